"""kvstore as the L2 store of LMCache's multi-process server (``kvstore.integrations.lmcache``).

A stock ``lmcache server`` (LMCache 0.5.6, in ``.venv-lmcache``) loads ``KVStoreL2Adapter``
as a plugin, with ``--l2-store-policy skip_l1`` so what it stores lives in kvstore alone,
against a real ``kvstore serve``; LMCache's own vLLM-side adapters store, look up and
retrieve through it (``bench/lmcache_mp_driver.py``). Lock and failure cases drive the
adapter directly in the same driver process. One server of each per module: the tests
run in file order, and the last one kills kvstore. Where the venv is missing they skip,
unless ``KVSTORE_REQUIRE_LMCACHE=1`` (``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from bench.lmcache_mp import LMCacheServer, MPDriver, adapter_spec, missing_modules
from bench.peers import lmcache_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from tests.conftest import wait_until
from bench.serving import free_port
from client_sdk import KVClient
from kvstore.keys import from_hex
from kvstore.memory.shm import HEADER, SHM_DIR, ShmReader
from tests.conftest import require_venv

pytestmark = pytest.mark.lmcache

NS = "lmcache"  # the adapter's default namespace
CHUNK = 64  # tokens
FLAG = "KVSTORE_REQUIRE_LMCACHE"


@pytest.fixture(scope="module")
def python() -> Path:
    found = require_venv(lmcache_python(), "no .venv-lmcache with lmcache==0.5.6", FLAG)
    missing = missing_modules(found)
    if missing:  # the plugin runs kvstore's code in LMCache's interpreter
        require_venv(None, f"{found} lacks kvstore's dependencies {missing}", FLAG)
    return found


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lmcache-l2")


class Kvstore:
    """The module's ``kvstore serve``; ``restart`` brings it back on the same port and data dir."""

    def __init__(self, work: Path) -> None:
        # a fast scrub: a block damaged after the server verified it is found within a test's wait
        self.env = small_env(work / "kvstore", KVSTORE_SCRUB_BYTES_PER_S="1GiB")
        self.proc = ServeProcess(self.env).start()

    @property
    def url(self) -> str:
        return self.proc.url

    def restart(self) -> None:
        self.proc = ServeProcess(self.env, port=self.proc.port).start()


@pytest.fixture(scope="module")
def kvstore(work):
    store = Kvstore(work)
    yield store
    store.proc.stop()


@pytest.fixture(scope="module")
def server(python, work, kvstore):
    spec = adapter_spec("kvstore", url=kvstore.url, status_interval_s=0.2)
    with LMCacheServer(python, spec, work / "lmcache-server.log", chunk_tokens=CHUNK) as srv:
        yield srv


@pytest.fixture(scope="module")
def driver(python, work, server):
    with MPDriver(python, work / "driver.log") as d:
        d.connect(server, max_tokens=512)
        yield d


