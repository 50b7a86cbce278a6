"""Layer-wise gets (``POST /v1/kv/get-layers``, ``client_sdk.layers``, ``hf_layers``) against a real server."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch

from client_sdk import Forbidden, KVClient, ServiceError, Unauthorized
from client_sdk.layers import LAYERS_PATH, iter_layers_http, iter_layers_shm
from kvstore.wire.rest import KV_MEDIA
from kvstore import KVStore
from kvstore.errors import BlockNotFound
from kvstore.keys import block_hashes
from server import ServerSettings, create_app
from server.layers import LAYERS_ROUTE
from tests.conftest import make_kv, make_spec
from tests.server.conftest import ACME, TOKENS, make_store
from tests.server.live import ThreadServer
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

MEDIA = {"http": False, "shm": None}
"""Medium -> the client's ``colocated``."""


def _client(url: str, **options) -> KVClient:
    """A client that keeps to one medium (no planner): these tests are about the layer path itself."""
    return KVClient(url, plan=False, **options)


def _layers_of(stream) -> list[torch.Tensor]:
    got = list(stream)
    assert [i for i, _ in got] == list(range(len(got)))
    return [t.clone() for _, t in got]


def test_the_route_the_client_asks_for_is_the_one_served():
    assert LAYERS_PATH == LAYERS_ROUTE


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("medium", ["http", "shm"])
def test_layers_are_the_bytes_get_kv_returns(serve_app, medium, dtype, codec):
    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], codec=codec, background=False))
    spec = make_spec(dtype=dtype)
    tokens = list(range(100))
    kv = make_kv(spec, 100)
    with _client(srv.url) as writer:
        writer.put_kv(spec, tokens[:64], kv[:, :, :, :64])
        full, n = writer.get_kv(spec, tokens)
    assert n == 64
    # tokens[:70]: every full block stored (a repeat is served from remembered handles);
    # tokens: 96 asked for, 64 stored (the server answers a strided part of its buffer)
    for _ in range(2):  # a fresh client checks every frame, then copies from what it checked
        with _client(srv.url, colocated=MEDIA[medium]) as c:
            for query in (tokens[:70], tokens[:70], tokens):
                stream = c.get_kv_layers(spec, query)
                assert stream.medium == medium and stream.n_tokens == 64 and stream.num_layers == spec.num_layers
                layers = _layers_of(stream)
                assert len(layers) == spec.num_layers
                assert all(torch.equal(got, full[i]) for i, got in enumerate(layers))
                assert torch.equal(stream.kv, full) and layers[0].dtype == spec.torch_dtype
            if medium == "shm":
                assert c.stats.shm_gets == 3 and c.stats.http_gets == 0
                # tokens[:70]'s blocks are all in the arena (its shared key index: no request);
                # tokens names 2 blocks never stored, which the server is asked about
                assert c.stats.shm_cached_gets == 2
                assert c.stats.shm_blocks_fetched_over_http == 0
            else:
                assert c.stats.http_gets == 3 and c.stats.shm_gets == 0


@pytest.mark.parametrize("medium", ["http", "shm"])
def test_a_miss_yields_no_layers(server, spec, medium):
    with _client(server.url, colocated=MEDIA[medium]) as c:
        c.put_kv(spec, list(range(32)), make_kv(spec, 32))
        stream = c.get_kv_layers(spec, list(range(1000, 1040)))
        assert stream.n_tokens == 0 and list(stream) == [] and stream.kv.shape == spec.kv_shape(0)
        assert c.get_kv_layers(spec, [1, 2, 3]).n_tokens == 0  # under one block
        assert c.get_kv_layers(spec, []).read_all()[1] == 0


def test_each_medium_can_be_asked_for_by_name(server, spec):
    tokens = list(range(32))
    kv = make_kv(spec, 32)
    with _client(server.url) as c:
        c.put_kv(spec, tokens, kv)
        for stream in (iter_layers_http(c.http, spec, tokens), iter_layers_shm(c.shm, spec, tokens)):
            assert torch.equal(stream.read_all()[0], kv)
    with _client(server.url, colocated=False) as remote, pytest.raises(ServiceError, match="does not use the shm"):
        iter_layers_shm(remote.shm, spec, tokens)


