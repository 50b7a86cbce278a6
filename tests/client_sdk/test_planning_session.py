"""The planner's predictions in a mixed session against a real ``kvstore serve``.

A user saw, after a two-minute session, "prediction error 96%" on the dashboard and first small
puts taking 24.9x their prediction. Here a co-located ``KVClient`` runs 200 transfers against a
``kvstore serve`` child process: puts and gets of 64 KiB to 4 MiB in a seeded random order (a
get reads back something put before, so some find their slots remembered and some ask). The
prediction error, as ``kvstore.decisions`` defines it and ``/admin/decisions`` serves it, must
be under 25% after the warm-up; and each (op, option, path)'s predictions must be within 2x of
what the transfers took from their 5th transfer on (stalls of a loaded machine aside).
"""

from __future__ import annotations

import math
import random
import time

import httpx
import numpy as np
import pytest
import torch

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from kvstore.decisions import WARMUP_TRANSFERS, prediction_error
from kvstore.spec import KVSpec

SPEC = KVSpec("planner-session", fingerprint="rev-1", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
              block_tokens=16)  # 2 KiB a token, 32 KiB a block
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20]
TRANSFERS = 200


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    """The client's decision records, and ``/admin/decisions``' answer, after one mixed session."""
    proc = ServeProcess(small_env(tmp_path_factory.mktemp("serve"), KVSTORE_SHM_BYTES="256MiB")).start()
    try:
        rng = random.Random(7)
        gen = torch.Generator().manual_seed(7)
        stored: list[np.ndarray] = []
        with KVClient(proc.url) as client:
            for _ in range(TRANSFERS):
                n = rng.choice(SIZES) // SPEC.bytes_per_token
                if stored and rng.random() < 0.5:
                    assert client.get_kv(SPEC, rng.choice(stored))[1] > 0
                else:
                    toks = np.array(rng.sample(range(1 << 30), n), dtype=np.uint32)
                    client.put_kv(SPEC, toks, torch.randn(SPEC.kv_shape(n), generator=gen).to(torch.float16))
                    stored.append(toks)
            local = client.decisions(4 * TRANSFERS)
        deadline = time.monotonic() + 10  # the last report goes out as the client closes
        while True:
            served = httpx.get(proc.url + "/admin/decisions", params={"limit": 4096}).json()
            if served["total"] >= len(local) or time.monotonic() > deadline:
                return local, served
            time.sleep(0.1)
    finally:
        proc.stop()


def test_the_prediction_error_after_warm_up_is_under_25_percent(session):
    local, served = session
    # A transfer retried over another medium is two records; a report that failed is dropped.
    assert len(local) >= TRANSFERS and served["total"] >= 0.9 * len(local)
    ids = {d["id"] for d in served["decisions"]}
    error = served["prediction_error"]
    # One definition: the server's figure is the client's, for the same records.
    assert error == prediction_error([d for d in local if d["id"] in ids])
    assert error["samples"] >= TRANSFERS // 2, error
    assert error["median"] < 0.25, error


def test_predictions_come_within_2x_by_the_5th_transfer_and_stay(session):
    local, _ = session
    ratios: dict[tuple[str, str, str], list[float]] = {}
    for d in local:
        if d["choice"] != "recompute" and not d["error"] and d["predicted_actual_s"]:
            ratios.setdefault((d["op"], d["choice"], d["path"]), []).append(d["actual_s"] / d["predicted_actual_s"])
    later = [abs(math.log(r)) for rs in ratios.values() for r in rs[WARMUP_TRANSFERS:]]
    within = sum(x <= math.log(2) for x in later) / len(later)
    # A loaded 2-core machine stalls a transfer now and then (a 64 KiB put took 114 ms among
    # 1.6 ms ones): those are no prediction's to meet, but they are few.
    assert within >= 0.8, {k: [round(r, 2) for r in rs] for k, rs in ratios.items()}
    for key, rs in ratios.items():
        if len(rs) > WARMUP_TRANSFERS:
            typical = sorted(abs(math.log(r)) for r in rs[WARMUP_TRANSFERS:])[len(rs[WARMUP_TRANSFERS:]) // 2]
            assert typical <= math.log(2), (key, [round(r, 2) for r in rs])
