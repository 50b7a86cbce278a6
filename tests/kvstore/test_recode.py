"""Blocks a put spills raw into a cold tier, re-encoded to int8 behind it (``kvstore.engine.recode``).

Real shm arenas and nvme directories, the store's own threads. A slow disk is injected where a
test needs the re-encoder caught mid-way: its tier's ``get`` waits on a gate.
"""

import threading
import time

import torch

from kvstore import KVStore, codec
from kvstore.codec import Codec
from kvstore.engine.events import MOVED
from kvstore.keys import block_hashes
from tests.conftest import make_kv, make_spec, wait_until
from tiers.nvme import NVMeTier
from tiers.shm import ShmTier

MiB = 1 << 20
SPEC = make_spec(num_layers=16, num_kv_heads=8, head_dim=64)  # 512 KiB blocks of 16 tokens: re-encoded behind
BLOCK = 512 * 1024
SMALL = make_spec(num_layers=4, num_kv_heads=2, head_dim=64)  # 32 KiB blocks: quantized on the put's path


def _store(path, *, backlog=64 * MiB, top=16 * MiB, **kw) -> KVStore:
    return KVStore([ShmTier(top), NVMeTier(path, 256 * MiB)], recode_backlog_bytes=backlog, **kw)


def _close_enough(got: torch.Tensor, ref: torch.Tensor) -> bool:
    ref = ref.float()
    return float((got.float() - ref).norm() / ref.norm()) < 0.01


def _gate(tier) -> tuple[threading.Event, threading.Event]:
    """Make ``tier.get`` (the re-encoder's read) return only once the gate opens: a slow disk."""
    entered, gate = threading.Event(), threading.Event()
    real = tier.get

    def get(key):
        frame = real(key)  # read, then held up: what it read may be stale by the time it returns
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return frame

    tier.get = get
    return entered, gate


def _nvme_entries(store):
    return [e for e in store.entries() if e.tier == "nvme"]


def test_a_full_store_spills_raw_and_the_recoder_makes_it_int8(tmp_path):
    tokens = list(range(16 * 64))  # 32 MiB of KV into a 16 MiB top tier
    kv = make_kv(SPEC, len(tokens), seed=1)
    with _store(tmp_path / "nvme") as store:
        assert store.put_kv(SPEC, tokens, kv) == len(tokens)
        st = store.stats().recode
        assert st["spilled_raw_blocks"] > 0, st  # the put wrote raw below the top tier
        assert store.recoder.idle(20)
        nvme = _nvme_entries(store)
        assert nvme and all(e.codec is Codec.INT8 for e in nvme)
        assert all(e.size < BLOCK for e in nvme)  # int8: about half the fp16 bytes
        st = store.stats().recode
        # each debt paid once: re-encoded, or given up for a block the mover moved meanwhile
        assert st["recoded_blocks"] + st["dropped"] == st["spilled_raw_blocks"] + st["demoted_raw_blocks"], st
        assert st["recoded_blocks"] >= len(nvme) // 2 and st["failed"] == st["kept_raw"] == 0, st
        assert st["pending_bytes"] == 0 and st["pending_blocks"] == 0
        assert st["recoded_bytes_saved"] > len(nvme) * BLOCK // 3
        # placement counts the frames' new sizes: what it decides room by matches the tier
        assert store.placement.usage()["nvme"] == sum(e.size for e in nvme) == store.tiers[1].stats().used_bytes
        recoded = [ev for ev in store.events.read(0, 100_000)[0] if ev.kind == MOVED and ev.reason == "recoded"]
        assert len({ev.key for ev in recoded}) == st["recoded_blocks"]
        assert all(ev.tier == ev.src == "nvme" for ev in recoded)
        got, n = store.get_kv(SPEC, tokens)
        assert n == len(tokens)
        for e in store.entries():
            part = slice(e.depth * 16, (e.depth + 1) * 16)
            if e.codec is Codec.INT8:
                assert _close_enough(got[:, :, :, part], kv[:, :, :, part])
            else:
                assert torch.equal(got[:, :, :, part], kv[:, :, :, part])
        assert store.stats().counters.corrupt_blocks == 0


def test_the_debt_is_bounded_past_it_a_put_encodes_itself(tmp_path):
    tokens = list(range(16 * 64))
    kv = make_kv(SPEC, len(tokens), seed=2)
    with _store(tmp_path / "nvme", backlog=4 * BLOCK) as store:
        entered, gate = _gate(store.tiers[1])
        try:
            assert store.put_kv(SPEC, tokens, kv) == len(tokens)
            entered.wait(5)
            nvme = _nvme_entries(store)
            raw = [e for e in nvme if e.codec is Codec.RAW]
            assert 1 <= len(raw) <= 4, len(raw)  # the bound, in raw KV bytes
            assert len(nvme) - len(raw) > 10  # the rest encoded on the put's path
            assert store.stats().recode["pending_bytes"] <= 4 * BLOCK + 4 * 1024
        finally:
            gate.set()
        assert store.recoder.idle(20)
        assert all(e.codec is Codec.INT8 for e in _nvme_entries(store))


