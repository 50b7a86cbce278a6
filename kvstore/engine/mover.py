"""Carrying out placement's orders: copy, switch the index, then delete.

A move never leaves a window in which the index names a frame that is gone:

1. read the frame from the source tier (a stable copy) and re-encode it when the
   destination wants another codec (int8 in cold tiers, raw again on the way
   up), outside any claim;
2. make room in the destination (moves of *other* keys; still no claim held);
3. under the key's claim, and only if the index entry is still the one read:
   write the destination, switch the entry, delete the source, tell placement.
   A concurrent put, delete or move of the same key either wins before the
   claim (the move gives up) or waits for it (and finds the move complete).

A crash inside step 3 leaves two copies and loses nothing: a durable tier's
copy is re-indexed at the next start (``kvstore/engine/recovery.py``).

A promotion out of a durable private tier copies: the durable frame stays where it is and the
entry remembers it (``IndexEntry.kept``, charged to that tier by placement), so a block acknowledged
as durable stays so while it is served from above, and a crash or restart finds it there. A later
demotion back into that tier switches to the copy with no write; a delete, eviction or rewrite
deletes it too (``EngineCore.drop_kept``). A reader that
looked the entry up before step 3 may find the source gone; it looks again
(``KVStore.get_kv`` re-reads the index once on a miss).

The background thread plans every ``interval_s`` and spends at most ``move_bytes_per_s`` (a
token bucket) and ``move_cpu_frac`` of the interval's CPU time, so placement never starves the
data path: a tier far above its watermark drains over several rounds.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore
from kvstore.engine.index import Kept
from kvstore.errors import FrameError, InvalidKV, TierError
from kvstore.engine.placement import MoveOrder, RoomHold
from kvstore.engine.recode import Recoder
from kvstore.engine.shared import Replica, SharedTier

__all__ = ["Mover"]

log = logging.getLogger("kvstore.engine.mover")

AHEAD_MOVES = 32
"""Orders looked at, at a time, for demotions to re-encode together."""

MOVE_CPU_S = 50e-6
"""A first guess at one move's CPU time (a small frame between memory tiers), until rounds measure it."""

YIELD_EVERY_S = 1e-3
"""CPU time the mover works between two hand-overs of the GIL."""

YIELD_S = 1e-4
"""How long a hand-over sleeps: long enough for a waiting thread to wake and take the GIL."""

PLAN_MIN = 64
"""Orders planned per tier in a round, at least, however dear a move has been."""


@dataclass(slots=True)
class _Ahead:
    """A demotion's frame, re-encoded for its destination before its turn came."""

    entry: object
    """The index entry the frame was read from: used only if the key still has it."""
    frame: bytearray
    checksum: int


