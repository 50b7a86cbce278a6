"""Shared-memory faults at the service: a reader killed holding a lease, a server killed holding the arena."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from bench.reliability_kit.load_worker import expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient
from kvstore.memory.shm import SHM_DIR
from tests.reliability.lease_holder import NAMESPACE, SEQUENCE, SPEC


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="16MiB",
               KVSTORE_STAGING_BYTES="16MiB", KVSTORE_LOG_LEVEL="warning")
    return env


def _shm_tier(url: str) -> dict:
    tiers = httpx.get(f"{url}/admin/tiers", timeout=10).json()["tiers"]
    return next(t for t in tiers if t["kind"] == "shm")


def _wait_for(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_reader_killed_holding_a_lease_gives_its_range_back(tmp_path):
    server = ServeProcess(_env(tmp_path)).start()
    try:
        with KVClient(server.url, namespace=NAMESPACE, plan=False) as client:
            client.put_kv(SPEC, SEQUENCE, expected_kv(0, SEQUENCE))
            holder = subprocess.Popen([sys.executable, "-m", "tests.reliability.lease_holder", server.url],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert holder.stdout is not None and holder.stdout.readline() == "leased\n"
                client.delete(SPEC, SEQUENCE)  # its first block's range is leased: retired, not freed
                assert _shm_tier(server.url)["details"]["retired"] == "1"
                holder.kill()
                holder.wait(timeout=10)
            finally:
                holder.kill()
            # the kernel dropped the dead reader's lock; the next reservation takes the range back
            other = list(range(9_000, 9_016))
            client.put_kv(SPEC, other, expected_kv(0, other))
            assert _wait_for(lambda: _shm_tier(server.url)["details"]["retired"] == "0")
            kv, n = client.get_kv(SPEC, other)
            assert n == len(other) and torch.equal(kv, expected_kv(0, other))
    finally:
        server.stop()


def _segments(url: str) -> set[str]:
    info = httpx.get(f"{url}/v1/info", timeout=10).json()["colocated"]
    return {info["segment"], info["staging_segment"]}


def test_a_server_killed_leaves_no_segment_after_the_next_start(tmp_path):
    env = _env(tmp_path)
    server = ServeProcess(env).start()
    dead = _segments(server.url)
    assert all(os.path.exists(os.path.join(SHM_DIR, s)) for s in dead)
    server.kill()  # SIGKILL: nothing unlinks its segments
    assert all(os.path.exists(os.path.join(SHM_DIR, s)) for s in dead)
    server = ServeProcess(env).start()
    try:
        alive = _segments(server.url)
        left = [s for s in dead if os.path.exists(os.path.join(SHM_DIR, s))]
        assert not left, f"the new server left its dead predecessor's segments: {left}"
        with KVClient(server.url, namespace=NAMESPACE, plan=False) as client:  # and it serves
            client.put_kv(SPEC, SEQUENCE, expected_kv(0, SEQUENCE))
            assert client.get_kv(SPEC, SEQUENCE)[1] == len(SEQUENCE)
    finally:
        server.stop()
    assert not [s for s in alive if os.path.exists(os.path.join(SHM_DIR, s))], "a clean stop left segments"
