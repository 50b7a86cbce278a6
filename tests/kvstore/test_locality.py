"""Retention, prefetch and hand-off in the engine (``kvstore.engine.prefetch``, placement's rule 5),
against real shm and nvme tiers."""

from __future__ import annotations

import math

import pytest

from kvstore.errors import InvalidInput, RetainQuotaExceeded
from kvstore.engine.store import KVStore
from tests.conftest import FakeClock, make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.nvme import NVMeTier
from tiers.shm import ShmTier


@pytest.fixture
def spec():
    return make_spec()


def tiers_of(store, spec, toks, ns):
    return [store.entry(k).tier for k in store._current_keys(spec, toks, ns)]


def small_store(spec, tmp_path, *, top_blocks=12, clock=None):
    frame = spec.block_nbytes + 1024
    return KVStore([ShmTier(frame * top_blocks), NVMeTier(tmp_path, 64 << 20)], background=False,
                   **({} if clock is None else {"clock": clock}))


def sunk(store, spec, toks, ns="a"):
    """``toks``' KV put, then every block of it moved to the lower tier ``low``."""
    store.put_kv(spec, toks, make_kv(spec, len(toks)), ns)
    for key in store._current_keys(spec, toks, ns):
        store.migrate(key, "low")


def hot_residents(store, spec, blocks, *, first=0, reads=5):
    """``blocks`` one-block sequences of namespace ``b``, each read ``reads`` times: hotter than
    anything of ``a``."""
    for i in range(first, first + blocks):
        toks = list(range(10_000 + 16 * i, 10_000 + 16 * (i + 1)))
        store.put_kv(spec, toks, make_kv(spec, 16, seed=i), "b")
        for _ in range(reads):
            store.get_kv(spec, toks, "b")


def test_prefetch_brings_a_sunk_prefix_to_shm_and_logs_why(spec, tmp_path):
    with small_store(spec, tmp_path) as store:
        toks = list(range(64))
        store.put_kv(spec, toks, make_kv(spec, 64), "a")
        for key in store._current_keys(spec, toks, "a"):
            assert store.migrate(key, "nvme")
        assert set(tiers_of(store, spec, toks, "a")) == {"nvme"}
        assert store.prefetch(spec, toks + [1, 2, 3], "a") == 64
        assert store.prefetcher.idle()
        assert set(tiers_of(store, spec, toks, "a")) == {"shm"}
        record = store.prefetcher.log()[-1]
        assert record["trigger"] == "requested" and record["from"] == {"nvme": 4} and record["moved"] == 4
        why = store.explain(store._current_keys(spec, toks, "a")[0])["moves"][-1]["reason"]
        assert why.startswith("promoted: prefetched (requested)")
        assert store.prefetch(spec, list(range(500, 564)), "a") == 0  # nothing stored: nothing queued
        assert store.prefetch(spec, toks, "other") == 0  # another namespace sees nothing


def test_retention_survives_churn_that_evicts_everything_else(spec, tmp_path):
    with small_store(spec, tmp_path) as store:
        convo = list(range(64))
        store.put_kv(spec, convo, make_kv(spec, 64), "a")
        out = store.retain(spec, convo, "a", ttl_s=60, priority=2, owner="tenant-a")
        assert out["blocks"] == 4 and out["owner"] == "tenant-a" and out["retained_bytes"] == out["bytes"]
        for i in range(30):  # other tenants fill the top tier many times over
            toks = list(range(10_000 + 64 * i, 10_000 + 64 * (i + 1)))
            store.put_kv(spec, toks, make_kv(spec, 64, seed=i), "b")
            store.run_placement()
        assert tiers_of(store, spec, convo, "a") == ["shm"] * 4
        info = store.explain(store._current_keys(spec, convo, "a")[0])
        assert info["retained"]["owner"] == "tenant-a" and info["retained"]["priority"] == 2
        assert store.release(spec, convo, "a", owner="someone-else") == 0
        assert store.release(spec, convo, "a", owner="tenant-a") == 4
        assert store.placement.retention(store._current_keys(spec, convo, "a")[0]) is None


def test_retention_expires_by_the_clock(spec, tmp_path):
    clock = FakeClock()
    with small_store(spec, tmp_path, clock=clock) as store:
        convo = list(range(32))
        store.put_kv(spec, convo, make_kv(spec, 32), "a")
        store.retain(spec, convo, "a", ttl_s=30)
        assert store.placement.retained_bytes() == {"a": store.retain(spec, convo, "a", ttl_s=30)["bytes"]}
        clock.advance(31)
        assert store.placement.retention(store._current_keys(spec, convo, "a")[0]) is None
        assert store.placement.retained_bytes() == {}


