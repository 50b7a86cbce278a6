"""A co-located first get of blocks the server has not verified yet (``Arena._copy_then_check``):
each frame's payload is copied first and checked after every copy, so the copies run while the
server's verifier hashes the same frames. A slot verified meanwhile is taken as it stands, any
other is hashed in the arena; a frame that fails its hash is a miss, never returned KV."""

from __future__ import annotations

import pytest
import torch

from client_sdk import KVClient
from kvstore import KVStore
from kvstore.keys import block_hashes
from kvstore.memory.shm import ShmReader
from tests.conftest import make_kv
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

TOKENS = 64  # 4 blocks of 16


@pytest.fixture
def unverified(serve_app, spec):
    """A server whose verifier is not running yet, holding 4 blocks a co-located writer put (their
    frames written into the arena by the client, so no one has hashed them): (server, tokens, kv)."""
    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False, scrub_bytes_per_s=0))
    tokens, kv = list(range(TOKENS)), make_kv(spec, TOKENS)
    with KVClient(srv.url, plan=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == TOKENS
    return srv, tokens, kv


def _first_get(url: str, spec, tokens: list[int]) -> tuple[torch.Tensor, int, KVClient]:
    with KVClient(url, plan=False) as reader:  # a fresh client: it remembers no slot
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        got, n = reader.get_kv(spec, tokens)
        return got, n, reader


def test_frames_the_server_has_not_verified_are_hashed_here_after_their_copies(unverified, spec):
    srv, tokens, kv = unverified
    got, n, reader = _first_get(srv.url, spec, tokens)
    assert n == TOKENS and torch.equal(got, kv)
    assert reader.stats.shm_frames_verified == 4 and reader.stats.shm_frames_trusted == 0


def test_frames_verified_between_their_copy_and_its_check_are_not_hashed_again(unverified, spec, monkeypatch):
    """The verifier catches up right after the reader's last copy (a timing injected by starting
    it there): every frame is then taken as the server vouched for it, none hashed by the reader."""
    srv, tokens, kv = unverified
    real, copies = ShmReader.copy_current, []

    def copy_then_verify(self, index, gen, dst, src):
        ok = real(self, index, gen, dst, src)
        copies.append(index)
        if len(copies) == 4:
            srv.store.scrubber.start()
            assert srv.store.scrubber.caught_up(10.0)
        return ok
    monkeypatch.setattr(ShmReader, "copy_current", copy_then_verify)
    got, n, reader = _first_get(srv.url, spec, tokens)
    assert n == TOKENS and torch.equal(got, kv)
    assert len(copies) == 4 and reader.stats.shm_frames_trusted == 4 and reader.stats.shm_frames_verified == 0


@pytest.mark.parametrize("damaged", [1, 3])
def test_a_frame_damaged_before_anyone_verified_it_ends_the_prefix(unverified, spec, damaged):
    """Its copy already landed in the result when the hash after it fails: the get still ends
    the prefix there (the server refuses that block too), and returns nothing of it."""
    srv, tokens, kv = unverified
    shm = srv.store.tiers[0]
    handle = shm.handle(block_hashes(spec, tokens)[damaged])
    shm._data[handle.offset + handle.length - 1] ^= 0xFF  # fault: a payload byte flips in the arena
    got, n, reader = _first_get(srv.url, spec, tokens)
    assert n == damaged * 16 and torch.equal(got, kv[:, :, :, :n])
    assert reader.stats.shm_frames_trusted == 0  # every frame it took, it hashed
