"""CXLTier on both of its paths: THP fallback (always) and real 2 MiB hugetlb pages.

The hugetlb tests reserve pages themselves, as root: a module fixture raises
``/proc/sys/vm/nr_hugepages`` by ``TEST_PAGES``, checks what the kernel
granted, and always puts the old value back. Without root (or with a read-only
``/proc/sys``) they skip and say why. Changes to the pool happen under a
``flock`` so two test runs on one machine do not undo each other's pool.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

from kvstore.errors import InvalidInput, StoreClosed
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tiers.cxl import HUGE_PAGE, CXLTier, online_nodes

NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"
NR_OVERCOMMIT = "/proc/sys/vm/nr_overcommit_hugepages"
POOL_LOCK = "/tmp/kvstore-test-nr_hugepages.lock"
TEST_PAGES = 64
"""Pages (2 MiB) the module reserves: 128 MiB."""
PAGES_NEEDED = 34
"""The contract's largest arena (64 MiB + slot slack = 33 pages) plus a 1 MiB one alive with it."""


def _read_int(path: str) -> int:
    with open(path) as f:
        return int(f.read().split()[0])


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _free_hugepages() -> int:
    """Pages a new MAP_HUGETLB mapping could reserve: free ones not already promised."""
    return _meminfo("HugePages_Free") - _meminfo("HugePages_Rsvd")


_held: list = []  # the open lock file while this process holds the pool lock


@contextmanager
def _pool_lock() -> Iterator[None]:
    """Exclusive use of the hugepage pool: across processes (flock), re-entrant within this one."""
    if _held:
        yield
        return
    with open(POOL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _held.append(lock)
        try:
            yield
        finally:
            _held.pop()


@contextmanager
def hugetlb_pages(target: int) -> Iterator[int]:
    """Hold nr_hugepages at ``target`` while the block runs; yields what the kernel granted.

    Skips when the pool cannot be changed here (not root, read-only /proc/sys).
    """
    if os.geteuid() != 0:
        pytest.skip("reserving hugepages needs root")
    with _pool_lock():
        old = _read_int(NR_HUGEPAGES)
        try:
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(target))
        except OSError as exc:
            pytest.skip(f"cannot write {NR_HUGEPAGES}: {exc}")
        try:
            yield _read_int(NR_HUGEPAGES)
        finally:
            with open(NR_HUGEPAGES, "w") as f:
                f.write(str(old))


@pytest.fixture(scope="module")
def hugepages() -> Iterator[int]:
    """TEST_PAGES more 2 MiB pages for this module's tests, restored afterwards."""
    with _pool_lock():
        old = _read_int(NR_HUGEPAGES)
        with hugetlb_pages(old + TEST_PAGES) as granted:
            if _free_hugepages() < PAGES_NEEDED:  # the kernel may grant fewer than asked
                pytest.skip(f"asked for {TEST_PAGES} hugepages, {granted - old} granted, "
                            f"{_free_hugepages()} free; the tests need {PAGES_NEEDED}")
            yield granted


@pytest.fixture
def no_free_hugepages() -> Iterator[None]:
    """No hugetlb page can back a new mapping while the test runs."""
    with _pool_lock():
        if _read_int(NR_OVERCOMMIT) > 0:
            pytest.skip("nr_overcommit_hugepages > 0: the kernel may hand out surplus pages")
        if _free_hugepages() <= 0:
            yield
        else:
            with hugetlb_pages(0):
                yield


def assert_bound(details: dict[str, str]) -> None:
    """Bound and on the node asked for, or honest about why not (seccomp may refuse mbind)."""
    if details["mbind"] == "ok":
        assert details["numa_nodes_observed"] == details["numa_node_requested"]
    else:
        assert details["mbind"].startswith("failed: ")


# -- the THP fallback path: runs everywhere ----------------------------------------------


def thp_tier(capacity_bytes: int, **kw) -> CXLTier:
    return CXLTier(capacity_bytes, hugepages=False, **kw)