def test_quota_is_per_owner_and_named(spec, tmp_path):
    with small_store(spec, tmp_path, top_blocks=40) as store:
        one, two = list(range(64)), list(range(1000, 1064))
        store.put_kv(spec, one, make_kv(spec, 64), "a")
        store.put_kv(spec, two, make_kv(spec, 64), "a")
        size = store.retain(spec, one, "a", ttl_s=60, quota_bytes=10**9)["bytes"]
        with pytest.raises(RetainQuotaExceeded, match="KVSTORE_RETAIN_QUOTA_BYTES") as err:
            store.retain(spec, two, "a", ttl_s=60, quota_bytes=size + 10)
        assert err.value.quota_bytes == size + 10 and err.value.retained_bytes == size
        assert all(store.placement.retention(k) is None for k in store._current_keys(spec, two, "a"))
        # renewing what one holds costs nothing more; another owner has its own quota
        store.retain(spec, one, "a", ttl_s=90, quota_bytes=size)
        store.retain(spec, two, "a", ttl_s=60, owner="b", quota_bytes=size)


@pytest.mark.parametrize("ttl", [0, -1, math.nan, math.inf, 86_401, "10", True])
def test_bad_ttls_and_priorities_are_refused(spec, tmp_path, ttl):
    with small_store(spec, tmp_path) as store:
        store.put_kv(spec, list(range(16)), make_kv(spec, 16), "a")
        with pytest.raises(InvalidInput, match="ttl_s"):
            store.retain(spec, list(range(16)), "a", ttl_s=ttl)
        with pytest.raises(InvalidInput, match="priority"):
            store.retain(spec, list(range(16)), "a", ttl_s=5, priority=10)
        assert store.placement.retained_bytes() == {}


def test_sooner_expiring_retention_of_the_same_owner_yields(spec, tmp_path):
    """A top tier full of one owner's retentions: a new retention of that owner, brought up
    from below, displaces its sooner-expiring one, never another owner's."""
    frame = spec.block_nbytes + 1024
    with KVStore([ShmTier(frame * 8), MemoryTier(64 << 20, name="low")], background=False) as store:
        mine_old, theirs, mine_new = list(range(64)), list(range(1000, 1064)), list(range(2000, 2064))
        for toks in (mine_old, theirs):
            store.put_kv(spec, toks, make_kv(spec, 64), "a")
        store.retain(spec, mine_old, "a", ttl_s=30, owner="t1")
        store.retain(spec, theirs, "a", ttl_s=10, owner="t2")
        store.put_kv(spec, mine_new, make_kv(spec, 64), "a")  # lands below: the top is all retained
        assert set(tiers_of(store, spec, mine_new, "a")) == {"low"}
        store.retain(spec, mine_new, "a", ttl_s=300, owner="t1")
        store.prefetcher.idle()
        for _ in range(3):
            store.run_placement()
        assert tiers_of(store, spec, mine_new, "a") == ["shm"] * 4
        assert tiers_of(store, spec, theirs, "a") == ["shm"] * 4  # t2's stays though it expires first
        assert "low" in tiers_of(store, spec, mine_old, "a")


def test_handoff_here_holds_and_to_another_node_needs_a_shared_tier(spec, tmp_path):
    with small_store(spec, tmp_path) as store:
        toks = list(range(48))
        store.put_kv(spec, toks, make_kv(spec, 48), "a")
        out = store.handoff(spec, toks, "a", to="here", ttl_s=30, owner="t")
        assert out == {"tokens": 48, "blocks": 3, "held": 3, "shared": 0, "to": "here"}
        assert store.placement.retention(store._current_keys(spec, toks, "a")[0])["owner"] == "t"
        with pytest.raises(InvalidInput, match="shared tier"):
            store.handoff(spec, toks, "a", to="node-b")
        with pytest.raises(InvalidInput, match="to must be"):
            store.handoff(spec, toks, "a", to="")


