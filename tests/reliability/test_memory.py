"""Memory stability: put/delete churn in mixed block sizes leaves the resident set where warm-up left it.

``tests/reliability/memory_churn.py`` runs in its own process (a clean resident set): 20,000
cycles by default, 1,000,000 behind ``slow``. After the first tenth (warm-up: the arena's
pages, the index, the allocator's bins), every later sample of VmRSS stays within 10% of it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def churn(tmp_path, cycles: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.reliability.memory_churn", str(cycles), str(tmp_path)],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(figures)
    return figures


def _check(figures: dict) -> None:
    warm, *later = figures["rss"]
    assert len(later) >= 9
    drift = max(later) / warm - 1
    assert drift <= 0.10, f"resident set grew {drift:.1%} after warm-up: {figures['rss']}"
    assert 0.0 <= figures["fragmentation"] < 1.0


def test_churn_keeps_the_resident_set(tmp_path):
    _check(churn(tmp_path, 20_000))


@pytest.mark.slow
def test_a_million_cycles_keep_the_resident_set(tmp_path):
    _check(churn(tmp_path, 1_000_000))
