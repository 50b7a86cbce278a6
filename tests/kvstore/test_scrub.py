"""The background verifier and scrubber (``kvstore.engine.scrub``) over a real shm arena.

Frames get into the arena as co-located writers put them (reserved slots filled through
``ShmSlotWriter``, then committed) or by ``put_kv``; what other processes see is read through
``ShmReader``, as they read it. The faults injected are bytes changed in the arena: before the
server verified a frame (a writer committed a body that does not match its header), and after
(a flip in a frame already vouched for). Waits are on conditions (the scrubber's, the event
log's) with a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstore import codec
from kvstore.cli.main import main
from kvstore.config import Settings
from kvstore.engine.events import REMOVED, Event
from kvstore.engine.scrub import BLOCK_COST_BYTES
from kvstore.engine.store import EmbeddedStore, KVStore
from kvstore.errors import InvalidInput
from kvstore.keys import block_hashes
from kvstore.memory.shm import ShmReader, ShmSlotWriter
from kvstore.spec import KVSpec
from tests.conftest import make_kv, make_spec, wait_until
from tiers.shm import ShmTier

NS = "scrub"
MiB = 1 << 20


def _reserved_put(store: KVStore, spec: KVSpec, tokens: list[int], kv: torch.Tensor,
                  damage_depth: int | None = None) -> None:
    """Put as a co-located writer does: fill the reserved slots, then commit their checksums.
    ``damage_depth``: that block's last payload byte is flipped after sealing (the fault: a body
    that does not match the checksum its header, and the commit, claim)."""
    res = store.reserve_put(spec, tokens, NS, owner="w")
    writer = ShmSlotWriter(store.tiers[0].segment)
    sums, bt = [], spec.block_tokens
    try:
        for b in res.to_dict()["blocks"]:
            with writer.slot(b["offset"], b["length"]) as view:
                n = codec.encode_into(kv[:, :, :, b["depth"] * bt:(b["depth"] + 1) * bt], view,
                                      meta=bytes.fromhex(b["meta"]))
                sums.append(codec.read_header(view[:n]).body_checksum)
                if b["depth"] == damage_depth:
                    view[n - 1] ^= 0xFF
    finally:
        writer.close()
    assert store.commit_put(res.id, "w", sums)[0] == len(tokens)


def _removed(store: KVStore, key: bytes, timeout_s: float = 10.0) -> Event:
    """The ``removed`` event of ``key``, waited for on the event log (a deadline, no sleep)."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while True:
        events, _ = store.events.read(seen)
        for ev in events:
            if ev.kind == REMOVED and ev.key == key:
                return ev
        seen = events[-1].seq if events else seen
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no removed event for {key.hex()[:16]} within {timeout_s:g} s")
        store.events.wait(seen, left)


def _verified(store: KVStore, keys: list[bytes]) -> list[bool]:
    """Whether another process reading the arena would skip hashing each key's frame."""
    reader = ShmReader(store.tiers[0].segment)
    try:
        return [hit is not None and hit.verified for hit in reader.look_up(keys)]
    finally:
        reader.close()


def _flip(store: KVStore, key: bytes) -> None:
    """Fault: the last payload byte of ``key``'s frame flips in the arena, as a stray writer would."""
    h = store.tiers[0].handle(key)
    writer = ShmSlotWriter(store.tiers[0].segment)
    try:
        with writer.slot(h.offset, h.length) as view:
            view[-1] ^= 0xFF
    finally:
        writer.close()


def test_a_committed_reserved_frame_is_verified_with_no_read():
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    keys = block_hashes(spec, tokens, NS)
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=0) as store:
        _reserved_put(store, spec, tokens, kv)
        assert store.scrubber.caught_up(10.0)
        assert _verified(store, keys) == [True] * 4
        # verification is not a read: no hits, no heat, no per-tier reads
        assert [store.explain(k)["hits"] for k in keys] == [0] * 4
        stats = store.stats()
        assert stats.reads_by_tier.get("shm", 0) == 0
        assert stats.scrub["verified_blocks"] == 4 and stats.scrub["verified_bytes"] == sum(
            store.entry(k).size for k in keys)
        assert stats.scrub["scrubbed_blocks"] == 0 and stats.scrub["cycles"] == 0  # rate 0: no scrub
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 64 and torch.equal(got, kv)


