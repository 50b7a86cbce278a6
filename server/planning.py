"""Planner routes: probes, the policies clients run under, their decision reports, the canary.

Clients plan their own transfers (``client_sdk.planning``); the server is where
their decisions meet:

- ``GET /v1/probe?bytes=N``: N bytes of filler, so a client can time this link (at most 16 MiB).
- ``GET /v1/policy``: the baseline policy and the canary candidate with its traffic share.
- ``POST /v1/decisions``: finished decision records, in batches; they feed the
  ring ``GET /admin/decisions`` serves, the prediction-error histogram and the
  decision counters in ``/metrics``, and the canary judge.
- ``GET /admin/policy``: both policies with each version's p50/p95 transfer time,
  prediction error and sample count, and the rollbacks so far.
- ``POST /admin/policy``: ``{"action": "candidate", "policy": {...}, "fraction": 0.1}``
  starts a canary; ``"promote"`` makes the candidate the baseline; ``"rollback"``
  drops it; ``"baseline"`` replaces the baseline outright; ``"fraction"`` moves the share.

A candidate whose p95 transfer time is worse than the baseline's by
``rollback_margin_frac`` over ``min_samples`` transfers of each is rolled back
on the next report, and the rollback is logged (audit log and ``/admin/policy``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from client_sdk.protocol import MalformedRequest
from kvstore.errors import InvalidInput
from kvstore.policy import CanaryJudge, Policy, PolicySet
from server.admin import admin
from server.auth import Principal
from server.data import principal, svc_of
from server.errors import field_error
from server.service import Service, json_body, require

__all__ = ["router", "PlanState"]

log = logging.getLogger("kvstore.server")

router = APIRouter()
_MAX_PROBE_BYTES = 16 << 20
_ZEROS = bytes(_MAX_PROBE_BYTES)
_MAX_REPORT = 1024
_NUMBERS = ("time_s", "bytes", "tokens", "policy_version")
_OPTIONAL_NUMBERS = ("predicted_s", "actual_s", "actual_bytes", "predicted_actual_s", "slo_s", "free_bytes")


class PlanState:
    """The policies, the decision ring and the canary judge of one server."""

    def __init__(self, ring: int = 4096) -> None:
        self.policies = PolicySet()
        self.judge = CanaryJudge()
        self.decisions: deque[dict[str, Any]] = deque(maxlen=ring)
        self.rollbacks: list[dict[str, Any]] = []
        self.received = 0

    def record(self, svc: Service, who: str, namespace: str, records: list[dict[str, Any]]) -> str | None:
        """Take a batch of reports; returns the reason when it rolled the candidate back."""
        for d in records:
            d["tenant"], d["namespace"] = who, namespace
            self.decisions.append(d)
            self.received += 1
            choice = d["choice"]
            svc.metrics.decisions.labels(d["op"], choice).inc()
            if d.get("error") or d.get("actual_s") is None or choice == "recompute":
                continue
            ratio = d.get("ratio")
            if isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0:
                svc.metrics.prediction.labels(choice.partition("+")[0]).observe(ratio)
            self.judge.observe(d["policy_version"], d["actual_s"],
                               abs(ratio - 1.0) if isinstance(ratio, (int, float)) else None)
        cand = self.policies.candidate
        if cand is None:
            return None
        why = self.judge.verdict(self.policies.baseline.version, cand.version)
        if why is not None:
            self.rollback("auto", why)
        return why

    def rollback(self, by: str, why: str) -> dict[str, Any]:
        cand = self.policies.candidate
        entry = {"time_s": time.time(), "by": by, "version": None if cand is None else cand.version, "why": why,
                 "summary": None if cand is None else self.judge.summary(cand.version)}
        self.policies = PolicySet(self.policies.baseline)
        self.rollbacks.append(entry)
        del self.rollbacks[:-100]
        log.warning("kvstore: planner policy v%s rolled back (%s): %s", entry["version"], by, why)
        return entry

    def view(self) -> dict[str, Any]:
        versions = {self.policies.baseline.version}
        if self.policies.candidate is not None:
            versions.add(self.policies.candidate.version)
        return {**self.policies.to_dict(), "versions": {str(v): self.judge.summary(v) for v in sorted(versions)},
                "canary": {"min_samples": self.judge.min_samples,
                           "rollback_margin_frac": self.judge.rollback_margin_frac},
                "rollbacks": list(self.rollbacks), "decisions_received": self.received}


def plan_state(svc: Service) -> PlanState:
    state = getattr(svc, "planning", None)
    if state is None:  # created on first use, on the event loop: no race
        state = svc.planning = PlanState()  # type: ignore[attr-defined]
    return state


@router.get("/v1/probe")
async def probe(request: Request, p: Principal = Depends(principal),
                nbytes: int = Query(0, alias="bytes", ge=0, le=_MAX_PROBE_BYTES)) -> Response:
    """Filler bytes for a client timing this link (auth as any data route)."""
    return Response(memoryview(_ZEROS)[:nbytes], media_type="application/octet-stream")


@router.get("/v1/policy")
async def get_policy(request: Request, p: Principal = Depends(principal)) -> dict:
    return plan_state(svc_of(request)).policies.to_dict()


def _check_record(i: int, d: Any) -> dict[str, Any]:
    where = f"decisions[{i}]"
    if not isinstance(d, dict):
        raise MalformedRequest(f"{where} must be an object")
    if d.get("op") not in ("get", "put") or not isinstance(d.get("choice"), str) or len(d["choice"]) > 64:
        raise MalformedRequest(f"{where}: op must be get or put and choice a short string")
    for name in _NUMBERS:
        v = d.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise MalformedRequest(f"{where}.{name} must be a finite number")
    for name in _OPTIONAL_NUMBERS:
        v = d.get(name)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)):
            raise MalformedRequest(f"{where}.{name} must be a finite number or null")
    if not isinstance(d.get("candidates", []), list) or len(d.get("candidates", [])) > 32:
        raise MalformedRequest(f"{where}.candidates must be a list of at most 32")
    for name in ("reason", "locality", "error"):
        if d.get(name) is not None and (not isinstance(d[name], str) or len(d[name]) > 2000):
            raise MalformedRequest(f"{where}.{name} must be a string of at most 2000 characters")
    return d


@router.post("/v1/decisions")
async def report_decisions(request: Request, p: Principal = Depends(principal)) -> dict:
    """A client's finished decisions; the canary is judged on them."""
    svc = svc_of(request)
    ns = svc.namespace(request, p)
    records = require(await json_body(request), "decisions", list)
    if len(records) > _MAX_REPORT:
        raise field_error(InvalidInput(f"at most {_MAX_REPORT} decisions a report, got {len(records)}"), "decisions")
    checked = [_check_record(i, d) for i, d in enumerate(records)]
    state = plan_state(svc)
    rolled = state.record(svc, p.name, ns, checked)
    if rolled is not None:
        svc.metrics.rollbacks.labels("auto").inc()
        await svc.run(svc.audit.record, "planner", "policy-rollback", why=rolled)
    return {"accepted": len(checked), "policies": state.policies.to_dict()}


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])


