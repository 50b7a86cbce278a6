"""Bad input at a live ``kvstore serve``: only 4xx comes back, the server stays up, stored data stays whole.

Hypothesis sends damaged frames (bit flips, truncations, random bytes, a foreign key) to
``PUT /v1/blocks/{key}`` and ``POST /v1/blocks/put``; hand-written probes cover path traversal and
non-hex keys, lying Content-Lengths, bodies over the limit, spec and shape mismatches,
NaN/Inf KV, an unknown frame version, a slow-loris upload, a huge JSON token list and token lists
over ``KVSTORE_MAX_TOKENS_PER_REQUEST``.
After each, a sequence stored at the start still reads back bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import KVClient
from client_sdk.media import encode_blocks
from kvstore import codec
from kvstore.errors import FrameError

SPEC = SPECS[0]
KEPT = list(range(11_000, 11_064))
NS = "fuzz"
LIMIT = 4 << 20
MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-input")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp / "data"), KVSTORE_MAX_BODY_BYTES=str(LIMIT), KVSTORE_BODY_TIMEOUT_S="1",
               KVSTORE_MAX_TOKENS_PER_REQUEST=str(MAX_TOKENS), KVSTORE_LOG_LEVEL="warning")
    server = ServeProcess(env).start()
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        client.put_kv(SPEC, KEPT, expected_kv(0, KEPT))
    with httpx.Client(base_url=server.url, headers={"X-KV-Namespace": NS}, timeout=30) as http:
        yield server, http, tmp
    server.stop()


def _intact(server: ServeProcess) -> None:
    assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        kv, n = client.get_kv(SPEC, KEPT)
    assert n == len(KEPT) and torch.equal(kv, expected_kv(0, KEPT))


def _frames() -> list[tuple[bytes, bytes]]:
    tokens = list(range(12_000, 12_016))
    return [(bytes(k), bytes(f)) for k, f in encode_blocks(SPEC, tokens, expected_kv(0, tokens), NS)]


KEY, FRAME = _frames()[0]


@st.composite
def damaged(draw) -> bytes:
    how = draw(st.sampled_from(["flip", "truncate", "random", "extend"]))
    if how == "flip":
        at = draw(st.integers(0, len(FRAME) - 1))
        return FRAME[:at] + bytes([FRAME[at] ^ (1 << draw(st.integers(0, 7)))]) + FRAME[at + 1:]
    if how == "truncate":
        return FRAME[:draw(st.integers(0, len(FRAME) - 1))]
    if how == "extend":
        return FRAME + draw(st.binary(min_size=1, max_size=64))
    return draw(st.binary(max_size=4096))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=damaged())
def test_damaged_frames_get_4xx_from_both_block_routes(live, frame):
    _, http, _ = live
    one = http.put(f"/v1/blocks/{KEY.hex()}", content=frame)
    assert 400 <= one.status_code < 500, (one.status_code, one.text)
    batch = http.post("/v1/blocks/put", content=json.dumps({"blocks": [{"key": KEY.hex(), "frame": frame.hex()}]}),
                      headers={"content-type": "application/json"})
    assert 400 <= batch.status_code < 500, (batch.status_code, batch.text)
    assert http.get(f"/v1/blocks/{KEY.hex()}").status_code == 404  # nothing of it was stored


@settings(max_examples=300, deadline=None)
@given(frame=damaged())
def test_damaged_frames_are_frame_errors_in_the_codec(frame):
    try:
        codec.decode(frame)
    except FrameError:
        return
    pytest.fail("a damaged frame decoded")


def test_the_undamaged_frame_is_accepted(live):  # so the damage is what the fuzzed ones are refused for
    server, http, _ = live
    assert http.put(f"/v1/blocks/{KEY.hex()}", content=FRAME).status_code == 201
    assert http.get(f"/v1/blocks/{KEY.hex()}").content == FRAME
    assert http.delete(f"/v1/blocks/{KEY.hex()}").status_code == 200
    _intact(server)


@pytest.mark.parametrize("path", ["../../../../etc/passwd", "..%2F..%2F..%2Fescape", "%2e%2e%2f" * 4 + "x",
                                  "zz" * 32, "ab" * 31, "ab" * 33, "AB" * 32 + "/..", "ab" * 32 + "%00"])
def test_keys_that_are_not_64_hex_digits_never_reach_a_file(live, path):
    server, http, tmp = live
    for method in ("GET", "PUT", "DELETE", "HEAD"):
        r = http.request(method, f"/v1/blocks/{path}", content=FRAME if method == "PUT" else None)
        assert 400 <= r.status_code < 500, (method, path, r.status_code)
    assert not list(tmp.parent.glob("escape*")) and not (tmp / "x").exists()
    _intact(server)


def _raw(server: ServeProcess, head: str, body: bytes = b"", wait_s: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as s:
        s.sendall(head.encode() + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:  # the server kept the connection open: what came is the answer
            pass
    return out


def test_lying_content_lengths(live):
    server, _, _ = live
    path = f"/v1/blocks/{KEY.hex()}"
    # shorter than the body: the frame is cut short, and the rest is no request
    short = _raw(server, f"PUT {path} HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\n"
                         f"Content-Length: {len(FRAME) // 2}\r\n\r\n", FRAME)
    assert short.split(b" ")[1][:1] == b"4", short[:200]
    # longer than the body, then the client goes quiet: the body timeout answers
    started = time.monotonic()
    long = _raw(server, f"PUT {path} HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\n"
                        f"Content-Length: {len(FRAME) * 2}\r\n\r\n", FRAME)
    assert not long or long.split(b" ")[1][:1] == b"4", long[:200]
    assert time.monotonic() - started < 5
    _intact(server)


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends before it closes (headers and body may come apart)."""
    parts = []
    while chunk := s.recv(65536):
        parts.append(chunk)
    return b"".join(parts)


