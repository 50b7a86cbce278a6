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
- no temp file sits among the data files: start-up moved them to quarantine;
- no client failed other than by losing its server.

The default run does 3 cycles; the ``slow`` one 20.

Two more scenarios run the same cycles and checks where the server moves acknowledged data
while it dies:

- **compaction**: the log layout with 512 KiB segments and its compactor looking every 50 ms;
  each client also puts and deletes a scratch sequence twice the size of each put, so two
  thirds of what reaches the log is dead and the compactor keeps rewriting the acknowledged
  frames into new segments. Each storm is killed only after the compaction counter
  (``/admin/stats``) rose during it; the files as the kill left them must hold compacted copies
  of live frames; a scratch sequence whose delete returned must not come back.
- **demotion**: ``KVSTORE_TIERS=shm,nvme`` with a 4 MiB shm tier. A durable put there raises
  ``NotDurable``; the client acknowledges it once ``lookup_blocks`` finds every token durable,
  which only placement's demotion to nvme makes so. Each storm is killed only after the
  demotion counter rose during it; some acknowledgements must have come that way. The
  checking server runs on the same tiers: its gets promote what they read into shm, and its
  clean stop drops shm, so the next cycle's check finds an acknowledged put only if the
  promotion kept its durable copy (``IndexEntry.kept``).

Each runs 2 cycles by default (about 20-30 s on 2 busy cores), 10 ``slow``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bench.reliability_kit.crash_client import NAMESPACE, SPEC, sequence
from bench.reliability_kit.load_worker import expected_kv
from bench.reliability_kit.scenarios import CRASHES, crash_env, run_crashes
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient


def _check(figures: dict, cycles: int) -> None:
    print(figures)  # shown with -s
    assert figures["cycles"] == cycles
    assert figures["client_errors"] == 0  # a client failed other than by losing its server
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


def _check_compacting(figures: dict, cycles: int) -> None:
    _check(figures, cycles)
    # the proof the scenario tested compaction: it ran in every storm before the kill (the kill
    # waits for that), and live frames were rewritten: their copies were on disk when it came
    assert len(figures["compactions_by_cycle"]) == cycles and min(figures["compactions_by_cycle"]) > 0
    assert figures["copied_frames"] > 0
    assert figures["deleted_checked"] > 0 and figures["resurrected"] == 0


def test_durable_puts_survive_kill_9_while_the_compactor_rewrites_their_segments(tmp_path):
    _check_compacting(run_crashes(tmp_path, cycles=2, seed=3, **CRASHES["compaction"]), 2)


@pytest.mark.slow
def test_durable_puts_survive_10_kill_9_under_compaction(tmp_path):
    _check_compacting(run_crashes(tmp_path, cycles=10, seed=5, **CRASHES["compaction"]), 10)


def _check_demoting(figures: dict, cycles: int) -> None:
    _check(figures, cycles)
    # demotions ran in every storm before the kill (the kill waits for that); only a demotion
    # makes a put that was NotDurable durable, so these acknowledgements are the demotions' own
    assert len(figures["demotions_by_cycle"]) == cycles and min(figures["demotions_by_cycle"]) > 0
    assert figures["acknowledged_after_demotion"] > 0


def test_puts_made_durable_by_demotion_survive_kill_9(tmp_path):
    _check_demoting(run_crashes(tmp_path, cycles=2, seed=4, **CRASHES["demotion"]), 2)


@pytest.mark.slow
def test_puts_made_durable_by_demotion_survive_10_kill_9(tmp_path):
    _check_demoting(run_crashes(tmp_path, cycles=10, seed=6, **CRASHES["demotion"]), 10)


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
