"""``get_kv_blocks``: a stored prefix handed block by block out of the arena (one copy in all)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from client_sdk import KVClient
from kvstore.codec import int_view
from kvstore.keys import block_hashes
from tests.client_sdk.test_colocated import _requests_served
from tests.conftest import make_kv


class Blocks:
    """A place callback that keeps a copy of each block it is handed, by depth."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.got: dict[int, torch.Tensor] = {}

    def __call__(self, depth: int, src: np.ndarray) -> None:
        out = torch.empty(self.spec.kv_shape(self.spec.block_tokens), dtype=self.spec.torch_dtype)
        np.copyto(int_view(out), src)
        self.got[depth] = out

    def block(self, kv: torch.Tensor, depth: int) -> torch.Tensor:
        bt = self.spec.block_tokens
        return kv[:, :, :, depth * bt:(depth + 1) * bt]


@pytest.mark.parametrize("colocated", [None, False])
def test_blocks_are_handed_over_exactly(server, spec, colocated):
    tokens = list(range(80))
    kv = make_kv(spec, 80)
    with KVClient(server.url, plan=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == 80
    with KVClient(server.url, plan=False, colocated=colocated) as c:
        place = Blocks(spec)
        assert c.get_kv_blocks(spec, tokens, place) == 80
        assert sorted(place.got) == [0, 1, 2, 3, 4]
        for d, block in place.got.items():
            assert torch.equal(block, place.block(kv, d))
        later = Blocks(spec)  # blocks before ``first`` are not read
        assert c.get_kv_blocks(spec, tokens, later, first=3) == 80
        assert sorted(later.got) == [3, 4]
        assert torch.equal(later.got[4], place.block(kv, 4))
        if colocated is None:
            assert c.stats.shm_frames_trusted + c.stats.shm_frames_verified >= 5 and c.stats.http_gets == 0


def test_a_first_co_located_read_makes_no_request_and_is_counted(server, spec):
    tokens = list(range(64))
    with KVClient(server.url, plan=False) as writer:
        writer.put_kv(spec, tokens, make_kv(spec, 64))
    with KVClient(server.url, plan=False) as c:
        assert c.lookup(spec, list(range(1000, 1016))) == 0  # maps the arena
        before = _requests_served(server.url)
        assert c.get_kv_blocks(spec, tokens, Blocks(spec)) == 64
        assert _requests_served(server.url) == before
        assert c.get_kv_blocks(spec, tokens, Blocks(spec), first=3) == 64  # reads the last block only
    counters = server.store.stats().counters  # closing reported them, as gets of 64 and 16 tokens
    assert counters.get_calls == 2 and counters.tokens_hit == 64 + 16


def test_the_prefix_ends_at_the_first_block_not_stored(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        c.delete_block(block_hashes(spec, tokens)[2])
        place = Blocks(spec)
        assert c.get_kv_blocks(spec, tokens, place) == 32
        assert torch.equal(place.got[1], place.block(kv, 1))
        assert c.get_kv_blocks(spec, tokens, Blocks(spec), first=3) == 32  # shorter than first: nothing placed


def test_a_block_lower_tiers_hold_comes_over_http(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        assert server.store.migrate(block_hashes(spec, tokens)[1], "memory")
        place = Blocks(spec)
        assert c.get_kv_blocks(spec, tokens, place) == 64
        assert torch.equal(place.got[1], place.block(kv, 1)) and c.stats.shm_blocks_fetched_over_http == 1


def test_a_slot_changed_under_the_copy_is_never_passed_off(server, spec):
    """The seqlock: a block deleted while ``place`` copies it (its slot's generation moves) is
    asked for again; gone, it ends the prefix, so the garbage placed for it is never counted."""
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    keys = block_hashes(spec, tokens)
    with KVClient(server.url, plan=False) as c, KVClient(server.url, plan=False) as other:
        c.put_kv(spec, tokens, kv)
        place = Blocks(spec)

        def racing(depth: int, src: np.ndarray) -> None:
            if depth == 2 and 2 not in place.got:
                other.delete_block(keys[2])  # under the copy: the slot is released
            place(depth, src)
        assert c.get_kv_blocks(spec, tokens, racing) == 32
        assert all(torch.equal(place.got[d], place.block(kv, d)) for d in (0, 1))


def test_bad_input_is_refused(server, spec):
    with KVClient(server.url, plan=False) as c:
        with pytest.raises(Exception, match="first=-1"):
            c.get_kv_blocks(spec, list(range(16)), Blocks(spec), first=-1)


def test_the_async_client_hands_blocks_over_too(server, spec):
    import asyncio

    from client_sdk import AsyncKVClient

    tokens = list(range(48))
    kv = make_kv(spec, 48)
    place = Blocks(spec)

    async def main() -> int:
        async with AsyncKVClient(server.url, plan=False) as c:
            await c.put_kv(spec, tokens, kv)
            return await c.get_kv_blocks(spec, tokens, place, first=1)
    assert asyncio.run(main()) == 48
    assert sorted(place.got) == [1, 2] and torch.equal(place.got[2], place.block(kv, 2))


class Fill:
    """A fill callback over a KV tensor, noting which depths it was asked for."""

    def __init__(self, spec, kv: torch.Tensor) -> None:
        self.bt, self.ints, self.asked = spec.block_tokens, int_view(kv), []

    def __call__(self, depth: int, dst: np.ndarray) -> None:
        self.asked.append(depth)
        np.copyto(dst, self.ints[:, :, :, depth * self.bt:(depth + 1) * self.bt])


@pytest.mark.parametrize("colocated", [None, False])
def test_put_kv_blocks_stores_what_fill_writes(server, spec, colocated):
    tokens = list(range(70))
    kv = make_kv(spec, 70)
    with KVClient(server.url, plan=False, colocated=colocated) as c:
        fill = Fill(spec, kv)
        assert c.put_kv_blocks(spec, tokens, fill) == 64
        assert sorted(fill.asked) == [0, 1, 2, 3]
        got, n = c.get_kv(spec, tokens)
        assert n == 64 and torch.equal(got, kv[:, :, :, :64])
        if colocated is None:  # straight into pool slots; a repeat asks only for the new blocks
            more = make_kv(spec, 96)
            more[:, :, :, :64] = kv[:, :, :, :64]
            before = _requests_served(server.url)
            again = Fill(spec, more)
            assert c.put_kv_blocks(spec, list(range(70)) + list(range(70, 96)), again) == 96
            assert sorted(again.asked) == [4, 5] and _requests_served(server.url) == before + 1
            got, n = c.get_kv(spec, list(range(70)) + list(range(70, 96)))
            assert n == 96 and torch.equal(got, more)
