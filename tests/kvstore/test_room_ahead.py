"""Room for new blocks made ahead of them: once writes take the top tier above its low watermark, the
mover sends its coldest residents down to it (woken by the write that crossed it), in batches
re-encoded together, and later puts land in the room they leave; puts past the high watermark (they
outran the mover) never wait for a demotion."""

from __future__ import annotations

import time

import pytest

from kvstore import KVStore
from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.placement import PlacementConfig, PlacementManager, TierPolicy
from kvstore.keys import block_hashes
from tests.conftest import FakeClock, make_kv, make_spec
from tiers.nvme_log import LogTier
from tiers.shm import ShmTier

MiB = 1 << 20
SPEC = make_spec(num_layers=8, head_dim=64)  # 64 KiB blocks: small enough to re-encode in batches
B = 100


def _manager():
    clock = FakeClock(0.0)
    tiers = [TierPolicy("top", 10 * B, high_watermark_frac=0.9, low_watermark_frac=0.5), TierPolicy("low", 100 * B)]
    return PlacementManager(tiers, config=PlacementConfig(), clock=clock), clock


def test_writes_past_the_low_watermark_send_the_coldest_down_to_it_and_no_further():
    m, _ = _manager()
    woken = []
    m.on_pressure = lambda: woken.append(len(written))  # under placement's lock: it asks nothing of it
    written: list[int] = []
    for i in range(9):  # 90%: at the high watermark, not above it
        m.admitted(b"k%04d" % i, "top", B)
        written.append(i)
    assert woken == [5]  # once, by the sixth write: it took the tier past its low watermark (50%)
    assert m.place_new(B) == "low"  # past the high watermark a put goes one tier down, never waits
    for i in (0, 1):
        m.accessed([b"k%04d" % i])  # the oldest two are in use
    orders = m.plan()
    assert [(o.src, o.dst) for o in orders] == [("top", "low")] * 4  # 9 -> 5 blocks: the low watermark
    assert {o.key for o in orders}.isdisjoint({b"k0000", b"k0001"})
    assert all("room for new blocks" in o.reason for o in orders)
    for o in orders:
        m.moved(o)
    assert m.place_new(B) == "top"  # the room they left takes the next put
    assert m.plan() == []  # at the low watermark: the rest stay
    m.admitted(b"k0100", "top", B)
    assert len(woken) == 2  # above it again: woken again


def test_a_round_that_found_only_a_puts_leased_blocks_is_tried_again_once_they_are_free():
    """One put's chain crosses the low watermark; the round its crossing woke finds only that
    chain, leased while it is written. Its end (the leases let go) wakes the mover again."""
    m, _ = _manager()
    woken = []
    m.on_pressure = lambda: woken.append(True)
    keys = [b"k%04d" % i for i in range(9)]
    for key in keys:  # as a put writes a chain: each block leased as it lands
        m.admitted(key, "top", B)
        assert m.lease(key)
    assert len(woken) == 1 and m.plan() == []  # every resident is the put's own, leased
    for key in keys:
        m.release(key)
    assert len(woken) == 2  # free to go down: woken again, once
    assert len(m.plan()) == 4  # 9 -> 5 blocks: the low watermark


def test_without_new_writes_only_residents_colder_than_a_new_block_go_down():
    m, clock = _manager()
    for i in range(9):
        m.admitted(b"k%04d" % i, "top", B)
    assert len(m.plan()) == 4  # writes: room made ahead (not carried out here)
    assert m.plan() == []  # no write since: fresh residents stay
    clock.advance(600)  # nobody read them since: a block read once now beats them all
    orders = m.plan()
    assert len(orders) == 4 and all("colder than a new one" in o.reason for o in orders)


def test_the_write_that_crosses_the_low_watermark_wakes_the_mover(tmp_path):
    """A round every 60 s: the demotions that come within seconds are the wake's."""
    top = ShmTier(8 * MiB)
    config = PlacementConfig(interval_s=60.0)
    with KVStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], placement=config) as store:
        low = top.capacity_bytes * store.placement.tiers[0].low_watermark_frac
        n = 0
        while store.placement.usage()[top.name] <= low:
            store.put_kv(SPEC, list(range(n * 16, n * 16 + 16)), make_kv(SPEC, 16, seed=n))
            n += 1
        deadline = time.monotonic() + 10
        while store.stats().counters.blocks_demoted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.stats().counters.blocks_demoted > 0
        deadline = time.monotonic() + 10
        while store.placement.usage()[top.name] > low and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.placement.usage()[top.name] <= low


