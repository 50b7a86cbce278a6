"""``AsyncKVClient.get_kv_layers`` against a real server: the same layers as the blocking stream,
received on the event loop (HTTP) or copied out of the arena (shm), never through a blocking client."""

from __future__ import annotations

import asyncio

import pytest
import torch

from client_sdk import AsyncKVClient, ServiceError
from client_sdk.layers import AsyncLayerStream, aiter_layers_http, aiter_layers_shm
from kvstore import KVStore
from kvstore.errors import BlockNotFound
from kvstore.keys import block_hashes
from tests.client_sdk.test_layers import MEDIA, held_server  # noqa: F401 - a fixture
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier
from tiers.shm import ShmTier


def _client(url: str, **options) -> AsyncKVClient:
    """One medium, no planner: these tests are about the layer path itself."""
    return AsyncKVClient(url, plan=False, **options)


async def _layers_of(stream: AsyncLayerStream) -> list[torch.Tensor]:
    got = [(i, t.clone()) async for i, t in stream]
    assert [i for i, _ in got] == list(range(len(got)))
    return [t for _, t in got]


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("medium", ["http", "shm"])
def test_layers_are_the_bytes_get_kv_returns(serve_app, medium, codec):
    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], codec=codec, background=False))
    spec = make_spec(dtype="bfloat16")
    tokens = list(range(100))
    kv = make_kv(spec, 100)

    async def main() -> None:
        async with _client(srv.url) as writer:
            await writer.put_kv(spec, tokens[:64], kv[:, :, :, :64])
            full, n = await writer.get_kv(spec, tokens)
        assert n == 64
        async with _client(srv.url, colocated=MEDIA[medium]) as c:
            for query in (tokens[:70], tokens[:70], tokens):  # a repeat is served from remembered handles
                stream = await c.get_kv_layers(spec, query)
                assert stream.medium == medium and stream.n_tokens == 64 and stream.num_layers == spec.num_layers
                layers = await _layers_of(stream)
                assert len(layers) == spec.num_layers
                assert all(torch.equal(got, full[i]) for i, got in enumerate(layers))
                assert torch.equal(stream.kv, full)
            # counted in this client's own stats: no other client streamed them
            if medium == "shm":
                assert c.stats.shm_gets == 3 and c.stats.http_gets == 0
                # tokens[:70]'s blocks are all in the arena (its shared key index: no request);
                # tokens names 2 blocks never stored, which the server is asked about
                assert c.stats.shm_cached_gets == 2
            else:
                assert c.stats.http_gets == 3 and c.stats.shm_gets == 0

    asyncio.run(main())


@pytest.mark.parametrize("medium", ["http", "shm"])
def test_a_miss_yields_no_layers(server, spec, medium):
    async def main() -> None:
        async with _client(server.url, colocated=MEDIA[medium]) as c:
            await c.put_kv(spec, list(range(32)), make_kv(spec, 32))
            stream = await c.get_kv_layers(spec, list(range(1000, 1040)))
            assert stream.n_tokens == 0 and await _layers_of(stream) == [] and stream.kv.shape == spec.kv_shape(0)
            assert (await c.get_kv_layers(spec, [1, 2, 3])).n_tokens == 0
            assert (await (await c.get_kv_layers(spec, [])).read_all())[1] == 0

    asyncio.run(main())


def test_each_medium_can_be_asked_for_by_name(server, spec):
    tokens = list(range(32))
    kv = make_kv(spec, 32)

    async def main() -> None:
        async with _client(server.url) as c:
            await c.put_kv(spec, tokens, kv)
            for stream in (await aiter_layers_http(c.http, spec, tokens), await aiter_layers_shm(c.shm, spec, tokens)):
                assert torch.equal((await stream.read_all())[0], kv)
        async with _client(server.url, colocated=False) as remote:
            with pytest.raises(ServiceError, match="does not use the shm"):
                await aiter_layers_shm(remote.shm, spec, tokens)

    asyncio.run(main())


def test_a_stream_stopped_early_leaves_client_and_server_usable(server):
    spec = make_spec(num_layers=32, head_dim=128)  # 512 KiB a block: more than a socket buffer in flight
    tokens = list(range(64))
    kv = make_kv(spec, 64)

    async def main() -> None:
        async with _client(server.url, colocated=False) as c:
            await c.put_kv(spec, tokens, kv)
            async with await c.get_kv_layers(spec, tokens) as stream:
                layer, first = await stream.__anext__()
                assert layer == 0 and torch.equal(first, kv[0])
            assert await _layers_of(stream) == []  # closed: nothing more comes
            await (await c.get_kv_layers(spec, tokens)).aclose()  # closed before its first layer
            assert torch.equal((await (await c.get_kv_layers(spec, tokens)).read_all())[0], kv)
            assert torch.equal((await c.get_kv(spec, tokens))[0], kv)

    asyncio.run(main())


def test_the_loop_runs_on_while_the_server_holds_the_rest(held_server, spec):  # noqa: F811 - the fixture
    """Layer 1 is awaited on the loop's socket: the loop is free to release the server meanwhile
    (a read that blocked the loop would hold it until the server gave up)."""
    srv, gate = held_server
    tokens = list(range(64))
    kv = make_kv(spec, 64)

    async def main() -> None:
        async with _client(srv.url, colocated=False) as c:
            await c.put_kv(spec, tokens, kv)
            stream = await c.get_kv_layers(spec, tokens)
            layer, first = await stream.__anext__()
            assert layer == 0 and torch.equal(first, kv[0])
            assert gate.released_in_time is None  # layer 1 has not left the server yet
            second = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            assert not second.done()
            gate.release.set()
            assert (await second)[0] == 1
            assert [i async for i, _ in stream] == list(range(2, spec.num_layers)) and torch.equal(stream.kv, kv)

    asyncio.run(main())
    assert gate.released_in_time is True


def test_a_slot_moved_after_layer_0_is_fetched_again(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    key = block_hashes(spec, tokens)[1]

    async def main() -> None:
        async with _client(server.url) as c:
            await c.put_kv(spec, tokens, kv)
            stream = await c.get_kv_layers(spec, tokens)
            assert (await stream.__anext__())[0] == 0
            # fault: placement moves the block (a new generation) while layers 1.. are still to copy
            assert server.store.migrate(key, "memory") and server.store.migrate(key, "shm")
            assert torch.equal((await stream.read_all())[0], kv)
            assert c.stats.shm_blocks_fetched_over_http == 1
            assert torch.equal((await (await c.get_kv_layers(spec, tokens)).read_all())[0], kv)

    asyncio.run(main())


def test_a_block_deleted_after_layer_0_is_a_typed_error(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)

    async def main() -> None:
        async with _client(server.url) as c:
            await c.put_kv(spec, tokens, kv)
            stream = await c.get_kv_layers(spec, tokens)
            await stream.__anext__()
            server.store.delete_blocks([block_hashes(spec, tokens)[2]])
            with pytest.raises(BlockNotFound, match="while its layers streamed"):
                await stream.read_all()
            stream = await c.get_kv_layers(spec, tokens)  # before layer 0 a lost block shortens the prefix
            assert (await stream.read_all())[1] == 32 and torch.equal(stream.kv, kv[:, :, :, :32])

    asyncio.run(main())
