"""The pooled put routes: a co-located client holds a pool of top-tier slots it writes new
blocks into, and one request publishes them and lends slots back (``kvstore.engine.pools``).

``/v1/kv/pool`` grants slots, ``/v1/kv/put-pooled`` publishes a put's blocks (``put_pooled``
is its work, which the commit channel, ``server.commit_channel``, runs too), ``/v1/blocks/put-pooled``
publishes frames by key (a cache backend's pages), ``DELETE /v1/kv/pool`` hands a pool back.
"""

from __future__ import annotations

from typing import Any, Mapping

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvstore.engine.pools import SLOT_SLACK
from kvstore.errors import InvalidInput, MalformedRequest
from kvstore.wire.rest import RESERVE_NO_ROOM, RESERVE_OFF, parse_kv_head
from server.auth import Principal
from server.errors import field_error, raise_named
from server.requests import agent_of, caller, charge_blocks, head_tokens, parse_key
from server.service import Service, json_object, parse_spec, require

__all__ = ["router", "put_pooled", "put_pooled_blocks", "MAX_POOL_SLOTS"]

router = APIRouter()

MAX_POOL_SLOTS = 4096
"""The most pool slots one request may ask for (a 64 MiB pool of 16 KiB blocks)."""


def _pool_name(query: Mapping[str, str]) -> str:
    """The ``pool`` query parameter: the client's name for its pool (one per client in a process)."""
    name = query.get("pool", "")
    if not 0 < len(name) <= 64 or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise field_error(InvalidInput(f"must be 1-64 letters, digits, '-' or '_', got {name!r}"), "pool")
    return name


def _pool_query(query: Mapping[str, str], svc: Service, spec) -> tuple[int, int, int]:
    """``pid``, ``count`` (slots wanted) and ``slot_bytes`` from the query, checked.

    Raises:
        InvalidInput: (422, naming the field) a missing or bad value; a slot size that is not
            between the spec's raw frame and that plus ``SLOT_SLACK``.
    """
    got = {}
    for name, default in (("pid", None), ("count", "0"), ("slot_bytes", None)):
        raw = query.get(name, default)
        if raw is None or not raw.isdigit() or len(raw) > 12:
            raise field_error(InvalidInput(f"must be a non-negative integer, got {raw!r}"), name)
        got[name] = int(raw)
    if got["count"] > MAX_POOL_SLOTS:
        raise field_error(InvalidInput(f"at most {MAX_POOL_SLOTS} slots a request, got {got['count']}"), "count")
    least = svc.store.reservations.pools.slot_bytes(spec)
    if not least <= got["slot_bytes"] <= least + SLOT_SLACK:
        raise field_error(InvalidInput(f"a {spec.dtype} block of this spec needs a slot of {least} to "
                                       f"{least + SLOT_SLACK} bytes, got {got['slot_bytes']}"), "slot_bytes")
    return got["pid"], got["count"], got["slot_bytes"]


def _returning(value: Any, field: str) -> list[int]:
    """The ``returning`` member: offsets of the caller's idle pool slots it gives back before a grant.

    Raises:
        MalformedRequest: (naming ``field``) not a list of at most ``MAX_POOL_SLOTS`` non-negative ints.
    """
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_POOL_SLOTS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in value):
        raise MalformedRequest(f"{field}: a list of at most {MAX_POOL_SLOTS} slot offsets (non-negative ints)",
                               field=field)
    return value


@router.post("/v1/kv/pool")
async def kv_pool(request: Request) -> JSONResponse:
    """Pool slots for the caller's process, which its pooled puts write into (``/v1/kv/put-pooled``).

    Body: a KV body without its KV (it names the spec; its tokens are ignored). Query: ``pid``,
    ``pool`` (the client's name for its pool), ``count``, ``slot_bytes``. The JSON head may hold
    ``returning``: offsets of the caller's idle slots (of another size) to give back first, since
    the pool's bytes are capped across sizes. Answer: ``{"segment", "ttl_s", "slots": [{"offset", "length"}]}``,
    as many as the top tier had room for (none: put another way). ``reservation_off`` (with
    ``why``) when this store takes no reserved puts.
    """
    svc, p, _ = caller(request, colocated=True)
    raw = await request.body()
    head = parse_kv_head(raw)
    spec = parse_spec(head.spec)
    why = svc.reservations_off()
    if why is not None:
        return JSONResponse({"slots": [], "reason": RESERVE_OFF, "why": why})
    pid, count, size = _pool_query(request.query_params, svc, spec)
    name = _pool_name(request.query_params)
    returning = _returning(head.fields.get("returning"), "header.returning")
    try:
        slots = await svc.run(svc.store.reservations.pools.grant, p.name, pid, name, size, count, returning)
    except InvalidInput as exc:
        raise_named(exc, "pid")
        raise
    return JSONResponse({"slots": slots, "segment": svc.shm.segment, "ttl_s": svc.store.reservations.pools.ttl_s,
                         **({} if slots else {"reason": RESERVE_NO_ROOM})})


