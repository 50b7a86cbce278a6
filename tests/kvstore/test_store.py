import threading

import pytest
import torch

from kvstore.engine.placement import PlacementConfig

from kvstore import EmbeddedStore, KVStore, Settings
from kvstore.codec import Codec, read_header
from kvstore.errors import InvalidInput, InvalidKV, InvalidSpec, InvalidTokens, StoreClosed, TierFull, TierUnavailable
from kvstore.keys import block_hashes
from tests.conftest import FakeClock, make_kv, make_spec
from tiers.memory import MemoryTier

MiB = 1 << 20
TOKENS = list(range(500, 600))  # 6 full blocks of 16, tail of 4


@pytest.fixture
def store():
    with EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=256 * MiB)) as s:
        yield s


def test_public_interface_round_trip(store, spec):
    kv = make_kv(spec, 100)
    assert store.put_kv(spec, TOKENS, kv, namespace="default") == 96
    kv2, n2 = store.get_kv(spec, TOKENS, namespace="default")
    assert n2 == 96 and kv2.dtype == torch.float16 and kv2.shape == spec.kv_shape(96)
    assert torch.equal(kv2, kv[:, :, :, :96])
    assert kv2.is_contiguous()
    assert store.lookup(spec, TOKENS, namespace="default") == 96


def test_nothing_stored_gives_empty_kv(store, spec):
    kv, n = store.get_kv(spec, TOKENS)
    assert n == 0 and kv.shape == spec.kv_shape(0) and kv.dtype == spec.torch_dtype
    assert store.lookup(spec, TOKENS) == 0


def test_partial_prefix(store, spec):
    kv = make_kv(spec, 100)
    store.put_kv(spec, TOKENS[:40], kv[:, :, :, :40])  # 2 blocks; the 8-token tail is dropped
    assert store.lookup(spec, TOKENS) == 32
    kv2, n = store.get_kv(spec, TOKENS)
    assert n == 32 and torch.equal(kv2, kv[:, :, :, :32])
    # a sequence that diverges inside block 1 shares only block 0
    other = TOKENS[:20] + [9] * 80
    assert store.lookup(spec, other) == 16
    assert torch.equal(store.get_kv(spec, other)[0], kv[:, :, :, :16])


def test_tail_shorter_than_a_block(store, spec):
    assert store.put_kv(spec, TOKENS[:15], make_kv(spec, 15)) == 0
    assert store.stats().blocks == 0
    kv, n = store.get_kv(spec, TOKENS[:15])
    assert n == 0 and kv.shape[3] == 0


def test_kv_longer_than_tokens_is_fine_shorter_is_not(store, spec):
    assert store.put_kv(spec, TOKENS[:32], make_kv(spec, 50)) == 32
    with pytest.raises(InvalidKV, match=">=96"):
        store.put_kv(spec, TOKENS, make_kv(spec, 90))


def test_dedup_does_not_rewrite(store, spec):
    kv = make_kv(spec, 100)
    store.put_kv(spec, TOKENS[:64], kv[:, :, :, :64])
    puts_before = store.stats().tiers[0].counters.puts
    assert store.put_kv(spec, TOKENS, kv) == 96  # covered tokens, old and new
    stats = store.stats()
    assert stats.counters.blocks_written == 6
    assert stats.counters.blocks_deduped == 4
    assert stats.tiers[0].counters.puts - puts_before == 2
    assert stats.blocks == 6


def test_namespace_and_spec_isolation(store, spec):
    kv = make_kv(spec, 100)
    store.put_kv(spec, TOKENS, kv, namespace="tenant-a")
    assert store.lookup(spec, TOKENS, namespace="tenant-b") == 0
    assert store.get_kv(spec, TOKENS, namespace="tenant-b")[1] == 0
    assert store.lookup(make_spec(fingerprint="weights-rev-2"), TOKENS, namespace="tenant-a") == 0
    assert store.delete(spec, TOKENS, namespace="tenant-b") == 0
    assert store.lookup(spec, TOKENS, namespace="tenant-a") == 96


