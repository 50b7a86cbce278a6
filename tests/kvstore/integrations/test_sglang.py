"""kvstore as SGLang HiCache's storage backend, against SGLang's own code and real ``kvstore serve`` processes.

SGLang runs in a venv of its own (``bench.engines``: ``.ci/run`` makes it), driven by
``bench/sglang_driver.py``: its ``StorageBackendFactory`` builds our backend through
``dynamic``, and its real ``HiCacheController`` (backup, prefetch and I/O threads over a
one-rank gloo group) writes pages from a real ``MHATokenToKVPoolHost`` to storage and
prefetches them back, in every host layout. One driver process serves the module (SGLang
imports in about 10 s). Where the venv is missing the tests skip, unless
``KVSTORE_REQUIRE_ENGINES=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import httpx
import pytest

from bench.engines import engine_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from tests.conftest import wait_until
from bench.sglang_hicache import LAYOUTS, DriverError, HiCacheDriver, kvstore_extra
from kvstore.keys import from_hex
from kvstore.memory.shm import HEADER, SHM_DIR, ShmReader
from tests.conftest import require_venv

pytestmark = pytest.mark.sglang

PAGE = 16


def tokens(pages: int, start: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


@pytest.fixture(scope="module")
def python() -> Path:
    return require_venv(engine_python("sglang"), "no SGLang venv matching bench/locks/sglang-cpu.txt "
                        "(python -m bench.engines ensure sglang makes one)", "KVSTORE_REQUIRE_ENGINES")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang")


@pytest.fixture(scope="module")
def server(work):
    # a fast scrub: a page damaged after the server verified it is found within a test's wait
    proc = ServeProcess(small_env(work / "kvstore", KVSTORE_SCRUB_BYTES_PER_S="1GiB")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def driver(python, work):
    with HiCacheDriver(python, work / "driver.log") as d:
        yield d


def setup(driver, url: str, namespace: str, layout: str = "page_first", **extra) -> dict:
    return driver.call(cmd="setup", layout=layout, extra=kvstore_extra(url, namespace, **extra))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_controller_writes_pages_and_prefetches_them_back_identical(driver, server, layout):
    for v1 in (True, False):
        setup(driver, server.url, f"ctl-{layout}-{int(v1)}", layout, interface_v1=v1)
        toks = tokens(40, 1000)
        wrote = driver.call(cmd="write", tokens=toks, seed=3)
        assert wrote["completed_tokens"] == len(toks)
        got = driver.call(cmd="prefetch", tokens=toks)  # the host copies were freed: these come from kvstore
        assert got["hit_tokens"] == got["completed_tokens"] == len(toks)
        assert got["digests"] == wrote["digests"]
        stats = driver.call(cmd="stats")  # SGLang's StorageMetrics: pages and GB/s of each batch
        assert sum(stats["storage"]["backup_pgs"]) == sum(stats["storage"]["prefetch_pgs"]) == 40
        assert min(stats["storage"]["prefetch_bandwidth"]) > 0
        assert stats["client"]["last_medium"] == "shm"  # co-located: through shared memory


@pytest.mark.parametrize("layout", LAYOUTS)
def test_factory_backend_both_interfaces_read_each_others_pages(driver, server, layout):
    """Pages set through one interface read back byte-identical through both (the generic calls
    and the zero-copy ones), and batch_exists counts them."""
    for v1 in (True, False):
        setup(driver, server.url, f"direct-{layout}-{int(v1)}", layout, interface_v1=v1)
        got = driver.call(cmd="direct", tokens=tokens(8, 5000), seed=4)
        assert all(got["set"]) and got["exists"] == 8
        assert all(got["get_v1"]) and got["get_v1_digests"] == got["digests"]
        assert got["get_digests"] == got["digests"]


def test_batch_exists_counts_a_prefix(driver, server):
    setup(driver, server.url, "prefix")
    toks = tokens(12, 9000)
    driver.call(cmd="write", tokens=toks[:6 * PAGE], seed=1)
    assert driver.call(cmd="exists", tokens=toks)["pages"] == 6
    assert driver.call(cmd="exists", tokens=tokens(3, 77_000))["pages"] == 0


def damage(url: str, key_hex: str) -> None:
    """Flip a payload byte of a block's frame in the server's shm arena."""
    segment = httpx.get(f"{url}/v1/info").json()["colocated"]["segment"]
    with ShmReader(segment) as reader:
        handle = reader.find(from_hex(key_hex))
    assert handle is not None, "the block is not in the shm arena"
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, flags=mmap.MAP_SHARED) as m:
            data_at = HEADER.unpack(m[:HEADER.size])[5]  # handle offsets count from the data region
            m[data_at + handle.offset + handle.length // 2] ^= 0xFF
    finally:
        os.close(fd)


def test_a_damaged_page_is_a_miss_never_wrong_bytes(driver, server):
    for v1 in (True, False):
        setup(driver, server.url, f"damage-{int(v1)}", interface_v1=v1)  # a fresh client: nothing verified yet
        toks = tokens(8, 20_000)
        wrote = driver.call(cmd="write", tokens=toks, seed=5)
        keys = driver.call(cmd="keys", tokens=toks)["keys"]
        found = _corrupt(server.url)
        # The server verifies each page right after it is written (kvstore.engine.scrub), so this
        # is damage at rest: its scrubber drops the page within a cycle, and only then may a
        # reader that trusts the verified slot read it. (Damage before verification: test_scrub.)
        damage(server.url, keys[3])
        wait_until(lambda: _corrupt(server.url) == found + 1, what="the scrubber dropping the damaged page")
        got = driver.call(cmd="prefetch", tokens=toks)
        assert got["hit_tokens"] == 3 * PAGE  # no longer indexed
        assert got["completed_tokens"] == 3 * PAGE  # the prefix before it, and nothing after
        assert got["digests"] == wrote["digests"][:3]


def _corrupt(url: str) -> int:
    return httpx.get(f"{url}/admin/stats", timeout=10).json()["counters"]["corrupt_blocks"]


def test_two_fingerprints_never_share_pages(driver, server):
    toks = tokens(6, 30_000)
    setup(driver, server.url, "fp", fingerprint="weights-a")
    assert driver.call(cmd="write", tokens=toks, seed=6)["completed_tokens"] == len(toks)
    setup(driver, server.url, "fp", fingerprint="weights-b")
    assert driver.call(cmd="exists", tokens=toks)["pages"] == 0
    assert driver.call(cmd="prefetch", tokens=toks)["completed_tokens"] == 0
    setup(driver, server.url, "fp", fingerprint="weights-a")
    assert driver.call(cmd="prefetch", tokens=toks)["completed_tokens"] == len(toks)


def test_layouts_and_ranks_have_their_own_keys(driver, server):
    """Another host layout is another byte order: a miss, not a page read in the wrong order.
    TP ranks hold their own shards; MLA's KV is the same on every rank: one copy, rank 0 writes."""
    toks = tokens(4, 40_000)
    setup(driver, server.url, "scope", "page_first")
    driver.call(cmd="write", tokens=toks, seed=7)
    setup(driver, server.url, "scope", "layer_first")
    assert driver.call(cmd="exists", tokens=toks)["pages"] == 0
    extra = kvstore_extra(server.url, "scope")
    tp = driver.call(cmd="scopes", extra=extra, ranks=[{"tp_rank": 0, "tp_size": 2}, {"tp_rank": 1, "tp_size": 2}])
    assert tp["scopes"][0]["key"] != tp["scopes"][1]["key"] and all(s["writer"] for s in tp["scopes"])
    mla = driver.call(cmd="scopes", extra=extra, ranks=[{"tp_rank": 0, "tp_size": 2, "mla": True},
                                                        {"tp_rank": 1, "tp_size": 2, "mla": True}])
    assert mla["scopes"][0]["key"] == mla["scopes"][1]["key"]
    assert [s["writer"] for s in mla["scopes"]] == [True, False]


