"""The reliability scenarios, as functions that run one and return its figures.

``tests/reliability/test_*.py`` assert on the figures; ``kvstore bench reliability`` runs the
same scenarios at full size and tabulates them. Each uses real processes: ``kvstore serve``
(``serve_process.ServeProcess``), client processes started by module name
(``python -m bench.reliability_kit.load_worker``: importable wherever kvstore is installed),
and real files and shared memory.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import torch

from client_sdk import KVClient
from bench.reliability_kit.crash_client import NAMESPACE as CRASH_NAMESPACE
from bench.reliability_kit.crash_client import SPEC, sequence
from bench.reliability_kit.load_worker import FAMILIES, NAMESPACE, PER_FAMILY, SPECS, expected_kv, matches, tokens_of
from bench.reliability_kit.serve_process import ServeProcess
from bench.serving import free_port

__all__ = ["WORKERS", "CLIENTS", "run_load", "run_crashes", "churn", "crash_env", "damage", "fuzz_blocks"]


WORKERS = 16


def run_load(tmp_path, ops_per_worker: int, seed: int = 0, lossy: bool = False, restart: bool = False) -> dict:
    """The scenario against a fresh server; its figures.

    Args:
        lossy: keep the cold tiers' default int8 and check gets within its rounding;
            otherwise every tier is raw and gets are checked bit for bit.
        restart: once the workers have made ``RESTART_AFTER_PUTS`` puts, stop the server and start
            another on the same port and data: co-located workers hold the old arena mapped
            and must map the new one (its shm segments are new), never read the old as the new.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # Upper tiers of a few MiB against ~40 MiB of sequences: puts push blocks down, gets
    # pull them back up, and deletes and evictions race both.
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_SHM_BYTES="4MiB", KVSTORE_CXL_BYTES="4MiB",
               KVSTORE_NVME_BYTES="512MiB", KVSTORE_STAGING_BYTES="32MiB", KVSTORE_LOG_LEVEL="warning")
    if not lossy:  # every tier raw: then any difference from the expected KV is wrong KV
        env["KVSTORE_TIER_CODECS"] = "cxl=raw,nvme=raw"
    if restart:  # more of the sequences stay in the arena, where co-located gets read with no request
        env["KVSTORE_SHM_BYTES"] = "24MiB"
    server = ServeProcess(env).start()
    restarted = False
    try:
        workers = [subprocess.Popen([sys.executable, "-m", "bench.reliability_kit.load_worker", server.url, str(w),
                                     str(ops_per_worker), str(seed), *(["lossy"] if lossy else [])],
                                    stdout=subprocess.PIPE, text=True)
                   for w in range(WORKERS)]
        if restart:
            restarted = _restart_midway(server, workers)
        results, failed = [], []
        for w, proc in enumerate(workers):
            out, _ = proc.communicate(timeout=3600)
            if proc.returncode:
                failed.append((w, proc.returncode))
            else:
                results.append(json.loads(out.strip().splitlines()[-1]))
        swept = _sweep(server.url, lossy)
        moves = httpx.get(f"{server.url}/admin/moves", params={"limit": 10_000}, timeout=30).json()["moves"]
        health = httpx.get(f"{server.url}/healthz", timeout=10).status_code
    finally:
        server.stop()
    latencies: dict[str, list[float]] = {}
    for r in results:
        for op, ts in r["latencies"].items():
            latencies.setdefault(op, []).extend(ts)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    figures = {
        "ops": sum(r["ops"] for r in results), "failed_workers": failed,
        "mismatches": sum(r["mismatches"] for r in results) + swept["mismatches"],
        "verified_tokens": sum(r["verified_tokens"] for r in results) + swept["tokens"],
        "errors": dict(errors), "moves": len(moves), "health": health, "swept_mismatches": swept["mismatches"],
        "examples": [e for r in results for e in r["examples"]][:10],
        "media": sorted({r["medium"] for r in results if r["medium"]}),
        "gets_with_no_request": sum(r.get("gets_with_no_request", 0) for r in results),
        "restarted": restarted,
        "arenas_mapped": [len(r.get("arenas_mapped", [])) for r in results],
        "arenas_read": len({a for r in results for a in r.get("arenas_read", [])}),
        "p50_ms": {op: 1e3 * statistics.median(ts) for op, ts in latencies.items()},
        "p99_ms": {op: 1e3 * sorted(ts)[int(0.99 * (len(ts) - 1))] for op, ts in latencies.items()},
    }
    return figures


