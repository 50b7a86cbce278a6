"""A co-located reader that takes a read lease on a stored block and holds it until killed.

    python -m tests.reliability.lease_holder URL

It asks the server for the slot handles of ``SEQUENCE`` (as the SDK does for a
co-located get), takes a lease on the first block with ``ShmReader.lease``
(the SDK's own reader) and writes ``leased`` once it holds it.
"""

from __future__ import annotations

import os
import sys
import time

from bench.reliability_kit.load_worker import SPECS

SPEC = SPECS[0]
SEQUENCE = list(range(5_000, 5_064))
NAMESPACE = "leases"


def main(url: str) -> None:
    from client_sdk import KVClient
    from client_sdk import calls
    from client_sdk._common import tokens_of
    from kvstore.memory.shm import ShmReader, SlotHandle

    with KVClient(url, namespace=NAMESPACE, plan=False) as client:
        answer = client.http.run(calls.kv_call("/v1/kv/handles", SPEC, tokens_of(SEQUENCE), None))
        segment = client.info()["colocated"]["segment"]
        handle = SlotHandle.from_dict({"segment": segment, **answer["blocks"][0]["handle"]})
        reader = ShmReader(segment)
        with reader.lease(handle) as view:
            assert view is not None, "the block moved before the lease"
            os.write(1, b"leased\n")
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
