"""Offsets into one preallocated arena: a size-class allocator with compaction.

Arena tiers (shm, cxl, device) allocate their memory once, at start, and carve
frames out of it with ``SlabAllocator``. Per-put allocation is what we avoid: a
fresh 32 MiB buffer copies at 2-7 GB/s here against 12-14 GB/s for a reused one
(``docs/design.md``, "Figures this design rests on"), and churn fragments the heap.

The allocator hands out offsets only; it never touches memory, so the same code
serves a ``/dev/shm`` mapping, a hugepage mapping and a CUDA tensor.

Free ranges sit in segregated bins, two-level like TLSF: a power of two split
into four sub-classes, each bin's ranges kept in address order. ``alloc`` takes the
lowest range of the smallest bin whose every range fits, then looks in the request's
own bin, so it fails only when no free range is large enough. ``alloc_high`` takes
the highest range that fits instead, for those that stay long and cannot move. Both
cost O(log n) in the free ranges, plus a look at each non-empty bin (a few hundred at
most); a request whose size is not its bin's floor also looks through its own bin, from the
lowest (``alloc``, when no larger bin has a range) or the highest (``alloc_high``, down to the
best range of the larger bins), past ranges too short for it; ``alloc_high_many`` carves
a writer's pool of slots with one such look. A full
arena after churn holds a free range for every scattered block demoted or deleted (90k
in one of 1M frames with a tenth freed); scanning them, as this allocator did, cost
0.64 ms an ``alloc`` and 20 ms an ``alloc_high`` there (``bench/steady_scale.py``,
the arena row; docs/benchmarks.md). When free space is enough in total but
split up, ``compact`` packs allocations towards offset 0 and returns the moves
for the owner to carry out; allocations the owner cannot move (a reader holds
them) stay where they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

from sortedcontainers import SortedList

from kvstore.errors import InvalidInput

__all__ = ["SlabAllocator", "Move"]

_SUB_BITS = 2  # four sub-classes per power of two: at most 25% slack in the first-choice bin


@dataclass(frozen=True, slots=True)
class Move:
    """One step of a compaction: copy ``size`` bytes from ``src`` down to ``dst``.

    Moves come in ascending order and ``dst < src``; ranges may overlap, so the
    copy must be overlap-safe (memmove semantics).
    """

    src: int
    dst: int
    size: int


@functools.lru_cache(maxsize=8192)  # a handful of frame sizes recur; this runs 5-7 times per put
def _bin(size: int) -> int:
    """Bin index of a free range of ``size`` bytes (> 0): ranges in bin b are >= its lower bound."""
    top = size.bit_length() - 1
    if top < _SUB_BITS:
        return size
    sub = (size >> (top - _SUB_BITS)) & ((1 << _SUB_BITS) - 1)
    return ((top - _SUB_BITS + 1) << _SUB_BITS) + sub


@functools.lru_cache(maxsize=8192)
def _bin_floor(index: int) -> int:
    """The smallest size that lands in bin ``index``."""
    if index < (1 << _SUB_BITS):
        return index
    top = (index >> _SUB_BITS) + _SUB_BITS - 1
    sub = index & ((1 << _SUB_BITS) - 1)
    return (1 << top) | (sub << (top - _SUB_BITS))


class SlabAllocator:
    """Allocates ``align``-rounded ranges of ``[0, size)``. Not thread-safe: its owner locks.

    Args:
        size: arena bytes.
        align: every allocation starts on, and is rounded up to, this many bytes
            (64: one cache line, so neighbours never share a line).
    """

    def __init__(self, size: int, *, align: int = 64) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidInput(f"arena size must be a positive int, got {size!r}")
        if align <= 0 or align & (align - 1):
            raise InvalidInput(f"align must be a power of two, got {align!r}")
        self.size = size - size % align
        self.align = align
        self._allocs: dict[int, int] = {}  # offset -> rounded size
        self._used = 0
        self._reset_free([(0, self.size)] if self.size else [])

    # -- queries ------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes allocated, after rounding."""
        return self._used

    @property
    def free_bytes(self) -> int:
        return self.size - self._used

    def free_ranges(self) -> int:
        """How many free ranges the free space is split into."""
        return len(self._free_start)

    def free_spans(self) -> list[tuple[int, int]]:
        """Every free range as ``(offset, length)``, in address order."""
        return sorted(self._free_start.items())

    def largest_free(self) -> int:
        """The largest single allocation that would succeed without compaction, in O(1) (the tier's
        ``stats``, which a pooled put's grant reads, calls this)."""
        return self._lengths[-1] if self._lengths else 0

    def rounded(self, n: int) -> int:
        """What an ``n``-byte request costs; zero-byte requests still take one unit."""
        return -(-n // self.align) * self.align or self.align

    def allocations(self) -> dict[int, int]:
        """A copy of ``offset -> rounded size`` for every live allocation."""
        return dict(self._allocs)

    def copy(self) -> "SlabAllocator":
        """An independent allocator in the same state, to plan on."""
        twin = SlabAllocator.__new__(SlabAllocator)
        twin.size, twin.align, twin._used = self.size, self.align, self._used
        twin._allocs = dict(self._allocs)
        twin._free_start = dict(self._free_start)
        twin._free_end = dict(self._free_end)
        twin._bins = {b: SortedList(members) for b, members in self._bins.items()}
        twin._lengths = SortedList(self._lengths)
        return twin

    # -- alloc / free ---------------------------------------------------------------

    def alloc(self, n: int) -> int | None:
        """The offset of a fresh ``n``-byte range, or ``None`` when no free range fits."""
        need = self.rounded(n)
        start = self._take_fit(need)
        if start is None:
            return None
        length = self._free_start[start]
        self._remove_free(start, length)
        if length > need:
            self._add_free(start + need, length - need)
        self._allocs[start] = need
        self._used += need
        return start

    def alloc_high(self, n: int) -> int | None:
        """As ``alloc``, but the top of the highest free range that fits, or ``None``.

        For ranges that stay allocated a long time and cannot be moved (a writer's pool of
        reserved slots): ``compact`` packs the rest towards 0, so such ranges kept at the high
        end do not split the space it frees.
        """
        need = self.rounded(n)
        start = self._take_high(need)
        return None if start is None else self._carve_top(start, need, 1)

    def alloc_high_many(self, n: int, count: int) -> list[int]:
        """Up to ``count`` ``n``-byte ranges as ``alloc_high`` takes them one by one, highest first:
        fewer when the free ranges run out. The top of the range ``alloc_high`` picks stays the
        highest that fits until it is too short, so its slots are carved in one step (a writer's
        pool is lent 16-128 slots at once)."""
        need = self.rounded(n)
        got: list[int] = []
        while len(got) < count:
            start = self._take_high(need)
            if start is None:
                break
            k = min(count - len(got), self._free_start[start] // need)
            low = self._carve_top(start, need, k)
            got.extend(range(low + (k - 1) * need, low - 1, -need))
        return got

    def _carve_top(self, start: int, need: int, k: int) -> int:
        """Allocate ``k`` ranges of ``need`` bytes off the top of the free range at ``start`` (it
        holds them); the lowest one's offset."""
        length = self._free_start[start]
        self._remove_free(start, length)
        low = start + length - k * need
        if low > start:
            self._add_free(start, low - start)
        for offset in range(low, start + length, need):
            self._allocs[offset] = need
        self._used += k * need
        return low

    def free(self, offset: int) -> None:
        """Return the range at ``offset``; neighbours coalesce.

        Raises:
            InvalidInput: ``offset`` is not a live allocation (a double free).
        """
        length = self._allocs.pop(offset, None)
        if length is None:
            raise InvalidInput(f"offset {offset} is not allocated")
        self._used -= length
        start, end = offset, offset + length
        before = self._free_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            start = before
        after = self._free_start.get(end)
        if after is not None:
            self._remove_free(end, after)
            end += after
        self._add_free(start, end - start)

    def shrink(self, offset: int, n: int) -> None:
        """Give back the tail of the allocation at ``offset`` beyond ``n`` bytes.

        An encoder reserves its worst case (``frame_size``) and may use less.
        """
        have = self._allocs.get(offset)
        if have is None:
            raise InvalidInput(f"offset {offset} is not allocated")
        keep = self.rounded(n)
        if keep >= have:
            return
        self._allocs[offset] = keep
        self._allocs[offset + keep] = have - keep
        self.free(offset + keep)

    def compact(self, pinned: Iterable[int] = ()) -> list[Move]:
        """Pack allocations towards 0, leaving ``pinned`` offsets in place.

        In offset order, each allocation moves down to the lowest free place below it: the
        first hole left before a pin that it fits (room before a pin that the allocations
        before it did not fill), else right after the last one placed. Pins then cost only the
        room no later allocation fits, not every gap before them (a few writers' pinned slots
        among mixed 64 KiB and 128 KiB frames left no 64 KiB range free when each gap was kept).

        Returns:
            The moves to carry out, in order: each ``dst < src`` and each destination is free
            by the time its move runs (sources ascend). The allocator already records the new
            offsets; the owner must copy the bytes before using them.
        """
        fixed = set(pinned)
        moves: list[Move] = []
        placed: dict[int, int] = {}
        holes: list[list[int]] = []  # [start, length]: room left before a pin, lowest first
        biggest = 0
        cursor = 0
        for off, size in sorted(self._allocs.items()):
            if off in fixed:
                if off > cursor:
                    holes.append([cursor, off - cursor])
                    biggest = max(biggest, off - cursor)
                placed[off] = size
                cursor = off + size
                continue
            hole = next((h for h in holes if h[1] >= size), None) if size <= biggest else None
            if hole is not None:  # below every pin passed: free since what was there moved
                dst = hole[0]
                hole[0] += size
                hole[1] -= size
                if hole[1] + size == biggest:
                    biggest = max(h[1] for h in holes)
            else:  # cursor <= off: below the next pin and every source not moved yet
                dst = cursor
                cursor = dst + size
            if dst != off:
                moves.append(Move(off, dst, size))
            placed[dst] = size
        self._allocs = placed
        self._reset_free(self._gaps())
        return moves

    # -- free-range bookkeeping ---------------------------------------------------

    def _reset_free(self, ranges: list[tuple[int, int]]) -> None:
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._bins: dict[int, SortedList] = {}  # bin -> starts of its free ranges, ascending
        self._lengths = SortedList()  # every free range's length: the longest is the last
        for start, length in ranges:
            self._add_free(start, length)

    def _gaps(self) -> list[tuple[int, int]]:
        gaps, cursor = [], 0
        for off, size in sorted(self._allocs.items()):
            if off > cursor:
                gaps.append((cursor, off - cursor))
            cursor = off + size
        if cursor < self.size:
            gaps.append((cursor, self.size - cursor))
        return gaps

    def _add_free(self, start: int, length: int) -> None:
        self._free_start[start] = length
        self._free_end[start + length] = start
        members = self._bins.get(_bin(length))
        if members is None:
            members = self._bins[_bin(length)] = SortedList()
        members.add(start)
        self._lengths.add(length)

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_start[start]
        del self._free_end[start + length]
        b = _bin(length)
        members = self._bins[b]
        members.remove(start)
        self._lengths.remove(length)
        if not members:
            del self._bins[b]

    def _take_fit(self, need: int) -> int | None:
        own = _bin(need)
        first = own if _bin_floor(own) == need else own + 1
        # Any range in a bin at or above ``first`` fits; prefer the smallest such bin.
        best = min((b for b in self._bins if b >= first), default=None)
        if best is not None:
            return self._bins[best][0]
        for start in self._bins.get(own, ()):
            if self._free_start[start] >= need:
                return start
        return None

    def _take_high(self, need: int) -> int | None:
        """The start of the highest free range of at least ``need`` bytes: the highest of each bin
        whose every range fits, and the highest fitting one of ``need``'s own bin."""
        own = _bin(need)
        first = own if _bin_floor(own) == need else own + 1
        best = max((self._bins[b][-1] for b in self._bins if b >= first), default=None)
        for start in reversed(self._bins.get(own, ())):
            if best is not None and start < best:
                break
            if self._free_start[start] >= need:
                return start
        return best
