"""The Redis tier against real redis-server processes: one standalone server and a
3-master Redis Cluster, both started once for this module (see ``redis_servers``)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

import tiers.redis as redis_tier
from kvstore.errors import InvalidInput, StoreClosed, TierFull, TierIOError, TierUnavailable
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tests.tiers.redis_servers import RedisClusterServers, RedisServer
from tiers.redis import RedisTier
from tiers.redis_lua import Script

_servers: dict[str, RedisServer | RedisClusterServers] = {}
_made: list[RedisTier] = []


def _server(mode: str) -> RedisServer | RedisClusterServers:
    """The module's standalone server or cluster, started on first use."""
    if mode not in _servers:
        _servers[mode] = RedisServer().start() if mode == "standalone" else RedisClusterServers().start()
    return _servers[mode]


@pytest.fixture(scope="module", autouse=True)
def _stop_servers():
    yield
    while _servers:
        _servers.popitem()[1].stop()


@pytest.fixture(autouse=True)
def _close_tiers():
    yield
    while _made:
        _made.pop().close()


def _tier(mode: str, capacity_bytes: int = 64 * MiB, **kwargs) -> RedisTier:
    """A tier on a keyspace of its own (so tests never see each other's frames), closed after the test."""
    kwargs.setdefault("keyspace", f"t{uuid.uuid4().hex[:12]}")
    _made.append(RedisTier(_server(mode).url, capacity_bytes, **kwargs))
    return _made[-1]


def _nodes(mode: str) -> list[RedisServer]:
    server = _server(mode)
    return server.nodes if isinstance(server, RedisClusterServers) else [server]


def _redis_keys(mode: str, pattern: str) -> list[bytes]:
    """Every key matching ``pattern``, asked of each node directly."""
    return [name for node in _nodes(mode) for name in _keys_on(node, pattern)]


def _keys_on(node: RedisServer, pattern: str) -> list[bytes]:
    with node.client() as client:
        return client.keys(pattern)


def _pttls(mode: str, pattern: str) -> list[int]:
    """Milliseconds to live of each key matching ``pattern``."""
    ttls = []
    for node in _nodes(mode):
        with node.client() as client:
            ttls += [client.pttl(name) for name in client.keys(pattern)]
    return ttls


@pytest.fixture(params=["standalone", "cluster"])
def mode(request) -> str:
    return request.param


class _RedisContract(TierContract):
    mode: str

    @pytest.fixture
    def make_tier(self):
        yield lambda capacity_bytes: _tier(self.mode, capacity_bytes)
        _server(self.mode).flushall()  # the conformance tests' 16 MiB frames add up

    def test_put_with_refuses_a_full_tier_before_writing(self, make_tier):
        """The one exception to the contract: a shared keyspace's capacity is known only at the
        write (Redis reserves it atomically there), so a frame that does not fit is refused after
        ``writer`` ran, and nothing is stored."""
        tier = make_tier(capacity_bytes=1 * MiB)
        tier.put(key(1), payload(600 * 1024, 1))

        def writer(view: memoryview) -> int:
            view[:] = payload(600 * 1024, 2)
            return len(view)

        with pytest.raises(TierFull):
            tier.put_with(key(2), 600 * 1024, writer)
        assert tier.get(key(2)) is None and tier.stats().used_bytes == 600 * 1024


class TestRedisStandalone(_RedisContract):
    mode = "standalone"


class TestRedisCluster(_RedisContract):
    mode = "cluster"


# Small chunks, so that the machines' frames (up to 24 KiB) span several of them.
TestRedisStandaloneStateMachine = tier_state_machine(
    lambda cap: _tier("standalone", cap, chunk_bytes=4096)).TestCase
TestRedisClusterStateMachine = tier_state_machine(
    lambda cap: _tier("cluster", cap, chunk_bytes=4096)).TestCase


# -- construction and stats -----------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(capacity_bytes=0), dict(capacity_bytes=1.5), dict(capacity_bytes=True),
    dict(chunk_bytes=0), dict(keyspace="a:b"), dict(keyspace="{x}"), dict(keyspace=""),
    dict(url="http://127.0.0.1:1"), dict(url="127.0.0.1:6379"),
])
def test_bad_arguments_are_invalid_input(kwargs):
    args = dict(url="redis://127.0.0.1:1/0", capacity_bytes=MiB) | kwargs
    with pytest.raises(InvalidInput):
        RedisTier(args.pop("url"), args.pop("capacity_bytes"), **args)