def test_the_recoder_waits_for_a_gap_in_the_puts_however_large_the_debt(tmp_path):
    """While puts go on it pays nothing, even past half its bound (a raw write now and a re-encode
    later is more work on the same cores than the int8 write a put makes once the debt is at its
    bound); in the first gap it pays everything."""
    with _store(tmp_path / "nvme", backlog=64 * MiB) as store:
        before = store.core.last_put_s
        store.put_kv(SMALL, list(range(32)), make_kv(SMALL, 32, seed=4))  # a put marks the core itself
        assert store.core.last_put_s > before
        store.core.putting()
        keys = [bytes([i]) * 32 for i in range(8)]  # owed, not stored: paying one drops it at once
        for key in keys:
            store.recoder.owe(key, 5 * MiB)  # 40 MiB: past half the bound
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # puts go on: each marks the core, as every put path does
            store.core.putting()
            assert store.stats().recode["pending_blocks"] == len(keys)
        assert store.recoder.idle(20)  # the gap: everything paid
        assert store.stats().recode["dropped"] == len(keys)


def test_a_delete_during_a_recode_wins(tmp_path):
    tokens = list(range(16 * 64))
    with _store(tmp_path / "nvme") as store:
        entered, gate = _gate(store.tiers[1])
        try:
            store.put_kv(SPEC, tokens, make_kv(SPEC, len(tokens), seed=3))
            assert entered.wait(5)  # the re-encoder is reading a frame
            assert store.delete(SPEC, tokens) == 64
        finally:
            gate.set()
        assert store.recoder.idle(20)
        assert store.lookup(SPEC, tokens) == 0
        keys = block_hashes(SPEC, tokens, "default")
        assert all(store.tiers[1].get(key) is None for key in keys)  # no frame written back
        st = store.stats().recode  # owed by the put's spills and by the mover's raw demotions
        assert st["recoded_blocks"] == 0 and st["dropped"] == st["spilled_raw_blocks"] + st["demoted_raw_blocks"] > 0


def test_readers_racing_the_recoder_get_every_block_right(tmp_path):
    tokens = list(range(16 * 64))
    kv = make_kv(SPEC, len(tokens), seed=4)
    with _store(tmp_path / "nvme", backlog=64 * MiB) as store:
        entered, gate = _gate(store.tiers[1])
        store.put_kv(SPEC, tokens, kv)
        stop, bad, reads = threading.Event(), [], [0]

        def read() -> None:
            while not stop.is_set():
                got, n = store.get_kv(SPEC, tokens)
                reads[0] += 1
                if n != len(tokens) or not _close_enough(got, kv):
                    bad.append(n)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            wait_until(lambda: reads[0] >= 2, what="the reader's first reads")
            gate.set()
            assert store.recoder.idle(20)
            wait_until(lambda: reads[0] >= 10, what="reads after the re-encodes")
        finally:
            gate.set()
            stop.set()
            reader.join(30)
        assert bad == []
        assert store.stats().counters.corrupt_blocks == 0


def test_raw_frames_found_at_start_are_owed_and_recoded(tmp_path):
    tokens = list(range(16 * 64))
    kv = make_kv(SPEC, len(tokens), seed=5)
    path = tmp_path / "nvme"
    with _store(path, tier_codecs={"nvme": "raw"}) as store:  # an operator who kept nvme raw
        store.put_kv(SPEC, tokens, kv)
        n_cold = len(_nvme_entries(store))
        assert n_cold and all(e.codec is Codec.RAW for e in _nvme_entries(store))
    with _store(path) as store:  # now int8 (the default): what is there is re-encoded
        assert store.recoder.idle(20)
        nvme = _nvme_entries(store)
        assert len(nvme) >= n_cold and all(e.codec is Codec.INT8 for e in nvme)  # the mover may demote more
        for e in nvme:
            part = slice(e.depth * 16, (e.depth + 1) * 16)
            assert _close_enough(codec.decode(store.tiers[1].get(e.key)), kv[:, :, :, part])
        assert store.stats().recode["recoded_blocks"] == len(nvme)


