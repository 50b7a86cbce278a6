"""Scale-out: two ``kvstore serve`` processes over one Redis (standalone, then a 3-master cluster).

A block put through server A is found by lookup and fetched bit-exact through
server B: Redis is the shared tier (written through on put, consulted on an
index miss), not a cluster kvstore builds itself.
"""

from __future__ import annotations

import pytest
import torch

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from tests.conftest import make_kv, make_spec
from tests.tiers.redis_servers import RedisClusterServers


def _pair(tmp_path, url: str):
    env = dict(KVSTORE_REDIS_URL=url, KVSTORE_TIER_CODECS="redis=raw", KVSTORE_REDIS_KEYSPACE="disagg")
    a = ServeProcess(small_env(tmp_path / "a", **env)).start()
    try:
        b = ServeProcess(small_env(tmp_path / "b", **env)).start()
    except BaseException:
        a.stop()
        raise
    return a, b


def _check_a_to_b(a: ServeProcess, b: ServeProcess) -> None:
    spec = make_spec(dtype="bfloat16")
    tokens = list(range(4000, 4050))
    kv = make_kv(spec, 50, seed=11)
    with KVClient(a.url, namespace="team", colocated=False) as ca:
        assert ca.put_kv(spec, tokens, kv) == 48
    with KVClient(b.url, namespace="team", colocated=False) as cb:
        answer = cb.lookup_blocks(spec, tokens)
        assert answer["tokens"] == 48, answer
        got, n = cb.get_kv(spec, tokens)
        assert n == 48
        assert torch.equal(got.view(torch.uint8), kv[:, :, :, :48].contiguous().view(torch.uint8))
    with KVClient(b.url, namespace="team") as local:  # B's co-located client gets the same bytes
        got, n = local.get_kv(spec, tokens)
        assert n == 48 and torch.equal(got.view(torch.uint8), kv[:, :, :, :48].contiguous().view(torch.uint8))
    with KVClient(b.url, namespace="other", colocated=False) as stranger:
        assert stranger.lookup(spec, tokens) == 0  # the namespace is in the key, in Redis too


def test_two_servers_share_one_redis(tmp_path, redis_server):
    a, b = _pair(tmp_path, redis_server.url)
    try:
        _check_a_to_b(a, b)
    finally:
        a.stop()
        b.stop()


@pytest.fixture
def redis_cluster():
    cluster = RedisClusterServers(3).start()
    yield cluster
    cluster.stop()


def test_two_servers_share_a_redis_cluster(tmp_path, redis_cluster):
    a, b = _pair(tmp_path, redis_cluster.url)
    try:
        _check_a_to_b(a, b)
    finally:
        a.stop()
        b.stop()


def test_lmcache_chunks_put_through_one_server_are_found_through_another(tmp_path, redis_server):
    """LMCache workers on two nodes, each talking to its own kvstore's lm:// listener."""
    from tests.server import lmwire as lm
    from bench.serving import free_port

    env = dict(KVSTORE_REDIS_URL=redis_server.url, KVSTORE_REDIS_KEYSPACE="disagg-lm")
    ports = free_port(), free_port()
    a = ServeProcess(small_env(tmp_path / "a", **env), "--lmcache-port", str(ports[0])).start()
    try:
        b = ServeProcess(small_env(tmp_path / "b", **env), "--lmcache-port", str(ports[1])).start()
        try:
            data = bytes(range(256)) * 4096  # 1 MiB; the Redis tier's int8 default never touches it
            to_a, to_b = lm.connect(ports[0]), lm.connect(ports[1])
            lm.put(to_a, "m@1@0@abc@bfloat16", data, lm.KV_2LTD, lm.BF16, (2, 1, 256, 1024))
            assert lm.exists(to_a, "m@1@0@abc@bfloat16")
            assert lm.exists(to_b, "m@1@0@abc@bfloat16")
            head, got = lm.get(to_b, "m@1@0@abc@bfloat16")
            assert got == data and head[2:8] == (lm.KV_2LTD, lm.BF16, 2, 1, 256, 1024)
            assert not lm.exists(to_b, "m@1@0@abd@bfloat16")
            to_a.close()
            to_b.close()
        finally:
            b.stop()
    finally:
        a.stop()
