"""A durable put waits for the nvme tier's group commit; other puts do not.

A real ``kvstore serve`` on nvme alone with a group commit too slow to happen by itself within
the test (30 s): a plain put returns with its writes unsynced; ``put_kv(durable=True)``'s check
(``POST /v1/lookup?sync=1``) makes the server sync them first, sync and async clients alike.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import AsyncKVClient, KVClient
from tests.conftest import make_kv, make_spec

SPEC = make_spec()


def syncs(url: str) -> int:
    with urllib.request.urlopen(f"{url}/admin/tiers", timeout=10) as r:
        nvme = json.loads(r.read())["tiers"][0]
    return int(nvme["details"]["fsync"].split("(")[1].split()[0])


def test_a_durable_put_waits_for_the_group_commit_and_a_plain_one_does_not(tmp_path):
    proc = ServeProcess(small_env(tmp_path, KVSTORE_TIERS="nvme", KVSTORE_NVME_SYNC_INTERVAL_S="30")).start()
    try:
        with KVClient(proc.url, retries=0) as c:
            assert syncs(proc.url) == 0
            c.put_kv(SPEC, list(range(64)), make_kv(SPEC, 64))
            assert syncs(proc.url) == 0  # acknowledged, not yet synced
            assert c.put_kv(SPEC, list(range(100, 164)), make_kv(SPEC, 64, 1), durable=True) == 64
            assert syncs(proc.url) == 1  # one sync covered both puts
            assert c.lookup_blocks(SPEC, list(range(64)))["durable_tokens"] == 64

        async def durable() -> int:
            async with AsyncKVClient(proc.url, retries=0) as ac:
                return await ac.put_kv(SPEC, list(range(200, 264)), make_kv(SPEC, 64, 2), durable=True)
        assert asyncio.run(durable()) == 64 and syncs(proc.url) == 2
    finally:
        proc.stop()
