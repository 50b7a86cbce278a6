"""The Arrow Flight bulk path: a real uvicorn app with its Flight server, and ``FlightMedium``."""

from __future__ import annotations

import json
import os
import socket
import threading

import pyarrow as pa
import pyarrow.flight as fl
import pytest
import torch

from client_sdk import Forbidden, KVClient, MalformedRequest, QuotaExceeded, ServiceError, Unauthorized
from client_sdk.flight import FlightMedium
from kvstore.wire.flight import batch_frames, frames_batch, typed_error
from client_sdk.media import encode_blocks
from kvstore.errors import ConnectionFailed, RouteNotFound
from kvstore import codec
from kvstore.errors import CorruptFrame, InvalidInput, InvalidKey
from kvstore.keys import block_hashes
from server.config import ServerSettings
from server.flight import FlightService, flight_host
from tests.conftest import make_kv, make_spec
from tests.server.conftest import ACME, ADMIN, BETA, TOKENS


@pytest.fixture
def fserver(serve_app):
    return serve_app(flight_port=0)


@pytest.fixture
def fauth(serve_app):
    return serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN, flight_port=0)


def medium(srv, token=None, namespace="default", **kwargs) -> FlightMedium:
    with KVClient(srv.url, token=ADMIN, plan=False) as c:  # any token may read /v1/info
        return FlightMedium.from_info(srv.url, c.info(), token, namespace, **kwargs)


def blocks(spec, n_tokens, namespace="default", seed=0, start=0):
    tokens = list(range(start, start + n_tokens))
    kv = make_kv(spec, n_tokens, seed)
    return tokens, kv, encode_blocks(spec, tokens, kv, namespace)


def test_info_offers_flight_on_a_bound_port(fserver, server):
    with KVClient(fserver.url, plan=False) as c:
        port = c.info()["media"]["flight"]["port"]
    assert isinstance(port, int) and port > 0 and port == fserver.svc.offers["flight"]["port"]
    with KVClient(server.url, plan=False) as c:  # flight_port None: no Flight server
        info = c.info()
        assert "flight" not in info["media"]
        with pytest.raises(RouteNotFound, match="KVSTORE_FLIGHT_PORT"):
            FlightMedium.from_info(server.url, info)


def test_frames_round_trip_bit_exact_and_absent_keys_are_none(fserver, spec):
    tokens, kv, items = blocks(spec, 64)
    with medium(fserver) as m:
        assert m.put_frames(items) == len(items)
        absent = os.urandom(32)
        got = m.get_frames([absent, *[k for k, _ in items], absent])
    assert got[0] is None and got[-1] is None
    assert [bytes(f) for f in got[1:-1]] == [bytes(f) for _, f in items]
    bt = spec.block_tokens
    for i, frame in enumerate(got[1:-1]):
        assert codec.verify(frame).body_checksum == codec.read_header(items[i][1]).body_checksum
        assert torch.equal(codec.decode(frame), kv[:, :, :, i * bt:(i + 1) * bt])


def test_many_small_frames_and_big_frames_span_several_batches(fserver):
    small = make_spec()  # 8 KiB frames: ~500 fit a 4 MiB batch
    _, _, items = blocks(small, 16 * 640)
    big = make_spec(num_layers=8, num_kv_heads=8, head_dim=128)  # 512 KiB frames
    _, _, big_items = blocks(big, 16 * 12, seed=1)
    everything = items + big_items
    with medium(fserver, batch_bytes=1 << 20) as m:
        assert m.put_frames(everything) == len(everything)
        got = m.get_frames([k for k, _ in everything])
    assert [bytes(f) for f in got] == [bytes(f) for _, f in everything]


