"""Co-located puts as flows (``client_sdk.colocated`` steps them): into pool slots with one
request (by tokens, ``put_kv``; by key, ``put_blocks_with``), into slots the server reserved
for the put, or through a staging lease the server copies from; None from a flow: go over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, TypeVar

import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk.arena import Arena
from client_sdk.calls import Call
from client_sdk.colocated import Colocation, Copy, Flow
from kvstore import codec as codec_mod
from kvstore.errors import CorruptFrame, Forbidden, InvalidInput, KVStoreError, QuotaExceeded, TierFull
from kvstore.keys import BlockHash, block_hashes, block_meta
from kvstore.spec import KVSpec
from kvstore.wire.rest import KV_MEDIA, RESERVE_NO_ROOM, RESERVE_OFF

__all__ = ["put_flow", "asking_for_slots", "pooled_put_flow", "reserved_put_flow", "put_blocks_flow",
           "pooled_blocks_flow", "filled_kv", "pool_slot_bytes", "staged_flow", "lent_flow"]

T = TypeVar("T")

NO_ROOM_RETRY_S = 1.0
"""How long puts skip asking for top-tier slots after the server had no room for them: a full
store stays full (new blocks spill one tier down until reads or deletes change that), and each
ask costs two requests that come back empty; a staged put lands wherever placement says."""


def staged_flow(colo: Colocation, arena: Arena, nbytes: int, write: Callable[[dict], Copy],
                commit: Callable[[dict, Any], Call[T]], stats: c.ClientStats) -> Flow[T | None]:
    """A put through a staging lease of at least ``nbytes``: ``write(lease)`` (a ``Copy`` into
    the lease's range; its result is handed to ``commit``), then ``commit(lease, written)``
    (the request that publishes it). None when staging has no room or the server's arena
    changed: the caller goes over HTTP.

    Each put holds its own lease while it writes and commits, so concurrent puts from one
    client never write into the same range. A lease the server expired is dropped and a
    fresh one taken, once. One generator, no nesting: each level of ``yield from`` would
    cost a resumption per step on every put.
    """
    for attempt in range(2):
        # After a refused lease, a fresh one: another idle lease may be as stale (all of them,
        # after a server restart)
        lease = arena.take_lease(nbytes) if attempt == 0 else None
        if lease is None:
            try:
                lease = yield calls.staging_lease(max(nbytes, 1 << 20))
            except TierFull as exc:
                if exc.tier == "staging":
                    return None  # staging full: go over HTTP
                raise
            if colo.changed(arena, lease.get("segment"), "staging_segment"):
                with contextlib.suppress(KVStoreError):  # not ours to write: hand it back now
                    yield calls.drop_lease(lease["lease"])
                return None  # this put goes over HTTP; the next maps the new arena
            arena.add_lease(lease)
        try:
            written = yield write(lease)
            got = yield commit(lease, written)
        except Forbidden:  # the lease expired server-side: lease again once
            arena.drop_lease(lease)
            if attempt:
                raise
            continue
        except BaseException:
            arena.give_back(lease)
            raise
        arena.give_back(lease)
        stats.shm_puts += 1
        stats.last_medium = "shm"
        return got
    return None


def asking_for_slots(arena: Arena) -> bool:
    """Whether a put should ask for top-tier slots (pooled or reserved): not for ``NO_ROOM_RETRY_S``
    after the server said it has no room for them (then: straight through staging)."""
    return time.monotonic() >= arena.no_room_until


def _stored_tokens(body: bytes) -> int:
    return int(json.loads(body)["stored_tokens"])


def put_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, kv: torch.Tensor,
             stats: c.ClientStats, namespace: str) -> Flow[int | None]:
    """A co-located put of ``kv`` (not empty): into pool slots (one request), else slots the server
    reserved, where it offers them; else through a staging lease; None: go over HTTP instead.
    For ``NO_ROOM_RETRY_S`` after the server said its top tier has no room, straight to staging."""
    slots = spec.full_blocks(len(toks)) and asking_for_slots(arena)
    if arena.pooled_puts and slots:
        got = yield from pooled_put_flow(colo, arena, spec, toks, kv, stats, namespace)
        if got is not None or colo.current() is not arena:
            return got
    if arena.reserved_puts and slots:
        got = yield from reserved_put_flow(colo, arena, spec, toks, kv, stats)
        if got is not None or colo.current() is not arena:  # stored, or the server restarted: HTTP
            return got
    nbytes = spec.bytes_per_token * int(kv.shape[3])

    def write(lease: dict) -> Copy:
        return Copy(nbytes, arena.write_staging, lease, kv)

    def commit(lease: dict, written: Any) -> Call[int]:
        return Call("POST", f"/v1/kv/put-staged/{lease['lease']}", c.kv_parts(spec, toks, kv, with_kv=False),
                    KV_MEDIA, _stored_tokens)

    return (yield from staged_flow(colo, arena, nbytes, write, commit, stats))


def pool_slot_bytes(spec: KVSpec, namespace: str) -> int:
    """The pool slot size this client asks for: the raw frame of a block of ``spec`` at any depth
    (metadata grows with the depth's digits; the server shrinks each frame to its length)."""
    meta = block_meta(namespace, spec.fingerprint(), 10**15)
    return codec_mod.frame_size(spec.kv_shape(spec.block_tokens), spec.dtype, codec_mod.Codec.RAW, meta_len=len(meta))


def filled_kv(spec: KVSpec, toks: Any, kv: "torch.Tensor | c.BlockFill") -> torch.Tensor:
    """``kv`` as a tensor of the full blocks of ``toks``: a ``fill`` is asked for each block."""
    if isinstance(kv, torch.Tensor):
        return kv
    bt = spec.block_tokens
    out = spec.empty_kv(spec.full_blocks(len(toks)) * bt)
    ints = c.int_view(out)
    for d in range(spec.full_blocks(len(toks))):
        kv(d, ints[:, :, :, d * bt:(d + 1) * bt])
    return out


def lent_flow(colo: Colocation, arena: Arena, size: int, n: int,
              ask: Callable[[list[int]], Call[dict]]) -> Flow[list[dict] | None]:
    """``n`` pool slots of ``size`` bytes, asked for (``ask(returning)``: a grant request) because the
    pool lacks them; None when the server lends too few now (no room), takes no pooled puts
    (``arena.pooled_puts`` is cleared) or changed its arena. A grant that falls short while the
    pool holds idle slots of other sizes is asked for once more, giving those back: the server
    caps a pool's bytes across sizes, so a writer that moved from one spec to another would
    otherwise be lent nothing while it held the old spec's slots."""
    # Slots named in ``returning`` are dropped here before the request is sent, and not taken back
    # if it fails: the server may have given them back already, and a write into one would damage
    # whatever it holds next. At worst they stay lent, unused, until the pool is released or reaped.
    returning: list[dict] = []
    for _ in range(2):
        sent = time.monotonic()
        try:
            got = yield ask([s["offset"] for s in returning])
        except Forbidden:
            if not returning:
                raise
            arena.pool.clear()  # this pool is not what the server holds (reclaimed meanwhile): start over
            return None
        if got.get("reason") == RESERVE_OFF:
            arena.pooled_puts = False
            return None
        if colo.changed(arena, got.get("segment"), "segment"):
            return None  # the slots are another arena's: the server reclaims them (this put: HTTP)
        arena.pool.add(size, got["slots"], sent, float(got["ttl_s"]))
        slots = arena.pool.take(size, n)
        if slots is not None or returning:
            return slots
        returning = arena.pool.take_others(size)
        if not returning:
            return None  # no room for them all now
    return None


def pooled_put_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, kv: "torch.Tensor | c.BlockFill",
                    stats: c.ClientStats, namespace: str) -> Flow[int | None]:
    """A put in one request: the blocks the arena's key index does not show stored are written
    into pool slots this process holds, then ``/v1/kv/put-pooled`` publishes them and lends back
    as many slots (``kvstore.engine.reserved``, "Pooled puts"). A pool too small (the first put,
    a larger one) is topped up first: one request more. None when the server lends none (no
    room, or it takes no reserved puts): the caller puts another way. ``kv`` may be a
    ``fill(depth, dst)`` that writes each new block into its slot itself (one copy).
    """
    keys = block_hashes(spec, toks, namespace)
    hits = arena.indexed(keys, namespace) if arena.reader.indexed else [None] * len(keys)
    new = [d for d, hit in enumerate(hits) if hit is None]
    size = pool_slot_bytes(spec, namespace)
    pid = os.getpid()
    slots = arena.pool.take(size, len(new))
    if slots is None:
        try:
            slots = yield from lent_flow(colo, arena, size, len(new), lambda back: calls.pool_slots(
                spec, pid, arena.pool.name, max(len(new), 1), size, back))
        except InvalidInput:  # this server sizes slots otherwise (an older one): reservations only
            arena.pooled_puts = False
            return None
        if slots is None:
            return None
    fp = spec.fingerprint()
    blocks = [{"depth": d, "offset": slot["offset"], "length": slot["length"], "meta": block_meta(namespace, fp, d)}
              for d, slot in zip(new, slots)]
    try:
        checksums = (yield Copy(sum(b["length"] for b in blocks), arena.write_reserved, blocks, spec, kv)) if blocks else []
    except BaseException:  # the copy failed: nothing was sent, the slots are still this pool's
        arena.pool.untake(size, slots)
        raise
    sent = time.monotonic()
    try:
        answer = yield calls.put_pooled(spec, toks, pid, arena.pool.name,
                                        [(b["depth"], b["offset"], k) for b, k in zip(blocks, checksums)],
                                        len(blocks), size)
    except Forbidden:  # the pool was reclaimed (idle, or a server restart): its slots are not ours
        arena.pool.clear()
        return None
    except (CorruptFrame, InvalidInput, QuotaExceeded):  # refused: the server put the slots back in the pool
        arena.pool.untake(size, slots)
        raise
    if colo.changed(arena, answer.get("segment"), "segment"):
        return None
    arena.pool.add(size, answer["slots"], sent, float(answer["ttl_s"]))
    if answer["missing"]:  # evicted between the index read and the put: the whole put the checked way
        return (yield from reserved_put_flow(colo, arena, spec, toks, filled_kv(spec, toks, kv), stats))
    stats.shm_puts += 1
    stats.last_medium = "shm"
    return int(answer["stored_tokens"])


def reserved_put_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, kv: torch.Tensor,
                      stats: c.ClientStats) -> Flow[int | None]:
    """A put whose frames this client writes straight into top-tier slots the server reserved
    (``kvstore.engine.reserved``): reserve, encode each new block into its slot (copy and hash in one
    pass), commit the checksums. None when the server reserved nothing (no room, or it takes
    no reserved puts): the caller puts another way.

    A failure while writing aborts the reservation; the server also reclaims it when this
    process exits, or after its time runs out.
    """
    res = yield calls.reserve_put(spec, toks, os.getpid())
    if res.get("reservation") is None:
        if res.get("reason") != RESERVE_NO_ROOM:
            arena.reserved_puts = False  # the server takes none: stop asking
        else:  # a full store: its placement puts new blocks below the top tier for now
            arena.no_room_until = time.monotonic() + NO_ROOM_RETRY_S
        return None
    if colo.changed(arena, res.get("segment"), "segment"):
        with contextlib.suppress(KVStoreError):
            yield calls.abort_put(res["reservation"])
        return None
    blocks = res["blocks"]
    if not blocks:  # every block is stored already
        stored = int(res["n_tokens"])
    else:
        try:
            checksums = yield Copy(sum(b["length"] for b in blocks), arena.write_reserved, blocks, spec, kv)
        except BaseException:
            with contextlib.suppress(KVStoreError):
                yield calls.abort_put(res["reservation"])
            raise
        stored = yield calls.commit_put(res["reservation"], checksums)
    stats.shm_puts += 1
    stats.last_medium = "shm"
    return stored


