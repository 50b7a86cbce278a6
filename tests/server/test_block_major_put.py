"""Block-major KV puts (``KV_BLOCKS_MEDIA``) over real HTTP: each block received straight into a
reserved shm slot (``server.block_puts``), and the SDK's choice of body.

Here: bit-exact round trips for every dtype, through the slots and through the buffered fallback;
blocks already stored read and dropped; the SDK sending the old body to a server that does not
list the new one (and after one refuses it); and bad input (a body that ends mid-block or runs
long, a head whose dtype or token count disagrees with the bytes, another tenant's namespace, a
client gone mid-body; blocks out of order, left out, labelled another size, or keyed for other
tokens, another model or another namespace; a body without labels), each answered 4xx naming
the field, storing nothing and leaving no slot reserved.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import numpy as np
import pytest
import torch

from client_sdk import AsyncKVClient, KVClient
from kvstore.keys import block_hashes
from kvstore.wire.rest import BLOCK_LABEL_BYTES, KV_BLOCKS_MEDIA, KV_MEDIA, encode_block_labels, encode_kv_head
from tests.conftest import make_kv, make_spec, wait_until
from tests.server.conftest import ACME, BETA, TOKENS, make_store
from tiers.memory import MemoryTier

BT = 16


def block_major(spec, tokens, kv, *, n_tokens=None, spec_dict=None, namespace="default", order=None) -> bytes:
    """A block-major body by hand: the KV head and tokens, then each full block's label and bytes;
    ``order``: the blocks' order (each with its own label), block 0 first by default."""
    n = len(tokens) if n_tokens is None else n_tokens
    blocks = n // spec.block_tokens
    head, tok_region = encode_kv_head(spec_dict or spec.to_dict(), n, blocks * spec.block_tokens)
    toks = np.asarray(tokens, dtype="<u4").tobytes()
    keys = block_hashes(spec, tokens, namespace)
    labels = encode_block_labels(keys, spec.block_nbytes)
    kv_blocks = [labels[i * BLOCK_LABEL_BYTES:(i + 1) * BLOCK_LABEL_BYTES]
                 + kv[:, :, :, i * BT:(i + 1) * BT].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                 for i in range(len(tokens) // BT)]
    order = range(len(kv_blocks)) if order is None else order
    return head + toks + bytes(tok_region - len(toks)) + b"".join(kv_blocks[i] for i in order)


def stored_reasons(server) -> list[str]:
    """Why each block was stored, as the event log says (``reserved``: through the slots)."""
    events, _ = server.store.core.events.read(0, 10_000)
    return [e.reason for e in events if e.kind == "stored"]


def assert_nothing_left(server, spec, tokens, namespace="default") -> None:
    """No block of ``tokens`` stored, no slot reserved, no reservation open."""
    store = server.store
    wait_until(lambda: store.reservations.open_count() == 0, what="every reservation ended")
    assert store.tiers[0].stats().details["reserved_bytes"] == "0"
    assert store.lookup(spec, tokens, namespace) == 0
    assert not [e for e in store.entries() if e.namespace == namespace]


def put_raw(server, body, *, token=None, namespace=None, length=True) -> httpx.Response:
    headers = {"content-type": KV_BLOCKS_MEDIA}
    if token:
        headers["authorization"] = f"Bearer {token}"
    if namespace:
        headers["x-kv-namespace"] = namespace
    content = body if length else iter([body[i:i + 4096] for i in range(0, len(body), 4096)])  # chunked
    return httpx.post(f"{server.url}/v1/kv/put", content=content, headers=headers, timeout=30)


def field_of(r: httpx.Response) -> str | None:
    return r.json()["error"].get("field")


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_a_put_goes_block_major_into_slots_and_reads_back_bit_exact(server, dtype):
    spec = make_spec(dtype=dtype)
    tokens, kv = list(range(100)), make_kv(spec, 100, seed=1)
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens, kv) == 96
        assert KV_BLOCKS_MEDIA in c.http.put_media
        got, n = c.get_kv(spec, tokens)
    assert n == 96 and torch.equal(got.view(torch.uint8), kv[:, :, :, :96].contiguous().view(torch.uint8))
    assert stored_reasons(server) == ["reserved"] * 6  # every block went through a reserved slot
    assert server.store.tiers[0].stats().details["reserved_bytes"] == "0"
    assert server.store.reservations.open_count() == 0


def test_info_lists_both_put_bodies(server):
    assert httpx.get(f"{server.url}/v1/info").json()["put_media"] == [KV_MEDIA, KV_BLOCKS_MEDIA]


def test_blocks_already_stored_are_read_and_dropped(server, spec):
    first, kv = make_kv(spec, 64, seed=2), make_kv(spec, 96, seed=3)
    tokens = list(range(500, 596))
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens[:64], first) == 64
        assert c.put_kv(spec, tokens, kv) == 96  # four blocks stored: their bytes skipped
        got, n = c.get_kv(spec, tokens)
    assert n == 96
    assert torch.equal(got[:, :, :, :64], first) and torch.equal(got[:, :, :, 64:], kv[:, :, :, 64:])
    assert stored_reasons(server) == ["reserved"] * 6