def test_auth_errors_are_typed(serve_app, spec):
    srv = serve_app(tokens=json.dumps(TOKENS))
    tokens = list(range(32))
    with _client(srv.url, token=ACME, namespace="acme") as acme:
        acme.put_kv(spec, tokens, make_kv(spec, 32))
        assert acme.get_kv_layers(spec, tokens).n_tokens == 32
    for medium, colocated in MEDIA.items():
        with _client(srv.url, colocated=colocated, retries=0) as anon, pytest.raises(Unauthorized):
            anon.get_kv_layers(spec, tokens)
        with _client(srv.url, token=ACME, namespace="beta", colocated=colocated) as wrong, \
                pytest.raises(Forbidden):
            wrong.get_kv_layers(spec, tokens)
        with _client(srv.url, token=ACME, namespace="shared", colocated=colocated) as other:
            assert other.get_kv_layers(spec, tokens).n_tokens == 0, medium  # acme's blocks are not in "shared"


def test_bad_input_is_a_4xx_with_a_message_and_the_server_keeps_serving(server, spec):
    url = f"{server.url}{LAYERS_ROUTE}"
    bad = [
        (httpx.post(url, content=b"not a KV body", headers={"content-type": KV_MEDIA}), 400, "MalformedRequest"),
        (httpx.post(url, content=b"{", headers={"content-type": "application/json"}), 400, "MalformedRequest"),
        (httpx.post(url, json={"spec": {"model_id": "m"}, "tokens": [1]}), 422, "InvalidSpec"),
        (httpx.post(url, json={"spec": spec.to_dict(), "tokens": [-1]}), 422, "InvalidTokens"),
        (httpx.get(url), 405, None),
    ]
    for resp, status, kind in bad:
        assert resp.status_code == status, resp.text
        if kind is not None:
            error = resp.json()["error"]
            assert error["type"] == kind and error["message"]
    with _client(server.url, colocated=False) as c:
        c.put_kv(spec, list(range(16)), make_kv(spec, 16))
        assert c.get_kv_layers(spec, list(range(16))).read_all()[1] == 16


def test_a_stream_stopped_early_leaves_client_and_server_usable(server):
    spec = make_spec(num_layers=32, head_dim=128)  # 512 KiB a block: more than a socket buffer in flight
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with _client(server.url, colocated=False) as c:
        c.put_kv(spec, tokens, kv)
        with c.get_kv_layers(spec, tokens) as stream:
            layer, first = next(stream)
            assert layer == 0 and torch.equal(first, kv[0])
        assert list(stream) == []  # closed: nothing more comes
        c.get_kv_layers(spec, tokens).close()  # closed before its first layer: its connection too
        assert torch.equal(c.get_kv_layers(spec, tokens).read_all()[0], kv)
        assert torch.equal(c.get_kv(spec, tokens)[0], kv)


# -- the first layer leaves before the last -------------------------------------------------


class HoldLayers:
    """Fault: the server holds every layer after the first until ``release`` is set (10 s at most).

    A client that only hands out layers once the whole answer is in never gets
    its first layer while the rest is held, so it cannot set ``release`` in time.
    """

    def __init__(self, app) -> None:
        self.app = app
        self.release = threading.Event()
        self.released_in_time: bool | None = None
        """None while the rest is held; then whether ``release`` came before the timeout."""

    @property
    def state(self):  # ThreadServer.svc reads app.state
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != LAYERS_ROUTE:
            return await self.app(scope, receive, send)
        bodies = 0

        async def held(message: dict) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body" and message.get("body"):
                bodies += 1
                if bodies == 2:
                    loop = asyncio.get_running_loop()
                    self.released_in_time = await loop.run_in_executor(None, self.release.wait, 10)
            await send(message)

        await self.app(scope, receive, held)


@pytest.fixture
def held_server():
    gate = HoldLayers(create_app(make_store(), ServerSettings(staging_bytes="16MiB", audit_log=None)))
    srv = ThreadServer(gate).start()
    yield srv, gate
    srv.stop()


def test_the_first_layer_is_yielded_while_the_server_holds_the_rest(held_server, spec):
    srv, gate = held_server
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with _client(srv.url, colocated=False) as c:
        c.put_kv(spec, tokens, kv)
        stream = c.get_kv_layers(spec, tokens)
        layer, first = next(stream)
        assert layer == 0 and torch.equal(first, kv[0])
        assert gate.released_in_time is None  # layer 1 has not left the server yet
        gate.release.set()
        rest = list(stream)
    assert gate.released_in_time is True
    assert [i for i, _ in rest] == [1, 2, 3] and torch.equal(stream.kv, kv)


# -- shm: slots that change mid-stream ------------------------------------------------------


