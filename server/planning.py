"""Planner routes: probes, the policies clients run under, their decision reports, the canary.

Clients plan their own transfers (``client_sdk.planning``); the server is where
their decisions meet:

- ``GET /v1/probe?bytes=N``: N bytes of filler, so a client can time this link (at most 16 MiB).
- ``GET /v1/policy``: the baseline policy and the canary candidate with its traffic share.
- ``POST /v1/decisions``: finished decision records, in batches; they feed the
  ring ``GET /admin/decisions`` serves, the actual/predicted histogram and the
  decision counters in ``/metrics``, and the canary judge.
- ``GET /admin/decisions``: the newest records, with the prediction error of those that
  match (``kvstore.decisions.prediction_error``: its ``definition`` comes with it).
- ``GET /admin/policy``: both policies with each version's p50/p95 transfer time,
  prediction error (the same definition, over the version's records) and sample count,
  and the rollbacks so far.
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
from typing import Any, Callable

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from kvstore.decisions import REASONS, prediction_error
from kvstore.errors import InvalidInput, MalformedRequest
from kvstore.planner import RECOMPUTE
from kvstore.policy import CODECS, MEDIA, CanaryJudge, Policy, PolicySet
from server.errors import field_error
from server.requests import admin_caller, admin_only, authenticate, authenticated, caller, svc_of
from server.service import Service, json_body, require

__all__ = ["router", "PlanState"]

log = logging.getLogger("kvstore.server")

router = APIRouter()
_MAX_PROBE_BYTES = 16 << 20
_ZEROS = bytes(_MAX_PROBE_BYTES)
_MAX_REPORT = 1024
_NUMBERS = ("time_s", "bytes", "tokens", "policy_version")
_OPTIONAL_NUMBERS = ("predicted_s", "actual_s", "actual_bytes", "predicted_actual_s", "slo_s", "free_bytes")


_OPTIONS = frozenset({RECOMPUTE} | set(MEDIA) | {f"{m}+{c}" for m in MEDIA for c in CODECS if c != "raw"})
"""Choices a label may name; anything else a client reports is counted as "other" (series stay few)."""


class PlanState:
    """The policies, the decision rings and the canary judge of one server.

    Each tenant has its own ring of ``ring`` records, so one tenant's reports
    cannot push another's out of ``/admin/decisions``.
    """

    def __init__(self, ring: int = 1024) -> None:
        self.policies = PolicySet()
        self.judge = CanaryJudge()
        self.rings: dict[str, deque[dict[str, Any]]] = {}
        self.ring = ring
        self.rollbacks: list[dict[str, Any]] = []
        self.received = 0

    def decisions(self) -> list[dict[str, Any]]:
        """Every tenant's kept records, in the order they arrived."""
        # Snapshots: ``/metrics`` reads this from a pool thread while the loop appends to the rings
        return sorted((d for ring in list(self.rings.values()) for d in tuple(ring)), key=lambda d: d["seq"])

    def record(self, svc: Service, who: str, namespace: str, records: list[dict[str, Any]]) -> str | None:
        """Take a batch of checked reports; returns the reason when it rolled the candidate back.

        Only records made under the policy this namespace is routed to count for
        the canary: a tenant cannot judge a version it does not run.
        """
        ring = self.rings.setdefault(who, deque(maxlen=self.ring))
        routed = self.policies.for_key(namespace).version
        for d in records:
            self.received += 1
            d.update(tenant=who, namespace=namespace, seq=self.received)
            ring.append(d)
            choice = d["choice"] if d["choice"] in _OPTIONS else "other"
            svc.metrics.decisions.labels(d["op"], choice).inc()
            # An exploration is a measurement, not the policy's choice: a candidate policy that adds
            # a medium must not be rolled back for the tries it costs, nor their fit-only predictions
            # weigh on the error histogram.
            if d["error"] or d["actual_s"] is None or choice in (RECOMPUTE, "other") or d["explore"]:
                continue
            ratio = d["ratio"]
            if ratio is not None:
                svc.metrics.prediction.labels(choice.partition("+")[0]).observe(ratio)
            if d["policy_version"] == routed:
                self.judge.observe(routed, d["actual_s"])
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
        records = self.decisions()
        summaries = {}
        for v in sorted(versions):
            error = prediction_error(d for d in records if d["policy_version"] == v)
            # median_abs_error: the same figure, under the name dashboards and scripts read before.
            summaries[str(v)] = {**self.judge.summary(v), "prediction_error": error,
                                 "median_abs_error": error["median"]}
        return {**self.policies.to_dict(), "versions": summaries,
                "canary": {"min_samples": self.judge.min_samples,
                           "rollback_margin_frac": self.judge.rollback_margin_frac},
                "rollbacks": list(self.rollbacks), "decisions_received": self.received}


