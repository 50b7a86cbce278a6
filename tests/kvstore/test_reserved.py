"""Two-phase puts (``kvstore.engine.reserved``) against a real shm tier: reserve, write into the slots, commit.

The writer here is this process through ``ShmSlotWriter``, as a co-located client writes;
the client path end to end (another process writing, being killed) is in
``tests/client_sdk/test_reserved_put.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvstore import codec
from kvstore.errors import CorruptFrame, Forbidden, InvalidInput, StoreClosed
from kvstore.memory.shm import ShmSlotWriter
from kvstore.engine.store import KVStore
from tests.conftest import FakeClock, fail_nth_commit, make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

NS = "res"


@pytest.fixture
def store():
    clock = FakeClock()
    s = KVStore([ShmTier(8 << 20), MemoryTier(32 << 20)], background=False, clock=clock)
    s.test_clock = clock
    yield s
    s.close()


def _write(store: KVStore, res, kv: torch.Tensor, spec) -> list[int]:
    writer = ShmSlotWriter(store.tiers[0].segment)
    sums = []
    bt = spec.block_tokens
    try:
        for b in res.to_dict()["blocks"]:
            with writer.slot(b["offset"], b["length"]) as view:
                n = codec.encode_into(kv[:, :, :, b["depth"] * bt:(b["depth"] + 1) * bt], view,
                                      meta=bytes.fromhex(b["meta"]))
                sums.append(codec.read_header(view[:n]).body_checksum)
    finally:
        writer.close()
    return sums


def _free(store: KVStore) -> tuple[str, str]:
    d = store.tiers[0].stats().details
    return d["arena_free_bytes"], d["reserved_bytes"]


def test_a_committed_reservation_reads_back_bit_exact():
    spec = make_spec()
    with KVStore([ShmTier(8 << 20)], background=False) as store:
        tokens, kv = list(range(64)), make_kv(spec, 64)
        res = store.reserve_put(spec, tokens, NS, owner="a")
        assert [b.depth for b in res.blocks] == [0, 1, 2, 3]
        assert store.lookup(spec, tokens, NS) == 0  # reserved is not visible
        assert store.commit_put(res.id, "a", _write(store, res, kv, spec)) == (64, kv.numel() * 2)
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 64 and torch.equal(got, kv)
        again = store.reserve_put(spec, tokens, NS, owner="a")  # all stored: nothing to write
        assert again.id == "" and again.blocks == [] and again.n_tokens == 64
        assert store.reservations.open_count() == 0


def test_a_wrong_checksum_is_refused_and_returns_every_slot(store):
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    before = _free(store)
    res = store.reserve_put(spec, tokens, NS, owner="a")
    sums = _write(store, res, kv, spec)
    sums[2] ^= 1
    with pytest.raises(CorruptFrame, match="block 2"):
        store.commit_put(res.id, "a", sums)
    assert store.lookup(spec, tokens, NS) == 0 and _free(store) == before
    with pytest.raises(Forbidden):  # it ended with the refusal
        store.commit_put(res.id, "a", sums)


@pytest.mark.parametrize("damage", ["header", "meta", "short-list"])
def test_a_frame_that_is_not_the_reserved_one_is_refused(store, damage):
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    before = _free(store)
    res = store.reserve_put(spec, tokens, NS, owner="a")
    sums = _write(store, res, kv, spec)
    writer = ShmSlotWriter(store.tiers[0].segment)
    b = res.to_dict()["blocks"][1]
    with writer.slot(b["offset"], b["length"]) as view:
        if damage == "header":
            view[5] ^= 0xFF
        elif damage == "meta":  # another block's metadata: depth 0 in slot 1
            n = codec.encode_into(kv[:, :, :, 16:32], view, meta=bytes.fromhex(res.to_dict()["blocks"][0]["meta"]))
            sums[1] = codec.read_header(view[:n]).body_checksum
    writer.close()
    with pytest.raises((CorruptFrame, InvalidInput)):
        store.commit_put(res.id, "a", sums[:-1] if damage == "short-list" else sums)
    assert store.lookup(spec, tokens, NS) == 0 and _free(store) == before


def test_a_reservation_is_its_owners_alone(store):
    spec = make_spec()
    res = store.reserve_put(spec, list(range(32)), NS, owner="a")
    sums = _write(store, res, make_kv(spec, 32), spec)
    with pytest.raises(Forbidden):
        store.commit_put(res.id, "b", sums)
    with pytest.raises(Forbidden):
        store.commit_put("never-handed-out", "a", sums)
    assert store.commit_put(res.id, "a", sums)[0] == 32


def test_a_body_that_lies_about_its_checksum_is_a_miss_on_its_first_read(store):
    """The server trusts a writer's checksum at commit; the first read still hashes the body."""
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    res = store.reserve_put(spec, tokens, NS, owner="a")
    sums = _write(store, res, kv, spec)
    writer = ShmSlotWriter(store.tiers[0].segment)
    b = res.to_dict()["blocks"][3]
    with writer.slot(b["offset"], b["length"]) as view:
        view[b["length"] - 1] ^= 0x01  # the body changed after its checksum was taken
    writer.close()
    assert store.commit_put(res.id, "a", sums)[0] == 64
    got, n = store.get_kv(spec, tokens, NS)
    assert n == 48 and torch.equal(got, kv[:, :, :, :48])  # never wrong KV: the damaged block is dropped
    assert store.stats().counters.corrupt_blocks == 1


