"""The Tier conformance suite: every tier passes the same tests.

A tier's test module subclasses ``TierContract`` and supplies one fixture,
``make_tier(capacity_bytes) -> Tier``, returning a fresh, empty tier on its
real backing; and builds a state machine with ``tier_state_machine``.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.errors import InvalidInput, InvalidKey, KVStoreError, StoreClosed, TierFull
from kvstore.tier import Tier, TierStats

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class TierContract:
    """Subclass with a ``make_tier`` fixture: ``make_tier(capacity_bytes=...) -> Tier``."""

    @pytest.fixture
    def tier(self, make_tier) -> Tier:
        return make_tier(capacity_bytes=64 * MiB)

    def test_attributes(self, tier):
        assert isinstance(tier.name, str) and tier.name
        assert isinstance(tier.capacity_bytes, int) and tier.capacity_bytes > 0
        assert isinstance(tier.durable, bool) and isinstance(tier.shared, bool)

    def test_put_get_round_trip(self, tier):
        data = payload(4096, 1)
        tier.put(key(1), data)
        assert bytes(tier.get(key(1))) == data

    def test_missing_key_is_none(self, tier):
        assert tier.get(key(99)) is None
        assert tier.contains(key(99)) is False
        assert tier.delete(key(99)) is False

    def test_accepts_any_buffer(self, tier):
        data = payload(1000, 2)
        for i, buf in enumerate([data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)]):
            tier.put(key(i), buf)
            assert bytes(tier.get(key(i))) == data

    def test_empty_and_large_frames(self, tier):
        tier.put(key(1), b"")
        assert bytes(tier.get(key(1))) == b""
        big = payload(16 * MiB, 3)
        tier.put(key(2), big)
        assert bytes(tier.get(key(2))) == big

    def test_overwrite_replaces_and_reaccounts(self, tier):
        tier.put(key(1), payload(3000, 1))
        tier.put(key(1), payload(1000, 2))
        assert bytes(tier.get(key(1))) == payload(1000, 2)
        stats = tier.stats()
        assert stats.entries == 1
        assert stats.used_bytes == 1000

    def test_returned_buffer_is_stable(self, tier):
        tier.put(key(1), payload(2048, 1))
        held = tier.get(key(1))
        tier.delete(key(1))
        tier.put(key(1), payload(2048, 2))
        tier.put(key(2), payload(2048, 3))
        assert bytes(held) == payload(2048, 1)

    def test_delete(self, tier):
        tier.put(key(1), b"abc")
        assert tier.delete(key(1)) is True
        assert tier.get(key(1)) is None
        assert tier.delete(key(1)) is False
        assert tier.stats().used_bytes == 0

    def test_contains_and_keys(self, tier):
        for i in range(5):
            tier.put(key(i), payload(100, i))
        assert all(tier.contains(key(i)) for i in range(5))
        assert sorted(tier.keys()) == sorted(key(i) for i in range(5))

    def test_stats(self, tier):
        tier.put(key(1), payload(500))
        tier.get(key(1))
        tier.get(key(2))
        stats = tier.stats()
        assert isinstance(stats, TierStats)
        assert (stats.entries, stats.used_bytes) == (1, 500)
        assert stats.capacity_bytes == tier.capacity_bytes
        assert stats.counters.hits == 1 and stats.counters.misses == 1
        assert stats.counters.puts == 1 and stats.counters.gets == 2
        assert stats.to_dict()["free_bytes"] == tier.capacity_bytes - 500

    def test_full_raises_and_changes_nothing(self, make_tier):
        tier = make_tier(capacity_bytes=1 * MiB)
        tier.put(key(1), payload(600 * 1024, 1))
        with pytest.raises(TierFull) as info:
            tier.put(key(2), payload(600 * 1024, 2))
        assert info.value.tier == tier.name
        assert tier.get(key(2)) is None
        assert bytes(tier.get(key(1))) == payload(600 * 1024, 1)
        assert tier.stats().used_bytes == 600 * 1024
        tier.put(key(1), payload(1 * MiB, 3))  # replacing frees the old frame first
        assert tier.stats().used_bytes == 1 * MiB

    def test_bad_key_is_typed_error(self, tier):
        with pytest.raises(InvalidKey):
            tier.put(b"short", b"x")

    def test_batch_forms(self, tier):
        items = [(key(i), payload(64, i)) for i in range(6)]
        tier.put_many(items)
        got = tier.get_many([key(i) for i in range(8)])
        assert [bytes(g) if g is not None else None for g in got] == [d for _, d in items] + [None, None]
        assert tier.contains_many([key(0), key(7)]) == [True, False]
        assert tier.delete_many([key(0), key(1), key(7)]) == 2

    def test_put_with_writes_in_place(self, tier):
        def writer(view: memoryview) -> int:
            view[:5] = b"hello"
            return 5

        assert tier.put_with(key(1), 64, writer) == 5
        assert bytes(tier.get(key(1))) == b"hello"
        assert tier.stats().used_bytes == 5

    def test_put_with_refuses_a_full_tier_before_writing(self, make_tier):
        tier = make_tier(capacity_bytes=1 * MiB)
        tier.put(key(1), payload(600 * 1024, 1))
        calls = []
        with pytest.raises(TierFull):
            tier.put_with(key(2), 600 * 1024, lambda view: calls.append(1) or 0)
        assert calls == []  # nothing was spent: the caller may make room and try again
        assert tier.get(key(2)) is None and tier.stats().used_bytes == 600 * 1024

    def test_get_into_reused_buffer(self, tier):
        out = bytearray(8192)
        tier.put(key(1), payload(5000, 1))
        assert tier.get_into(key(1), out) == 5000
        assert bytes(out[:5000]) == payload(5000, 1)
        assert tier.get_into(key(2), out) is None
        with pytest.raises(InvalidInput):
            tier.get_into(key(1), bytearray(10))
        with pytest.raises(InvalidInput):
            tier.get_into(key(1), bytes(8192))  # read-only
        with pytest.raises(InvalidInput):
            tier.get_into(key(1), np.zeros((2, 8192), np.uint8)[:, ::2])  # not contiguous

    def test_read_with_lends_the_frame_for_the_call(self, tier):
        tier.put(key(1), payload(5000, 1))
        assert tier.read_with(key(1), lambda view: (len(view), bytes(view[:64]))) == (5000, payload(5000, 1)[:64])
        assert tier.read_with(key(2), lambda view: pytest.fail("called for a missing key")) is None
        # The lent frame stays the one stored while the key is deleted and rewritten meanwhile.
        def rewrite_and_read(view):
            assert tier.delete(key(1))
            tier.put(key(1), payload(5000, 3))
            tier.put(key(4), payload(5000, 4))
            return bytes(view)
        assert tier.read_with(key(1), rewrite_and_read) == payload(5000, 1)
        assert tier.read_with(key(1), bytes) == payload(5000, 3)
        assert tier.head(key(1), 64) == (payload(5000, 3)[:64], 5000)
        # A reader that fails leaves the frame readable and deletable.
        with pytest.raises(ZeroDivisionError):
            tier.read_with(key(1), lambda view: 1 / 0)
        assert tier.get(key(1)) is not None and tier.delete(key(1))

    def test_head_gives_a_prefix_and_the_length(self, tier):
        tier.put(key(1), payload(5000, 1))
        head, length = tier.head(key(1), 100)
        assert bytes(head) == payload(5000, 1)[:100] and length == 5000
        assert tier.head(key(2), 100) is None

    def test_threads(self, tier):
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for i in range(200):
                    k = key(t * 1000 + i % 20)
                    data = payload(256, t * 1000 + i % 20)
                    tier.put(k, data)
                    got = tier.get(k)
                    assert got is None or bytes(got) == data
                    if i % 3 == 0:
                        tier.delete(k)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        stats = tier.stats()
        live = list(tier.keys())
        assert stats.entries == len(live)
        assert stats.used_bytes == sum(len(bytes(tier.get(k))) for k in live)

    def test_close(self, make_tier):
        tier = make_tier(capacity_bytes=1 * MiB)
        tier.put(key(1), b"x")
        tier.close()
        tier.close()  # idempotent
        with pytest.raises(StoreClosed):
            tier.get(key(1))
        with pytest.raises(KVStoreError):
            tier.put(key(1), b"x")


def tier_state_machine(factory, capacity_bytes: int = 64 * 1024, max_examples: int = 60):
    """A Hypothesis state machine checking a tier against a dict model.

    ``factory(capacity_bytes)`` must return a fresh, empty tier.
    """

    class TierMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tier = factory(capacity_bytes)
            self.model: dict[bytes, bytes] = {}

        keys = st.integers(0, 7).map(key)

        @rule(k=keys, data=st.binary(max_size=24 * 1024))
        def put(self, k, data):
            used = sum(len(v) for kk, v in self.model.items() if kk != k)
            if used + len(data) > capacity_bytes:
                with pytest.raises(TierFull):
                    self.tier.put(k, data)
            else:
                self.tier.put(k, data)
                self.model[k] = data

        @rule(k=keys)
        def get(self, k):
            got = self.tier.get(k)
            assert (None if got is None else bytes(got)) == self.model.get(k)

        @rule(k=keys)
        def delete(self, k):
            assert self.tier.delete(k) == (k in self.model)
            self.model.pop(k, None)

        @rule(k=keys)
        def contains(self, k):
            assert self.tier.contains(k) == (k in self.model)

        @precondition(lambda self: self.model)
        @rule()
        def list_keys(self):
            assert sorted(self.tier.keys()) == sorted(self.model)

        @invariant()
        def accounting(self):
            stats = self.tier.stats()
            assert stats.entries == len(self.model)
            assert stats.used_bytes == sum(len(v) for v in self.model.values())
            assert stats.used_bytes <= stats.capacity_bytes

        def teardown(self):
            self.tier.close()

    TierMachine.TestCase.settings = settings(
        max_examples=int(os.environ.get("KVSTORE_HYPOTHESIS_EXAMPLES", max_examples)),
        stateful_step_count=30,
        deadline=None,
    )
    return TierMachine
