"""Block-level routes under ``/v1/blocks``: frames by key, one at a time or in batches.

Bodies are frames as the codec writes them (``application/x-kvstore-frame``),
never JSON or base64. A block of a namespace other than the request's is
answered exactly like an absent one (404), so a tenant cannot even detect it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.errors import BlockNotFound, FrameError, InvalidInput, InvalidKV, MalformedRequest
from kvstore.keys import BlockHash
from kvstore.wire.rest import BATCH_MEDIA, FRAME_MEDIA, H_CODEC, H_TIER, encode_batch_head, pad64, parse_batch_head
from server.auth import Principal
from server.colocated import handle_json
from server.errors import field_error
from server.requests import authenticate, caller, namespace_of, parse_key, parse_keys, put_frames
from server.service import Service, json_body, parse_tokens, released, require

__all__ = ["router"]

router = APIRouter()
_MAX_BATCH_KEYS = 65536


def _keys(data: dict[str, Any]) -> list[BlockHash]:
    keys = require(data, "keys", list)
    if len(keys) > _MAX_BATCH_KEYS:
        raise field_error(InvalidInput(f"at most {_MAX_BATCH_KEYS} keys a batch, got {len(keys)}"), "keys")
    return parse_keys(keys)


def _scope(request: Request, p: Principal) -> frozenset[str]:
    """The request's namespace, as the one namespace a block may be in to be found."""
    return frozenset({namespace_of(request, p)})


@router.get("/v1/blocks/{hex_key}")
async def block_get(hex_key: str, request: Request) -> Response:
    svc, p = authenticate(request)
    key, scope = parse_key(hex_key), _scope(request, p)
    got = await svc.run(svc.store.frames.read, key, scope)
    if got is None:
        raise BlockNotFound(f"block {hex_key} is not stored in this namespace")
    frame, entry = got
    body = memoryview(frame).cast("B")
    svc.metrics.transfer.labels("out", "http").inc(len(body))
    return Response(body, media_type=FRAME_MEDIA, headers={H_TIER: entry.tier, H_CODEC: entry.codec.value})


@router.head("/v1/blocks/{hex_key}")
async def block_head(hex_key: str, request: Request) -> Response:
    svc, p = authenticate(request)
    entry = await svc.run(svc.store.frames.block_entry, parse_key(hex_key), _scope(request, p))
    if entry is None:
        return Response(status_code=404)
    return Response(status_code=200, headers={"content-length": str(entry.size), H_TIER: entry.tier,
                                              H_CODEC: entry.codec.value, "content-type": FRAME_MEDIA})


@router.put("/v1/blocks/{hex_key}")
async def block_put(hex_key: str, request: Request) -> JSONResponse:
    """Store a frame under its key. Its metadata must name the request namespace."""
    svc, p = authenticate(request)
    key = parse_key(hex_key)
    ns = namespace_of(request, p)
    buf, n = await svc.read_body(request)
    with released(svc.buffers, buf):
        frame = bytes(memoryview(buf)[:n])  # the tier keeps it; the pooled buffer goes back
    await svc.run(put_frames, svc, p, ns, [(key, frame)])
    svc.metrics.transfer.labels("in", "http").inc(n)
    return JSONResponse({"stored": True}, status_code=201)


