"""Block-level routes under ``/v1/blocks``: frames by key, one at a time or in batches.

Bodies are frames as the codec writes them (``application/x-kvstore-frame``),
never JSON or base64. A block of a namespace other than the request's is
answered exactly like an absent one (404), so a tenant cannot even detect it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from client_sdk.protocol import (BATCH_MEDIA, FRAME_MEDIA, H_CODEC, H_TIER, MalformedRequest, encode_batch_head,
                                 pad64, parse_batch_head)
from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.errors import BlockNotFound, FrameError, InvalidInput, InvalidKV
from kvstore.keys import BlockHash, from_hex
from server import engine
from server.auth import Principal
from server.data import principal, svc_of
from server.errors import field_error
from server.service import Service, json_body, released, require

__all__ = ["router"]

router = APIRouter()
_MAX_BATCH_KEYS = 65536


def _key(hex_key: str, field: str = "key") -> BlockHash:
    try:
        return from_hex(hex_key)
    except InvalidInput as exc:
        raise field_error(exc, field) from exc


def _keys(data: dict[str, Any]) -> list[BlockHash]:
    keys = require(data, "keys", list)
    if len(keys) > _MAX_BATCH_KEYS:
        raise field_error(InvalidInput(f"at most {_MAX_BATCH_KEYS} keys a batch, got {len(keys)}"), "keys")
    return [_key(k, "keys") for k in keys]


def _scope(svc: Service, request: Request, p: Principal) -> frozenset[str]:
    return frozenset({svc.namespace(request, p)})


@router.get("/v1/blocks/{hex_key}")
async def block_get(hex_key: str, request: Request, p: Principal = Depends(principal)) -> Response:
    svc = svc_of(request)
    key, scope = _key(hex_key), _scope(svc, request, p)
    got = await svc.run(engine.read_frame, svc.store, key, scope)
    if got is None:
        raise BlockNotFound(f"block {hex_key} is not stored in this namespace")
    frame, entry = got
    body = memoryview(frame).cast("B")
    svc.metrics.transfer.labels("out", "http").inc(len(body))
    return Response(body, media_type=FRAME_MEDIA, headers={H_TIER: entry.tier, H_CODEC: entry.codec.value})


@router.head("/v1/blocks/{hex_key}")
async def block_head(hex_key: str, request: Request, p: Principal = Depends(principal)) -> Response:
    svc = svc_of(request)
    entry = await svc.run(engine.block_entry, svc.store, _key(hex_key), _scope(svc, request, p))
    if entry is None:
        return Response(status_code=404)
    return Response(status_code=200, headers={"content-length": str(entry.size), H_TIER: entry.tier,
                                              H_CODEC: entry.codec.value, "content-type": FRAME_MEDIA})


@router.put("/v1/blocks/{hex_key}")
async def block_put(hex_key: str, request: Request, p: Principal = Depends(principal)) -> JSONResponse:
    """Store a frame under its key. Its metadata must name the request namespace."""
    svc = svc_of(request)
    key = _key(hex_key)
    ns = svc.namespace(request, p)
    buf, n = await svc.read_body(request)
    with released(svc.buffers, buf):
        frame = bytes(memoryview(buf)[:n])  # the tier keeps it; the pooled buffer goes back
    await svc.run(_put_frames, svc, p, ns, [(key, frame)])
    svc.metrics.transfer.labels("in", "http").inc(n)
    return JSONResponse({"stored": True}, status_code=201)


def _put_frames(svc: Service, p: Principal, ns: str, frames: list[tuple[BlockHash, Any]]) -> int:
    svc.quotas.check(p, ns, sum(len(memoryview(f).cast("B")) for _, f in frames))
    for key, frame in frames:
        engine.put_frame(svc.store, key, frame, ns)
    return len(frames)


@router.delete("/v1/blocks/{hex_key}")
async def block_delete(hex_key: str, request: Request, p: Principal = Depends(principal)) -> dict:
    svc = svc_of(request)
    key, scope = _key(hex_key), _scope(svc, request, p)
    if engine.current_entry(svc.store, key, scope) is None:
        raise BlockNotFound(f"block {hex_key} is not stored in this namespace")
    return {"deleted": await svc.run(svc.store.delete_blocks, [key])}


@router.post("/v1/blocks/get")
async def blocks_get(request: Request, p: Principal = Depends(principal)) -> Response:
    """Many frames in one batch body; absent ones have null offset and length.

    ``{"keys": [...], "codec": "int8"}`` asks for the frames in that codec: fewer bytes on a slow link.
    """
    svc = svc_of(request)
    scope = _scope(svc, request, p)
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
        got = engine.read_frame(svc.store, key, scope)
        if got is not None and codec is not None:
            try:
                got = (codec_mod.transcode(got[0], codec), got[1])
            except FrameError:
                got = None  # a damaged frame is a miss, as everywhere
            except InvalidKV:
                pass  # NaN/Inf: int8 cannot carry it; send the frame as stored
        out.append(got)
    return out


@router.post("/v1/blocks/put")
async def blocks_put(request: Request, p: Principal = Depends(principal)) -> JSONResponse:
    """Many frames from one batch body."""
    svc = svc_of(request)
    ns = svc.namespace(request, p)
    buf, n = await svc.read_body(request)
    with released(svc.buffers, buf):
        view = memoryview(buf)[:n]
        blocks, data_at = parse_batch_head(view)
        frames = []
        for i, b in enumerate(blocks):
            off, length = b.get("offset"), b.get("length")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, length)):
                raise MalformedRequest(f"header.blocks[{i}]: offset and length must be non-negative ints")
            if data_at + off + length > n:
                raise MalformedRequest(f"header.blocks[{i}]: frame runs past the body ({n} bytes)")
            frames.append((_key(b.get("key"), f"blocks[{i}].key"), bytes(view[data_at + off:data_at + off + length])))
        del view
    stored = await svc.run(_put_frames, svc, p, ns, frames)
    svc.metrics.transfer.labels("in", "http").inc(n)
    return JSONResponse({"stored": stored}, status_code=201)


@router.post("/v1/blocks/delete")
async def blocks_delete(request: Request, p: Principal = Depends(principal)) -> dict:
    svc = svc_of(request)
    scope = _scope(svc, request, p)
    keys = _keys(await json_body(request))
    mine = [k for k in keys if engine.current_entry(svc.store, k, scope) is not None]
    return {"deleted": await svc.run(svc.store.delete_blocks, mine) if mine else 0}


@router.post("/v1/blocks/exists")
async def blocks_exists(request: Request, p: Principal = Depends(principal)) -> dict:
    svc = svc_of(request)
    scope = _scope(svc, request, p)
    keys = _keys(await json_body(request))
    present = await svc.run(lambda: [engine.block_entry(svc.store, k, scope) is not None for k in keys])
    return {"present": present}
