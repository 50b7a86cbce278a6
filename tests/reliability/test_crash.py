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
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client_sdk import KVClient
from tests.reliability.crash_client import NAMESPACE, SPEC, sequence
from tests.reliability.load_worker import expected_kv
from tests.server.live import ServeProcess
from tests.tiers.redis_servers import free_port

CLIENTS = 4


def _env(data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # raw on nvme (a cold tier keeps int8 by default): then any difference is damage, not rounding
    env.update(KVSTORE_DATA_DIR=str(data), KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw",
               KVSTORE_LOG_LEVEL="warning")
    return env


def _cycle(url: str, server: ServeProcess, cycle: int, rng: random.Random) -> dict[int, tuple[list[int], int]]:
    """One storm and kill; each client's acknowledged puts and the one it had in flight."""
    clients = [subprocess.Popen([sys.executable, "-m", "tests.reliability.crash_client", url, str(c),
                                 str(cycle * 1_000_000)], stdout=subprocess.PIPE, text=True)
               for c in range(CLIENTS)]
    try:
        for proc in clients:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
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
        acked[c] = (done, (done[-1] + 1) if done else cycle * 1_000_000)
    return acked


def run_crashes(tmp_path: Path, cycles: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    data, port = tmp_path / "data", free_port()
    all_acked: list[tuple[int, int]] = []
    figures = {"cycles": 0, "acknowledged": 0, "checked": 0, "lost": 0, "torn_served": 0, "in_flight_found": 0}
    for cycle in range(cycles):
        server = ServeProcess(_env(data), port=port).start()
        acked = _cycle(server.url, server, cycle, rng)
        assert all(done for done, _ in acked.values()), f"a client acknowledged nothing in cycle {cycle}: {acked}"
        server = ServeProcess(_env(data), port=port).start()
        try:
            with KVClient(server.url, namespace=NAMESPACE, colocated=False, plan=False) as client:
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
    print(figures)
    return figures


def _check(figures: dict, cycles: int) -> None:
    assert figures["cycles"] == cycles
    assert figures["lost"] == 0
    assert figures["torn_served"] == 0
    assert figures["acknowledged"] > 0 and figures["checked"] >= figures["acknowledged"]


def test_durable_puts_survive_kill_9(tmp_path):
    _check(run_crashes(tmp_path, cycles=3), 3)


@pytest.mark.slow
def test_durable_puts_survive_20_kill_9(tmp_path):
    _check(run_crashes(tmp_path, cycles=20, seed=1), 20)


async def _async_durable_put(url: str, tokens: list[int]) -> int:
    from client_sdk import AsyncKVClient

    async with AsyncKVClient(url, namespace=NAMESPACE, colocated=False, plan=False) as client:
        return await client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)


def test_a_durable_put_on_a_volatile_tier_is_refused_not_promised(tmp_path):
    env = _env(tmp_path / "data")
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
            # once placement has moved it to nvme, the same put is durable (a no-op store)
            client.migrate(client.lookup_blocks(SPEC, tokens)["blocks"][0]["key"], "nvme")
            first = tokens[:SPEC.block_tokens]
            assert client.put_kv(SPEC, first, expected_kv(0, first), durable=True) == len(first)
    finally:
        server.stop()
