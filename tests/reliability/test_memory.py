"""Memory stability: put/delete churn in mixed block sizes leaves the resident set where warm-up left it.

``bench/reliability_kit/memory_churn.py`` runs in its own process (a clean resident set): 20,000
cycles by default, 1,000,000 behind ``slow``. After the first tenth (warm-up: the arena's
pages, the index, the allocator's bins), every later sample of VmRSS stays within 10% of it.
"""

from __future__ import annotations

import pytest

from bench.reliability_kit.scenarios import churn


def _check(figures: dict) -> None:
    print(figures)  # shown with -s
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


@pytest.mark.slow
def test_bench_reliability_quick_prints_and_writes_every_figure(tmp_path):
    import json
    import subprocess
    import sys

    page = tmp_path / "reliability.md"
    page.write_text("# R\n\n<!-- bench:results -->\n<!-- /bench:results -->\n")
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "reliability", "--quick", "--out",
                           str(tmp_path), "--docs", str(page)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    for figure in ("crash cycles survived", "lost", "torn or foreign served", "crash under compaction",
                   "crash under demotion", "fuzz cases run", "5xx seen",
                   "concurrent ops verified", "mismatches", "p99 latency", "RSS drift"):
        assert figure in done.stdout and figure in page.read_text()
    [path] = tmp_path.glob("reliability-*.json")
    result = json.loads(path.read_text())
    assert result["crash"]["lost"] == 0 and result["load"]["mismatches"] == 0 and result["fuzz"]["5xx"] == 0
    assert {name: (c["lost"], c["torn_served"]) for name, c in result["crash_moving"].items()} \
        == {"compaction": (0, 0), "demotion": (0, 0)}