RESTART_AFTER_PUTS = 200
"""Puts the workers make before ``run_load(restart=True)`` restarts the server: about half of the
test's run (16 workers of 80 operations, 30% puts)."""


def _puts(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r'^kvstore_store_ops_total\{counter="put_calls"\} ([0-9.e+]+)$', text, re.M)
    if match is None:
        raise RuntimeError("/metrics shows no put_calls counter (kvstore_store_ops_total)")
    return int(float(match.group(1)))


def _restart_midway(server: ServeProcess, workers: list[subprocess.Popen]) -> bool:
    """Once the workers made ``RESTART_AFTER_PUTS`` puts (or all exited first: False), stop the
    server and start another on its port and data directory."""
    deadline = time.monotonic() + 300
    while _puts(server.url) < RESTART_AFTER_PUTS:
        if all(w.poll() is not None for w in workers):
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers made fewer than {RESTART_AFTER_PUTS} puts in 300 s")
        time.sleep(0.05)
    server.stop()
    server.start()
    return True


def _sweep(url: str, lossy: bool) -> dict:
    """After the storm: every sequence reads back as its expected prefix, whatever survived."""
    mismatches = tokens = 0
    with KVClient(url, namespace=NAMESPACE, colocated=False, plan=False) as client:
        for which, spec in enumerate(SPECS):
            for seq in range(FAMILIES * PER_FAMILY):
                toks = tokens_of(seq)
                kv, n = client.get_kv(spec, toks)
                tokens += n
                if n and not matches(kv, expected_kv(which, toks[:n]), lossy):
                    mismatches += 1
    return {"mismatches": mismatches, "tokens": tokens}


CLIENTS = 4
PUTS_PER_CYCLE = 20_000
"""Room for one client's puts in a cycle (it makes a few hundred): cycle c numbers them from c * this."""


def crash_env(data: Path, **settings: str) -> dict[str, str]:
    """The crash scenario's server environment; ``settings`` adds KVSTORE_* variables
    (``KVSTORE_NVME_LAYOUT="log"``...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # raw on nvme (a cold tier keeps int8 by default): then any difference is damage, not rounding
    env.update(KVSTORE_DATA_DIR=str(data), KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw",
               KVSTORE_LOG_LEVEL="warning", **settings)
    return env


def _cycle(url: str, server: ServeProcess, cycle: int, rng: random.Random) -> dict[int, tuple[list[int], int]]:
    """One storm and kill; each client's acknowledged puts and the one it had in flight."""
    clients = [subprocess.Popen([sys.executable, "-m", "bench.reliability_kit.crash_client", url, str(c),
                                 str(cycle * PUTS_PER_CYCLE)], stdout=subprocess.PIPE, text=True)
               for c in range(CLIENTS)]
    try:
        for c, proc in enumerate(clients):
            assert proc.stdout is not None
            if (line := proc.stdout.readline()) != "ready\n":
                raise RuntimeError(f"crash client {c} did not start (exit {proc.poll()}, said {line!r})")
        proc_timer = rng.uniform(0.3, 2.0)
        try:
            clients[0].wait(timeout=proc_timer)  # a client that dies early fails the test below
        except subprocess.TimeoutExpired:
            pass
        server.kill()  # SIGKILL, mid-storm
    finally:
        for proc in clients:
            proc.kill()
    acked: dict[int, tuple[list[int], int]] = {}
    for c, proc in enumerate(clients):
        out, _ = proc.communicate(timeout=30)
        lines = out.splitlines()
        done = [int(x) for x in lines if x.strip()]  # a line is only ever written whole
        acked[c] = (done, (done[-1] + 1) if done else cycle * PUTS_PER_CYCLE)
    return acked


