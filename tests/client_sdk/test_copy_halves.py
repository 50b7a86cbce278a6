"""Co-located puts and gets whose copies run in two halves (``kvstore.memory.halves``), against a
real server: the split forced on for these small sequences (its size floor at 0). What is read
back is the put's KV bit for bit, by every read path (a repeat get, a new client's first get of
frames the server verified, and of frames nobody verified yet); a put whose helper half fails
raises, stores nothing, and the same put goes through whole after."""

from __future__ import annotations

import threading

import pytest
import torch

from client_sdk import KVClient
from kvstore import KVStore
from kvstore import codec as codec_mod
from kvstore.errors import InvalidKV
from kvstore.memory import halves
from tests.conftest import make_kv
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

TOKENS = 128  # 8 blocks of 16


@pytest.fixture
def split(monkeypatch):
    """Every run of two items or more splits; the starts handed to the helper, counted."""
    before = halves.copy_threads()
    halves.set_copy_threads(2)
    monkeypatch.setattr(halves, "SPLIT_MIN_BYTES", 0)
    starts: list[int] = []
    real = halves._Helper.try_start

    def counted(self, job):
        started = real(self, job)
        starts.append(started)
        return started
    monkeypatch.setattr(halves._Helper, "try_start", counted)
    yield starts
    halves.set_copy_threads(before)


@pytest.mark.parametrize("path", ["pooled", "reserved"])
def test_a_put_in_halves_reads_back_bit_exact_by_every_path(serve_app, spec, split, path):
    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False, scrub_bytes_per_s=0))
    tokens, kv = list(range(TOKENS)), make_kv(spec, TOKENS, seed=5)
    with KVClient(srv.url, plan=False) as writer:
        writer.lookup(spec, [1])  # maps the arena
        writer.colocation.arena.pooled_puts = path == "pooled"
        assert writer.put_kv(spec, tokens, kv) == TOKENS and writer.stats.last_medium == "shm"
        assert any(split)  # the writer's blocks went out in two halves
        with KVClient(srv.url, plan=False) as first:  # nobody has verified the frames yet
            first.lookup(spec, [1])
            split.clear()
            got, n = first.get_kv(spec, tokens)
            assert n == TOKENS and torch.equal(got, kv) and first.stats.shm_frames_verified == 8
            assert any(split)  # copied in two halves, checked after
        srv.store.scrubber.start()
        assert srv.store.scrubber.caught_up(10.0)
        with KVClient(srv.url, plan=False) as later:  # every frame verified by the server
            later.lookup(spec, [1])
            out = torch.zeros_like(kv)
            split.clear()
            assert later.get_kv(spec, tokens, out=out)[1] == TOKENS and torch.equal(out, kv)
            assert later.stats.shm_frames_trusted == 8 and any(split)  # one run's copy, in two halves
            out.zero_()
            assert later.get_kv(spec, tokens, out=out)[1] == TOKENS and torch.equal(out, kv)  # a repeat


def test_a_put_whose_helper_half_fails_raises_and_stores_nothing(serve_app, spec, split, monkeypatch):
    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False, scrub_bytes_per_s=0))
    tokens, kv = list(range(TOKENS)), make_kv(spec, TOKENS, seed=6)
    real = codec_mod.raw_frame_into

    def failing_on_the_helper(*args, **kwargs):  # the fault: the helper's half cannot encode
        if threading.current_thread().name == "kvstore-copy-half":
            raise InvalidKV("injected: the helper's half failed")
        return real(*args, **kwargs)
    with KVClient(srv.url, plan=False) as writer:
        writer.lookup(spec, [1])
        writer.colocation.arena.pooled_puts = False  # a reservation: the failure aborts it
        monkeypatch.setattr(codec_mod, "raw_frame_into", failing_on_the_helper)
        with pytest.raises(InvalidKV, match="injected"):
            writer.put_kv(spec, tokens, kv)
        assert writer.lookup(spec, tokens) == 0
        assert srv.store.reservations.open_count() == 0
        monkeypatch.setattr(codec_mod, "raw_frame_into", real)
        assert writer.put_kv(spec, tokens, kv) == TOKENS
        got, n = writer.get_kv(spec, tokens)
        assert n == TOKENS and torch.equal(got, kv)


def test_a_nowait_put_copies_its_snapshot_in_halves(server, spec, split):
    tokens, kv = list(range(1_000, 1_000 + TOKENS)), make_kv(spec, TOKENS, seed=7)
    with KVClient(server.url, plan=False) as writer:
        handle = writer.put_kv(spec, tokens, kv, wait=False)
        assert split and split[0]  # the snapshot's copy went out in two halves first
        kv.zero_()  # the caller may reuse its tensor once the put returned
        assert handle.result(10.0) == TOKENS
        got, n = writer.get_kv(spec, tokens)
        assert n == TOKENS and torch.equal(got, make_kv(spec, TOKENS, seed=7))
