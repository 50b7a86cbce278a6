"""A co-located first get's blocks checked and copied together (``client_sdk.arena_runs``): runs
of equally spaced slots whichever way they lie, runs broken by other blocks, two metadata
layouts in one get, and slots that change under the batch."""

from __future__ import annotations

import pytest
import torch

from client_sdk import KVClient
from client_sdk.arena_runs import TrustedRuns
from kvstore import KVStore
from kvstore.keys import block_hashes
from kvstore.memory.shm import ShmReader
from tests.conftest import make_kv
from tests.client_sdk.test_reserved_put import _requests_by_route
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

BLOCKS = 20  # depths 0-19: a block's metadata grows a digit at 10, so two layouts in one get


@pytest.fixture
def verified_server(serve_app):
    """A server whose verifier runs (every frame it stores is vouched for, then trusted)."""
    return serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], scrub_bytes_per_s=0))


@pytest.fixture
def runs(monkeypatch) -> list[tuple[int, int]]:
    """Each ``(count, stride)`` the batch copied in one go, recorded as it reads."""
    seen: list[tuple[int, int]] = []
    real = ShmReader.spaced_arrays

    def spy(self, start, stride, count, dtype, shape):
        seen.append((count, stride))
        return real(self, start, stride, count, dtype, shape)
    monkeypatch.setattr(ShmReader, "spaced_arrays", spy)
    return seen


def _first_get(url: str, spec, tokens: list[int]) -> tuple[torch.Tensor, int, KVClient]:
    with KVClient(url, plan=False) as reader:  # a fresh client: it remembers no slot
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        before = _requests_by_route(url)
        got, n = reader.get_kv(spec, tokens)
        assert _requests_by_route(url) == before  # found in the arena's key index: no request
        return got, n, reader


@pytest.mark.parametrize("colocated", [False, True])
def test_a_first_get_copies_each_run_of_blocks_to_its_place(verified_server, spec, runs, colocated):
    """HTTP puts take their slots upwards, a co-located writer's pool downwards: either way a
    get's blocks lie equally spaced, and are copied as one run, each block to its own tokens."""
    tokens = list(range(BLOCKS * 16))
    kv = make_kv(spec, len(tokens))
    with KVClient(verified_server.url, plan=False, colocated=colocated) as writer:
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    runs.clear()
    got, n, reader = _first_get(verified_server.url, spec, tokens)
    assert n == len(tokens) and torch.equal(got, kv)
    assert reader.stats.shm_frames_trusted == BLOCKS and reader.stats.shm_frames_verified == 0
    assert sum(count for count, _ in runs) == BLOCKS and max(count for count, _ in runs) > 1
    assert all((stride < 0) == colocated for count, stride in runs if count > 1)


def test_blocks_that_other_blocks_lie_between_are_copied_each_to_its_place(verified_server, spec, runs):
    """A sequence put in two parts with another's blocks put between them: its slots are not
    equally spaced across the gap, so the get copies two runs (or more), never one across it."""
    tokens = list(range(BLOCKS * 16))
    kv = make_kv(spec, len(tokens))
    with KVClient(verified_server.url, plan=False, colocated=False) as writer:
        assert writer.put_kv(spec, tokens[:64], kv[:, :, :, :64]) == 64
        assert writer.put_kv(spec, list(range(90_000, 90_048)), make_kv(spec, 48, seed=1)) == 48
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    runs.clear()
    got, n, _ = _first_get(verified_server.url, spec, tokens)
    assert n == len(tokens) and torch.equal(got, kv)
    assert len(runs) >= 2 and sum(count for count, _ in runs) == BLOCKS


