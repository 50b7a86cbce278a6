"""Moves racing puts, deletes and other moves of the same key: each op lands whole.

A tier hook starts the racing operation in another thread at the moment the
mover touches a tier; the operation then waits for the key's claim and must
find the move either not started or complete.
"""

import threading

import torch

from kvstore import KVStore
from kvstore.keys import block_hashes
from kvstore.engine.placement import PlacementConfig
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier

MiB = 1 << 20
SPEC = make_spec()
TOKENS = list(range(16))


class HookTier(MemoryTier):
    """A memory tier that starts ``on_put``/``on_delete`` in a thread, once."""

    def __init__(self, capacity, name, *, shared_writers=False):
        super().__init__(capacity, name=name)
        self.shared_writers = shared_writers
        self.on_put = self.on_delete = None
        self.threads = []

    def _fire(self, which):
        hook = getattr(self, which)
        if hook is not None:
            setattr(self, which, None)
            t = threading.Thread(target=hook)
            t.start()
            self.threads.append(t)

    def put(self, key, frame):
        self._fire("on_put")
        super().put(key, frame)

    def delete(self, key):
        self._fire("on_delete")
        return super().delete(key)

    def join(self):
        for t in self.threads:
            t.join(10)


def store(tiers, policy="write_back"):
    return KVStore(tiers, write_policy=policy, placement=PlacementConfig(min_residency_s=0.0), background=False,
                   tier_codecs={t.name: "raw" for t in tiers})


def test_a_delete_racing_a_demotion_into_the_shared_tier_stays_deleted():
    hot, shared = HookTier(16 * MiB, "hot"), HookTier(64 * MiB, "redis", shared_writers=True)
    a = store([hot, shared])
    a.put_kv(SPEC, TOKENS, make_kv(SPEC, 16))
    key = block_hashes(SPEC, TOKENS)[0]
    deleted = []
    shared.on_put = lambda: deleted.append(a.delete(SPEC, TOKENS))
    a.migrate(key, "redis")
    shared.join()
    assert deleted == [1] and a.entry(key) is None
    assert not shared.contains(key) and a._shared.replica(key) is None  # gone for every node
    b = store([MemoryTier(16 * MiB, name="hot"), shared])
    assert b.lookup(SPEC, TOKENS) == 0


def test_a_move_back_racing_the_source_delete_loses_nothing():
    hot, cold = HookTier(16 * MiB, "hot"), HookTier(64 * MiB, "cold")
    s = store([hot, cold])
    kv = make_kv(SPEC, 16, seed=3)
    s.put_kv(SPEC, TOKENS, kv)
    key = block_hashes(SPEC, TOKENS)[0]
    hot.on_delete = lambda: s.migrate(key, "hot")
    s.migrate(key, "cold")
    hot.join()
    entry = s.entry(key)
    assert next(t for t in s.tiers if t.name == entry.tier).contains(key)
    got, n = s.get_kv(SPEC, TOKENS)
    assert n == 16 and torch.equal(got, kv)
    assert s.placement.tier_of(key) == entry.tier


def test_a_put_frame_racing_a_move_keeps_the_new_frame():
    from kvstore import codec as codec_mod
    from kvstore.keys import block_meta

    hot, cold = HookTier(16 * MiB, "hot"), HookTier(64 * MiB, "cold")
    s = store([hot, cold])
    s.put_kv(SPEC, TOKENS, make_kv(SPEC, 16, seed=1))
    key = block_hashes(SPEC, TOKENS)[0]
    newer = make_kv(SPEC, 16, seed=9)
    frame = codec_mod.encode(newer, "raw", meta=block_meta("default", SPEC.fingerprint(), 0))
    cold.on_put = lambda: s.frames.put(key, frame, "default")
    s.migrate(key, "cold")
    cold.join()
    got, n = s.get_kv(SPEC, TOKENS)
    assert n == 16 and s.stats().counters.corrupt_blocks == 0
    assert torch.equal(got, newer) or torch.equal(got, make_kv(SPEC, 16, seed=1))
    assert s.placement.tier_of(key) == s.entry(key).tier
