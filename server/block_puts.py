"""Block-major puts (``POST /v1/kv/put`` with ``KV_BLOCKS_MEDIA``): each block received straight
into its frame in a reserved top-tier slot, once its label says it is the block expected there.

A token-major put body is read whole into a pooled buffer, and only then is each block copied
out of it into the top tier and hashed (``Puts.write_chain``). A block-major body carries each
block's KV as the payload of its raw frame, one block after another, so the server reserves a
slot for every new block first (``kvstore.engine.reserved``, owner the caller, no process), copies
each part of the body into its slot as it arrives, seals the frames there (their one hash) in the
thread pool while the next blocks arrive, and commits: one copy of the KV on the server, not two,
and the blocks are written while the rest of the body is still on the wire. A block already
stored is read and dropped. Each block's label (``kvstore.wire.rest``) is checked before its bytes
are taken: a block out of order, of another size, or keyed for other tokens, another model or
another namespace is refused with nothing stored. Every failure gives the reservation back before
it answers: a bad label, a body that ends short or runs long, a client gone mid-body, a stall
(408), the in-flight cap (503).

Where the top tier takes no reserved puts (no room for every new block, not a raw shm arena, a
shared tier, ``KVSTORE_RESERVED_PUTS=0``), and for a put of one block, the body is buffered and
stored as a token-major one is, after one more copy into token-major order (none for one block).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, wait
from typing import Any, Callable

import numpy as np
import torch

from kvstore import codec as codec_mod
from kvstore.errors import Forbidden, MalformedRequest
from kvstore.keys import block_hashes
from kvstore.spec import KVSpec
from kvstore.wire.rest import BLOCK_LABEL_BYTES, KVHeader, check_block_head, check_block_label, kv_nbytes
from server.auth import Principal
from server.inflight import BodyStream
from server.requests import agent_of, charge_blocks, streamed_kv_head
from server.service import Service, kv_view, parse_spec, released

__all__ = ["put_blocks"]

Put = Callable[[Service, Principal, str, KVSpec, Any, torch.Tensor, "str | None"], int]
"""The route's token-major put (quota charge, ``put_kv``, its errors named): the fallback's store."""


async def put_blocks(request: Any, svc: Service, p: Principal, ns: str, *, reserving: bool,
                     put: Put) -> tuple[int, int]:
    """Store a block-major put's full blocks: (tokens covered, KV bytes received).

    Args:
        reserving: the server takes reserved puts (``Service.reservations_off`` says none is off).
        put: the token-major put, run in the pool, for a body that goes the buffered way.

    Raises:
        MalformedRequest: (400) a head that cannot be parsed; a length that is not what the head
            describes, naming ``header.spec.dtype``, ``header.kv_tokens`` or ``body``; a body that
            ends short (a client gone included) or runs long, a block out of order or of another
            size (``body``). Nothing is stored.
        InvalidInput, InvalidSpec: (422) ``header.kv_tokens`` not the full blocks', a bad spec, a
            block keyed for other tokens, model or namespace (``body``).
        TooManyTokens, PayloadTooLarge, QuotaExceeded, BodyTimeout, ServerBusy: as their names say.
    """
    body = BodyStream(request, svc.settings.max_body_bytes)
    head, tokens = await streamed_kv_head(svc, body)
    spec = parse_spec(head.spec)
    n_blocks = check_block_head(head, spec.block_tokens)
    body.expected = total = head.total + n_blocks * BLOCK_LABEL_BYTES
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) != total:  # refused before anything is reserved
        raise _length_mismatch(head, spec, int(declared), n_blocks * BLOCK_LABEL_BYTES)
    agent, nbytes = agent_of(request), head.total - head.kv_at
    # One block's block-major bytes are its token-major bytes: buffered, its put takes one thread
    # hop where a reserved one takes two (reserve, commit), which cost more than the copy it saves.
    res = await svc.run(_reserve, svc, p, ns, spec, tokens) if reserving and n_blocks > 1 else None
    if res is None:
        sent = total - head.kv_at  # the blocks and their labels
        buf = svc.buffers.acquire(max(sent, 1))
        with released(svc.buffers, buf):
            await body.read_into(memoryview(buf)[:sent])
            await body.end()
            _check_labels(memoryview(buf), block_hashes(spec, tokens, ns), spec.block_nbytes)
            return await svc.run(_put_buffered, svc, p, ns, spec, tokens, buf, n_blocks, agent, put), nbytes
    sealing: list[Future] = []
    try:
        await _receive_into_slots(body, svc, res, spec, n_blocks, sealing)
        await body.end()
        checksums = [c for job in sealing for c in await asyncio.wrap_future(job)]
    except BaseException:
        await _give_back(svc, res.id, p.name, sealing)
        raise
    if not res.id:  # every block was stored already: nothing reserved, nothing to commit
        if agent is not None:
            await svc.run(svc.store.locality.wrote, res.keys, ns, spec, agent)
        return res.n_tokens, nbytes
    stored, _ = await svc.run(svc.store.commit_put, res.id, p.name, checksums, agent=agent, sealed=True)
    return stored, nbytes


def _reserve(svc: Service, p: Principal, ns: str, spec: KVSpec, tokens: Any) -> Any:
    """Slots for the new blocks (None: no room for them all), once the quota allows them."""
    charge_blocks(svc, p, ns, spec, tokens)
    return svc.store.reserve_put(spec, tokens, ns, owner=p.name, pid=None)


SEAL_BATCH_BYTES = 1 << 20
"""Frames sealed by one job in the pool, at least this many bytes of them (all that is left at the
end is sealed on the loop): a job per 32 KiB block cost more to hand over than its hash."""


async def _receive_into_slots(body: BodyStream, svc: Service, res: Any, spec: KVSpec, n_blocks: int,
                              sealing: list[Future]) -> None:
    """Each block's bytes into its reserved slot's payload; the frames then sealed around them in
    the pool (``sealing`` gets the jobs, whose results are the body checksums, in block order)."""
    top, shape, nbytes = svc.store.tiers[0], spec.kv_shape(spec.block_tokens), spec.block_nbytes
    reserved = {b.depth: b for b in res.blocks}
    batch: list[tuple[memoryview, bytes]] = []
    label = memoryview(bytearray(BLOCK_LABEL_BYTES))  # one for the put: each block's is read into it
    for depth in range(n_blocks):
        await body.read_into(label)
        check_block_label(label, depth, res.keys[depth], nbytes)
        b = reserved.get(depth)
        if b is None:  # stored already
            await body.skip(nbytes)
            continue
        frame = top.reserved_view(b.slot)
        at = codec_mod.raw_payload_offset(len(shape), len(b.meta))
        await body.read_into(frame[at:at + nbytes])
        batch.append((frame, b.meta))
        # Hashed while the blocks are still in cache: a digest streamed over the parts would hash
        # the same bytes once too, and seal_raw computes its own (kvstore.codec). In the pool while
        # the loop receives the next blocks (xxhash lets the GIL go): 1.18x and 1.32x the GB/s of
        # sealing on the loop in two interleaved runs here (32 MiB puts, 2 MiB blocks).
        if len(batch) * nbytes >= SEAL_BATCH_BYTES and depth < n_blocks - 1:
            sealing.append(svc.pool.submit(_seal, batch, spec.dtype, shape))
            batch = []
    if batch:  # the last blocks have nothing to overlap: sealed here (a small put hops no thread)
        done: Future = Future()
        try:
            done.set_result(_seal(batch, spec.dtype, shape))
        except Exception as exc:  # noqa: BLE001 - raised where the jobs' results are read
            done.set_exception(exc)
        sealing.append(done)


def _seal(frames: list[tuple[memoryview, bytes]], dtype: str, shape: tuple[int, ...]) -> list[int]:
    """Seal raw frames whose payloads are in place: their body checksums."""
    sums = []
    for frame, meta in frames:
        n = codec_mod.seal_raw(frame, dtype, shape, meta)
        sums.append(codec_mod.read_header(frame[:n], prefix=True).body_checksum)
    return sums


async def _give_back(svc: Service, rid: str, owner: str, sealing: list[Future]) -> None:
    """Abort reservation ``rid`` in the pool once no seal job may still write into its slots, and
    wait for that even when this request is being cancelled (the abort runs on regardless): an
    error answers only once the slots are free."""
    if not rid:
        return
    job = asyncio.ensure_future(svc.run(_abort_after, svc, rid, owner, sealing))
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        pass  # the caller re-raises what ended the request; the job still runs


def _abort_after(svc: Service, rid: str, owner: str, sealing: list[Future]) -> None:
    wait(sealing)  # queued before this job: they run first, on other workers
    _abort_quietly(svc, rid, owner)


def _abort_quietly(svc: Service, rid: str, owner: str) -> None:
    try:
        svc.store.reservations.abort(rid, owner)
    except Forbidden:  # reaped meanwhile (past ttl_s): its slots are back already
        pass


def _check_labels(blocks: memoryview, keys: list, nbytes: int) -> None:
    """``check_block_label`` of each block of a block-major body's KV region held whole."""
    step = BLOCK_LABEL_BYTES + nbytes
    for depth, key in enumerate(keys):
        check_block_label(blocks[depth * step:depth * step + BLOCK_LABEL_BYTES], depth, key, nbytes)


