"""Pooled puts (``kvstore.engine.reserved``, "Pooled puts") against a real shm tier: slots granted
ahead to a writer process, written by it, published by one call that grants as many back.

The writer here is this process through ``ShmSlotWriter``, as a co-located client writes; the
client end to end (one request a put, a writer killed mid-put) is in ``tests/client_sdk``.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvstore import codec
from kvstore.engine.pools import MAX_POOL_BYTES, SLOT_SLACK
from kvstore.engine.store import KVStore
from kvstore.engine.events import STORED
from kvstore.errors import CorruptFrame, Forbidden, InvalidInput, StoreClosed
from kvstore.keys import block_hashes, block_meta
from kvstore.memory.shm import ShmSlotWriter
from tests.conftest import FakeClock, fail_nth_commit, make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

NS = "pool"
PID = os.getpid()


@pytest.fixture
def store():
    clock = FakeClock()
    s = KVStore([ShmTier(16 << 20), MemoryTier(32 << 20)], background=False, clock=clock)
    s.test_clock = clock
    yield s
    s.close()


def _size(store: KVStore, spec) -> int:
    return store.reservations.pools.slot_bytes(spec) + 256


def _write(store: KVStore, spec, kv: torch.Tensor, slots: list[dict], depths: list[int]) -> list[tuple[int, int, int]]:
    """Encode block ``depths[i]`` of ``kv`` into ``slots[i]``: the put's writes."""
    writer = ShmSlotWriter(store.tiers[0].segment)
    bt, writes = spec.block_tokens, []
    try:
        for slot, d in zip(slots, depths):
            with writer.slot(slot["offset"], slot["length"]) as view:
                n = codec.encode_into(kv[:, :, :, d * bt:(d + 1) * bt], view,
                                      meta=block_meta(NS, spec.fingerprint(), d))
                writes.append((d, slot["offset"], codec.read_header(view[:n]).body_checksum))
    finally:
        writer.close()
    return writes


def _reserved(store: KVStore) -> int:
    return int(store.tiers[0].stats().details["reserved_bytes"])


def test_a_pooled_put_reads_back_and_is_lent_as_many_slots_again(store):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    slots = res.grant("a", PID, "p1", size, 4)
    assert len(slots) == 4 and all(s["length"] == size for s in slots)
    assert _reserved(store) == res.lent_bytes() == 4 * size
    tokens, kv = list(range(64)), make_kv(spec, 64)
    assert store.lookup(spec, tokens, NS) == 0  # lent slots are not blocks
    done = res.put_pooled(spec, tokens, NS, "a", PID, "p1", _write(store, spec, kv, slots, [0, 1, 2, 3]), 4)
    assert (done.n_tokens, done.missing, len(done.slots)) == (64, [], 4)
    assert {s["offset"] for s in done.slots}.isdisjoint({s["offset"] for s in slots})
    got, n = store.get_kv(spec, tokens, NS)
    assert n == 64 and torch.equal(got, kv)
    assert res.lent_bytes() == 4 * size  # the used four published (shrunk to their frames), four more lent


def test_blocks_not_written_must_be_stored_and_a_gap_is_reported(store):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(64)), make_kv(spec, 64)
    store.put_kv(spec, tokens[:32], kv[:, :, :, :32], NS)  # blocks 0 and 1 stored already
    slots = res.grant("a", PID, "p", size, 2)
    done = res.put_pooled(spec, tokens, NS, "a", PID, "p", _write(store, spec, kv, slots[:1], [2]), 0)
    assert done.missing == [3] and done.n_tokens == 48  # block 3: neither written nor stored
    assert store.lookup(spec, tokens, NS) == 48 and len(done.slots) == 0
    assert res.lent_bytes() == size  # the unused slot stays lent


def test_a_block_stored_meanwhile_hands_its_slot_back_to_the_pool(store):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(32)), make_kv(spec, 32)
    slots = res.grant("a", PID, "p", size, 2)
    writes = _write(store, spec, kv, slots, [0, 1])
    store.put_kv(spec, tokens[:16], kv[:, :, :, :16], NS)  # another writer stored block 0 first
    done = res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
    assert done.n_tokens == 32 and [s["offset"] for s in done.slots] == [slots[0]["offset"]]
    assert res.lent_bytes() == size
    assert torch.equal(store.get_kv(spec, tokens, NS)[0], kv)