def test_the_settings_low_watermark_is_where_the_mover_makes_room_down_to(tmp_path):
    """``KVSTORE_TOP_TIER_LOW_WATERMARK`` widens the band: the room made ahead reaches it, and a
    policy the caller names for the top tier still wins over the setting."""
    from kvstore.config import Settings
    from kvstore.engine.store import EmbeddedStore

    top = ShmTier(8 * MiB)
    settings = Settings(top_tier_low_watermark=0.5)
    with EmbeddedStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], settings=settings,
                       background=False) as store:
        assert store.placement.tiers[0].low_watermark_frac == 0.5
        n = 0
        while store.placement.usage()[top.name] <= 0.8 * top.capacity_bytes:
            store.put_kv(SPEC, list(range(n * 16, n * 16 + 16)), make_kv(SPEC, 16, seed=n))
            n += 1
        assert store.run_placement() > 0
        used = store.placement.usage()[top.name]
        assert 0.45 * top.capacity_bytes < used <= 0.5 * top.capacity_bytes  # down to it, no further
    with EmbeddedStore([ShmTier(8 * MiB), LogTier(str(tmp_path / "nvme2"), 64 * MiB)], settings=settings,
                       background=False, tier_policies={"shm": {"high_watermark_frac": 0.7}}) as store:
        assert (store.placement.tiers[0].low_watermark_frac, store.placement.tiers[0].high_watermark_frac) == (0.5, 0.7)


def test_a_put_into_a_full_top_tier_never_demotes_on_its_path(tmp_path):
    clock = FakeClock()
    top = ShmTier(8 * MiB)  # the band between the watermarks holds six 64 KiB blocks
    with KVStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], background=False, clock=clock) as store:
        placement = store.placement
        n = 0
        while placement.place_new(64 << 10) == top.name:
            store.put_kv(SPEC, list(range(n * 16, n * 16 + 16)), make_kv(SPEC, 16, seed=n))
            n += 1
        toks = list(range(900_000, 900_064))
        store.put_kv(SPEC, toks, make_kv(SPEC, 64, seed=7))
        keys = block_hashes(SPEC, toks, "default")
        assert {store.entry(k).tier for k in keys} == {"nvme"}
        assert store.stats().counters.blocks_demoted == 0  # the put made no room by moving others
        moved = store.run_placement()  # the mover's round: the coldest down, to the low watermark
        assert moved > 0 and store.stats().counters.blocks_demoted == moved
        low = top.capacity_bytes * placement.tiers[0].low_watermark_frac
        assert placement.usage()[top.name] <= low
        toks = list(range(800_000, 800_064))
        store.put_kv(SPEC, toks, make_kv(SPEC, 64, seed=8))
        assert {store.entry(k).tier for k in block_hashes(SPEC, toks, "default")} == {top.name}
        for i in range(n):  # every block reads back, wherever it went (int8 below: close, not equal)
            kv, got = store.get_kv(SPEC, list(range(i * 16, i * 16 + 16)))
            assert got == 16 and (kv.float() - make_kv(SPEC, 16, seed=i).float()).abs().max() < 0.05


def _full_then_cold(store: KVStore, top: ShmTier, clock: FakeClock) -> list[bytes]:
    keys = []
    n = 0
    while store.placement.place_new(64 << 10) == top.name:
        toks = list(range(n * 16, n * 16 + 16))
        store.put_kv(SPEC, toks, make_kv(SPEC, 16, seed=n))
        keys += block_hashes(SPEC, toks, "default")
        n += 1
    clock.advance(600)
    return keys


