"""End to end: ``kvstore serve`` in a subprocess with a real redis-server; clients in other processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from client_sdk._common import kv_parts
from kvstore.wire.rest import KV_MEDIA
from kvstore.keys import block_hashes, normalize_tokens
from tests.conftest import make_kv, make_spec, shm_segments

CHILD = textwrap.dedent("""
    import json, sys, torch
    from client_sdk import KVClient
    from tests.conftest import make_kv, make_spec
    url, mode, colocated = sys.argv[1], sys.argv[2], {"auto": None, "remote": False}[sys.argv[3]]
    spec = make_spec(dtype="bfloat16", num_layers=6, head_dim=64)
    tokens = list(range(1000, 1000 + 200))
    with KVClient(url, namespace="e2e", colocated=colocated, plan=False) as c:  # the medium under test, fixed
        if mode == "put":
            out = {"stored": c.put_kv(spec, tokens, make_kv(spec, 200, seed=7))}
        else:
            kv, n = c.get_kv(spec, tokens)
            raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
            out = {"n": n, "lookup": c.lookup(spec, tokens), "bytes": raw.hex()}
        out["medium"] = c.stats.last_medium
    print(json.dumps(out))
""")


def _child(url: str, mode: str, colocated: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, url, mode, colocated], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture
def serve_with_redis(tmp_path, redis_server):
    proc = ServeProcess(small_env(tmp_path / "data", KVSTORE_REDIS_URL=redis_server.url)).start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("colocated", ["auto", "remote"])
def test_put_in_one_process_get_in_another_bit_identical(serve_with_redis, colocated):
    url = serve_with_redis.url
    put = _child(url, "put", colocated)
    assert put == {"stored": 192, "medium": "shm" if colocated == "auto" else "http"}
    got = _child(url, "get", colocated)
    assert got["n"] == 192 and got["lookup"] == 192
    assert got["medium"] == ("shm" if colocated == "auto" else "http")
    spec = make_spec(dtype="bfloat16", num_layers=6, head_dim=64)
    want = make_kv(spec, 200, seed=7)[:, :, :, :192].contiguous()
    assert bytes.fromhex(got["bytes"]) == want.view(__import__("torch").uint8).numpy().tobytes()
    with KVClient(url) as c:
        tiers = {t["name"]: t for t in c.admin.tiers()}
    assert list(tiers) == ["shm", "cxl", "redis", "nvme"] and tiers["redis"]["state"] == "ok"


def _raw_put(port: int, spec, tokens, kv) -> tuple[socket.socket, bytes, bytes]:
    """A put request split in two: everything but the last 64 KiB, and that tail."""
    body = b"".join(bytes(memoryview(p).cast("B")) for p in kv_parts(spec, normalize_tokens(tokens), kv))
    head = (f"POST /v1/kv/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {KV_MEDIA}\r\n"
            f"X-KV-Namespace: default\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock, head + body[:-65536], body[-65536:]


def _read_answer(sock: socket.socket) -> bytes:
    """A whole HTTP answer with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_sigterm_lets_in_flight_requests_finish_and_releases_shm(tmp_path):
    proc = ServeProcess(small_env(tmp_path / "data")).start()
    mine = shm_segments(proc.proc.pid)
    spec = make_spec()
    tokens = list(range(320))
    kv = make_kv(spec, 320)
    with KVClient(proc.url, colocated=False) as c:  # one block to the durable tier, to see it survive
        c.put_kv(spec, tokens[:16], kv[:, :, :, :16])
        assert c.admin.migrate(block_hashes(spec, tokens)[0], "nvme")["moved"] is True
    sock, first, rest = _raw_put(proc.port, spec, tokens, kv)
    sock.sendall(first)
    time.sleep(0.3)
    proc.signal(signal.SIGTERM)  # the request is in flight: headers and most of the body are in
    time.sleep(0.5)
    assert proc.proc.poll() is None, "the server exited before its in-flight request finished"
    sock.sendall(rest)
    answer = _read_answer(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"stored_tokens": 320}
    code = proc.wait(30)
    assert code in (0, -signal.SIGTERM), proc.log()
    assert mine and not shm_segments(proc.proc.pid), "shm segments outlived the server"
    # the durable tier was flushed: a new server on the same data dir serves that block
    again = ServeProcess(small_env(tmp_path / "data")).start()
    try:
        with KVClient(again.url, colocated=False) as c:
            assert c.lookup(spec, tokens) == 16
            got, n = c.get_kv(spec, tokens)
        assert n == 16 and (got.float() - kv[:, :, :, :16].float()).abs().max() < 0.05  # int8 in nvme
    finally:
        again.stop()


def test_sigint_stops_the_server_too(tmp_path):
    proc = ServeProcess(small_env(tmp_path / "data", KVSTORE_LOG_LEVEL="info")).start()
    mine = shm_segments(proc.proc.pid)
    proc.signal(signal.SIGINT)
    code = proc.wait(30)
    # 130, as after Ctrl-C; a shell's background job inherits SIGINT ignored (this process then
    # too), and uvicorn re-raises the signal under the disposition it found: the server exits 0
    assert code == (0 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 130), proc.log()
    assert "Application shutdown complete" in proc.log() and "Traceback" not in proc.log()
    assert "froze" in proc.log() and "(at start)" in proc.log()  # server.collector: its start kept out of gc walks
    assert mine and not shm_segments(proc.proc.pid)


def test_serve_flags_and_env(tmp_path):
    env = small_env(tmp_path / "env-data", KVSTORE_TIERS="shm,nvme", KVSTORE_CODEC="int8")
    proc = ServeProcess(env, "--data-dir", str(tmp_path / "flag-data"), "--shm-bytes", "8MiB",
                        "--admin-token", "admin-token-xyz-123").start()
    try:
        with KVClient(proc.url, token="admin-token-xyz-123") as c:
            tiers = c.admin.tiers()
        assert [t["name"] for t in tiers] == ["shm", "nvme"] and tiers[0]["capacity_bytes"] == 8 << 20
        assert (tmp_path / "flag-data" / "nvme-log").is_dir() and not (tmp_path / "env-data" / "nvme-log").exists()
        assert "auth on" in proc.log()
    finally:
        proc.stop()
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--shm-bytes", "lots"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "size" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--tokens-file", str(tmp_path / "none.json")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "tokens file" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve"], env={**env, "KVSTORE_GC_FREEZE_AFTER_S": "-1"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gc_freeze_after_s" in bad.stderr