def test_a_slow_loris_upload_gets_408_and_its_connection_closed(live):
    server, _, _ = live
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"PUT /v1/blocks/{KEY.hex()} HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\n"
                  f"Content-Length: {len(FRAME)}\r\n\r\n".encode() + FRAME[:100])
        started = time.monotonic()
        answer = _until_closed(s)
        waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"BodyTimeout" in answer and b"connection: close" in answer.lower() and 0.5 < waited < 5
    _intact(server)


def test_a_trickled_upload_gets_408_too(live):
    """A byte every 0.3 s never stalls for the 1 s idle limit, but misses the body's deadline."""
    server, _, _ = live
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"PUT /v1/blocks/{KEY.hex()} HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\n"
                  f"Content-Length: {len(FRAME)}\r\n\r\n".encode())
        s.settimeout(0.3)
        started, answer = time.monotonic(), b""
        for i in range(40):
            try:
                s.sendall(FRAME[i:i + 1])
                answer = s.recv(65536)
                break
            except socket.timeout:
                continue
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert time.monotonic() - started < 5
    _intact(server)


def test_a_stalled_hot_route_upload_gets_408_and_the_next_request_is_served(live):
    server, _, _ = live
    from client_sdk._common import kv_parts, tokens_of
    from kvstore.wire.rest import KV_MEDIA

    tokens = list(range(15_000, 15_016))
    body = b"".join(bytes(p) for p in kv_parts(SPEC, tokens_of(tokens), expected_kv(0, tokens)))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST /v1/kv/put HTTP/1.1\r\nHost: x\r\nX-KV-Namespace: {NS}\r\nContent-Type: {KV_MEDIA}\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:1000])
        answer = _until_closed(s)  # and closed
        assert answer.startswith(b"HTTP/1.1 408") and b"BodyTimeout" in answer, answer[:200]
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        assert client.lookup(SPEC, tokens) == 0  # nothing of the stalled put was stored
        assert client.put_kv(SPEC, tokens, expected_kv(0, tokens)) == 16
    _intact(server)


def test_bodies_over_the_limit_get_413_declared_or_not(live):
    server, http, _ = live
    big = bytes(LIMIT + 1)
    assert http.put(f"/v1/blocks/{KEY.hex()}", content=big).status_code == 413

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(5):
            yield bytes(1 << 20)
    assert http.put(f"/v1/blocks/{KEY.hex()}", content=chunks()).status_code == 413
    _intact(server)


