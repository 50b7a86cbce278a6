"""Redis faults at the service: kill its redis-server mid-load, then start it again.

``kvstore serve`` runs with shm, Redis and nvme (raw everywhere, so gets are checked bit for
bit). Four client threads put and get in a loop while the test kills the redis-server with
SIGKILL and, two seconds later, starts it again on the same port. Throughout:

- every get returns a prefix of its sequence, bit for bit (what shm and nvme hold still serves);
- no request takes longer than the client's timeout, and none fails with an untyped error;
- ``/readyz`` says ``degraded`` while Redis is down, and ``ok`` within 5 s of its restart,
  without restarting kvstore.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import httpx
import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient
from kvstore.errors import KVStoreError
from tests.tiers.redis_servers import RedisClusterServers, RedisServer

SPEC = SPECS[0]
TIMEOUT_S = 10.0


def _loop(url: str, worker: int, stop: threading.Event, out: dict) -> None:
    errors: Counter[str] = Counter()
    slowest = mismatches = ops = 0
    with KVClient(url, namespace="redis-faults", colocated=False, plan=False, timeout_s=TIMEOUT_S,
                  retries=1) as client:
        i = 0
        while not stop.is_set():
            seq = (worker * 7 + i) % 24
            tokens = [seq * 10_000 + t for t in range(64 + 16 * (seq % 5))]
            t0 = time.perf_counter()
            try:
                if i % 3 == 0:
                    client.put_kv(SPEC, tokens, expected_kv(0, tokens))
                else:
                    kv, n = client.get_kv(SPEC, tokens)
                    mismatches += bool(n) and not torch.equal(kv, expected_kv(0, tokens[:n]))
            except KVStoreError as exc:
                errors[type(exc).__name__] += 1
            slowest = max(slowest, time.perf_counter() - t0)
            ops += 1
            i += 1
    out[worker] = {"ops": ops, "errors": errors, "slowest_s": slowest, "mismatches": mismatches}


def _ready(url: str) -> dict:
    return httpx.get(f"{url}/readyz", timeout=TIMEOUT_S).json()


def test_redis_killed_mid_load_degrades_and_comes_back_without_a_restart(tmp_path):
    redis_srv = RedisServer().start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_REDIS_URL=redis_srv.url, KVSTORE_SHM_BYTES="4MiB",
               KVSTORE_CXL_BYTES="4MiB", KVSTORE_TIER_CODECS="cxl=raw,redis=raw,nvme=raw",
               KVSTORE_LOG_LEVEL="warning")
    server = ServeProcess(env).start()
    stop, results = threading.Event(), {}
    threads = [threading.Thread(target=_loop, args=(server.url, w, stop, results)) for w in range(4)]
    try:
        assert _ready(server.url)["status"] == "ok"
        for t in threads:
            t.start()
        time.sleep(1.5)
        redis_srv.kill()
        time.sleep(0.5)
        down = _ready(server.url)
        assert down["status"] == "degraded", down
        time.sleep(1.5)
        redis_srv.start()  # the same port
        back_at = time.monotonic()
        while _ready(server.url)["status"] != "ok":
            assert time.monotonic() - back_at < 5, "the Redis tier was not back within 5 s"
            time.sleep(0.1)
        recovered_s = time.monotonic() - back_at
        time.sleep(1.5)  # and the load runs on with Redis back
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        server.stop()
        redis_srv.stop()
    errors = sum((r["errors"] for r in results.values()), Counter())
    print({"recovered_s": recovered_s, "errors": dict(errors), **{w: r["ops"] for w, r in results.items()}})
    assert len(results) == 4 and all(r["ops"] > 10 for r in results.values())
    assert sum(r["mismatches"] for r in results.values()) == 0
    assert max(r["slowest_s"] for r in results.values()) < TIMEOUT_S
    assert set(errors) <= {"TierUnavailable"}, errors  # typed, and only the one that says Redis is down


def test_a_cluster_master_lost_fails_over_to_its_replica_unseen_by_clients(tmp_path):
    """Redis Cluster, 3 masters with a replica each; one master is killed with every block written.

    Once the replica has taken its slots (about 2 s with a 1 s node timeout), the clients' next
    gets find every block, bit for bit, and puts go on: nothing to restart, no error to handle.
    """
    cluster = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_REDIS_URL=cluster.url, KVSTORE_TIERS="redis",
               KVSTORE_TIER_CODECS="redis=raw", KVSTORE_LOG_LEVEL="warning")
    server = ServeProcess(env).start()
    try:
        with KVClient(server.url, namespace="failover", colocated=False, plan=False, timeout_s=TIMEOUT_S) as client:
            seqs = [[s * 10_000 + t for t in range(64)] for s in range(24)]
            for tokens in seqs:  # 96 blocks: every master holds some
                assert client.put_kv(SPEC, tokens, expected_kv(0, tokens)) == 64
            for node in cluster.masters():  # the replicas have every write before a master goes
                with node.client() as c:
                    assert c.execute_command("WAIT", 1, 5000) == 1
            cluster.masters()[0].kill()
            cluster.wait_ok(timeout_s=30)  # its replica serves its slots now
            for tokens in seqs:
                kv, n = client.get_kv(SPEC, tokens)
                assert n == 64 and torch.equal(kv, expected_kv(0, tokens))
            more = [9_999_000 + t for t in range(64)]
            assert client.put_kv(SPEC, more, expected_kv(0, more)) == 64
            assert client.get_kv(SPEC, more)[1] == 64
    finally:
        server.stop()
        cluster.stop()