def test_int8_transcoding_is_smaller_and_close(fserver, spec):
    tokens, kv, items = blocks(spec, 64)
    bt = spec.block_tokens
    with medium(fserver) as m:
        m.put_frames(items)
        got = m.get_frames([k for k, _ in items], codec="int8")
        kv8, n = m.get_kv(spec, tokens, codec="int8")
    assert n == 64
    for i, frame in enumerate(got):
        assert codec.read_header(frame).codec is codec.Codec.INT8
        assert len(frame) < len(items[i][1])
        want = kv[:, :, :, i * bt:(i + 1) * bt].float()
        assert (codec.decode(frame).float() - want).norm() / want.norm() < 0.01
    assert (kv8.float() - kv.float()).norm() / kv.float().norm() < 0.01


def test_flight_and_rest_see_the_same_frames(fserver, spec):
    _, _, via_flight = blocks(spec, 32)
    _, _, via_rest = blocks(spec, 32, seed=1, start=1000)
    with medium(fserver) as m, KVClient(fserver.url, plan=False) as rest:
        m.put_frames(via_flight)
        rest.put_blocks(via_rest)
        assert [bytes(f) for f in rest.get_blocks([k for k, _ in via_flight])] == [bytes(f) for _, f in via_flight]
        assert [bytes(f) for f in m.get_frames([k for k, _ in via_rest])] == [bytes(f) for _, f in via_rest]


def test_get_kv_decodes_the_stored_prefix_into_out(fserver, spec):
    tokens, kv, items = blocks(spec, 64)
    with medium(fserver) as m:
        m.put_frames(items[:2])  # a 32-token prefix of 64
        got, n = m.get_kv(spec, tokens)
        assert n == 32 and got.is_contiguous() and torch.equal(got, kv[:, :, :, :32])
        out = torch.zeros(spec.kv_shape(64), dtype=spec.torch_dtype)
        got, n = m.get_kv(spec, tokens, out)
        assert n == 32 and got.data_ptr() == out.data_ptr() and torch.equal(got, kv[:, :, :, :32])
        m.put_frames(items)
        got, n = m.get_kv(spec, tokens, out)
        assert n == 64 and got.data_ptr() == out.data_ptr() and torch.equal(got, kv)
        assert m.get_kv(spec, list(range(500, 564)))[1] == 0


def test_auth_is_refused_with_the_typed_error(fauth, spec):
    _, _, items = blocks(spec, 16, namespace="acme")
    keys = [k for k, _ in items]
    with medium(fauth, "not-a-real-token", "acme") as m, pytest.raises(Unauthorized, match="unknown bearer token"):
        m.get_frames(keys)
    with medium(fauth, None, "acme") as m, pytest.raises(Unauthorized, match="missing bearer token"):
        m.put_frames(items)
    with medium(fauth, ACME, "beta") as m:
        with pytest.raises(Forbidden, match="'beta' is not granted to tenant 'acme'"):
            m.get_frames(keys)
        with pytest.raises(Forbidden):
            m.put_frames(items)
        with pytest.raises(Forbidden):
            list(m.get_kv_layers(spec, list(range(16))))
    with medium(fauth, ACME, "acme") as m:
        assert m.put_frames(items) == 1 and m.get_frames(keys)[0] is not None
    with medium(fauth, BETA, "beta") as m:  # acme's block is invisible from beta's namespace
        assert m.get_frames(keys) == [None]
    assert fauth.svc.metrics.auth_failures.labels("403")._value.get() >= 3