def test_a_put_with_every_block_stored_stores_nothing_new(server, spec):
    tokens, kv = list(range(48)), make_kv(spec, 48)
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        c.put_kv(spec, tokens, kv)
        assert c.put_kv(spec, tokens, make_kv(spec, 48, seed=9)) == 48
        assert torch.equal(c.get_kv(spec, tokens)[0], kv)
    assert len(stored_reasons(server)) == 3 and server.store.reservations.open_count() == 0


@pytest.mark.parametrize("how", ["reserved_puts_off", "no_room", "memory_top"])
def test_without_reserved_slots_the_body_is_buffered_and_stored_the_same(serve_app, spec, how):
    settings = {"reserved_puts": False} if how == "reserved_puts_off" else {}
    store = {"no_room": make_store(shm_bytes=16 << 10), "memory_top": None}.get(how)
    if how == "memory_top":
        from kvstore import KVStore

        store = KVStore([MemoryTier(64 << 20)], background=False)
    server = serve_app(store, **settings)
    tokens, kv = list(range(1_000, 1_070)), make_kv(spec, 70, seed=4)
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens, kv) == 64
        got, n = c.get_kv(spec, tokens)
    assert n == 64 and torch.equal(got, kv[:, :, :, :64])
    assert stored_reasons(server) == ["put"] * 4  # put_kv's path, after the body was put in token order
    assert server.store.reservations.open_count() == 0


def test_a_one_block_put_is_stored_without_reserving(server, spec):
    tokens, kv = list(range(20)), make_kv(spec, 20)
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens, kv) == 16
        assert torch.equal(c.get_kv(spec, tokens)[0], kv[:, :, :, :16])
    assert stored_reasons(server) == ["put"]


def test_a_put_of_less_than_a_block_stores_nothing(server, spec):
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, list(range(10)), make_kv(spec, 10)) == 0
        assert KV_BLOCKS_MEDIA in c.http.put_media
    assert stored_reasons(server) == [] and server.store.reservations.open_count() == 0


def test_a_large_put_whose_rows_go_out_in_many_partial_writes_reads_back(server):
    spec = make_spec(num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB blocks: 512 rows of 4 KiB each
    tokens, kv = list(range(64)), make_kv(spec, 72, seed=7)  # 8 MiB of blocks, and a tail the body leaves out
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens + list(range(8)), kv) == 64
        got, n = c.get_kv(spec, tokens)
    assert n == 64 and torch.equal(got, kv[:, :, :, :64])
    assert stored_reasons(server) == ["reserved"] * 4


def test_the_block_major_parts_hold_the_bytes_the_layout_names(spec):
    from client_sdk._common import KVPutBody
    from client_sdk._http import joined

    tokens, kv = list(range(40)), make_kv(spec, 40)  # two full blocks and a tail
    body = KVPutBody(spec, np.asarray(tokens, dtype=np.uint32), kv)
    assert joined(body.blocks("default")) == block_major(spec, tokens, kv)
    assert joined(body) == b"".join(bytes(memoryview(p).cast("B")) for p in body)  # token-major, as before