def test_an_entry_under_another_namespace_is_a_miss(store, spec):
    """Even a key that (by some other route) equals ours is served only to its own namespace."""
    kv = make_kv(spec, 32)
    store.put_kv(spec, TOKENS[:32], kv, namespace="tenant-a")
    key = block_hashes(spec, TOKENS[:32], "tenant-a")[0]
    store.entry(key).namespace = "tenant-b"  # simulate a poisoned entry (the live entry)
    assert store.lookup(spec, TOKENS[:32], namespace="tenant-a") == 0
    assert store.get_kv(spec, TOKENS[:32], namespace="tenant-a")[1] == 0


def test_tokens_as_tensor_and_bfloat16():
    spec = make_spec(dtype="bfloat16", block_tokens=8)
    with EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=16 * MiB)) as store:
        kv = make_kv(spec, 24)
        assert store.put_kv(spec, torch.tensor(TOKENS[:24]), kv) == 24
        kv2, n = store.get_kv(spec, TOKENS[:24])
        assert n == 24 and kv2.dtype == torch.bfloat16 and torch.equal(kv2, kv)


@pytest.mark.parametrize("codec", ["int8", "int8+lz4"])
def test_int8_store_keeps_error_bound_and_saves_bytes(spec, codec):
    with EmbeddedStore(codec=codec, settings=Settings(tiers="memory", memory_bytes=64 * MiB)) as store:
        kv = make_kv(spec, 100)
        store.put_kv(spec, TOKENS, kv)
        kv2, n = store.get_kv(spec, TOKENS)
        ref = kv[:, :, :, :96].float()
        assert n == 96 and float((kv2.float() - ref).norm() / ref.norm()) <= 0.01
        stats = store.stats()
        assert stats.codec_bytes_saved > 0.3 * stats.raw_bytes
        assert all(e.codec is not Codec.RAW for e in store.entries())


def test_int8_refuses_nan_before_storing_anything(spec):
    with EmbeddedStore(codec="int8", settings=Settings(tiers="memory", memory_bytes=64 * MiB)) as store:
        kv = make_kv(spec, 100)
        kv[1, 1, 0, 70, 3] = float("nan")  # in block 4
        store.put_kv(spec, TOKENS[:16], kv[:, :, :, :16])  # block 0 was there before the call
        with pytest.raises(InvalidKV, match=r"NaN.*nothing was stored"):
            store.put_kv(spec, TOKENS, kv)
        assert store.stats().blocks == 1 and store.tiers[0].stats().entries == 1
        assert store.lookup(spec, TOKENS) == 16



def test_nan_blocks_are_stored_exact_when_puts_land_in_raw_tiers():
    """Raw top tiers take any finite-or-not KV (no 2 ms scan per 32 MiB); a block that
    falls through to an int8 tier is kept raw there instead of failing the put."""
    hot, mid = MemoryTier(1 * MiB, name="hot"), MemoryTier(1 * MiB, name="mid")
    cold = MemoryTier(64 * MiB, name="cold")
    spec = make_spec(num_layers=8, head_dim=64)  # 64 KiB blocks: 15 fit in each small tier
    tokens = list(range(40 * 16))
    kv = make_kv(spec, len(tokens))
    kv[1, 0, 0, 3 * 16 + 2, 5] = float("nan")  # block 3: lands in hot
    kv[2, 1, 1, 35 * 16 + 7, 1] = float("inf")  # block 35: falls through to cold (int8)
    kv[2, 1, 1, 36 * 16 + 7, 1] = 1.0  # block 36: finite, cold
    with KVStore([hot, mid, cold], tier_codecs={"cold": "int8"}, background=False) as store:
        assert store.put_kv(spec, tokens, kv) == len(tokens)
        entries = {e.depth: e for e in store.entries()}
        assert entries[3].tier == "hot" and entries[3].codec is Codec.RAW
        assert entries[35].tier == "cold" and entries[35].codec is Codec.RAW  # kept raw: int8 cannot hold Inf
        assert entries[36].tier == "cold" and entries[36].codec is Codec.INT8
        assert store.stats().counters.blocks_kept_raw == 1
        got, n = store.get_kv(spec, tokens)
        assert n == len(tokens)
        for b in (3, 35):
            part = slice(b * 16, (b + 1) * 16)
            assert torch.equal(got[:, :, :, part].view(torch.int16), kv[:, :, :, part].view(torch.int16))

