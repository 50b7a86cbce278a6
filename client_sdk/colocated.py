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
import logging
from typing import Any, Awaitable, Callable, Generator, Sequence, TypeVar

import numpy as np
import torch

from client_sdk import _common as c
from client_sdk.arena import Arena
from client_sdk import calls
from client_sdk.calls import Call
from kvstore.errors import KVStoreError, ServiceError
from kvstore.keys import BlockHash
from kvstore.spec import KVSpec
from kvstore.wire.rest import host_id

__all__ = ["Copy", "Steps", "Colocation", "drive", "adrive", "get_flow", "missing_flow", "cached_get", "frames_flow",
           "blocks_exist_flow", "get_blocks_into_flow"]

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
                socket_path = offer.get("commit_socket")
                self.arena.commit_socket = socket_path if isinstance(socket_path, str) else None
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
    bt = spec.block_tokens

    def result(n_blocks: int) -> tuple[torch.Tensor, np.ndarray]:
        if out is None:
            return pool.tensor_and_ints(spec.kv_shape(n_blocks * bt), spec.torch_dtype)
        return out_views.get(spec, n_blocks * bt, out)
    got = arena.read_cached(spec, toks, namespace, result, stats)
    if got is None:
        return None
    blocks, kv = got
    arena.served_from_cache(blocks, bt, stats)
    return kv, len(blocks) * bt


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


# -- blocks by key ------------------------------------------------------------------------------


def blocks_exist_flow(colo: Colocation, arena: Arena | None, keys: Sequence[BlockHash],
                      namespace: str, ask_server: bool = True) -> Flow[list[bool]]:
    """Whether each key holds a block of this namespace. Co-located, remembered slots whose
    generation stands and the arena's key index answer without a request, and the answer's
    slots are remembered; ``ask_server=False`` answers from them alone."""
    hexes = calls.hexes(keys)
    if arena is not None and hexes:
        present = [b is not None for b in arena.blocks_by_key(hexes, [bytes.fromhex(h) for h in hexes], namespace)]
        ask = [i for i, here in enumerate(present) if not here]
        if not ask or (not ask_server and arena.reader.indexed):  # an arena with no index: ask
            return present
        answer = yield calls.block_handles([hexes[i] for i in ask], count=False)
        if not colo.changed(arena, answer.get("segment"), "segment"):
            arena.handles.remember(answer["blocks"])
            for i, b in zip(ask, answer["blocks"]):
                present[i] = b.get("checksum") is not None
            return present
    return (yield calls.blocks_exist(keys))


def read_in_place(arena: Arena, todo: Sequence[tuple[int, dict, int | None]], namespace: str,
                  sink: c.BlockSink, stats: c.ClientStats) -> list[int]:
    """Hand each ``(i, slot handle, checksum)`` block to ``sink`` from the arena; the ``i`` read.

    Slots the server has not verified yet go last, last to first: its verifier hashes a commit's
    frames first to last right behind it, so a batch read just after its put (a cache's write,
    then a prefetch) finds more of them verified by then, and where it still hashes, the two meet
    in the middle instead of both hashing every frame (read in order, a fifth of such a batch was
    hashed by both: 128 pages of 256 KiB). ``sink`` takes blocks in any order.
    """
    read, later = [], []
    for i, h, checksum in todo:
        got = arena.read_block(h, checksum, namespace, i, sink, stats, defer=True)
        if got is None:
            later.append((i, h, checksum))
        elif got:
            read.append(i)
    for i, h, checksum in reversed(later):
        if arena.read_block(h, checksum, namespace, i, sink, stats):
            read.append(i)
    return read


def get_blocks_into_flow(colo: Colocation, arena: Arena | None, keys: list[BlockHash], sink: c.BlockSink,
                         namespace: str, stats: c.ClientStats, report: Callable[[], None]) -> Flow[list[bool]]:
    """``get_blocks_into``: remembered slots read with no request, the rest named by one
    ``/v1/blocks/handles`` request and read in place, what the arena lacks over HTTP."""
    done = [False] * len(keys)
    absent: set[int] = set()
    if arena is not None and keys:
        hexes = [k.hex() for k in keys]
        found = arena.blocks_by_key(hexes, keys, namespace)
        read = read_in_place(arena, [(i, b["handle"], b.get("checksum")) for i, b in enumerate(found) if b is not None],
                             namespace, sink, stats)
        for i in read:
            done[i] = True
        served = [found[i] for i in read]
        ask = [i for i, ok in enumerate(done) if not ok]
        if served:  # the server never saw these reads: report them, for placement's heat
            arena.accesses.add(served, 0, 0)
            if arena.accesses.due():
                report()
        if ask:
            answer = yield calls.block_handles([hexes[i] for i in ask])
            if not colo.changed(arena, answer.get("segment"), "segment"):
                arena.handles.remember(answer["blocks"])
                named = []
                for i, b in zip(ask, answer["blocks"]):
                    if b.get("handle") is not None:
                        # the checksum the server indexed: a slot reused meanwhile cannot pass for it
                        named.append((i, b["handle"], b.get("checksum")))
                    elif b.get("checksum") is None:
                        absent.add(i)  # not stored: nothing to fetch
                for i in read_in_place(arena, named, namespace, sink, stats):
                    done[i] = True
        stats.shm_gets += 1
        stats.last_medium = "shm"
    missing = [i for i, ok in enumerate(done) if not ok and i not in absent]
    if missing:
        frames = yield calls.get_blocks([keys[i] for i in missing])
        for i, frame in zip(missing, frames):
            if frame is not None and c.give_frame(memoryview(frame), namespace, i, sink, None):
                done[i] = True
    return done