def test_the_async_client_sends_block_major_too(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64, seed=5)

    async def go():
        async with AsyncKVClient(server.url, colocated=False, plan=False, retries=0) as c:
            assert await c.put_kv(spec, tokens, kv) == 64
            assert KV_BLOCKS_MEDIA in c.http.put_media
            return await c.get_kv(spec, tokens)

    got, n = asyncio.run(go())
    assert n == 64 and torch.equal(got, kv)
    assert stored_reasons(server) == ["reserved"] * 4


# -- servers from before block-major bodies ------------------------------------------------------


class OlderServer:
    """The app as a server from before block-major bodies answers: ``/v1/info`` without
    ``put_media``, and a block-major put refused for its content type (as the old route did)."""

    def __init__(self, app) -> None:
        self.app, self.older, self.put_types = app, True, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.older:
            return await self.app(scope, receive, send)
        if scope["path"] == "/v1/kv/put":
            media = dict(scope["headers"]).get(b"content-type", b"").decode()
            self.put_types.append(media)
            if media != KV_MEDIA:
                body = json.dumps({"error": {"type": "MalformedRequest", "field": "content-type",
                                             "message": f"content-type: must be {KV_MEDIA}"}}).encode()
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                return await send({"type": "http.response.body", "body": body})
        if scope["path"] != "/v1/info":
            return await self.app(scope, receive, send)

        async def without_put_media(message):
            if message["type"] == "http.response.body":
                info = json.loads(message["body"])
                info.pop("put_media")
                message = {**message, "body": json.dumps(info).encode()}
            elif message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message["headers"] if k != b"content-length"]}
            await send(message)
        return await self.app(scope, receive, without_put_media)


@pytest.fixture
def older(tmp_path):
    from server import ServerSettings, create_app
    from tests.server.live import ThreadServer

    wrapper = OlderServer(create_app(make_store(), ServerSettings(staging_bytes="16MiB")))
    srv = ThreadServer(wrapper).start()
    yield srv, wrapper
    srv.stop()


def test_a_server_that_lists_no_block_bodies_gets_the_old_one(older, spec):
    srv, wrapper = older
    tokens, kv = list(range(64)), make_kv(spec, 64)
    with KVClient(srv.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, tokens, kv) == 64
        assert c.http.put_media == frozenset({KV_MEDIA})
        assert torch.equal(c.get_kv(spec, tokens)[0], kv)
    assert wrapper.put_types == [KV_MEDIA]


def test_a_server_that_refuses_block_bodies_later_gets_the_old_one_from_then_on(older, spec):
    srv, wrapper = older
    wrapper.older = False
    with KVClient(srv.url, colocated=False, plan=False, retries=0) as c:
        assert c.put_kv(spec, list(range(32)), make_kv(spec, 32)) == 32
        assert KV_BLOCKS_MEDIA in c.http.put_media
        wrapper.older = True  # restarted as an older version
        tokens, kv = list(range(100, 164)), make_kv(spec, 64, seed=6)
        assert c.put_kv(spec, tokens, kv) == 64
        assert c.put_kv(spec, list(range(200, 232)), make_kv(spec, 32)) == 32
        assert torch.equal(c.get_kv(spec, tokens)[0], kv)
    assert wrapper.put_types == [KV_BLOCKS_MEDIA, KV_MEDIA, KV_MEDIA]


# -- bad input: 4xx naming the field, nothing stored, no slot left reserved -----------------------