def test_per_tier_codec():
    hot, cold = MemoryTier(1 * MiB, name="hot"), MemoryTier(64 * MiB, name="cold")
    spec = make_spec(num_layers=8, head_dim=64)  # 64 KiB blocks: 15 fit in hot
    # No background threads: the mover would send the coldest of a tier this full down meanwhile
    # (seen under load), and the put encodes its spill int8 itself (the re-encoder's path has tests
    # of its own, tests/kvstore/test_recode.py)
    with KVStore([hot, cold], tier_codecs={"cold": "int8"}, background=False) as store:
        kv = make_kv(spec, 20 * 16)
        store.put_kv(spec, list(range(20 * 16)), kv)
        by_tier = {e.tier: e.codec for e in store.entries()}
        assert by_tier == {"hot": Codec.RAW, "cold": Codec.INT8}
        assert hot.stats().entries == 15 and cold.stats().entries == 5
        # One call never pushes out its own chain: the blocks that did not fit went below.
        assert {e.depth for e in store.entries() if e.tier == "cold"} == {15, 16, 17, 18, 19}
        kv2, n = store.get_kv(spec, list(range(20 * 16)))
        assert n == 320 and torch.equal(kv2[:, :, :, : 15 * 16], kv[:, :, :, : 15 * 16])
        err = (kv2[:, :, :, 15 * 16:].float() - kv[:, :, :, 15 * 16:].float()).norm() / kv[:, :, :, 15 * 16:].float().norm()
        assert 0 < err < 0.01


def test_a_later_put_demotes_the_coldest_and_recodes_them():
    hot, cold = MemoryTier(1 * MiB, name="hot"), MemoryTier(64 * MiB, name="cold")
    spec = make_spec(num_layers=8, head_dim=64)  # 64 KiB blocks: 15 fit in hot
    # Admission off: every new block enters the top tier, so the older chain has to make room.
    config = PlacementConfig(admission=False)
    with KVStore([hot, cold], tier_codecs={"cold": "int8"}, background=False, placement=config) as store:
        first, second = list(range(10 * 16)), list(range(10_000, 10_000 + 10 * 16))
        kv1, kv2 = make_kv(spec, len(first), seed=1), make_kv(spec, len(second), seed=2)
        store.put_kv(spec, first, kv1)
        store.get_kv(spec, first[: 5 * 16])  # the first five blocks are hotter than the rest
        store.put_kv(spec, second, kv2)
        demoted = sorted(e.depth for e in store.entries() if e.tier == "cold")
        assert demoted == [5, 6, 7, 8, 9] and store.stats().counters.blocks_demoted == 5
        assert all(e.codec is Codec.INT8 for e in store.entries() if e.tier == "cold")
        got, n = store.get_kv(spec, first)
        assert n == len(first) and torch.equal(got[:, :, :, : 5 * 16], kv1[:, :, :, : 5 * 16])
        tail, ref = got[:, :, :, 5 * 16:].float(), kv1[:, :, :, 5 * 16:].float()
        assert 0 < float((tail - ref).norm() / ref.norm()) < 0.01
        cold_key = next(e.key for e in store.entries() if e.tier == "cold")
        why = store.explain(cold_key)
        assert why["tier"] == "cold" and why["codec"] == "int8"
        assert "demoted: hot full" in why["moves"][-1]["reason"]


def test_full_everywhere_raises_with_progress(spec):
    block = spec.block_nbytes + 512  # frame overhead
    with KVStore([MemoryTier(3 * block)]) as store:
        with pytest.raises(TierFull) as info:
            store.put_kv(spec, TOKENS, make_kv(spec, 100))
        assert info.value.stored_tokens == 48
        assert store.lookup(spec, TOKENS) == 48


class _DownTier(MemoryTier):
    def put_with(self, key, size, writer):
        raise TierUnavailable("backing is down", tier=self.name)

    def put(self, key, frame):
        raise TierUnavailable("backing is down", tier=self.name)