def test_a_store_without_background_threads_encodes_for_the_cold_tier_itself(tmp_path):
    for store in (_store(tmp_path / "a", backlog=0), _store(tmp_path / "b", background=False)):
        with store:
            store.put_kv(SPEC, list(range(16 * 64)), make_kv(SPEC, 16 * 64, seed=6))
            nvme = _nvme_entries(store)
            assert nvme and all(e.codec is Codec.INT8 for e in nvme)
            st = store.stats().recode
            assert st["spilled_raw_blocks"] == 0 and st["backlog_bytes"] == 0


def test_no_rewrite_in_place_where_an_overwrite_could_lose_a_durable_frame(tmp_path):
    # The file layout under a group commit renames an unsynced file over the old one: the put
    # encodes int8 itself there. The log layout keeps the old record until a synced compaction.
    from tiers.nvme_log import LogTier

    for cold, spills in ((NVMeTier(tmp_path / "f", 256 * MiB, sync_interval_s=0.1), False),
                         (LogTier(tmp_path / "l", 256 * MiB, sync_interval_s=0.1), True)):
        assert cold.overwrite_keeps_durable is spills
        with KVStore([ShmTier(16 * MiB), cold]) as store:
            store.put_kv(SPEC, list(range(16 * 64)), make_kv(SPEC, 16 * 64, seed=7))
            assert (store.stats().recode["spilled_raw_blocks"] > 0) is spills
            assert store.recoder.idle(20)
            assert all(e.codec is Codec.INT8 for e in _nvme_entries(store))


def test_a_rewrite_that_fails_after_it_landed_is_indexed_as_written(tmp_path):
    # A file renamed into place whose directory sync then fails: the tier serves the new frame,
    # so the index must name it, or the next read takes the sound block for damage and drops it.
    from kvstore.errors import TierIOError

    tokens = list(range(16 * 64))
    kv = make_kv(SPEC, len(tokens), seed=8)
    with _store(tmp_path / "nvme") as store:  # the file layout, each put synced
        cold = store.tiers[1]
        real = cold.put

        def put(key, frame):
            real(key, frame)
            if threading.current_thread().name == "kvstore-recoder":
                raise TierIOError("injected: the directory's fsync failed")

        cold.put = put
        store.put_kv(SPEC, tokens, kv)
        assert store.recoder.idle(20)
        for e in _nvme_entries(store):
            assert e.codec is Codec.INT8 and codec.read_header(cold.get(e.key)).body_checksum == e.checksum
        got, n = store.get_kv(SPEC, tokens)
        assert n == len(tokens) and _close_enough(got, kv)
        assert store.stats().counters.corrupt_blocks == 0


def test_a_block_read_by_key_waits_out_a_rewrite_between_its_write_and_switch(tmp_path):
    with _store(tmp_path / "nvme") as store:
        cold = store.tiers[1]
        real, entered, gate = cold.put, threading.Event(), threading.Event()

        def put(key, frame):
            real(key, frame)  # written: the index still names the raw frame until the switch
            if threading.current_thread().name == "kvstore-recoder":
                entered.set()
                assert gate.wait(30)

        cold.put = put
        try:
            store.put_kv(SPEC, list(range(16 * 64)), make_kv(SPEC, 16 * 64, seed=9))
            assert entered.wait(10)
            key = next(e.key for e in _nvme_entries(store) if e.codec is Codec.RAW
                       and codec.read_header(real.__self__.get(e.key)).codec is Codec.INT8)
            got: list = []
            reader = threading.Thread(target=lambda: got.append(
                store.frames.read_with(key, None, lambda view, header, entry: (header.codec, entry.codec))))
            reader.start()
            reader.join(0.3)
            assert reader.is_alive()  # waiting for the rewrite's claim, not answering "gone"
        finally:
            gate.set()
        reader.join(10)
        assert got == [(Codec.INT8, Codec.INT8)]


def test_a_block_int8_cannot_hold_stays_raw_and_its_batch_is_recoded(tmp_path):
    from tiers.memory import MemoryTier

    tokens = list(range(16 * 64))
    kv = make_kv(SPEC, len(tokens), seed=10)
    kv[0, 1, 0, 60 * 16 + 3, 5] = float("inf")  # block 60: raw KV keeps it, int8 cannot
    # Both upper tiers raw: the put does not refuse Inf (it would where a put lands in int8)
    with KVStore([ShmTier(16 * MiB), MemoryTier(8 * MiB, name="warm"), NVMeTier(tmp_path / "n", 256 * MiB)]) as store:
        assert store.put_kv(SPEC, tokens, kv) == len(tokens)
        assert store.recoder.idle(20)
        nvme = {e.depth: e for e in _nvme_entries(store)}
        assert 60 in nvme and len(nvme) > 8
        assert nvme[60].codec is Codec.RAW
        assert all(e.codec is Codec.INT8 for d, e in nvme.items() if d != 60)
        st = store.stats().recode
        assert st["kept_raw"] == 1 and st["recoded_blocks"] == len(nvme) - 1, st
        got, n = store.get_kv(SPEC, tokens)
        assert n == len(tokens)
        part = slice(60 * 16, 61 * 16)
        assert torch.equal(got[:, :, :, part].view(torch.int16), kv[:, :, :, part].view(torch.int16))


