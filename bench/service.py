"""``kvstore bench service``: the SDK against a live ``kvstore serve``, next to same-run baselines.

==================  =====================================================  =========
row                 baseline in the same run                                target
==================  =====================================================  =========
co-located put/get  memcpy into a reused buffer (numpy ``copyto``)          >= 0.7x
remote put/get      curl uploading / downloading the same bytes to/from a   >= 0.6x
                    bare uvicorn endpoint (a raw ASGI app, no framework)
lookup req/s        a bare FastAPI route taking the same body; the client   >= 0.7x
                    does the SDK's work (encode the request, parse JSON)
==================  =====================================================  =========

The server is ``kvstore serve`` in a child process (shm + cxl + nvme, sized
for the run); the baselines' servers are child processes too, so every row
pays the same process boundary. KV is fp16 ``[32, 2, 8, T, 128]``: 32 MiB is
T = 256 (16 blocks of 16 tokens), 1 MiB is T = 8 (one block of 8 tokens).
Every put writes new blocks (fresh token ids; the previous sequence is
deleted outside the clock); gets read the same stored sequence. ``get_kv``
rows return a fresh tensor per call, as the API does; the ``get_kv(out=)``
rows receive into a reused buffer. Samples are interleaved across rows, in an
order rotated every round, so drift, and the slowdown right after a put, hit
all of them alike. Every row sees the same cache state: by default
(``--caches warm``) each sample follows an untimed call of the same row, as in
a loop; with ``--caches cold`` each follows a 96 MiB scrub, as a read of KV
written long ago after other work would. (Interleaving alone gave the memcpy
rows a source the row before had just read, and the store's rows a cold one.) The client process runs torch with one
intra-op thread unless ``--torch-threads`` says otherwise (``codec.decode``
copies with torch, and its thread team stalls on a busy two-core machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from fastapi import Request

from bench.report import header, publish
from bench.serving import child, free_port

__all__ = ["run", "bare_app", "bare_fastapi"]

MiB = 1 << 20
_SCRUB_BYTES = 96 * MiB
"""``--caches cold`` reads and writes this much before each sample: three times this
machine's 32 MiB L3, so no row starts with anything in cache."""
TARGETS = {"shm": 0.7, "http": 0.6, "lookup": 0.7}


# -- baseline servers (run as ``python -m bench.service bare|fastapi PORT NBYTES``) -------------


def bare_app(nbytes: int):
    """A raw ASGI app: GET /blob/<n> sends n bytes (at most ``nbytes``), PUT /sink drains the body."""
    blob = memoryview(np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8).tobytes())

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] in ("PUT", "POST"):
            more = True
            while more:
                message = await receive()
                more = message.get("more_body", False)
            body = b"ok"
        else:
            path = scope["path"]
            body = blob[:int(path.rsplit("/", 1)[1])] if path.startswith("/blob/") else b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


def bare_fastapi():
    """A FastAPI app whose one route reads the body and answers a small JSON, as lookup does."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/bare")
    async def bare(request: Request) -> dict:
        await request.body()
        return {"tokens": 0, "block_tokens": 16, "blocks": []}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app


def _serve_baseline(kind: str, port: int, nbytes: int) -> None:
    import uvicorn

    app = bare_app(nbytes) if kind == "bare" else bare_fastapi()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- measurement ------------------------------------------------------------------------------


def _curl_times(args: list[str], url: str, n: int) -> list[float]:
    """Seconds per transfer, as curl's ``time_total`` reports (no process start-up)."""
    cmd = ["curl", "-s", "--http1.1"]
    for _ in range(n):
        cmd += [*args, "-o", "/dev/null", "-w", "%{time_total}\\n", url]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout
    return [float(x) for x in out.split()]


def _spec(size_name: str):
    from kvstore.spec import KVSpec

    tokens, bt = (256, 16) if size_name == "32MiB" else (8, 8)
    return KVSpec("bench-service", 32, 8, 128, "float16", bt, fingerprint="bench-1"), tokens


