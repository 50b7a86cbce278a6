"""KV-level data routes under ``/v1``: put, get, lookup, delete, tenant eviction,
and the co-located (shared-memory) forms of put and get.

Every route works in one namespace, from the ``X-KV-Namespace`` header
(``default`` when absent), which the caller's token must grant.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from kvstore._version import __version__
from kvstore.engine.evict import EvictionQuery, evict
from kvstore.errors import InvalidInput, InvalidKV, MalformedRequest, PayloadTooLarge
from kvstore.wire.rest import (H_DTYPE, H_HINT, H_MEDIUM, H_SHAPE, H_TOKENS, KV_BLOCKS_MEDIA, KV_MEDIA, MAX_TOUCH_KEYS,
                               PUT_MEDIA, RESERVE_NO_ROOM, RESERVE_OFF, parse_kv_head)
from server.auth import Principal
from server.block_puts import put_blocks
from server.colocated import handle_json
from server.errors import field_error, raise_named
from server.requests import (agent_of, authenticate, caller, charge_blocks, head_tokens, media_of, parse_keys,
                             spec_and_tokens)
from server.service import Service, json_body, kv_view, parse_spec, parse_tokens, released, require

__all__ = ["router", "eviction_query", "eviction_answer"]

router = APIRouter()


@router.get("/v1/info")
async def info(request: Request) -> dict:
    """What a client needs to pick its medium; co-location details only when offered."""
    svc, p = authenticate(request)
    colocated = None
    if svc.staging is not None and svc.shm is not None:
        colocated = {"host_id": svc.host_id, "segment": svc.shm.segment, "tier": svc.shm.name,
                     "staging_segment": svc.staging.segment,
                     "reserved_puts": svc.reservations_off() is None, "commit_socket": svc.commit_socket}
    return {"service": "kvstore", "version": __version__, "host_id": svc.host_id, "colocated": colocated,
            "tiers": [t.name for t in svc.store.tiers], "auth": svc.auth.enabled, "tenant": p.name,
            "namespaces": None if p.namespaces is None else sorted(p.namespaces),
            "max_body_bytes": svc.settings.max_body_bytes, "media": dict(svc.offers),
            "put_media": list(PUT_MEDIA), "kv_events": bool(svc.settings.kv_events_endpoint)}


@router.post("/v1/kv/put")
async def kv_put(request: Request) -> JSONResponse:
    """Store the KV of every full block. Body: a KV body, token-major (``KV_MEDIA``) or
    block-major (``KV_BLOCKS_MEDIA``: ``server.block_puts``), ``kvstore.wire.rest``."""
    svc, p, ns = caller(request)
    media = media_of(request)
    if media == KV_BLOCKS_MEDIA:  # straight into reserved slots where the top tier takes them
        stored, nbytes = await put_blocks(request, svc, p, ns, reserving=svc.reservations_off() is None, put=_put)
        svc.metrics.transfer.labels("in", "http").inc(nbytes)
        return JSONResponse({"stored_tokens": stored})
    if media != KV_MEDIA:
        raise MalformedRequest(f"content-type: must be {KV_MEDIA} or {KV_BLOCKS_MEDIA}", field="content-type")
    buf, n = await svc.read_body(request)
    with released(svc.buffers, buf):
        head = parse_kv_head(memoryview(buf)[:n])
        if n != head.total:
            raise MalformedRequest(f"body: {n} bytes, the header describes {head.total}", field="body")
        tokens = head_tokens(svc, buf, head)
        spec = parse_spec(head.spec)
        kv = kv_view(buf, head.kv_at, spec, head.kv_tokens)
        stored = await svc.run(_put, svc, p, ns, spec, tokens, kv, agent_of(request))
    svc.metrics.transfer.labels("in", "http").inc(head.total - head.kv_at)
    return JSONResponse({"stored_tokens": stored})


def _put(svc: Service, p: Principal, ns: str, spec, tokens, kv, agent: str | None = None) -> int:
    charge_blocks(svc, p, ns, spec, tokens)
    try:
        return svc.store.put_kv(spec, tokens, kv, ns, agent=agent)
    except InvalidKV as exc:  # fewer KV tokens than the full blocks need, or NaN/Inf for int8
        raise field_error(exc, "kv") from exc


@router.post("/v1/kv/get")
async def kv_get(request: Request) -> Response:
    """The KV of the longest stored prefix, as raw bytes ``[L, 2, H, n, D]``."""
    svc, _, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    # Decode into a pooled buffer that goes back to the pool once the response is sent:
    # a fresh 32 MiB tensor per get spent most of the request faulting its pages in.
    want = spec.full_blocks(len(tokens)) * spec.block_tokens
    nbytes = want * spec.bytes_per_token
    buf = svc.buffers.acquire(nbytes) if nbytes else None
    try:
        out = None if buf is None else \
            torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(spec.torch_dtype).view(spec.kv_shape(want))
        hints: list[str] = []  # the store's, when nothing is found: sent as X-KV-Hint
        kv, n = await svc.run(svc.store.get_kv, spec, tokens, ns, out=out, agent=agent_of(request), hints=hints)
    except BaseException:
        if buf is not None:
            svc.buffers.release(buf)
        raise
    if buf is not None and n == want:  # the whole buffer is the answer, already contiguous
        body = memoryview(buf)[:nbytes]
        done = BackgroundTask(svc.buffers.release, buf)
    else:  # a shorter prefix is a strided view of the buffer: copy it out and give the buffer back
        body = memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy())
        done = None
        if buf is not None:
            svc.buffers.release(buf)
    svc.metrics.transfer.labels("out", "http").inc(len(body))
    headers = {H_TOKENS: str(n), H_SHAPE: ",".join(map(str, kv.shape)), H_DTYPE: spec.dtype, H_MEDIUM: "http"}
    if hints:
        headers[H_HINT] = hints[0]
    return Response(body, media_type=KV_MEDIA, background=done, headers=headers)


@router.post("/v1/lookup")
async def lookup(request: Request) -> JSONResponse:
    """The longest stored prefix: its token count, and each block's key and tier; and how much of
    it sits on durable tiers (``durable_tokens``), which ``put_kv(..., durable=True)`` checks
    with ``?sync=1``: durable tiers' group commits first (``Tier.sync``).
    ``hint`` when nothing is found but the tokens are stored under another spec of the model."""
    svc, _, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    hints: list[str] = []
    if request.query_params.get("sync") == "1":  # a durable put's check: the group commit first
        await svc.run(svc.store.core.sync_durable)
    blocks = await svc.run_index(svc.store.prefix_blocks, spec, tokens, ns, hints=hints)
    return JSONResponse({"tokens": len(blocks) * spec.block_tokens, "block_tokens": spec.block_tokens,
                         "durable_tokens": svc.store.frames.durable_count(blocks) * spec.block_tokens,
                         "blocks": [{"key": b.key.hex(), "tier": b.tier} for b in blocks], **_hint(hints)})


def _hint(hints: list[str]) -> dict[str, str]:
    """A JSON answer's ``hint`` field, when the store gave one."""
    return {"hint": hints[0]} if hints else {}