@router.post("/v1/blocks/put-staged/{lease_id}")
async def blocks_put_staged(lease_id: str, request: Request) -> JSONResponse:
    """Many frames the client wrote into its staging lease, stored by key (co-located only).

    Body: ``{"blocks": [{"key", "offset", "length"}], "make_room": false}``, offsets into the
    lease. Each frame must verify and name the request's namespace, as ``/v1/blocks/put``'s
    do. ``make_room`` places them as ``put_kv`` places blocks (colder entries are demoted or
    evicted) instead of falling through full tiers: what a cache backend wants.
    """
    svc, p, ns = caller(request, colocated=True)
    data = await json_body(request)
    blocks = require(data, "blocks", list)
    if len(blocks) > _MAX_BATCH_KEYS:
        raise MalformedRequest(f"blocks: at most {_MAX_BATCH_KEYS} per request, got {len(blocks)}", field="blocks")
    make_room = data.get("make_room", False)
    if not isinstance(make_room, bool):
        raise field_error(InvalidInput(f"must be true or false, got {make_room!r}"), "make_room")
    spans, end = [], 0
    for i, b in enumerate(blocks):
        off, length = (b.get("offset"), b.get("length")) if isinstance(b, dict) else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, length)):
            raise MalformedRequest(f"blocks[{i}]: offset and length must be non-negative ints", field=f"blocks[{i}]")
        spans.append((parse_key(b.get("key"), f"blocks[{i}].key"), off, length))
        end = max(end, off + length)
    with svc.staging.use(lease_id, p.name, end) as view:
        frames = [(key, view[off:off + length]) for key, off, length in spans]
        try:
            stored = await svc.run(put_frames, svc, p, ns, frames, make_room=make_room)
        finally:
            del frames
    svc.metrics.colocated.labels("put").inc()
    svc.metrics.transfer.labels("in", "shm").inc(end)
    return JSONResponse({"stored": stored}, status_code=201)


@router.delete("/v1/blocks/{hex_key}")
async def block_delete(hex_key: str, request: Request) -> dict:
    svc, p = authenticate(request)
    key, scope = parse_key(hex_key), _scope(request, p)
    if svc.store.frames.current_entry(key, scope) is None:
        raise BlockNotFound(f"block {hex_key} is not stored in this namespace")
    return {"deleted": await svc.run(svc.store.delete_blocks, [key])}


@router.post("/v1/blocks/get")
async def blocks_get(request: Request) -> Response:
    """Many frames in one batch body; absent ones have null offset and length.

    ``{"keys": [...], "codec": "int8"}`` asks for the frames in that codec: fewer bytes on a slow link.
    """
    svc, p = authenticate(request)
    scope = _scope(request, p)
    data = await json_body(request)
    keys = _keys(data)
    codec = data.get("codec")
    if codec is not None:
        try:
            codec = Codec.parse(codec)
        except InvalidInput as exc:
            raise field_error(exc, "codec") from exc
    frames = await svc.run(_read_frames, svc, keys, scope, codec)
    blocks, parts, at = [], [], 0
    for key, got in zip(keys, frames):
        if got is None:
            blocks.append({"key": key.hex(), "offset": None, "length": None})
            continue
        view = memoryview(got[0]).cast("B")
        blocks.append({"key": key.hex(), "offset": at, "length": len(view), "tier": got[1].tier})
        parts.append(view)
        pad = pad64(len(view)) - len(view)
        if pad:
            parts.append(bytes(pad))
        at += pad64(len(view))
    head, _ = encode_batch_head(blocks)
    body = b"".join([head, *parts])
    svc.metrics.transfer.labels("out", "http").inc(len(body))
    return Response(body, media_type=BATCH_MEDIA)


def _read_frames(svc: Service, keys: list[BlockHash], scope: frozenset[str],
                 codec: Codec | None) -> list[tuple[Any, Any] | None]:
    """Frames of ``keys``; with ``codec``, re-encoded into it (a block int8 cannot carry stays as stored)."""
    out = []
    for key in keys:
        # verified here: a damaged frame is dropped from the index (a miss now, and stored anew by
        # the client's next put) instead of being served and refused by every reader in turn
        got = svc.store.frames.read_with(key, scope, lambda view, _header, entry: (bytes(view), entry))
        if got is None and svc.store.frames.current_entry(key, scope) is None:
            got = svc.store.frames.read(key, scope)  # not indexed here: another node's, in the shared tier
        if got is not None and codec is not None:
            try:
                got = (codec_mod.transcode(got[0], codec), got[1])
            except FrameError:
                got = None  # a damaged frame is a miss, as everywhere
            except InvalidKV:
                pass  # NaN/Inf: int8 cannot carry it; send the frame as stored
        out.append(got)
    return out