def rate_of(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def _measure_size(size_name: str, repeats: int, url: str, bare_port: int, workdir: str, cold: bool) -> dict:
    from client_sdk import KVClient

    spec, n_tokens = _spec(size_name)
    nbytes = spec.bytes_per_token * n_tokens
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(spec.kv_shape(n_tokens), generator=gen).to(torch.float16)
    shm = KVClient(url, namespace="bench", plan=False)  # each row measures one fixed medium
    http = KVClient(url, namespace="bench", colocated=False, plan=False)
    fixed = list(range(1_000_000, 1_000_000 + n_tokens))
    shm.put_kv(spec, fixed, kv)
    out = torch.empty(nbytes, dtype=torch.uint8)
    dst = np.empty(nbytes, np.uint8)
    src = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    upload = os.path.join(workdir, f"upload-{size_name}.bin")
    with open(upload, "wb") as f:
        f.write(src.tobytes())
    counter = [0]

    def put_with(client: KVClient) -> Callable[[], float]:
        def once() -> float:
            counter[0] += 1
            toks = [counter[0] * 4096 + i for i in range(n_tokens)]
            start = time.perf_counter()
            stored = client.put_kv(spec, toks, kv)
            took = time.perf_counter() - start
            assert stored == n_tokens, stored
            client.delete(spec, toks)
            return took
        return once

    def get_with(client: KVClient, reuse: bool) -> Callable[[], float]:
        def once() -> float:
            start = time.perf_counter()
            _, n = client.get_kv(spec, fixed, out=out if reuse else None)
            took = time.perf_counter() - start
            assert n == n_tokens, n
            return took
        return once

    def memcpy_put() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    def memcpy_get() -> float:
        start = time.perf_counter()
        np.copyto(out.numpy(), src)
        return time.perf_counter() - start

    rows: dict[str, Callable[[], float]] = {
        "shm put": put_with(shm), "shm get": get_with(shm, False), "shm get out=": get_with(shm, True),
        "memcpy put": memcpy_put, "memcpy get": memcpy_get,
        "http put": put_with(http), "http get": get_with(http, False), "http get out=": get_with(http, True),
        "curl put": lambda: _curl_times(["-X", "PUT", "--data-binary", f"@{upload}"],
                                        f"http://127.0.0.1:{bare_port}/sink", 1)[0],
        "curl get": lambda: _curl_times([], f"http://127.0.0.1:{bare_port}/blob/{nbytes}", 1)[0],
    }
    for _ in range(3):  # warm-up: leases, connections, pooled buffers, page faults
        for fn in rows.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in rows}
    scrub = np.zeros(_SCRUB_BYTES if cold else 0, np.uint8)
    order = list(rows.items())
    for r in range(repeats):
        # rotate the order each round: whatever runs right after a put runs slower (a 1 MiB get
        # measured 43-50 us there, 36 us in a loop of gets), and a fixed order would always
        # hand that to the same row
        for name, fn in order[r % len(order):] + order[:r % len(order)]:
            if cold:
                scrub += 1  # the sample starts from cold caches: data, and the interpreter's own
            else:
                fn()  # the sample follows the same call, as in a loop over one buffer
            times[name].append(fn())
    assert shm.stats.shm_gets and shm.stats.shm_puts and not http.stats.shm_gets, "a row used the wrong medium"
    got, _ = http.get_kv(spec, fixed)
    assert torch.equal(got, kv), "KV read back over HTTP differs from what was stored"
    shm_stats = shm.stats.to_dict()
    shm.close()
    http.close()
    rates = {name: rate_of(nbytes, ts) for name, ts in times.items()}
    med = {name: r["median"] for name, r in rates.items()}
    ratios = {
        "shm put / memcpy": med["shm put"] / med["memcpy put"],
        "shm get / memcpy": med["shm get"] / med["memcpy get"],
        "shm get out= / memcpy": med["shm get out="] / med["memcpy get"],
        "http put / curl put": med["http put"] / med["curl put"],
        "http get / curl get": med["http get"] / med["curl get"],
        "http get out= / curl get": med["http get out="] / med["curl get"],
    }
    return {"size": size_name, "bytes": nbytes, "gbps": rates, "ratios": ratios, "shm_client": shm_stats}


