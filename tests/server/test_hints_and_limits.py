"""Bad input from a user's report, against a real uvicorn: a get under another dtype says why it is
empty (a hint, warned once by the SDK), a request over ``KVSTORE_MAX_TOKENS_PER_REQUEST`` is 413
``TooManyTokens`` naming the setting and stores nothing, and every 4xx of one bad field names it."""

from __future__ import annotations

import json
import warnings

import httpx
import pytest

from client_sdk import KVClient, TooManyTokens
from kvstore.errors import InvalidInput, KVStoreWarning
from kvstore.wire.errors import error_from
from kvstore.wire.rest import H_HINT, KV_MEDIA, encode_kv_head
from tests.conftest import make_kv, make_spec
from tests.server.conftest import ADMIN

TOKENS = list(range(900, 964))  # 4 blocks of 16
F16, F32 = make_spec(dtype="float16"), make_spec(dtype="float32")
CAP = 1000


def _kv_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, KVStoreWarning)]


def _error(resp) -> dict:
    return resp.json()["error"]


# -- the spec-mismatch hint ---------------------------------------------------------------------------


def test_a_get_under_another_dtype_is_empty_with_a_hint_and_the_sdk_warns_once(server):
    with KVClient(server.url, colocated=False, plan=False, retries=0) as client:
        assert client.put_kv(F16, TOKENS, make_kv(F16, 64)) == 64
        body = {"spec": F32.to_dict(), "tokens": TOKENS}
        resp = httpx.post(f"{server.url}/v1/kv/get", json=body)
        assert resp.status_code == 200 and resp.headers["x-kv-tokens"] == "0" and resp.content == b""
        assert "stored as dtype=float16, asked dtype=float32" in resp.headers[H_HINT]
        look = httpx.post(f"{server.url}/v1/lookup", json=body).json()
        assert look["tokens"] == 0 and "dtype=float16" in look["hint"]
        assert "hint" not in httpx.post(f"{server.url}/v1/lookup", json={**body, "spec": F16.to_dict()}).json()

        (kv, n), warned = _kv_warnings(lambda: client.get_kv(F32, TOKENS))
        assert n == 0 and kv.shape[3] == 0 and len(warned) == 1 and "asked dtype=float32" in warned[0]
        (_, n), warned = _kv_warnings(lambda: client.get_kv(F32, TOKENS))
        assert n == 0 and warned == []  # once per pair of specs per client
        n, warned = _kv_warnings(lambda: client.lookup(F32, TOKENS))
        assert n == 0 and warned == []  # the same pair: already said
        assert client.stats.to_dict()["hints_warned"] == 1
        (_, n), warned = _kv_warnings(lambda: client.get_kv(F16, TOKENS))
        assert n == 64 and warned == []
    with KVClient(server.url, colocated=False, plan=False, retries=0) as other:  # another client says it again
        assert len(_kv_warnings(lambda: other.lookup(F32, TOKENS))[1]) == 1


def test_the_colocated_handles_path_carries_the_hint(server):
    with KVClient(server.url, colocated=True, plan=False, retries=0) as client:
        assert client.put_kv(F16, TOKENS, make_kv(F16, 64)) == 64
        (_, n), warned = _kv_warnings(lambda: client.get_kv(F32, TOKENS))
        assert client.stats.last_medium == "shm"
        assert n == 0 and len(warned) == 1 and "stored as dtype=float16" in warned[0]
    answer = httpx.post(f"{server.url}/v1/kv/handles", json={"spec": F32.to_dict(), "tokens": TOKENS}).json()
    assert answer["blocks"] == [] and "asked dtype=float32" in answer["hint"]


# -- the token cap ------------------------------------------------------------------------------------


def _kv_body(spec, tokens, kv: bytes = b"", kv_tokens: int = 0) -> bytes:
    head, region = encode_kv_head(spec.to_dict(), len(tokens), kv_tokens)
    ids = b"".join(t.to_bytes(4, "little") for t in tokens)
    return head + ids + bytes(region - len(ids)) + kv


def _too_many(resp, what: str = "") -> None:
    assert resp.status_code == 413, (what, resp.status_code, resp.text)
    err = _error(resp)
    assert err["type"] == "TooManyTokens" and err["field"] == "tokens" and err["limit"] == CAP, (what, err)
    assert "KVSTORE_MAX_TOKENS_PER_REQUEST" in err["message"] and str(CAP) in err["message"], err
    exc = error_from(413, resp.content)
    assert isinstance(exc, TooManyTokens) and exc.field == "tokens" and exc.limit == CAP


