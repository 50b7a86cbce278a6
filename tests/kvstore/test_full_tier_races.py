"""Puts racing each other and the mover into a full tier: each makes room of its own.

A put makes room before it writes (``PlacementManager.hold_room``). Before holds, two
puts that found the same free bytes, or picked the same coldest entry as the other or
as the background mover, left one of them with no room: ``TierFull`` from a cache
that only had to evict. These run real shm arenas with the background mover on,
several writers at once, and many times the tier's capacity.
"""

import threading

import pytest
import torch

from kvstore import KVStore
from kvstore.errors import TierFull
from kvstore.engine.placement import PlacementConfig
from tests.conftest import make_spec, wait_until
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

MiB = 1 << 20
SPEC = make_spec(num_layers=4, num_kv_heads=2, head_dim=64)  # 32 KiB blocks of 16 tokens
WRITERS, ROUNDS = 8, 120  # 8 x 120 x 4 blocks = 3,840 blocks, 120 MiB into 8 MiB


def _kv(n_tokens: int, seed: int) -> torch.Tensor:
    return torch.full(SPEC.kv_shape(n_tokens), float(seed % 1000), dtype=SPEC.torch_dtype)


def _storm(store: KVStore, writers: int = WRITERS, rounds: int = ROUNDS) -> list[str]:
    errors: list[str] = []

    def write(w: int) -> None:
        for i in range(rounds):
            tokens = list(range(w * 10_000_000 + 64 * i, w * 10_000_000 + 64 * (i + 1)))
            try:
                assert store.put_kv(SPEC, tokens, _kv(64, w * rounds + i), "race") == 64
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(f"writer {w} round {i}: {exc!r}")

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def test_writers_into_a_full_shm_tier_never_see_tier_full():
    shm = ShmTier(8 * MiB)
    with KVStore([shm], placement=PlacementConfig(interval_s=0.01)) as store:
        errors = _storm(store)
        assert errors == []
        counters = store.stats().counters
        assert counters.blocks_written == WRITERS * ROUNDS * 4
        assert counters.blocks_evicted > 0
        assert counters.room_forced == 0  # the holds' accounting was enough: no write was refused
        # The accounting placement decides by is the arena's own, once the writers are done and
        # the mover's last watermark round (it may still be evicting) has settled.
        wait_until(lambda: store.placement.usage()["shm"] == shm.stats().used_bytes <= shm.capacity_bytes
                   and store.stats().blocks == shm.stats().entries,
                   what="placement's accounting agreeing with the arena")
        # What survived the churn reads back right: a prefix of each put, never another's KV.
        found = 0
        for w in range(WRITERS):
            for i in range(ROUNDS):
                tokens = list(range(w * 10_000_000 + 64 * i, w * 10_000_000 + 64 * (i + 1)))
                kv, n = store.get_kv(SPEC, tokens, "race")
                assert n % 16 == 0 and kv.equal(_kv(64, w * ROUNDS + i)[:, :, :, :n])
                found += n
        assert 0 < found <= shm.capacity_bytes // (32 << 10) * 16


def test_writers_and_demotions_into_a_full_lower_tier_never_see_tier_full():
    # New blocks that do not beat the top's coldest start one tier down (admission), and the
    # mover demotes into that same full tier: puts and moves both make room there.
    top, low = ShmTier(4 * MiB), ShmTier(4 * MiB, name="low")
    with KVStore([top, low], placement=PlacementConfig(interval_s=0.01, min_residency_s=0)) as store:
        assert _storm(store) == []

        def agree() -> bool:
            # The mover's last watermark round can still be evicting from the full lower tier
            # when the writers finish (a CI run under load caught placement's count read before
            # it and the arena's after: 13 blocks apart): compare once it has settled. A leak in
            # placement's accounting never settles, and fails here.
            usage = store.placement.usage()
            return (usage["shm"] == top.stats().used_bytes and usage["low"] == low.stats().used_bytes
                    and store.stats().blocks == top.stats().entries + low.stats().entries)

        wait_until(lambda: agree() and agree(), what="placement's accounting agreeing with the arenas")


class RefusesOnce(MemoryTier):
    """Injects the one fault accounting cannot see: the tier refuses a write its accounting
    admits (as an arena does while a reader still holds a range it freed)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, name="mem")
        self.refuse = False

    def put_with(self, key, size, writer):
        if self.refuse:
            self.refuse = False
            raise TierFull("a reader still holds the range", tier=self.name)
        return super().put_with(key, size, writer)

    def put(self, key, frame):
        if self.refuse:
            self.refuse = False
            raise TierFull("a reader still holds the range", tier=self.name)
        super().put(key, frame)


def test_a_write_refused_despite_room_is_tried_again_with_room_forced():
    tier = RefusesOnce(4 * MiB)
    with KVStore([tier], background=False) as store:
        for i in range(4):
            store.put_kv(SPEC, list(range(16 * i, 16 * (i + 1))), _kv(16, i), "race")
        before = store.stats().counters.blocks_evicted
        tier.refuse = True
        assert store.put_kv(SPEC, list(range(1000, 1016)), _kv(16, 9), "race") == 16
        assert not tier.refuse  # the fault fired
        # Room was forced although the tier was not full by its accounting: a frame's worth went
        # (two blocks: a put's size estimate is a little over a frame, with room for metadata).
        assert before < store.stats().counters.blocks_evicted <= before + 2
        assert store.stats().counters.room_forced == 1
        assert store.get_kv(SPEC, list(range(1000, 1016)), "race")[1] == 16


def test_a_tier_full_of_pinned_blocks_still_says_so():
    tier = ShmTier(1 * MiB)
    with KVStore([tier], background=False) as store:
        stored = []
        for i in range(64):
            tokens = list(range(16 * i, 16 * (i + 1)))
            try:
                store.put_kv(SPEC, tokens, _kv(16, i), "race")
            except TierFull:
                break
            stored.append(tokens)
            assert store.pin(SPEC, tokens, "race")
        with pytest.raises(TierFull, match="no tier has room"):
            store.put_kv(SPEC, list(range(5000, 5016)), _kv(16, 1), "race")
        assert all(store.get_kv(SPEC, t, "race")[1] == 16 for t in stored)