@router.post("/v1/kv/delete")
async def kv_delete(request: Request) -> dict:
    """Delete the stored blocks of a token sequence (in this namespace)."""
    svc, _, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    return {"deleted_blocks": await svc.run(svc.store.delete, spec, tokens, ns)}


def eviction_query(data: dict[str, Any], max_tokens: int | None = None, **scope: Any) -> EvictionQuery:
    """An ``EvictionQuery`` from a JSON body; errors name the field. ``max_tokens``: the most ids
    ``prefix.tokens`` may hold (``max_tokens_per_request``)."""
    keys = require(data, "keys", list, default=None)
    prefix = require(data, "prefix", dict, default=None)
    watermark = require(data, "watermark", dict, default=None)
    fields: dict[str, Any] = {
        "namespace": require(data, "namespace", str, default=None),
        "fingerprint": require(data, "fingerprint", str, default=None),
        "tier": require(data, "tier", str, default=None),
        "older_than_s": require(data, "older_than_s", (int, float), default=None),
        "include_pinned": require(data, "include_pinned", bool, default=False),
        "limit": require(data, "limit", int, default=None),
    }
    if keys is not None:
        fields["keys"] = tuple(parse_keys(keys))
    if prefix is not None:
        fields["prefix_spec"] = parse_spec(require(prefix, "spec", dict), "prefix.spec")
        fields["prefix_tokens"] = parse_tokens(require(prefix, "tokens", list), "prefix.tokens", max_tokens)
        if prefix.get("namespace") is not None:
            fields["namespace"] = require(prefix, "namespace", str)
    if watermark is not None:
        fields["watermark_frac"] = require(watermark, "frac", (int, float))
        fields["tier"] = require(watermark, "tier", str, default=fields["tier"])
    fields.update(scope)
    return EvictionQuery(**fields)