def _put_buffered(svc: Service, p: Principal, ns: str, spec: KVSpec, tokens: Any, buf: Any, n_blocks: int,
                  agent: str | None, put: Put) -> int:
    """``put`` of a block-major body's labelled blocks held whole in ``buf``, copied into
    token-major order first (a pooled buffer: ``put_kv`` takes KV that way; a single block needs no
    copy). Blocking: run it in the pool."""
    if n_blocks <= 1:  # already token-major, after its label
        return put(svc, p, ns, spec, tokens, kv_view(buf, BLOCK_LABEL_BYTES, spec, n_blocks * spec.block_tokens),
                   agent)
    rows = spec.num_layers * 2 * spec.num_kv_heads
    run, nbytes = spec.block_nbytes // rows, n_blocks * spec.block_nbytes  # run: one row's bytes of a block
    step = BLOCK_LABEL_BYTES + spec.block_nbytes
    out = svc.buffers.acquire(nbytes)
    with released(svc.buffers, out):
        labelled = np.frombuffer(buf, np.uint8, n_blocks * step).reshape(n_blocks, step)
        src = labelled[:, BLOCK_LABEL_BYTES:].reshape(n_blocks, rows, run)
        np.copyto(np.frombuffer(out, np.uint8, nbytes).reshape(rows, n_blocks, run), src.transpose(1, 0, 2))
        kv = kv_view(out, 0, spec, n_blocks * spec.block_tokens)
        return put(svc, p, ns, spec, tokens, kv, agent)


def _length_mismatch(head: KVHeader, spec: KVSpec, declared: int, labels: int) -> MalformedRequest:
    """The 400 of a block-major body whose declared length is not what its head describes (with
    ``labels`` bytes of block labels), naming what most likely disagrees: the spec's dtype (the KV
    bytes are another dtype's size), the tokens (too few bytes for them), or the body (more bytes
    than the head describes)."""
    got, want = declared - labels - head.kv_at, head.total - head.kv_at
    for dtype in ("float16", "bfloat16", "float32"):
        if dtype != spec.dtype and got > 0 and got == kv_nbytes({**head.spec, "dtype": dtype}, head.kv_tokens):
            return MalformedRequest(f"header.spec.dtype: {head.kv_tokens} tokens of {spec.dtype} KV are {want} "
                                    f"bytes; the body carries {got}, their size in {dtype}", field="header.spec.dtype")
    if got < want:
        return MalformedRequest(f"header.kv_tokens: {head.kv_tokens} tokens of KV are {want} bytes; the body "
                                f"carries {max(got, 0)} after its tokens", field="header.kv_tokens")
    return MalformedRequest(f"body: {declared} bytes, the header describes {head.total + labels}", field="body")
