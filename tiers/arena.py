"""The shared body of tiers whose frames live in one preallocated arena.

shm, cxl and device differ only in what the arena is (a ``/dev/shm`` mapping,
hugepage memory, a torch tensor) and in how bytes get in and out. Everything
else lives here once: the key map, the ``SlabAllocator``, capacity accounting,
compaction, and the rule that memory a reader is copying from is never reused
under it.

Stamps. Each publish of a slot (a put, a move by compaction) takes a new stamp from a
tier-wide count, never reused, so a slot whose stamp is unchanged holds the bytes it
held then. A reader that checked those bytes may ``vouch`` for them at that stamp, and
``read_vouched`` tells the next reader so: the store then skips hashing a frame again
(``kvstore/engine/frames.py``). The note lives on the slot and goes with its publication, except
that a compaction move, which copies checked bytes within the arena, keeps it (the store's
scrubber re-checks every slot in its cycle: ``kvstore/engine/scrub.py``).

Concurrency. One lock guards the maps; bytes move outside it. A put reserves
its range under the lock, fills it unlocked and publishes under the lock, so an
int8 encoder running in ``put_with`` does not stall other readers. A get pins
its range (``_busy``) while it copies. A range that is deleted or replaced while
pinned is *retired*: it leaves the key map and the accounting at once, and goes
back to the allocator when the last reader lets go. Compaction never moves a
pinned range. Subclasses can pin more (shm: ranges leased to other processes).
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, TypeVar

from kvstore.errors import InvalidInput, StoreClosed, TierFull
from kvstore.keys import BlockHash, check_key
from kvstore.memory.buffers import Scratch
from kvstore.memory.slab import Move, SlabAllocator
from kvstore.tier import Buffer, FrameWriter, Tier, TierCounters, TierStats, writable_bytes

T = TypeVar("T")

__all__ = ["ArenaTier", "Slot", "default_max_entries"]

ALIGN = 64
"""Slot alignment: one cache line, so two slots never share one."""


def default_max_entries(capacity_bytes: int) -> int:
    """One slot per 4 KiB of capacity, within [1024, 4M]: a 16-token block of
    even a tiny model is larger than 4 KiB, so slots run out after bytes do."""
    return min(max(capacity_bytes // 4096, 1024), 1 << 22)


def _staging_buffer(n: int) -> bytearray:
    return bytearray(n)


# A per-thread buffer for writers that cannot write into the arena itself.
_STAGING = Scratch(_staging_buffer, len)


@dataclass(slots=True)
class Slot:
    """Where one frame lives."""

    index: int
    """Row in the slot table: shm publishes it to readers in other processes."""
    offset: int
    length: int
    """Frame bytes; the allocator holds ``length`` rounded up to ``ALIGN``."""
    stamp: int = 0
    """The tier-wide count when the slot was last published: a new one at every put and move."""
    vouched: bool = False
    """A reader checked the bytes published at ``stamp`` (``vouch``); cleared when it changes."""


class ArenaTier(Tier):
    """A tier over one arena of ``arena_bytes``; subclasses move the bytes.

    Subclasses implement ``_copy_in``, ``_copy_out`` and ``_move`` and may
    override ``_fill`` (write in place), ``_publish``/``_unpublish`` (announce a
    slot) and ``_pinned_elsewhere`` (ranges other processes hold).
    """

    kind = "arena"

    def __init__(self, capacity_bytes: int, *, name: str, max_entries: int | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInput(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        slots = default_max_entries(capacity_bytes) if max_entries is None else max_entries
        if isinstance(slots, bool) or not isinstance(slots, int) or slots <= 0:
            raise InvalidInput(f"max_entries must be a positive int, got {max_entries!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.max_entries = slots
        # Rounding costs at most ALIGN per slot; with this slack, a compacted
        # arena always has room for whatever the capacity accounting admits.
        self.arena_bytes = capacity_bytes + slots * ALIGN
        self._alloc = SlabAllocator(self.arena_bytes, align=ALIGN)
        self._slots: dict[bytes, Slot] = {}
        self._free_rows = list(range(slots - 1, -1, -1))
        self._busy: dict[int, int] = {}  # offset -> readers/writers copying it now
        self._retired: dict[int, Slot] = {}  # offset -> slot gone from the map, still pinned
        self._used = 0
        self._reserved = 0
        self._compactions = 0
        self._released = self._trims = 0  # release_free: the last one's bytes, and how many ran
        self._stamps = 0
        # A tier that lends copies (device) hands out new bytes on every read: those are checked
        # as new, so it never says a slot was vouched for.
        self._lends_slots = type(self)._lent is not ArenaTier._lent
        # Only a tier whose memory is this process's own hands free pages back (release_free): the
        # others are not walked for nothing under their lock
        self._releases = type(self)._release_pages is not ArenaTier._release_pages
        self._counters = TierCounters()
        self._lock = threading.Lock()
        self._closed = False

    # -- what a subclass provides ----------------------------------------------------

    @abstractmethod
    def _copy_in(self, offset: int, frame: memoryview) -> None:
        """Copy ``frame`` into the arena at ``offset``."""

    @abstractmethod
    def _copy_out(self, offset: int, length: int) -> Buffer:
        """A stable copy of ``length`` bytes at ``offset``."""

    @abstractmethod
    def _move(self, moves: list[Move]) -> None:
        """Carry out compaction moves, in order, overlap-safe."""

    def _fill(self, offset: int, size: int, writer: FrameWriter) -> int:
        """Let ``writer`` produce a frame of at most ``size`` bytes at ``offset``.

        This default stages through a reused per-thread buffer; host arenas
        override it to hand the writer the slot itself.
        """
        with memoryview(_STAGING.get(size))[:size] as view:
            n = writer(view)
            self._copy_in(offset, view[:n])
        return n

    def _copy_out_into(self, offset: int, length: int, out: memoryview) -> None:
        out[:length] = memoryview(self._copy_out(offset, length)).cast("B")

    @contextmanager
    def _lent(self, offset: int, length: int) -> Iterator[memoryview]:
        """The slot's bytes for the length of a ``with``; the slot is held busy meanwhile.

        This default lends a copy; arenas in host memory override it to lend the slot.
        """
        yield memoryview(self._copy_out(offset, length)).cast("B")

    def _publish(self, key: bytes, slot: Slot) -> None:
        """The slot now holds ``key``'s frame. Lock held."""

    def _unpublish(self, slot: Slot) -> None:
        """The slot's frame is going away or moving. Lock held."""

    def _pinned_elsewhere(self, slot: Slot) -> bool:
        """Whether another process holds the slot's range. Lock held."""
        return False

    def _vouched(self, slot: Slot) -> None:
        """The slot's frame was verified at its current stamp (announce it to other readers). Lock held."""

    def _details(self) -> dict[str, str]:
        return {}

    def _release_pages(self, offset: int, length: int) -> int:
        """Hand back the pages wholly inside the free range ``[offset, offset + length)``; bytes.
        Called under the lock, so nothing is allocated there meanwhile. Default: nothing (a
        shared mapping other processes map, a device)."""
        return 0

    # -- the Tier contract -------------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer) -> None:
        check_key(key)
        view = memoryview(frame).cast("B")
        size = len(view)
        with self._lock:
            slot = self._reserve(key, size)
        try:
            self._copy_in(slot.offset, view)
        except BaseException:
            self._abort(slot, size)
            raise
        self._commit(key, slot, size, size)

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        check_key(key)
        with self._lock:
            slot = self._reserve(key, size)
        try:
            n = self._fill(slot.offset, size, writer)
            if not 0 <= n <= size:
                raise InvalidInput(f"writer reported {n} bytes for a {size}-byte slot")
        except BaseException:
            self._abort(slot, size)
            raise
        self._commit(key, slot, size, n)
        return n

    # -- two-phase puts: a writer in another process fills a reserved slot -------------------

    def reserve(self, key: BlockHash, size: int, *, lasting: bool = False) -> Slot:
        """Room for a frame of at most ``size`` bytes for ``key``, held busy (never moved or reused)
        and invisible until ``commit_reserved`` or ``abort_reserved``. Every reservation must end
        in one of the two, or its range stays taken.

        ``lasting``: the reservation may be held a long time (a writer's pool slot): it is taken
        from the arena's high end, so that such ranges, which compaction cannot move, do not
        split the room compaction packs towards the low end (several writers' pools scattered
        through a small arena left no range for a block though the bytes were free).

        Raises:
            TierFull: no room; nothing changed.
        """
        check_key(key)
        with self._lock:
            return self._reserve(key, size, lasting=lasting)

    def reserve_many(self, key: BlockHash, size: int, count: int) -> list[Slot]:
        """Up to ``count`` lasting reservations of ``size`` bytes for ``key``, which holds no frame
        here (a pool's slots), under one hold of the lock and one pass of the allocator: the first
        as ``reserve(lasting=True)`` makes it (it may compact), the rest from free ranges only, so
        a fragmented arena lends fewer; none: an empty list. Each ends as ``reserve``'s does."""
        check_key(key)
        if count <= 0:
            return []
        with self._lock:
            try:
                got = [self._reserve(key, size, lasting=True)]  # the one way that may compact
            except TierFull:
                return []
            more = min(count - 1, len(self._free_rows), (self.capacity_bytes - self._used - self._reserved) // size)
            if more > 0:
                for offset in self._alloc.alloc_high_many(size, more):
                    self._reserved += size
                    self._busy[offset] = 1
                    got.append(Slot(self._free_rows.pop(), offset, size))
            return got

    def reserved_view(self, slot: Slot) -> memoryview | None:
        """The reserved slot's bytes, in tiers that keep them in this process's memory (None elsewhere)."""
        return None

    def commit_reserved(self, key: BlockHash, slot: Slot, size: int, n: int) -> None:
        """Publish a reserved slot, filled with an ``n``-byte frame, as ``key``'s frame.

        Raises:
            InvalidInput: ``n`` is not within the reservation. StoreClosed: the tier closed meanwhile.
        """
        if not 0 < n <= size:
            self._abort(slot, size)
            raise InvalidInput(f"a {n}-byte frame for a {size}-byte reservation")
        self._commit(key, slot, size, n)

    def abort_reserved(self, slot: Slot, size: int) -> None:
        """Give a reserved slot back unpublished."""
        self._abort(slot, size)

    def _abort(self, slot: Slot, size: int) -> None:
        with self._lock:
            self._reserved -= size
            self._release(slot)  # retired while pinned, freed by the unbusy below
            self._unbusy(slot.offset)

    def _commit(self, key: bytes, slot: Slot, size: int, n: int) -> None:
        """Publish a filled slot in place of ``key``'s old frame."""
        with self._lock:
            self._reserved -= size
            if self._closed:
                self._release(slot)
                self._unbusy(slot.offset)
                raise StoreClosed(f"tier {self.name!r} was closed during a put")
            slot.length = n
            if n < size:
                self._alloc.shrink(slot.offset, n)
            old = self._slots.pop(key, None)
            if old is not None:
                self._used -= old.length
                self._unpublish(old)
                self._release(old)
            self._slots[key] = slot
            self._used += n
            self._publish_stamped(key, slot)
            self._counters.puts += 1
            self._unbusy(slot.offset)

    def _reserve(self, key: bytes, size: int, *, lasting: bool = False) -> Slot:
        """Room for ``size`` bytes, pinned until published. Lock held.

        Raises:
            TierFull: over capacity, out of slots, or the arena is pinned apart;
                nothing changed.
        """
        self._check_open()
        old = self._slots.get(key)
        old_len = old.length if old is not None else 0
        if self._used + self._reserved - old_len + size > self.capacity_bytes:
            self._full(f"a {size}-byte frame does not fit ({self._used} of {self.capacity_bytes} bytes used)")
        offset = self._take_range(size, lasting) if self._free_rows else None
        if offset is None:
            offset = self._make_room(key, old, size, lasting)
        self._reserved += size
        self._busy[offset] = 1
        return Slot(self._free_rows.pop(), offset, size)

    def _take_range(self, size: int, lasting: bool) -> int | None:
        return self._alloc.alloc_high(size) if lasting else self._alloc.alloc(size)

    def _make_room(self, key: bytes, old: Slot | None, size: int, lasting: bool = False) -> int:
        """Allocate when the easy way failed: drop the frame being replaced, compact.

        Both steps are planned on a copy of the allocator first, so a put that
        cannot succeed raises TierFull before it has dropped or moved anything.
        """
        # Replacing: the old frame may go first rather than need room for both.
        droppable = old is not None and not self._busy.get(old.offset) and not self._pinned_elsewhere(old)
        plan = self._alloc.copy()
        if droppable:
            plan.free(old.offset)
        compact = plan.alloc(size) is None
        if compact:
            plan = self._alloc.copy()
            if droppable:
                plan.free(old.offset)
            plan.compact(self._pinned_offsets(skip=old if droppable else None))
            if plan.alloc(size) is None:
                self._full(f"no {size}-byte range is free ({len(self._busy)} ranges being read, "
                           f"{len(self._retired)} retired ranges still held by readers)")
        if not self._free_rows and not droppable:
            self._full(f"all {self.max_entries} slots are in use")
        if droppable:
            del self._slots[key]
            self._used -= old.length
            self._unpublish(old)
            self._release(old)
        if compact:
            self._compact()
        offset = self._take_range(size, lasting)
        if offset is None:  # a reader in another process leased a range since the plan
            self._full(f"no {size}-byte range is free: a reader pinned one during compaction")
        return offset

    def _pinned_offsets(self, skip: Slot | None = None) -> set[int]:
        """Ranges compaction must leave in place. Lock held."""
        pinned = set(self._busy) | set(self._retired)
        pinned |= {s.offset for s in self._slots.values() if s is not skip and self._pinned_elsewhere(s)}
        return pinned

    def _full(self, why: str) -> None:
        self._counters.errors += 1
        raise TierFull(f"tier {self.name!r}: {why}", tier=self.name)

    def get(self, key: BlockHash) -> Buffer | None:
        slot = self._pin(key)
        if slot is None:
            return None
        try:
            return self._copy_out(slot.offset, slot.length)
        finally:
            with self._lock:
                self._unbusy(slot.offset)

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        slot = self._pin(key)
        if slot is None:
            return None
        try:
            view = writable_bytes(out)
            if len(view) < slot.length:
                raise InvalidInput(f"out holds {len(view)} bytes, the frame needs {slot.length}")
            self._copy_out_into(slot.offset, slot.length, view)
            return slot.length
        finally:
            with self._lock:
                self._unbusy(slot.offset)

    def read_with(self, key: BlockHash, reader: Callable[[memoryview], T]) -> T | None:
        return self.read_vouched(key, lambda view, _stamp, _vouched: reader(view))

    def read_vouched(self, key: BlockHash, reader: Callable[[memoryview, int, bool], T]) -> T | None:
        """``read_with``, where ``reader(view, stamp, vouched)`` also learns the lent slot's stamp and
        whether a reader vouched for its bytes at that stamp (never, in a tier that lends copies).

        Returns:
            what ``reader`` returns; None when ``key`` is absent.
        """
        slot = self._pin(key)
        if slot is None:
            return None
        try:
            with self._lent(slot.offset, slot.length) as view:
                return reader(view, slot.stamp, slot.vouched and self._lends_slots)
        finally:
            with self._lock:
                self._unbusy(slot.offset)

    @property
    def lends_frames(self) -> bool:
        return self._lends_slots

    def vouch(self, key: BlockHash, stamp: int) -> None:
        """Note that ``key``'s bytes published at ``stamp`` were checked; later ``read_vouched``
        calls say so until the slot is published again. A no-op when it was, or ``key`` went."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None and slot.stamp == stamp:
                slot.vouched = True
                self._vouched(slot)

    def head(self, key: BlockHash, nbytes: int) -> tuple[Buffer, int] | None:
        # Copy the prefix only: the default would copy the whole frame to read its header.
        return self.read_with(key, lambda view: (bytes(view[:nbytes]), len(view)))

    def _pin(self, key: bytes) -> Slot | None:
        with self._lock:
            self._check_open()
            self._counters.gets += 1
            slot = self._slots.get(key)
            if slot is None:
                self._counters.misses += 1
                return None
            self._counters.hits += 1
            self._busy[slot.offset] = self._busy.get(slot.offset, 0) + 1
            return replace(slot)

    def delete(self, key: BlockHash) -> bool:
        with self._lock:
            self._check_open()
            slot = self._slots.pop(key, None)
            if slot is None:
                return False
            self._used -= slot.length
            self._counters.deletes += 1
            self._unpublish(slot)
            self._release(slot)
            return True

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            self._check_open()
            return key in self._slots

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            self._check_open()
            snapshot = list(self._slots)
        return iter(snapshot)  # type: ignore[arg-type]

    def release_free(self) -> int:
        if not self._releases:
            return 0
        with self._lock:
            if self._closed:
                return 0
            released = sum(self._release_pages(start, length) for start, length in self._alloc.free_spans())
            self._released, self._trims = released, self._trims + 1
            return released

    def room_bytes(self) -> int:
        """Capacity less the bytes stored and reserved: what may be lent now. What ``stats()``
        says, without asking the kernel (a pooled put's grant asks this on every request)."""
        with self._lock:
            return self.capacity_bytes - self._used - self._reserved

    def stats(self) -> TierStats:
        extra = self._details()  # outside the lock: it may ask the kernel (smaps, NUMA)
        with self._lock:
            details = {
                "arena_bytes": str(self.arena_bytes),
                "arena_free_bytes": str(self._alloc.free_bytes),
                "reserved_bytes": str(self._reserved),
                "largest_free_bytes": str(self._alloc.largest_free()),
                "compactions": str(self._compactions),
                **({"free_released": f"{self._released} bytes at the last of {self._trims} idle trims"}
                   if self._releases else {}),
                "retired": str(len(self._retired)),
                **extra,
            }
            return TierStats(
                name=self.name,
                kind=self.kind,
                entries=len(self._slots),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                durable=self.durable,
                shared=self.shared,
                counters=replace(self._counters),
                details=details,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for slot in self._slots.values():
                self._unpublish(slot)
            self._slots.clear()
            self._used = 0
        self._close_arena()

    def _close_arena(self) -> None:
        """Release the arena itself; called once, after the maps are cleared."""

    # -- bookkeeping under the lock ------------------------------------------------

    def _release(self, slot: Slot) -> None:
        """Free ``slot`` now, or retire it until its readers let go."""
        if self._busy.get(slot.offset) or self._pinned_elsewhere(slot):
            self._retired[slot.offset] = slot
            return
        self._alloc.free(slot.offset)
        self._free_rows.append(slot.index)

    def _publish_stamped(self, key: bytes, slot: Slot) -> None:
        """``_publish`` under a new stamp: whatever was vouched for before is not these bytes. Lock held."""
        self._stamps += 1
        slot.stamp, slot.vouched = self._stamps, False
        self._publish(key, slot)

    def _unbusy(self, offset: int) -> None:
        left = self._busy[offset] - 1
        if left:
            self._busy[offset] = left
            return
        del self._busy[offset]
        slot = self._retired.pop(offset, None)
        if slot is not None:
            self._release(slot)

    def _reclaim(self) -> None:
        """Free retired slots whose outside pins have gone."""
        for offset, slot in list(self._retired.items()):
            if not self._busy.get(offset) and not self._pinned_elsewhere(slot):
                del self._retired[offset]
                self._release(slot)

    def _compact(self) -> None:
        self._reclaim()
        live = [(k, s) for k, s in self._slots.items() if not self._busy.get(s.offset)]
        # Unpublish before probing for outside pins: a reader that pins a slot
        # after the probe then finds its generation gone and backs off.
        for _, slot in live:
            self._unpublish(slot)
        pinned = set(self._busy) | set(self._retired)
        pinned |= {s.offset for _, s in live if self._pinned_elsewhere(s)}
        moves = self._alloc.compact(pinned)
        self._move(moves)
        moved = {m.src: m.dst for m in moves}
        for key, slot in live:
            vouched = slot.vouched
            slot.offset = moved.get(slot.offset, slot.offset)
            self._publish_stamped(key, slot)
            if vouched:  # the bytes that were checked, moved in memory: still checked (the scrub re-checks)
                slot.vouched = True
                self._vouched(slot)
        self._compactions += 1

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"tier {self.name!r} is closed")