def run_crashes(tmp_path: Path, cycles: int, seed: int = 0, **settings: str) -> dict:
    rng = random.Random(seed)
    data, port = tmp_path / "data", free_port()
    all_acked: list[tuple[int, int]] = []
    figures = {"cycles": 0, "acknowledged": 0, "checked": 0, "lost": 0, "torn_served": 0, "in_flight_found": 0}
    for cycle in range(cycles):
        server = ServeProcess(crash_env(data, **settings), port=port).start()
        acked = _cycle(server.url, server, cycle, rng)
        assert all(done for done, _ in acked.values()), f"a client acknowledged nothing in cycle {cycle}: {acked}"
        server = ServeProcess(crash_env(data, **settings), port=port).start()
        try:
            with KVClient(server.url, namespace=CRASH_NAMESPACE, colocated=False, plan=False) as client:
                for c, (done, in_flight) in acked.items():
                    all_acked.extend((c, i) for i in done)
                    figures["acknowledged"] += len(done)
                    tokens = sequence(c, in_flight)
                    kv, n = client.get_kv(SPEC, tokens)
                    if n:
                        figures["in_flight_found"] += 1
                        figures["torn_served"] += not torch.equal(kv, expected_kv(0, tokens[:n]))
                # every acknowledged put so far: this cycle's and all before
                for c, i in all_acked:
                    tokens = sequence(c, i)
                    kv, n = client.get_kv(SPEC, tokens)
                    figures["checked"] += 1
                    if n < len(tokens):
                        figures["lost"] += 1
                    elif not torch.equal(kv, expected_kv(0, tokens)):
                        figures["torn_served"] += 1
        finally:
            server.stop()
        stray = [p for p in data.rglob("*.tmp") if "quarantine" not in p.parts]
        assert not stray, f"temp files among the data after a restart: {stray[:5]}"
        figures["cycles"] += 1
    return figures


def churn(tmp_path: Path, cycles: int) -> dict:
    """``memory_churn`` in its own process (a clean resident set); its figures."""
    done = subprocess.run([sys.executable, "-m", "bench.reliability_kit.memory_churn", str(cycles), str(tmp_path)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"memory_churn failed: {done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def damage(frame: bytes, rng: random.Random) -> bytes:
    """``frame`` with one bit flipped, cut short, extended, or replaced by random bytes."""
    how = rng.choice(("flip", "truncate", "extend", "random"))
    if how == "flip":
        at = rng.randrange(len(frame))
        return frame[:at] + bytes([frame[at] ^ (1 << rng.randrange(8))]) + frame[at + 1:]
    if how == "truncate":
        return frame[:rng.randrange(len(frame))]
    if how == "extend":
        return frame + rng.randbytes(rng.randint(1, 64))
    return rng.randbytes(rng.randint(0, 4096))


def fuzz_blocks(tmp_path: Path, cases: int, seed: int = 0) -> dict:
    """Damaged frames to ``PUT /v1/blocks/{key}`` and ``POST /v1/blocks/put`` of a fresh server.

    Returns:
        ``{"cases", "statuses": {status: count}, "5xx", "stored", "healthy"}``: "stored" counts
        damaged frames the server kept (must be 0).
    """
    from client_sdk.media import encode_blocks

    rng = random.Random(seed)
    tokens = list(range(12_000, 12_016))
    [(key, frame)] = [(bytes(k), bytes(f)) for k, f in encode_blocks(SPECS[0], tokens, expected_kv(0, tokens), "fuzz")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "fuzz-data"), KVSTORE_LOG_LEVEL="warning")
    server = ServeProcess(env).start()
    statuses: Counter[int] = Counter()
    stored = 0
    try:
        with httpx.Client(base_url=server.url, headers={"X-KV-Namespace": "fuzz"}, timeout=30) as http:
            for _ in range(cases):
                bad = damage(frame, rng)
                statuses[http.put(f"/v1/blocks/{key.hex()}", content=bad).status_code] += 1
                body = json.dumps({"blocks": [{"key": key.hex(), "frame": bad.hex()}]})
                statuses[http.post("/v1/blocks/put", content=body,
                                   headers={"content-type": "application/json"}).status_code] += 1
                if http.head(f"/v1/blocks/{key.hex()}").status_code == 200:
                    stored += 1
                    http.delete(f"/v1/blocks/{key.hex()}")
            healthy = http.get("/healthz").status_code == 200
    finally:
        server.stop()
    return {"cases": 2 * cases, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "5xx": sum(v for k, v in statuses.items() if k >= 500), "stored": stored, "healthy": healthy}