def test_stats_details(mode):
    tier = _tier(mode, chunk_bytes=4096)
    details = tier.stats().details
    assert details["mode"] == mode and details["connected"] == "yes"
    assert details["chunk_bytes"] == "4096"
    assert details["url"].startswith("redis+cluster://" if mode == "cluster" else "redis://")
    assert tier.stats().kind == "redis" and tier.shared is True and tier.durable is False
    tier.close()
    with pytest.raises(StoreClosed):
        tier.stats()


def test_url_password_is_never_shown():
    port = _server("standalone").port
    tier = RedisTier(f"redis://user:s3cret@127.0.0.1:{port}/0?password=s3cret", MiB)
    _made.append(tier)
    stats = tier.stats()  # this server has no such user: not connected
    assert stats.details["connected"] == "no"
    assert "s3cret" not in repr(stats.to_dict())
    assert stats.details["url"].startswith("redis://user:***@127.0.0.1:")


def test_durable_when_the_server_appends_to_an_aof():
    server = RedisServer("--appendonly", "yes").start()
    try:
        tier = RedisTier(server.url, MiB)
        assert tier.durable is True and tier.stats().details["persistence"] == "aof on every master"
        tier.close()
    finally:
        server.stop()


def test_unix_socket_url():
    server = RedisServer("--unixsocket", "redis.sock", "--unixsocketperm", "700").start()
    try:
        with RedisTier(f"unix://{server.dir / 'redis.sock'}", MiB) as tier:
            tier.put(key(1), payload(100_000))
            assert tier.get(key(1)) == payload(100_000)
    finally:
        server.stop()


# -- frames ------------------------------------------------------------------------


