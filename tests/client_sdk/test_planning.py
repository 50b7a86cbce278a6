"""The planner end to end: media move frames, recompute under a slow link, decision records, the canary."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from client_sdk import KVClient
from client_sdk.media import Throttled
from client_sdk.redis_direct import RedisDirectMedium
from client_sdk.rest_media import HttpMedium, InprocMedium
from kvstore import KVStore
from kvstore import codec as codec_mod
from kvstore.keys import block_hashes
from kvstore.spec import KVSpec
from tests.server.conftest import ADMIN, TOKENS
from tiers.redis import RedisTier

SPEC = KVSpec("planner-test", fingerprint="rev-1", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
              block_tokens=16)
TOKS = np.arange(512, dtype=np.uint32)


def _kv(n: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.kv_shape(n), generator=g).to(torch.float16)


def _check_frames(medium, kv: torch.Tensor) -> None:
    """Frames put through ``medium`` come back verified and bit-exact; absent keys are None."""
    keys = block_hashes(SPEC, TOKS, medium.namespace)
    stored = medium.put_kv(SPEC, TOKS, kv)
    assert stored == 512
    frames = medium.get_frames(keys + [bytes(32)])
    assert frames[-1] is None
    for i, frame in enumerate(frames[:-1]):
        codec_mod.verify(frame)  # header and body checksum
        block = codec_mod.decode(frame)
        assert torch.equal(block, kv[:, :, :, i * 16:(i + 1) * 16])
    got, n = medium.get_kv(SPEC, TOKS)
    assert n == 512 and torch.equal(got, kv)


def test_http_shm_and_inproc_media_move_frames(server):
    with KVClient(server.url) as client:
        client.shm.arena()
        _check_frames(HttpMedium(client.http, client.pool), _kv(seed=1))
        client.delete(SPEC, TOKS)
        _check_frames(client.shm, _kv(seed=2))
        assert client.stats.shm_puts == 1
    _check_frames(InprocMedium(server.store, "inproc-ns"), _kv(seed=3))


def test_http_int8_frames_are_half_the_bytes(server):
    with KVClient(server.url, colocated=False) as client:
        medium = HttpMedium(client.http, client.pool)
        kv = _kv(seed=4)
        medium.put_kv(SPEC, TOKS, kv)
        keys = block_hashes(SPEC, TOKS, client.namespace)
        raw = medium.get_frames(keys[:1])[0]
        small = medium.get_frames(keys[:1], codec="int8")[0]
        assert codec_mod.read_header(small).codec.value == "int8" and len(small) < 0.65 * len(raw)  # scales weigh more in small blocks
        got, n = medium.get_kv(SPEC, TOKS, codec="int8")
        assert n == 512
        assert float((got.float() - kv.float()).norm() / kv.float().norm()) < 0.01
        resp = httpx.post(server.url + "/v1/blocks/get", json={"keys": [keys[0].hex()], "codec": "zip"})
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "codec"


def test_redis_medium_reads_frames_straight_from_redis(serve_app, redis_server):
    store = KVStore([RedisTier(redis_server.url, 64 << 20, keyspace="direct")], tier_codecs={"redis": "raw"},
                    background=False)
    srv = serve_app(store)
    with KVClient(srv.url, colocated=False, redis_url=redis_server.url) as client:
        assert client.info()["media"]["redis"] == {"keyspace": "direct", "tier": "redis"}
        medium = RedisDirectMedium(client.http, redis_server.url, "direct")
        _check_frames(medium, _kv(seed=5))
        other = block_hashes(SPEC, TOKS, "someone-else")
        assert medium.get_frames(other[:2]) == [None, None]
        medium.close()
        client.put_kv(SPEC, TOKS, _kv(seed=6))
        assert "redis" in client._planner.media


def _slow(bandwidth_Bps: float):
    return lambda medium: Throttled(medium, latency_s=0.0005, bandwidth_Bps=bandwidth_Bps)


def test_recompute_under_an_injected_bandwidth_cap_and_fetch_otherwise(server):
    kv = _kv(seed=7)
    with KVClient(server.url, colocated=False) as plain:
        plain.put_kv(SPEC, TOKS, kv)
    # 512 tokens are 512 KiB here; at 2 MB/s that is ~0.26 s, against 0.05 s of prefill at 10k tokens/s.
    with KVClient(server.url, colocated=False, wrap_media=_slow(2e6)) as slow:
        slow.set_prefill_rate(SPEC, 10_000.0)
        got, n = slow.get_kv(SPEC, TOKS)
        d = slow.last_decision
        assert n == 0 and got.shape[3] == 0
        assert d.choice == "recompute", d.reason
        rec = next(c for c in d.candidates if c.option == "recompute")
        assert rec.predicted_s == pytest.approx(512 / 10_000.0)
        assert d.predicted_s == rec.predicted_s
    with KVClient(server.url, colocated=False, wrap_media=_slow(2e9)) as fast:
        fast.set_prefill_rate(SPEC, 10_000.0)
        got, n = fast.get_kv(SPEC, TOKS)
        assert n == 512 and torch.equal(got, kv)
        assert fast.last_decision.choice == "http"


def test_decisions_reach_admin_and_metrics_with_predicted_and_actual(serve_app):
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    with KVClient(srv.url, token=acme, namespace="acme") as client:
        client.put_kv(SPEC, TOKS, _kv(seed=8))
        for _ in range(3):
            assert client.get_kv(SPEC, TOKS)[1] == 512
        local = client.decisions()
        assert [d["op"] for d in local] == ["put", "get", "get", "get"]
        assert all(d["predicted_s"] is not None and d["actual_s"] > 0 for d in local)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    got = httpx.get(srv.url + "/admin/decisions", headers=admin).json()
    rows = got["decisions"]
    assert len(rows) == 4 and {r["namespace"] for r in rows} == {"acme"}
    assert all("candidates" in r and "reason" in r and r["actual_s"] > 0 for r in rows)
    assert any(r["ratio"] is not None for r in rows)
    only_gets = httpx.get(srv.url + "/admin/decisions", params={"op": "get"}, headers=admin).json()
    assert only_gets["total"] == 3
    assert httpx.get(srv.url + "/admin/decisions", headers={"Authorization": f"Bearer {acme}"}).status_code == 403
    metrics = httpx.get(srv.url + "/metrics").text
    assert "kvstore_planner_prediction_ratio_bucket" in metrics
    assert 'kvstore_planner_decisions_total{choice=' in metrics


def _record(version: int, actual_s: float, choice: str = "http") -> dict:
    return {"op": "get", "choice": choice, "time_s": 1.0, "bytes": 1 << 20, "tokens": 64, "policy_version": version,
            "predicted_s": 0.001, "actual_s": actual_s, "predicted_actual_s": 0.001, "ratio": actual_s / 0.001,
            "candidates": [], "reason": "test", "locality": "remote"}


def test_canary_routes_promotes_rolls_back_and_auto_rolls_back(serve_app):
    srv = serve_app(admin_token=ADMIN, tokens=json.dumps(TOKENS))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    post = lambda body: httpx.post(srv.url + "/admin/policy", json=body, headers=admin)  # noqa: E731
    resp = post({"action": "candidate", "policy": {"version": 2, "media": ["http"]}, "fraction": 1.0,
                 "min_samples": 5})
    assert resp.status_code == 200, resp.text
    with KVClient(srv.url, token=acme, namespace="acme") as client:
        client.put_kv(SPEC, TOKS, _kv(seed=9))
        assert client.last_decision.policy_version == 2 and client.last_decision.choice == "http"
    assert post({"action": "promote"}).json()["baseline"]["version"] == 2
    assert httpx.get(srv.url + "/v1/policy", headers={"Authorization": f"Bearer {acme}"}).json()["candidate"] is None
    # An operator's rollback.
    post({"action": "candidate", "policy": {"version": 3}, "fraction": 0.5})
    view = post({"action": "rollback", "why": "testing"}).json()
    assert view["candidate"] is None and view["rollbacks"][-1]["by"] == "admin"
    # A deliberately bad candidate: 10x slower transfers, rolled back on the report that proves it.
    post({"action": "candidate", "policy": {"version": 4}, "fraction": 0.5, "min_samples": 5})
    # At a 0.5 share, "acme" hashes to the candidate and "default" to the baseline (kvstore.policy.bucket).
    on_candidate = {"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"}
    on_baseline = {"Authorization": f"Bearer {ADMIN}", "x-kv-namespace": "default"}
    # A tenant cannot judge a version it is not routed to: these claim v2 from the candidate's namespace.
    forged = [_record(2, 0.0001) for _ in range(50)]
    assert httpx.post(srv.url + "/v1/decisions", json={"decisions": forged}, headers=on_candidate).status_code == 200
    good = [_record(2, 0.002) for _ in range(40)]  # outweighs the real put above in the p95
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": good}, headers=on_baseline)
    assert resp.status_code == 200 and resp.json()["policies"]["candidate"]["version"] == 4
    # Explorations are measurements, not the policy's choice: however slow, they judge nothing.
    tries = [{**_record(4, 0.5), "explore": True} for _ in range(10)]
    answer = httpx.post(srv.url + "/v1/decisions", json={"decisions": tries}, headers=on_candidate).json()
    assert answer["policies"]["candidate"]["version"] == 4
    bad = [_record(4, 0.020) for _ in range(5)]
    answer = httpx.post(srv.url + "/v1/decisions", json={"decisions": bad}, headers=on_candidate).json()
    assert answer["policies"]["candidate"] is None
    view = httpx.get(srv.url + "/admin/policy", headers=admin).json()
    auto = view["rollbacks"][-1]
    assert auto["by"] == "auto" and auto["version"] == 4 and "p95" in auto["why"]
    assert 40 <= view["versions"]["2"]["samples"] < 90  # the forged 50 were not counted
    assert 'kvstore_planner_rollbacks_total{by="auto"} 1.0' in httpx.get(srv.url + "/metrics").text


@pytest.mark.parametrize("body, field", [
    ({"action": "candidate", "policy": {"version": 1}}, "policy"),
    ({"action": "candidate", "policy": {"version": 2, "margin_frac": "lots"}}, "policy"),
    ({"action": "promote"}, "action"),
    ({"action": "explode"}, "action"),
])
def test_bad_policy_requests_get_422_and_change_nothing(serve_app, body, field):
    srv = serve_app(admin_token=ADMIN, tokens=json.dumps(TOKENS))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    resp = httpx.post(srv.url + "/admin/policy", json=body, headers=admin)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field
    assert httpx.get(srv.url + "/admin/policy", headers=admin).json()["baseline"]["version"] == 1


def test_bad_reports_and_probes_get_4xx(server):
    url = server.url
    assert httpx.get(url + "/v1/probe", params={"bytes": 1 << 30}).status_code == 422
    assert len(httpx.get(url + "/v1/probe", params={"bytes": 1000}).content) == 1000
    for body in ({"decisions": "x"}, {"decisions": [{"op": "get"}]}, {"decisions": [_record(1, float("nan"))]},
                 {"decisions": [_record(1, 0.1)] * 2000}, {"decisions": [_record(1, -5.0)]},
                 {"decisions": [{**_record(1, 0.1), "policy_version": 1.5}]},
                 {"decisions": [{**_record(1, 0.1), "candidates": [{"option": 7}]}]}):
        resp = httpx.post(url + "/v1/decisions", content=json.dumps(body).replace("NaN", "1e999"),
                          headers={"content-type": "application/json"})
        assert 400 <= resp.status_code < 500, resp.text
    assert httpx.get(url + "/healthz").status_code == 200


def test_the_planner_counts_flight_among_its_media_and_moves_kv_over_it(serve_app):
    srv = serve_app(flight_port=0)
    kv = _kv(seed=10)
    flight_only = {"action": "baseline", "policy": {"version": 7, "media": ["flight"]}}
    with KVClient(srv.url, colocated=False) as client:
        client.put_kv(SPEC, TOKS, kv)
        assert set(client.media()) == {"http", "flight"}
        assert httpx.post(srv.url + "/admin/policy", json=flight_only).status_code == 200
        client._planner._refresh(force=True)
        got, n = client.get_kv(SPEC, TOKS)
        assert n == 512 and torch.equal(got, kv)
        assert client.last_decision.choice == "flight" and client.last_decision.policy_version == 7


def test_get_kv_layers_on_the_client_matches_get_kv(server):
    kv = _kv(seed=11)
    for colocated in (None, False):
        with KVClient(server.url, colocated=colocated) as client:
            client.put_kv(SPEC, TOKS, kv)
            with client.get_kv_layers(SPEC, TOKS) as stream:
                assert stream.n_tokens == 512
                layers = list(stream)
            assert [i for i, _ in layers] == list(range(SPEC.num_layers))
            assert torch.equal(torch.stack([t for _, t in layers]), kv)


def test_reports_keep_known_fields_and_labels_stay_few(server):
    junk = {**_record(1, 0.01, choice="made-up-medium"), "blob": "x" * 1000, "explore": True,
            "candidates": [{"option": "http", "predicted_s": 0.002, "queued_bytes": 4096, "wait_s": 0.001, "x": 1}]}
    resp = httpx.post(server.url + "/v1/decisions", json={"decisions": [junk] * 20})
    assert resp.status_code == 200
    row = httpx.get(server.url + "/admin/decisions").json()["decisions"][-1]
    assert "blob" not in row and row["choice"] == "made-up-medium" and row["explore"] is True
    assert row["candidates"] == [{"option": "http", "predicted_s": 0.002, "feasible": True, "why": None,
                                  "queued_bytes": 4096, "wait_s": 0.001, "path": None, "learnt": None}]
    bad = {**junk, "candidates": [{"option": "http", "wait_s": -1}]}
    refused = httpx.post(server.url + "/v1/decisions", json={"decisions": [bad]})
    assert refused.status_code == 400 and "wait_s" in refused.text
    assert row["ratio"] == pytest.approx(0.01 / 0.001)  # worked out by the server
    metrics = httpx.get(server.url + "/metrics").text
    assert 'choice="other"' in metrics and "made-up-medium" not in metrics


def test_a_failing_medium_is_set_aside_and_the_get_retried_over_http(serve_app):
    srv = serve_app(flight_port=0)
    kv = _kv(seed=12)
    # HTTP behind 50 ms of injected latency: Flight is the planner's choice until it fails.
    slow_http = lambda m: Throttled(m, latency_s=0.05) if m.name == "http" else m  # noqa: E731
    with KVClient(srv.url, colocated=False, wrap_media=slow_http) as client:
        client.put_kv(SPEC, TOKS, kv)
        flight = client.media()["flight"]

        def broken(*args, **kwargs):
            from kvstore.errors import ConnectionFailed
            raise ConnectionFailed("injected: flight is down")

        flight.get_kv = broken  # a fault, injected
        assert httpx.post(srv.url + "/admin/policy", json={"action": "baseline", "policy": {
            "version": 8, "media": ["flight", "http"]}}).status_code == 200
        client._planner._refresh(force=True)
        for _ in range(3):
            got, n = client.get_kv(SPEC, TOKS)
            assert n == 512 and torch.equal(got, kv)
        assert "flight" in client._planner._down
        gets = [d for d in client.decisions() if d["op"] == "get"]
        failed = [d for d in gets if d["choice"] == "flight"]
        assert len(failed) == 1 and "ConnectionFailed" in failed[0]["error"]  # tried once, then set aside
        assert all(d["choice"] == "http" and d["error"] is None for d in gets if d is not failed[0])


def test_a_full_store_is_not_a_broken_medium(serve_app):
    """TierFull is the store's answer on every medium: raised at once, shm not set aside."""
    from kvstore import KVStore
    from kvstore.errors import TierFull
    from tiers.shm import ShmTier

    frame = SPEC.block_nbytes + 4096
    srv = serve_app(KVStore([ShmTier(frame * 8)], background=False))
    with KVClient(srv.url) as client:
        client.put_kv(SPEC, TOKS[:64], _kv(seed=1)[:, :, :, :64])
        assert client.stats.last_medium == "shm"
        with pytest.raises(TierFull):
            client.put_kv(SPEC, list(range(5000, 5512)), _kv(seed=2))
        assert "shm" not in client._planner._down
        client.get_kv(SPEC, TOKS[:64])
        assert client.stats.last_medium == "shm"
        fails = [d for d in client.decisions() if d["error"]]
        assert len(fails) == 1 and "TierFull" in fails[0]["error"]  # one try, no retry over http