def wait_for(probe, what: str, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not (got := probe()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return got


def namespace_keys(url: str) -> set[str]:
    with KVClient(url) as admin:
        return {e["key"] for e in admin.admin.entries(namespace=NS, limit=1000)["entries"]}


# -- through a stock lmcache server ------------------------------------------------------------


def test_store_lookup_retrieve_are_byte_identical(driver, server, kvstore):
    before = namespace_keys(kvstore.url)
    stored = driver.call("store", seed=1, tokens=256)
    assert stored["settled"]  # skip_l1 dropped the chunks from L1: kvstore took them
    assert len(namespace_keys(kvstore.url) - before) == 4  # one block per 64-token chunk
    got = driver.call("fetch", seed=1, tokens=256)
    assert got["hit_tokens"] == 256 and got["identical"] and not got["load_errors"]
    half = driver.call("fetch", seed=1, tokens=128)  # a prompt of the first two chunks: those two
    assert half["hit_tokens"] == 128 and half["identical"]
    assert driver.call("fetch", seed=2, tokens=256)["hit_tokens"] == 0  # other tokens: nothing
    status = server.adapter_status()
    assert status["is_healthy"] and status["kvstore_status"] == "ok" and server.status()["is_healthy"]
    assert status["stored_object_count"] == 4 and status["lock_count"] == 0  # every lock released
    assert len(server.l2_objects()) == 4  # LMCache's own listing: the adapter's list_l2_keys


def test_lmcache_deletes_through_the_adapter(driver, server, kvstore):
    listed = server.l2_objects()
    assert driver.call("store", seed=3, tokens=128)["settled"]
    new = [e for e in server.l2_objects() if e not in listed]
    assert len(new) == 2
    before = namespace_keys(kvstore.url)
    assert server.delete_l2([e["key"] for e in new])["ok"]
    assert len(before - namespace_keys(kvstore.url)) == 2
    assert server.l2_objects() == listed  # LMCache's listing follows
    assert driver.call("fetch", seed=3, tokens=128)["hit_tokens"] == 0


def test_a_repeated_store_copies_nothing(driver, server):
    first = server.adapter_status()
    assert driver.call("store", seed=1, tokens=256)["settled"]
    again = server.adapter_status()
    assert again["stored_chunks"] == first["stored_chunks"]
    assert again["skipped_chunks"] == first["skipped_chunks"] + 4
    assert driver.call("fetch", seed=1, tokens=256)["identical"]


def test_a_damaged_block_is_a_miss_from_there_on(driver, server, kvstore):
    seed = 20
    keys = namespace_keys(kvstore.url)
    added = []
    for tokens in (128, 192, 256):  # one store per length: the block each adds is that chunk's
        assert driver.call("store", seed=seed, tokens=tokens)["settled"]
        now = namespace_keys(kvstore.url)
        added.append(now - keys)
        keys = now
    assert [len(a) for a in added] == [2, 1, 1]
    # The server verified each block right after its store (kvstore.engine.scrub): this is damage
    # at rest, which its scrubber drops within a cycle; readers trust the verified slot until then.
    found = httpx.get(f"{kvstore.url}/admin/stats", timeout=10).json()["counters"]["corrupt_blocks"]
    damage_payload(kvstore.url, next(iter(added[1])))  # the third chunk
    wait_until(lambda: httpx.get(f"{kvstore.url}/admin/stats", timeout=10).json()["counters"]["corrupt_blocks"]
               == found + 1, what="the scrubber dropping the damaged block")
    assert added[1] - namespace_keys(kvstore.url) == added[1]  # the damaged block left kvstore

    got = driver.call("fetch", seed=seed, tokens=256)
    assert got["hit_tokens"] == 128  # the prefix before the damaged chunk
    assert got["identical"]  # and its bytes are exactly what was stored

    assert driver.call("store", seed=seed, tokens=256)["settled"]  # LMCache's next store puts it anew
    healed = driver.call("fetch", seed=seed, tokens=256)
    assert healed["hit_tokens"] == 256 and healed["identical"]


def damage_payload(url: str, hex_key: str) -> None:
    """Flip the last payload byte of a block in kvstore's shm arena, behind the server's back."""
    with KVClient(url) as client:
        segment = client.info()["colocated"]["segment"]
    with ShmReader(segment) as reader:
        handle = reader.find(from_hex(hex_key))
    assert handle is not None, "the block is not in the shm tier"
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as m:
            data_at = HEADER.unpack(m[:HEADER.size])[5]
            at = data_at + handle.offset + handle.length - 1
            m[at] ^= 0xFF
    finally:
        os.close(fd)


# -- the adapter on its own ---------------------------------------------------------------------


@pytest.fixture
def adapter(driver, kvstore, request):
    """A ``KVStoreL2Adapter`` in the driver process, in a namespace of the test's own."""
    ns = request.node.name.removeprefix("test_")[:40].replace("_", "-")
    driver.call("adapter_open", params={"url": kvstore.url, "namespace": ns, "status_interval_s": 0.2})
    yield ns
    driver.call("adapter_close")


def evict_namespace(url: str, ns: str) -> dict:
    with KVClient(url) as admin:  # no tokens: the loopback caller is the admin
        return admin.admin.evict(namespace=ns)


def pinned(url: str, ns: str) -> int:
    """Blocks of ``ns`` kvstore holds pinned now."""
    with KVClient(url) as admin:
        return sum(e["pinned"] for e in admin.admin.entries(namespace=ns, limit=1000)["entries"])


def test_a_lookup_of_chunks_in_the_arena_answers_with_no_request_and_locks_after(driver, kvstore, adapter):
    assert driver.call("adapter_store", keys=[1, 2], nbytes=4096)["success"]
    kvstore.proc.signal(signal.SIGSTOP)  # a lookup that asked kvstore anything would wait, then miss
    try:
        looked = driver.call("adapter_lookup", keys=[1, 2])
    finally:
        kvstore.proc.signal(signal.SIGCONT)
    assert looked["found"] == [True, True]  # the arena's shared key index answered
    wait_for(lambda: pinned(kvstore.url, adapter) == 2, "the lookup's locks, pinned on their own lane")
    # a pin on the lookup's path would have waited out its timeout on the stopped server and failed
    assert driver.call("adapter_status")["status"]["failed_calls"] == 0
    driver.call("adapter_unlock", keys=[1, 2])
    wait_for(lambda: pinned(kvstore.url, adapter) == 0, "the unpins, in order after the pins")
    assert driver.call("adapter_status")["status"]["lock_count"] == 0


def test_a_locked_chunk_survives_eviction_until_its_last_unlock(driver, kvstore, adapter):
    ok = driver.call("adapter_store", keys=[1, 2], nbytes=4096)
    assert ok["success"] and ok["bytes"] == 8192
    assert driver.call("adapter_lookup", keys=[1, 3])["found"] == [True, False]
    assert driver.call("adapter_lookup", keys=[1])["found"] == [True]  # a second lock of chunk 1
    wait_for(lambda: pinned(kvstore.url, adapter) == 1, "the lock's pin")  # one request after the lookup
    swept = evict_namespace(kvstore.url, adapter)
    assert swept["removed_blocks"] == 1 and swept["skipped_pinned"] == 1  # chunk 2 went, chunk 1 stayed
    assert driver.call("adapter_load", keys=[1, 2], nbytes=4096) == {"loaded": [True, False], "identical": [True, None]}

    driver.call("adapter_unlock", keys=[1])  # one lock left
    wait_for(lambda: driver.call("adapter_status")["status"]["lock_count"] == 1, "first unlock")
    assert evict_namespace(kvstore.url, adapter)["removed_blocks"] == 0
    driver.call("adapter_unlock", keys=[1])
    wait_for(lambda: evict_namespace(kvstore.url, adapter)["removed_blocks"] == 1, "eviction after the last unlock")
    assert driver.call("adapter_status")["status"]["lock_count"] == 0
    assert driver.call("adapter_load", keys=[1], nbytes=4096)["loaded"] == [False]

    # LMCache was told of both evictions (its byte accounting and eviction policy follow them)
    st = driver.call("adapter_status")
    assert st["status"]["gone_chunks"] == 2 and st["status"]["stored_object_count"] == 0
    assert st["usage_bytes"] == 0 and st["listed"] == 0


def test_results_are_answered_once_and_unlock_of_unknown_keys_is_harmless(driver, adapter):
    driver.call("adapter_store", keys=[5], nbytes=1000)
    got = driver.call("adapter_lookup", keys=[5])
    assert got["found"] == [True] and not got["again"]
    driver.call("adapter_unlock", keys=[5, 6, 7])  # 6 and 7 were never locked
    wait_for(lambda: driver.call("adapter_status")["status"]["lock_count"] == 0, "unlock")
    assert driver.call("adapter_load", keys=[5], nbytes=999)["loaded"] == [False]  # another size: a miss


def test_close_stops_the_threads_and_a_later_task_fails_at_once(driver, kvstore):
    driver.call("adapter_open", params={"url": kvstore.url, "namespace": "closing"})
    driver.call("adapter_store", keys=[1], nbytes=100)
    driver.call("adapter_lookup", keys=[1])  # a lock still held: close releases its pin
    closed = driver.call("adapter_close")
    assert closed == {"threads_left": [], "late_lookup": [False]}
    assert evict_namespace(kvstore.url, "closing")["removed_blocks"] == 1


@pytest.mark.parametrize("params, says", [
    ({"url": "ftp://x"}, "url"),
    ({"lock_ttl_s": 7200}, "lock_ttl_s"),
    ({"workers": 0}, "workers"),
    ({"namespace": "a/b"}, "namespace"),
    ({"nope": 1}, "unknown adapter_params"),
])
def test_bad_params_are_refused_at_construction(driver, params, says):
    with pytest.raises(RuntimeError, match="InvalidInput|InvalidSpec") as err:
        driver.call("adapter_open", params=params)
    assert says in str(err.value)


def test_with_kvstore_unreachable_tasks_fail_fast_and_status_says_so(driver):
    driver.call("adapter_open", params={"url": f"http://127.0.0.1:{free_port()}", "status_interval_s": 0.2})
    try:
        assert driver.call("adapter_store", keys=[1], nbytes=4096)["success"] is False
        assert driver.call("adapter_lookup", keys=[1])["found"] == [False]
        assert driver.call("adapter_load", keys=[1], nbytes=4096)["loaded"] == [False]
        driver.call("adapter_unlock", keys=[1])
        st = wait_for(lambda: (s := driver.call("adapter_status")["status"])["kvstore_status"] == "unreachable" and s,
                      "status")
        assert st["is_healthy"] is False
    finally:
        driver.call("adapter_close")


def test_a_hung_kvstore_never_holds_up_lmcache(driver):
    """A server that takes connections and never answers: ``submit_*`` still return at once."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # connections complete in the kernel's backlog; no request is ever read
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        driver.call("adapter_open", params={"url": url, "timeout_s": 1, "status_interval_s": 0.2})
        try:
            stored = driver.call("adapter_store", keys=[1], nbytes=4096)
            assert stored["success"] is False
            assert stored["submit_s"] < 0.5 and stored["seconds"] >= 0.9  # the wait was on the worker
            looked = driver.call("adapter_lookup", keys=[1])
            assert looked["found"] == [False] and looked["submit_s"] < 0.5
            st = driver.call("adapter_status")["status"]  # answered from the monitor's last probe
            assert st["is_healthy"] is False
        finally:
            driver.call("adapter_close")


# -- kvstore restarted under a running lmcache server (kills the module's kvstore: keep last) ---


def test_kvstore_restarted_in_the_middle(driver, server, kvstore):
    assert driver.call("store", seed=30, tokens=256)["settled"]
    kvstore.proc.kill()

    assert driver.call("fetch", seed=30, tokens=256)["hit_tokens"] == 0  # a miss, not an error
    failed = driver.call("store", seed=31, tokens=128, settle_timeout_s=2)
    assert not failed["settled"]  # the L2 store failed; LMCache keeps the chunks in L1
    assert server.healthy()
    wait_for(lambda: not server.adapter_status()["is_healthy"], "unhealthy status")
    assert server.status()["is_healthy"] is False

    kvstore.restart()
    wait_for(lambda: server.adapter_status()["is_healthy"], "healthy status")
    assert driver.call("store", seed=32, tokens=256)["settled"]
    got = driver.call("fetch", seed=32, tokens=256)
    assert got["hit_tokens"] == 256 and got["identical"]
    assert server.healthy()