def test_an_expired_reservation_is_reclaimed_and_its_commit_refused(store):
    spec = make_spec()
    before = _free(store)
    res = store.reserve_put(spec, list(range(64)), NS, owner="a")
    sums = _write(store, res, make_kv(spec, 64), spec)
    assert store.reservations.reap() == 0
    store.test_clock.advance(store.reservations.ttl_s + 1)
    assert store.reservations.reap() == 1
    assert _free(store) == before
    with pytest.raises(Forbidden, match="expired"):
        store.commit_put(res.id, "a", sums)
    assert store.lookup(spec, list(range(64)), NS) == 0


def test_a_dead_writers_reservation_is_reclaimed_by_the_reaper(store):
    spec = make_spec()
    before = _free(store)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store.reserve_put(spec, list(range(64)), NS, owner="a", pid=child.pid)
        assert _free(store) != before
        child.kill()
        child.wait()
        deadline = time.monotonic() + 10  # the reaper looks every reap_every_s (0.5 s)
        while store.reservations.open_count() and time.monotonic() < deadline:
            threading.Event().wait(0.05)  # a real thread's doing: wait for it, bounded
        assert store.reservations.open_count() == 0 and store.reservations.reaped == 1
        assert _free(store) == before
    finally:
        child.kill()


def test_a_pid_that_is_no_process_is_refused(store):
    with pytest.raises(InvalidInput, match="pid"):
        store.reserve_put(make_spec(), list(range(32)), NS, owner="a", pid=2 ** 22 + 12345)


def test_two_writers_of_one_prefix_store_it_once(store):
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    r1 = store.reserve_put(spec, tokens, NS, owner="a")
    r2 = store.reserve_put(spec, tokens, NS, owner="b")
    s1, s2 = _write(store, r1, kv, spec), _write(store, r2, kv, spec)
    assert store.commit_put(r2.id, "b", s2)[0] == 64
    assert store.commit_put(r1.id, "a", s1)[0] == 64  # its blocks are stored already: its slots go back
    got, n = store.get_kv(spec, tokens, NS)
    assert n == 64 and torch.equal(got, kv)
    assert store.tiers[0].stats().entries == 4
    assert store.tiers[0].stats().details["reserved_bytes"] == "0"


def test_no_room_for_all_reserves_nothing():
    spec = make_spec()
    with KVStore([ShmTier(1 << 20)], background=False) as store:  # room for a few blocks only
        before = _free(store)
        assert store.reserve_put(spec, list(range(4096)), NS, owner="a") is None
        assert _free(store) == before


def test_reserved_puts_are_off_where_the_top_tier_is_not_a_raw_shm_arena():
    spec = make_spec()
    with KVStore([MemoryTier(8 << 20)], background=False) as store:
        assert "not an shm arena" in store.reservations.unavailable()
        with pytest.raises(InvalidInput, match="off here"):
            store.reserve_put(spec, list(range(32)), NS, owner="a")
    with KVStore([ShmTier(8 << 20)], background=False, codec="int8") as store:
        assert "int8" in store.reservations.unavailable()


def test_close_returns_open_reservations():
    spec = make_spec()
    store = KVStore([ShmTier(8 << 20)], background=False)
    store.reserve_put(spec, list(range(64)), NS, owner="a", pid=os.getpid())
    store.close()
    assert store.reservations.open_count() == 0


def test_a_commit_that_fails_midway_keeps_the_blocks_before_it_and_returns_every_other_slot(store, monkeypatch):
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    before = _free(store)
    res = store.reserve_put(spec, tokens, NS, owner="a")
    sums = _write(store, res, kv, spec)
    fail_nth_commit(monkeypatch, store.tiers[0], 3)
    with pytest.raises(StoreClosed):
        store.commit_put(res.id, "a", sums)
    got, n = store.get_kv(spec, tokens, NS)
    assert n == 32 and torch.equal(got, kv[:, :, :, :32])  # blocks 0 and 1 are published
    assert _free(store)[1] == before[1]  # no slot is left reserved
    assert store.placement._incoming[0] == 0  # and no room held
    store.delete(spec, tokens, NS)
    assert _free(store) == before