def test_unavailable_tier_degrades_to_the_next(spec):
    with KVStore([_DownTier(64 * MiB, name="down"), MemoryTier(64 * MiB, name="up")]) as store:
        assert store.put_kv(spec, TOKENS, make_kv(spec, 100)) == 96
        assert {e.tier for e in store.entries()} == {"up"}
        assert store.stats().counters.tier_errors == 6
    with KVStore([_DownTier(64 * MiB, name="down")]) as store:
        with pytest.raises(TierUnavailable):
            store.put_kv(spec, TOKENS, make_kv(spec, 100))


def test_corrupt_frame_is_a_miss_and_dropped(store, spec):
    kv = make_kv(spec, 100)
    store.put_kv(spec, TOKENS, kv)
    tier = store.tiers[0]
    key = block_hashes(spec, TOKENS)[3]
    frame = bytearray(tier.get(key))
    frame[read_header(frame).payload_offset + 10] ^= 0x40  # one flipped bit in the payload
    tier.put(key, frame)
    kv2, n = store.get_kv(spec, TOKENS)
    assert n == 48 and torch.equal(kv2, kv[:, :, :, :48])
    assert store.stats().counters.corrupt_blocks == 1
    assert store.lookup(spec, TOKENS) == 48 and not tier.contains(key)
    assert store.put_kv(spec, TOKENS, kv) == 96  # the next put heals it
    assert torch.equal(store.get_kv(spec, TOKENS)[0], kv[:, :, :, :96])


def test_frame_lost_by_the_tier_is_a_miss(store, spec):
    store.put_kv(spec, TOKENS, make_kv(spec, 100))
    store.tiers[0].delete(block_hashes(spec, TOKENS)[2])
    assert store.get_kv(spec, TOKENS)[1] == 32
    assert store.stats().counters.stale_blocks == 1
    assert store.lookup(spec, TOKENS) == 32


def test_delete(store, spec):
    kv = make_kv(spec, 100)
    store.put_kv(spec, TOKENS, kv)
    assert store.delete(spec, TOKENS[:32]) == 2
    assert store.lookup(spec, TOKENS) == 0  # the chain starts with a missing block
    assert store.stats().blocks == 4 and store.tiers[0].stats().entries == 4
    assert store.delete_blocks(block_hashes(spec, TOKENS)) == 4
    assert store.stats().blocks == 0 and store.stats().frame_bytes == 0
    assert store.tiers[0].stats().used_bytes == 0


def test_hits_are_recorded(store, spec):
    store.put_kv(spec, TOKENS, make_kv(spec, 100))
    store.get_kv(spec, TOKENS[:40])
    hits = {e.depth: e.hits for e in store.entries()}
    assert hits == {0: 1, 1: 1, 2: 0, 3: 0, 4: 0, 5: 0}
    c = store.stats().counters
    assert (c.tokens_requested, c.tokens_hit) == (32, 32)


@pytest.mark.parametrize("call", ["put_kv", "get_kv", "lookup"])
def test_bad_input_is_typed_and_changes_nothing(store, spec, call):
    kv = make_kv(spec, 100)
    args = {"put_kv": (TOKENS, kv), "get_kv": (TOKENS,), "lookup": (TOKENS,)}[call]
    fn = getattr(store, call)
    with pytest.raises(InvalidInput):
        fn("not a spec", *args)
    with pytest.raises(InvalidTokens):
        fn(spec, [1.5] * 32, *args[1:])
    with pytest.raises(InvalidSpec, match="namespace"):
        fn(spec, *args, namespace="a/b")
    assert store.stats().blocks == 0


def test_put_kv_shape_and_dtype_errors(store, spec):
    with pytest.raises(InvalidKV, match="dtype"):
        store.put_kv(spec, TOKENS, make_kv(spec, 100).float())
    with pytest.raises(InvalidKV, match="shape"):
        store.put_kv(spec, TOKENS, torch.zeros(4, 2, 3, 100, 16, dtype=torch.float16))


def test_closed_store_refuses(spec):
    store = EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=MiB))
    store.close()
    store.close()
    for call in (lambda: store.put_kv(spec, TOKENS, make_kv(spec, 100)),
                 lambda: store.get_kv(spec, TOKENS), lambda: store.lookup(spec, TOKENS)):
        with pytest.raises(StoreClosed):
            call()


