"""``get_kv`` decodes straight out of an shm slot and hashes it once per publish ("Verified once").

The damage here is the fault injected: a payload byte flipped in the arena. Before a frame's
first read it is caught (a miss, never wrong KV); after the first read it is not (the rule's
stated cost, in docs/design.md); a frame written again under a new publication is checked anew;
a tier that lends copies checks every read.
"""

from __future__ import annotations

import torch

from kvstore.keys import block_hashes
from kvstore.engine.store import KVStore
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

NS = "v1"


def _flip(store: KVStore, spec, tokens, depth: int) -> None:
    """Fault: the last payload byte of block ``depth``'s frame flips in the shm arena."""
    shm = store.tiers[0]
    h = shm.handle(block_hashes(spec, tokens, NS)[depth])
    shm._view[h.offset + h.length - 1] ^= 0xFF  # noqa: SLF001 - the fault: memory changed under the tier


def test_damage_before_the_first_read_is_a_miss():
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    with KVStore([ShmTier(8 << 20)], background=False) as store:
        store.put_kv(spec, tokens, kv, NS)
        _flip(store, spec, tokens, 2)
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 32 and torch.equal(got, kv[:, :, :, :32])
        assert store.stats().counters.corrupt_blocks == 1


def test_a_frame_read_once_is_not_hashed_again_until_it_is_published_again():
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    with KVStore([ShmTier(8 << 20)], background=False) as store:
        store.put_kv(spec, tokens, kv, NS)
        assert store.get_kv(spec, tokens, NS)[1] == 64  # verifies and vouches
        _flip(store, spec, tokens, 1)
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 64 and not torch.equal(got, kv)  # what the rule gives up, stated in docs/design.md
        assert store.stats().counters.corrupt_blocks == 0
        store.delete(spec, tokens, NS)  # written again: a new publication, hashed on its next read
        store.put_kv(spec, tokens, kv, NS)
        _flip(store, spec, tokens, 1)
        got, n = store.get_kv(spec, tokens, NS)
        assert n == 16 and torch.equal(got, kv[:, :, :, :16])
        assert store.stats().counters.corrupt_blocks == 1


def test_reads_of_a_tier_that_lends_copies_are_all_checked():
    spec = make_spec()
    tokens, kv = list(range(32)), make_kv(spec, 32)
    with KVStore([MemoryTier(8 << 20)], background=False) as store:
        assert not store.tiers[0].lends_frames
        store.put_kv(spec, tokens, kv, NS)
        for _ in range(2):
            got, n = store.get_kv(spec, tokens, NS)
            assert n == 32 and torch.equal(got, kv)
