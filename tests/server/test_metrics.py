"""``/metrics``' planner figure: the prediction error the dashboard shows, by ``kvstore.decisions``' one
definition, read from the decision records the server keeps at each scrape."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.decisions import WARMUP_TRANSFERS, prediction_error
from tests.server.conftest import ADMIN, TOKENS

AUTH = {"Authorization": f"Bearer {ADMIN}"}


def record(actual_s: float, predicted_s: float, **kw) -> dict:
    """A finished decision record as a client reports it (past its estimate's warm-up)."""
    return {"op": "get", "choice": "shm", "time_s": 1.0, "bytes": 1 << 20, "tokens": 64, "policy_version": 1,
            "predicted_s": predicted_s, "actual_s": actual_s, "predicted_actual_s": predicted_s, "candidates": [],
            "reason": "chose shm: lowest predicted time", "reason_code": "best", "learnt": WARMUP_TRANSFERS,
            "locality": "colocated", **kw}


RECORDS = [record(0.001, 0.0012) for _ in range(5)] + [  # 20% each
    record(0.002, 0.001, op="put", choice="http"),  # 50%
    record(0.01, 0.0001, learnt=0),  # warm-up: left out
    record(0.01, 0.0001, explore=True)]  # an exploration: left out


def gauges(url: str) -> dict[str, float]:
    resp = httpx.get(url + "/metrics", timeout=10)
    assert resp.status_code == 200
    return {s.name: s.value for f in text_string_to_metric_families(resp.text) for s in f.samples
            if s.name.startswith("kvstore_planner_prediction_error") or s.name == "kvstore_blocks"}


def test_the_prediction_error_is_nan_until_a_transfer_counts(server):
    got = gauges(server.url)
    assert math.isnan(got["kvstore_planner_prediction_error"]) and got["kvstore_planner_prediction_error_samples"] == 0


def test_the_prediction_error_is_the_defined_figure_of_the_records_read(server):
    server.svc.metrics.read_decisions(lambda: RECORDS)
    want = prediction_error(RECORDS)
    got = gauges(server.url)
    assert got["kvstore_planner_prediction_error"] == pytest.approx(want["median"]) == pytest.approx(0.2)
    assert got["kvstore_planner_prediction_error_samples"] == want["samples"] == 6


def test_a_failing_record_source_leaves_out_the_figure_not_the_scrape(server):
    def mutated() -> list[dict]:  # a source read while the event loop changed it
        raise RuntimeError("deque mutated during iteration")

    server.svc.metrics.read_decisions(mutated)
    got = gauges(server.url)
    assert "kvstore_planner_prediction_error" not in got and "kvstore_blocks" in got


def test_metrics_shows_the_prediction_error_admin_decisions_shows(serve_app):
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": RECORDS},
                      headers={"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"})
    assert resp.status_code == 200, resp.text
    shown = httpx.get(srv.url + "/admin/decisions", headers=AUTH).json()["prediction_error"]
    got = gauges(srv.url)
    assert got["kvstore_planner_prediction_error"] == pytest.approx(shown["median"])
    assert got["kvstore_planner_prediction_error_samples"] == shown["samples"]