def test_small_blocks_are_quantized_with_their_chain_on_the_puts_path(tmp_path):
    tokens = list(range(16 * 64))  # 2 MiB of 32 KiB blocks into a 1 MiB top tier
    kv = make_kv(SMALL, len(tokens), seed=11)
    with _store(tmp_path / "nvme", top=1 * MiB) as store:
        assert store.put_kv(SMALL, tokens, kv) == len(tokens)
        demoted = {ev.key for ev in store.events.read(0, 100_000)[0]
                   if ev.kind == MOVED and ev.reason.startswith("demoted")}  # the mover's: raw until a gap
        nvme = [e for e in _nvme_entries(store) if e.key not in demoted]  # no waiting: int8 as the put returns
        assert len(nvme) > 16 and all(e.codec is Codec.INT8 for e in nvme)
        assert store.stats().recode["spilled_raw_blocks"] == 0
        from kvstore.keys import block_meta

        for e in nvme[:4]:  # the frames one-at-a-time encoding makes, byte for byte
            block = kv[:, :, :, e.depth * 16:(e.depth + 1) * 16]
            meta = block_meta(e.namespace, e.spec_fp, e.depth)
            assert bytes(store.tiers[1].get(e.key)) == bytes(codec.encode(block, "int8", meta=meta))
        got, n = store.get_kv(SMALL, tokens)
        assert n == len(tokens) and _close_enough(got, kv)


def test_the_mover_demotes_raw_and_the_recoder_makes_it_int8_in_a_gap(tmp_path):
    """A demotion into an int8 tier copies the raw frame down as it is and owes its re-encode
    (2.6x cheaper beside the puts that made it necessary); the block is served exactly meanwhile
    and within int8's error after."""
    tokens = list(range(16 * 64))  # 2 MiB of 32 KiB blocks into a 1 MiB top tier
    kv = make_kv(SMALL, len(tokens), seed=13)
    from kvstore.engine.placement import PlacementConfig

    with _store(tmp_path / "nvme", top=1 * MiB, placement=PlacementConfig(min_residency_s=0)) as store:
        entered, gate = _gate(store.tiers[1])  # the re-encoder's reads wait: demoted frames stay raw
        try:
            assert store.put_kv(SMALL, tokens, kv) == len(tokens)
            wait_until(lambda: store.stats().recode["demoted_raw_blocks"] > 0, 20, "a raw demotion")
            wait_until(lambda: entered.is_set(), 20, "the re-encoder's first read")
            raw = [e for e in _nvme_entries(store) if e.codec is Codec.RAW]
            assert raw  # down as they were
            got, n = store.get_kv(SMALL, tokens)
            assert n == len(tokens)
            for e in raw:  # exact until re-encoded
                part = slice(e.depth * 16, (e.depth + 1) * 16)
                assert torch.equal(got[:, :, :, part], kv[:, :, :, part])
        finally:
            gate.set()
        assert store.recoder.idle(20)
        st = store.stats().recode
        assert st["spilled_raw_blocks"] == 0 and st["recoded_blocks"] >= 1, st
        assert all(e.codec is Codec.INT8 for e in _nvme_entries(store))
        got, n = store.get_kv(SMALL, tokens)
        assert n == len(tokens) and _close_enough(got, kv)


def test_a_small_block_int8_cannot_hold_is_kept_raw_and_the_rest_int8(tmp_path):
    from tiers.memory import MemoryTier

    tokens = list(range(16 * 64))
    kv = make_kv(SMALL, len(tokens), seed=12)
    kv[1, 0, 1, 60 * 16 + 2, 9] = float("nan")
    with KVStore([ShmTier(1 * MiB), MemoryTier(MiB // 2, name="warm"), NVMeTier(tmp_path / "n", 64 * MiB)]) as store:
        assert store.put_kv(SMALL, tokens, kv) == len(tokens)
        nvme = {e.depth: e for e in _nvme_entries(store)}
        assert 60 in nvme and nvme[60].codec is Codec.RAW and store.stats().counters.blocks_kept_raw == 1
        assert all(e.codec is Codec.INT8 for d, e in nvme.items() if d != 60)
