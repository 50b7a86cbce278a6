"""An idle store shrinks (``kvstore.engine.trim``): when it trims, and that a trim reaches the arenas."""

from __future__ import annotations

import time

import torch

from kvstore.engine.store import KVStore
from kvstore.engine.trim import Trimmer
from kvstore.spec import KVSpec
from tiers.cxl import HUGE_PAGE, CXLTier
from tiers.memory import MemoryTier

MiB = 1 << 20
SPEC = KVSpec("trim", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16, fingerprint="t-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_quiet_spell_is_trimmed_once_then_again_after_a_put_or_a_long_quiet():
    with KVStore([MemoryTier(MiB, name="mem")], background=False) as store:
        clock = Clock()
        trimmer = Trimmer(store.core, idle_s=10.0, retrim_s=60.0, clock=clock)
        store.core.last_put_s = 995.0
        assert trimmer._due_in() == 5.0  # 10 s after the last put
        clock.now = 1005.0
        assert trimmer._due_in() == 0.0
        trimmer.trim()
        assert trimmer.trims == 1 and trimmer._due_in() == 60.0  # this spell is trimmed: retrim_s later
        store.core.last_put_s = clock.now = 1020.0  # a put: the next spell begins 10 s after it
        assert trimmer._due_in() == 10.0
        clock.now = 1030.0
        assert trimmer._due_in() == 0.0


def test_an_idle_store_hands_its_cxl_arenas_free_pages_back():
    """A store whose puts went into a THP cxl arena, then deleted: the thread trims once the store
    is quiet, and the arena's pages of the deleted frames leave this process."""
    tier = CXLTier(64 * MiB, hugepages=False)
    with KVStore([tier], background=False) as store:
        kv = torch.randn(SPEC.kv_shape(8192)).half()  # 512 blocks of 32 KiB: 16 MiB
        tokens = list(range(8192))
        assert store.put_kv(SPEC, tokens, kv) == len(tokens)
        tier._facts_at = -float("inf")  # the page facts are cached for FACTS_TTL_S: read them now
        assert int(tier.stats().details["resident_bytes"]) >= 16 * MiB
        store.delete(SPEC, tokens)
        trimmer = Trimmer(store.core, idle_s=0.2)
        trimmer.start()
        try:
            deadline = time.monotonic() + 10
            while trimmer.trims == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            trimmer.close()
        assert trimmer.trims >= 1 and trimmer.released_bytes >= 16 * MiB
        tier._facts_at = -float("inf")
        assert int(tier.stats().details["resident_bytes"]) <= HUGE_PAGE
        assert store.put_kv(SPEC, tokens, kv) == len(tokens)  # the arena takes frames again
        got, n = store.get_kv(SPEC, tokens)
        assert n == len(tokens) and torch.equal(got, kv)
