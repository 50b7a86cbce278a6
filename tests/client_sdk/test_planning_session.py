"""The planner's predictions in a mixed session against a real ``kvstore serve``.

A user saw, after a two-minute session, "prediction error 96%" on the dashboard and first small
puts taking 24.9x their prediction. Here a co-located ``KVClient`` runs 200 transfers against a
``kvstore serve`` child process (``bench.planner_session.session``): puts and gets of 64 KiB to
4 MiB in a seeded random order (a get reads back something put before, so some find their slots
remembered and some ask). The server's prediction error must be the client's, for the same
records; each (op, option, path)'s predictions must be within 2x of what the transfers took from
their 5th transfer on (stalls of a loaded machine aside).

The 25% target for the prediction error is ``kvstore bench planner``'s, as the median of fresh
sessions: one session on a loaded 2-core VM measured 0.17-0.30 with the model unchanged (the same
1 MiB get takes 0.36-1.1 ms within a session), so this test bounds it where a broken model lands:
0.50-0.61 before the fix this test came with.
"""

from __future__ import annotations

import math

import pytest

from bench.planner_session import TRANSFERS, session as run_session, within_2x
from bench.reliability_kit.serve_process import ServeProcess, small_env
from kvstore.decisions import WARMUP_TRANSFERS, prediction_error

BROKEN_ERROR = 0.4
"""Under the 0.50-0.61 of the model before its fix; over the 0.30 a sound one measured on a loaded VM."""


def _session() -> tuple[list[dict], dict]:
    """One mixed session against a fresh ``kvstore serve`` child."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = ServeProcess(small_env(tmp, KVSTORE_SHM_BYTES="256MiB")).start()
        try:
            return run_session(proc.url)
        finally:
            proc.stop()


@pytest.fixture(scope="module")
def session() -> tuple[list[dict], dict]:
    """The client's decision records, and ``/admin/decisions``' answer, after one mixed session."""
    return _session()


def _off_by_2x(local: list[dict]) -> list:
    """What in a session's records misses "within 2x from the 5th transfer on": the share of all
    transfers within 2x when under 0.8, and each (op, option, path) whose typical ratio is over
    2x; empty when none misses."""
    within, ratios = within_2x(local)
    misses: list = []
    # A loaded 2-core machine stalls a transfer now and then (a 64 KiB put took 114 ms among
    # 1.6 ms ones): those are no prediction's to meet, but they are few.
    if within < 0.8:
        misses.append(("within 2x", round(within, 2), {k: [round(r, 2) for r in rs] for k, rs in ratios.items()}))
    for key, rs in ratios.items():
        if len(rs) > WARMUP_TRANSFERS:
            later = rs[WARMUP_TRANSFERS:]
            typical = sorted(abs(math.log(r)) for r in later)[len(later) // 2]
            if typical > math.log(2):
                misses.append((key, round(math.exp(typical), 2), [round(r, 2) for r in rs]))
    return misses


def test_the_served_prediction_error_is_the_clients_and_not_broken(session):
    local, served = session
    # A transfer retried over another medium is two records; a report that failed is dropped.
    assert len(local) >= TRANSFERS and served["total"] >= 0.9 * len(local)
    ids = {d["id"] for d in served["decisions"]}
    error = served["prediction_error"]
    # One definition: the server's figure is the client's, for the same records.
    assert error == prediction_error([d for d in local if d["id"] in ids])
    assert error["samples"] >= TRANSFERS // 2, error
    assert error["median"] < BROKEN_ERROR, error


def test_predictions_come_within_2x_by_the_5th_transfer_and_stay(session):
    """One session on CI's loaded 2-core machine has missed now and then: in two of the four CI
    runs of stops 49-50, shm puts' typical ratio was 2.1x, then 1 / 2.3x (an early stall, or a
    size class first met late and predicted from the other classes' fit), while a broken model
    misses in every session. A session that misses is run once more against a fresh server: both
    must miss to fail."""
    local, _ = session
    misses = _off_by_2x(local)
    if misses:
        again = _off_by_2x(_session()[0])
        assert not again, {"first session": misses, "second session": again}
