"""Concurrent load: 16 client processes of mixed puts, gets, lookups, deletes and evictions against a
real ``kvstore serve`` whose small upper tiers keep placement moving blocks; every get is checked.

The default run does 2,400 operations; the ``slow`` one 100,000. The figures are zero
mismatches, zero errors and zero failed workers; latencies are printed (``-s``), never asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import Counter

import httpx
import pytest
import torch

from client_sdk import KVClient
from tests.reliability.load_worker import FAMILIES, NAMESPACE, PER_FAMILY, SPECS, expected_kv, matches, tokens_of
from tests.server.live import ServeProcess

WORKERS = 16


def run_load(tmp_path, ops_per_worker: int, seed: int = 0, lossy: bool = False) -> dict:
    """The scenario against a fresh server; its figures.

    Args:
        lossy: keep the cold tiers' default int8 and check gets within its rounding;
            otherwise every tier is raw and gets are checked bit for bit.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # Upper tiers of a few MiB against ~40 MiB of sequences: puts push blocks down, gets
    # pull them back up, and deletes and evictions race both.
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_SHM_BYTES="4MiB", KVSTORE_CXL_BYTES="4MiB",
               KVSTORE_NVME_BYTES="512MiB", KVSTORE_STAGING_BYTES="32MiB", KVSTORE_LOG_LEVEL="warning")
    if not lossy:  # every tier raw: then any difference from the expected KV is wrong KV
        env["KVSTORE_TIER_CODECS"] = "cxl=raw,nvme=raw"
    server = ServeProcess(env).start()
    try:
        workers = [subprocess.Popen([sys.executable, "-m", "tests.reliability.load_worker", server.url, str(w),
                                     str(ops_per_worker), str(seed), *(["lossy"] if lossy else [])],
                                    stdout=subprocess.PIPE, text=True)
                   for w in range(WORKERS)]
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
        "p50_ms": {op: 1e3 * statistics.median(ts) for op, ts in latencies.items()},
        "p99_ms": {op: 1e3 * sorted(ts)[int(0.99 * (len(ts) - 1))] for op, ts in latencies.items()},
    }
    print(json.dumps(figures, indent=1))
    return figures


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


def _check(figures: dict, ops: int) -> None:
    assert figures["failed_workers"] == []
    assert figures["ops"] == ops
    assert figures["mismatches"] == 0
    assert figures["errors"] == {}
    assert figures["health"] == 200
    assert figures["verified_tokens"] > 0
    assert figures["moves"] > 0, "placement moved nothing: the scenario did not exercise moves"
    assert figures["media"] == ["http", "shm"]


def test_concurrent_mixed_load_serves_no_wrong_kv(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=150), WORKERS * 150)


def test_with_int8_cold_tiers_only_rounding_differs(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=100, seed=2, lossy=True), WORKERS * 100)


@pytest.mark.slow
def test_concurrent_mixed_load_100k_ops(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=6250, seed=1), WORKERS * 6250)


def test_the_lossy_check_tells_rounding_from_another_blocks_kv():
    want = expected_kv(0, tokens_of(3))
    rounded = want.float() + torch.empty(want.shape).uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert matches(rounded.half(), want, lossy=True) and not matches(rounded.half(), want, lossy=False)
    other = expected_kv(0, tokens_of(4)[:len(tokens_of(3))])  # same length, other sequence's tokens
    assert not matches(other, want, lossy=True)
    assert not matches(want + 2, want, lossy=True)
