"""The /v1 data routes over real HTTP: KV put/get/lookup/delete, blocks, bad input."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from client_sdk import KVClient, MalformedRequest, PayloadTooLarge
from kvstore.wire.rest import BATCH_MEDIA, KV_MEDIA, encode_kv_head, parse_batch_head, parse_kv_head
from kvstore.wire.errors import error_from
from kvstore import codec
from kvstore.errors import InvalidKV, InvalidSpec, InvalidTokens
from kvstore.keys import block_hashes
from tests.conftest import make_kv, make_spec
from tests.server.conftest import make_store


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_put_get_roundtrip_is_bit_identical(client, dtype):
    spec = make_spec(dtype=dtype)
    tokens = list(range(100))
    kv = make_kv(spec, 100)
    assert client.put_kv(spec, tokens, kv) == 96
    got, n = client.get_kv(spec, tokens)
    assert n == 96 and got.dtype == kv.dtype and got.shape == spec.kv_shape(96)
    assert torch.equal(got.view(torch.uint8), kv[:, :, :, :96].contiguous().view(torch.uint8))
    assert client.stats.last_medium == "http" and client.stats.shm_gets == 0


def test_get_returns_the_longest_stored_prefix(client, spec):
    tokens = list(range(80))
    kv = make_kv(spec, 80)
    client.put_kv(spec, tokens[:48], kv[:, :, :, :48])
    got, n = client.get_kv(spec, tokens)
    assert n == 48 and torch.equal(got, kv[:, :, :, :48])
    other = [7] + tokens[1:]
    empty, n0 = client.get_kv(spec, other)
    assert n0 == 0 and empty.shape == spec.kv_shape(0)


def test_lookup_reports_tokens_keys_and_tiers(client, server, spec):
    tokens = list(range(64))
    client.put_kv(spec, tokens, make_kv(spec, 64))
    answer = client.lookup_blocks(spec, tokens + [1, 2, 3])
    assert answer["tokens"] == 64 and answer["block_tokens"] == 16
    assert [b["key"] for b in answer["blocks"]] == [k.hex() for k in block_hashes(spec, tokens)]
    assert {b["tier"] for b in answer["blocks"]} == {"shm"}
    assert client.lookup(spec, tokens[:40]) == 32
    assert client.lookup(spec, [5] * 64) == 0


def test_json_bodies_work_for_get_and_lookup(server, client, spec):
    tokens = list(range(32))
    kv = make_kv(spec, 32)
    client.put_kv(spec, tokens, kv)
    body = {"spec": spec.to_dict(), "tokens": tokens}
    look = httpx.post(f"{server.url}/v1/lookup", json=body)
    assert look.status_code == 200 and look.json()["tokens"] == 32
    got = httpx.post(f"{server.url}/v1/kv/get", json=body)
    assert got.status_code == 200 and got.headers["x-kv-tokens"] == "32"
    assert got.headers["content-type"] == KV_MEDIA and got.headers["x-kv-medium"] == "http"
    assert got.content == kv.contiguous().numpy().tobytes()


def test_delete_removes_the_sequence(client, spec):
    tokens = list(range(48))
    client.put_kv(spec, tokens, make_kv(spec, 48))
    assert client.delete(spec, tokens) == 3
    assert client.lookup(spec, tokens) == 0
    assert client.delete(spec, tokens) == 0


def test_namespaces_are_part_of_the_key(server, spec):
    a = KVClient(server.url, namespace="a", colocated=False)
    b = KVClient(server.url, namespace="b", colocated=False)
    tokens = list(range(32))
    a.put_kv(spec, tokens, make_kv(spec, 32))
    assert a.lookup(spec, tokens) == 32 and b.lookup(spec, tokens) == 0
    assert b.get_kv(spec, tokens)[1] == 0
    a.close(), b.close()


# -- bad input: 4xx naming the field, and the server stays up ------------------------------


def _kv_body(spec_dict, tokens, kv_bytes=b"", kv_tokens=0):
    head, tok_region = encode_kv_head(spec_dict, len(tokens), kv_tokens)
    tok = bytes(memoryview(torch.tensor(tokens, dtype=torch.int64).numpy().astype("<u4")).cast("B"))
    return head + tok + bytes(tok_region - len(tok)) + kv_bytes


def _post(server, path, content, ctype=KV_MEDIA, **headers):
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": ctype, **headers})


def _error(resp):
    body = resp.json()["error"]
    return body["type"], body["message"], body.get("field")


@pytest.mark.parametrize("mutate,field,kind", [
    (lambda s: s.update(num_layers=0), "spec", "InvalidSpec"),
    (lambda s: s.update(dtype="int4"), "spec", "InvalidSpec"),
    (lambda s: s.pop("head_dim"), "spec", "InvalidSpec"),
    (lambda s: s.update(colour="red"), "spec", "InvalidSpec"),
])
def test_bad_spec_is_422_naming_the_field(server, spec, mutate, field, kind):
    d = spec.to_dict()
    mutate(d)
    resp = httpx.post(f"{server.url}/v1/lookup", json={"spec": d, "tokens": [1, 2, 3]})
    assert resp.status_code == 422
    t, message, f = _error(resp)
    assert t == kind and f == field and message.startswith("spec:")
    assert isinstance(error_from(422, resp.content), InvalidSpec)
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_bad_tokens_and_missing_fields_are_422(server, spec):
    resp = httpx.post(f"{server.url}/v1/lookup", json={"spec": spec.to_dict(), "tokens": [1, -5]})
    assert resp.status_code == 422 and _error(resp)[2] == "tokens" and "[0, 2**32)" in _error(resp)[1]
    assert isinstance(error_from(422, resp.content), InvalidTokens)
    resp = httpx.post(f"{server.url}/v1/lookup", json={"tokens": [1]})
    assert resp.status_code == 422 and _error(resp)[2] == "spec" and "required" in _error(resp)[1]
    resp = httpx.post(f"{server.url}/v1/lookup", json={"spec": spec.to_dict(), "tokens": "abc"})
    assert resp.status_code == 422 and _error(resp)[2] == "tokens"
    resp = _post(server, "/v1/lookup", b'{"spec": {', ctype="application/json")
    assert resp.status_code == 400 and _error(resp)[0] == "MalformedRequest" and "not JSON" in _error(resp)[1]


def test_bad_kv_bodies_are_400_or_422(server, spec):
    good = _kv_body(spec.to_dict(), list(range(16)), make_kv(spec, 16).numpy().tobytes(), 16)
    assert _post(server, "/v1/kv/put", good).status_code == 200
    resp = _post(server, "/v1/kv/put", b"XXXX" + good[4:])
    assert resp.status_code == 400 and "magic" in _error(resp)[1]
    resp = _post(server, "/v1/kv/put", good[:-10])
    assert resp.status_code == 400 and "body" in _error(resp)[1]
    resp = _post(server, "/v1/kv/put", good, ctype="application/octet-stream")
    assert resp.status_code == 400 and _error(resp)[1].startswith("content-type")
    short = _kv_body(spec.to_dict(), list(range(32)), make_kv(spec, 16).numpy().tobytes(), 16)
    resp = _post(server, "/v1/kv/put", short)
    assert resp.status_code == 422 and _error(resp)[0] == "InvalidKV" and ">=32" in _error(resp)[1]
    assert isinstance(error_from(422, resp.content), InvalidKV)
    resp = _post(server, "/v1/kv/get", good[:6])
    assert resp.status_code == 400
    resp = _post(server, "/v1/kv/put", good, **{"x-kv-namespace": "no spaces!"})
    assert resp.status_code == 422 and _error(resp)[2] == "x-kv-namespace"
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_unknown_route_and_method_are_typed(server):
    resp = httpx.get(f"{server.url}/v1/nope")
    assert resp.status_code == 404 and _error(resp)[0] == "RouteNotFound"
    resp = httpx.delete(f"{server.url}/v1/lookup")
    assert resp.status_code == 405 and _error(resp)[0] == "RouteNotFound"


def test_body_over_the_limit_is_413(serve_app, spec):
    srv = serve_app(max_body_bytes="64KiB")
    big = _kv_body(spec.to_dict(), list(range(160)), make_kv(spec, 160).numpy().tobytes(), 160)
    assert len(big) > 64 * 1024
    resp = _post(srv, "/v1/kv/put", big)
    assert resp.status_code == 413 and _error(resp)[0] == "PayloadTooLarge"

    def chunks():  # no Content-Length: the route counts as it reads
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    resp = httpx.post(f"{srv.url}/v1/kv/put", content=chunks(), headers={"content-type": KV_MEDIA})
    assert resp.status_code == 413 and "limit" in _error(resp)[1]
    client = KVClient(srv.url, colocated=False, retries=0)
    with pytest.raises(PayloadTooLarge):
        client.put_kv(spec, list(range(160)), make_kv(spec, 160))
    assert client.put_kv(spec, list(range(16)), make_kv(spec, 16)) == 16  # still serving
    client.close()


# -- blocks ------------------------------------------------------------------------------


def test_block_routes_get_head_put_delete(serve_app, spec):
    a, b = serve_app(), serve_app()
    ca = KVClient(a.url, colocated=False)
    cb = KVClient(b.url, colocated=False)
    tokens = list(range(48))
    kv = make_kv(spec, 48)
    ca.put_kv(spec, tokens, kv)
    keys = block_hashes(spec, tokens)
    frame = ca.get_block(keys[0])
    assert codec.decode(frame).equal(kv[:, :, :, :16])
    head = httpx.head(f"{a.url}/v1/blocks/{keys[0].hex()}")
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(frame)
    assert head.headers["x-kv-tier"] == "shm" and head.headers["x-kv-codec"] == "raw"
    assert httpx.head(f"{a.url}/v1/blocks/{'00' * 32}").status_code == 404
    # carry every frame to server b by key: b then serves the sequence
    frames = ca.get_blocks(keys + [b"\0" * 32])
    assert frames[-1] is None
    assert cb.put_blocks(list(zip(keys, frames[:3]))) == 3
    got, n = cb.get_kv(spec, tokens)
    assert n == 48 and torch.equal(got, kv)
    assert httpx.post(f"{b.url}/v1/blocks/exists", json={"keys": [k.hex() for k in keys]}).json() == {
        "present": [True, True, True]}
    assert cb.delete_block(keys[2]) is True and cb.delete_block(keys[2]) is False
    assert cb.lookup(spec, tokens) == 32
    assert cb.delete_blocks(keys) == 2 and cb.lookup(spec, tokens) == 0
    ca.close(), cb.close()


def test_block_put_refuses_a_frame_of_another_namespace_and_garbage(server, client, spec):
    tokens = list(range(16))
    client.put_kv(spec, tokens, make_kv(spec, 16))
    key = block_hashes(spec, tokens)[0]
    frame = client.get_block(key)
    other = KVClient(server.url, namespace="other", colocated=False)
    resp = httpx.put(f"{server.url}/v1/blocks/{'11' * 32}", content=frame, headers={"x-kv-namespace": "other"})
    assert resp.status_code == 422 and "namespace" in _error(resp)[1]
    bad = bytearray(frame)
    bad[-1] ^= 0xFF
    resp = httpx.put(f"{server.url}/v1/blocks/{'22' * 32}", content=bytes(bad))
    assert resp.status_code == 422 and _error(resp)[0] == "CorruptFrame"
    resp = httpx.put(f"{server.url}/v1/blocks/not-hex", content=frame)
    assert resp.status_code == 422 and _error(resp)[2] == "key"
    assert other.get_block(key) is None  # another namespace's block reads as absent
    other.close()


def test_batch_get_answer_layout(server, client, spec):
    tokens = list(range(32))
    client.put_kv(spec, tokens, make_kv(spec, 32))
    keys = block_hashes(spec, tokens)
    resp = httpx.post(f"{server.url}/v1/blocks/get", json={"keys": [keys[1].hex(), "ab" * 32]})
    assert resp.headers["content-type"] == BATCH_MEDIA
    blocks, data_at = parse_batch_head(resp.content)
    assert data_at % 64 == 0 and blocks[1]["offset"] is None
    assert blocks[0]["key"] == keys[1].hex() and blocks[0]["offset"] % 64 == 0
    frame = resp.content[data_at + blocks[0]["offset"]:data_at + blocks[0]["offset"] + blocks[0]["length"]]
    assert frame == client.get_block(keys[1])


def test_kv_head_layout_is_aligned_and_round_trips(spec):
    head, region = encode_kv_head(spec.to_dict(), 5, 16)
    parsed = parse_kv_head(head + bytes(region))
    assert (parsed.n_tokens, parsed.kv_tokens) == (5, 16)
    assert parsed.tokens_at == len(head) and parsed.tokens_at % 64 == 0 and parsed.kv_at % 64 == 0
    assert parsed.total == parsed.kv_at + spec.bytes_per_token * 16
    bad = json.dumps({"spec": spec.to_dict(), "n_tokens": -5, "kv_tokens": 0}).encode()
    with pytest.raises(MalformedRequest, match="header.n_tokens"):
        parse_kv_head(b"KVW1" + len(bad).to_bytes(4, "little") + bad)
    assert json.loads(head[8:8 + int.from_bytes(head[4:8], "little")])["spec"] == spec.to_dict()


def test_hot_routes_map_errors_like_every_other_route(serve_app, spec, caplog):
    """The hot data routes skip FastAPI's router (``server.app._Direct``); their errors must not differ."""
    store = make_store()
    srv = serve_app(store)
    client = KVClient(srv.url, colocated=False)
    tokens = list(range(32))
    client.put_kv(spec, tokens, make_kv(spec, 32))
    body = {"spec": spec.to_dict(), "tokens": tokens}
    bad = httpx.post(f"{srv.url}/v1/lookup", json={"spec": spec.to_dict()})  # a typed store error
    assert bad.status_code == 422 and _error(bad)[0] == "InvalidInput" and "tokens" in _error(bad)[1]

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")
    store.prefix_blocks = broken  # the walk /v1/lookup answers from
    with caplog.at_level("ERROR", logger="kvstore.server"):
        resp = httpx.post(f"{srv.url}/v1/lookup", json={"spec": spec.to_dict(), "tokens": tokens + list(range(16))})
    assert resp.status_code == 500
    assert resp.json() == {"error": {"type": "ServiceError", "message": "internal server error"}}
    assert "injected fault" in caplog.text  # the traceback goes to the log, not the client
    del store.prefix_blocks
    assert httpx.post(f"{srv.url}/v1/lookup", json=body).json()["tokens"] == 32  # still up
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'route="/v1/lookup"' in metrics and 'status="500"' in metrics  # series by route template
    client.close()