def eviction_answer(result: Any, audit_id: int | None, show_keys: int = 1000) -> dict:
    plan = result.plan
    return {"dry_run": result.dry_run, "blocks": plan.blocks, "bytes": plan.bytes,
            "removed_blocks": result.removed_blocks, "removed_bytes": result.removed_bytes,
            "skipped_pinned": plan.skipped_pinned, "by_tier": plan.by_tier(),
            "keys": result.keys[:show_keys], "keys_truncated": len(result.keys) > show_keys, "audit_id": audit_id}


@router.post("/v1/evict")
async def tenant_evict(request: Request) -> dict:
    """Evict this namespace's blocks by the admin selectors; another tenant's are out of reach."""
    svc, p, ns = caller(request)
    data = await json_body(request)
    if data.get("namespace") not in (None, ns):
        raise MalformedRequest("namespace: a tenant evicts in its request namespace (X-KV-Namespace) only",
                               field="namespace")
    query = eviction_query(data, svc.settings.max_tokens_per_request, namespace=ns,
                           namespaces_allowed=frozenset({ns}), include_pinned=False)
    dry_run = require(data, "dry_run", bool, default=False)
    result = await svc.run(evict, svc.store, query, dry_run=dry_run)
    record = await svc.run(svc.audit.record, p.name, "evict", scope="tenant", namespace=ns, dry_run=dry_run,
                           query=query.describe(), blocks=result.plan.blocks, bytes=result.plan.bytes,
                           removed_blocks=result.removed_blocks, removed_bytes=result.removed_bytes)
    svc.metrics.evicted.inc(result.removed_blocks)
    return eviction_answer(result, record["id"])


# -- co-located: shared memory ---------------------------------------------------------------


@router.post("/v1/kv/handles")
async def kv_handles(request: Request) -> JSONResponse:
    """Slot handles of the longest stored prefix, for a client that reads the shm arena itself.

    Blocks outside the shm tier come with a null handle; the client fetches those
    with ``POST /v1/blocks/get``.
    """
    svc, _, ns = caller(request, colocated=True)
    spec, tokens = await spec_and_tokens(request)
    hints: list[str] = []
    blocks = await svc.run_index(svc.store.prefix_blocks, spec, tokens, ns, agent=agent_of(request), hints=hints)
    shm = svc.shm.name
    handles = iter(await svc.slot_handles([b.key for b in blocks if b.tier == shm]))
    out, read_here = [], []
    for b in blocks:
        handle = next(handles) if b.tier == shm else None
        out.append({"key": b.key.hex(), "tier": b.tier, "checksum": b.entry.checksum if b.entry else None,
                    "handle": handle_json(handle)})
        if handle is not None and b.entry is not None:
            read_here.append(b.key)
    # Only the blocks the client reads through a handle: it fetches the others with
    # /v1/blocks/get, which counts them itself (counting them here too read them twice).
    svc.tally.add(read_here)
    bt = spec.block_tokens
    svc.store.core.count(get_calls=1, tokens_requested=spec.full_blocks(len(tokens)) * bt, tokens_hit=len(blocks) * bt)
    svc.metrics.colocated.labels("get").inc()
    return JSONResponse({"n_tokens": len(blocks) * bt, "segment": svc.shm.segment, "blocks": out, **_hint(hints)})


_MAX_TOUCH_COUNT = 1 << 30
"""Reads of one key one access report may claim."""


