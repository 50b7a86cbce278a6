"""The co-located path, written once for both clients: flows that yield what they need done.

On the server's host, KV moves through the server's shared memory: gets copy out
of its arena under each slot's seqlock, puts write into a staging lease and send
one small commit. The logic (which requests, which copies, what to do when a
lease expired or the server restarted) is the same for ``KVClient`` and
``AsyncKVClient``; only how a request is sent and where a copy runs differ. So
each operation here is a generator (a *flow*) that yields steps: a
``client_sdk.calls.Call`` to send, or a ``Copy`` to run, and gets the answer back
(an error answer is thrown into it). ``drive`` runs a flow with a blocking
transport; ``adrive`` with an async one, running large copies off the event loop. Both
step through a flow with ``Steps``, which the planner's transfers (``client_sdk.planning``)
and the layer streams (``client_sdk.layers``) are run with too.

``Colocation`` is the state both clients keep: whether the server's arena can be
mapped here, and the mapping. An arena retired after a server restart is unmapped once the
last call or stream reading it (another thread's, a layer stream) lets go of it.
"""

from __future__ import annotations

import contextlib
import os
import json
import logging
import time
from typing import Any, Awaitable, Callable, Generator, Sequence, TypeVar

import torch

from client_sdk import _common as c
from client_sdk.arena import Arena
from client_sdk import calls
from client_sdk.calls import Call
from kvstore import codec as codec_mod
from kvstore.errors import Forbidden, InvalidInput, KVStoreError, ServiceError, TierFull
from kvstore.keys import BlockHash, block_hashes, block_meta
from kvstore.spec import KVSpec
from kvstore.wire.rest import KV_MEDIA, RESERVE_NO_ROOM, RESERVE_OFF, host_id

__all__ = ["Copy", "Steps", "Colocation", "drive", "adrive", "get_flow", "missing_flow", "cached_get", "put_flow",
           "staged_flow", "frames_flow", "blocks_exist_flow", "get_blocks_into_flow", "put_blocks_flow"]

log = logging.getLogger("kvstore.client")

T = TypeVar("T")