def test_a_request_is_answered_before_the_verifier_starts_on_what_it_published():
    """A publish inside ``answering`` (a request being answered on this thread) wakes the
    verifier when the outermost block ends, not before, even when the block raises."""
    spec = make_spec()
    kv = make_kv(spec, 64)
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=0) as store:
        _reserved_put(store, spec, list(range(64)), kv)
        assert store.scrubber.caught_up(10.0)  # the verifier is idle, waiting to be woken
        held = list(range(100, 164))
        with store.scrubber.answering():
            with store.scrubber.answering():  # nested: only the outermost end wakes it
                _reserved_put(store, spec, held, kv)
            assert not store.scrubber.caught_up(0.3)
            assert _verified(store, block_hashes(spec, held, NS)) == [False] * 4
        assert store.scrubber.caught_up(10.0)  # the block's end woke it, with nothing else published
        assert _verified(store, block_hashes(spec, held, NS)) == [True] * 4
        failed = list(range(200, 264))
        with pytest.raises(RuntimeError), store.scrubber.answering():
            _reserved_put(store, spec, failed, kv)
            raise RuntimeError("the request failed after its publish")
        assert store.scrubber.caught_up(10.0)
        assert _verified(store, block_hashes(spec, failed, NS)) == [True] * 4


def test_a_publish_elsewhere_or_past_a_quarter_of_the_ring_wakes_the_verifier():
    """Only this thread's publishes wait for its block; one block's publishes past a quarter of
    the event ring wake the verifier anyway (else they would fall off the ring, unverified)."""
    spec = make_spec()
    kv = make_kv(spec, 64)
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=0, event_capacity=16) as store:
        _reserved_put(store, spec, list(range(64)), kv)
        assert store.scrubber.caught_up(10.0)
        with store.scrubber.answering():
            other = list(range(100, 164))
            putter = threading.Thread(target=_reserved_put, args=(store, spec, other, kv))
            putter.start()
            putter.join()
            assert store.scrubber.caught_up(10.0)  # another thread's publish woke it at once
            assert _verified(store, block_hashes(spec, other, NS)) == [True] * 4
            many = list(range(200, 264))  # 4 blocks: 4 events, the ring's quarter
            _reserved_put(store, spec, many, kv)
            assert store.scrubber.caught_up(10.0)  # the fourth publish woke it, inside the block
        assert _verified(store, block_hashes(spec, many, NS)) == [True] * 4
        assert store.stats().scrub["publishes_missed"] == 0


def test_damage_before_verification_is_dropped_and_read_as_a_miss():
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    keys = block_hashes(spec, tokens, NS)
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=0) as store:
        _reserved_put(store, spec, tokens, kv, damage_depth=2)
        ev = _removed(store, keys[2])
        assert ev.reason == "corrupt" and ev.tier == "shm"
        assert store.scrubber.caught_up(10.0)
        assert _verified(store, keys) == [True, True, False, True]  # the damaged one is gone, never vouched
        assert store.stats().counters.corrupt_blocks == 1 and store.stats().scrub["damaged_found"] == 1
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 32 and torch.equal(got, kv[:, :, :, :32])


def test_damage_after_verification_is_found_by_the_scrub():
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    keys = block_hashes(spec, tokens, NS)
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=64 * MiB) as store:
        store.put_kv(spec, tokens, kv, NS)
        assert store.scrubber.caught_up(10.0) and _verified(store, keys) == [True] * 4
        _flip(store, keys[1])  # readers would trust these bytes now: the scrub is what finds them
        began = time.monotonic()
        assert _removed(store, keys[1]).reason == "corrupt"
        # within about a cycle: 4 blocks charged 1 MiB each at 64 MiB/s, cycles MIN_CYCLE_S apart at least
        assert time.monotonic() - began < 5.0
        assert store.stats().counters.corrupt_blocks == 1 and store.stats().scrub["damaged_found"] == 1
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 16 and torch.equal(got, kv[:, :, :, :16])