def test_a_body_that_ends_mid_block_is_400_body(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    body = block_major(spec, tokens, kv)
    cut = len(body) - spec.block_nbytes - spec.block_nbytes // 2  # two and a half blocks arrive
    r = put_raw(server, body[:cut], length=False)  # chunked: the head alone says how long it is
    assert r.status_code == 400 and field_of(r) == "body" and "ended after" in r.text
    assert_nothing_left(server, spec, tokens)


def test_a_body_longer_than_its_head_is_400_body(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    body = block_major(spec, tokens, kv) + b"\0" * 100
    for length in (True, False):  # refused from Content-Length, or once the extra bytes come
        r = put_raw(server, body, length=length)
        assert r.status_code == 400 and field_of(r) == "body", r.text
        assert_nothing_left(server, spec, tokens)


def test_a_head_whose_dtype_disagrees_with_the_bytes_is_400_naming_the_dtype(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)  # float16 bytes
    body = block_major(spec, tokens, kv, spec_dict={**spec.to_dict(), "dtype": "float32"})
    r = put_raw(server, body)
    assert r.status_code == 400 and field_of(r) == "header.spec.dtype", r.text
    assert "float16" in r.json()["error"]["message"]
    assert_nothing_left(server, spec, tokens)
    assert_nothing_left(server, make_spec(dtype="float32"), tokens)


def test_a_head_naming_more_tokens_than_bytes_sent_is_400_naming_the_tokens(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    body = block_major(spec, tokens[:48], kv[:, :, :, :48])  # three blocks of bytes
    head_64 = block_major(spec, tokens, kv)[:len(body) - 3 * spec.block_nbytes]  # a head for 64 tokens
    r = put_raw(server, head_64 + body[len(body) - 3 * spec.block_nbytes:])
    assert r.status_code == 400 and field_of(r) == "header.kv_tokens", r.text
    assert_nothing_left(server, spec, tokens)


def test_kv_tokens_other_than_the_full_blocks_is_422(server, spec):
    tokens, kv = list(range(40)), make_kv(spec, 40)
    head, region = encode_kv_head(spec.to_dict(), 40, 40)  # 40 tokens of KV: not whole blocks
    toks = np.asarray(tokens, "<u4").tobytes()
    body = head + toks + bytes(region - len(toks)) + kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    r = put_raw(server, body)
    assert r.status_code == 422 and field_of(r) == "header.kv_tokens", r.text
    assert_nothing_left(server, spec, tokens)


def test_another_tenants_namespace_is_403_and_nothing_is_stored(auth_server, spec):
    assert "beta" not in TOKENS[ACME]["namespaces"]
    tokens, kv = list(range(64)), make_kv(spec, 64)
    r = put_raw(auth_server, block_major(spec, tokens, kv), token=ACME, namespace="beta")
    assert r.status_code == 403
    assert_nothing_left(auth_server, spec, tokens, "beta")
    r = put_raw(auth_server, block_major(spec, tokens, kv, namespace="acme"), token=ACME, namespace="acme")
    assert r.status_code == 200 and r.json() == {"stored_tokens": 64}


@pytest.fixture(params=["slots", "buffered"])
def either_way(request, serve_app):
    """A server that receives block-major bodies into reserved slots, or one that buffers them."""
    return serve_app(make_store(), reserved_puts=request.param == "slots")


def test_blocks_out_of_order_are_400_and_nothing_is_stored(either_way, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    r = put_raw(either_way, block_major(spec, tokens, kv, order=[0, 2, 1, 3]))
    assert r.status_code == 400 and field_of(r) == "body", r.text
    assert "block 1 is labelled block 2" in r.json()["error"]["message"]
    assert_nothing_left(either_way, spec, tokens)
    assert stored_reasons(either_way) == []


def test_a_block_left_out_and_another_sent_twice_is_400(either_way, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    r = put_raw(either_way, block_major(spec, tokens, kv, order=[0, 1, 3, 3]))  # the length still adds up
    assert r.status_code == 400 and field_of(r) == "body", r.text
    assert_nothing_left(either_way, spec, tokens)


def test_a_block_keyed_under_another_namespace_is_422_and_nothing_is_stored(either_way, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    r = put_raw(either_way, block_major(spec, tokens, kv, namespace="other"))  # sent to "default"
    assert r.status_code == 422 and field_of(r) == "body", r.text
    assert "another namespace" in r.json()["error"]["message"]
    assert_nothing_left(either_way, spec, tokens)
    assert_nothing_left(either_way, spec, tokens, "other")


def test_a_block_keyed_for_other_tokens_or_another_model_is_422(either_way, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    blocks = 4 * (BLOCK_LABEL_BYTES + spec.block_nbytes)
    head = block_major(spec, tokens, kv)[:-blocks]  # the head and tokens, then blocks labelled...
    for labelled in (block_major(spec, list(range(1, 65)), kv),  # ...for other tokens
                     block_major(make_spec(model_id="another-model"), tokens, kv)):  # ...for another model
        r = put_raw(either_way, head + labelled[-blocks:])
        assert r.status_code == 422 and field_of(r) == "body", r.text
        assert "block 0 is keyed" in r.json()["error"]["message"]
    assert_nothing_left(either_way, spec, tokens)


def test_a_block_labelled_another_size_is_400(either_way, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    body = bytearray(block_major(spec, tokens, kv))
    third = len(body) - 2 * (BLOCK_LABEL_BYTES + spec.block_nbytes)
    body[third + 8:third + 16] = (spec.block_nbytes - 2).to_bytes(8, "little")
    r = put_raw(either_way, bytes(body))
    assert r.status_code == 400 and field_of(r) == "body", r.text
    assert f"block 2 is labelled {spec.block_nbytes - 2} bytes" in r.json()["error"]["message"]
    assert_nothing_left(either_way, spec, tokens)


def test_an_unlabelled_body_is_400_and_its_first_media_type_is_refused(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    head, region = encode_kv_head(spec.to_dict(), 64, 64)
    toks = np.asarray(tokens, "<u4").tobytes()
    unlabelled = head + toks + bytes(region - len(toks)) + b"".join(
        kv[:, :, :, i * BT:(i + 1) * BT].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for i in range(4))
    r = put_raw(server, unlabelled, length=False)  # chunked: the Content-Length check cannot catch it
    assert r.status_code == 400 and field_of(r) == "body" and "label" in r.text, r.text
    r = httpx.post(f"{server.url}/v1/kv/put", content=unlabelled,
                   headers={"content-type": "application/x-kvstore-kv-blocks"}, timeout=30)
    assert r.status_code == 400 and field_of(r) == "content-type"  # an older SDK falls back to KV_MEDIA
    assert_nothing_left(server, spec, tokens)


def test_a_client_gone_mid_body_leaves_no_block_and_no_slot(server, spec):
    tokens, kv = list(range(64)), make_kv(spec, 64)
    body = block_major(spec, tokens, kv)
    head = (f"POST /v1/kv/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {KV_BLOCKS_MEDIA}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sent = len(body) - 2 * spec.block_nbytes - 100  # into the third block
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body[:sent])
        wait_until(lambda: server.store.reservations.open_count() == 1, what="the put reserved its slots")
    # the socket is closed: the server reads a disconnect mid-body and gives every slot back
    assert_nothing_left(server, spec, tokens)
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:  # and the store goes on
        assert c.put_kv(spec, tokens, kv) == 64
        assert torch.equal(c.get_kv(spec, tokens)[0], kv)


def test_the_reserved_blocks_are_the_new_ones_only(server, spec):
    tokens = list(range(64))
    with KVClient(server.url, colocated=False, plan=False, retries=0) as c:
        c.put_kv(spec, tokens[:32], make_kv(spec, 32))
    keys = block_hashes(spec, tokens)
    body = block_major(spec, tokens, make_kv(spec, 64, seed=8))
    r = put_raw(server, body[:-spec.block_nbytes // 2], length=False)  # the last new block cut short
    assert r.status_code == 400 and field_of(r) == "body"
    assert server.store.lookup(spec, tokens) == 32  # the stored prefix stands; no new block came in
    assert {e.key for e in server.store.entries()} == set(keys[:2])
    assert server.store.reservations.open_count() == 0
    assert server.store.tiers[0].stats().details["reserved_bytes"] == "0"


def test_a_put_over_the_tenants_quota_is_507_before_any_slot_is_reserved(auth_server):
    spec = make_spec(num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB blocks; beta may hold 1 MiB
    tokens, kv = list(range(32)), make_kv(spec, 32)
    r = put_raw(auth_server, block_major(spec, tokens, kv), token=BETA, namespace="beta")
    assert r.status_code == 507 and r.json()["error"]["type"] == "QuotaExceeded"
    assert_nothing_left(auth_server, spec, tokens, "beta")