def test_chunked_frames_round_trip_and_leave_no_stale_chunks(mode):
    tier = _tier(mode, chunk_bytes=4096)
    pattern = f"kv:{tier.keyspace}:*"
    for size in [5 * 4096 + 3, 0, 1, 4095, 4096, 4097, 3 * 4096, 2 * 4096 + 1]:
        data = payload(size, size)
        tier.put(key(1), data)
        assert tier.get(key(1)) == data
        # the manifest plus this frame's chunks (1-2x chunk_bytes each): nothing staged or left over
        assert len(_redis_keys(mode, pattern)) == 1 + (max(1, size // 4096) if size else 0)
    assert tier.stats().used_bytes == 2 * 4096 + 1
    assert tier.delete(key(1)) and _redis_keys(mode, pattern) == []


def test_batches(mode):
    tier = _tier(mode, capacity_bytes=3 * 4096, chunk_bytes=1024)
    items = [(key(i), payload(4096, i)) for i in range(4)]
    with pytest.raises(TierFull):
        tier.put_many(items)  # the fourth does not fit: stored in order up to it
    assert tier.get_many([k for k, _ in items]) == [d for _, d in items[:3]] + [None]
    assert tier.stats().used_bytes == 3 * 4096
    assert _redis_keys(mode, f"kv:{tier.keyspace}:*:s:*") == []
    assert tier.delete_many([key(0), key(0), key(3)]) == 1
    assert tier.contains_many([key(0), key(1)]) == [False, True]


def test_frames_spread_over_the_cluster_masters():
    tier = _tier("cluster", chunk_bytes=1024)
    tier.put_many([(key(i), payload(3000, i)) for i in range(30)])
    per_node = [len(_keys_on(node, f"kv:{tier.keyspace}:*")) for node in _nodes("cluster")]
    assert all(n > 0 for n in per_node) and sum(per_node) == 30 * 3  # manifest + 2 chunks
    assert sorted(tier.keys()) == sorted(key(i) for i in range(30))


def test_put_with_reuses_its_buffer_and_get_into_lands_chunks(mode):
    tier = _tier(mode, chunk_bytes=1024)

    def fill(byte: bytes, n: int):
        def writer(view: memoryview) -> int:
            view[:n] = byte * n
            return n
        return writer

    assert tier.put_with(key(1), 10_000, fill(b"a", 9_000)) == 9_000
    assert tier.put_with(key(2), 200, fill(b"b", 100)) == 100  # the same buffer, smaller
    assert tier.get(key(1)) == b"a" * 9_000 and tier.get(key(2)) == b"b" * 100
    out = bytearray(b"z" * 10_000)
    assert tier.get_into(key(1), out) == 9_000 and out == b"a" * 9_000 + b"z" * 1_000
    assert tier.get_into(key(2), memoryview(out)[5:]) == 100 and out[5:105] == b"b" * 100
    assert tier.stats().used_bytes == 9_100


def test_cluster_reads_and_writes_follow_a_moved_slot():
    tier = _tier("cluster", chunk_bytes=1024)
    tier.put(key(1), payload(3000, 1))
    assert tier.get(key(1)) == payload(3000, 1)  # the client now caches the slot map
    mkey = f"kv:{tier.keyspace}:{{{key(1).hex()}}}"
    nodes = _nodes("cluster")
    clients = [node.client() for node in nodes]
    try:
        slot = clients[0].cluster("keyslot", mkey)
        ids = [c.cluster("myid") for c in clients]
        src = next(i for i, c in enumerate(clients) if c.cluster("countkeysinslot", slot))
        dst = (src + 1) % len(nodes)
        clients[dst].cluster("setslot", slot, "importing", ids[src])
        clients[src].cluster("setslot", slot, "migrating", ids[dst])
        names = clients[src].cluster("getkeysinslot", slot, 100)
        clients[src].migrate("127.0.0.1", nodes[dst].port, names, 0, 5000)
        for c in clients:
            c.cluster("setslot", slot, "node", ids[dst])
    finally:
        for c in clients:
            c.close()
    assert tier.get(key(1)) == payload(3000, 1)  # MOVED: the tier re-learns the map
    tier.put(key(1), payload(5000, 2))
    assert tier.get(key(1)) == payload(5000, 2) and tier.stats().used_bytes == 5000
    assert tier.delete(key(1)) and tier.stats().used_bytes == 0


def test_redis_out_of_memory_is_tier_full():
    server = _server("standalone")
    tier = _tier("standalone", capacity_bytes=1 << 30)
    tier.put(key(1), b"small")
    with server.client() as client:
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 2 * MiB)
        try:
            with pytest.raises(TierFull):
                tier.put(key(2), payload(8 * MiB))
            assert tier.get(key(2)) is None
            assert tier.delete(key(1))  # deletes still work when Redis is full
        finally:
            client.config_set("maxmemory", 0)
    assert tier.stats().used_bytes == 0
    tier.put(key(2), payload(8 * MiB))


def test_a_writer_that_dies_before_publishing_leaves_expiring_chunks(mode, monkeypatch):
    tier = _tier(mode, chunk_bytes=1024)
    failing = Script("#!lua\nreturn redis.error_reply('ERR injected')")
    monkeypatch.setattr(redis_tier, "PUBLISH", failing)
    monkeypatch.setattr(RedisTier, "_discard", lambda self, r, writes: None)  # died: no cleanup
    with pytest.raises(TierIOError):
        tier.put(key(1), payload(3 * 1024))
    assert tier.get(key(1)) is None and tier.stats().used_bytes == 0
    ttls = _pttls(mode, f"kv:{tier.keyspace}:*:s:*")
    assert len(ttls) == 3 and all(0 < ttl <= redis_tier._STAGE_TTL_MS for ttl in ttls)


# -- sharing -----------------------------------------------------------------------


def test_tiers_on_one_keyspace_share_frames_and_accounting(mode):
    a = _tier(mode, keyspace=f"shared{uuid.uuid4().hex[:8]}")
    b = _tier(mode, keyspace=a.keyspace)
    other = _tier(mode)
    a.put(key(1), payload(1000, 1))
    b.put(key(2), payload(2000, 2))
    assert b.get(key(1)) == payload(1000, 1) and a.get(key(2)) == payload(2000, 2)
    for tier in (a, b):
        stats = tier.stats()
        assert (stats.entries, stats.used_bytes) == (2, 3000)
        assert sorted(tier.keys()) == [key(1), key(2)]
    assert other.get(key(1)) is None and list(other.keys()) == []
    assert other.stats().used_bytes == 0
    assert b.delete(key(1)) and not a.contains(key(1))
    assert a.stats().used_bytes == 2000


def test_racing_writers_keep_the_accounting_exact(mode):
    """Two kvstores rewrite and delete the same keys at once (cluster: the CAS retry path)."""
    tiers = [_tier(mode, chunk_bytes=1024, keyspace=f"race{uuid.uuid4().hex[:8]}")]
    tiers.append(_tier(mode, chunk_bytes=1024, keyspace=tiers[0].keyspace))
    deadline = time.monotonic() + 1.0

    def race(tier: RedisTier, seed: int) -> None:
        i = seed
        while time.monotonic() < deadline:
            if i % 7 == 0:
                tier.delete(key(i % 3))
            else:
                tier.put(key(i % 3), payload(500 * (i % 5), i))
            i += 1

    threads = [threading.Thread(target=race, args=(tier, n)) for n, tier in enumerate(tiers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    frames = [f for f in tiers[0].get_many([key(i) for i in range(3)]) if f is not None]
    stats = tiers[1].stats()
    assert (stats.entries, stats.used_bytes) == (len(frames), sum(map(len, frames)))


def _torn_read_run(mode: str, seconds: float) -> None:
    """One writer rewrites (and now and then deletes) one key; readers must see whole frames."""
    writer = _tier(mode, chunk_bytes=4096)
    reader = _tier(mode, keyspace=writer.keyspace)
    frames = [payload(size, seed) for seed, size in
              enumerate([1, 4095, 4096, 4097, 3 * 4096 + 5, 6 * 4096, 2 * 4096 + 1])]
    allowed, seen, bad = set(frames), set(), []
    stop = threading.Event()

    def write() -> None:
        i = 0
        while not stop.is_set():
            if i % 11 == 10:
                writer.delete(key(1))
            else:
                writer.put(key(1), frames[i % len(frames)])
            i += 1

    def read() -> None:
        while not stop.is_set():
            got = reader.get(key(1))
            if got is not None and bytes(got) in allowed:
                seen.add(bytes(got))
            elif got is not None:
                bad.append(len(got))

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    assert bad == [], f"torn or foreign frames of lengths {bad[:10]}"
    assert len(seen) >= 3  # the readers did see the writer's changes
    final = reader.get(key(1))
    assert reader.stats().used_bytes == (0 if final is None else len(final))


def test_reads_are_never_torn(mode):
    _torn_read_run(mode, seconds=1.5)


@pytest.mark.slow
def test_reads_are_never_torn_long(mode):
    _torn_read_run(mode, seconds=30)


# -- Redis going away ---------------------------------------------------------------


@pytest.fixture
def own_server():
    server = RedisServer().start()
    yield server
    server.stop()


def test_down_redis_is_unavailable_fast_and_the_tier_reconnects(own_server):
    tier = RedisTier(own_server.url, MiB, socket_timeout_s=1.0, connect_timeout_s=0.5)
    _made.append(tier)
    tier.put(key(1), b"before")
    assert tier.stats().entries == 1
    own_server.kill()
    for op in (lambda: tier.get(key(1)), lambda: tier.put(key(2), b"x"),
               lambda: tier.contains(key(1)), lambda: tier.delete(key(1)), lambda: list(tier.keys())):
        start = time.monotonic()
        with pytest.raises(TierUnavailable) as info:
            op()
        assert time.monotonic() - start < 2.0
        assert info.value.tier == tier.name
    stats = tier.stats()  # degrades: the last figures seen, marked as such
    assert stats.details["connected"] == "no" and (stats.entries, stats.used_bytes) == (1, 6)
    own_server.start()  # same port, empty (no persistence)
    assert tier.get(key(1)) is None  # pooled connections to the old process are replaced
    tier.put(key(2), b"after")
    assert tier.get(key(2)) == b"after"
    stats = tier.stats()
    assert stats.details["connected"] == "yes" and (stats.entries, stats.used_bytes) == (1, 5)
    assert stats.counters.errors >= 5


def test_hung_redis_times_out_and_the_tier_recovers(own_server):
    tier = RedisTier(own_server.url, MiB, socket_timeout_s=0.5, connect_timeout_s=0.5)
    _made.append(tier)
    tier.put(key(1), b"frame")
    own_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(TierUnavailable):
            tier.get(key(1))
        assert time.monotonic() - start < 1.5  # one socket timeout, no retry on timeouts
    finally:
        own_server.resume()
    assert tier.get(key(1)) == b"frame"
