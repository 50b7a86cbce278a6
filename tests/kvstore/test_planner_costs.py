"""The cost model's cold start, paths and first-call costs, and the prediction error's definition.

The figures are from a mixed session against ``kvstore serve`` on one host (64 KiB-4 MiB puts and
gets): a shm put costs about 1.2 ms plus 3 ns a byte, its probe (a copy out of the arena, no
request) 0.15 ns a byte; the HTTP probe's empty round trip is about 0.2 ms.
"""

from __future__ import annotations

import pytest

from kvstore.decisions import ERROR_WINDOW, PREDICTION_ERROR, WARMUP_TRANSFERS, prediction_error, relative_error
from kvstore.planner import CostModel, Estimate, Option, Planner
from kvstore.policy import Policy

KB, MB = 1 << 10, 1 << 20
POLICY = Policy(media=("shm", "http"), explore_after_s=86400.0)


def _shm_put(nbytes: int) -> float:
    return 0.0012 + 3e-9 * nbytes


def _probed(est: Estimate) -> Estimate:
    est.observe(0, 5e-6, 0.3, 8192, 0.0, real=False)  # the shm probe's round trip: no request
    est.observe(2 * MB, 5e-6 + 0.15e-9 * 2 * MB, 0.3, 8192, 0.0, real=False)
    return est


def test_before_a_real_transfer_the_prior_pays_the_requests_the_probe_does_not_make():
    bare, priced = _probed(Estimate()), _probed(Estimate())
    priced.overhead_s = 2 * 0.0002  # a shm put's reserve and commit, at the HTTP probe's round trip
    truth = _shm_put(64 * KB)
    assert truth / bare.predict(64 * KB) > 40  # what the user saw: the first small puts, 25-45x
    assert truth / priced.predict(64 * KB) < 4


def test_one_measured_size_scales_the_probes_line_and_two_fit_their_own():
    est = _probed(Estimate())
    est.overhead_s = 0.0004
    est.observe(64 * KB, _shm_put(64 * KB), 0.3, 8192, 1.0)
    for size in (256 * KB, 1 * MB, 4 * MB):  # one class measured: every other size within 4x
        assert 0.25 < est.predict(size) / _shm_put(size) < 4, size
    est.observe(1 * MB, _shm_put(1 * MB), 0.3, 8192, 2.0)
    for size in (256 * KB, 4 * MB, 16 * MB):  # two: the line through them, fixed cost and bandwidth apart
        assert est.predict(size) == pytest.approx(_shm_put(size), rel=0.01), size
    assert est.latency_s == pytest.approx(0.0012, rel=0.01)


def test_the_first_transfers_of_a_size_pay_first_call_costs_and_a_faster_one_replaces_them():
    est = Estimate()
    for seconds in (0.075, 0.013, 0.0097):  # a first 256 KiB shm put, then the next ones
        est.observe(256 * KB, seconds, 0.3, 8192, 0.0)
    assert est.predict(256 * KB) == pytest.approx(0.0097)
    est.observe(256 * KB, 0.0026, 0.3, 8192, 0.0)  # the fourth is averaged in (log space)
    assert est.predict(256 * KB) == pytest.approx(0.0097 ** 0.7 * 0.0026 ** 0.3)


def test_a_cached_shm_get_has_its_own_estimate():
    model = CostModel()
    shm = Option("shm")
    for _ in range(3):
        model.observe("get", "shm", 64 * KB, 0.0010, POLICY)  # asks the server where the blocks are
        model.observe("get", "shm", 64 * KB, 0.00008, POLICY, path="cached")  # slots remembered
    assert model.predict("get", shm, 64 * KB) == pytest.approx(0.0010)
    assert model.predict("get", shm, 64 * KB, path="cached") == pytest.approx(0.00008)
    assert model.learnt("get", "shm", "cached") == 3 and model.learnt("get", "http") == 0
    planner = Planner(model)
    model.observe("get", "http", 64 * KB, 0.0012, POLICY)
    d = planner.decide("get", [shm, Option("http")], nbytes=64 * KB, tokens=1, policy=POLICY,
                       paths={"shm": "cached"})
    assert d.choice == "shm" and d.path == "cached" and d.predicted_s == pytest.approx(0.00008)
    planner.finish(d, POLICY, actual_s=0.0001, actual_bytes=64 * KB)
    assert d.predicted_actual_s == d.predicted_s and d.learnt == 3
    assert model.learnt("get", "shm", "cached") == 4 and model.learnt("get", "shm") == 3


def _rec(actual: float, predicted: float, **kw) -> dict:
    return {"op": "get", "choice": "shm", "actual_s": actual, "predicted_actual_s": predicted, "error": None,
            "explore": False, "learnt": WARMUP_TRANSFERS, **kw}


def test_the_prediction_error_is_defined_once():
    assert relative_error(_rec(0.002, 0.001)) == pytest.approx(0.5)  # 2x too low
    assert relative_error(_rec(0.001, 0.002)) == pytest.approx(1.0)  # 2x too high
    assert relative_error(_rec(0.001, 0.002, learnt=WARMUP_TRANSFERS - 1)) is None  # warm-up
    assert relative_error(_rec(0.001, 0.002, learnt=None)) == pytest.approx(1.0)  # an older client's
    assert relative_error(_rec(0.001, 0.002, explore=True)) is None
    assert relative_error(_rec(0.001, 0.002, error="ConnectionFailed()")) is None
    assert relative_error(_rec(0.001, 0.002, choice="recompute")) is None
    assert relative_error(_rec(0.001, None)) is None
    old = [_rec(0.001, 0.01)] * 300  # 900% each, then the newest ERROR_WINDOW at 10%
    new = [_rec(0.001, 0.0011)] * ERROR_WINDOW + [_rec(0.001, 0.0011, op="put")]
    got = prediction_error(old + new)
    assert got["median"] == pytest.approx(0.1) and got["samples"] == ERROR_WINDOW
    assert got["by_op"] == {"get": pytest.approx(0.1), "put": pytest.approx(0.1)}
    assert got["definition"] == PREDICTION_ERROR and "median of |actual - predicted| / actual" in PREDICTION_ERROR
    assert prediction_error([])["median"] is None
