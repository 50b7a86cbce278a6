"""Bodies in flight cannot take a live ``kvstore serve`` down.

32 connections each declare a 512 MiB ``/v1/kv/put`` body, push 64 MiB of it as fast
as the server reads (2 GiB in all, against the 768 MiB that large bodies may hold under
a 1 GiB cap), then trickle, while ordinary clients put and get. The server's resident
memory stays under its baseline plus ``KVSTORE_MAX_INFLIGHT_BYTES``, every ordinary
request succeeds, and every flooding connection is answered 503 (the cap, with
Retry-After) or 408 (the body deadline). Before the cap, each such connection committed
its whole declared size at once: this test would have asked for 16 GiB.

The flood is sized so that the cap must refuse some bodies however slow the machine: the
large share fills from 768 MiB read, and the body deadline (15.7 s) leaves the server
that long to read them: 49 MiB/s. Here it reads the flood at about 150 MiB/s.

A watchdog kills the server if it grows a GiB past the bound, so a regression fails
here instead of taking the machine.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient
from kvstore.wire.rest import KV_MEDIA

SPEC = SPECS[0]
NS = "flood"
CAP = 1 << 30
DECLARED = 512 << 20  # within the large share (768 MiB), so not 413
FLOODERS = 32
FAST_BYTES = 64 << 20


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inflight")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp / "data"), KVSTORE_MAX_INFLIGHT_BYTES=str(CAP),
               KVSTORE_INFLIGHT_WAIT_S="1", KVSTORE_BODY_TIMEOUT_S="5",
               KVSTORE_BODY_MIN_RATE=str(48 << 20),  # a 512 MiB body's deadline: 5 s + 10.7 s
               KVSTORE_LOG_LEVEL="warning",
               KVSTORE_TIERS="shm", KVSTORE_SHM_BYTES=str(256 << 20))
    server = ServeProcess(env).start()
    yield server
    server.stop()


def _flood(port: int, answers: list[bytes], trace: list[str], stop: threading.Event) -> None:
    """Declare 512 MiB, send up to 64 MiB of it as fast as the server takes it, then trickle."""
    head = (f"POST /v1/kv/put HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\nContent-Type: {KV_MEDIA}\r\n"
            f"Content-Length: {DECLARED}\r\n\r\n").encode()
    part = memoryview(bytes(1 << 20))
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        s.settimeout(0.1)
        sent = 0
        while not stop.is_set():
            try:
                if s.recv(1, socket.MSG_PEEK):  # answered
                    break
            except socket.timeout:
                pass
            except OSError:
                break
            try:
                sent += s.send(part if sent < FAST_BYTES else part[:1024])
            except socket.timeout:  # the server stopped reading: it waits for room, or has answered
                continue
            except OSError:  # reset after its answer
                break
        s.settimeout(10)
        got = b""
        try:
            while chunk := s.recv(65536):  # the answer closes the connection
                got += chunk
        except OSError as exc:
            got = got or f"no answer: {exc}".encode()
        answers.append(got)
        trace.append(f"{sent >> 20} MiB sent, {'answered' if got[:5] == b'HTTP/' else 'NOT answered'} after "
                     f"{time.monotonic() - began:.1f} s")


def test_flooding_uploads_stay_under_the_cap_and_ordinary_clients_are_served(live):
    server = live
    pid = server.proc.pid
    tokens = list(range(2_000, 2_000 + 64))
    kv = expected_kv(0, tokens)
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        for _ in range(3):  # warm: the pooled buffers an ordinary put and get use are baseline
            assert client.put_kv(SPEC, tokens, kv) == len(tokens)
            assert client.get_kv(SPEC, tokens)[1] == len(tokens)
    baseline = _rss(pid)
    bound = baseline + CAP

    stop, killed, peak = threading.Event(), [], [baseline]

    def watch() -> None:
        while not stop.is_set():
            rss = _rss(pid)
            peak[0] = max(peak[0], rss)
            if rss > bound + (1 << 30):
                killed.append(rss)
                server.proc.kill()
                return
            time.sleep(0.02)

    answers: list[bytes] = []
    trace: list[str] = []  # per flooder, for a failure's message
    flooders = [threading.Thread(target=_flood, args=(server.port, answers, trace, stop)) for _ in range(FLOODERS)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in flooders:
        t.start()
    served, failures = 0, []
    deadline = time.monotonic() + 60
    try:
        with KVClient(server.url, namespace=NS, colocated=False, plan=False, timeout_s=30) as client:
            i = 0
            while any(t.is_alive() for t in flooders) and time.monotonic() < deadline:
                toks = list(range(10_000 + 64 * i, 10_000 + 64 * (i + 1)))
                try:
                    assert client.put_kv(SPEC, toks, expected_kv(0, toks)) == len(toks)
                    got, n = client.get_kv(SPEC, tokens)
                    assert n == len(tokens) and got.equal(kv)
                    served += 1
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    failures.append(repr(exc))
                i += 1
    finally:
        stop.set()
        for t in flooders:
            t.join(30)
        watcher.join(5)
    assert not killed, f"server RSS reached {killed[0] >> 20} MiB, bound {bound >> 20} MiB: killed"
    assert peak[0] <= bound, f"peak RSS {peak[0] >> 20} MiB over baseline {baseline >> 20} + cap {CAP >> 20}"
    assert not failures and served >= 3, (served, failures[:3])
    assert len(answers) == FLOODERS
    statuses = sorted({a[:12] for a in answers})
    assert all(a.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) for a in answers), (statuses, trace)
    busy = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
    print(f"baseline {baseline >> 20} MiB, peak {peak[0] >> 20} MiB (cap {CAP >> 20}); {served} ordinary "
          f"put+get rounds; {len(busy)} x 503, {len(answers) - len(busy)} x 408")
    assert busy, "the cap never refused a body: the flood did not reach it"
    assert all(b"retry-after:" in a.lower() and b"ServerBusy" in a for a in busy), busy[0][:300]
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        got, n = client.get_kv(SPEC, tokens)  # still up, data whole
        assert n == len(tokens) and got.equal(kv)
        toks = list(range(10_000 + 64 * (i - 1), 10_000 + 64 * i))  # the last ordinary put, whole
        got, n = client.get_kv(SPEC, toks)
        assert n == len(toks) and got.equal(expected_kv(0, toks))
