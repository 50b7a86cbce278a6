"""The SDK against live servers: EmbeddedStore's contract, retries, timeouts, typed errors, async."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import pytest
import torch

import client_sdk
import server as server_pkg
from bench.serving import free_port
from client_sdk import AsyncKVClient, ConnectionFailed, KVClient, RequestTimeout
from kvstore.wire.errors import ERRORS, STATUS, error_body, error_from
from kvstore import KVStore
from kvstore.errors import InvalidInput, InvalidKV, InvalidSpec, TierFull
from server import ServerSettings, create_app
from tests.conftest import make_kv, make_spec
from tests.server.conftest import make_store
from tests.server.live import ThreadServer
from tiers.memory import MemoryTier


@pytest.fixture
def live(tmp_path):
    srv = ThreadServer(create_app(make_store(), ServerSettings(staging_bytes="16MiB",
                                                               audit_log=str(tmp_path / "a.jsonl")))).start()
    yield srv
    srv.stop()


def test_public_surfaces_are_listed():
    assert set(client_sdk.__all__) >= {"KVClient", "AsyncKVClient", "Unauthorized", "Forbidden", "QuotaExceeded",
                                       "ConnectionFailed"}
    assert all(hasattr(client_sdk, name) for name in client_sdk.__all__)
    assert server_pkg.__all__ == ["create_app", "serve", "ServerSettings", "TenantGrant"]


@pytest.mark.parametrize("colocated", [None, False])
def test_same_contract_as_embedded_store(live, spec, colocated):
    ref = KVStore([MemoryTier(64 << 20)], background=False)
    tokens = torch.arange(70)  # a tensor of token ids works as for the engine
    kv = make_kv(spec, 70)
    with KVClient(live.url, colocated=colocated) as c:
        assert c.put_kv(spec, tokens, kv) == ref.put_kv(spec, tokens, kv) == 64
        (a, n), (b, m) = c.get_kv(spec, tokens), ref.get_kv(spec, tokens)
        assert n == m == 64 and isinstance(n, int) and torch.equal(a, b) and a.dtype == b.dtype
        assert c.lookup(spec, list(range(90))) == ref.lookup(spec, list(range(90))) == 64
        assert c.delete(spec, tokens) == ref.delete(spec, tokens) == 4
        for bad in (lambda: c.put_kv(spec, tokens, kv[:, :, :, :10]), lambda: c.put_kv(spec, tokens, kv.float())):
            with pytest.raises(InvalidKV):
                bad()
        with pytest.raises(InvalidSpec):
            c.get_kv({"model_id": "x"}, tokens)
    ref.close()


def test_get_into_a_caller_buffer(live, spec):
    tokens = list(range(48))
    kv = make_kv(spec, 48)
    out = torch.empty(spec.bytes_per_token * 64, dtype=torch.uint8)
    for colocated in (None, False):
        with KVClient(live.url, colocated=colocated) as c:
            c.put_kv(spec, tokens, kv)
            got, n = c.get_kv(spec, tokens, out=out)
            assert n == 48 and torch.equal(got, kv) and got.data_ptr() == out.data_ptr()
            with pytest.raises(InvalidInput, match="out holds"):
                c.get_kv(spec, tokens, out=bytearray(100))
            assert c.get_kv(spec, tokens)[1] == 48  # the client is still usable


def test_results_reuse_memory_only_once_released(live, spec):
    tokens = list(range(32))
    with KVClient(live.url, colocated=False) as c:
        c.put_kv(spec, tokens, make_kv(spec, 32))
        first, _ = c.get_kv(spec, tokens)
        keep = first.clone()
        second, _ = c.get_kv(spec, tokens)
        assert second.data_ptr() != first.data_ptr()  # first is alive: never handed out again
        ptr = first.data_ptr()
        del first
        gc.collect()
        third, _ = c.get_kv(spec, tokens)
        assert third.data_ptr() == ptr and torch.equal(third, keep)


def test_connection_errors_are_retried_with_backoff_then_typed():
    port = free_port()  # nobody listens
    with KVClient(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.05, colocated=False) as c:
        start = time.monotonic()
        with pytest.raises(ConnectionFailed, match="after 3 retries"):
            c.lookup(make_spec(), [1] * 16)
        took = time.monotonic() - start
    assert c.stats.retries == 3 and took >= 0.5 * (0.05 + 0.1 + 0.2)


class _DropFirst:
    """A TCP proxy that accepts a connection, reads the request and closes without answering
    (a fault: the server died mid-request); later connections are forwarded."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.dropped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.dropped == 0:
                self.dropped += 1
                conn.recv(65536)
                conn.close()
                continue
            up = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def test_a_dropped_connection_is_retried_transparently(live, spec):
    proxy = _DropFirst(live.port)
    try:
        with KVClient(f"http://127.0.0.1:{proxy.port}", colocated=False, backoff_s=0.01) as c:
            kv = make_kv(spec, 32)
            assert c.put_kv(spec, list(range(32)), kv) == 32
            assert proxy.dropped == 1 and c.stats.retries == 1
            assert torch.equal(c.get_kv(spec, list(range(32)))[0], kv)
    finally:
        proxy.close()


def test_a_restarted_server_is_reconnected_to(tmp_path, spec):
    port = free_port()
    first = ThreadServer(create_app(make_store(), ServerSettings(colocated=False)), port=port).start()
    c = KVClient(f"http://127.0.0.1:{port}", colocated=False, backoff_s=0.05)
    c.put_kv(spec, list(range(16)), make_kv(spec, 16))
    first.stop()
    second = ThreadServer(create_app(make_store(), ServerSettings(colocated=False)), port=port).start()
    try:
        assert c.lookup(spec, list(range(16))) == 0  # a new store: the keep-alive socket was stale
        assert c.put_kv(spec, list(range(16)), make_kv(spec, 16)) == 16
    finally:
        c.close()
        second.stop()


