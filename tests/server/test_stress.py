"""Concurrent clients of both media against one ``kvstore serve``: every answer is exact or a miss.

The default run is short; ``pytest -m slow`` runs the long one.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from tests.conftest import make_kv, make_spec


def _worker(url: str, wid: int, ops: int, errors: list[str]) -> None:
    rng = random.Random(wid)
    spec = make_spec(head_dim=32)
    seqs = {i: [wid * 100_000 + i * 1000 + t for t in range(rng.choice((16, 48, 80)))] for i in range(6)}
    kvs = {i: make_kv(spec, len(s), seed=wid * 100 + i) for i, s in seqs.items()}
    try:
        with KVClient(url, namespace=f"w{wid % 3}", colocated=None if wid % 2 else False, backoff_s=0.01) as c:
            for _ in range(ops):
                i = rng.randrange(6)
                op = rng.random()
                if op < 0.4:
                    c.put_kv(spec, seqs[i], kvs[i])
                elif op < 0.8:
                    got, n = c.get_kv(spec, seqs[i])
                    if n % 16 or not torch.equal(got, kvs[i][:, :, :, :n]):
                        errors.append(f"worker {wid}: wrong KV for seq {i} (n={n})")
                elif op < 0.9:
                    n = c.lookup(spec, seqs[i])
                    if n % 16 or n > len(seqs[i]):
                        errors.append(f"worker {wid}: lookup {n}")
                else:
                    c.delete(spec, seqs[i])
    except Exception as exc:  # noqa: BLE001 - collected and asserted on below
        errors.append(f"worker {wid}: {type(exc).__name__}: {exc}")


def _stress(tmp_path, workers: int, ops: int) -> None:
    # a small shm tier: placement demotes to cxl and nvme while the workers run
    proc = ServeProcess(small_env(tmp_path / "data", KVSTORE_SHM_BYTES="2MiB")).start()
    errors: list[str] = []
    try:
        threads = [threading.Thread(target=_worker, args=(proc.url, w, ops, errors)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert proc.proc.poll() is None, proc.log()
    finally:
        proc.stop()
    assert not errors, errors[:10]


def test_concurrent_clients_short(tmp_path):
    _stress(tmp_path, workers=4, ops=25)


@pytest.mark.slow
def test_concurrent_clients_long(tmp_path):
    _stress(tmp_path, workers=8, ops=3000)
