"""Crash durability: four clients put with ``durable=True`` while the server is ``kill -9``ed.

Each cycle starts ``kvstore serve`` on the nvme tier alone over the same data
directory, lets four client processes put sequences in a loop (each reports a
put only after ``put_kv(..., durable=True)`` returned), kills the server with
SIGKILL at a seeded random moment, then the clients, and restarts the server.
Then:

- every put acknowledged as durable, in this cycle or any before, reads back
  whole and bit for bit;
- the put each client had in flight reads back as a prefix of itself, bit for
  bit, or not at all: nothing torn or foreign is served;
- no temp file sits among the data files: start-up moved them to quarantine.

The default run does 3 cycles; the ``slow`` one 20.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.reliability_kit.crash_client import NAMESPACE, SPEC, sequence
from bench.reliability_kit.load_worker import expected_kv
from bench.reliability_kit.scenarios import crash_env, run_crashes
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient


def _check(figures: dict, cycles: int) -> None:
    print(figures)  # shown with -s
    assert figures["cycles"] == cycles
    assert figures["lost"] == 0
    assert figures["torn_served"] == 0
    assert figures["acknowledged"] > 0 and figures["checked"] >= figures["acknowledged"]


def test_durable_puts_survive_kill_9(tmp_path):
    # The defaults: the log layout under a group commit. Segments appended through the page cache,
    # a durable put's check waiting for the group commit that covers it; each restart cuts the
    # open segment's torn tail and seals it.
    _check(run_crashes(tmp_path, cycles=3), 3)


def test_durable_puts_survive_kill_9_on_the_file_layout_each_put_synced(tmp_path):
    _check(run_crashes(tmp_path, cycles=3, seed=2, KVSTORE_NVME_LAYOUT="files", KVSTORE_NVME_SYNC_INTERVAL_S="0"), 3)


@pytest.mark.slow
def test_durable_puts_survive_20_kill_9(tmp_path):
    _check(run_crashes(tmp_path, cycles=20, seed=1), 20)


async def _async_durable_put(url: str, tokens: list[int]) -> int:
    from client_sdk import AsyncKVClient

    async with AsyncKVClient(url, namespace=NAMESPACE, colocated=False, plan=False) as client:
        return await client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)


def test_a_durable_put_on_a_volatile_tier_is_refused_not_promised(tmp_path):
    env = crash_env(tmp_path / "data")
    env.update(KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="64MiB")
    server = ServeProcess(env).start()
    try:
        with KVClient(server.url, namespace=NAMESPACE, colocated=False, plan=False) as client:
            tokens = sequence(0, 1)
            from kvstore.errors import NotDurable

            with pytest.raises(NotDurable) as info:
                client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)
            assert info.value.stored_tokens == len(tokens) and info.value.durable_tokens == 0
            # the put itself stands
            kv, n = client.get_kv(SPEC, tokens)
            assert n == len(tokens) and torch.equal(kv, expected_kv(0, tokens))
            with pytest.raises(NotDurable):
                asyncio.run(_async_durable_put(server.url, tokens))
            assert client.lookup_blocks(SPEC, tokens)["durable_tokens"] == 0
            # once placement has moved it to nvme, the same put is durable (a no-op store)
            client.admin.migrate(client.lookup_blocks(SPEC, tokens)["blocks"][0]["key"], "nvme")
            assert client.lookup_blocks(SPEC, tokens)["durable_tokens"] == SPEC.block_tokens  # a prefix
            first = tokens[:SPEC.block_tokens]
            assert client.put_kv(SPEC, first, expected_kv(0, first), durable=True) == len(first)
    finally:
        server.stop()