@router.post("/v1/kv/touch")
async def kv_touch(request: Request) -> dict:
    """Reads a co-located client served with no request (the arena's key index, remembered slots):
    counted as gets, as reads for heat and, by the caller's agent, for learning hand-offs.

    Body: ``{"keys": [hex], "counts": [n], "gets": n, "tokens_requested": n, "tokens_hit": n}``;
    ``counts`` (optional, default 1 each) says how many reads of each key.
    Only keys stored in the request's namespace count; others are ignored, so a
    report can neither warm nor probe another tenant's blocks.
    """
    svc, _, ns = caller(request, colocated=True)
    data = await json_body(request)
    keys = require(data, "keys", list)
    if len(keys) > MAX_TOUCH_KEYS:
        raise MalformedRequest(f"keys: at most {MAX_TOUCH_KEYS} per report, got {len(keys)}", field="keys")
    reads = data.get("counts", [1] * len(keys))
    if (not isinstance(reads, list) or len(reads) != len(keys)
            or not all(type(n) is int and 0 < n <= _MAX_TOUCH_COUNT for n in reads)):
        raise field_error(InvalidInput(f"must be a list of integers in [1, {_MAX_TOUCH_COUNT}], one per key"),
                          "counts")
    counts = {name: require(data, name, int) for name in ("gets", "tokens_requested", "tokens_hit")}
    for name, value in counts.items():
        if isinstance(value, bool) or value < 0:
            raise field_error(InvalidInput(f"must be a non-negative integer, got {value!r}"), name)
    if counts["tokens_hit"] > counts["tokens_requested"]:
        raise field_error(InvalidInput("cannot exceed tokens_requested"), "tokens_hit")
    wanted = parse_keys(keys)
    return {"touched": await svc.run(_touch, svc, ns, wanted, reads, counts, agent_of(request))}


def _touch(svc: Service, ns: str, keys: list, reads: list[int], counts: dict[str, int], agent: str | None) -> int:
    mine = [(k, n) for k, n, e in zip(keys, reads, svc.store.core.entries_of(keys)) if e is not None and e.namespace == ns]
    svc.store.core.touch([k for k, _ in mine], [n for _, n in mine])
    if agent is not None and counts["gets"]:
        # reads served with no request teach hand-offs as a get does: a report mixes several
        # gets' keys, so each key is offered on its own (a chain is known by its last key)
        for k, _ in mine:
            svc.store.locality.handoffs.read([k], ns, agent)
    svc.store.core.count(get_calls=counts["gets"], tokens_requested=counts["tokens_requested"],
                         tokens_hit=counts["tokens_hit"])
    if counts["gets"]:
        svc.metrics.colocated.labels("get").inc(counts["gets"])
    return len(mine)


@router.post("/v1/staging/lease")
async def staging_lease(request: Request) -> dict:
    """Lease a range of the staging arena for co-located puts: ``{"nbytes": N}``."""
    svc, p = authenticate(request, colocated=True)
    data = await json_body(request)
    nbytes = require(data, "nbytes", int)
    if nbytes > svc.settings.max_body_bytes:
        raise PayloadTooLarge(f"nbytes: {nbytes} is over the {svc.settings.max_body_bytes}-byte limit",
                              field="nbytes")
    lease = svc.staging.lease(nbytes, p.name)
    return lease.to_dict(svc.staging.segment)


@router.delete("/v1/staging/lease/{lease_id}")
async def staging_release(lease_id: str, request: Request) -> dict:
    svc, p = authenticate(request, colocated=True)
    return {"released": svc.staging.release(lease_id, p.name)}


@router.post("/v1/kv/put-staged/{lease_id}")
async def kv_put_staged(lease_id: str, request: Request) -> JSONResponse:
    """A put whose KV bytes the client wrote into its staging lease.

    Body: a KV body without the KV bytes (it ends at the KV offset).
    """
    svc, p, ns = caller(request, colocated=True)
    raw = await request.body()
    head = parse_kv_head(raw)
    if len(raw) != head.kv_at:
        raise MalformedRequest(f"body: {len(raw)} bytes; a staged put's body ends at the KV offset {head.kv_at}",
                               field="body")
    tokens = head_tokens(svc, raw, head)
    spec = parse_spec(head.spec)
    nbytes = head.total - head.kv_at
    with svc.staging.use(lease_id, p.name, nbytes) as view:
        kv = kv_view(view, 0, spec, head.kv_tokens)  # type: ignore[arg-type]
        stored = await svc.run(_put, svc, p, ns, spec, tokens, kv, agent_of(request))
        del kv
    svc.metrics.colocated.labels("put").inc()
    svc.metrics.transfer.labels("in", "shm").inc(nbytes)
    return JSONResponse({"stored_tokens": stored, "medium": "shm"})