def pooled_blocks_flow(colo: Colocation, arena: Arena, keys: list[BlockHash], offsets: list[int],
                       writer: c.BlockWriter, stats: c.ClientStats) -> Flow[int | None]:
    """``put_blocks_with`` in one request: each frame written straight into a pool slot of this
    process, then ``/v1/blocks/put-pooled`` publishes them by key and lends as many slots back
    (a first put asks for slots first). None when the server lends none: put another way."""
    sizes = [offsets[i + 1] - offsets[i] for i in range(len(keys))]
    size = -(-max(sizes) // 4096) * 4096  # one slot size for a backend's pages (their metadata differ a little)
    pid, name = os.getpid(), arena.pool.name
    slots = arena.pool.take(size, len(keys))
    if slots is None:
        slots = yield from lent_flow(colo, arena, size, len(keys),
                                     lambda back: calls.put_pooled_blocks(pid, name, [], len(keys), size, back))
        if slots is None:
            return None
    try:
        checksums = yield Copy(offsets[-1], arena.write_frames, slots, sizes, writer)
    except BaseException:  # the writer failed: nothing was sent, the slots are still this pool's
        arena.pool.untake(size, slots)
        raise
    sent = time.monotonic()
    try:
        answer = yield calls.put_pooled_blocks(pid, name, [(k.hex(), s["offset"], x) for k, s, x
                                                           in zip(keys, slots, checksums)], len(keys), size)
    except Forbidden:  # the pool was reclaimed (idle, or a server restart): its slots are not ours
        arena.pool.clear()
        return None
    except (CorruptFrame, InvalidInput, QuotaExceeded):  # refused: the server put the slots back in the pool
        arena.pool.untake(size, slots)
        raise
    if colo.changed(arena, answer.get("segment"), "segment"):
        return None
    arena.pool.add(size, answer["slots"], sent, float(answer["ttl_s"]))
    stats.shm_puts += 1
    stats.last_medium = "shm"
    return int(answer["stored"])


def put_blocks_flow(colo: Colocation, arena: Arena | None, keys: list[BlockHash], offsets: list[int],
                    writer: c.BlockWriter, make_room: bool, stats: c.ClientStats) -> Flow[int]:
    """``put_blocks_with``: into pool slots (one request) or through a staging lease when
    co-located, else one HTTP batch."""
    if arena is not None and arena.pooled_puts:
        stored = yield from pooled_blocks_flow(colo, arena, keys, offsets, writer, stats)
        if stored is not None:
            return stored
        arena = colo.current()  # None after a restart: this put goes over HTTP
    if arena is not None:
        def fill(lease: dict) -> list[dict]:
            view = memoryview(arena.staging)[lease["offset"]:lease["offset"] + offsets[-1]]
            try:
                return [{"key": key.hex(), "offset": offsets[i], "length": writer(i, view[offsets[i]:offsets[i + 1]])}
                        for i, key in enumerate(keys)]
            finally:
                view.release()

        def commit(lease: dict, blocks: list[dict]) -> Call[int]:
            return calls.json_call("POST", f"/v1/blocks/put-staged/{lease['lease']}",
                                   {"blocks": blocks, "make_room": make_room}, parse=lambda a: int(a["stored"]))

        stored = yield from staged_flow(colo, arena, offsets[-1], lambda lease: Copy(offsets[-1], fill, lease),
                                        commit, stats)
        if stored is not None:
            return stored
    buf = bytearray(offsets[-1])
    view = memoryview(buf)
    items = []
    for i, key in enumerate(keys):
        n = writer(i, view[offsets[i]:offsets[i + 1]])
        items.append((key, view[offsets[i]:offsets[i] + n]))
    return (yield calls.put_blocks(items, make_room))