def test_a_slot_not_in_the_writers_pool_is_refused_and_nothing_is_stored(store):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(32)), make_kv(spec, 32)
    mine = res.grant("a", PID, "p", size, 2)
    theirs = res.grant("b", PID, "p", size, 1)
    writes = _write(store, spec, kv, [mine[0], theirs[0]], [0, 1])
    with pytest.raises(Forbidden, match="pool"):
        res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
    with pytest.raises(Forbidden):  # another pool of the same tenant and process: not these slots either
        res.put_pooled(spec, tokens, NS, "a", PID, "q", writes[:1], 0)
    assert store.lookup(spec, tokens, NS) == 0
    ok = res.put_pooled(spec, tokens, NS, "a", PID, "p", writes[:1] + _write(store, spec, kv, mine[1:], [1]), 0)
    assert ok.n_tokens == 32  # its own slots were still its
    with pytest.raises(Forbidden):  # used: no longer lent
        res.put_pooled(spec, tokens, NS, "a", PID, "p", writes[:1], 0)
    with pytest.raises(InvalidInput, match="writes"):
        res.put_pooled(spec, tokens, NS, "a", PID, "p", [(5, mine[0]["offset"], 1)], 0)


@pytest.mark.parametrize("damage", ["checksum", "body-of-another-block", "header"])
def test_a_frame_that_is_not_its_blocks_is_refused_and_the_slots_stay_lent(store, damage):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(32)), make_kv(spec, 32)
    slots = res.grant("a", PID, "p", size, 2)
    writes = _write(store, spec, kv, slots, [0, 1])
    if damage == "checksum":
        writes[1] = (1, writes[1][1], writes[1][2] ^ 1)
    elif damage == "body-of-another-block":  # block 0's frame claimed for depth 1: its metadata says 0
        writes[1] = (1, writes[0][1], writes[0][2])
        writes[0] = (0, slots[1]["offset"], writes[0][2])
    else:
        writer = ShmSlotWriter(store.tiers[0].segment)
        with writer.slot(slots[1]["offset"], 64) as view:
            view[8] ^= 0xFF
        writer.close()
    with pytest.raises(CorruptFrame):
        res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
    assert store.lookup(spec, tokens, NS) == 0 and res.lent_bytes() == 2 * size


def test_an_idle_pool_is_reclaimed_and_then_refused(store):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    slots = res.grant("a", PID, "p", size, 3)
    writes = _write(store, spec, make_kv(spec, 16), slots[:1], [0])
    assert store.reservations.reap() == 0
    store.test_clock.advance(res.ttl_s + 1)
    assert store.reservations.reap() == 1 and res.lent_bytes() == 0 and _reserved(store) == 0
    with pytest.raises(Forbidden, match="reclaimed"):
        res.put_pooled(spec, list(range(16)), NS, "a", PID, "p", writes, 0)