class Copy:
    """A step: ``fn(*args)``, a copy of ``nbytes`` in or out of the arena (off the loop when large)."""

    __slots__ = ("nbytes", "fn", "args")

    def __init__(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> None:
        self.nbytes, self.fn, self.args = nbytes, fn, args


Flow = Generator["Call[Any] | Copy", Any, T]


class Steps:
    """A flow run one step at a time, the loop written once for every driver.

    Iterating yields the flow's steps; the driver runs each (its own way: blocking,
    awaited, in a thread) and sets ``answer`` to what it gave, or ``error`` to what it
    raised, before asking for the next (an error is thrown into the flow, which may
    handle it). ``result`` is the flow's return value once the iteration ends.
    """

    __slots__ = ("flow", "answer", "error", "result")

    def __init__(self, flow: Generator[Any, Any, Any]) -> None:
        self.flow = flow
        self.answer: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> "Steps":
        return self

    def __next__(self) -> Any:
        error, self.error = self.error, None
        try:
            return self.flow.send(self.answer) if error is None else self.flow.throw(error)
        except StopIteration as stop:
            self.result = stop.value
            raise


def drive(flow: Flow[T], run: Callable[[Call[Any]], Any]) -> T:
    """Run ``flow`` to its result, sending its calls with ``run`` and its copies inline."""
    steps = Steps(flow)
    try:
        for step in steps:
            try:
                steps.answer = run(step) if type(step) is Call else step.fn(*step.args)
            except Exception as exc:  # the flow decides: it may handle it (an expired lease) or not
                steps.error = exc
    except BaseException:
        flow.close()  # a flow stopped early (KeyboardInterrupt...) still gives back what it holds
        raise
    return steps.result


async def adrive(flow: Flow[T], run: Callable[[Call[Any]], Awaitable[Any]],
                 off_loop: Callable[..., Awaitable[Any]]) -> T:
    """``drive`` with an async transport; each copy goes through ``off_loop(nbytes, fn, *args)``."""
    steps = Steps(flow)
    try:
        for step in steps:
            try:
                steps.answer = await (run(step) if type(step) is Call else off_loop(step.nbytes, step.fn, *step.args))
            except Exception as exc:
                steps.error = exc
    except BaseException:  # cancelled: the flow gives back what it holds
        flow.close()
        raise
    return steps.result


class Colocation:
    """Whether this client reads the server's shm arena, and its mapping.

    Args:
        url: the server's (for log lines).
        colocated: None picks shm when it works; False never (remote); True requires it.
    """

    def __init__(self, url: str, colocated: bool | None) -> None:
        self.url = url
        self.colocated = colocated
        self.arena: Arena | None = None
        self.decided: str | None = None
        """"shm" or "http" once picked; None again after a restart retired the arena."""
        self.on_pending: Callable[[], None] | None = None
        """Handed to each arena's access log (``AccessLog.on_pending``): the client's report timer."""

    @property
    def undecided(self) -> bool:
        return self.colocated is not False and self.decided is None

    def pick_flow(self) -> Flow[str]:
        """Ask the server where it runs and map its arena when it is on this host; "shm" or "http".

        Raises:
            ServiceError: ``colocated=True`` and the arena cannot be used here.
        """
        info = yield calls.info()
        offer = (info or {}).get("colocated")
        reason = None
        if not offer:
            reason = "the server offers no shm path"
        elif offer.get("host_id") != host_id():
            reason = "the server runs on another host"
        else:
            try:
                self.arena = Arena(offer["segment"], offer["staging_segment"],
                                   reserved_puts=bool(offer.get("reserved_puts")))
                self.arena.accesses.on_pending = self.on_pending
                granted = (info or {}).get("namespaces")
                # the key index answers only for namespaces this token may read: the server checks the rest
                self.arena.namespaces = None if granted is None else frozenset(granted)
                self.decided = "shm"
                return "shm"
            except KVStoreError as exc:
                reason = f"its shm segments cannot be opened here ({exc})"
        if self.colocated:
            raise ServiceError(f"colocated=True but {reason}")
        self.decided = "http"
        return "http"

    def current(self) -> Arena | None:
        """The mapped arena; None when shm is not used (or a restart retired it: pick again)."""
        return self.arena if self.decided == "shm" else None

    def changed(self, arena: Arena, named: Any, which: str) -> bool:
        """True when the server named other segments than ``arena`` maps: it restarted, and what
        this client would write into (or read from) its old mapping is no longer the server's
        memory. The arena is retired and the next call maps the server's new one."""
        if named == getattr(arena, which):
            return False
        log.info("kvstore at %s serves from other shm segments (a restart?): mapping them again", self.url)
        if self.arena is arena:
            arena.retire()  # unmapped once the last call or stream reading it is done
            self.arena, self.decided = None, None
        return True

    def close_flow(self) -> Flow[None]:
        """Hand back every staging lease and the put pool (each expires on its own otherwise) and unmap."""
        if self.arena is not None:
            for lease in self.arena.leases:
                with contextlib.suppress(KVStoreError):
                    yield calls.drop_lease(lease["lease"])
            if self.arena.pool.used:  # else the server reclaims it once it sees no put for its ttl_s
                with contextlib.suppress(KVStoreError):
                    yield calls.release_pool(os.getpid(), self.arena.pool.name)
                self.arena.pool.clear()
            self.arena.close()
            self.arena = None


# -- gets ------------------------------------------------------------------------------------


def cached_get(arena: Arena, spec: KVSpec, toks: Any, out: Any, pool: c.TensorPool, out_views: c.OutViews,
               namespace: str, stats: c.ClientStats) -> tuple[torch.Tensor, int] | None:
    """A get whose every block's slot is known with no request (remembered, or in the arena's
    shared key index), read with none; None when one is in neither or went stale (then
    ``get_flow`` asks the server)."""
    cached = arena.blocks_for(spec, toks, namespace)
    if cached is None:
        return None
    bt = spec.block_tokens
    if out is None:
        kv, dst = pool.tensor_and_ints(spec.kv_shape(len(cached) * bt), spec.torch_dtype)
    else:
        kv, dst = out_views.get(spec, len(cached) * bt, out)
    if arena.fill_from_handles(cached, kv, bt, stats, dst):
        arena.handles.forget(cached)
        return None
    arena.served_from_cache(cached, bt, stats)
    return kv, len(cached) * bt


def get_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, out: Any, pool: c.TensorPool,
             stats: c.ClientStats) -> Flow[tuple[torch.Tensor, int]]:
    """A co-located get: the server names the prefix's slots, each is copied out under its
    seqlock; blocks not in the arena come over HTTP in one batch."""
    bt = spec.block_tokens
    answer = yield calls.kv_call("/v1/kv/handles", spec, toks, None)
    c.warn_hint(stats, spec, answer.get("hint"))
    blocks = answer["blocks"]
    kv = c.result_tensor(spec, len(blocks) * bt, out, pool)
    if colo.changed(arena, answer.get("segment"), "segment"):
        missing: Sequence[int] = range(len(blocks))  # its handles name slots of another arena
    else:
        arena.handles.remember(blocks)
        missing = yield Copy(spec.bytes_per_token * len(blocks) * bt, arena.fill_from_handles, blocks, kv, bt, stats)
    good = len(blocks)
    if missing:  # rare: a nested flow only then
        good = yield from missing_flow(blocks, missing, kv, bt, stats)
    stats.shm_gets += 1
    stats.last_medium = "shm"
    if good < len(blocks):
        kv = kv[:, :, :, :good * bt].clone() if out is None else c.result_tensor(spec, good * bt, out)
    return kv, good * bt