def test_a_silent_server_times_out_without_retrying(spec):
    silent = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
    try:
        with KVClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3, retries=3,
                      colocated=False) as c:
            start = time.monotonic()
            with pytest.raises(RequestTimeout):
                c.lookup(spec, [1] * 16)
            assert time.monotonic() - start < 2 and c.stats.retries == 0
    finally:
        silent.close()


def test_every_wire_error_maps_back_to_its_class():
    for name, status in STATUS.items():
        cls = ERRORS[name]
        exc = cls("boom", tier="t") if issubclass(cls, TierFull) else (
            cls("boom", status=status) if issubclass(cls, client_sdk.ServiceError) else cls("boom"))
        back = error_from(status, error_body(exc))
        assert type(back) is cls and str(back) == "boom", name
    assert isinstance(error_from(418, b"not json"), client_sdk.ServiceError)
    assert type(error_from(401, b'{"detail": "nope"}')) is client_sdk.Unauthorized


def test_async_client_mirrors_the_sync_one(live, spec):
    async def main() -> None:
        for colocated in (None, False):
            async with AsyncKVClient(live.url, namespace=f"ns{colocated}", colocated=colocated, plan=False) as c:
                seqs = [list(range(i * 1000, i * 1000 + 48)) for i in range(4)]
                kvs = [make_kv(spec, 48, seed=i) for i in range(4)]
                stored = await asyncio.gather(*(c.put_kv(spec, s, k) for s, k in zip(seqs, kvs)))
                assert stored == [48] * 4
                got = await asyncio.gather(*(c.get_kv(spec, s) for s in seqs))
                assert all(n == 48 and torch.equal(g, k) for (g, n), k in zip(got, kvs))
                assert await c.lookup(spec, seqs[0] + [1] * 20) == 48
                assert await c.delete(spec, seqs[0]) == 3
                assert (await c.get_kv(spec, seqs[0]))[1] == 0
                medium = "shm" if colocated is None else "http"
                assert c.stats.last_medium == medium
                assert (c.stats.shm_gets if colocated is None else c.stats.http_gets) == 5
                with pytest.raises(InvalidSpec):
                    await c.lookup(spec.to_dict(), seqs[0])
        async with AsyncKVClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01) as dead:
            with pytest.raises(ConnectionFailed):
                await dead.lookup(spec, [1] * 16)

    asyncio.run(main())


def test_tensor_pool_with_many_sizes():
    from client_sdk._common import TensorPool

    pool = TensorPool(1 << 20)
    held = [pool.tensor((n, 64), torch.float16) for n in (8, 40, 8, 16, 40)]
    for i, t in enumerate(held):
        t.fill_(i)
    ptrs = {t.data_ptr() for t in held}
    del held, t
    gc.collect()
    again = [pool.tensor((n, 64), torch.float16) for n in (40, 8, 16, 8, 40, 100)]
    assert {t.data_ptr() for t in again[:5]} == ptrs  # every buffer came back, best fit first
    assert again[5].data_ptr() not in ptrs and again[5].shape == (100, 64)
    assert pool.tensor((3, 64), torch.float16).data_ptr() not in ptrs  # all in use: a new one


def test_async_block_and_admin_helpers(live, spec):
    from kvstore.keys import block_hashes

    async def main() -> None:
        async with AsyncKVClient(live.url, namespace="blocks", colocated=False) as c:
            tokens = list(range(48))
            kv = make_kv(spec, 48)
            await c.put_kv(spec, tokens, kv)
            keys = block_hashes(spec, tokens, "blocks")
            frames = await c.get_blocks(keys + [b"\1" * 32])
            assert frames[3] is None and all(frames[:3])
            assert await c.delete_blocks(keys) == 3 and await c.lookup(spec, tokens) == 0
            assert await c.put_blocks(list(zip(keys, frames[:3]))) == 3
            assert torch.equal((await c.get_kv(spec, tokens))[0], kv)
            assert await c.delete_block(keys[2]) is True and await c.delete_block(keys[2]) is False
            entries = await c.admin.entries(sort="size", limit=10, namespace="blocks")
            assert entries["total"] == 2
            assert (await c.evict_mine(tier="shm", dry_run=True))["blocks"] == 2
            assert "kvstore_tier_entries" in await c.metrics() and (await c.health())["status"] == "ok"

    asyncio.run(main())


def test_access_log_counts_repeats_and_splits_big_reports():
    from client_sdk.arena import AccessLog

    log = AccessLog(max_keys=4, max_age_s=3600)
    log.MAX_REPORT_KEYS = 2
    assert log.drain() is None and not log.due()
    log.add([{"key": "a"}, {"key": "b"}], requested=32, hit=32)
    log.add([{"key": "a"}, {"key": "c"}], requested=32, hit=16)
    assert log.due()  # 4 reads pending
    first = log.drain()
    assert first == {"keys": ["a", "b"], "counts": [2, 1], "gets": 2, "tokens_requested": 64, "tokens_hit": 48}
    second = log.drain()  # the key the first could not take, with no gets counted twice
    assert second == {"keys": ["c"], "counts": [1], "gets": 0, "tokens_requested": 0, "tokens_hit": 0}
    assert log.drain() is None and not log.due()
