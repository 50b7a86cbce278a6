"""SlabAllocator: no overlap, exact accounting, fails only when nothing fits."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import InvalidInput
from kvstore.memory.slab import SlabAllocator, _bin, _bin_floor


def test_bins_are_monotonic_and_floors_round_trip():
    prev = 0
    for size in range(1, 70000, 7):
        b = _bin(size)
        assert b >= prev
        prev = b
        assert _bin_floor(b) <= size
        assert _bin(_bin_floor(b)) == b


def test_alloc_free_coalesces_back_to_one_range():
    a = SlabAllocator(1 << 20)
    offs = [a.alloc(1000) for _ in range(100)]
    assert len(set(offs)) == 100 and a.used_bytes == 100 * 1024
    for off in offs[::2] + offs[1::2]:
        a.free(off)
    assert a.used_bytes == 0 and a.largest_free() == 1 << 20


def test_zero_byte_request_takes_one_unit():
    a = SlabAllocator(128)
    assert a.alloc(0) == 0 and a.alloc(0) == 64 and a.alloc(0) is None


def test_fragmented_space_fails_until_compacted():
    a = SlabAllocator(4096)
    offs = [a.alloc(512) for _ in range(8)]
    for off in offs[::2]:
        a.free(off)
    assert a.free_bytes == 2048 and a.alloc(1024) is None
    moves = a.compact()
    assert [m.dst for m in moves] == [0, 512, 1024, 1536]
    assert a.alloc(2048) == 2048


def test_compact_leaves_pinned_in_place():
    a = SlabAllocator(4096)
    offs = [a.alloc(512) for _ in range(8)]
    for off in (offs[0], offs[2], offs[5]):
        a.free(off)
    pinned = offs[3]
    a.compact(pinned=[pinned])
    allocs = a.allocations()
    assert pinned in allocs
    spans = sorted((o, o + s) for o, s in allocs.items())
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))


def test_double_free_is_typed():
    a = SlabAllocator(4096)
    off = a.alloc(10)
    a.free(off)
    with pytest.raises(InvalidInput):
        a.free(off)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bad_size(bad):
    with pytest.raises(InvalidInput):
        SlabAllocator(bad)


class AllocatorMachine(RuleBasedStateMachine):
    SIZE = 1 << 16

    def __init__(self):
        super().__init__()
        self.a = SlabAllocator(self.SIZE)
        self.live: dict[int, int] = {}

    @rule(n=st.integers(0, 20000))
    def alloc(self, n):
        need = self.a.rounded(n)
        # first choice: the lowest range of the smallest bin whose every range fits
        fits = [(_bin(length), start) for start, length in self.a._gaps() if _bin(length) > _bin(need)
                or (_bin(length) == _bin(need) and _bin_floor(_bin(need)) == need)]
        off = self.a.alloc(n)
        gaps = self.a._gaps() if off is None else None
        if off is None:
            assert all(length < need for _, length in gaps)
        else:
            assert off % 64 == 0 and off + need <= self.SIZE
            assert not fits or off == min(fits)[1]
            self.live[off] = need

    @rule(n=st.integers(0, 20000))
    def alloc_high(self, n):
        off = self.a.alloc_high(n)
        if off is None:
            assert all(length < self.a.rounded(n) for _, length in self.a._gaps())
        else:
            assert off % 64 == 0 and off + self.a.rounded(n) <= self.SIZE
            # the top of the highest range that fits: no fitting free range lies above it
            assert all(start + length <= off or length < self.a.rounded(n) for start, length in self.a._gaps())
            self.live[off] = self.a.rounded(n)

    @rule(n=st.integers(0, 8000), count=st.integers(1, 6))
    def alloc_high_many(self, n, count):
        one_by_one = self.a.copy()
        want = []
        for _ in range(count):
            off = one_by_one.alloc_high(n)
            if off is None:
                break
            want.append(off)
        got = self.a.alloc_high_many(n, count)
        assert got == want  # the same slots, in the same order, as taken one at a time
        assert self.a.allocations() == one_by_one.allocations()
        assert sorted(self.a._free_start.items()) == sorted(one_by_one._free_start.items())
        self.live.update((off, self.a.rounded(n)) for off in got)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        off = sorted(self.live)[i % len(self.live)]
        self.a.free(off)
        del self.live[off]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compact(self, data):
        pinned = data.draw(st.sets(st.sampled_from(sorted(self.live)), max_size=3))
        moves = self.a.compact(pinned)
        remap = {m.src: m.dst for m in moves}
        assert all(m.dst < m.src for m in moves)
        assert not pinned & set(remap)
        self.live = {remap.get(o, o): s for o, s in self.live.items()}
        if not pinned:
            assert self.a.largest_free() == self.a.free_bytes
        else:  # past the last pin, everything packs: its free room is one range, at the end
            tail = max(o + self.live[o] for o in pinned)
            after = [(st, n) for st, n in self.a._free_start.items() if st >= tail]
            assert len(after) <= 1 and all(st + n == self.SIZE for st, n in after)

    @invariant()
    def consistent(self):
        assert self.a.allocations() == self.live
        assert self.a.used_bytes == sum(self.live.values())
        spans = sorted((o, o + s) for o, s in self.live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert self.a.largest_free() == max(self.a._free_start.values(), default=0)
        free_total = sum(self.a._free_start.values())
        assert free_total == self.SIZE - self.a.used_bytes
        # each free range in its size's bin, once, and each bin in address order
        binned = [(b, start) for b, members in self.a._bins.items() for start in members]
        assert sorted(binned) == sorted((_bin(n), start) for start, n in self.a._free_start.items())
        assert all(list(members) == sorted(members) and members for members in self.a._bins.values())


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_alloc_high_takes_the_top_and_compaction_packs_the_rest_below_it():
    a = SlabAllocator(4096)
    pool = a.alloc_high(1000)
    assert pool == 4096 - 1024
    low = [a.alloc(512) for _ in range(4)]
    assert low == [0, 512, 1024, 1536]
    a.free(low[0])
    a.free(low[2])
    assert a.alloc(1536) is None  # 2 x 512 free below, split
    a.compact(pinned={pool})  # the long-lived range is at the top: everything else packs under it
    assert a.largest_free() == 4096 - 1024 - 2 * 512


def test_compaction_fills_the_room_before_a_pin_with_what_fits():
    a = SlabAllocator(10 * 64)
    first = a.alloc(64)
    pin = a.alloc(2 * 64)
    big, small = a.alloc(3 * 64), a.alloc(64)
    a.free(first)
    moves = a.compact(pinned={pin})  # the small one goes before the pin; the large one fits only after it
    assert [(m.src, m.dst) for m in moves] == [(small, 0)] and big == pin + 128
    assert a.largest_free() == 10 * 64 - (big + 3 * 64)


def test_shrink_returns_the_tail():
    a = SlabAllocator(4096)
    off = a.alloc(4000)
    a.shrink(off, 100)
    assert a.used_bytes == 128 and a.largest_free() == 4096 - 128
    assert a.alloc(3968) == 128


# -- kvstore.memory.buffers ---------------------------------------------------------------


def test_scratch_is_reused_grows_and_is_per_thread():
    import threading

    from kvstore.memory.buffers import Scratch

    made: list[int] = []

    def alloc(n: int) -> bytearray:
        made.append(n)
        return bytearray(n)

    s = Scratch(alloc, len, round_to=4096, max_kept=1 << 20)
    a = s.get(100)
    assert len(a) == 4096 and s.get(4096) is a  # rounded up, then reused
    big = s.get(2 << 20)
    assert len(big) == 2 << 20 and s.get(100) is a  # over max_kept: lent, not kept
    other: list[bytearray] = []
    t = threading.Thread(target=lambda: other.append(s.get(100)))
    t.start()
    t.join()
    assert other[0] is not a  # each thread has its own
    s.drop()
    assert s.get(100) is not a
    doubling = Scratch(bytearray, len, grow=2.0)
    first = doubling.get(1000)
    assert len(doubling.get(1001)) == 2000 and len(first) == 1000


def test_buffer_pool_lends_the_smallest_fit_and_keeps_at_most_keep_bytes():
    from kvstore.memory.buffers import BufferPool

    pool = BufferPool(keep_bytes=3 << 20)
    small, big = pool.acquire(1 << 20), pool.acquire(2 << 20)
    pool.release(big)
    pool.release(small)
    assert pool.acquire(100) is small  # the smallest that fits
    pool.release(small)
    pool.release(bytearray(2 << 20))  # 5 MiB idle: the largest go first
    assert sum(len(b) for b in [pool.acquire(1), pool.acquire(1)]) <= 3 << 20


def test_a_bounded_pool_lends_no_buffer_over_twice_the_request_and_keeps_the_big_ones():
    import numpy as np

    from kvstore.memory.buffers import BufferPool

    made: list[int] = []

    def alloc(n: int) -> np.ndarray:
        made.append(n)
        return np.empty(n, np.uint8)

    pool = BufferPool(3 << 20, alloc=alloc, max_slack=0, drop_smallest=True)
    big = pool.acquire(2 << 20)
    pool.release(big)
    assert pool.acquire(1 << 19) is not big  # 2 MiB for 512 KiB is past twice: a fresh one
    assert pool.acquire(1 << 20) is big  # 2 MiB for 1 MiB fits
    pool.release(big)
    pool.release(np.empty(1 << 20, np.uint8))
    pool.release(np.empty(1 << 19, np.uint8))  # 3.5 MiB idle: the smallest goes
    assert sorted(len(pool.acquire(1 << 20)) for _ in range(2)) == [1 << 20, 2 << 20]