def missing_flow(blocks: Sequence[dict], missing: Sequence[int], kv: torch.Tensor, bt: int,
                 stats: c.ClientStats) -> Flow[int]:
    """The blocks of a co-located read that the arena did not have, over HTTP in one batch, into
    ``kv``; how many blocks of the prefix are in ``kv`` then (it stops at the first that is gone)."""
    want = {blocks[i]["key"]: i for i in missing}
    body = yield calls.raw_blocks(list(want))
    arrived = c.fill_from_batch(body, want, kv, bt, {})
    stats.shm_blocks_fetched_over_http += len(arrived)
    lost = sorted(set(missing) - arrived)
    return lost[0] if lost else len(blocks)


def frames_flow(arena: Arena, keys: Sequence[BlockHash], namespace: str) -> Flow[list[Any]]:
    """Frames of ``keys``: from the arena where it holds them (this namespace's), the rest over HTTP."""
    frames: list[Any] = []
    for key in keys:
        handle = arena.reader.find(key)
        frame = arena.reader.read(handle) if handle is not None else None
        if frame is not None and not c.frame_in_namespace(frame, namespace):
            frame = None
        frames.append(frame)
    missing = [i for i, f in enumerate(frames) if f is None]
    if missing:
        got = yield calls.get_blocks([keys[i] for i in missing])
        for i, frame in zip(missing, got):
            frames[i] = frame
    return frames


# -- puts ------------------------------------------------------------------------------------


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


def _stored_tokens(body: bytes) -> int:
    return int(json.loads(body)["stored_tokens"])


def put_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, kv: torch.Tensor,
             stats: c.ClientStats, namespace: str) -> Flow[int | None]:
    """A co-located put of ``kv`` (not empty): into pool slots (one request), else slots the server
    reserved, where it offers them; else through a staging lease; None: go over HTTP instead."""
    if arena.pooled_puts and spec.full_blocks(len(toks)):
        got = yield from pooled_put_flow(colo, arena, spec, toks, kv, stats, namespace)
        if got is not None or colo.current() is not arena:
            return got
    if arena.reserved_puts and spec.full_blocks(len(toks)):
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
    hits = arena.reader.look_up(keys) if arena.reader.indexed else [None] * len(keys)
    new = [d for d, hit in enumerate(hits) if hit is None]
    size = pool_slot_bytes(spec, namespace)
    pid = os.getpid()
    slots = arena.pool.take(size, len(new))
    if slots is None:
        sent = time.monotonic()
        try:
            got = yield calls.pool_slots(spec, pid, arena.pool.name, max(len(new), 1), size)
        except InvalidInput:  # this server sizes slots otherwise (an older one): reservations only
            arena.pooled_puts = False
            return None
        if got.get("reason") == RESERVE_OFF:
            arena.pooled_puts = False
            return None
        if colo.changed(arena, got.get("segment"), "segment"):
            return None  # the slots are another arena's: the server reclaims them (this put: HTTP)
        arena.pool.add(size, got["slots"], sent, float(got["ttl_s"]))
        slots = arena.pool.take(size, len(new))
        if slots is None:  # no room for them all now
            return None
    fp = spec.fingerprint()
    blocks = [{"depth": d, "offset": slot["offset"], "length": slot["length"], "meta": block_meta(namespace, fp, d)}
              for d, slot in zip(new, slots)]
    checksums = (yield Copy(sum(b["length"] for b in blocks), arena.write_reserved, blocks, spec, kv)) if blocks else []
    sent = time.monotonic()
    try:
        answer = yield calls.put_pooled(spec, toks, pid, arena.pool.name,
                                        [(b["depth"], b["offset"], k) for b, k in zip(blocks, checksums)],
                                        len(blocks), size)
    except Forbidden:  # the pool was reclaimed (idle, or a server restart): its slots are not ours
        arena.pool.clear()
        return None
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