class TestCXLFallback(TierContract):
    @pytest.fixture
    def make_tier(self):
        made = []

        def make(capacity_bytes: int) -> CXLTier:
            made.append(thp_tier(capacity_bytes))
            return made[-1]

        yield make
        for tier in made:
            tier.close()

    def test_kind_and_flags(self, tier):
        stats = tier.stats()
        assert (stats.kind, stats.durable, stats.shared) == ("cxl", False, False)

    def test_details_do_not_claim_hugetlb(self, tier):
        details = tier.stats().details
        assert details["hugetlb"] == "not requested"
        assert "hugetlb" not in details["page_size"] and "MAP_HUGETLB" not in details["backing"]
        assert details["hugetlb_bytes"] == "0"
        assert 0 <= int(details["thp_bytes"]) <= tier.map_bytes
        assert ("THP" in details["page_size"]) == (int(details["thp_bytes"]) > 0)
        assert tier.map_bytes % HUGE_PAGE == 0 and tier.map_bytes >= tier.arena_bytes

    def test_bound_and_faulted_in_by_the_writes(self):
        # A THP arena holds no memory until frames are written into it (an idle server's
        # anonymous memory is what it stores), and the memory it then holds is bound.
        with thp_tier(32 * MiB) as tier:
            details = tier.stats().details
            assert details["prefault"].startswith("none") and int(details["resident_bytes"]) < 4 * MiB
            for i in range(6):
                tier.put(key(i), payload(MiB - 64, i))
            tier._facts_at = -float("inf")  # the page facts are cached for FACTS_TTL_S: read them now
            details = tier.stats().details
            assert int(details["resident_bytes"]) >= 6 * MiB
            assert details["numa_node_requested"] == str(max(online_nodes()))
            assert_bound(details)
            assert all(bytes(tier.get(key(i))) == payload(MiB - 64, i) for i in range(6))

    def test_an_idle_trim_hands_back_the_pages_of_free_ranges_only(self):
        # Frames written fault pages in; deleted, their whole huge pages go back to the kernel
        # (an idle server shrinks), while the frames still stored keep their bytes.
        with thp_tier(32 * MiB) as tier:
            for i in range(12):
                tier.put(key(i), payload(2 * MiB - 64, i))
            resident = lambda: int(tier.stats().details["resident_bytes"])  # noqa: E731
            tier._facts_at = -float("inf")  # the page facts are cached for FACTS_TTL_S: read them now
            full = resident()
            assert full >= 24 * MiB
            for i in range(2, 12):
                tier.delete(key(i))
            released = tier.release_free()
            assert released >= 16 * MiB and released % HUGE_PAGE == 0
            tier._facts_at = -float("inf")
            # the kernel took them back: what stays is the two frames kept (and a page they share)
            assert resident() <= 3 * HUGE_PAGE and full - resident() >= 18 * MiB
            assert tier.stats().details["free_released"].startswith(f"{released} bytes at the last of 1 ")
            assert all(bytes(tier.get(key(i))) == payload(2 * MiB - 64, i) for i in range(2))
            for i in range(2, 12):  # the released ranges take frames again, faulted in afresh
                tier.put(key(i), payload(2 * MiB - 64, 100 + i))
            assert all(bytes(tier.get(key(i))) == payload(2 * MiB - 64, 100 + i) for i in range(2, 12))
            assert all(bytes(tier.get(key(i))) == payload(2 * MiB - 64, i) for i in range(2))

    def test_put_with_writes_straight_into_the_arena(self, tier):
        seen = []

        def writer(view: memoryview) -> int:
            seen.append(np.frombuffer(view, np.uint8).ctypes.data)
            view[:3] = b"abc"
            return 3

        tier.put_with(key(1), 4096, writer)
        assert tier._map.addr <= seen[0] < tier._map.addr + tier.map_bytes  # no staging buffer
        assert bytes(tier.get(key(1))) == b"abc"


TestCXLFallbackStateMachine = tier_state_machine(thp_tier).TestCase


def test_without_hugepages_falls_back_and_says_so(no_free_hugepages):
    with CXLTier(1 * MiB) as tier:
        details = tier.stats().details
        assert details["hugetlb"].startswith("refused: ENOMEM")
        assert "hugetlb" not in details["page_size"] and details["hugetlb_bytes"] == "0"
        tier.put(key(1), b"still works")
        assert bytes(tier.get(key(1))) == b"still works"


def test_compaction_moves_overlapping_ranges():
    with thp_tier(1 * MiB, max_entries=16) as tier:
        sizes = {0: 64 * 1024, 1: 512 * 1024, 2: 64 * 1024, 3: 384 * 1024}  # exactly full
        for i, n in sizes.items():
            tier.put(key(i), payload(n, i))
        tier.delete(key(0))
        tier.delete(key(2))
        # 128 KiB is free only in pieces: 1 and 3 slide down over their own old bytes.
        tier.put(key(4), payload(128 * 1024, 4))
        assert tier.stats().details["compactions"] == "1"
        for i in (1, 3):
            assert bytes(tier.get(key(i))) == payload(sizes[i], i)
        assert bytes(tier.get(key(4))) == payload(128 * 1024, 4)


# -- NUMA node ---------------------------------------------------------------------------


def test_default_node_is_the_highest_online():
    with thp_tier(1 * MiB) as tier:
        assert tier.numa_node == max(online_nodes())
        assert tier.stats().details["numa_node_requested"] == str(max(online_nodes()))


