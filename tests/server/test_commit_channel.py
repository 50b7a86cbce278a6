"""The commit channel (``server.commit_channel``): a co-located pooled put's one request over a
Unix socket, against real uvicorn servers (in a thread, and ``kvstore serve`` processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from client_sdk import channel as client_channel
from kvstore.wire.channel import ANSWER, REQUEST, head
from server import commit_channel
from tests.conftest import make_kv
from tests.server.conftest import ACME, make_store


def _channel_requests(url: str, status: str = "200") -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r'^kvstore_commit_channel_requests_total\{status="%s"\} (\S+)$' % status, text, re.M)
    return float(m.group(1)) if m else 0.0


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def _ask(sock: socket.socket, h: bytes, body: bytes = b"") -> tuple[int, dict]:
    sock.sendall(REQUEST.pack(len(h), len(body)) + h + body)
    status, n = ANSWER.unpack(_recv(sock, ANSWER.size))
    return status, json.loads(_recv(sock, n))


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the channel closed the connection"
        out += chunk
    return out


def _toks(i: int, n: int) -> np.ndarray:
    return np.arange(i * 1_000_000, i * 1_000_000 + n, dtype=np.uint32)


def test_colocated_puts_commit_over_the_channel_and_read_back(server, spec):
    n = spec.block_tokens * 4
    before = _channel_requests(server.url)
    with KVClient(server.url, plan=False) as client:
        for i in range(5):
            assert client.put_kv(spec, _toks(i, n), make_kv(spec, n, seed=i)) == n
        assert client.http.channel is not None and client.http.channel.path == server.svc.commit_socket
        for i in range(5):
            kv, got = client.get_kv(spec, _toks(i, n))
            assert got == n and torch.equal(kv, make_kv(spec, n, seed=i))
        assert client.stats.shm_puts == 5
    assert _channel_requests(server.url) - before == 5


def test_a_server_with_the_channel_off_offers_none_and_puts_go_over_http(serve_app, spec):
    srv = serve_app(make_store(), commit_channel=False)
    assert httpx.get(srv.url + "/v1/info").json()["colocated"]["commit_socket"] is None
    n = spec.block_tokens * 2
    with KVClient(srv.url, plan=False) as client:
        assert client.put_kv(spec, _toks(1, n), make_kv(spec, n)) == n
        assert client.http.channel is None and client.stats.shm_puts == 1
    assert _channel_requests(srv.url) == 0


def test_the_socket_is_the_servers_users_alone_and_goes_with_it(serve_app):
    srv = serve_app(make_store())
    path = srv.svc.commit_socket
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    srv.stop()
    assert not os.path.exists(os.path.dirname(path))


def test_bad_requests_get_the_routes_typed_errors_and_the_server_stays_up(server, spec):
    path = server.svc.commit_socket
    query = f"/v1/kv/put-pooled?pid={os.getpid()}&pool=p1&count=0&slot_bytes=1"
    over_http = httpx.post(server.url + query, content=b"not a kv body",
                           headers={"content-type": "application/x-kvstore-kv"})
    with _connect(path) as sock:
        status, body = _ask(sock, head("POST", query, None, "default", None), b"not a kv body")
        assert (status, body) == (over_http.status_code, over_http.json()) and status == 400
        status, body = _ask(sock, head("POST", "/v1/kv/put", None, "default", None))  # not served here
        assert status == 404 and body["error"]["type"] == "RouteNotFound"
        status, body = _ask(sock, b'{"method": 1}')
        assert status == 400 and body["error"]["field"] == "head"
        status, body = _ask(sock, b"[not json")
        assert status == 400 and body["error"]["field"] == "head"
        # the connection still serves after errors
        status, _ = _ask(sock, head("POST", query, None, "default", None), b"x")
        assert status == 400
    with _connect(path) as sock:  # a request over the size limit: 413, and the connection goes
        sock.sendall(REQUEST.pack(64, 1 << 31))
        status, n = ANSWER.unpack(_recv(sock, ANSWER.size))
        assert status == 413 and json.loads(_recv(sock, n))["error"]["field"] == "body"
        assert sock.recv(1) == b""
    n = spec.block_tokens * 2
    before = _channel_requests(server.url)
    with KVClient(server.url, plan=False) as client:
        assert client.put_kv(spec, _toks(3, n), make_kv(spec, n)) == n
    assert _channel_requests(server.url) == before + 1 and _channel_requests(server.url, "400") >= 4


def test_tokens_and_namespaces_are_checked_as_on_http(auth_server, spec):
    path = auth_server.svc.commit_socket
    query = f"/v1/kv/put-pooled?pid={os.getpid()}&pool=p1&count=0&slot_bytes=1"
    with _connect(path) as sock:
        status, body = _ask(sock, head("POST", query, None, "acme", None), b"x")
        assert status == 401 and body["error"]["type"] == "Unauthorized"
        status, body = _ask(sock, head("POST", query, "Bearer not-a-token", "acme", None), b"x")
        assert status == 401
        status, body = _ask(sock, head("POST", query, f"Bearer {ACME}", "beta", None), b"x")
        assert status == 403 and body["error"]["type"] == "Forbidden"
    n = spec.block_tokens * 2
    before = _channel_requests(auth_server.url)
    with KVClient(auth_server.url, token=ACME, namespace="acme", plan=False) as client:
        assert client.put_kv(spec, _toks(4, n), make_kv(spec, n)) == n
        assert client.get_kv(spec, _toks(4, n))[1] == n
    assert _channel_requests(auth_server.url) == before + 1


def test_a_stalled_request_loses_its_connection_within_the_body_timeout(serve_app):
    srv = serve_app(make_store(), body_timeout_s=0.3)
    with _connect(srv.svc.commit_socket) as sock:
        sock.sendall(REQUEST.pack(100, 0) + b"{")  # and nothing more
        start = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - start < 5


def test_a_client_past_the_connection_limit_puts_over_http_then_comes_back(server, spec, monkeypatch):
    monkeypatch.setattr(commit_channel, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(client_channel, "RETRY_AFTER_S", 0.0)
    n = spec.block_tokens * 2
    with KVClient(server.url, plan=False) as client:
        with _connect(server.svc.commit_socket) as held:  # takes the one connection
            _ask(held, head("POST", "/v1/nothing", None, "default", None))
            before = _channel_requests(server.url)
            assert client.put_kv(spec, _toks(5, n), make_kv(spec, n)) == n  # refused BUSY: over HTTP
            assert client.stats.shm_puts == 1 and _channel_requests(server.url) == before
        deadline = time.monotonic() + 10  # the held connection's thread ends: room again
        while server.svc.commit_channel.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.put_kv(spec, _toks(6, n), make_kv(spec, n)) == n
        assert _channel_requests(server.url) == before + 1
        assert client.get_kv(spec, _toks(6, n))[1] == n


def test_threads_of_one_client_share_a_few_connections(server, spec):
    n = spec.block_tokens * 2
    before = _channel_requests(server.url)
    with KVClient(server.url, plan=False) as client:
        client.put_kv(spec, _toks(20, n), make_kv(spec, n))  # maps the arena

        def puts(t: int) -> None:
            for i in range(5):
                assert client.put_kv(spec, _toks(100 + 10 * t + i, n), make_kv(spec, n, seed=t)) == n
        threads = [threading.Thread(target=puts, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(client.http.channel._idle) <= client_channel.IDLE_SOCKETS
        for t in range(8):
            kv, got = client.get_kv(spec, _toks(100 + 10 * t + 4, n))
            assert got == n and torch.equal(kv, make_kv(spec, n, seed=t))
    assert _channel_requests(server.url) - before == 41


def test_the_acceptor_outlives_a_failed_accept(serve_app, monkeypatch):
    real, failed = commit_channel._accept_one, []

    def flaky(listener):
        if not failed:
            failed.append(1)
            raise OSError(24, "Too many open files")
        return real(listener)
    monkeypatch.setattr(commit_channel, "_accept_one", flaky)
    srv = serve_app(make_store())
    with _connect(srv.svc.commit_socket) as sock:
        status, body = _ask(sock, head("POST", "/v1/nothing", None, "default", None))
        assert status == 404 and failed


def test_a_request_being_answered_at_shutdown_is_answered(serve_app, monkeypatch):
    started, release = threading.Event(), threading.Event()

    def slow(*args):
        started.set()
        assert release.wait(10)
        return {"done": True}
    monkeypatch.setitem(commit_channel.ROUTES, ("POST", "/v1/kv/put-pooled"), slow)
    srv = serve_app(make_store())
    path = srv.svc.commit_socket
    with _connect(path) as sock:
        h = head("POST", "/v1/kv/put-pooled", None, "default", None)
        sock.sendall(REQUEST.pack(len(h), 0) + h)
        assert started.wait(10)
        stopping = threading.Thread(target=srv.stop)
        stopping.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the channel has stopped taking connections
            try:
                _connect(path).close()
            except OSError:
                break
            time.sleep(0.01)
        release.set()
        status, n = ANSWER.unpack(_recv(sock, ANSWER.size))
        assert status == 200 and json.loads(_recv(sock, n)) == {"done": True}
        stopping.join(30)


def test_a_trickled_request_loses_its_connection_by_its_deadline(serve_app):
    srv = serve_app(make_store(), body_timeout_s=0.3, body_min_rate=1 << 20)
    with _connect(srv.svc.commit_socket) as sock:
        sock.sendall(REQUEST.pack(100, 0))
        start = time.monotonic()
        closed = False
        while time.monotonic() - start < 5 and not closed:
            try:
                sock.sendall(b" ")  # a byte at a time, each well within body_timeout_s of the last
                sock.settimeout(0.1)
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        assert closed and time.monotonic() - start < 2


@pytest.fixture
def short_tmp():
    """A temp dir with a short path (a Unix socket's path is at most 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvch-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_restarted_server_is_found_again_and_a_killed_ones_socket_goes(tmp_path, short_tmp, spec):
    env = small_env(tmp_path / "a", TMPDIR=short_tmp)
    first = ServeProcess(env).start()
    n = spec.block_tokens * 4
    try:
        with KVClient(first.url, plan=False) as client:
            assert client.put_kv(spec, _toks(7, n), make_kv(spec, n, seed=7)) == n
            old = client.http.channel.path
            assert os.path.dirname(old).startswith(os.path.join(short_tmp, f"kvstore-commit-{first.proc.pid}-"))
            first.kill()  # kill -9: its socket directory stays behind
            assert os.path.exists(old)
            second = ServeProcess(small_env(tmp_path / "b", TMPDIR=short_tmp), port=first.port).start()
            try:
                assert not os.path.exists(os.path.dirname(old))  # removed at the next start
                for i in range(8, 12):  # the first after the restart may go another way; none fails
                    assert client.put_kv(spec, _toks(i, n), make_kv(spec, n, seed=i)) == n
                new = httpx.get(second.url + "/v1/info").json()["colocated"]["commit_socket"]
                assert new != old and client.http.channel is not None and client.http.channel.path == new
                kv, got = client.get_kv(spec, _toks(11, n))
                assert got == n and torch.equal(kv, make_kv(spec, n, seed=11))
                assert _channel_requests(second.url) >= 2
            finally:
                second.stop()
    finally:
        first.kill()


def test_frames_by_key_commit_over_the_channel(server):
    from tests.server.test_blocks_by_key import keys, payloads, put

    ks, data = keys(8, "pages"), payloads(8)
    before = _channel_requests(server.url)
    with KVClient(server.url, namespace="pages", plan=False) as client:
        assert put(client, ks, data, ns="pages") == 8
        assert _channel_requests(server.url) - before >= 1  # the first grant, then the put
        got = client.get_blocks(ks)
    assert [bytes(memoryview(f))[-4096:] for f in got] == data
