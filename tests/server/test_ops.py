"""/healthz, /readyz (with a real Redis killed and restarted) and /metrics."""

from __future__ import annotations

import re

import httpx

from client_sdk import KVClient
from kvstore import KVStore
from kvstore.keys import block_hashes
from tests.conftest import make_kv
from tests.tiers.redis_servers import RedisServer
from tiers.memory import MemoryTier
from tiers.redis import RedisTier
from tiers.shm import ShmTier


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample, labels matched in any order."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels} in /metrics")


def test_healthz(server):
    resp = httpx.get(f"{server.url}/healthz")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_metrics_expose_the_named_series(serve_app, spec):
    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], tier_codecs={"memory": "int8"}, background=False)
    srv = serve_app(store)
    with KVClient(srv.url, colocated=False) as c:
        tokens = list(range(48))
        c.put_kv(spec, tokens, make_kv(spec, 48))
        c.get_kv(spec, tokens)
        c.lookup(spec, tokens)
        c.admin.migrate(block_hashes(spec, tokens)[0], "memory")
        text = c.metrics()
    for name in ("kvstore_tier_bytes", "kvstore_tier_entries", "kvstore_tier_capacity_bytes", "kvstore_tier_up"):
        assert _metric(text, name, tier="shm", kind="shm") >= 0
    for name in ("hits", "misses", "puts", "gets", "errors", "deletes"):  # the old names keep working
        assert _metric(text, f"kvstore_tier_{name}_total", tier="memory", kind="memory") >= 0
        assert _metric(text, f"kvstore_tier_backend_{name}_total", tier="memory", kind="memory") >= 0
    assert _metric(text, "kvstore_tier_entries", tier="shm") == 2
    assert _metric(text, "kvstore_tier_entries", tier="memory") == 1
    assert _metric(text, "kvstore_tier_puts_total", tier="shm") == 3
    assert _metric(text, "kvstore_tier_backend_puts_total", tier="shm") == 3
    # Reads served by tier (the get's three blocks; the migration's read is a move, not a read),
    # under the new name and the old one; the tier's own hits include the move.
    assert _metric(text, "kvstore_tier_reads_total", tier="shm", kind="shm") == 3
    assert _metric(text, "kvstore_tier_hits_total", tier="shm") == 3
    assert _metric(text, "kvstore_tier_reads_total", tier="memory") == 0
    assert _metric(text, "kvstore_tier_backend_hits_total", tier="shm") >= 3
    assert _metric(text, "kvstore_moves_total", reason="migrated") == 1
    assert _metric(text, "kvstore_codec_bytes_saved") > 0  # the int8 block in memory
    assert _metric(text, "kvstore_request_duration_seconds_count", route="/v1/kv/put", method="POST") == 1
    assert _metric(text, "kvstore_request_duration_seconds_bucket", route="/v1/kv/get", method="POST",
                   le="+Inf") == 1
    assert _metric(text, "kvstore_requests_total", route="/admin/migrate", method="POST", status="200") == 1
    assert _metric(text, "kvstore_transfer_bytes_total", direction="out", medium="http") == spec.bytes_per_token * 48
    assert _metric(text, "kvstore_store_ops_total", counter="put_calls") == 1


def test_tier_reads_count_colocated_gets_that_the_tier_never_saw(server, spec):
    """A co-located get reads shm slots without asking the shm tier for a frame: the tier's own
    counters stay at 0 hits, the reads by tier (and kvstore_tier_hits_total) count every block."""
    tokens = list(range(64))
    with KVClient(server.url) as c:
        c.put_kv(spec, tokens, make_kv(spec, 64))
        for _ in range(2):
            assert c.get_kv(spec, tokens)[1] == 64 and c.stats.last_medium == "shm"
    # close() reported the second get's reads from remembered handles
    with KVClient(server.url, colocated=False) as c:
        text = c.metrics()
    assert _metric(text, "kvstore_tier_reads_total", tier="shm", kind="shm") == 2 * 4
    assert _metric(text, "kvstore_tier_hits_total", tier="shm", kind="shm") == 2 * 4
    assert _metric(text, "kvstore_tier_backend_hits_total", tier="shm") == 0  # labelled as the tier's own
    assert _metric(text, "kvstore_tier_backend_gets_total", tier="shm") == 0
    assert _metric(text, "kvstore_store_ops_total", counter="tokens_hit") == 2 * 64
    help_lines = [line for line in text.splitlines() if line.startswith("# HELP kvstore_tier_")]
    assert any(line.startswith("# HELP kvstore_tier_reads_total Block reads served") for line in help_lines)
    assert any(line.startswith("# HELP kvstore_tier_backend_hits_total") and "co-located" in line
               for line in help_lines)


def test_readyz_degrades_when_redis_dies_and_recovers(serve_app, spec):
    redis_srv = RedisServer().start()
    try:
        tier = RedisTier(redis_srv.url, 64 << 20, keyspace="readyz")
        srv = serve_app(KVStore([ShmTier(16 << 20), tier], background=False))
        ready = httpx.get(f"{srv.url}/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "ok"
        assert {t["name"]: t["state"] for t in ready.json()["tiers"]} == {"shm": "ok", "redis": "ok"}
        redis_srv.kill()
        ready = httpx.get(f"{srv.url}/readyz", timeout=10)
        body = ready.json()
        assert ready.status_code == 200 and body["status"] == "degraded"
        assert body["reasons"] and body["reasons"][0].startswith("tier redis unavailable")
        assert {t["name"]: t["state"] for t in body["tiers"]} == {"shm": "ok", "redis": "unavailable"}
        with KVClient(srv.url, colocated=False) as c:  # degraded, not stopped
            assert c.put_kv(spec, list(range(32)), make_kv(spec, 32)) == 32
            metrics = c.metrics()
        assert _metric(metrics, "kvstore_tier_up", tier="redis") == 0
        redis_srv.start()  # same port
        body = httpx.get(f"{srv.url}/readyz", timeout=10).json()
        assert body["status"] == "ok" and body["reasons"] == []
    finally:
        redis_srv.stop()


def test_readyz_is_503_once_the_store_is_closed(serve_app):
    srv = serve_app()
    srv.store.close()
    resp = httpx.get(f"{srv.url}/readyz")
    assert resp.status_code == 503 and resp.json()["status"] == "unavailable"
