"""Concurrent load: 16 client processes of mixed puts, gets, lookups, deletes and evictions against a
real ``kvstore serve`` whose small upper tiers keep placement moving blocks; every get is checked.
Half the clients are co-located: they find blocks through the arena's shared key index and read
them under each slot's seqlock while the server compacts, moves and drops them.

The default run does 2,400 operations; the ``slow`` one 100,000. The figures are zero
mismatches, zero errors and zero failed workers; latencies are printed (``-s``), never asserted.
"""

from __future__ import annotations

import pytest
import torch

from bench.reliability_kit.load_worker import expected_kv, matches, tokens_of
from bench.reliability_kit.scenarios import WORKERS, run_load


def _check(figures: dict, ops: int) -> None:
    print(figures)  # shown with -s
    assert figures["failed_workers"] == []
    assert figures["ops"] == ops
    assert figures["mismatches"] == 0
    assert figures["errors"] == {}
    assert figures["health"] == 200
    assert figures["verified_tokens"] > 0
    assert figures["moves"] > 0, "placement moved nothing: the scenario did not exercise moves"
    assert figures["media"] == ["http", "shm"]
    # co-located gets found their blocks through the arena's shared key index while the
    # server moved, replaced and deleted them under it: and not one was wrong (above)
    assert figures["gets_with_no_request"] > 0


def test_concurrent_mixed_load_serves_no_wrong_kv(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=150), WORKERS * 150)


def test_with_int8_cold_tiers_only_rounding_differs(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=100, seed=2, lossy=True), WORKERS * 100)


def test_a_server_restart_under_load_serves_no_wrong_kv(tmp_path):
    """The server stops and another starts on its port and data half-way through. Co-located
    workers held the old arena mapped with blocks found through its key index: they must see
    its segments are not the new server's and map the new arena, never read the old one as the
    new one's (every get is checked, and the sweep after)."""
    figures = run_load(tmp_path, ops_per_worker=80, seed=3, restart=True)
    print(figures)  # shown with -s
    assert figures["restarted"], "the workers finished before the restart: the scenario tested nothing"
    assert figures["failed_workers"] == []
    assert figures["ops"] == WORKERS * 80
    assert figures["mismatches"] == 0
    # while it was down, calls failed as a client sees a server that is gone; nothing else
    assert set(figures["errors"]) <= {"ConnectionFailed", "ServiceUnavailable"}, figures["errors"]
    assert figures["health"] == 200
    # co-located workers (the even ones) mapped the old arena and, unless they were done before
    # the restart, the new one; HTTP workers map none. Gets read blocks with no request from both.
    mapped = figures["arenas_mapped"]
    assert set(mapped[1::2]) == {0} and set(mapped[::2]) <= {1, 2} and mapped[::2].count(2) >= WORKERS // 4, mapped
    assert figures["arenas_read"] == 2


@pytest.mark.slow
def test_concurrent_mixed_load_100k_ops(tmp_path):
    _check(run_load(tmp_path, ops_per_worker=6250, seed=1), WORKERS * 6250)


def test_the_lossy_check_tells_rounding_from_another_blocks_kv():
    want = expected_kv(0, tokens_of(3))
    rounded = want.float() + torch.empty(want.shape).uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(0))
    assert matches(rounded.half(), want, lossy=True) and not matches(rounded.half(), want, lossy=False)
    other = expected_kv(0, tokens_of(4)[:len(tokens_of(3))])  # same length, other sequence's tokens
    assert not matches(other, want, lossy=True)
    assert not matches(want + 2, want, lossy=True)
