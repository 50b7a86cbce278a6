"""A client of the crash scenarios: puts in a loop until it is killed.

    python -m bench.reliability_kit.crash_client URL CLIENT START [MODE]

Put number ``i`` (from START on) stores ``sequence(CLIENT, i)``. The first line on stdout is
``ready`` once the client is connected; every later line is written in one write (the parent
never reads half a line) and says one of:

    i     put ``i`` is acknowledged as durable
    ~i    put ``i`` is stored but not yet durable (``NotDurable``); ``i`` follows once it is
    -i    ``scratch(CLIENT, i)`` was put and deleted, both acknowledged

MODE (default ``durable``):

- ``durable``: ``put_kv(..., durable=True)``; a reported ``i`` is a put that returned.
- ``scratch``: as ``durable``, and after each put a scratch sequence twice its size is put
  and deleted: two thirds of what reaches the log is dead, so sealed segments pass the
  compactor's dead fraction and it rewrites the live frames (the acknowledged puts) beside
  them while the puts go on.
- ``demote``: for a server whose top tier is volatile (``shm,nvme``), where a durable put raises
  ``NotDurable`` until placement demotes its blocks to nvme: the put is reported ``~i``, and
  ``i`` once ``lookup_blocks(...)["durable_tokens"]`` covers every token, the acknowledgement a
  user of such a server gets. The client keeps putting meanwhile (at most ``PENDING`` puts
  waiting): its new blocks are the pressure that makes placement demote the older ones.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv

SPEC = SPECS[0]
NAMESPACE = "crash"
MODES = ("durable", "scratch", "demote")
PENDING = 8
"""Puts a ``demote`` client lets wait for demotion before it stops putting and only polls: four
clients' worth (about 8 MiB) is more than the small shm tier holds, so waiting never deadlocks."""


def sequence(client: int, i: int) -> list[int]:
    """Put ``i`` of ``client``: 64 to 192 tokens (4 to 12 blocks) of its own.

    Clients 0-3 and ``i`` below 1,000,000 keep every token id under 2**32 and apart.
    """
    n = 64 + 16 * ((i * 7 + client) % 9)
    return [client * 1_000_000_000 + i * 1_000 + t for t in range(n)]


def scratch(client: int, i: int) -> list[int]:
    """The scratch sequence put and deleted after put ``i``: twice as long as ``sequence(client, i)``,
    in the ids 300-683 of put ``i``'s range that no sequence uses."""
    n = 2 * len(sequence(client, i))
    return [client * 1_000_000_000 + i * 1_000 + 300 + t for t in range(n)]


def _say(line: str) -> None:
    os.write(1, f"{line}\n".encode())  # one write: the parent never reads half a line


def _durable_loop(kv_client, client: int, start: int, with_scratch: bool) -> None:
    i = start
    while True:
        tokens = sequence(client, i)
        kv_client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)
        _say(str(i))
        if with_scratch:
            dead = scratch(client, i)
            kv_client.put_kv(SPEC, dead, expected_kv(0, dead))
            kv_client.delete(SPEC, dead)
            _say(f"-{i}")
        i += 1


def _durable_now(kv_client, client: int, i: int) -> bool:
    tokens = sequence(client, i)
    return kv_client.lookup_blocks(SPEC, tokens)["durable_tokens"] == len(tokens)


def _demote_loop(kv_client, client: int, start: int) -> None:
    from kvstore.errors import NotDurable

    pending: list[int] = []
    i = start
    while True:
        if len(pending) < PENDING:
            tokens = sequence(client, i)
            try:
                kv_client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)
                _say(str(i))  # spilled straight to nvme (shm above its watermark): durable at once
            except NotDurable:
                _say(f"~{i}")
                pending.append(i)
            i += 1
        else:
            time.sleep(0.01)  # only waiting on placement: do not spin the server with lookups
        for j in [j for j in pending if _durable_now(kv_client, client, j)]:
            pending.remove(j)
            _say(str(j))


def main(url: str, client: int, start: int, mode: str = "durable") -> None:
    from client_sdk import ConnectionFailed, KVClient

    if mode not in MODES:
        raise SystemExit(f"crash_client: mode must be one of {MODES}, got {mode!r}")
    torch.set_num_threads(1)
    with KVClient(url, namespace=NAMESPACE, colocated=False, plan=False, retries=0, timeout_s=30) as kv_client:
        kv_client.lookup(SPEC, sequence(client, start))  # connected
        _say("ready")
        try:
            if mode == "demote":
                _demote_loop(kv_client, client, start)
            else:
                _durable_loop(kv_client, client, start, with_scratch=mode == "scratch")
        except ConnectionFailed:  # the server was killed: the scenario, not a failure
            return


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