def plan_state(svc: Service) -> PlanState:
    state = getattr(svc, "planning", None)
    if state is None:  # created on first use, on the event loop: no race
        state = svc.planning = PlanState()  # type: ignore[attr-defined]
        svc.metrics.read_decisions(state.decisions)  # the prediction-error gauge reads the same records
    return state


def prefetch_policy(svc: Service) -> Callable[[str], tuple[int, bool]]:
    """What the store asks before it prefetches on its own (``KVStore.policy_for``): the version
    of the policy a namespace is routed to and whether that policy lets it. A candidate's share
    of namespaces runs the candidate's rule, and a rollback takes it back, as for transfers."""
    state = plan_state(svc)

    def policy_for(namespace: str) -> tuple[int, bool]:
        policy = state.policies.for_key(namespace)
        return policy.version, policy.prefetch
    return policy_for


@router.get("/v1/probe", dependencies=[Depends(authenticated)])  # 401 before a bad ``bytes``' 422
async def probe(request: Request, nbytes: int = Query(0, alias="bytes", ge=0, le=_MAX_PROBE_BYTES)) -> Response:
    """Filler bytes for a client timing this link (auth as any data route)."""
    return Response(memoryview(_ZEROS)[:nbytes], media_type="application/octet-stream")


@router.get("/v1/policy")
async def get_policy(request: Request) -> dict:
    svc, _ = authenticate(request)
    return plan_state(svc).policies.to_dict()


def _number(d: dict, name: str, where: str, *, optional: bool, integer: bool = False) -> Any:
    v = d.get(name)
    if v is None and optional:
        return None
    if (isinstance(v, bool) or not isinstance(v, int if integer else (int, float))
            or not math.isfinite(v) or v < 0):
        kind = "a non-negative integer" if integer else "a finite number >= 0"
        raise MalformedRequest(f"{where}.{name} must be {kind}{' or null' if optional else ''}", field=f"{where}.{name}")
    return v


def _text(d: dict, name: str, where: str, limit: int) -> str | None:
    v = d.get(name)
    if v is not None and (not isinstance(v, str) or len(v) > limit):
        raise MalformedRequest(f"{where}.{name} must be a string of at most {limit} characters", field=f"{where}.{name}")
    return v