def test_learned_handoffs_hold_new_puts_unless_the_policy_says_no(spec, tmp_path):
    with small_store(spec, tmp_path, top_blocks=40) as store:
        ctx = list(range(32))
        for i in range(2):  # planner writes, coder reads: twice
            toks = ctx + list(range(100 * (i + 1), 100 * (i + 1) + 16))
            store.put_kv(spec, toks, make_kv(spec, len(toks)), "team", agent="planner")
            store.get_kv(spec, toks, "team", agent="coder")
        assert store.locality.handoffs.describe()["team"]["handoffs"] == 2
        store.get_kv(spec, ctx, "team", agent="planner")  # the writer reading is no hand-off
        assert store.locality.handoffs.describe()["team"]["handoffs"] == 2
        store.policy_for = lambda ns: (7, False)
        nxt = ctx + list(range(900, 916))
        store.put_kv(spec, nxt, make_kv(spec, len(nxt)), "team", agent="planner")
        assert store.prefetcher.idle() and store.prefetcher.log() == []
        store.policy_for = lambda ns: (8, True)
        nxt = ctx + list(range(950, 966))
        store.put_kv(spec, nxt, make_kv(spec, len(nxt)), "team", agent="planner")
        assert store.prefetcher.idle()
        record = store.prefetcher.log()[-1]
        assert record["trigger"] == "hand-off" and record["policy_version"] == 8 and record["held"] == 3
        assert "2 hand-offs" in record["reason"]
        key = store._current_keys(spec, nxt, "team")[-1]
        assert store.placement.retention(key)["owner"] == "_prefetch"
        store.get_kv(spec, nxt, "team", agent="reviewer")  # the reader came: the hold ends
        assert store.placement.retention(key) is None


def test_a_prefetch_into_a_full_top_tier_does_not_push_itself_out(spec, tmp_path):
    """The top tier full of hotter blocks: each promoted block makes room, and without the job's
    lease and hold the prefix's own earlier blocks would be that room."""
    frame = spec.block_nbytes + 1024
    with KVStore([ShmTier(frame * 16), MemoryTier(64 << 20, name="low")], background=False) as store:
        convo = list(range(16 * 8))
        sunk(store, spec, convo)
        hot_residents(store, spec, 16)  # they fill the top tier
        assert store.prefetch(spec, convo, "a") == len(convo)
        assert store.prefetcher.idle()
        assert tiers_of(store, spec, convo, "a") == ["shm"] * 8
        assert store.prefetcher.log()[-1]["held"] == 4  # the leading blocks that fit a quarter of the tier
        for _ in range(3):
            store.run_placement()
        assert tiers_of(store, spec, convo, "a")[:4] == ["shm"] * 4  # held for its reader
        store.get_kv(spec, convo, "a")
        assert store.placement.retention(store._current_keys(spec, convo, "a")[0]) is None  # the reader came


def test_a_prefetch_tries_a_refused_move_again(spec, tmp_path, monkeypatch):
    """A move into the top tier refused once (no free range at that instant: reads, a compaction)
    is tried again within the job, not left one tier down for the reader to fetch over HTTP."""
    with small_store(spec, tmp_path) as store:
        toks = list(range(64))
        store.put_kv(spec, toks, make_kv(spec, 64), "a")
        keys = store._current_keys(spec, toks, "a")
        for key in keys:
            assert store.migrate(key, "nvme")
        real, refused = store.prefetcher._execute, []

        def refuse_the_second_once(order, **how):
            if order.key == keys[1] and not refused:
                refused.append(order.key)
                return False
            return real(order, **how)
        monkeypatch.setattr(store.prefetcher, "_execute", refuse_the_second_once)
        assert store.prefetch(spec, toks, "a") == 64
        assert store.prefetcher.idle()
        assert refused == [keys[1]] and set(tiers_of(store, spec, toks, "a")) == {"shm"}
        record = store.prefetcher.log()[-1]
        assert (record["moved"], record["failed"], record["retried"]) == (4, 0, 1)