@router.post("/v1/blocks/handles")
async def blocks_handles(request: Request) -> JSONResponse:
    """Slot handles of ``keys`` in the shm arena, for a co-located client that reads them itself.

    Body ``{"keys": [...], "count": true}``; answer ``{"segment", "blocks": [{"key", "checksum",
    "handle"}]}``. A key that is absent, another namespace's or outside the shm tier has a null
    handle (the client fetches those with ``/v1/blocks/get``, which counts its own reads).
    ``count: false`` asks where blocks are without counting reads (a lookup): the client then
    reports the reads it makes through ``/v1/kv/touch``.
    """
    svc, p = authenticate(request, colocated=True)
    scope = _scope(request, p)
    data = await json_body(request)
    keys = _keys(data)
    count = data.get("count", True)
    if not isinstance(count, bool):
        raise field_error(InvalidInput(f"must be true or false, got {count!r}"), "count")
    entries = await svc.run_index(_entries, svc, keys, scope)
    shm = svc.shm.name
    handles = iter(await svc.slot_handles([k for k, e in zip(keys, entries) if e is not None and e.tier == shm]))
    out, read_here = [], []
    for key, entry in zip(keys, entries):
        handle = next(handles) if entry is not None and entry.tier == shm else None
        out.append({"key": key.hex(), "checksum": entry.checksum if entry is not None else None,
                    "handle": handle_json(handle)})
        if handle is not None:
            read_here.append(key)
    if count:  # the client reads these itself: count them here (else it reports what it reads)
        svc.tally.add(read_here)
        svc.metrics.colocated.labels("get").inc()
    return JSONResponse({"segment": svc.shm.segment, "blocks": out})


def _entries(svc: Service, keys: list[BlockHash], scope: frozenset[str]) -> list[Any]:
    return [svc.store.frames.current_entry(key, scope) for key in keys]


@router.post("/v1/blocks/put")
async def blocks_put(request: Request) -> JSONResponse:
    """Many frames from one batch body; ``?make_room=true`` places them as ``put_kv`` places blocks."""
    svc, p, ns = caller(request)
    buf, n = await svc.read_body(request)
    with released(svc.buffers, buf):
        view = memoryview(buf)[:n]
        blocks, data_at = parse_batch_head(view)
        frames = []
        for i, b in enumerate(blocks):
            off, length = b.get("offset"), b.get("length")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, length)):
                raise MalformedRequest(f"header.blocks[{i}]: offset and length must be non-negative ints",
                                       field=f"header.blocks[{i}]")
            if data_at + off + length > n:
                raise MalformedRequest(f"header.blocks[{i}]: frame runs past the body ({n} bytes)",
                                       field=f"header.blocks[{i}]")
            frames.append((parse_key(b.get("key"), f"blocks[{i}].key"), bytes(view[data_at + off:data_at + off + length])))
        del view
    make_room = request.query_params.get("make_room", "false")
    if make_room not in ("true", "false"):
        raise field_error(InvalidInput(f"must be true or false, got {make_room!r}"), "make_room")
    stored = await svc.run(put_frames, svc, p, ns, frames, make_room=make_room == "true")
    svc.metrics.transfer.labels("in", "http").inc(n)
    return JSONResponse({"stored": stored}, status_code=201)


@router.post("/v1/blocks/delete")
async def blocks_delete(request: Request) -> dict:
    svc, p = authenticate(request)
    scope = _scope(request, p)
    keys = _keys(await json_body(request))
    mine = [k for k in keys if svc.store.frames.current_entry(k, scope) is not None]
    return {"deleted": await svc.run(svc.store.delete_blocks, mine) if mine else 0}


MAX_PIN_TTL_S = 3600.0
"""A tenant's pin lasts at most this long: a client that dies holding pins cannot hold them forever."""