def test_the_scrub_keeps_to_its_rate():
    # 1 MiB blocks: above the scrub's per-block charge, so each is paced at its own size
    spec = KVSpec("llama-scrub", num_layers=16, num_kv_heads=8, head_dim=128, dtype="float16",
                  block_tokens=16, fingerprint="weights-rev-1")
    tokens = list(range(4 * 16))
    rate = 8 * MiB  # a cycle of 4 MiB takes half a second: longer than MIN_CYCLE_S, so pacing sets it
    with KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=rate) as store:
        store.put_kv(spec, tokens, make_kv(spec, len(tokens)), NS)
        sizes = [e.size for e in store.entries()]
        cycle, block = sum(sizes), max(sizes)
        assert min(sizes) > BLOCK_COST_BYTES
        assert store.scrubber.wait_cycles(2, 20.0)  # the first may have begun before the put
        t_a = time.monotonic()  # read before the count, so every block counted after began at or after it
        before = store.stats().scrub
        # two more cycles: the second of them begins after this count, so all of it is counted below
        assert store.scrubber.wait_cycles(before["cycles"] + 2, 20.0)
        s_b = store.stats().scrub["scrubbed_bytes"]
        t_b = time.monotonic()
        s_a = before["scrubbed_bytes"]
        assert cycle <= s_b - s_a <= rate * (t_b - t_a) + block
        assert store.stats().scrub["last_cycle_s"] >= cycle / rate * 0.999  # paced, not as fast as it can hash


def test_close_stops_the_thread_promptly():
    spec = make_spec()
    tokens = list(range(32))
    store = KVStore([ShmTier(8 * MiB)], scrub_bytes_per_s=1)  # one block, then a wait of days
    try:
        store.put_kv(spec, tokens, make_kv(spec, 32), NS)
        assert store.scrubber.running
        wait_until(lambda: store.stats().scrub["scrubbed_blocks"] >= 1, what="the scrub's first block")
    finally:
        began = time.monotonic()
        store.close()
        took = time.monotonic() - began
    assert not store.scrubber.running and took < 2.0


def test_without_background_readers_verify():
    spec = make_spec()
    tokens, kv = list(range(32)), make_kv(spec, 32)
    with KVStore([ShmTier(8 * MiB)], background=False) as store:
        store.put_kv(spec, tokens, kv, NS)
        assert not store.scrubber.running and not store.scrubber.caught_up(0.0)
        keys = block_hashes(spec, tokens, NS)
        assert _verified(store, keys) == [False, False]
        assert store.get_kv(spec, tokens, NS)[1] == 32  # the first read hashes and vouches
        assert _verified(store, keys) == [True, True]


def test_the_rate_setting_and_its_flag(monkeypatch):
    assert Settings().scrub_bytes_per_s == 256 * MiB
    assert Settings(scrub_bytes_per_s="64MiB").scrub_bytes_per_s == 64 * MiB
    monkeypatch.setenv("KVSTORE_SCRUB_BYTES_PER_S", "0")
    assert Settings.from_env().scrub_bytes_per_s == 0
    monkeypatch.setenv("KVSTORE_SCRUB_BYTES_PER_S", "fast")
    with pytest.raises(InvalidInput, match="KVSTORE_SCRUB_BYTES_PER_S"):
        Settings.from_env()
    monkeypatch.delenv("KVSTORE_SCRUB_BYTES_PER_S")
    tier = ShmTier(MiB)
    try:
        with pytest.raises(InvalidInput, match="scrub_bytes_per_s"):
            KVStore([tier], scrub_bytes_per_s=-1, background=False)
    finally:
        tier.close()
    settings = Settings(tiers="shm", shm_bytes=4 * MiB, scrub_bytes_per_s="32MiB")
    with EmbeddedStore(settings=settings, background=False) as store:
        assert store.scrubber.bytes_per_s == 32 * MiB
    assert main(["serve", "--scrub-bytes-per-s", "fast"]) == 2  # refused before anything starts