@pytest.mark.parametrize("node", [7, 1023, -1, True, "0", 0.0])
def test_node_that_is_not_online_is_invalid_input(node):
    if node in online_nodes() and type(node) is int:
        pytest.skip(f"node {node} exists here")
    with pytest.raises(InvalidInput, match="online node"):
        CXLTier(1 * MiB, numa_node=node)


# -- close while others copy -------------------------------------------------------------


def test_close_waits_for_a_writer_in_the_arena():
    tier = thp_tier(1 * MiB)
    inside, release, outcome = threading.Event(), threading.Event(), []

    def writer(view: memoryview) -> int:
        inside.set()
        release.wait(5)
        view[:4] = b"late"  # must still be mapped
        return 4

    def put() -> None:
        try:
            tier.put_with(key(1), 64, writer)
        except StoreClosed as exc:
            outcome.append(exc)

    putter = threading.Thread(target=put)
    putter.start()
    inside.wait(5)
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and tier._unmap.alive  # close waits; nothing unmapped yet
    release.set()
    putter.join(5)
    closer.join(5)
    assert not closer.is_alive() and not tier._unmap.alive
    assert len(outcome) == 1  # the put lost the race to close, with a typed error


def test_copy_after_close_is_store_closed_not_a_crash():
    tier = thp_tier(1 * MiB)
    tier.put(key(1), b"frame")
    slot = tier._slots[key(1)]  # a reader that pinned this before close ...
    tier.close()
    with pytest.raises(StoreClosed):  # ... and copies after it
        tier._copy_out(slot.offset, slot.length)


def test_gets_racing_close():
    for _ in range(5):
        tier = thp_tier(8 * MiB)
        tier.put(key(1), payload(4 * MiB, 1))
        errors: list[BaseException] = []

        def read() -> None:
            out = bytearray(4 * MiB)
            try:
                while tier.get_into(key(1), out) == 4 * MiB:
                    pass
            except StoreClosed:
                return
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        readers = [threading.Thread(target=read) for _ in range(2)]
        for th in readers:
            th.start()
        time.sleep(0.01)
        tier.close()
        for th in readers:
            th.join(5)
        assert not errors


# -- the hugetlb path: root reserves real 2 MiB pages ------------------------------------


def huge_tier(capacity_bytes: int) -> CXLTier:
    tier = CXLTier(capacity_bytes)
    assert tier.stats().details["page_size"] == "2 MiB (hugetlb)", tier.stats().details
    return tier


class TestCXLHugepages(TierContract):
    @pytest.fixture
    def make_tier(self, hugepages):
        made = []

        def make(capacity_bytes: int) -> CXLTier:
            made.append(huge_tier(capacity_bytes))
            return made[-1]

        yield make
        for tier in made:
            tier.close()

    def test_stats_say_2mib_pages(self, tier):
        details = tier.stats().details
        assert details["hugetlb"] == "obtained" and details["backing"] == "anonymous mmap, MAP_HUGETLB"
        assert details["hugetlb_bytes"] == str(tier.map_bytes)  # pre-faulted, all of it
        assert details["thp_bytes"] == "0"
        assert_bound(details)

    def test_close_returns_the_pages(self, make_tier):
        before = _meminfo("HugePages_Free")
        tier = make_tier(capacity_bytes=8 * MiB)
        assert _meminfo("HugePages_Free") <= before - tier.map_bytes // HUGE_PAGE
        tier.close()
        assert _meminfo("HugePages_Free") == before


TestCXLHugepageStateMachine = pytest.mark.usefixtures("hugepages")(
    tier_state_machine(huge_tier, max_examples=20).TestCase
)


def test_hugetlb_pages_the_node_cannot_back_fall_back_to_thp(hugepages, monkeypatch):
    # Fault injection: on a multi-node host the pool may hold no pages on the
    # bound node; populate then fails with ENOMEM. Simulate it for hugetlb only.
    import tiers.cxl as cxl

    real = cxl._prefault

    def prefault(addr: int, length: int) -> str:
        if cxl._smaps_kib(addr, length).get("KernelPageSize") == HUGE_PAGE // 1024:
            raise cxl.TierIOError("cannot fault in: ENOMEM (simulated)")
        return real(addr, length)

    monkeypatch.setattr(cxl, "_prefault", prefault)
    free = _meminfo("HugePages_Free")
    with CXLTier(1 * MiB) as tier:
        details = tier.stats().details
        assert details["hugetlb"].startswith("refused at fault-in on node 0")
        assert details["hugetlb_bytes"] == "0" and "hugetlb" not in details["page_size"]
        tier.put(key(1), b"ok")
        assert bytes(tier.get(key(1))) == b"ok"
    assert _meminfo("HugePages_Free") == free  # the refused hugetlb mapping was unmapped