def test_a_put_over_quota_is_refused_and_stores_nothing(fauth):
    big = make_spec(num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB blocks, beta's quota is 1 MiB
    _, _, items = blocks(big, 16, namespace="beta")
    with medium(fauth, BETA, "beta") as m, pytest.raises(QuotaExceeded, match="quota"):
        m.put_frames(items)
    assert fauth.store.entry(items[0][0]) is None


def test_a_corrupt_or_foreign_frame_is_refused_and_nothing_is_stored(fserver, spec):
    _, _, items = blocks(spec, 16)
    key, frame = items[0]
    bad = bytearray(frame)
    bad[-1] ^= 0x01
    with medium(fserver) as m:
        with pytest.raises(CorruptFrame):
            m.put_frames([(key, bad)])
        assert fserver.store.entry(key) is None
        _, _, other = blocks(spec, 16, namespace="elsewhere")
        with pytest.raises(InvalidInput, match="namespace"):
            m.put_frames(other)
        assert fserver.store.entry(other[0][0]) is None
        assert m.put_frames(items) == 1  # the server still serves


def test_bad_tickets_get_clear_errors_and_the_server_stays_up(fserver, spec):
    port = fserver.svc.offers["flight"]["port"]
    raw = fl.FlightClient(f"grpc://127.0.0.1:{port}")

    def refused(ticket: bytes) -> Exception:
        with pytest.raises(pa.ArrowException) as info:
            raw.do_get(fl.Ticket(ticket)).read_all()
        return typed_error(info.value, "test")

    assert isinstance(err := refused(b"not json"), MalformedRequest) and "ticket: not JSON" in str(err)
    assert isinstance(err := refused(b"[1, 2]"), MalformedRequest) and "must be a JSON object" in str(err)
    assert isinstance(err := refused(b'{"keys": ["zz"]}'), InvalidKey) and err.field == "keys"
    too_many = json.dumps({"keys": ["00" * 32] * 65_537}).encode()
    assert "at most 65536 keys a ticket" in str(refused(too_many))
    assert "unknown op 'nope'" in str(refused(b'{"op": "nope"}'))
    assert refused(b'{"keys": [], "codec": "fp8"}').field == "codec"
    assert refused(b'{"op": "layers", "spec": {"x": 1}, "tokens": [1]}').field == "spec"
    assert "[0, 67108864]" in str(refused(b'{"op": "probe", "bytes": -1}'))
    for descriptor, message in ((fl.FlightDescriptor.for_path("x"), "descriptor: must be a command"),
                                (fl.FlightDescriptor.for_command(b'{"op": "drop"}'), "unknown op 'drop'")):
        with pytest.raises(pa.ArrowException) as info:
            writer, _ = raw.do_put(descriptor, pa.schema([("x", pa.int8())]))
            writer.close()
        assert message in str(typed_error(info.value, "test"))
    with pytest.raises(pa.ArrowException) as info:  # the right command, batches of another schema
        writer, _ = raw.do_put(fl.FlightDescriptor.for_command(b'{"op": "frames"}'), pa.schema([("x", pa.int8())]))
        writer.write_batch(pa.record_batch([pa.array([1], pa.int8())], names=["x"]))
        writer.close()
    assert isinstance(err := typed_error(info.value, "test"), MalformedRequest) and "record batch" in str(err)
    raw.close()
    _, _, items = blocks(spec, 16)
    with medium(fserver) as m:
        assert m.put_frames(items) == 1 and bytes(m.get_frames([items[0][0]])[0]) == bytes(items[0][1])
        m.probe(0)
        m.probe(5 << 20)


def test_layer_stream_equals_get_kv_layers(fserver, spec):
    tokens = list(range(80))  # 5 blocks; 3 stored below
    kv = make_kv(spec, 80)
    fserver.store.put_kv(spec, tokens[:48], kv[:, :, :, :48], "default")
    want, n = fserver.store.get_kv(spec, tokens, "default")
    assert n == 48
    with medium(fserver) as m:
        layers = list(m.get_kv_layers(spec, tokens))
        assert [i for i, _ in layers] == list(range(spec.num_layers))
        for i, layer in layers:
            assert layer.shape == (2, spec.num_kv_heads, 48, spec.head_dim) and torch.equal(layer, want[i])
        assert list(m.get_kv_layers(spec, list(range(900, 932)))) == []


def test_shutdown_closes_the_flight_port_and_leaves_no_thread(serve_app, spec):
    srv = serve_app(flight_port=0)
    port = srv.svc.offers["flight"]["port"]
    m = medium(srv)
    assert m.get_frames([os.urandom(32)]) == [None]
    srv.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(ConnectionFailed):
        m.get_frames([os.urandom(32)])
    m.close()
    assert not [t for t in threading.enumerate() if "flight" in t.name]


def test_a_busy_port_fails_to_start(fserver):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError, match="cannot listen"):
            FlightService(fserver.svc, "127.0.0.1", busy.getsockname()[1])