def test_a_huge_json_token_list_is_refused(live):
    server, http, _ = live
    body = json.dumps({"spec": SPEC.to_dict(), "tokens": list(range(2_000_000))})  # ~16 MB of JSON
    r = http.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.status_code
    _intact(server)


def test_token_lists_over_the_cap_get_413_naming_the_setting_and_store_nothing(live):
    server, http, _ = live
    from client_sdk import TooManyTokens

    tokens = list(range(20_000, 20_000 + MAX_TOKENS + 16))
    for body in (json.dumps({"spec": SPEC.to_dict(), "tokens": tokens}),  # ~40 KB: parsed, then counted
                 json.dumps({"spec": SPEC.to_dict(), "tokens": list(range(300_000))})):  # 2 MB: refused unread
        r = http.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 413 and err["type"] == "TooManyTokens" and err["field"] == "tokens", r.text
        assert f"KVSTORE_MAX_TOKENS_PER_REQUEST={MAX_TOKENS}" in err["message"] and err["limit"] == MAX_TOKENS
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        with pytest.raises(TooManyTokens) as exc:  # a KV body without KV: its header's count is over
            client.get_kv(SPEC, tokens)
        assert exc.value.field == "tokens" and exc.value.limit == MAX_TOKENS
        assert client.lookup(SPEC, tokens[:MAX_TOKENS]) == 0
    _intact(server)


def test_spec_and_shape_mismatches_are_4xx(live):
    server, http, _ = live
    from client_sdk._common import kv_parts, tokens_of
    from kvstore.wire.rest import KV_MEDIA

    tokens = tokens_of(list(range(13_000, 13_032)))
    parts = kv_parts(SPEC, tokens, expected_kv(0, list(range(13_000, 13_032))))
    body = b"".join(bytes(p) for p in parts)
    for bad in (body[:-2048], body + bytes(2048)):  # KV bytes short of / past what the header says
        r = http.post("/v1/kv/put", content=bad, headers={"content-type": KV_MEDIA})
        assert 400 <= r.status_code < 500, r.status_code
    wrong = {"spec": {**SPEC.to_dict(), "num_layers": -1}, "tokens": [1, 2, 3]}
    assert http.post("/v1/lookup", json=wrong).status_code == 422
    _intact(server)


def test_an_unknown_frame_version_is_refused(live):
    server, http, _ = live
    newer = FRAME[:4] + bytes([codec.VERSION + 1]) + FRAME[5:]
    r = http.put(f"/v1/blocks/{KEY.hex()}", content=newer)
    assert r.status_code == 422 and "UnsupportedFrame" in r.text
    _intact(server)


def test_nan_and_inf_kv_round_trip_raw_or_are_refused_for_int8(live, tmp_path):
    server, _, _ = live
    tokens = list(range(14_000, 14_016))
    kv = expected_kv(0, tokens)
    kv[0, 0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float16)
    with KVClient(server.url, namespace=NS, colocated=False, plan=False) as client:
        client.put_kv(SPEC, tokens, kv)  # raw tiers keep any bits
        got, n = client.get_kv(SPEC, tokens)
        assert n == 16 and torch.equal(got.view(torch.int16), kv.view(torch.int16))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "int8"), KVSTORE_CODEC="int8", KVSTORE_LOG_LEVEL="warning")
    int8 = ServeProcess(env).start()
    try:
        with KVClient(int8.url, namespace=NS, colocated=False, plan=False) as client:
            from kvstore.errors import InvalidKV

            with pytest.raises(InvalidKV, match="NaN|Inf|finite"):
                client.put_kv(SPEC, tokens, kv)
            assert client.lookup(SPEC, tokens) == 0
    finally:
        int8.stop()


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_bad_body_timeout_is_refused_at_start(value):
    from kvstore.errors import InvalidInput
    from server.config import ServerSettings

    with pytest.raises(InvalidInput, match="BODY_TIMEOUT_S|body_timeout_s"):
        ServerSettings.from_env({"KVSTORE_BODY_TIMEOUT_S": value})
