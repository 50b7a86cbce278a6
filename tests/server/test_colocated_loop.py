"""The co-located read routes on the event loop (``server.colocated``): no tier's or placement's
lock is taken there, a remembered slot handle is served only while it is current, and the reads
the loop hands off are counted before any later store call."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import httpx

from client_sdk import KVClient
from kvstore.keys import block_hashes
from tests.conftest import make_kv


def _stored(server, spec, n_tokens: int = 64) -> tuple[list[int], dict]:
    tokens = list(range(n_tokens))
    with KVClient(server.url, colocated=False) as c:
        c.put_kv(spec, tokens, make_kv(spec, n_tokens))
    return tokens, {"spec": spec.to_dict(), "tokens": tokens}


@contextmanager
def _stalled(server) -> Iterator[threading.Event]:
    """The shm tier's ``handle`` and the engine's ``touch`` (placement's lock) wait for the event
    yielded, as they would behind a compaction or the mover."""
    release = threading.Event()
    tier, core = server.svc.shm, server.store.core
    tier_handle, touch = tier.handle, core.touch

    def stalled_handle(key):
        release.wait(30)
        return tier_handle(key)

    def stalled_touch(*args, **kwargs):
        release.wait(30)
        return touch(*args, **kwargs)

    tier.handle, core.touch = stalled_handle, stalled_touch
    try:
        yield release
    finally:
        release.set()
        del tier.handle, core.touch


def test_remembered_handles_are_answered_while_the_tier_and_placement_are_busy(server, spec):
    tokens, body = _stored(server, spec)
    first = httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=10).json()
    assert len(first["blocks"]) == 4 and all(b["handle"] for b in first["blocks"])
    keys = [b["key"] for b in first["blocks"]]
    with _stalled(server) as release:
        for _ in range(3):  # the loop neither asks the tier nor counts the reads itself
            again = httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=2)
            assert again.status_code == 200 and again.json()["blocks"] == first["blocks"]
        by_key = httpx.post(f"{server.url}/v1/blocks/handles", json={"keys": keys}, timeout=2).json()
        assert [b["handle"] for b in by_key["blocks"]] == [b["handle"] for b in first["blocks"]]
        assert httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
        release.set()
    assert server.svc.tally.flush(10)
    assert [server.store.entry(k).hits for k in block_hashes(spec, tokens)] == [5] * 4  # 1 + 3 + 1, none lost


def test_a_handle_is_served_only_while_its_slot_holds_that_frame(server, spec):
    tokens, body = _stored(server, spec)
    keys = block_hashes(spec, tokens)
    first = httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=10).json()["blocks"]
    assert server.store.migrate(keys[1], "memory") and server.store.migrate(keys[1], "shm")  # a new slot
    now = httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=10).json()["blocks"]
    assert now[0] == first[0] and now[2:] == first[2:]
    assert now[1]["handle"] != first[1]["handle"]
    current = server.svc.shm.handle(keys[1])
    assert (now[1]["handle"]["index"], now[1]["handle"]["gen"]) == (current.index, current.gen)
    assert server.store.migrate(keys[2], "memory")  # out of shm: no handle, fetched over HTTP
    later = httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=10).json()["blocks"]
    assert later[2]["tier"] == "memory" and later[2]["handle"] is None


def test_reads_handed_off_are_counted_before_a_later_store_call(server, spec):
    """A report or a stats read after a handles answer sees its reads (``Service.run`` flushes)."""
    tokens, body = _stored(server, spec)
    for _ in range(5):
        assert httpx.post(f"{server.url}/v1/kv/handles", json=body, timeout=10).status_code == 200
    stats = httpx.get(f"{server.url}/admin/stats", timeout=10).json()
    assert stats["reads_by_tier"] == {"shm": 5 * 4}
    assert server.store.entry(block_hashes(spec, tokens)[0]).hits == 5
