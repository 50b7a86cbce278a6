"""lm:// GET hashes a chunk's body once per publish of its arena slot ("Verified once", docs/design.md).

A real store and listener, driven over raw sockets as in ``test_lmcache_listener.py``.
The body hashes are counted by wrapping the hash function ``kvstore.codec`` and
``kvstore.frame`` (which seals a frame) call: the wrapper only counts, every hash is still made.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import xxhash

from kvstore import KVStore
from kvstore import codec as codec_mod
from kvstore import frame as frame_mod
from kvstore.keys import named_key
from tests.server import lmwire as lm
from tests.server.conftest import ADMIN, TOKENS
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

MiB = 1 << 20
AUTH = {"authorization": f"Bearer {ADMIN}"}
SIZE = MiB
"""A chunk's payload: any hash of at least this many bytes is a hash of its frame's body."""


def chunk(seed: int) -> bytes:
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(256)) * (SIZE // 256)


@pytest.fixture
def srv(serve_app):
    """The listener over shm (8 MiB) and memory, with an admin token."""
    store = KVStore([ShmTier(8 * MiB), MemoryTier(64 * MiB)], background=False)
    server = serve_app(store, lmcache_port=0, body_timeout_s=2.0, tokens=json.dumps(TOKENS), admin_token=ADMIN)
    server.lm_port = server.svc.lmcache.port
    return server


@pytest.fixture
def body_hashes(monkeypatch) -> list[int]:
    """The lengths of the chunk-sized hashes kvstore.codec and kvstore.frame make from now on."""
    made: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data, *args, **kwargs):
        if memoryview(data).nbytes >= SIZE:
            made.append(memoryview(data).nbytes)
        return real(data, *args, **kwargs)

    counted = SimpleNamespace(**{**vars(xxhash), "xxh3_64_intdigest": counting})
    monkeypatch.setattr(codec_mod, "xxhash", counted)
    monkeypatch.setattr(frame_mod, "xxhash", counted)
    return made


def put(sock, name: str, data: bytes) -> None:
    lm.put(sock, name, data, lm.BINARY, lm.UINT8, (len(data), 0, 0, 0))
    assert lm.exists(sock, name)


def flip(srv, name: str) -> None:
    """Fault: a payload byte of ``name``'s frame flips in the shm arena."""
    shm = srv.store.tiers[0]
    handle = shm.handle(named_key("lmcache", "lmcache", name))
    shm._view[handle.offset + handle.length - 10] ^= 0xFF


MISS = ((400, 0, 1, 2, 0, 0, 0, 0, 0), None)


def test_a_chunk_verified_once_is_sent_without_hashing_it_again(srv, body_hashes):
    sock = lm.connect(srv.lm_port)
    put(sock, "m@1@0@a@half", chunk(1))
    body_hashes.clear()  # the put sealed it: written here, but not yet verified
    assert lm.get(sock, "m@1@0@a@half")[1] == chunk(1)
    assert len(body_hashes) == 1  # the first send verifies
    for _ in range(3):
        assert lm.get(sock, "m@1@0@a@half")[1] == chunk(1)
    assert len(body_hashes) == 1
    sock.close()


def test_a_chunk_damaged_before_its_first_send_is_a_miss_and_dropped(srv, body_hashes):
    sock = lm.connect(srv.lm_port)
    put(sock, "m@1@0@dd@half", chunk(2))
    flip(srv, "m@1@0@dd@half")
    assert lm.get(sock, "m@1@0@dd@half") == MISS  # never the bytes
    assert not lm.exists(sock, "m@1@0@dd@half")
    assert srv.store.stats().counters.corrupt_blocks == 1
    assert lm.health(sock) == 200
    sock.close()


def test_a_rewritten_chunk_is_verified_again(srv, body_hashes):
    """A re-put publishes a new slot: a vouch for the old bytes says nothing about the new ones."""
    sock = lm.connect(srv.lm_port)
    put(sock, "m@1@0@1e@half", chunk(3))
    assert lm.get(sock, "m@1@0@1e@half")[1] == chunk(3)  # verified
    put(sock, "m@1@0@1e@half", chunk(4))
    flip(srv, "m@1@0@1e@half")
    assert lm.get(sock, "m@1@0@1e@half") == MISS
    assert not lm.exists(sock, "m@1@0@1e@half")
    assert srv.store.stats().counters.corrupt_blocks == 1
    sock.close()


def test_a_moved_chunk_is_verified_again(srv, body_hashes):
    """Moved to memory (which verifies every read) and back into another shm slot: hashed anew."""
    sock = lm.connect(srv.lm_port)
    put(sock, "m@1@0@3e@half", chunk(5))
    assert lm.get(sock, "m@1@0@3e@half")[1] == chunk(5)
    key = named_key("lmcache", "lmcache", "m@1@0@3e@half").hex()
    for tier, hashed in (("memory", 2), ("shm", 1)):  # memory hashes every send; shm the first after the move
        moved = httpx.post(f"{srv.url}/admin/migrate", json={"key": key, "tier": tier}, headers=AUTH).json()
        assert moved["moved"] is True
        body_hashes.clear()
        assert lm.get(sock, "m@1@0@3e@half")[1] == chunk(5)
        assert lm.get(sock, "m@1@0@3e@half")[1] == chunk(5)
        assert len(body_hashes) == hashed
    body_hashes.clear()
    assert lm.get(sock, "m@1@0@3e@half")[1] == chunk(5)
    assert body_hashes == []
    flip(srv, "m@1@0@3e@half")  # what is given up: a change behind the stamp's back after the first send
    assert lm.get(sock, "m@1@0@3e@half")[1] != chunk(5)
    sock.close()