def _check_record(i: int, d: Any) -> dict[str, Any]:
    """A checked copy of one reported record: known fields only, types and ranges enforced."""
    where = f"decisions[{i}]"
    if not isinstance(d, dict):
        raise MalformedRequest(f"{where} must be an object", field=where)
    if d.get("op") not in ("get", "put") or not isinstance(d.get("choice"), str) or len(d["choice"]) > 64:
        raise MalformedRequest(f"{where}: op must be get or put and choice a short string", field=where)
    out: dict[str, Any] = {"op": d["op"], "choice": d["choice"]}
    for name in ("time_s", "bytes", "tokens"):
        out[name] = _number(d, name, where, optional=False)
    out["policy_version"] = _number(d, "policy_version", where, optional=False, integer=True)
    for name in ("predicted_s", "actual_s", "actual_bytes", "predicted_actual_s", "slo_s", "free_bytes"):
        out[name] = _number(d, name, where, optional=True)
    out["id"] = _number(d, "id", where, optional=True, integer=True)
    out["explore"] = d.get("explore") is True
    out["learnt"] = _number(d, "learnt", where, optional=True, integer=True)
    for name, limit in (("reason", 2000), ("locality", 32), ("error", 2000), ("path", 32)):
        out[name] = _text(d, name, where, limit)
    code = d.get("reason_code")
    out["reason_code"] = code if isinstance(code, str) and code in REASONS else None  # none: an older client
    cands = d.get("candidates", [])
    if not isinstance(cands, list) or len(cands) > 32:
        raise MalformedRequest(f"{where}.candidates must be a list of at most 32", field=f"{where}.candidates")
    out["candidates"] = []
    for j, c in enumerate(cands):
        cw = f"{where}.candidates[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("option"), str) or len(c["option"]) > 64:
            raise MalformedRequest(f"{cw} must be an object with a short option string", field=cw)
        out["candidates"].append({"option": c["option"], "predicted_s": _number(c, "predicted_s", cw, optional=True),
                                  "feasible": bool(c.get("feasible", True)), "why": _text(c, "why", cw, 500),
                                  "queued_bytes": _number(c, "queued_bytes", cw, optional=True, integer=True),
                                  "wait_s": _number(c, "wait_s", cw, optional=True),
                                  "path": _text(c, "path", cw, 32),
                                  "learnt": _number(c, "learnt", cw, optional=True, integer=True)})
    # The server works the ratio out itself rather than trusting the client's.
    actual, predicted = out["actual_s"], out["predicted_actual_s"]
    out["ratio"] = actual / predicted if actual and predicted else None
    return out


@router.post("/v1/decisions")
async def report_decisions(request: Request) -> dict:
    """A client's finished decisions; the canary is judged on them."""
    svc, p, ns = caller(request)
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


admin_router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])


@admin_router.get("/decisions")
async def admin_decisions(request: Request, limit: int = Query(100, ge=1, le=4096), op: str | None = None,
                          choice: str | None = None, namespace: str | None = None) -> dict:
    """The newest decision records (oldest first), optionally filtered.

    The clients' transfer decisions by default; ``op=prefetch`` gives the server's own prefetch
    decisions instead (``KVStore.prefetcher.log``: trigger as the choice, and the reason), which
    ``/admin/prefetches`` and the dashboard show too."""
    svc = svc_of(request)
    state = plan_state(svc)
    if op == "prefetch":
        found = [{**d, "choice": d["trigger"]} for d in svc.store.prefetcher.log(4096)]
    else:
        found = state.decisions()
    rows = [d for d in found if (op is None or d["op"] == op) and (choice is None or d["choice"] == choice)
            and (namespace is None or d.get("namespace") == namespace)]
    return {"decisions": rows[-limit:], "total": len(rows), "received": state.received,
            "prediction_error": prediction_error(rows)}


@admin_router.get("/policy")
async def admin_policy(request: Request) -> dict:
    return plan_state(svc_of(request)).view()


@admin_router.post("/policy")
async def admin_set_policy(request: Request) -> dict:
    """Start, move, promote or roll back a canary, or replace the baseline."""
    svc, p = admin_caller(request)
    state = plan_state(svc)
    data = await json_body(request)
    action = require(data, "action", str)
    ps = state.policies
    try:
        if action == "candidate":
            cand = Policy.from_dict(require(data, "policy", dict))
            settings = {k: data.get(k) for k in ("min_samples", "rollback_margin_frac")}
            state.judge.check(**settings)  # all checked before anything changes
            policies = PolicySet(ps.baseline, cand, data.get("fraction", 0.1))
            state.policies = policies
            state.judge.forget(cand.version)
            state.judge.configure(**settings)
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