@pytest.fixture
def capped(serve_app):
    return serve_app(max_tokens_per_request=CAP, admin_token=ADMIN)


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/kv/get", "/v1/kv/get-layers", "/v1/kv/delete",
                                  "/v1/kv/prefetch", "/v1/kv/retain?ttl_s=60", "/v1/kv/release",
                                  "/v1/kv/handoff", "/v1/kv/handles", "/v1/kv/reserve?pid=1"])
def test_every_token_route_refuses_more_than_the_cap(capped, path):
    over, spec = list(range(CAP + 24)), F16
    auth = {"authorization": f"Bearer {ADMIN}"}
    _too_many(httpx.post(f"{capped.url}{path}", content=_kv_body(spec, over),
                         headers={"content-type": KV_MEDIA, **auth}), path)
    if "reserve" not in path:  # a reservation takes a KV body only
        base, _, query = path.partition("?")
        params = dict(p.split("=") for p in query.split("&") if p)
        body = {"spec": spec.to_dict(), "tokens": over, **{k: float(v) for k, v in params.items()}}
        _too_many(httpx.post(f"{capped.url}{base}", json=body, headers=auth), path)
    at_cap = httpx.post(f"{capped.url}/v1/lookup", json={"spec": spec.to_dict(), "tokens": over[:CAP]}, headers=auth)
    assert at_cap.status_code == 200, at_cap.text


def test_a_put_over_the_cap_stores_nothing_and_the_server_stays_up(capped):
    over = list(range(5000, 5000 + 1024))  # 64 full blocks, 24 past the cap
    kv = make_kv(F16, 1024).numpy().tobytes()
    _too_many(httpx.post(f"{capped.url}/v1/kv/put", content=_kv_body(F16, over, kv, 1024),
                         headers={"content-type": KV_MEDIA, "authorization": f"Bearer {ADMIN}"}))
    with KVClient(capped.url, ADMIN, colocated=False, plan=False, retries=0) as client:
        with pytest.raises(TooManyTokens) as err:
            client.put_kv(F16, over, make_kv(F16, 1024))
        assert err.value.field == "tokens" and err.value.limit == CAP
        with pytest.raises(TooManyTokens):
            client.get_kv(F16, over)
        assert client.lookup(F16, over[:CAP]) == 0  # nothing of it was stored
        assert client.put_kv(F16, over[:992], make_kv(F16, 992)) == 992
    assert httpx.get(f"{capped.url}/healthz").status_code == 200


def test_json_over_the_cap_is_refused_by_its_size_before_it_is_parsed(capped):
    spec = F16.to_dict()
    big = json.dumps({"spec": spec, "tokens": list(range(300_000))}).encode()  # ~2 MB: over 24 B an id + 1 MiB
    headers = {"content-type": "application/json", "authorization": f"Bearer {ADMIN}"}
    _too_many(httpx.post(f"{capped.url}/v1/lookup", content=big, headers=headers), "declared length")
    dense = json.dumps({"spec": spec, "tokens": [0] * 6000}).encode()  # small, but 6000 commas
    resp = httpx.post(f"{capped.url}/v1/lookup", content=dense, headers=headers)
    _too_many(resp, "commas")
    assert "commas" in _error(resp)["message"]

    def chunks():  # no Content-Length: refused by its length once read, before json.loads
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    _too_many(httpx.post(f"{capped.url}/v1/lookup", content=chunks(), headers=headers), "chunked")


def test_admin_and_tenant_eviction_and_pin_by_tokens_are_capped(capped):
    over = list(range(CAP + 1))
    auth = {"authorization": f"Bearer {ADMIN}"}
    prefix = {"spec": F16.to_dict(), "tokens": over}
    resp = httpx.post(f"{capped.url}/admin/evict", json={"prefix": prefix, "dry_run": True}, headers=auth)
    assert resp.status_code == 413 and _error(resp)["field"] == "prefix.tokens", resp.text
    resp = httpx.post(f"{capped.url}/v1/evict", json={"prefix": prefix, "dry_run": True}, headers=auth)
    assert resp.status_code == 413 and _error(resp)["field"] == "prefix.tokens", resp.text
    _too_many(httpx.post(f"{capped.url}/admin/pin", json={**prefix, "namespace": "default"}, headers=auth))


