"""Disk faults at the service: a block file damaged on disk is caught on read, quarantined and a miss.

The server keeps its blocks on the nvme tier alone (raw, so a read back is bit for bit). One
block file of a four-block sequence is damaged in place; a get then returns the prefix before
it, bit for bit, never the damaged bytes, and the file is in ``quarantine/``. The same holds
after a restart, where start-up indexes files by their headers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient

SPEC = SPECS[0]
TOKENS = list(range(7_000, 7_064))  # four blocks of 16


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # The file layout: these damage one block's file (the log layout's damage is
    # tests/tiers/test_nvme_log.py's).
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw",
               KVSTORE_NVME_LAYOUT="files", KVSTORE_LOG_LEVEL="warning")
    return env


def _damage(path: Path, how: str) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if how == "bit flip":
            f.seek(size - 100)  # in the body: the header still parses
            byte = f.read(1)[0]
            f.seek(size - 100)
            f.write(bytes([byte ^ 0x10]))
        elif how == "truncated":
            f.truncate(size - 4096)
        else:  # zero-filled, as after a crash of a file system without data journaling
            f.write(bytes(size))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("how", ["bit flip", "truncated", "zero-filled"])
def test_a_damaged_block_file_is_a_miss_and_quarantined(tmp_path, how):
    env = _env(tmp_path)
    server = ServeProcess(env).start()
    try:
        with KVClient(server.url, namespace="disk", colocated=False, plan=False) as client:
            client.put_kv(SPEC, TOKENS, expected_kv(0, TOKENS))
            key = client.lookup_blocks(SPEC, TOKENS)["blocks"][2]["key"]
            [path] = [p for p in (tmp_path / "data").rglob(f"{key}*") if "quarantine" not in p.parts]
            _damage(path, how)
            for _ in range(2):  # the first read catches it; the second finds the miss recorded
                kv, n = client.get_kv(SPEC, TOKENS)
                assert n == 32 and torch.equal(kv, expected_kv(0, TOKENS[:32]))
            assert client.lookup(SPEC, TOKENS) == 32
            assert not path.exists()
            assert [p.name for p in (tmp_path / "data").rglob("quarantine/*") if key in p.name]
            # a put of the same sequence writes the block again
            client.put_kv(SPEC, TOKENS, expected_kv(0, TOKENS))
            kv, n = client.get_kv(SPEC, TOKENS)
            assert n == 64 and torch.equal(kv, expected_kv(0, TOKENS))
            _damage(path, how)  # and damaged again, it is caught after a restart too
    finally:
        server.stop()
    server = ServeProcess(env).start()
    try:
        with KVClient(server.url, namespace="disk", colocated=False, plan=False) as client:
            kv, n = client.get_kv(SPEC, TOKENS)
            assert n == 32 and torch.equal(kv, expected_kv(0, TOKENS[:32]))
    finally:
        server.stop()