def put_blocks_flow(colo: Colocation, arena: Arena | None, keys: list[BlockHash], offsets: list[int],
                    writer: c.BlockWriter, make_room: bool, stats: c.ClientStats) -> Flow[int]:
    """``put_blocks_with``: through a staging lease when co-located, else one HTTP batch."""
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


# -- blocks by key ------------------------------------------------------------------------------


def blocks_exist_flow(colo: Colocation, arena: Arena | None, keys: Sequence[BlockHash],
                      namespace: str) -> Flow[list[bool]]:
    """Whether each key holds a block of this namespace. Co-located, remembered slots whose
    generation stands answer without a request, and the answer's slots are remembered."""
    hexes = calls.hexes(keys)
    if arena is not None and hexes:
        present = [b is not None for b in arena.blocks_by_key(hexes, [bytes.fromhex(h) for h in hexes], namespace)]
        ask = [i for i, here in enumerate(present) if not here]
        if not ask:
            return present
        answer = yield calls.block_handles([hexes[i] for i in ask], count=False)
        if not colo.changed(arena, answer.get("segment"), "segment"):
            arena.handles.remember(answer["blocks"])
            for i, b in zip(ask, answer["blocks"]):
                present[i] = b.get("checksum") is not None
            return present
    return (yield calls.blocks_exist(keys))


def get_blocks_into_flow(colo: Colocation, arena: Arena | None, keys: list[BlockHash], sink: c.BlockSink,
                         namespace: str, stats: c.ClientStats, report: Callable[[], None]) -> Flow[list[bool]]:
    """``get_blocks_into``: remembered slots read with no request, the rest named by one
    ``/v1/blocks/handles`` request and read in place, what the arena lacks over HTTP."""
    done = [False] * len(keys)
    absent: set[int] = set()
    if arena is not None and keys:
        hexes = [k.hex() for k in keys]
        served, ask = [], []
        for i, b in enumerate(arena.blocks_by_key(hexes, keys, namespace)):
            if b is not None and arena.read_block(b["handle"], b.get("checksum"), namespace, i, sink, stats):
                done[i] = True
                served.append(b)
            else:
                ask.append(i)
        if served:  # the server never saw these reads: report them, for placement's heat
            arena.accesses.add(served, 0, 0)
            if arena.accesses.due():
                report()
        if ask:
            answer = yield calls.block_handles([hexes[i] for i in ask])
            if not colo.changed(arena, answer.get("segment"), "segment"):
                arena.handles.remember(answer["blocks"])
                for i, b in zip(ask, answer["blocks"]):
                    h = b.get("handle")
                    if h is None:
                        if b.get("checksum") is None:
                            absent.add(i)  # not stored: nothing to fetch
                        continue
                    # the checksum the server indexed: a slot reused meanwhile cannot pass for it
                    done[i] = arena.read_block(h, b.get("checksum"), namespace, i, sink, stats)
        stats.shm_gets += 1
        stats.last_medium = "shm"
    missing = [i for i, ok in enumerate(done) if not ok and i not in absent]
    if missing:
        frames = yield calls.get_blocks([keys[i] for i in missing])
        for i, frame in zip(missing, frames):
            if frame is not None and c.give_frame(memoryview(frame), namespace, i, sink, None):
                done[i] = True
    return done