def test_blocks_outside_the_arena_come_over_http(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with _client(server.url) as c:
        c.put_kv(spec, tokens, kv)
        assert server.store.migrate(block_hashes(spec, tokens)[2], "memory")
        stream = c.get_kv_layers(spec, tokens)
        assert torch.equal(stream.read_all()[0], kv) and stream.medium == "shm"
        assert c.stats.shm_blocks_fetched_over_http == 1


def test_a_slot_moved_after_layer_0_is_fetched_again(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    key = block_hashes(spec, tokens)[1]
    with _client(server.url) as c:
        c.put_kv(spec, tokens, kv)
        stream = c.get_kv_layers(spec, tokens)
        assert next(stream)[0] == 0
        # fault: placement moves the block (a new generation) while layers 1.. are still to copy
        assert server.store.migrate(key, "memory") and server.store.migrate(key, "shm")
        assert torch.equal(stream.read_all()[0], kv)
        assert c.stats.shm_blocks_fetched_over_http == 1  # copied per layer, so the move was seen
        assert torch.equal(c.get_kv_layers(spec, tokens).read_all()[0], kv)  # new handles from the server


def test_a_block_deleted_after_layer_0_is_a_typed_error(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with _client(server.url) as c:
        c.put_kv(spec, tokens, kv)
        stream = c.get_kv_layers(spec, tokens)
        next(stream)
        server.store.delete_blocks([block_hashes(spec, tokens)[2]])
        with pytest.raises(BlockNotFound, match="while its layers streamed"):
            list(stream)
        stream = c.get_kv_layers(spec, tokens)  # before layer 0 a lost block shortens the prefix
        assert stream.read_all()[1] == 32 and torch.equal(stream.kv, kv[:, :, :, :32])


# -- transformers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from kvstore.integrations.hf import kv_from_cache, out_cache, spec_for
    from tests.kvstore.integrations.test_hf import build

    model, digest, prompt = build()
    spec = spec_for(model, fingerprint=digest[:16])
    with torch.no_grad():
        kv = kv_from_cache(out_cache(model(prompt[:, :128], use_cache=True)), spec)
    return model, spec, prompt, kv


def _next_logits(model, cache, ids):
    from kvstore.integrations.hf import cache_kwargs

    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("medium", ["http", "shm"])
def test_a_streamed_cache_resumes_with_the_logits_of_a_whole_one(server, llama, medium, background):
    from kvstore.integrations.hf import cache_from_kv
    from kvstore.integrations.hf_layers import cache_from_layers

    model, spec, prompt, kv = llama
    with _client(server.url, colocated=MEDIA[medium]) as c:
        c.put_kv(spec, prompt[0, :128], kv)
        full, n = c.get_kv(spec, prompt[0])
        stream = c.get_kv_layers(spec, prompt[0])
        cache = cache_from_layers(stream, model.config, background=background)
        assert cache.get_seq_length() == n == 128  # known before any layer is read
        streamed = _next_logits(model, cache, prompt[:, n:])
    whole = _next_logits(model, cache_from_kv(full, model.config), prompt[:, n:])
    assert torch.equal(streamed, whole)
    assert cache.get_seq_length() == 129 and stream.medium == medium


def test_the_model_computes_layer_0_while_the_server_holds_the_rest(held_server, llama):
    from kvstore.integrations.hf import cache_from_kv
    from kvstore.integrations.hf_layers import cache_from_layers

    srv, gate = held_server
    model, spec, prompt, kv = llama
    hook = model.model.layers[0].register_forward_hook(lambda *_: gate.release.set())
    try:
        with _client(srv.url, colocated=False) as c:
            c.put_kv(spec, prompt[0, :128], kv)
            cache = cache_from_layers(c.get_kv_layers(spec, prompt[0]), model.config)
            streamed = _next_logits(model, cache, prompt[:, 128:])
    finally:
        hook.remove()
    assert gate.released_in_time is True  # layer 0 ran before layer 1 had left the server
    assert torch.equal(streamed, _next_logits(model, cache_from_kv(kv, model.config), prompt[:, 128:]))


def test_a_streamed_cache_of_a_miss_is_empty_and_a_broken_stream_raises(llama):
    from kvstore.errors import InvalidKV
    from kvstore.integrations.hf_layers import cache_from_layers

    model, spec, prompt, kv = llama
    empty = cache_from_layers(iter(()), model.config)
    assert empty.get_seq_length() == 0
    _next_logits(model, empty, prompt[:, :4])
    assert empty.get_seq_length() == 4

    def two_layers():  # the stream stops after layer 1 (no n_tokens up front: read off layer 0)
        for i in range(2):
            yield i, kv[i]

    broken = cache_from_layers(two_layers(), model.config, background=False)
    assert broken.get_seq_length() == 128
    with pytest.raises(InvalidKV, match="ended after 2 of 4 layers"):
        _next_logits(model, broken, prompt[:, 128:])
    with pytest.raises(InvalidKV, match="sliding"):
        cache_from_layers(iter(()), type(model.config)(**{**model.config.to_dict(),
                                                           "layer_types": ["sliding_attention"] * 4}))