@router.post("/v1/kv/put-pooled")
async def kv_put_pooled(request: Request) -> JSONResponse:
    """A put whose new blocks the caller wrote into its pool slots: one request (``put_pooled``;
    a co-located client may send the same request over the commit channel, ``server.commit_channel``).

    Body: a KV body without its KV, whose JSON head also holds ``writes``: ``[[depth, offset,
    body checksum], ...]``, one per block written. Query: ``pid``, ``pool``, ``count`` (slots to
    grant back), ``slot_bytes``. Answer: ``{"stored_tokens", "missing": [depths], "slots": [...],
    "segment", "ttl_s"}``: ``missing`` names blocks neither written nor stored (send them another
    way), ``slots`` the pool slots the caller holds again (unused) or newly.
    """
    svc, p, ns = caller(request, colocated=True)
    raw = await request.body()
    return JSONResponse(await svc.run(put_pooled, svc, p, ns, raw, request.query_params, agent_of(request)))


def put_pooled(svc: Service, p: Principal, ns: str, raw: bytes, query: Mapping[str, str],
               agent: str | None) -> dict[str, Any]:
    """``/v1/kv/put-pooled``'s work and answer, for a caller already authenticated for ``ns`` on
    the co-located path: blocking (the I/O pool's, or the commit channel's thread).

    Raises:
        MalformedRequest, InvalidInput, TooManyTokens: the body or query, naming the field.
        KVStoreError: the store's, as a put's.
    """
    head = parse_kv_head(raw)
    if len(raw) != head.kv_at:
        raise MalformedRequest(f"body: {len(raw)} bytes; a pooled put's body ends at the KV offset {head.kv_at}",
                               field="body")
    tokens = head_tokens(svc, raw, head)
    spec = parse_spec(head.spec)
    why = svc.reservations_off()
    if why is not None:
        raise field_error(InvalidInput(f"pooled puts are off here: {why}"), "body")
    pid, count, _ = _pool_query(query, svc, spec)
    name = _pool_name(query)
    writes = head.fields.get("writes")
    if not isinstance(writes, list) or len(writes) > len(tokens) // max(spec.block_tokens, 1) or not all(
            isinstance(w, list) and len(w) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                       for v in w) and w[2] < 1 << 64 for w in writes):
        raise MalformedRequest("header.writes: a list of [depth, offset, checksum] non-negative ints, "
                               "at most one per block", field="header.writes")
    charge_blocks(svc, p, ns, spec, tokens)
    svc.store.hints.saw(spec, ns)
    try:
        done = svc.store.reservations.pools.put_pooled(spec, tokens, ns, p.name, pid, name,
                                                       [tuple(w) for w in writes], count)
    except InvalidInput as exc:
        raise_named(exc, "writes")
        raise_named(exc, "pid")
        raise
    if agent is not None:
        svc.store.locality.wrote(done.keys, ns, spec, agent)
    svc.metrics.colocated.labels("put").inc()
    svc.metrics.transfer.labels("in", "shm").inc(done.nbytes)
    return {"stored_tokens": done.n_tokens, "missing": done.missing, "slots": done.slots,
            "segment": svc.shm.segment, "ttl_s": svc.store.reservations.pools.ttl_s, "medium": "shm"}


MAX_FRAME_SLOT_BYTES = 64 << 20
"""The largest pool slot a by-key pooled put may ask for (the most a pool holds)."""


@router.post("/v1/blocks/put-pooled")
async def blocks_put_pooled(request: Request) -> JSONResponse:
    """Frames the caller wrote into its pool slots, stored by key: a cache backend's pages in one
    request, no staging copy (co-located only; ``put_pooled_blocks``, which the commit channel
    runs too).

    Body: ``{"blocks": [{"key", "offset", "checksum"}]}`` (may be empty: a first grant; then
    ``"returning": [offsets]`` may name idle slots of another size to give back first). Query:
    ``pid``, ``pool``, ``count`` (slots to grant back), ``slot_bytes`` (their size, 4 KiB to 64
    MiB). Each frame must name the request's namespace in its metadata, as ``/v1/blocks/put``'s
    do, and carry the claimed body checksum. Answer: ``{"stored", "slots", "segment", "ttl_s"}``,
    or ``reason`` (``reservation_off``/``no_room``) with no slots.
    """
    svc, p, ns = caller(request, colocated=True)
    raw = await request.body()
    return JSONResponse(await svc.run(put_pooled_blocks, svc, p, ns, raw, request.query_params, agent_of(request)))