def test_clear_removes_this_scopes_pages_only(driver, server):
    toks = tokens(4, 50_000)
    setup(driver, server.url, "clear", fingerprint="other")
    driver.call(cmd="write", tokens=toks, seed=8)
    setup(driver, server.url, "clear", fingerprint="mine")
    driver.call(cmd="write", tokens=toks, seed=8)
    driver.call(cmd="clear")
    assert driver.call(cmd="exists", tokens=toks)["pages"] == 0
    setup(driver, server.url, "clear", fingerprint="other")
    assert driver.call(cmd="exists", tokens=toks)["pages"] == 4


def test_bad_config_is_refused_naming_the_key(driver, server):
    with pytest.raises(DriverError, match="namespace"):
        setup(driver, server.url, "no spaces allowed")
    with pytest.raises(DriverError, match="timeout_s"):
        setup(driver, server.url, "ok", timeout_s=-1)


def test_kvstore_stopped_mid_run_makes_lookups_miss_and_the_controller_carry_on(driver, work):
    srv = ServeProcess(small_env(work / "restart")).start()
    try:
        toks = tokens(6, 60_000)
        setup(driver, srv.url, "down", timeout_s=2)
        assert driver.call(cmd="write", tokens=toks, seed=9)["completed_tokens"] == len(toks)
        srv.kill()
        started = time.monotonic()
        assert driver.call(cmd="exists", tokens=toks)["pages"] == 0
        assert driver.call(cmd="prefetch", tokens=toks)["completed_tokens"] == 0
        assert driver.call(cmd="write", tokens=tokens(2, 61_000), seed=9)["completed_tokens"] == 0
        assert time.monotonic() - started < 10  # a dead store costs a refused connect, then a pause
        assert driver.call(cmd="threads")["alive"]
        srv = ServeProcess(small_env(work / "restart"), port=srv.port).start()
        deadline = time.monotonic() + 40  # the backend pauses 2 s after the failure, then 4 s...
        while driver.call(cmd="write", tokens=toks, seed=9)["completed_tokens"] != len(toks):
            assert time.monotonic() < deadline, "the backend did not come back to the restarted store"
            time.sleep(0.5)
        assert driver.call(cmd="prefetch", tokens=toks)["completed_tokens"] == len(toks)
    finally:
        srv.stop()