def test_constructor_errors():
    with pytest.raises(InvalidInput, match="non-empty"):
        KVStore([])
    with pytest.raises(InvalidInput, match="unique"):
        KVStore([MemoryTier(MiB), MemoryTier(MiB)])
    with pytest.raises(InvalidInput, match="unknown tier"):
        KVStore([MemoryTier(MiB)], tier_codecs={"nvme": "int8"})
    with pytest.raises(InvalidInput, match="unknown codec"):
        KVStore([MemoryTier(MiB)], codec="gzip")


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("KVSTORE_TIERS", "memory")
    monkeypatch.setenv("KVSTORE_MEMORY_BYTES", "3MiB")
    monkeypatch.setenv("KVSTORE_CODEC", "int8")
    with EmbeddedStore() as store:
        assert store.tiers[0].capacity_bytes == 3 * MiB
        assert store.core.codec_of("memory") is Codec.INT8
    monkeypatch.setenv("KVSTORE_MEMORY_BYTES", "lots")
    with pytest.raises(InvalidInput, match="KVSTORE_MEMORY_BYTES"):
        EmbeddedStore()


@pytest.mark.parametrize("iterations", [150, pytest.param(5000, marks=pytest.mark.slow)])
def test_threaded_put_get_delete_keep_index_and_data_consistent(iterations):
    """Writers, readers and deleters on overlapping sequences: every read is exact."""
    spec = make_spec(block_tokens=4, num_layers=2, head_dim=8)
    base = make_kv(spec, 64, seed=7)  # token t's KV depends only on t: prefixes agree
    seqs = [list(range(t0, t0 + 64)) for t0 in (0,)] + [list(range(32)) + list(range(100 + 32 * i, 132 + 32 * i)) for i in range(3)]
    kvs = [base if i == 0 else torch.cat([base[:, :, :, :32], make_kv(spec, 32, seed=i)], dim=3) for i in range(len(seqs))]
    errors: list[BaseException] = []
    with EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=64 * MiB)) as store:

        def worker(w: int) -> None:
            try:
                for i in range(iterations):
                    s = (w + i) % len(seqs)
                    op = (w * 7 + i) % 5
                    if op < 2:
                        store.put_kv(spec, seqs[s], kvs[s])
                    elif op < 4:
                        got, n = store.get_kv(spec, seqs[s])
                        assert torch.equal(got, kvs[s][:, :, :, :n]), f"seq {s}: wrong KV for {n} tokens"
                    else:
                        store.delete(spec, seqs[s][: 4 * (1 + i % 16)])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        tier = store.tiers[0]
        entries = {e.key: e for e in store.entries()}
        assert set(entries) == set(tier.keys())
        assert sum(e.size for e in entries.values()) == tier.stats().used_bytes == store.stats().frame_bytes
        for s, seq in enumerate(seqs):
            got, n = store.get_kv(spec, seq)
            assert torch.equal(got, kvs[s][:, :, :, :n])


class _GatedDeleteTier(MemoryTier):
    """A tier whose delete stalls until released: a slow backing, to pin down a race."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.entered, self.release = threading.Event(), threading.Event()

    def delete(self, key):
        self.entered.set()
        assert self.release.wait(10)
        return super().delete(key)


def test_put_during_a_slow_delete_of_the_same_block_is_not_lost(spec):
    """A put racing a delete of the same key must not end with an index entry whose frame the
    delete removed: the per-key claim orders them."""
    tier = _GatedDeleteTier(64 * MiB)
    with KVStore([tier]) as store:
        kv = make_kv(spec, 16)
        store.put_kv(spec, TOKENS[:16], kv)
        deleter = threading.Thread(target=store.delete, args=(spec, TOKENS[:16]))
        deleter.start()
        assert tier.entered.wait(10)
        writer = threading.Thread(target=store.put_kv, args=(spec, TOKENS[:16], kv))
        writer.start()
        writer.join(0.2)  # let it get as far as it can while the delete is stalled
        tier.release.set()
        deleter.join(10)
        writer.join(10)
        assert store.lookup(spec, TOKENS[:16]) == 16
        got, n = store.get_kv(spec, TOKENS[:16])
        assert n == 16 and torch.equal(got, kv)
        assert set(tier.keys()) == {e.key for e in store.entries()}


def test_settings_accept_sizes_and_normalise():
    s = Settings(tiers="memory", memory_bytes="2MiB", codec="int8")
    assert s.memory_bytes == 2 * MiB and s.codec == "int8"
    with pytest.raises(InvalidInput):
        Settings(tiers="memory", memory_bytes=0)
    with pytest.raises(InvalidInput):
        Settings(codec="gzip")


def test_delete_blocks_checks_keys(store):
    from kvstore.errors import InvalidKey

    with pytest.raises(InvalidKey):
        store.delete_blocks([b"short"])


class _MixUpTier(MemoryTier):
    """A faulty backing that serves another key's (sound) frame for one key."""

    swap: dict = {}

    def get(self, key):
        return super().get(self.swap.get(key, key))


