"""ENOSPC at the service: the nvme tier's file system fills up under a stream of puts.

``kvstore serve`` keeps its data directory on a tmpfs of a few MiB (mounted for the test: it
needs root). Puts go on well past what the disk holds. With a tier after nvme the blocks that
do not fit fall back to it and no client sees an error; with none, the store frees room by
force (its coldest blocks go, as if the tier's capacity were the disk's) and counts it, and a
put it still cannot place is a typed 507 ``TierFull``. Either way the blocks that were stored
read back bit for bit (no partial file is ever served), and the server stays up.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient
from kvstore.errors import KVStoreError
from tests.mounts import small_tmpfs

SPEC = SPECS[0]


@pytest.fixture
def small_fs(tmp_path):
    yield from small_tmpfs(tmp_path / "small", "3m")


def _server(small_fs, tmp_path, **settings: str) -> ServeProcess:
    """``kvstore serve`` with its data on the small file system, its log and audit log off it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(small_fs / "data"), KVSTORE_STAGING_BYTES="4MiB", KVSTORE_NVME_BYTES="64MiB",
               KVSTORE_AUDIT_LOG=str(tmp_path / "audit.jsonl"), KVSTORE_LOG_LEVEL="warning", **settings)
    server = ServeProcess(env)
    server.log_path = tmp_path / "serve.log"
    return server.start()


def test_a_full_file_system_makes_room_by_force_and_serves_only_whole_blocks(small_fs, tmp_path):
    server = _server(small_fs, tmp_path, KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="1MiB",
                     KVSTORE_TIER_CODECS="nvme=raw")
    stored, errors = [], Counter()
    try:
        with KVClient(server.url, namespace="enospc", colocated=False, plan=False) as client:
            for s in range(40):  # 40 x 128 KiB: 5 MiB against 1 MiB of shm and 3 MiB of disk
                tokens = [s * 1_000 + t for t in range(64)]
                try:
                    client.put_kv(SPEC, tokens, expected_kv(0, tokens))
                    stored.append(tokens)
                except KVStoreError as exc:
                    errors[type(exc).__name__] += 1
            served = 0
            for s in range(40):
                tokens = [s * 1_000 + t for t in range(64)]
                kv, n = client.get_kv(SPEC, tokens)
                assert not n or torch.equal(kv, expected_kv(0, tokens[:n])), f"sequence {s}: wrong KV"
                served += n
            assert client.health()["status"] == "ok"
            stats = client.admin.stats()
    finally:
        server.stop()
    counters = stats["counters"]
    print({"stored": len(stored), "errors": dict(errors), "served_tokens": served,
           "room_forced": counters["room_forced"], "evicted": counters["blocks_evicted"]})
    assert set(errors) <= {"TierFull"}, errors
    # The disk refused writes its 64 MiB capacity admits: the scenario happened, and was met by force.
    assert counters["room_forced"] > 0, "the file system never filled: the scenario did not happen"
    assert counters["blocks_evicted"] > 0
    assert len(stored) > 40 // 2 and 0 < served < 40 * 64  # most puts stored; the disk kept what fitted
    assert "freeing room by force" in server.log_path.read_text()


def test_a_full_nvme_tier_falls_back_to_the_next_tier(small_fs, tmp_path):
    """nvme first, cxl after it: once the file system is full, blocks land in cxl, whole."""
    server = _server(small_fs, tmp_path, KVSTORE_TIERS="nvme,cxl", KVSTORE_CXL_BYTES="32MiB",
                     KVSTORE_TIER_CODECS="nvme=raw,cxl=raw")
    try:
        with KVClient(server.url, namespace="enospc", colocated=False, plan=False) as client:
            seqs = [[s * 1_000 + t for t in range(64)] for s in range(40)]  # 5 MiB against 3 MiB of disk
            for tokens in seqs:
                assert client.put_kv(SPEC, tokens, expected_kv(0, tokens)) == 64  # no error reaches a client
            tiers = Counter()
            for tokens in seqs:
                kv, n = client.get_kv(SPEC, tokens)
                assert n == 64 and torch.equal(kv, expected_kv(0, tokens))
                tiers.update(b["tier"] for b in client.lookup_blocks(SPEC, tokens)["blocks"])
    finally:
        server.stop()
    print(dict(tiers))
    assert tiers["nvme"] > 0 and tiers["cxl"] > 0  # the disk took what fitted, cxl the rest