def put_pooled_blocks(svc: Service, p: Principal, ns: str, raw: bytes, query: Mapping[str, str],
                      agent: str | None = None) -> dict[str, Any]:
    """``/v1/blocks/put-pooled``'s work and answer, for a caller already authenticated for ``ns``
    on the co-located path: blocking, as ``put_pooled``. (``agent`` is not used: frames by key
    carry no chain to learn a hand-off from.)

    Raises:
        MalformedRequest, InvalidInput: the body or query, naming the field.
        KVStoreError: the store's, as a put's.
    """
    body = json_object(raw)
    blocks = require(body, "blocks", list)
    returning = _returning(body.get("returning"), "returning")
    if returning and blocks:
        raise MalformedRequest("returning: only in a grant (no blocks)", field="returning")
    if len(blocks) > MAX_POOL_SLOTS:
        raise MalformedRequest(f"blocks: at most {MAX_POOL_SLOTS} per request, got {len(blocks)}", field="blocks")
    writes = []
    for i, b in enumerate(blocks):
        off, checksum = (b.get("offset"), b.get("checksum")) if isinstance(b, dict) else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in (off, checksum)):
            raise MalformedRequest(f"blocks[{i}]: offset and checksum must be non-negative ints",
                                   field=f"blocks[{i}]")
        writes.append((parse_key(b.get("key"), f"blocks[{i}].key"), off, checksum))
    why = svc.reservations_off()
    if why is not None:
        if writes:
            raise field_error(InvalidInput(f"pooled puts are off here: {why}"), "blocks")
        return {"stored": 0, "slots": [], "reason": RESERVE_OFF, "why": why}
    got = {}
    for name in ("pid", "count", "slot_bytes"):
        value = query.get(name, "0" if name == "count" else None)
        if value is None or not value.isdigit() or len(value) > 12:
            raise field_error(InvalidInput(f"must be a non-negative integer, got {value!r}"), name)
        got[name] = int(value)
    if got["count"] > MAX_POOL_SLOTS:
        raise field_error(InvalidInput(f"at most {MAX_POOL_SLOTS} slots a request, got {got['count']}"), "count")
    if not 4096 <= got["slot_bytes"] <= MAX_FRAME_SLOT_BYTES:
        raise field_error(InvalidInput(f"must be 4096 to {MAX_FRAME_SLOT_BYTES} bytes, got {got['slot_bytes']}"),
                          "slot_bytes")
    pools, name = svc.store.reservations.pools, _pool_name(query)
    try:
        if not writes:
            done, slots = None, pools.grant(p.name, got["pid"], name, got["slot_bytes"], got["count"], returning)
        else:
            done = pools.put_frames(ns, p.name, got["pid"], name, writes, got["count"], got["slot_bytes"],
                                    lambda nbytes: svc.quotas.check(p, ns, nbytes))
            slots = done.slots
    except InvalidInput as exc:
        raise_named(exc, "pid")
        raise field_error(exc, "blocks") from None
    if done is not None:
        svc.metrics.colocated.labels("put").inc()
        svc.metrics.transfer.labels("in", "shm").inc(done.nbytes)
    return {"stored": 0 if done is None else done.stored, "slots": slots, "segment": svc.shm.segment,
            "ttl_s": pools.ttl_s, **({} if slots or done is not None else {"reason": RESERVE_NO_ROOM})}


@router.delete("/v1/kv/pool")
async def kv_pool_release(request: Request) -> dict:
    """Give the caller's pool back (query ``pid``, ``pool``): its client closes. ``{"released": slots}``."""
    svc, p, _ = caller(request, colocated=True)
    pid = request.query_params.get("pid", "")
    if not pid.isdigit() or len(pid) > 12:
        raise field_error(InvalidInput(f"must be a process id, got {pid!r}"), "pid")
    name = _pool_name(request.query_params)
    return {"released": await svc.run(svc.store.reservations.pools.release, p.name, int(pid), name)}