# -- field in 4xx bodies --------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,status,field", [
    ("/v1/kv/retain", {"ttl_s": -1}, 422, "ttl_s"),
    ("/v1/kv/retain", {"ttl_s": 60, "priority": 12}, 422, "priority"),
    ("/v1/kv/retain", {"ttl_s": "soon"}, 422, "ttl_s"),
    ("/v1/lookup", {"spec": {**F16.to_dict(), "dtype": "int4"}}, 422, "spec"),
    ("/v1/lookup", {"tokens": [1, -2]}, 422, "tokens"),
    ("/v1/lookup", {"tokens": "abc"}, 422, "tokens"),
    ("/v1/kv/handoff", {"to": 7}, 422, "to"),
    ("/v1/blocks/pin", {"keys": [], "ttl_s": 0}, 422, "ttl_s"),
    ("/v1/blocks/get", {"keys": ["zz"]}, 422, "keys"),
    ("/v1/blocks/get", {"keys": [], "codec": "fp8"}, 422, "codec"),
])
def test_a_4xx_for_one_bad_field_names_it(server, path, body, status, field):
    full = {"spec": F16.to_dict(), "tokens": TOKENS, **body} if path.startswith("/v1/kv") or path == "/v1/lookup" \
        else body
    resp = httpx.post(f"{server.url}{path}", json=full)
    assert resp.status_code == status and _error(resp).get("field") == field, (path, resp.text)
    exc = error_from(resp.status_code, resp.content)
    assert isinstance(exc, InvalidInput) and exc.field == field


def test_bodies_layouts_and_query_parameters_name_their_field(serve_app):
    srv = serve_app(max_body_bytes="1MiB")
    url = srv.url
    cases = [
        (httpx.post(f"{url}/v1/lookup", content=b"{", headers={"content-type": "application/json"}), 400, "body"),
        (httpx.post(f"{url}/v1/kv/put", content=b"{}", headers={"content-type": "application/json"}), 400,
         "content-type"),
        (httpx.post(f"{url}/v1/kv/put", content=b"XXXX" + bytes(60), headers={"content-type": KV_MEDIA}), 400, "body"),
        (httpx.post(f"{url}/v1/kv/put", content=bytes(2 << 20), headers={"content-type": KV_MEDIA}), 413, "body"),
        (httpx.get(f"{url}/v1/probe", params={"bytes": -1}), 422, "bytes"),  # FastAPI's own validation
        (httpx.post(f"{url}/v1/kv/reserve", params={"pid": "x"}, content=_kv_body(F16, TOKENS),
                    headers={"content-type": KV_MEDIA}), 422, "pid"),
        (httpx.post(f"{url}/v1/lookup", json={"spec": F16.to_dict(), "tokens": []},
                    headers={"x-kv-namespace": "no spaces"}), 422, "x-kv-namespace"),
        (httpx.post(f"{url}/v1/staging/lease", json={"nbytes": 0}), 422, "nbytes"),
    ]
    short = _kv_body(F16, TOKENS[:32], make_kv(F16, 32).numpy().tobytes()[:-64], 32)
    cases.append((httpx.post(f"{url}/v1/kv/put", content=short, headers={"content-type": KV_MEDIA}), 400, "body"))
    for resp, status, field in cases:
        assert resp.status_code == status and _error(resp).get("field") == field, (status, field, resp.text)
    assert httpx.get(f"{url}/healthz").status_code == 200


@pytest.mark.parametrize("raw", ["0", "-1", "many", "1.5"])
def test_a_bad_token_cap_is_refused_at_start(raw):
    from server.config import ServerSettings

    with pytest.raises(InvalidInput, match="MAX_TOKENS_PER_REQUEST|max_tokens_per_request"):
        ServerSettings.from_env({"KVSTORE_MAX_TOKENS_PER_REQUEST": raw})
    assert ServerSettings.from_env({"KVSTORE_MAX_TOKENS_PER_REQUEST": "2048"}).max_tokens_per_request == 2048
    assert ServerSettings().max_tokens_per_request == 1 << 20