@pytest.mark.parametrize("when", ["before its copy", "after its copy"])
def test_a_block_deleted_under_the_batch_is_not_served(verified_server, spec, monkeypatch, when):
    """The batch reads a slot's bytes between two looks at its generation: a block deleted in
    between (its range may be reused) ends the prefix there, whether its bytes were copied yet."""
    tokens = list(range(BLOCKS * 16))
    kv = make_kv(spec, len(tokens))
    keys = block_hashes(spec, tokens)
    with KVClient(verified_server.url, plan=False, colocated=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    real = TrustedRuns._copy_runs

    def delete_one(self, took, starts, ints, bt, shape):
        if when == "before its copy":
            verified_server.store.delete_blocks([keys[5]])
        done = real(self, took, starts, ints, bt, shape)
        if when == "after its copy":
            verified_server.store.delete_blocks([keys[5]])
        return done
    monkeypatch.setattr(TrustedRuns, "_copy_runs", delete_one)
    with KVClient(verified_server.url, plan=False) as reader:
        got, n = reader.get_kv(spec, tokens)
    assert n == 5 * 16 and torch.equal(got, kv[:, :, :, :n])


def _delete_after_heads(monkeypatch, server, key) -> None:
    """From now on, each read of frames' first bytes deletes block ``key`` right after it."""
    real = ShmReader.heads

    def heads_then_delete(self, offsets, length):
        got = real(self, offsets, length)
        server.store.delete_blocks([key])
        return got
    monkeypatch.setattr(ShmReader, "heads", heads_then_delete)


def test_a_hit_whose_slot_changes_while_its_metadata_is_read_is_a_miss(verified_server, spec, monkeypatch):
    """The namespace check reads the hits' frames after the index look-up; a block deleted in
    between (its range free for another frame) is a miss, not an answer from stale bytes."""
    tokens = list(range(4 * 16))
    keys = block_hashes(spec, tokens)
    with KVClient(verified_server.url, plan=False) as writer:
        assert writer.put_kv(spec, tokens, make_kv(spec, len(tokens))) == len(tokens)
    with KVClient(verified_server.url, plan=False) as reader:
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        _delete_after_heads(monkeypatch, verified_server, keys[2])
        assert reader.blocks_exist(keys, ask_server=False) == [True, True, False, True]


def test_metadata_that_names_another_namespace_past_the_bytes_read_is_not_this_ones(serve_app):
    """Beta puts frames under acme's sequence keys whose metadata starts as acme's and names beta
    again 300 bytes on, past the bytes the batch reads of each frame (``json.loads``, and the
    server, take the last): acme's get and existence check must not take them for its own."""
    import json

    from kvstore import codec
    from kvstore.keys import block_meta, meta_prefix
    from tests.conftest import make_spec
    from tests.server.conftest import ACME, BETA, TOKENS

    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], scrub_bytes_per_s=0)
    srv = serve_app(store, tokens=json.dumps(TOKENS))
    spec = make_spec()
    tokens = list(range(4 * 16))
    ks = block_hashes(spec, tokens, "acme")
    metas = [block_meta("acme", spec.fingerprint(), d)[:-1] + b',"pad":"' + b"x" * 300 + b'","ns":"beta"}'
             for d in range(4)]
    assert all(json.loads(m)["ns"] == "beta" and m.startswith(meta_prefix("acme")) for m in metas)
    frames = [codec.encode(make_kv(spec, 16, seed=d), meta=m) for d, m in enumerate(metas)]
    with KVClient(srv.url, token=BETA, namespace="beta", colocated=False) as beta:
        def write(i, view):
            view[:len(frames[i])] = frames[i]
            return len(frames[i])
        assert beta.put_blocks_with(ks, [len(f) for f in frames], write) == 4
    assert store.scrubber.caught_up(10.0)
    with KVClient(srv.url, token=ACME, namespace="acme", plan=False) as acme:
        assert acme.get_kv(spec, tokens)[1] == 0
        assert acme.blocks_exist(ks, ask_server=False) == [False] * 4


def _spy_first_fill(monkeypatch) -> list:
    """What each ``TrustedRuns.first_fill`` returned, recorded as it reads: its blocks' keys and the
    positions it copied, or None (not its blocks: their payload views die with the arena's mapping)."""
    seen: list = []
    real = TrustedRuns.first_fill

    def spy(self, *args):
        got = real(self, *args)
        seen.append(None if got is None else ([b["key"] for b in got[0]], got[1]))
        return got
    monkeypatch.setattr(TrustedRuns, "first_fill", spy)
    return seen