def test_a_sound_frame_of_another_block_is_a_miss_not_wrong_kv(spec):
    tier = _MixUpTier(64 * MiB)
    with KVStore([tier]) as store:
        kv_a, kv_b = make_kv(spec, 48, seed=1), make_kv(spec, 48, seed=2)
        store.put_kv(spec, TOKENS[:48], kv_a)
        store.put_kv(spec, TOKENS[1:49], kv_b)
        tier.swap = {block_hashes(spec, TOKENS[:48])[1]: block_hashes(spec, TOKENS[1:49])[1]}
        got, n = store.get_kv(spec, TOKENS[:48])
        assert n == 16 and torch.equal(got, kv_a[:, :, :, :16])
        assert store.stats().counters.corrupt_blocks == 1


def test_kv_with_autograd_history(store, spec):
    kv = make_kv(spec, 32).float().requires_grad_()
    spec32 = spec.replace(dtype="float32")
    with EmbeddedStore(codec="int8", settings=Settings(tiers="memory", memory_bytes=16 * MiB)) as s:
        assert s.put_kv(spec32, TOKENS[:32], kv * 1) == 32
        got, n = s.get_kv(spec32, TOKENS[:32])
        assert n == 32 and not got.requires_grad


def test_delete_blocks_is_all_or_nothing(store, spec):
    store.put_kv(spec, TOKENS, make_kv(spec, 100))
    keys = block_hashes(spec, TOKENS)
    from kvstore.errors import InvalidKey

    with pytest.raises(InvalidKey):
        store.delete_blocks([keys[0], b"bad"])
    with pytest.raises(InvalidInput):
        store.delete_blocks(None)
    assert store.stats().blocks == 6


def test_close_empties_the_index(spec):
    store = EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=16 * MiB))
    store.put_kv(spec, TOKENS, make_kv(spec, 100))
    store.close()
    assert store.stats().blocks == 0 and store.stats().frame_bytes == 0


def test_full_top_tier_is_skipped_without_encoding(spec):
    """A full tier refuses before the frame is encoded into it."""
    calls = []

    class Counting(MemoryTier):
        def put(self, key, frame):
            calls.append(key)
            super().put(key, frame)

    top = MemoryTier(1, name="top")
    # admission off: each block is offered to the top tier first (admission would send it
    # straight to the next, a full top tier being past its high watermark)
    with KVStore([top, Counting(64 * MiB, name="next")], placement=PlacementConfig(admission=False)) as store:
        store.put_kv(spec, TOKENS, make_kv(spec, 100))
        assert top.stats().counters.errors == 6 and top.stats().entries == 0
        assert {e.tier for e in store.entries()} == {"next"}


