"""KV events in the engine (``kvstore.engine.events``): every change to the index is one numbered event,
and a snapshot plus the events after it rebuild the index exactly, whatever ran meanwhile."""

from __future__ import annotations

import random
import threading

import pytest

from kvstore.engine.events import STORED, EventLog
from kvstore.engine.store import KVStore
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier


def replay(blocks: dict, events) -> dict:
    for e in events:
        if e.kind in ("stored", "moved"):
            blocks[e.key] = e.tier
        elif e.kind == "removed":
            blocks.pop(e.key, None)
        elif e.kind == "cleared":
            blocks.clear()
    return blocks


def index_of(store: KVStore) -> dict:
    return {e.key: e.tier for e in store.entries()}


def test_put_move_delete_evict_are_events_in_order():
    spec = make_spec()
    frame = spec.block_nbytes + 1024
    with KVStore([ShmTier(4 << 20), MemoryTier(frame * 6, name="low")], background=False) as store:
        toks = list(range(64))
        store.put_kv(spec, toks, make_kv(spec, 64), "a")
        events, lost = store.events.read(0)
        assert not lost and [e.kind for e in events] == ["stored"] * 4
        assert [e.seq for e in events] == [1, 2, 3, 4]
        assert events[0].parent is None and events[1].parent == events[0].key
        assert {e.tier for e in events} == {"shm"} and {e.namespace for e in events} == {"a"}
        key = events[2].key
        assert store.migrate(key, "low")
        moved = store.events.read(4)[0]
        assert [(e.kind, e.src, e.tier, e.key) for e in moved] == [("moved", "shm", "low", key)]
        assert store.delete(spec, toks[:16], "a") == 1
        gone = store.events.read(5)[0]
        assert [(e.kind, e.reason) for e in gone] == [("removed", "deleted")]
        from kvstore.engine.evict import EvictionQuery, evict
        assert evict(store, EvictionQuery(keys=(events[1].key,))).removed_blocks == 1
        assert [(e.kind, e.reason, e.key) for e in store.events.read(6)[0]] == [("removed", "evicted", events[1].key)]
        # placement's last tier evicts: fill "low" past its capacity through migrations
        others = list(range(1000, 1000 + 16 * 8))
        store.put_kv(spec, others, make_kv(spec, len(others)), "b")
        for e in store.entries():
            if e.tier == "shm":
                store.migrate(e.key, "low")
        store.run_placement()
        kinds = {(e.kind, e.reason) for e in store.events.read(0, 10_000)[0]}
        assert ("removed", "evicted") in kinds
        assert replay({}, store.events.read(0, 10_000)[0]) == index_of(store)


def test_snapshot_plus_events_is_exact_under_concurrent_churn():
    """Writers, deleters and the mover run while snapshots are taken: each snapshot plus the
    events after it equals the index once the writers stop."""
    spec = make_spec()
    frame = spec.block_nbytes + 1024
    store = KVStore([ShmTier(frame * 24), MemoryTier(frame * 1000, name="low")], background=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                base = rng.randrange(40) * 1000
                toks = list(range(base, base + 16 * rng.randint(1, 4)))
                if rng.random() < 0.7:
                    store.put_kv(spec, toks, make_kv(spec, len(toks)), f"ns{rng.randrange(3)}")
                else:
                    store.delete(spec, toks, f"ns{rng.randrange(3)}")
                store.get_kv(spec, toks, f"ns{rng.randrange(3)}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    snaps = []
    for _ in range(5):
        seq, entries = store.core.events_snapshot()
        snaps.append((seq, {e.key: e.tier for e in entries}))
        threading.Event().wait(0.05)
    stop.set()
    for t in threads:
        t.join()
    store._mover.stop()  # no more moves: the index is final
    assert not errors
    final = index_of(store)
    for seq, blocks in snaps:
        events, lost = store.events.read(seq, 1_000_000)
        assert not lost
        assert replay(dict(blocks), events) == final
    kinds = {e.kind for e in store.events.read(0, 1_000_000)[0]}
    assert {"stored", "moved", "removed"} <= kinds  # the churn did move and remove blocks
    ns_seq, ns_entries = store.core.events_snapshot(frozenset({"ns1"}))
    assert {e.namespace for e in ns_entries} <= {"ns1"}
    store.close()
    assert store.events.read(store.events.last_seq - 1)[0][-1].kind == "cleared"


def test_ring_reports_loss_and_bad_cursors():
    log = EventLog(16)
    for i in range(40):
        log.emit("stored", key=bytes([i]) * 32, namespace="a", tier="shm")
    events, lost = log.read(0)
    assert lost and events[0].seq == 25 and events[-1].seq == 40
    events, lost = log.read(30)
    assert not lost and [e.seq for e in events] == list(range(31, 41))
    assert log.read(40) == ([], False)
    with pytest.raises(ValueError):
        log.read(41)
    with pytest.raises(ValueError):
        log.read(-1)
    assert log.wait(39, 0.0) and not log.wait(40, 0.01)


def test_a_stopped_reader_costs_emit_nothing():
    """One ring and cursors: emitting with a reader that never reads keeps no queue of its own."""
    log = EventLog(1024)
    seen = []
    remove = log.add_hook(seen.append)
    for i in range(5000):
        log.emit("stored", key=b"k" * 32)
    remove()
    log.emit("stored", key=b"k" * 32)
    assert len(seen) == 5000 and seen[-1] == 5000
    assert sum(1 for slot in log._ring if slot is not None) == 1024


def test_token_ids_kept_only_when_asked():
    spec = make_spec()
    with KVStore([MemoryTier(64 << 20)], background=False) as store:
        store.put_kv(spec, list(range(32)), make_kv(spec, 32), "a")
        assert all(e.tokens is None for e in store.events.read(0)[0])
        store.events.keep_tokens = True
        store.put_kv(spec, list(range(100, 132)), make_kv(spec, 32), "a")
        new = store.events.read(2)[0]
        import numpy as np
        assert [np.frombuffer(e.tokens, "<u4").tolist() for e in new] == [list(range(100, 116)),
                                                                          list(range(116, 132))]


def test_emit_many_numbers_in_order_and_calls_each_hook_once_with_the_last():
    log = EventLog(16)
    seen: list[int] = []
    log.add_hook(seen.append)
    log.emit(STORED, key=b"\0" * 32)
    events = log.emit_many(STORED, [{"key": bytes([i]) * 32, "depth": i} for i in range(1, 4)])
    assert [e.seq for e in events] == [2, 3, 4] and [e.depth for e in events] == [1, 2, 3]
    assert len({e.time_s for e in events}) == 1
    assert seen == [1, 4]  # one wake-up for the batch
    got, lost = log.read(0)
    assert [e.seq for e in got] == [1, 2, 3, 4] and not lost
    assert log.emit_many(STORED, []) == [] and seen == [1, 4] and log.last_seq == 4