@admin_router.get("/decisions")
async def admin_decisions(request: Request, limit: int = Query(100, ge=1, le=4096), op: str | None = None,
                          choice: str | None = None, namespace: str | None = None) -> dict:
    """The newest decision records (oldest first), optionally filtered."""
    state = plan_state(svc_of(request))
    rows = [d for d in state.decisions if (op is None or d["op"] == op) and (choice is None or d["choice"] == choice)
            and (namespace is None or d.get("namespace") == namespace)]
    return {"decisions": rows[-limit:], "total": len(rows), "received": state.received}


@admin_router.get("/policy")
async def admin_policy(request: Request) -> dict:
    return plan_state(svc_of(request)).view()


@admin_router.post("/policy")
async def admin_set_policy(request: Request, p: Principal = Depends(principal)) -> dict:
    """Start, move, promote or roll back a canary, or replace the baseline."""
    svc = svc_of(request)
    state = plan_state(svc)
    data = await json_body(request)
    action = require(data, "action", str)
    ps = state.policies
    try:
        if action == "candidate":
            cand = Policy.from_dict(require(data, "policy", dict))
            state.policies = PolicySet(ps.baseline, cand, data.get("fraction", 0.1))
            state.judge.forget(cand.version)
            for name in ("min_samples", "rollback_margin_frac"):
                if name in data:
                    value = data[name]
                    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                        raise InvalidInput(f"{name} must be a non-negative number")
                    setattr(state.judge, name, int(value) if name == "min_samples" else float(value))
        elif action == "fraction":
            if ps.candidate is None:
                raise InvalidInput("there is no candidate to give traffic to")
            state.policies = PolicySet(ps.baseline, ps.candidate, data.get("fraction"))
        elif action == "promote":
            if ps.candidate is None:
                raise InvalidInput("there is no candidate to promote")
            state.policies = PolicySet(ps.candidate)
        elif action == "rollback":
            if ps.candidate is None:
                raise InvalidInput("there is no candidate to roll back")
            state.rollback(p.name, str(data.get("why", "rolled back by an operator"))[:500])
            svc.metrics.rollbacks.labels("operator").inc()
        elif action == "baseline":
            base = Policy.from_dict(require(data, "policy", dict))
            if ps.candidate is not None and ps.candidate.version == base.version:
                raise InvalidInput(f"version {base.version} is the candidate's; promote it instead")
            state.policies = PolicySet(base, ps.candidate, ps.fraction)
        else:
            raise InvalidInput(f"action must be candidate, fraction, promote, rollback or baseline, got {action!r}")
    except InvalidInput as exc:
        raise field_error(exc, "policy" if action in ("candidate", "baseline") else "action") from exc
    await svc.run(svc.audit.record, p.name, f"policy-{action}", policies=state.policies.to_dict())
    return state.view()


router.include_router(admin_router)
