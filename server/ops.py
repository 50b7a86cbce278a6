"""Health, readiness and metrics: no auth, so probes and scrapers need no token.

``/readyz`` asks every tier for its stats (off the loop, with a deadline). A
tier that answers with ``connected: no`` or raises is *unavailable*; the store
still serves from the others, so the answer is 200 ``degraded`` with the
reasons. Only a closed store, or no tier left, is 503.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import KVStoreError
from server.requests import svc_of

__all__ = ["router"]

router = APIRouter()
_PROBE_TIMEOUT_S = 3.0


@router.get("/healthz")
async def healthz() -> dict:
    """Liveness: the process answers."""
    return {"status": "ok"}


def _tier_states(store) -> list[dict]:
    states = []
    for tier in store.tiers:
        state = {"name": tier.name, "kind": getattr(tier, "kind", None), "state": "ok"}
        try:
            stats = tier.stats()
            state["kind"] = stats.kind
            if stats.details.get("connected") == "no":
                state.update(state="unavailable", reason=stats.details.get("error", "not connected"))
        except KVStoreError as exc:
            state.update(state="unavailable", reason=f"{type(exc).__name__}: {exc}")
        states.append(state)
    return states


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    svc = svc_of(request)
    if svc.store.core.closed:
        return JSONResponse({"status": "unavailable", "reasons": ["the store is closed"], "tiers": []}, 503)
    try:
        states = await asyncio.wait_for(svc.run(_tier_states, svc.store), _PROBE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return JSONResponse({"status": "degraded", "tiers": [],
                             "reasons": [f"tier probe did not answer within {_PROBE_TIMEOUT_S} s"]}, 200)
    reasons = [f"tier {s['name']} unavailable: {s['reason']}" for s in states if s["state"] != "ok"]
    if len(reasons) == len(states):
        return JSONResponse({"status": "unavailable", "tiers": states, "reasons": reasons}, 503)
    return JSONResponse({"status": "degraded" if reasons else "ok", "tiers": states, "reasons": reasons}, 200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    svc = svc_of(request)
    body = await svc.run(generate_latest, svc.metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