def test_demotions_of_small_blocks_are_reencoded_together_into_the_same_frames(tmp_path, monkeypatch):
    batches = []
    many = codec_mod.encode_many

    def counting(kvs, metas):  # counts; every frame is still made by encode_many
        batches.append(len(kvs))
        return many(kvs, metas)

    monkeypatch.setattr(codec_mod, "encode_many", counting)
    clock = FakeClock()
    top = ShmTier(2 * MiB)
    with KVStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], background=False, clock=clock) as store:
        keys = _full_then_cold(store, top, clock)
        raw = {k: bytes(top.get(k)) for k in keys}
        moved = store.run_placement()
        assert moved >= 2 and batches and max(batches) >= 2  # at least one batch of several
        assert sum(batches) <= moved  # no block read and encoded twice
        down = [k for k in keys if store.entry(k).tier == "nvme"]
        assert len(down) == moved
        nvme = store.core.tier("nvme")
        for k in down:  # byte for byte the frame one-at-a-time re-encoding makes
            one = codec_mod.encode(codec_mod.decode(raw[k]), Codec.INT8, meta=codec_mod.frame_meta(raw[k]))
            assert bytes(nvme.get(k)) == bytes(one)
            assert store.entry(k).codec is Codec.INT8 and store.entry(k).size == len(one)


@pytest.mark.parametrize("fault", ["deleted", "rewritten"])
def test_a_block_changed_while_its_batch_is_encoded_keeps_the_change(tmp_path, monkeypatch, fault):
    clock = FakeClock()
    top = ShmTier(2 * MiB)
    with KVStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], background=False, clock=clock) as store:
        keys = _full_then_cold(store, top, clock)
        tokens_of = {k: list(range(i * 16, i * 16 + 16)) for i, k in enumerate(keys)}  # one block a put
        read: list[bytes] = []
        get, many = top.get, codec_mod.encode_many
        victim: list[bytes] = []

        def reading(key):  # records which blocks a batch read; reads them all the same
            read.append(key)
            return get(key)

        def meanwhile(kvs, metas):  # fault: a block of the batch changes between its read and its move
            frames = many(kvs, metas)
            if not victim:
                victim.append(read[0])
                store.delete_blocks(victim)
                if fault == "rewritten":  # written again: a new entry, in the room the delete left
                    toks = tokens_of[victim[0]]
                    store.put_kv(SPEC, toks, make_kv(SPEC, 16, seed=99))
            return frames

        monkeypatch.setattr(top, "get", reading)
        monkeypatch.setattr(codec_mod, "encode_many", meanwhile)
        assert store.run_placement() > 0 and victim
        monkeypatch.setattr(codec_mod, "encode_many", many)
        entry = store.entry(victim[0])
        if fault == "deleted":
            assert entry is None and not store.core.tier("nvme").contains(victim[0])
        else:  # the new KV (int8 where it spilled: close, not equal), not the batch's old frame
            assert entry is not None
            kv, got = store.get_kv(SPEC, tokens_of[victim[0]])
            new, old = make_kv(SPEC, 16, seed=99).float(), make_kv(SPEC, 16, seed=keys.index(victim[0])).float()
            assert got == 16 and (kv.float() - new).abs().max() < 0.05 < (kv.float() - old).abs().max()


def test_blocks_of_two_shapes_are_batched_apart_never_failing_together(tmp_path, monkeypatch):
    """Two models' 64 KiB blocks side by side: one batch per shape (``encode_many`` refuses mixed ones)."""
    other = make_spec(num_layers=16, head_dim=32, model_id="other")  # the same bytes a block, another shape
    calls: list[tuple] = []
    many = codec_mod.encode_many

    def recording(kvs, metas):
        try:
            out = many(kvs, metas)
        except Exception as exc:  # noqa: BLE001 - recorded, then raised as before
            calls.append(("failed", type(exc).__name__))
            raise
        calls.append((tuple(kvs[0].shape), len(kvs)))
        return out

    monkeypatch.setattr(codec_mod, "encode_many", recording)
    clock = FakeClock()
    top = ShmTier(8 * MiB)  # six blocks between the watermarks
    with KVStore([top, LogTier(str(tmp_path / "nvme"), 64 * MiB)], background=False, clock=clock) as store:
        n = 0
        while store.placement.place_new(64 << 10) == top.name:
            spec = (SPEC, other)[n % 2]
            store.put_kv(spec, list(range(n * 16, n * 16 + 16)), make_kv(spec, 16, seed=n))
            n += 1
        clock.advance(600)
        moved = store.run_placement()
        assert moved >= 4
        assert [c for c in calls if c[0] == "failed"] == []
        assert {c[0] for c in calls} == {tuple(SPEC.kv_shape(16)), tuple(other.kv_shape(16))}