def _measure_lookup(url: str, fastapi_port: int, seconds: float) -> dict:
    from client_sdk import KVClient
    from client_sdk._common import headers_for, kv_parts, tokens_of
    from client_sdk._http import Connection, Endpoint

    spec, _ = _spec("32MiB")
    tokens = list(range(1_000_000, 1_000_256))
    client = KVClient(url, namespace="bench", plan=False)
    if client.lookup(spec, tokens) != len(tokens):  # the 32 MiB rows stored it already, unless --quick
        client.put_kv(spec, tokens, torch.zeros(spec.kv_shape(len(tokens)), dtype=torch.float16))
    bare = Connection(Endpoint.parse(f"http://127.0.0.1:{fastapi_port}"), connect_timeout_s=5, timeout_s=30)
    headers = headers_for(None, "bench", "application/x-kvstore-kv")

    def bare_once() -> None:  # the SDK's client-side work, against a route that does nothing
        head = bare.request("POST", "/bare", headers, kv_parts(spec, tokens_of(tokens), None))
        json.loads(bare.read_body())
        assert head.status == 200

    def lookup_once() -> None:
        assert client.lookup(spec, tokens) == len(tokens)

    def rps(fn: Callable[[], None]) -> float:
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
        return n / (time.perf_counter() - start)

    for fn in (bare_once, lookup_once):
        for _ in range(50):
            fn()
    samples: dict[str, list[float]] = {"lookup": [], "bare": []}
    for _ in range(3):
        samples["lookup"].append(rps(lookup_once))
        samples["bare"].append(rps(bare_once))
    client.close()
    bare.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"tokens": len(tokens), "rps": {k: {"median": med[k], "min": min(v), "max": max(v)}
                                         for k, v in samples.items()},
            "ratio": med["lookup"] / med["bare"]}


def run(*, quick: bool = False, repeats: int | None = None, out_dir: str | Path | None = None,
        torch_threads: int = 1, caches: str = "warm") -> dict:
    """Measure every row; print a table; write JSON; return the result.

    Args:
        caches: ``warm`` (each sample right after an untimed call of the same row) or
            ``cold`` (each after 96 MiB are read and written).
        torch_threads: torch intra-op threads in this (client) process; 0 keeps torch's default.
            The server runs with ``KVSTORE_TORCH_THREADS`` (default 1) either way.
    """
    if caches not in ("warm", "cold"):
        raise ValueError(f"caches must be 'warm' or 'cold', got {caches!r}")
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if shutil.which("curl") is None:
        raise RuntimeError("kvstore bench service needs curl for its HTTP baseline")
    repeats = repeats or (3 if quick else 9)
    sizes = ["1MiB"] if quick else ["32MiB", "1MiB"]
    workdir = tempfile.mkdtemp(prefix=".kvstore-bench-service-", dir=".")
    port, bare_port, fastapi_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=os.path.join(workdir, "data"), KVSTORE_SHM_BYTES="512MiB",
               KVSTORE_CXL_BYTES="64MiB", KVSTORE_STAGING_BYTES="128MiB", KVSTORE_LOG_LEVEL="warning")
    rows, lookup = [], None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(child([sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port)],
                                       port, env))
            biggest = max(_spec(s)[0].bytes_per_token * _spec(s)[1] for s in sizes)
            for kind, p in (("bare", bare_port), ("fastapi", fastapi_port)):
                stack.enter_context(child([sys.executable, "-m", "bench.service", kind, str(p), str(biggest)], p,
                                           path="/healthz"))
            url = f"http://127.0.0.1:{port}"
            for size in sizes:
                rows.append(_measure_size(size, repeats, url, bare_port, workdir, caches == "cold"))
            lookup = _measure_lookup(url, fastapi_port, 0.5 if quick else 2.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = header("service", repeats=repeats, caches=caches, client_torch_threads=torch.get_num_threads(),
                    unit="GB/s (1e9 B/s) of KV bytes, median over samples; lookup in requests/s, one client",
                    targets=TARGETS, rows=rows, lookup=lookup)
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    lines = [f"kvstore bench service  ({result['repeats']} samples, median GB/s, {result.get('caches', 'warm')} caches)"]
    for row in result["rows"]:
        g = row["gbps"]
        lines.append(f"\n{row['size']}")
        for name in g:
            lines.append(f"  {name:<16} {g[name]['median']:7.2f}  ({g[name]['min']:.2f}-{g[name]['max']:.2f})")
        for name, ratio in row["ratios"].items():
            kind = "shm" if name.startswith("shm") else "http"
            ok = "ok" if ratio >= TARGETS[kind] else "NO"
            lines.append(f"  {name:<26} {ratio:5.2f}x  target >= {TARGETS[kind]}x {ok}")
    if result.get("lookup"):
        lk = result["lookup"]
        ok = "ok" if lk["ratio"] >= TARGETS["lookup"] else "NO"
        lines.append(f"\nlookup ({lk['tokens']} tokens): {lk['rps']['lookup']['median']:.0f} req/s, bare FastAPI "
                     f"route {lk['rps']['bare']['median']:.0f} req/s: {lk['ratio']:.2f}x  target >= "
                     f"{TARGETS['lookup']}x {ok}")
    return "\n".join(lines)


if __name__ == "__main__":  # baseline servers for the bench's child processes
    _serve_baseline(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
