"""A client of the crash scenario: durable puts in a loop until it is killed.

    python -m bench.reliability_kit.crash_client URL CLIENT START

Put number ``i`` (from START on) stores ``sequence(CLIENT, i)`` with
``put_kv(..., durable=True)`` and, once that returned, writes ``i`` and a
newline to stdout in one write: a reported ``i`` is a put acknowledged as
durable. The first line is ``ready`` once the client is connected.
"""

from __future__ import annotations

import os
import sys

import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv

SPEC = SPECS[0]
NAMESPACE = "crash"


def sequence(client: int, i: int) -> list[int]:
    """Put ``i`` of ``client``: 64 to 192 tokens (4 to 12 blocks) of its own.

    Clients 0-3 and ``i`` below 1,000,000 keep every token id under 2**32 and apart.
    """
    n = 64 + 16 * ((i * 7 + client) % 9)
    return [client * 1_000_000_000 + i * 1_000 + t for t in range(n)]


def main(url: str, client: int, start: int) -> None:
    from client_sdk import ConnectionFailed, KVClient

    torch.set_num_threads(1)
    with KVClient(url, namespace=NAMESPACE, colocated=False, plan=False, retries=0, timeout_s=30) as kv_client:
        kv_client.lookup(SPEC, sequence(client, start))  # connected
        os.write(1, b"ready\n")
        i = start
        while True:
            tokens = sequence(client, i)
            try:
                kv_client.put_kv(SPEC, tokens, expected_kv(0, tokens), durable=True)
            except ConnectionFailed:  # the server was killed: the scenario, not a failure
                return
            os.write(1, f"{i}\n".encode())  # one write: the parent never reads half a line
            i += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
