"""ArenaTier's shared body, checked through the plainest arena: a bytearray."""

import threading

import numpy as np
import pytest

from kvstore.errors import StoreClosed, TierFull
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tiers.arena import ArenaTier


class HeapArena(ArenaTier):
    kind = "heap-arena"
    durable = False
    shared = False

    def __init__(self, capacity_bytes, **kw):
        super().__init__(capacity_bytes, name="heap", **kw)
        self.buf = np.zeros(self.arena_bytes, np.uint8)

    def _copy_in(self, offset, frame):
        self.buf[offset:offset + len(frame)] = np.frombuffer(frame, np.uint8)

    def _copy_out(self, offset, length):
        return self.buf[offset:offset + length].tobytes()

    def _move(self, moves):
        for m in moves:
            self.buf[m.dst:m.dst + m.size] = self.buf[m.src:m.src + m.size].copy()


class TestHeapArena(TierContract):
    @pytest.fixture
    def make_tier(self):
        made = []

        def make(capacity_bytes):
            made.append(HeapArena(capacity_bytes))
            return made[-1]

        yield make
        for t in made:
            t.close()

    def test_fragmented_arena_compacts_instead_of_refusing(self):
        tier = HeapArena(1 * MiB, max_entries=16)
        for i in range(8):
            tier.put(key(i), payload(128 * 1024 - 64, i))
        for i in range(0, 8, 2):
            tier.delete(key(i))
        tier.put(key(100), payload(512 * 1024 - 64, 100))
        assert tier.stats().details["compactions"] == "1"
        for i in range(1, 8, 2):
            assert bytes(tier.get(key(i))) == payload(128 * 1024 - 64, i)
        assert bytes(tier.get(key(100))) == payload(512 * 1024 - 64, 100)

    def test_lasting_reservations_do_not_split_the_arena(self):
        # Writers' pools hold reserved slots for as long as they write; placed among frames,
        # they pinned a small arena apart: free bytes enough, no range long enough.
        tier = HeapArena(1 * MiB, max_entries=64)
        block = 64 * 1024 - 64
        pools = []
        for i in range(8):
            tier.put(key(i), payload(block, i))
            if i % 2:
                pools.append(tier.reserve(key(1000 + i), block, lasting=True))
        for i in range(8):
            tier.delete(key(i))
        tier.put(key(100), payload(8 * 64 * 1024 - 64, 100))  # half the arena in one range
        assert bytes(tier.get(key(100))) == payload(8 * 64 * 1024 - 64, 100)
        assert all(p.offset >= tier.arena_bytes - 4 * 64 * 1024 for p in pools)
        for p in pools:
            tier.abort_reserved(p, block)

    def test_range_being_read_is_not_reused(self):
        tier = HeapArena(1 * MiB, max_entries=16)
        tier.put(key(1), payload(4096, 1))
        gate, release = threading.Event(), threading.Event()
        copy_out = tier._copy_out

        def slow_copy(offset, length):
            gate.set()
            release.wait(5)
            return copy_out(offset, length)

        tier._copy_out = slow_copy
        got = []
        reader = threading.Thread(target=lambda: got.append(tier.get(key(1))))
        reader.start()
        gate.wait(5)
        tier._copy_out = copy_out
        tier.delete(key(1))
        tier.put(key(2), payload(4096, 2))  # must not land on the range being read
        assert tier.stats().details["retired"] == "1"
        release.set()
        reader.join()
        assert got == [payload(4096, 1)]
        assert tier.stats().details["retired"] == "0"

    def test_slots_run_out_as_tierfull(self):
        tier = HeapArena(1 * MiB, max_entries=2)
        tier.put(key(1), b"a")
        tier.put(key(2), b"b")
        with pytest.raises(TierFull, match="slots"):
            tier.put(key(3), b"c")
        tier.put(key(2), b"bb")  # replacing needs no new row once the old one is freed

    def test_failed_writer_leaves_nothing(self):
        tier = HeapArena(1 * MiB)

        def boom(view):
            raise RuntimeError("encoder failed")

        with pytest.raises(RuntimeError):
            tier.put_with(key(1), 1000, boom)
        stats = tier.stats()
        assert stats.entries == 0 and stats.details["arena_free_bytes"] == str(tier.arena_bytes)


TestHeapArenaStateMachine = tier_state_machine(lambda cap: HeapArena(cap)).TestCase


def test_tierfull_on_replace_keeps_the_old_frame():
    # A pinned range blocks compaction; the put fails and the frame it would replace survives.
    tier = HeapArena(1 * MiB, max_entries=16)
    for i, n in ((1, 512 * 1024), (2, 256 * 1024), (3, 200 * 1024)):
        tier.put(key(i), payload(n, i))
    pinned = tier._pin(key(3))
    with pytest.raises(TierFull):
        tier.put(key(2), payload(300 * 1024, 9))
    assert bytes(tier.get(key(2))) == payload(256 * 1024, 2)
    with tier._lock:
        tier._unbusy(pinned.offset)
    tier.put(key(2), payload(300 * 1024, 9))
    assert bytes(tier.get(key(2))) == payload(300 * 1024, 9)
    assert bytes(tier.get(key(3))) == payload(200 * 1024, 3)


def test_close_during_a_put_releases_its_range():
    tier = HeapArena(1 * MiB)

    def writer(view):
        tier.close()
        return 0

    with pytest.raises(StoreClosed):
        tier.put_with(key(1), 100, writer)
    assert tier._busy == {}
