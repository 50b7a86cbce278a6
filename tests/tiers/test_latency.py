"""LatencyTier: conformance around a MemoryTier, and the delays it promises.

Timing tests assert lower bounds only: a loaded machine makes ops slower,
never faster, so an upper bound would be flaky and a lower bound is honest.
"""

import threading
import time

import numpy as np
import pytest

from kvstore.errors import InvalidInput
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tiers.latency import CXL_ADDED_LATENCY_NS, CXL_BANDWIDTH_GBPS, LatencyTier
from tiers.memory import MemoryTier


def cxl_memory(capacity_bytes: int) -> LatencyTier:
    return LatencyTier(MemoryTier(capacity_bytes))


class TestLatencyOverMemory(TierContract):
    @pytest.fixture
    def make_tier(self):
        made = []

        def make(capacity_bytes: int) -> LatencyTier:
            made.append(cxl_memory(capacity_bytes))
            return made[-1]

        yield make
        for tier in made:
            tier.close()

    def test_identity_shows_through(self, tier):
        assert (tier.name, tier.capacity_bytes) == (tier.inner.name, tier.inner.capacity_bytes)
        assert (tier.durable, tier.shared) == (tier.inner.durable, tier.inner.shared)
        stats = tier.stats()
        assert stats.kind == "memory" and stats.name == "memory"
        assert stats.details["backing"] == tier.inner.stats().details["backing"]

    def test_stats_name_the_model(self, tier):
        details = tier.stats().details
        assert details["latency_ns"] == str(CXL_ADDED_LATENCY_NS)
        assert details["bandwidth_gbps"] == f"{CXL_BANDWIDTH_GBPS:g}"
        assert "GB/s" in details["latency_model"]


TestLatencyStateMachine = tier_state_machine(cxl_memory).TestCase


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def test_32mib_at_1_gbps_takes_about_32ms():
    tier = LatencyTier(MemoryTier(64 * MiB), latency_ns=0, bandwidth_gbps=1)
    frame = np.zeros(32 * MiB, np.uint8)
    out = bytearray(32 * MiB)
    # 32 MiB / 1e9 B/s = 33.6 ms; generous lower bounds only.
    assert timed(tier.put, key(1), frame) >= 0.025
    assert timed(tier.get, key(1)) >= 0.025
    assert timed(tier.get_into, key(1), out) >= 0.025
    # The wrapper waits out what the inner copies did not already take.
    assert float(tier.stats().details["injected_delay_s"]) >= 0.05


def test_latency_applies_to_every_data_op():
    tier = LatencyTier(MemoryTier(1 * MiB), latency_ns=2_000_000, bandwidth_gbps=float("inf"))
    tier.put(key(1), b"x")
    for op in (tier.contains, tier.get, tier.delete):
        assert timed(op, key(1)) >= 0.0019
    assert timed(tier.keys) >= 0.0019
    assert timed(tier.get_many, [key(1), key(2)]) >= 0.0019  # a batch pays it once


def test_short_latency_is_spun_not_slept():
    tier = LatencyTier(MemoryTier(1 * MiB), latency_ns=50_000, bandwidth_gbps=float("inf"))
    assert timed(tier.contains, key(1)) >= 50e-6


def test_bandwidth_is_shared_by_threads():
    tier = LatencyTier(MemoryTier(64 * MiB), latency_ns=0, bandwidth_gbps=1)
    frame = bytes(8 * MiB)
    threads = [threading.Thread(target=tier.put, args=(key(i), frame)) for i in range(4)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # Four 8 MiB puts share one 1 GB/s link: 33.6 ms in all, not 8.4 ms each in parallel.
    assert time.perf_counter() - start >= 0.025


def test_failed_op_still_pays_latency():
    tier = LatencyTier(MemoryTier(1 * MiB), latency_ns=2_000_000)
    start = time.perf_counter()
    with pytest.raises(InvalidInput):
        tier.put(b"short", b"x")
    assert time.perf_counter() - start >= 0.0019


def test_wraps_an_arena_tier():
    from tiers.cxl import CXLTier

    with LatencyTier(CXLTier(4 * MiB, hugepages=False)) as tier:
        data = payload(100_000, 7)
        tier.put(key(1), data)
        out = bytearray(100_000)
        assert tier.get_into(key(1), out) == 100_000 and bytes(out) == data
        details = tier.stats().details
        assert "mbind" in details and details["latency_model"].startswith("+90 ns")
        assert tier.stats().kind == "cxl"


@pytest.mark.parametrize("kw", [
    {"latency_ns": -1}, {"latency_ns": float("inf")}, {"latency_ns": True}, {"latency_ns": "90"},
    {"bandwidth_gbps": 0}, {"bandwidth_gbps": -1.0}, {"bandwidth_gbps": float("nan")},
])
def test_bad_model_is_invalid_input(kw):
    with pytest.raises(InvalidInput):
        LatencyTier(MemoryTier(MiB), **kw)


def test_inner_must_be_a_tier():
    with pytest.raises(InvalidInput):
        LatencyTier({})
