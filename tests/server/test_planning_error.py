"""The server's prediction error: one definition for ``/admin/decisions``, ``/admin/policy`` and the
dashboard, with the definition beside the figure; reports keep the reason code, path and warm-up."""

from __future__ import annotations

import json

import httpx
import pytest

from kvstore.decisions import PREDICTION_ERROR, WARMUP_TRANSFERS, prediction_error
from tests.server.conftest import ADMIN, TOKENS

AUTH = {"Authorization": f"Bearer {ADMIN}"}


def _record(actual_s: float, predicted_s: float, **kw) -> dict:
    return {"op": "get", "choice": "shm", "time_s": 1.0, "bytes": 1 << 20, "tokens": 64, "policy_version": 1,
            "predicted_s": predicted_s, "actual_s": actual_s, "predicted_actual_s": predicted_s,
            "candidates": [{"option": "shm", "predicted_s": predicted_s, "path": "cached", "learnt": 9}],
            "reason": "chose shm: lowest predicted time (1.00 ms)", "reason_code": "best", "path": "cached",
            "learnt": WARMUP_TRANSFERS, "locality": "colocated", **kw}


@pytest.fixture
def srv(serve_app):
    return serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)


def test_admin_decisions_and_policy_carry_the_defined_error(srv):
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    warm = [_record(0.001, 0.0012) for _ in range(10)]  # 20% each
    cold = [_record(0.01, 0.0001, learnt=0), _record(0.01, 0.0001, explore=True),
            _record(0.01, 0.0001, error="ConnectionFailed('x')"), _record(0.002, 0.001, op="put", choice="http")]
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": warm + cold},
                      headers={"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"})
    assert resp.status_code == 200, resp.text
    got = httpx.get(srv.url + "/admin/decisions", params={"limit": 3}, headers=AUTH).json()
    assert len(got["decisions"]) == 3 and got["total"] == 14
    error = got["prediction_error"]
    assert error == prediction_error(warm + cold) and error["samples"] == 11  # the warm-up, explore, failure left out
    assert error["median"] == pytest.approx(0.2) and error["by_op"]["put"] == pytest.approx(0.5)
    assert error["definition"] == PREDICTION_ERROR
    puts = httpx.get(srv.url + "/admin/decisions", params={"op": "put"}, headers=AUTH).json()["prediction_error"]
    assert puts["samples"] == 1 and puts["median"] == pytest.approx(0.5)  # over the rows that match
    row = got["decisions"][-1]
    assert row["path"] == "cached" and row["reason_code"] == "best" and row["learnt"] == WARMUP_TRANSFERS
    assert row["candidates"][0]["path"] == "cached" and row["candidates"][0]["learnt"] == 9
    version = httpx.get(srv.url + "/admin/policy", headers=AUTH).json()["versions"]["1"]
    assert version["prediction_error"] == error and version["median_abs_error"] == error["median"]


def test_an_unknown_reason_code_is_not_kept(srv):
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": [_record(0.001, 0.001, reason_code="x" * 500)]},
                      headers={"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"})
    assert resp.status_code == 200
    assert httpx.get(srv.url + "/admin/decisions", headers=AUTH).json()["decisions"][-1]["reason_code"] is None
    odd = _record(0.001, 0.001, reason_code=["best"])  # not even a string: dropped, not a 500
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": [odd]},
                      headers={"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"})
    assert resp.status_code == 200, resp.text
    bad = _record(0.001, 0.001, learnt=-1)
    resp = httpx.post(srv.url + "/v1/decisions", json={"decisions": [bad]},
                      headers={"Authorization": f"Bearer {acme}", "x-kv-namespace": "acme"})
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "decisions[0].learnt"


def test_the_dashboard_states_the_definition_beside_the_figure(srv):
    page = httpx.get(srv.url + "/admin/ui").text
    script = httpx.get(srv.url + "/admin/ui/dashboard.js").text
    assert 'id="prediction-error"' in page
    # Both figures come from the server with their definition: none is computed in the page.
    assert "pe.definition" in script and "s.prediction_error.definition" in script
    assert "prediction_error.median" in script
