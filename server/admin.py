"""Operator routes under ``/admin``; the admin token only.

Entries and ``explain`` show each block's retention (``retain``, ``handoff``); ``/admin/prefetches``
shows the store's prefetch decisions.

Evictions, pins and migrations write an audit record (who, what, how many,
bytes) before they answer; the record's fsync runs in the I/O pool, like tier work.
"""

from __future__ import annotations

import math
import time
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from kvstore.engine.evict import coldest_first, evict
from kvstore.engine.store import StoreStats
from kvstore.errors import BlockNotFound, InvalidInput, MalformedRequest
from kvstore.keys import BlockHash
from server.data import eviction_answer, eviction_query
from server.errors import field_error
from server.requests import admin_caller, admin_only, parse_key, parse_keys, svc_of
from server.service import Service, json_body, parse_spec, parse_tokens, require

__all__ = ["router", "heat_histogram"]

router = APIRouter(prefix="/admin", dependencies=[Depends(admin_only)])
"""Every route: the admin token (401, then 403), before FastAPI validates a route's parameters."""


@router.post("/evict")
async def admin_evict(request: Request) -> dict:
    """Evict by keys, prefix (spec + tokens [+ namespace]), namespace, fingerprint, tier,
    ``older_than_s`` or ``watermark: {tier, frac}``; ``dry_run`` removes nothing."""
    svc, p = admin_caller(request)
    data = await json_body(request)
    known = {"keys", "prefix", "namespace", "fingerprint", "tier", "older_than_s", "watermark", "include_pinned",
             "limit", "dry_run"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MalformedRequest(f"body: unknown field(s) {unknown}; known: {sorted(known)}", field="body")
    query = eviction_query(data, svc.settings.max_tokens_per_request)
    dry_run = require(data, "dry_run", bool, default=False)
    result = await svc.run(evict, svc.store, query, dry_run=dry_run)
    record = await svc.run(svc.audit.record, p.name, "evict", scope="admin", dry_run=dry_run,
                           query=query.describe(), blocks=result.plan.blocks, bytes=result.plan.bytes,
                           removed_blocks=result.removed_blocks, removed_bytes=result.removed_bytes,
                           by_tier=result.plan.by_tier())
    svc.metrics.evicted.inc(result.removed_blocks)
    return eviction_answer(result, record["id"])


def _pin_keys(svc: Service, data: dict[str, Any]) -> list[BlockHash]:
    """Keys from ``{"keys": [...]}`` or ``{"spec", "tokens", "namespace"}`` (the stored prefix)."""
    if "keys" in data:
        return parse_keys(require(data, "keys", list))
    if "spec" in data:
        spec = parse_spec(require(data, "spec", dict))
        tokens = parse_tokens(require(data, "tokens", list), limit=svc.settings.max_tokens_per_request)
        ns = require(data, "namespace", str, default="default")
        return [b.key for b in svc.store.prefix_blocks(spec, tokens, ns) if b.entry is not None]
    raise MalformedRequest("body: give keys, or spec and tokens (and namespace)", field="body")


@router.post("/pin")
async def admin_pin(request: Request) -> dict:
    """Pin blocks (``ttl_s`` seconds, or until unpinned): placement will not move them down or out."""
    svc, p = admin_caller(request)
    data = await json_body(request)
    ttl = require(data, "ttl_s", (int, float), default=None)
    keys = await svc.run(_pin_keys, svc, data)
    n = await svc.run(svc.store.pin_keys, keys, ttl)
    nbytes = sum(e.size for k in keys if (e := svc.store.entry(k)) is not None)
    await svc.run(svc.audit.record, p.name, "pin", keys=len(keys), blocks=n, ttl_s=ttl, bytes=nbytes)
    return {"pinned": n, "requested": len(keys)}


@router.delete("/pin")
async def admin_unpin(request: Request) -> dict:
    svc, p = admin_caller(request)
    data = await json_body(request)
    keys = await svc.run(_pin_keys, svc, data)
    n = await svc.run(svc.store.unpin_keys, keys)
    await svc.run(svc.audit.record, p.name, "unpin", keys=len(keys), blocks=n)
    return {"unpinned": n, "requested": len(keys)}


@router.post("/migrate")
async def admin_migrate(request: Request) -> dict:
    """Move one block to a tier now: ``{"key": hex, "tier": name}``."""
    svc, p = admin_caller(request)
    data = await json_body(request)
    key = parse_key(require(data, "key", str))
    tier = require(data, "tier", str)
    before = svc.store.entry(key)
    if before is None:
        raise BlockNotFound(f"block {key.hex()} is not stored")
    try:
        moved = await svc.run(svc.store.migrate, key, tier)
    except InvalidInput as exc:
        raise field_error(exc, "tier") from exc
    after = svc.store.entry(key)
    await svc.run(svc.audit.record, p.name, "migrate", key=key.hex(), src=before.tier, dst=tier, moved=moved,
                  blocks=int(moved), bytes=before.size if moved else 0)
    return {"moved": moved, "tier": after.tier if after else None, "from": before.tier}


@router.get("/stats")
async def admin_stats(request: Request) -> dict:
    """``StoreStats``: store counters, ``reads_by_tier``, and each tier with its ``reads`` (the
    same figure) and ``backend_counters``; plus the service's own figures."""
    svc = svc_of(request)
    stats = await svc.run(svc.store.stats)
    out = stats.to_dict()
    out["service"] = {"uptime_s": time.time() - svc.started_s, "auth": svc.auth.enabled,
                      "staging": svc.staging.stats() if svc.staging else None,
                      "audit_records": svc.audit.list(0)[0],
                      "lmcache": svc.lmcache.stats() if svc.lmcache is not None else None}
    return out


@router.get("/connectors")
async def admin_connectors(request: Request) -> dict:
    """Engine connectors' counters by namespace and engine (``server.connectors``)."""
    return {"connectors": svc_of(request).connectors.summary()}


@router.get("/tiers")
async def admin_tiers(request: Request) -> dict:
    """Each tier: occupancy, state, watermarks, ``reads`` (block reads it served, on every read
    path: the store's ``reads_by_tier``, as ``/admin/stats`` and ``/metrics`` report them) and
    ``backend_counters`` (the tier's own operation counters, which a co-located read bypasses)."""
    svc = svc_of(request)

    def tiers() -> list[dict]:
        placement = svc.store.placement
        usage = placement.usage()
        policies = {p.name: p for p in placement.tiers}
        reads = svc.store.core.reads_by_tier()
        out = []
        for t in svc.store.tiers:
            s = StoreStats.tier_dict(t.stats(), reads)
            s["placement_bytes"] = usage.get(t.name)
            s["state"] = "unavailable" if s["details"].get("connected") == "no" else "ok"
            policy = policies.get(t.name)
            s["high_watermark_frac"] = policy.high_watermark_frac if policy else None
            s["low_watermark_frac"] = policy.low_watermark_frac if policy else None
            out.append(s)
        return out

    return {"tiers": await svc.run(tiers)}


_SORTS = {"heat", "size", "age", "last_access"}


@router.get("/entries")
async def admin_entries(request: Request, sort: str = Query("heat"), order: str = Query("desc"),
                        limit: int = Query(100, ge=1, le=10_000), offset: int = Query(0, ge=0),
                        namespace: str | None = None, tier: str | None = None,
                        min_heat_per_s: float | None = Query(None, ge=0),
                        max_heat_per_s: float | None = Query(None, ge=0),
                        min_age_s: float | None = Query(None, ge=0),
                        max_age_s: float | None = Query(None, ge=0)) -> dict:
    """Index entries, sorted by ``heat``, ``size``, ``age`` or ``last_access``, and paginated.

    Filters: ``namespace``, ``tier``, heat (reads per second now, as ``explain`` shows it)
    between ``min_heat_per_s`` and ``max_heat_per_s``, age (seconds since the write) between
    ``min_age_s`` and ``max_age_s``; ``total`` counts the entries that pass.
    """
    if sort not in _SORTS:
        raise InvalidInput(f"sort: must be one of {sorted(_SORTS)}, got {sort!r}", field="sort")
    if order not in ("asc", "desc"):
        raise InvalidInput(f"order: must be asc or desc, got {order!r}", field="order")
    svc = svc_of(request)

    def page() -> tuple[int, list[dict]]:
        now = svc.store.clock()  # the clock the entries' created_s were read from
        entries = [e for e in svc.store.entries()
                   if (namespace is None or e.namespace == namespace) and (tier is None or e.tier == tier)
                   and (min_age_s is None or now - e.created_s >= min_age_s)
                   and (max_age_s is None or now - e.created_s <= max_age_s)]
        if min_heat_per_s is not None or max_heat_per_s is not None:
            lo, hi = min_heat_per_s or 0.0, math.inf if max_heat_per_s is None else max_heat_per_s
            rates = {e.key: (svc.store.placement.explain(e.key) or {}).get("heat_per_s", 0.0) for e in entries}
            entries = [e for e in entries if lo <= rates[e.key] <= hi]
        if sort == "heat":
            entries = coldest_first(svc.store, entries)  # ascending heat
        else:
            entries.sort(key={"size": lambda e: e.size, "age": lambda e: -e.created_s,
                              "last_access": lambda e: e.last_access_s}[sort])
        if order == "desc":
            entries.reverse()
        rows = []
        for e in entries[offset:offset + limit]:
            info = svc.store.placement.explain(e.key) or {}
            rows.append({"key": e.key.hex(), "tier": e.tier, "size": e.size, "raw_bytes": e.raw_bytes,
                         "codec": e.codec.value, "namespace": e.namespace, "spec_fingerprint": e.spec_fp,
                         "depth": e.depth, "hits": e.hits, "age_s": now - e.created_s,
                         "last_access_age_s": now - e.last_access_s, "heat_score": info.get("heat_score"),
                         "heat_per_s": info.get("heat_per_s"), "pinned": info.get("pinned", False),
                         "retained": svc.store.placement.retention(e.key)})
        return len(entries), rows

    total, rows = await svc.run(page)
    return {"total": total, "offset": offset, "limit": limit, "sort": sort, "order": order, "entries": rows}


@router.get("/explain/{hex_key}")
async def admin_explain(hex_key: str, request: Request) -> dict:
    """Where a block is, what it is, how hot, its pins, its retention (``retained``: owner,
    priority, expires_in_s, or null) and its last moves."""
    svc = svc_of(request)
    key = parse_key(hex_key)
    info = await svc.run(_explain, svc, key)  # placement's lock: off the loop
    if info is None:
        raise BlockNotFound(f"block {hex_key} is not stored")
    return info


def _explain(svc: Service, key: BlockHash) -> dict[str, Any] | None:
    info = svc.store.explain(key)
    if info is not None:
        info.setdefault("retained", svc.store.placement.retention(key))
    return info


@router.get("/prefetches")
async def admin_prefetches(request: Request, limit: int = Query(100, ge=1, le=10_000),
                           namespace: str | None = None, trigger: str | None = None) -> dict:
    """The store's latest prefetch decisions, newest last: what brought blocks up (``trigger``:
    requested, hand-off, retain, read-ahead), why, from which tiers, and what moved. Kept apart from
    ``/admin/decisions``, whose records are the client planner's transfers."""
    svc = svc_of(request)
    # Filter before the limit: a namespace's few prefetches are not pushed out by others'.
    rows = [d for d in svc.store.prefetcher.log(10_000)
            if (namespace is None or d.get("namespace") == namespace) and (trigger is None or d.get("trigger") == trigger)]
    retained = await svc.run(svc.store.placement.retained_bytes)  # placement's lock: off the loop
    return {"prefetches": rows[-limit:], "total": len(rows), "retained_bytes": retained}


@router.get("/audit")
async def admin_audit(request: Request, limit: int = Query(100, ge=1, le=10_000), offset: int = Query(0, ge=0),
                      action: str | None = None) -> dict:
    total, records = svc_of(request).audit.list(limit, offset, action)
    return {"total": total, "records": records}


@router.get("/moves")
async def admin_moves(request: Request, limit: int = Query(100, ge=1, le=10_000)) -> dict:
    """Placement's latest moves, newest last."""
    svc = svc_of(request)
    return {"moves": await svc.run(svc.store.moves, limit)}  # placement's lock: off the loop


@router.get("/heat")
async def admin_heat(request: Request, bins: int = Query(12, ge=1, le=100)) -> dict:
    """A histogram of heat (reads per second now) by tier: ``bins`` log-spaced bins between
    the lowest and highest rate above zero, plus ``zero`` for entries that read as 0."""
    svc = svc_of(request)
    rates, total = await svc.run(svc.store.placement.heat_rates)
    return heat_histogram(rates, [t.name for t in svc.store.tiers], bins, total)


def heat_histogram(rates: list[tuple[str, float]], tiers: list[str], bins: int, total: int) -> dict:
    """``{"bins": [{"lo", "hi", "counts": {tier: n}}], "zero": {tier: n}, "entries", "sampled"}``;
    counts are scaled up when ``rates`` is a sample of ``total`` entries."""
    scale = total / len(rates) if rates else 1.0
    zero = dict.fromkeys(tiers, 0)
    positive = [(t, r) for t, r in rates if r > 0 and math.isfinite(r)]
    for t, r in rates:
        if not r > 0:
            zero[t] = zero.get(t, 0) + 1
    out_bins: list[dict] = []
    if positive:
        lo, hi = math.log10(min(r for _, r in positive)), math.log10(max(r for _, r in positive))
        width = (hi - lo) / bins or 1.0  # one rate for all: a single bin around it
        n = bins if hi > lo else 1
        counts = [dict.fromkeys(tiers, 0) for _ in range(n)]
        for t, r in positive:
            i = min(n - 1, int((math.log10(r) - lo) / width))
            counts[i][t] = counts[i].get(t, 0) + 1
        for i, c in enumerate(counts):
            out_bins.append({"lo": 10 ** (lo + i * width), "hi": 10 ** (lo + (i + 1) * width),
                             "counts": {t: round(v * scale) for t, v in c.items()}})
    return {"bins": out_bins, "zero": {t: round(v * scale) for t, v in zero.items()}, "entries": total,
            "sampled": len(rates) < total, "unit": "reads per second"}


@router.get("/history")
async def admin_history(request: Request, limit: int = Query(720, ge=1, le=10_000)) -> dict:
    """The hit ratio over time, overall and by tier (``server.history``): one point per
    sampling interval, oldest first, the last running to now."""
    history = svc_of(request).history
    return {"interval_s": history.interval_s, "points": history.points(limit)}