def test_a_newer_prefetch_takes_its_hold_from_the_oldest_unread_one(spec, tmp_path):
    """The hold budget (a quarter of the top tier) spent on a prefetch nobody read: the next
    prefetch ends that hold rather than promote blocks it cannot hold, which a full tier would send
    straight back down before their reader came."""
    frame = spec.block_nbytes + 1024
    with KVStore([ShmTier(frame * 16), MemoryTier(64 << 20, name="low")], background=False) as store:
        first, second = list(range(16 * 4)), list(range(5000, 5000 + 16 * 4))
        for toks in (first, second):
            sunk(store, spec, toks)
        hot_residents(store, spec, 16)  # they fill the top tier
        assert store.prefetch(spec, first, "a") == len(first)
        assert store.prefetcher.idle() and store.prefetcher.log()[-1]["held"] == 4  # all the budget
        assert store.prefetch(spec, second, "a") == len(second)  # first's reader never came
        assert store.prefetcher.idle()
        assert store.prefetcher.log()[-1]["held"] == 4 and store.prefetcher.counters["holds_displaced"] == 4
        assert store.prefetcher.counters["holds_cut"] == 0
        first_keys, second_keys = (store._current_keys(spec, t, "a") for t in (first, second))
        assert all(store.placement.retention(k) is None for k in first_keys)
        assert all(store.placement.retention(k)["owner"] == "_prefetch" for k in second_keys)
        for i in range(16, 24):  # more hot puts: the held prefix stays for its reader
            hot_residents(store, spec, 1, first=i, reads=0)
            store.run_placement()
        assert tiers_of(store, spec, second, "a") == ["shm"] * 4


def test_a_prefix_prefetched_again_keeps_its_hold_over_an_older_one(spec, tmp_path):
    """Holds give way oldest first, and a prefix prefetched again is as new as its latest
    prefetch: the hold ended for a newer one is the other prefix's, not the renewed one's."""
    frame = spec.block_nbytes + 1024
    with KVStore([ShmTier(frame * 16), MemoryTier(64 << 20, name="low")], background=False) as store:
        renewed, other, newest = (list(range(base, base + 32)) for base in (0, 5000, 9000))  # 2 blocks each
        for toks in (renewed, other, newest):
            store.put_kv(spec, toks, make_kv(spec, len(toks)), "a")
        for toks in (renewed, other, renewed, newest):  # a budget of 4 blocks: the last needs 2 of them
            store.prefetch(spec, toks, "a")
            assert store.prefetcher.idle()
            assert store.prefetcher.log()[-1]["held"] == 2
        held = {name: [store.placement.retention(k) is not None for k in store._current_keys(spec, toks, "a")]
                for name, toks in (("renewed", renewed), ("other", other), ("newest", newest))}
        assert held == {"renewed": [True, True], "other": [False, False], "newest": [True, True]}
        assert store.prefetcher.counters["holds_displaced"] == 2


def test_the_holds_remembered_are_bounded(spec, tmp_path, monkeypatch):
    """Past ``HELD_REMEMBERED`` holds the oldest is forgotten (it ends by its read or expiry, as
    before), and so are its keys: the bookkeeping stays bounded however many prefetches come."""
    from kvstore.engine import prefetch as prefetch_mod

    monkeypatch.setattr(prefetch_mod, "HELD_REMEMBERED", 1)
    with small_store(spec, tmp_path, top_blocks=64) as store:
        first, second = list(range(32)), list(range(5000, 5032))
        for toks in (first, second):
            store.put_kv(spec, toks, make_kv(spec, len(toks)), "a")
            store.prefetch(spec, toks, "a")
            assert store.prefetcher.idle()
        assert set(store.prefetcher._hold_of) == set(store._current_keys(spec, second, "a"))
        assert len(store.prefetcher._held) == 1
        assert store.placement.retention(store._current_keys(spec, first, "a")[0]) is not None  # not ended


def test_a_prefetch_makes_room_the_arena_lacks_although_placement_counts_it(spec, tmp_path):
    """Slots lent to co-located writers take arena space that placement's books do not show: a
    top tier placement counts as having room has no free range, every move is refused, and
    nothing else demotes. The job's retries make room by force, as a put's forced try does."""
    frame = spec.block_nbytes + 1024
    top = ShmTier(frame * 16)
    with KVStore([top, MemoryTier(64 << 20, name="low")], background=False) as store:
        convo = list(range(16 * 4))
        sunk(store, spec, convo)
        hot_residents(store, spec, 12)  # placement counts room for 4 more blocks
        lent = [top.reserve(bytes([i]) * 32, frame) for i in range(4)]  # the rest of the arena, lent
        assert store.prefetch(spec, convo, "a") == len(convo)
        assert store.prefetcher.idle()
        assert tiers_of(store, spec, convo, "a") == ["shm"] * 4
        record = store.prefetcher.log()[-1]
        assert (record["moved"], record["failed"]) == (4, 0) and record["retried"] >= 1
        assert store.prefetcher.counters["moves_forced"] == record["retried"]
        for slot in lent:
            top.abort_reserved(slot, frame)
