"""kvstore.engine.evict: selection semantics over a real store (no HTTP)."""

from __future__ import annotations

import pytest

from kvstore import KVStore
from kvstore.errors import InvalidInput
from kvstore.engine.evict import EvictionQuery, evict, select
from kvstore.keys import block_hashes
from tests.conftest import FakeClock, make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier


@pytest.fixture
def store():
    s = KVStore([ShmTier(16 << 20), MemoryTier(16 << 20)], background=False)
    yield s
    s.close()


def _fill(store, spec):
    a, b = list(range(64)), list(range(100, 132))
    store.put_kv(spec, a, make_kv(spec, 64), "ns1")
    store.put_kv(spec, b, make_kv(spec, 32), "ns2")
    return a, b


def test_selectors_combine_with_and(store, spec):
    a, b = _fill(store, spec)
    keys_a = block_hashes(spec, a, "ns1")
    store.migrate(keys_a[3], "memory")
    assert {e.key for e in select(store, EvictionQuery(namespace="ns1")).entries} == set(keys_a)
    plan = select(store, EvictionQuery(namespace="ns1", tier="shm"))
    assert {e.key for e in plan.entries} == set(keys_a[:3])
    assert select(store, EvictionQuery(namespace="ns2", tier="memory")).entries == []
    both = select(store, EvictionQuery(keys=(keys_a[0], keys_a[3]), tier="memory"))
    assert [e.key for e in both.entries] == [keys_a[3]]
    assert plan.bytes == sum(e.size for e in plan.entries) and plan.by_tier() == {
        "shm": {"blocks": 3, "bytes": plan.bytes}}


def test_prefix_selects_that_chain_in_that_namespace_only(store, spec):
    a, _ = _fill(store, spec)
    store.put_kv(spec, a[:32], make_kv(spec, 32), "ns2")
    plan = select(store, EvictionQuery(prefix_spec=spec, prefix_tokens=a[:32], namespace="ns1"))
    assert {e.key for e in plan.entries} == set(block_hashes(spec, a[:32], "ns1"))  # not ns2's copy
    other = make_spec(model_id="another")
    assert select(store, EvictionQuery(prefix_spec=other, prefix_tokens=a, namespace="ns1")).entries == []


def test_limit_takes_the_coldest_and_pins_are_skipped(store, spec):
    a, b = _fill(store, spec)
    for _ in range(3):
        store.get_kv(spec, b, "ns2")  # b is hot
    plan = select(store, EvictionQuery(tier="shm", limit=4))
    assert {e.key for e in plan.entries} == set(block_hashes(spec, a, "ns1"))
    store.pin_keys(block_hashes(spec, a, "ns1")[:2])
    plan = select(store, EvictionQuery(tier="shm"))
    assert plan.skipped_pinned == 2 and len(plan.entries) == 4
    assert len(select(store, EvictionQuery(tier="shm", include_pinned=True)).entries) == 6


def test_tenant_scope_hides_other_namespaces_even_by_key(store, spec):
    a, b = _fill(store, spec)
    q = EvictionQuery(keys=tuple(block_hashes(spec, a, "ns1")), namespaces_allowed=frozenset({"ns2"}))
    result = evict(store, q)
    assert result.plan.blocks == 0 and result.removed_blocks == 0
    assert store.lookup(spec, a, "ns1") == 64


def test_evict_removes_and_counts_bytes(store, spec):
    a, _ = _fill(store, spec)
    dry = evict(store, EvictionQuery(namespace="ns1"), dry_run=True)
    assert dry.removed_blocks == 0 and store.lookup(spec, a, "ns1") == 64
    done = evict(store, EvictionQuery(namespace="ns1"))
    assert done.removed_blocks == 4 and done.removed_bytes == dry.plan.bytes > 0
    assert store.lookup(spec, a, "ns1") == 0 and len(store.entries()) == 2


@pytest.mark.parametrize("fields,words", [
    ({}, "at least one selector"),
    ({"namespace": "bad ns"}, "namespace"),
    ({"fingerprint": "abc"}, "64 hex"),
    ({"watermark_frac": 0.5}, "needs a tier"),
    ({"tier": "shm", "watermark_frac": 1.5}, "frac"),
    ({"older_than_s": "old"}, "older_than_s"),
    ({"limit": -1, "tier": "shm"}, "limit"),
    ({"keys": (b"short",)}, "keys"),
])
def test_bad_queries_say_what_is_wrong(fields, words):
    with pytest.raises(InvalidInput, match=words):
        EvictionQuery(**fields)


def test_unknown_tier_is_refused(store):
    with pytest.raises(InvalidInput, match="unknown tier 'tape'"):
        select(store, EvictionQuery(tier="tape"))


def test_older_than_selects_by_last_access_on_the_stores_clock(spec):
    """Aged by advancing the store's clock, not by sleeping: ``now_s`` is a reading of the same clock."""
    clock = FakeClock()
    with KVStore([ShmTier(16 << 20), MemoryTier(16 << 20)], background=False, clock=clock) as store:
        old, new = list(range(32)), list(range(500, 532))
        store.put_kv(spec, old, make_kv(spec, 32))
        clock.advance(10)
        store.put_kv(spec, new, make_kv(spec, 32))
        clock.advance(1)
        plan = select(store, EvictionQuery(older_than_s=5), now_s=store.clock())
        assert {e.key for e in plan.entries} == set(block_hashes(spec, old))
        store.get_kv(spec, old[:16])  # a read makes the first block young again
        plan = select(store, EvictionQuery(older_than_s=5), now_s=store.clock())
        assert [e.key for e in plan.entries] == block_hashes(spec, old)[1:]
        clock.advance(10)
        assert len(select(store, EvictionQuery(older_than_s=5), now_s=store.clock()).entries) == 4