@router.post("/v1/blocks/pin")
async def blocks_pin(request: Request) -> dict:
    """Hold this namespace's blocks where they are (placement neither demotes nor evicts them)
    for ``ttl_s`` seconds (at most an hour): ``{"keys": [...], "ttl_s": 60}``. A cache's
    lookup-then-load takes them so a looked-up block is still there to load."""
    svc, p = authenticate(request)
    scope = _scope(request, p)
    data = await json_body(request)
    keys = _keys(data)
    ttl = data.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_PIN_TTL_S:
        raise field_error(InvalidInput(f"must be a number of seconds in (0, {MAX_PIN_TTL_S:.0f}], got {ttl!r}"),
                          "ttl_s")
    mine = [k for k in keys if svc.store.frames.current_entry(k, scope) is not None]
    return {"pinned": await svc.run(svc.store.pin_keys, mine, float(ttl)) if mine else 0, "requested": len(keys)}


@router.post("/v1/blocks/unpin")
async def blocks_unpin(request: Request) -> dict:
    """Release pins of this namespace's blocks: ``{"keys": [...]}``."""
    svc, p = authenticate(request)
    scope = _scope(request, p)
    keys = _keys(await json_body(request))
    mine = [k for k in keys if svc.store.frames.current_entry(k, scope) is not None]
    return {"unpinned": await svc.run(svc.store.unpin_keys, mine) if mine else 0, "requested": len(keys)}


@router.post("/v1/blocks/exists")
async def blocks_exists(request: Request) -> dict:
    svc, p = authenticate(request)
    scope = _scope(request, p)
    keys = _keys(await json_body(request))
    present = await svc.run(lambda: [svc.store.frames.block_entry(k, scope) is not None for k in keys])
    return {"present": present}


def _engine_name(value: Any, field: str) -> bytes | int:
    """An engine's block name from JSON: hex of 1-64 bytes, or an int in [0, 2**64) (vLLM's
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` form), kept as it came so events repeat it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64:
        return value
    if isinstance(value, str) and 2 <= len(value) <= 128:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    raise InvalidInput(f"{field}: an engine's block hash is hex of 1-64 bytes or an int in [0, 2**64), "
                       f"got {value!r:.80}", field=field)


@router.post("/v1/blocks/names")
async def blocks_names(request: Request) -> dict:
    """An engine's own names for stored blocks of this namespace, for KV events: ``{"blocks":
    [{"key": hex, "engine_hash": hex or int}, ...], "parent": the engine's name for the first
    block's parent or null, "tokens": the blocks' token ids, concatenated (optional)}``. The blocks
    are consecutive in one chain. Blocks not stored here are skipped; ``named`` counts the rest."""
    svc, p = authenticate(request)
    ns = namespace_of(request, p)
    data = await json_body(request)
    blocks = require(data, "blocks", list)
    if not 0 < len(blocks) <= _MAX_BATCH_KEYS:
        raise field_error(InvalidInput(f"1 to {_MAX_BATCH_KEYS} blocks a request, got {len(blocks)}"), "blocks")
    keys, names = [], []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise InvalidInput(f"blocks[{i}]: an object with key and engine_hash, got {type(b).__name__}",
                               field=f"blocks[{i}]")
        keys.append(parse_key(b.get("key"), f"blocks[{i}].key"))
        names.append(_engine_name(b.get("engine_hash"), f"blocks[{i}].engine_hash"))
    parent = data.get("parent")
    parents: list[bytes | int | None] = [None if parent is None else _engine_name(parent, "parent"), *names[:-1]]
    per_block: list[bytes | None] = [None] * len(keys)
    if data.get("tokens") is not None:
        toks = parse_tokens(data["tokens"], limit=svc.settings.max_tokens_per_request)
        if len(toks) % len(keys):
            raise InvalidInput(f"tokens: {len(toks)} token ids do not split into {len(keys)} blocks",
                               field="tokens")
        raw = toks.astype("<u4").tobytes()
        step = len(raw) // len(keys)
        per_block = [raw[i * step:(i + 1) * step] for i in range(len(keys))]
    named = await svc.run(svc.store.core.name_blocks, list(zip(keys, names, parents, per_block)), ns)
    return {"named": named, "requested": len(keys)}