class Mover:
    """Executes ``MoveOrder``s for one store; optionally in a background thread.

    Args:
        core: the store's engine core (index, tiers, codecs).
        shared: the store's shared tier, if it has one: moves into and out of it copy.
        on_move: told of every move done, with the frame's new size.
        recoder: where a raw block demoted raw into a tier that wants int8 is owed its re-encode
            (``Recoder.spills_raw`` decides, within its debt's bound); None: every demotion
            encodes for its destination itself.
    """

    def __init__(self, core: EngineCore, shared: SharedTier | None, *,
                 on_move: Callable[[MoveOrder, int], None] | None = None,
                 recoder: Recoder | None = None) -> None:
        self._core = core
        self._recoder = recoder
        self._shared = shared
        self._placement = core.placement
        self._on_move = on_move
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._tokens = float(self._placement.config.move_bytes_per_s)
        self._refilled = time.monotonic()
        self._move_cpu_s = MOVE_CPU_S  # a move's CPU time, as rounds measure it

    # -- one move ----------------------------------------------------------------

    def execute(self, order: MoveOrder, *, depth: int = 0, ahead: "_Ahead | None" = None,
                force_room: bool = False) -> bool:
        """Carry out ``order``; False when it no longer applies or the destination refused it.

        Reading and re-encoding happen outside the key's claim; writing the
        destination, switching the index, deleting the source and telling
        placement all happen inside it, after checking the entry is still the
        one we read. So a concurrent put, delete or move of the same key either
        wins outright or finds the move complete; it never sees a half.
        ``ahead``: the frame already re-encoded for the destination (``_encode_ahead``), used
        only if the entry is still the one it was read from. ``force_room``: room for the frame is
        made in the destination whatever placement counts free there (a retry of a refused move).
        """
        core = self._core
        entry = core.entry(order.key)
        if entry is not None and entry.kept is not None and entry.kept.tier == order.dst and entry.tier == order.src:
            return self._commit(entry, order, None)  # back where its durable copy stayed: switch, copy nothing
        if ahead is not None and entry is ahead.entry and order.dst is not None:
            room = self._hold_room(core.tier(order.dst), len(ahead.frame), depth, force_room)
            try:
                return self._commit(entry, order, (ahead.frame, Codec.INT8, ahead.checksum))
            finally:
                if room is not None:
                    room.release()
        if entry is None:
            self._placement.removed(order.key)
            return False
        if entry.tier != order.src:  # placement's record is behind: resync it
            self._placement.admitted(order.key, entry.tier, entry.size, access=False, depth=entry.depth)
            return False
        if order.dst is None:
            with core.claim(order.key):
                if self._placement.is_held(order.key) or core.unpublish(order.key, expected=entry, reason="evicted") is None:
                    return False
                core.delete_frame(entry)
                self._done(order, 0)
            return True
        src, dst = core.tier(order.src), core.tier(order.dst)
        shared = self._shared
        to_shared = shared is not None and dst.name == shared.name
        if to_shared and shared.replica(order.key) is not None:
            return self._commit(entry, order, None)  # already there (write-through): switch, copy nothing
        try:
            frame = src.get(order.key)
        except TierError as exc:
            log.warning("move of %s: tier %s failed a get (%s)", order.key.hex(), src.name, exc)
            return False
        if frame is None:
            core.drop(entry, corrupt=False)
            return False
        raw = self._demotes_raw(order, entry, len(frame))
        try:
            frame, codec, checksum = self._recode(frame, entry.codec, Codec.RAW if raw else core.codec_of(dst.name))
        except (FrameError, InvalidKV) as exc:
            log.warning("move of %s: frame in %s is damaged (%s); dropped", order.key.hex(), src.name, exc)
            core.drop(entry, corrupt=True)
            return False
        room = self._hold_room(dst, len(frame), depth, force_room)  # outside the claim: it moves other keys
        try:
            moved = self._commit(entry, order, (frame, codec, checksum))
        finally:
            if room is not None:
                room.release()
        if moved and raw:
            self._recoder.owe(order.key, len(frame), demoted=True)  # int8 comes in the puts' next gap
        return moved

    def _demotes_raw(self, order: MoveOrder, entry, nbytes: int) -> bool:
        """Whether this demotion copies a raw frame down as it is and owes its re-encode: a
        demotion costs 2.6x as much CPU when it encodes int8 itself (109 against 286 us a 64 KiB
        block, stop 53), and it runs beside the puts that made it necessary; the re-encoder pays
        in their gaps (``kvstore.engine.recode``)."""
        return (self._recoder is not None and entry.codec is Codec.RAW and order.dst is not None
                and self._downward(order) and self._recoder.spills_raw(order.dst, nbytes))

    def _commit(self, entry, order: MoveOrder, copy: tuple | None) -> bool:
        """Under the key's claim: write ``copy`` to the destination (None: use the durable copy
        the entry kept there, or the shared replica), switch the index, drop the source unless
        it is a durable copy to keep, record the move."""
        core, shared = self._core, self._shared
        src, dst = core.tier(order.src), core.tier(order.dst)
        leaving_shared = shared is not None and src.name == shared.name
        with core.claim(order.key):
            if core.entry(order.key) is not entry:  # rewritten, moved or deleted meanwhile: it wins
                return False
            if self._downward(order) and self._placement.is_held(order.key):
                return False  # pinned or leased since the order was planned
            kept = entry.kept
            if copy is None and kept is not None and kept.tier == dst.name:
                size, codec, checksum, kept = kept.size, kept.codec, kept.checksum, None
            elif copy is None:
                replica = shared.replica(order.key)
                if replica is None:  # deleted meanwhile
                    return False
                size, codec, checksum = replica.size, replica.codec, replica.checksum
            else:
                frame, codec, checksum = copy
                size = len(frame)
                try:
                    dst.put(order.key, frame)
                except TierError as exc:  # full after all, or failing: the entry stays where it is
                    log.info("move of %s to %s refused: %s", order.key.hex(), dst.name, exc)
                    return False
                if shared is not None and dst.name == shared.name:
                    shared.remember(order.key, Replica(size, codec, checksum))
                    shared.demoted(size)
                if kept is not None and kept.tier == dst.name:  # written over by this frame
                    kept = None
            # Other nodes read the shared tier: leaving it is a copy, never a delete.
            if leaving_shared:
                shared.remember(order.key, Replica(entry.size, entry.codec, entry.checksum))
            keep = not leaving_shared and src.durable and self._upward(order)
            if keep:
                if kept is not None:  # a copy further down: the nearer one is enough
                    self._delete_quietly(core.tier(kept.tier), order.key)
                kept = Kept(src.name, entry.size, entry.codec, entry.checksum)
            core.switch(replace(entry, tier=dst.name, size=size, codec=codec, checksum=checksum, kept=kept),
                        src=src.name, reason=order.reason)
            if not leaving_shared and not keep:
                self._delete_quietly(src, order.key)
            self._done(order, size)
            if entry.kept is not None and kept is not entry.kept:
                self._placement.unkeep(order.key)
            if keep:
                self._placement.keep(order.key, src.name, entry.size)
        return True

    def _upward(self, order: MoveOrder) -> bool:
        names = self._core.tier_names
        return order.dst is not None and names.index(order.dst) < names.index(order.src)

    def _downward(self, order: MoveOrder) -> bool:
        """A placement demotion (an operator's migrate may move held blocks; pins stop placement only)."""
        names = self._core.tier_names
        return not order.reason.startswith("migrated") and names.index(order.dst) > names.index(order.src)

    def _hold_room(self, dst, nbytes: int, depth: int, force: bool = False) -> RoomHold | None:
        """Room in ``dst`` for the frame being moved, held until it is written (None: the chain of
        moves making room for moves is as deep as there are tiers)."""
        if depth >= len(self._core.tier_names):
            return None
        room = self._placement.hold_room(dst.name, nbytes, force=force)
        try:
            for sub in room.orders:
                self.execute(sub, depth=depth + 1)
        except BaseException:
            room.release()
            raise
        return room

    @staticmethod
    def _recode(frame, have: Codec, want: Codec) -> tuple[object, Codec, int]:
        """The frame in the codec ``want`` (re-encoded only when it differs)."""
        if have is want:
            return frame, have, codec_mod.read_header(frame).body_checksum
        kv = codec_mod.decode(frame)
        try:
            new = codec_mod.encode(kv, want, meta=codec_mod.frame_meta(frame))
        except InvalidKV:  # int8 cannot hold this block (e.g. Inf); keep the codec it has
            return frame, have, codec_mod.read_header(frame).body_checksum
        header = codec_mod.read_header(new)
        return new, header.codec, header.body_checksum

    def _delete_quietly(self, tier, key: bytes) -> None:
        try:
            tier.delete(key)
        except TierError as exc:
            log.warning("move of %s: tier %s failed a delete (%s)", key.hex(), tier.name, exc)

    def _done(self, order: MoveOrder, new_size: int) -> None:
        self._placement.moved(order, new_size)
        if self._on_move is not None:
            self._on_move(order, new_size)

    # -- the background loop ---------------------------------------------------------

    def run_once(self, *, bounded: bool = False) -> int:
        """Plan and execute within the byte budget; returns how many moves happened.

        Args:
            bounded: as the background thread runs it: the round also ends once this thread has
                used ``move_cpu_frac`` of the interval's CPU time, and plans about what that share
                carries out (1.5 times the moves it paid for lately). Bytes alone do not bound a round: a move of a small frame costs
                tens of microseconds of Python whatever its size (a budget of 128 MiB is 100k of
                them), and a round holds the GIL that puts and gets need. CPU time, not wall time:
                waits for a disk do not count. Unbounded (a round on demand), it plans and moves
                all the byte budget allows.
        """
        cfg = self._placement.config
        now = time.monotonic()
        # a round on demand gets an interval's bytes; the thread's (woken ones too) what time has added
        gain = min(now - self._refilled, cfg.interval_s) if bounded else cfg.interval_s
        self._refilled = now
        self._tokens = min(self._tokens + cfg.move_bytes_per_s * gain, float(cfg.move_bytes_per_s))
        slice_s = cfg.move_cpu_frac * cfg.interval_s if bounded else float("inf")
        limit = max(PLAN_MIN, int(1.5 * slice_s / self._move_cpu_s)) if bounded else None
        started = yielded = time.thread_time()
        done = 0
        orders = self._placement.plan(hold=True, limit=limit)
        planned = time.thread_time()
        ahead: dict[bytes, _Ahead] = {}
        looked: set[bytes] = set()  # orders a batch has considered: each once
        try:
            for i, order in enumerate(orders):
                if (done and order.size > self._tokens) or (i and time.thread_time() - started > slice_s):
                    break  # out of budget: the next round re-plans from fresh heat
                if order.key not in looked:
                    window = orders[i:i + AHEAD_MOVES]
                    looked.update(o.key for o in window)
                    ahead.update(self._encode_ahead(window, self._tokens))
                if self.execute(order, ahead=ahead.pop(order.key, None)):
                    done += 1
                    self._tokens -= order.size
                if bounded and time.thread_time() - yielded > YIELD_EVERY_S:
                    # A thread that let the GIL go (for a copy, a lock, a socket) waits up to the
                    # switch interval (5 ms) to have it back from a busy mover: a get of a few
                    # blocks would take ten times its time. A short sleep hands it over.
                    time.sleep(YIELD_S)
                    yielded = time.thread_time()
        finally:
            self._placement.settle(orders)
        if done and bounded:  # what a move costs here, for the next round's plan
            per_move = (time.thread_time() - planned) / done
            self._move_cpu_s = max(1e-6, 0.8 * self._move_cpu_s + 0.2 * per_move)
        return done

    def _encode_ahead(self, orders: list[MoveOrder], budget: float) -> dict[bytes, "_Ahead"]:
        """int8 frames for the demotions among ``orders`` (within ``budget`` bytes) that take a small
        raw block into an int8 tier, quantized in batches of one shape and dtype
        (``codec.encode_many``): one at a time, a 64 KiB block is mostly per-op overhead (a fifth
        of the speed), and a full store's demotions were most of the mover's time. A block left
        out (alone of its shape, unreadable, damaged, or in a batch int8 cannot hold) is moved
        alone, as ``execute`` does, which finds out which and drops a damaged frame."""
        core = self._core
        groups: dict[tuple, list[tuple]] = {}  # (shape, dtype) -> (order, entry, frame, kv)
        for order in orders:
            budget -= order.size
            if budget < 0:
                break
            entry = core.entry(order.key)
            if (order.dst is None or entry is None or entry.tier != order.src or entry.codec is not Codec.RAW
                    or core.codec_of(order.dst) is not Codec.INT8 or order.size > codec_mod.MANY_PAYS_BELOW
                    or (self._shared is not None and order.dst == self._shared.name)
                    or self._demotes_raw(order, entry, order.size)):  # goes down raw: nothing to encode
                continue
            try:
                frame = core.tier(order.src).get(order.key)
                kv = codec_mod.decode(frame) if frame is not None else None
            except (FrameError, InvalidKV, TierError):
                continue
            if kv is not None:
                groups.setdefault((tuple(kv.shape), kv.dtype), []).append((order, entry, frame, kv))
        out: dict[bytes, _Ahead] = {}
        for group in groups.values():
            if len(group) < 2:
                continue
            try:
                new = codec_mod.encode_many([kv for *_, kv in group], [codec_mod.frame_meta(f) for _, _, f, _ in group])
            except InvalidKV:
                continue
            for (order, entry, _, _), frame in zip(group, new):
                out[order.key] = _Ahead(entry, frame, codec_mod.read_header(frame).body_checksum)
        return out

    def start(self) -> None:
        if self._thread is None:
            self._placement.on_pressure = self.wake
            self._thread = threading.Thread(target=self._loop, name="kvstore-mover", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Start a round now, not at the next interval (a put took the top tier past its low
        watermark: the room the next puts need is made while they come). Safe under any lock."""
        self._wake.set()

    def _loop(self) -> None:
        cfg = self._placement.config
        rest = 0.0
        # A round every interval_s, or sooner when woken; after a round that used c seconds of CPU,
        # none for c * (1 / move_cpu_frac - 1) seconds: woken rounds keep the mover within its share.
        while not self._stop.wait(rest):
            self._wake.wait(max(0.0, cfg.interval_s - rest))
            self._wake.clear()
            if self._stop.is_set():
                return
            started = time.thread_time()
            try:
                self.run_once(bounded=True)
            except Exception:  # keep moving next round; a bug here must not kill placement
                log.exception("placement round failed")
            # a store that closed mid-round has cleared its index; nothing more to do
            if self._core.closed:
                return
            rest = (time.thread_time() - started) * (1 / cfg.move_cpu_frac - 1)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._thread = None