def test_put_frame_stores_a_verified_frame_and_refuses_another_namespace(spec):
    from kvstore import codec as codec_mod
    from kvstore.errors import CorruptFrame
    from kvstore.keys import block_hashes
    from kvstore.keys import block_meta as _frame_meta

    kv = make_kv(spec, 16)
    key = block_hashes(spec, TOKENS[:16], "acme")[0]
    frame = codec_mod.encode(kv, "raw", meta=_frame_meta("acme", spec.fingerprint(), 0))
    with KVStore([MemoryTier(16 * MiB)], background=False) as store:
        with pytest.raises(InvalidInput, match="namespace"):
            store.frames.put(key, frame, namespace="other")
        with pytest.raises(CorruptFrame):
            store.frames.put(key, bytes(frame[:-1]), namespace="acme")
        entry = store.frames.put(key, frame, namespace="acme")
        assert entry.namespace == "acme" and store.frames.put(key, frame, namespace="acme") == entry
        got, n = store.get_kv(spec, TOKENS[:16], namespace="acme")
        assert n == 16 and torch.equal(got, kv)
        store.core.touch([key])
        store.core.count(get_calls=1, tokens_requested=16, tokens_hit=16)
        store.core.count(lookup_calls=1)
        counters = store.stats().counters
        assert counters.get_calls == 2 and counters.lookup_calls == 1 and store.entry(key).hits == 2
    assert store.core.closed


def test_get_kv_into_a_reused_buffer(spec):
    with KVStore([MemoryTier(64 * MiB)], background=False) as store:
        kv = make_kv(spec, 64, seed=5)
        store.put_kv(spec, TOKENS[:64], kv)
        buf = torch.full(spec.kv_shape(96), 7.0, dtype=spec.torch_dtype)
        got, n = store.get_kv(spec, TOKENS[:96], out=buf)
        assert n == 64 and got.data_ptr() == buf.data_ptr() and torch.equal(got, kv)
        assert torch.all(buf[:, :, :, 64:] == 7)  # past the hit, untouched
        with pytest.raises(InvalidKV, match="kv shape"):
            store.get_kv(spec, TOKENS[:96], out=torch.empty(spec.kv_shape(32), dtype=spec.torch_dtype))
        with pytest.raises(InvalidKV, match="grad"):
            store.get_kv(spec, TOKENS[:64], out=torch.zeros(spec.kv_shape(64), dtype=torch.float32,
                                                            requires_grad=True).to(spec.torch_dtype))
        assert store.stats().counters.corrupt_blocks == 0 and store.lookup(spec, TOKENS[:64]) == 64


def test_put_frame_with_writes_in_place_and_fails_cleanly(spec, tmp_path):
    """The lm:// listener's path: a frame the writer produces (from a socket) in the tier's memory."""
    from kvstore import codec as codec_mod
    from kvstore.keys import block_meta, named_key
    from tiers.shm import ShmTier

    meta = block_meta("ns", "ab" * 32, 0, extra={"x": 1})
    at = codec_mod.raw_payload_offset(1, len(meta))

    def writer_of(payload: bytes):
        def writer(view: memoryview) -> int:
            view[at:at + len(payload)] = payload
            return codec_mod.seal_raw(view, "uint8", (len(payload),), meta)
        return writer

    key = named_key("ns", "test", "a")
    with KVStore([ShmTier(1 * MiB), MemoryTier(4 * MiB)], background=False) as store:
        entry = store.frames.put_with(key, "ns", at + 4096, writer_of(b"q" * 4096))
        assert entry.tier == "shm" and entry.raw_bytes == 4096 and store.entry(key) == entry
        got = store.tiers[0].read_with(key, lambda v: bytes(codec_mod.decode(v).numpy()))
        assert got == b"q" * 4096
        # Too big for shm, and shm refuses before the writer runs: the next tier takes it.
        big = store.frames.put_with(named_key("ns", "test", "b"), "ns", at + 2 * MiB, writer_of(b"z" * 2 * MiB))
        assert big.tier == "memory"

        def failing(view: memoryview) -> int:  # a peer that goes away part-way
            view[at:at + 10] = b"partial..."
            raise ConnectionResetError("peer left")

        with pytest.raises(ConnectionResetError):
            store.frames.put_with(named_key("ns", "test", "c"), "ns", at + 4096, failing)
        assert store.entry(named_key("ns", "test", "c")) is None and len(store.entries()) == 2
        assert store.tiers[0].stats().used_bytes == entry.size  # the reservation was given back
        with pytest.raises(InvalidInput, match="namespace"):
            store.frames.put_with(named_key("other", "test", "d"), "other", at + 16, writer_of(b"w" * 16))
        assert store.entry(named_key("other", "test", "d")) is None
        with pytest.raises(TierFull):
            store.frames.put_with(named_key("ns", "test", "e"), "ns", at + 8 * MiB, writer_of(b"y"),
                                 make_room=False)


# -- the store's clock: tests age entries, heat and pins by advancing it, never by sleeping --------


def test_a_given_clock_stamps_entries_and_ages_heat_pins_and_moves(spec):
    clock = FakeClock(1_000.0)
    with KVStore([MemoryTier(64 * MiB, name="a"), MemoryTier(64 * MiB, name="b")], background=False,
                 clock=clock) as store:
        assert store.clock is clock and store.placement.clock is clock  # one clock for entries and heat
        keys = block_hashes(spec, TOKENS[:32])
        store.put_kv(spec, TOKENS[:32], make_kv(spec, 32))
        assert [(e.created_s, e.last_access_s) for e in store.core.entries_of(keys)] == [(1_000.0, 1_000.0)] * 2
        clock.advance(30)
        store.get_kv(spec, TOKENS[:16])  # reads the first block only
        first, second = store.core.entries_of(keys)
        assert (first.created_s, first.last_access_s, second.last_access_s) == (1_000.0, 1_030.0, 1_000.0)
        store.core.touch([keys[1]])  # a read that bypassed get_kv
        assert store.entry(keys[1]).last_access_s == 1_030.0
        info = store.explain(keys[0])
        assert info["created_s"] == 1_000.0 and info["last_access_age_s"] == 0.0
        hot = info["heat_per_s"]
        clock.advance(600)  # idle for ten short half-lives, two long ones: heat decays
        info = store.explain(keys[0])
        assert info["last_access_age_s"] == 600.0 and 0 < info["heat_per_s"] < hot / 3
        assert store.pin_keys(keys, ttl_s=5.0) == 2
        assert store.placement.is_pinned(keys[0]) and store.explain(keys[0])["pinned_for_s"] == 5.0
        clock.advance(5.5)  # the pin's ttl runs out
        assert not store.placement.is_pinned(keys[0]) and not store.explain(keys[0])["pinned"]
        assert store.migrate(keys[0], "b")
        clock.advance(7)
        assert store.moves()[-1]["age_s"] == 7.0


def test_a_given_clock_stamps_frames_put_and_blocks_recovered(spec, tmp_path):
    from kvstore import codec as codec_mod
    from kvstore.keys import block_meta
    from tiers.nvme import NVMeTier

    clock = FakeClock(50.0)
    key = block_hashes(spec, TOKENS[:16], "acme")[0]
    frame = codec_mod.encode(make_kv(spec, 16), "raw", meta=block_meta("acme", spec.fingerprint(), 0))
    with KVStore([NVMeTier(str(tmp_path), 64 * MiB)], background=False, clock=clock) as store:
        entry = store.frames.put(key, frame, namespace="acme")
        assert (entry.created_s, entry.last_access_s) == (50.0, 50.0)
        clock.advance(10)
        assert store.frames.read(key, None) is not None and store.entry(key).last_access_s == 60.0
    clock.advance(1_000)
    with KVStore([NVMeTier(str(tmp_path), 64 * MiB)], background=False, clock=clock) as again:
        assert again.recovered.entries == 1
        assert (again.entry(key).created_s, again.entry(key).last_access_s) == (1_060.0, 1_060.0)


def test_no_clock_keeps_wall_time_for_entries_and_monotonic_for_placement(spec):
    import time

    before = time.time()
    with KVStore([MemoryTier(16 * MiB)], background=False) as store:
        store.put_kv(spec, TOKENS[:16], make_kv(spec, 16))
        (entry,) = store.entries()
        assert before <= entry.created_s <= time.time() and store.clock is time.time
        assert store.placement.clock is time.monotonic
    clock = FakeClock()
    with EmbeddedStore(settings=Settings(tiers="memory", memory_bytes=16 * MiB), background=False,
                       clock=clock) as embedded:  # EmbeddedStore forwards it
        embedded.put_kv(spec, TOKENS[:16], make_kv(spec, 16))
        assert embedded.entries()[0].created_s == clock.now and embedded.placement.clock is clock