def test_a_first_get_reads_each_frames_first_bytes_once(verified_server, spec, monkeypatch):
    """A first get looks up, checks and copies its blocks in one pass: each frame's first bytes
    are read once for its namespace and its layout both, and every block is copied there."""
    tokens = list(range(BLOCKS * 16))
    kv = make_kv(spec, len(tokens))
    with KVClient(verified_server.url, plan=False, colocated=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    passes = _spy_first_fill(monkeypatch)
    reads: list[int] = []
    real_heads = ShmReader.heads

    def count_heads(self, offsets, length):
        reads.append(len(offsets))
        return real_heads(self, offsets, length)
    with KVClient(verified_server.url, plan=False) as reader:
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        monkeypatch.setattr(ShmReader, "heads", count_heads)
        before = _requests_by_route(verified_server.url)
        got, n = reader.get_kv(spec, tokens)
        assert _requests_by_route(verified_server.url) == before
    assert n == len(tokens) and torch.equal(got, kv)
    assert reads == [BLOCKS]
    (keys, done), = passes
    assert done == set(range(BLOCKS)) and keys == [k.hex() for k in block_hashes(spec, tokens)]
    assert reader.stats.shm_frames_trusted == BLOCKS


def test_a_block_deleted_after_the_first_pass_read_it_ends_the_prefix_there(verified_server, spec, monkeypatch):
    """The one pass reads a block's first bytes after the look-up and checks its generation once,
    after the copies: a block deleted in between (its range free for another frame) is asked of
    the server, which no longer has it."""
    tokens = list(range(4 * 16))
    kv = make_kv(spec, len(tokens))
    keys = block_hashes(spec, tokens)
    with KVClient(verified_server.url, plan=False, colocated=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    passes = _spy_first_fill(monkeypatch)
    with KVClient(verified_server.url, plan=False) as reader:
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        _delete_after_heads(monkeypatch, verified_server, keys[2])
        got, n = reader.get_kv(spec, tokens)
    assert passes == [None]
    assert n == 2 * 16 and torch.equal(got, kv[:, :, :, :n])


def test_blocks_the_server_has_not_verified_are_left_to_the_checked_reads(verified_server, spec, monkeypatch):
    """A slot whose verified word does not show its generation is not trusted by the one pass:
    it is left to the per-block reads, which hash it here before it is served."""
    tokens = list(range(4 * 16))
    kv = make_kv(spec, len(tokens))
    with KVClient(verified_server.url, plan=False, colocated=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == len(tokens)
    assert verified_server.store.scrubber.caught_up(10.0)
    real_look_up = ShmReader.look_up
    monkeypatch.setattr(ShmReader, "look_up", lambda self, keys: [
        None if h is None else h._replace(verified=False) for h in real_look_up(self, keys)])
    monkeypatch.setattr(ShmReader, "holds_verified", lambda self, index, gen: False)
    monkeypatch.setattr(ShmReader, "verified", lambda self, handle: False)
    passes = _spy_first_fill(monkeypatch)
    with KVClient(verified_server.url, plan=False) as reader:
        assert reader.lookup(spec, list(range(1 << 20, (1 << 20) + 16))) == 0  # maps the arena
        got, n = reader.get_kv(spec, tokens)
    assert n == len(tokens) and torch.equal(got, kv)
    (_, done), = passes
    assert done == set()
    assert reader.stats.shm_frames_verified == 4 and reader.stats.shm_frames_trusted == 0


def test_metadata_that_must_be_parsed_is_parsed_by_the_first_pass(verified_server, spec):
    """A frame whose metadata holds an escape is not surely this namespace's by its bytes: the one
    pass parses it, as the server does, and serves it when it names the namespace."""
    from kvstore import codec
    from kvstore.keys import block_meta

    tokens = list(range(4 * 16))
    keys = block_hashes(spec, tokens)
    kvs = [make_kv(spec, 16, seed=d) for d in range(4)]
    frames = [codec.encode(kvs[d], meta=block_meta("default", spec.fingerprint(), d, note='say "hi"'))
              for d in range(4)]
    assert all(b"\\" in f[:400] for f in frames)
    with KVClient(verified_server.url, colocated=False) as writer:
        def write(i, view):
            view[:len(frames[i])] = frames[i]
            return len(frames[i])
        assert writer.put_blocks_with(keys, [len(f) for f in frames], write) == 4
    assert verified_server.store.scrubber.caught_up(10.0)
    got, n, reader = _first_get(verified_server.url, spec, tokens)
    assert n == len(tokens) and torch.equal(got, torch.cat(kvs, dim=3))
    assert reader.stats.shm_frames_trusted == 4