def test_record_batches_carry_nulls_and_slices():
    keys = [bytes([i]) * 32 for i in range(4)]
    batch = frames_batch([(keys[0], b"abc"), (keys[1], None), (keys[2], memoryview(b"")), (keys[3], bytearray(b"z"))])
    assert [(k, None if f is None else bytes(f)) for k, f in batch_frames(batch)] == \
        [(keys[0], b"abc"), (keys[1], None), (keys[2], b""), (keys[3], b"z")]
    assert [(k, None if f is None else bytes(f)) for k, f in batch_frames(batch.slice(1, 3))] == \
        [(keys[1], None), (keys[2], b""), (keys[3], b"z")]
    with pytest.raises(MalformedRequest, match="record batch"):
        batch_frames(pa.record_batch([pa.array([1])], names=["x"]))


def test_settings_flight_port():
    assert ServerSettings().flight_port is None
    assert ServerSettings.from_env({"KVSTORE_FLIGHT_PORT": "8471"}).flight_port == 8471
    assert ServerSettings.from_env({"KVSTORE_FLIGHT_PORT": "0"}).flight_port == 0
    with pytest.raises(InvalidInput, match="KVSTORE_FLIGHT_PORT"):
        ServerSettings.from_env({"KVSTORE_FLIGHT_PORT": "grpc"})
    for bad in (70_000, -1, True, "8471"):
        with pytest.raises(InvalidInput, match="flight_port"):
            ServerSettings(flight_port=bad)
    with pytest.raises(InvalidInput, match="differ"):
        ServerSettings(port=9000, flight_port=9000)
    # auth off: Flight stays on loopback even when REST was asked for another host, as serve does
    assert flight_host(ServerSettings(host="0.0.0.0")) == "127.0.0.1"
    assert flight_host(ServerSettings(host="0.0.0.0", admin_token=ADMIN)) == "0.0.0.0"


def test_an_unexpected_failure_is_an_internal_error_without_a_traceback(fserver, spec, monkeypatch):
    from kvstore.engine.frames import Frames

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(Frames, "read", broken)
    with medium(fserver) as m:
        with pytest.raises(ServiceError) as info:
            m.get_frames([os.urandom(32)])
        assert str(info.value) == "internal server error" and info.value.status == 500
        monkeypatch.undo()
        assert m.get_frames([os.urandom(32)]) == [None]


def test_a_layer_stream_left_early_is_cancelled(fserver, spec):
    tokens = list(range(32))
    fserver.store.put_kv(spec, tokens, make_kv(spec, 32), "default")
    with medium(fserver) as m:
        stream = m.get_kv_layers(spec, tokens)
        first, _ = next(stream)
        stream.close()
        assert first == 0
        assert len(list(m.get_kv_layers(spec, tokens))) == spec.num_layers  # the medium still works


def test_kvstore_serve_flight_port_flag(tmp_path):
    from bench.reliability_kit.serve_process import ServeProcess, small_env

    proc = ServeProcess(small_env(tmp_path), "--flight-port", "0").start()
    try:
        with KVClient(proc.url, colocated=False) as client:
            port = client.info()["media"]["flight"]["port"]
            assert port > 0
            spec = make_spec()
            with FlightMedium("127.0.0.1", port) as m:
                assert m.get_frames(block_hashes(spec, list(range(32)))) == [None, None]
    finally:
        proc.stop()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass
