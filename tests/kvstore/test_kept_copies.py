"""A block promoted out of a durable tier stays durable (``IndexEntry.kept``, ``kvstore.engine.mover``).

A real store over a volatile top tier (``MemoryTier``) and a durable one (``NVMeTier`` on real
files): a block acknowledged durable, then read until placement promotes it, is still counted
durable and still comes back after the store is closed and opened again over the same files
(the top tier's copy is gone then, as a restart or a crash leaves it). A delete after the
promotion takes the durable copy too (nothing comes back), a demotion back switches to the copy
without writing the frame again, placement counts the copy's bytes where they lie, and a promoted
frame found gone or damaged falls back to its durable copy.
"""

from __future__ import annotations

import torch

from kvstore import KVStore
from kvstore.engine.placement import PlacementConfig
from kvstore.keys import block_hashes
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.nvme import NVMeTier

MiB = 1 << 20
SPEC = make_spec(num_layers=8, head_dim=64)  # 64 KiB blocks
TOKENS = list(range(5_000, 5_000 + 16 * 4))  # four blocks
QUICK = PlacementConfig(min_residency_s=0.0)


def open_store(path) -> KVStore:
    """The volatile top tier fresh, the durable one over ``path`` (raw: any difference is damage)."""
    return KVStore([MemoryTier(4 * MiB, name="hot"), NVMeTier(path, 64 * MiB, sync_interval_s=0)],
                   tier_codecs={"nvme": "raw"}, placement=QUICK, background=False)


def put_durable_then_promote(store: KVStore, kv: torch.Tensor) -> None:
    """Store ``kv`` on nvme alone (durable), then read it until placement promotes it."""
    store.put_kv(SPEC, TOKENS, kv)
    for key in block_hashes(SPEC, TOKENS):
        if store.entry(key).tier == "hot":
            assert store.migrate(key, "nvme")
    assert store.durable_tokens(SPEC, TOKENS) == len(TOKENS)
    for _ in range(5):
        store.get_kv(SPEC, TOKENS)
    store.run_placement()
    assert {store.entry(k).tier for k in block_hashes(SPEC, TOKENS)} == {"hot"}  # promoted


def test_a_promoted_durable_block_stays_durable_and_survives_a_restart(tmp_path):
    kv = make_kv(SPEC, len(TOKENS), seed=1)
    with open_store(tmp_path) as store:
        put_durable_then_promote(store, kv)
        assert store.durable_tokens(SPEC, TOKENS) == len(TOKENS)  # still vouched for
        assert all(store.entry(k).kept.tier == "nvme" for k in block_hashes(SPEC, TOKENS))
        got, n = store.get_kv(SPEC, TOKENS)
        assert n == len(TOKENS) and torch.equal(got, kv)
    with open_store(tmp_path) as store:  # the hot tier's copies are gone; the durable ones are read
        got, n = store.get_kv(SPEC, TOKENS)
        assert n == len(TOKENS) and torch.equal(got, kv)


def test_a_delete_after_the_promotion_takes_the_durable_copy_too(tmp_path):
    with open_store(tmp_path) as store:
        put_durable_then_promote(store, make_kv(SPEC, len(TOKENS), seed=2))
        assert store.delete(SPEC, TOKENS) == 4
        assert store.placement.usage()["nvme"] == 0  # the copies' bytes are no longer counted
    with open_store(tmp_path) as store:
        assert store.lookup(SPEC, TOKENS) == 0  # nothing comes back at the next start


def test_a_demotion_back_switches_to_the_kept_copy_without_writing(tmp_path):
    kv = make_kv(SPEC, len(TOKENS), seed=3)
    with open_store(tmp_path) as store:
        put_durable_then_promote(store, kv)
        keys = block_hashes(SPEC, TOKENS)
        nvme = store.tiers[1]
        kept = {k: store.entry(k).kept for k in keys}
        usage = store.placement.usage()
        assert usage["nvme"] == sum(c.size for c in kept.values())  # the copies count where they lie
        before = nvme.stats().counters
        for k in keys:
            assert store.migrate(k, "nvme")
        after = nvme.stats().counters
        assert (after.puts, after.deletes) == (before.puts, before.deletes)  # no frame written or deleted
        for k in keys:
            entry = store.entry(k)
            assert entry.tier == "nvme" and entry.kept is None
            assert (entry.size, entry.checksum) == (kept[k].size, kept[k].checksum)
        assert store.placement.usage() == {"hot": 0, "nvme": usage["nvme"]}  # charged once, as the entry's
        got, n = store.get_kv(SPEC, TOKENS)
        assert n == len(TOKENS) and torch.equal(got, kv)


def test_a_promoted_block_whose_frame_is_lost_or_damaged_falls_back_to_its_durable_copy(tmp_path):
    kv = make_kv(SPEC, len(TOKENS), seed=4)
    with open_store(tmp_path) as store:
        put_durable_then_promote(store, kv)
        keys, hot = block_hashes(SPEC, TOKENS), store.tiers[0]
        hot.delete(keys[1])  # gone from the top tier under the index
        damaged = bytearray(hot.get(keys[2]))
        damaged[-1] ^= 0xFF  # a payload byte: the body checksum fails
        hot.put(keys[2], bytes(damaged))
        first, n = store.get_kv(SPEC, TOKENS)
        assert torch.equal(first, kv[:, :, :, :n])  # a bit-exact prefix while it finds the damage
        got, n = store.get_kv(SPEC, TOKENS)
        assert n == len(TOKENS) and torch.equal(got, kv)  # served from the durable copies
        assert [store.entry(k).tier for k in keys] == ["hot", "nvme", "nvme", "hot"]
        assert store.durable_tokens(SPEC, TOKENS) == len(TOKENS)
        counters = store.stats().counters
        assert (counters.stale_blocks, counters.corrupt_blocks) == (1, 1)
        sizes = {k: store.entry(k).size for k in keys}
        assert store.placement.usage() == {"hot": sizes[keys[0]] + sizes[keys[3]], "nvme": sum(sizes.values())}
