"""kvstore as LMCache's remote backend, driven by LMCache 0.5.6's own client.

LMCache runs in its own virtualenv (``.venv-lmcache``; ``.ci/run`` makes it, and
``kvstore bench all --with-lmcache`` does too), through ``bench/lmcache_driver.py``:
its ``RemoteBackend`` over an ``lm://`` URL, which is how a vLLM or SGLang engine with
LMCache reaches a remote server, with ``LMCServerConnector`` on the wire. Where that
virtualenv is missing the tests skip, unless ``KVSTORE_REQUIRE_LMCACHE=1`` (set by
``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from bench.peers import LMCACHE_CHUNK, LMCACHE_CHUNK_BYTES, LMCacheDriver, lmcache_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from bench.serving import free_port
from tests.conftest import require_venv

pytestmark = pytest.mark.lmcache

MiB = 1 << 20
MODEL = "kvstore-bench"  # the driver's CacheEngineKey model name


@pytest.fixture(scope="module")
def lmcache() -> Path:
    return require_venv(lmcache_python(), "no .venv-lmcache with lmcache==0.5.6 (kvstore bench all "
                        "--with-lmcache makes one)", "KVSTORE_REQUIRE_LMCACHE")


@pytest.fixture
def driver(lmcache, tmp_path):
    d = LMCacheDriver(lmcache, tmp_path / "lmcache-driver.log")
    yield d
    d.close()


def key_name(n: int) -> str:
    return f"{MODEL}@1@0@{n:x}@bfloat16"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def setup(driver: LMCacheDriver, name: str, port: int) -> dict:
    return driver.call(cmd="setup", backend=name, lm_url=f"lm://127.0.0.1:{port}", shape=list(LMCACHE_CHUNK),
                       dtype="bfloat16")


def test_lmcache_puts_gets_exists_and_lists_then_reads_after_a_restart(driver, tmp_path):
    lm_port = free_port()
    env = small_env(tmp_path / "data", KVSTORE_TIERS="nvme", KVSTORE_NVME_BYTES="1GiB")
    proc = ServeProcess(env, "--lmcache-port", str(lm_port)).start()
    try:
        setup(driver, "kv", lm_port)
        keys = {10 + i: 500 + i for i in range(4)}  # key -> seed of its data
        for key, seed in keys.items():
            driver.call(cmd="put_key", backend="kv", key=key, seed=seed)
        for key, seed in keys.items():
            got = driver.call(cmd="get_key", backend="kv", key=key, seed=seed)
            assert got["found"] and got["equal"], got  # bit for bit
            assert (got["shape"], got["dtype"], got["fmt"]) == (list(LMCACHE_CHUNK), "bfloat16", "KV_2LTD")
        assert not driver.call(cmd="get_key", backend="kv", key=99, seed=0)["found"]
        assert driver.call(cmd="exists_key", backend="kv", key=10)["exists"]
        assert not driver.call(cmd="exists_key", backend="kv", key=99)["exists"]
        listed = driver.call(cmd="list_keys", backend="kv")
        assert listed["connector_class"] == "LMCServerConnector"
        assert listed["connector"] is None  # LMCache 0.5.6's connector list() is a stub that sends nothing
        assert listed["code"] == 200 and set(listed["wire"]) >= {key_name(k) for k in keys}
        entries = httpx.get(f"{proc.url}/admin/entries", params={"namespace": "lmcache"}).json()
        assert entries["total"] == len(keys) + 1  # and the chunk the setup stores (key 1)
        assert {(e["tier"], e["codec"]) for e in entries["entries"]} == {("nvme", "raw")}
        assert proc.stop() is not None  # SIGTERM: a clean stop
        proc = ServeProcess(env, "--lmcache-port", str(lm_port), port=proc.port).start()
        setup(driver, "kv2", lm_port)  # LMCache does not reconnect: a new RemoteBackend, as a restarted engine
        for key, seed in keys.items():
            got = driver.call(cmd="get_key", backend="kv2", key=key, seed=seed)
            assert got["found"] and got["equal"], (key, got)
    finally:
        proc.stop()


def test_past_the_top_tier_kvstore_demotes_and_evicts_where_lmcache_grows(driver, tmp_path):
    """12 chunks (384 MiB) into 96 MiB of shm and 200 MiB of nvme; LMCache's own server gets them too."""
    lm_port = free_port()
    env = small_env(tmp_path / "data", KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="96MiB",
                    KVSTORE_NVME_BYTES="200MiB")
    proc = ServeProcess(env, "--lmcache-port", str(lm_port)).start()
    try:
        setup(driver, "kv", lm_port)
        theirs = driver.call(cmd="setup", backend="lm", shape=list(LMCACHE_CHUNK), dtype="bfloat16")["server_pid"]
        ours_before, theirs_before = rss_bytes(proc.proc.pid), rss_bytes(theirs)
        keys = list(range(100, 112))
        for key in keys:
            for backend in ("kv", "lm"):  # the driver checks with EXIST that each put was stored
                driver.call(cmd="put_key", backend=backend, key=key, seed=key)
        grown_ours = rss_bytes(proc.proc.pid) - ours_before
        grown_theirs = rss_bytes(theirs) - theirs_before
        # LMCache's server keeps every chunk in RAM and never evicts: it grows by what it was given.
        assert grown_theirs > 0.9 * len(keys) * LMCACHE_CHUNK_BYTES, grown_theirs
        assert grown_ours < 128 * MiB, grown_ours  # ours: preallocated shm, then disk
        stats = httpx.get(f"{proc.url}/admin/stats").json()
        assert stats["counters"]["blocks_evicted"] >= 3  # nvme holds six chunks; the oldest went
        # Read the newest chunks, which admission left on nvme: placement promotes them,
        # demoting colder ones from shm in exchange.
        hot = keys[-2:]
        deadline = time.monotonic() + 30
        while True:
            for key in hot:
                assert driver.call(cmd="get_key", backend="kv", key=key, seed=key)["equal"]
            stats = httpx.get(f"{proc.url}/admin/stats").json()["counters"]
            if stats["blocks_promoted"] and stats["blocks_demoted"]:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.3)
        kept = [k for k in keys if driver.call(cmd="exists_key", backend="kv", key=k)["exists"]]
        assert len(kept) < len(keys) and set(hot) <= set(kept)  # evicted: cold chunks, never the hot ones
        for key in kept:
            got = driver.call(cmd="get_key", backend="kv", key=key, seed=key)
            if not got["found"]:  # evicted since it was listed: nvme drains past its watermark meanwhile
                assert key not in hot and not driver.call(cmd="exists_key", backend="kv", key=key)["exists"]
                continue
            assert got["equal"], (key, got)  # bit for bit, on whichever tier
        counters = httpx.get(f"{proc.url}/admin/stats").json()["counters"]
        assert counters["stale_blocks"] == 0 and counters["corrupt_blocks"] == 0  # a miss was an eviction
        moves = httpx.get(f"{proc.url}/admin/moves").json()["moves"]
        assert {m["reason"].split(":")[0] for m in moves} >= {"promoted", "demoted", "evicted"}
    finally:
        proc.stop()
