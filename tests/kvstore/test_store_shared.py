"""Two stores over one Redis: adoption, write policies, shared copies."""

import pytest
import torch

from kvstore import KVStore
from kvstore.keys import block_hashes
from kvstore.engine.placement import PlacementConfig
from tests.conftest import make_kv, make_spec
from tests.tiers.redis_servers import RedisServer
from tiers.memory import MemoryTier
from tiers.redis import RedisTier

MiB = 1 << 20
SPEC = make_spec(num_layers=4, head_dim=32)
TOKENS = list(range(16 * 6))


@pytest.fixture(scope="module")
def redis_url():
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture
def pair(redis_url, request):
    keyspace = request.node.name.replace("[", "-").replace("]", "")
    made = []

    def make(policy="write_through"):
        store = KVStore([MemoryTier(16 * MiB, name="hot"), RedisTier(redis_url, 64 * MiB, keyspace=keyspace)],
                        write_policy=policy, placement=PlacementConfig(min_residency_s=0.0), background=False)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def close_enough(got, ref) -> bool:
    return float((got.float() - ref.float()).norm() / ref.float().norm()) < 0.01


def test_write_through_lets_another_node_find_and_fetch(pair):
    a, b = pair(), pair()
    kv = make_kv(SPEC, len(TOKENS), seed=1)
    a.put_kv(SPEC, TOKENS, kv)
    assert a.stats().shared["bytes_written"] > 0
    assert b.lookup(SPEC, TOKENS) == len(TOKENS)
    got, n = b.get_kv(SPEC, TOKENS)
    assert n == len(TOKENS) and close_enough(got, kv)  # the shared copy is int8 (a cold tier)
    assert b.stats().counters.blocks_adopted == 6
    assert {e.tier for e in b.entries()} == {"redis"}
    got_a, _ = a.get_kv(SPEC, TOKENS)
    assert torch.equal(got_a, kv)  # the writer still serves its own raw copy


def test_write_back_shares_only_what_is_demoted(pair):
    a, b = pair("write_back"), pair()
    a.put_kv(SPEC, TOKENS, make_kv(SPEC, len(TOKENS), seed=2))
    assert b.lookup(SPEC, TOKENS) == 0 and a.stats().shared["bytes_written"] == 0
    for key in block_hashes(SPEC, TOKENS)[:3]:
        assert a.migrate(key, "redis")
    assert b.lookup(SPEC, TOKENS) == 48


def test_selective_shares_after_enough_reads(pair):
    a, b = pair("selective"), pair()
    a.put_kv(SPEC, TOKENS, make_kv(SPEC, len(TOKENS), seed=3))
    a.get_kv(SPEC, TOKENS)
    assert b.lookup(SPEC, TOKENS) == 0
    a.get_kv(SPEC, TOKENS)  # second read: selective_hits=2 reached
    assert b.lookup(SPEC, TOKENS) == len(TOKENS)


def test_delete_removes_the_shared_copy_and_promotion_keeps_it(pair):
    a, b = pair(), pair()
    kv = make_kv(SPEC, len(TOKENS), seed=4)
    a.put_kv(SPEC, TOKENS, kv)
    for _ in range(3):
        b.get_kv(SPEC, TOKENS)
    b.run_placement()  # hot in b: copied up into b's memory, the shared copy stays
    assert {e.tier for e in b.entries()} == {"hot"}
    c = pair()
    assert c.lookup(SPEC, TOKENS) == len(TOKENS)
    assert a.delete(SPEC, TOKENS) == 6
    assert c.lookup(SPEC, TOKENS) == 0