# -- co-located: reserved puts (``kvstore.engine.reserved``) ------------------------------------------


@router.post("/v1/kv/reserve")
async def kv_reserve(request: Request) -> JSONResponse:
    """Top-tier slots for a put's new blocks, which the client fills itself and then commits.

    Body: a KV body without the KV bytes (it ends at the KV offset). Query: ``pid``, the
    writing process (a reservation whose process exits is reclaimed at once). Answer:
    ``{"reservation", "segment", "n_tokens", "blocks": [{"depth", "offset", "length", "meta"}]}``,
    offsets into the shm tier's data region; ``reservation`` null when the top tier has no room
    for them all (``reason`` ``no_room``) or this store takes no reserved puts
    (``reserved_puts_off``), with ``why`` in words: put another way.
    """
    svc, p, ns = caller(request, colocated=True)
    raw = await request.body()
    head = parse_kv_head(raw)
    if len(raw) != head.kv_at:
        raise MalformedRequest(f"body: {len(raw)} bytes; a reservation's body ends at the KV offset {head.kv_at}",
                               field="body")
    pid = request.query_params.get("pid")
    if pid is not None and not pid.isdigit():
        raise field_error(InvalidInput(f"must be a process id, got {pid!r}"), "pid")
    tokens = head_tokens(svc, raw, head)
    spec = parse_spec(head.spec)
    why = svc.reservations_off()
    if why is not None:
        return JSONResponse({"reservation": None, "reason": RESERVE_OFF, "why": why})
    res = await svc.run(_reserve, svc, p, ns, spec, tokens, None if pid is None else int(pid))
    if res is None:
        return JSONResponse({"reservation": None, "reason": RESERVE_NO_ROOM,
                             "why": f"tier {svc.shm.name!r} has no room for them all"})
    return JSONResponse({**res.to_dict(), "segment": svc.shm.segment})


def _reserve(svc: Service, p: Principal, ns: str, spec, tokens, pid: int | None):
    charge_blocks(svc, p, ns, spec, tokens)
    try:
        return svc.store.reserve_put(spec, tokens, ns, owner=p.name, pid=pid)
    except InvalidInput as exc:  # no such process: the engine says "pid: ..."
        raise_named(exc, "pid")
        raise


@router.post("/v1/kv/commit")
async def kv_commit(request: Request) -> JSONResponse:
    """Publish a reservation the caller filled: ``{"reservation", "checksums": [one per block]}``.

    Each frame's header is checked against the reservation and its claimed body checksum;
    a mismatch returns every slot and stores nothing (422).
    """
    svc, p, _ = caller(request, colocated=True)
    data = await json_body(request)
    rid = require(data, "reservation", str)
    checksums = require(data, "checksums", list)
    try:
        stored, nbytes = await svc.run(svc.store.commit_put, rid, p.name, checksums, agent=agent_of(request))
    except InvalidInput as exc:  # not one checksum per block: the engine says "checksums: ..."
        raise_named(exc, "checksums")
        raise
    svc.metrics.colocated.labels("put").inc()
    svc.metrics.transfer.labels("in", "shm").inc(nbytes)
    return JSONResponse({"stored_tokens": stored, "medium": "shm"})


# -- co-located: pooled puts, one request a put (``kvstore.engine.reserved``, "Pooled puts") ------------

@router.delete("/v1/kv/reserve/{rid}")
async def kv_abort(rid: str, request: Request) -> dict:
    """Give a reservation's slots back unfilled."""
    svc, p, _ = caller(request, colocated=True)
    await svc.run(svc.store.reservations.abort, rid, p.name)
    return {"aborted": rid}