def test_a_pool_is_bounded_released_on_request_and_at_close():
    spec = make_spec(num_layers=32, head_dim=128)  # 512 KiB a block
    with KVStore([ShmTier(256 << 20)], background=False) as store:
        res = store.reservations.pools
        size = _size(store, spec)
        got = res.grant("a", PID, "p", size, 1000)
        assert len(got) == min(MAX_POOL_BYTES, (256 << 20) // 8) // size
        assert res.grant("a", PID, "p", size, 10) == []  # at the cap
        assert res.release("a", PID, "p") == len(got) and _reserved(store) == 0
        res.grant("a", PID, "p", size, 3)
    assert res.lent_bytes() == 0  # closed: given back


def test_a_grant_first_takes_back_the_idle_slots_its_writer_hands_it():
    """The cap counts every slot size: a writer that moved to another spec gives its old slots back."""
    big, other = make_spec(num_layers=32, head_dim=128), make_spec(num_layers=8, head_dim=128)
    with KVStore([ShmTier(32 << 20)], background=False) as store:
        res = store.reservations.pools
        held = res.grant("a", PID, "p", _size(store, big), 1000)
        size = _size(store, other)
        some = res.grant("a", PID, "p", size, 4)
        assert len(some) < 4  # the big slots hold the pool at its cap (an eighth of 32 MiB)
        lent = res.lent_bytes()
        with pytest.raises(Forbidden):  # one offset not of this pool: nothing given back, nothing lent
            res.grant("a", PID, "p", size, 4, returning=[held[0]["offset"], 64])
        assert res.lent_bytes() == lent
        got = res.grant("a", PID, "p", size, 4, returning=[s["offset"] for s in held])
        assert len(got) == 4 and res.lent_bytes() == (len(some) + 4) * size == _reserved(store)
        with pytest.raises(Forbidden):  # given back: no longer this pool's
            res.grant("a", PID, "p", size, 1, returning=[held[1]["offset"]])


def test_slot_sizes_and_pids_are_checked(store):
    spec, res = make_spec(), store.reservations.pools
    assert res.slot_bytes(spec) + SLOT_SLACK > res.slot_bytes(spec)
    with pytest.raises(InvalidInput, match="pid"):
        res.grant("a", 2**31 - 5, "p", _size(store, spec), 1)


def test_a_grant_lends_disjoint_slots_as_many_as_fit_and_all_come_back():
    spec = make_spec()
    with KVStore([ShmTier(4 << 20)], background=False) as store:
        res = store.reservations.pools
        size = _size(store, spec)
        store.put_kv(spec, list(range(7104)), make_kv(spec, 7104), NS)  # most of the tier taken
        room = store.tiers[0].room_bytes()
        got = res.grant("a", PID, "p", size, 1000)
        assert 1 < len(got) < room // size < (4 << 20) // 8 // size  # the free room, less a slot's
        assert res.grant("a", PID, "p", size, 10) == []  # nothing more: no block is demoted for a pool
        spans = sorted((s["offset"], s["offset"] + s["length"]) for s in got)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert store.lookup(spec, list(range(7104)), NS) == 7104  # nothing was demoted for them
        assert _reserved(store) == res.lent_bytes() == len(got) * size
        assert res.release("a", PID, "p") == len(got) and _reserved(store) == 0
        assert len(res.grant("a", PID, "p", size, 1000)) == len(got)  # the room placement held came back too


def test_a_frame_whose_header_checksum_alone_is_damaged_is_dropped_before_a_read_trusts_it():
    """A batch's later headers are compared with its first (``WrittenHeaders``), not re-hashed: the
    one field that skips, the header's own checksum, is the verifier's to find."""
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    keys = block_hashes(spec, tokens, NS)
    with KVStore([ShmTier(16 << 20)], scrub_bytes_per_s=0) as store:
        res = store.reservations.pools
        slots = res.grant("a", PID, "p", _size(store, spec), 4)
        writes = _write(store, spec, kv, slots, [0, 1, 2, 3])
        writer = ShmSlotWriter(store.tiers[0].segment)
        with writer.slot(slots[2]["offset"], 256) as view:
            header_len = codec.read_header(view, prefix=True).header_len
            view[header_len - 1] ^= 0xFF  # the last byte of the header's own checksum
        writer.close()
        done = res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
        assert done.n_tokens == 64
        assert store.scrubber.caught_up(10.0)
        assert store.entry(keys[2]) is None and store.stats().counters.corrupt_blocks == 1
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 32 and torch.equal(got, kv[:, :, :, :32])


def test_a_pooled_put_publishes_its_blocks_as_one_batch_in_chain_order(store):
    """One put, one batch: its stored events are numbered together, in chain order with their
    parents, and the log's hooks (the verifier's wake-up) run once for it, not once a block."""
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(64)), make_kv(spec, 64)
    slots = res.grant("a", PID, "p", size, 4)
    writes = _write(store, spec, kv, slots, [0, 1, 2, 3])
    wakes: list[int] = []
    store.core.events.add_hook(wakes.append)
    before = store.core.events.last_seq
    res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
    events, _ = store.core.events.read(before)
    keys = block_hashes(spec, tokens, NS)
    assert [(e.kind, e.key, e.depth, e.parent, e.reason) for e in events] == [
        (STORED, k, d, keys[d - 1] if d else None, "reserved") for d, k in enumerate(keys)]
    assert wakes == [before + 4]


def test_a_commit_that_fails_midway_keeps_the_blocks_before_it_and_pools_the_rest(store, monkeypatch):
    spec, res = make_spec(), store.reservations.pools
    size = _size(store, spec)
    tokens, kv = list(range(64)), make_kv(spec, 64)
    slots = res.grant("a", PID, "p", size, 4)
    writes = _write(store, spec, kv, slots, [0, 1, 2, 3])
    fail_nth_commit(monkeypatch, store.tiers[0], 3)
    with pytest.raises(StoreClosed):
        res.put_pooled(spec, tokens, NS, "a", PID, "p", writes, 0)
    assert store.lookup(spec, tokens, NS) == 32  # blocks 0 and 1 are published and read back
    got, n = store.get_kv(spec, tokens, NS)
    assert n == 32 and torch.equal(got, kv[:, :, :, :32])
    assert res.lent_bytes() == _reserved(store) == size  # block 3's slot is lent again
    assert store.placement._incoming[0] == size  # the rooms of the published and the failed are given up
