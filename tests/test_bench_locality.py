"""Quick runs of the locality benches (``bench.locality_events``, ``bench.locality_retain``).

Only what must always hold is asserted: the rebuilt block set is exact, every put's event
arrives, retained conversations stay in the top tier within their quota. The timing targets
(p99, throughput ratios) belong to the bench's table, not to a test on a shared machine.
"""

from __future__ import annotations

import math

from bench import locality_events, locality_retain


def test_events_bench_rebuilds_the_block_set_exactly():
    result = locality_events.run(quick=True)
    exact, latency, *stalled = result["rows"]
    assert exact["mismatched_keys"] == {"from the start": 0, "from mid-run": 0}, exact
    assert exact["met"] and exact["entries"] > 0
    assert exact["events"].get("moved", 0) > 0, "the small tiers should have forced moves"
    assert sum(exact["calls"].values()) == exact["ops"]
    assert latency["missing_events"] == 0 and math.isfinite(latency["p99_ms"])
    assert len(stalled) == 3 and all(r["ratio"] > 0 and len(r["ratios"]) == r["rounds"] for r in stalled)
    assert "snapshot + events" in locality_events.format_table(result)


def test_retain_bench_keeps_retained_conversations_in_the_top_tier():
    result = locality_retain.run(quick=True)
    retained, unretained = result["rows"]
    with_, without = result["runs"]
    assert with_["retain"] and not without["retain"]
    assert 0 < with_["retained_bytes"] <= with_["quota_bytes"]
    assert retained["within_quota"] and retained["with_retention"] >= locality_retain.TARGET_RETAINED_RATIO
    assert with_["churn_bytes"] >= 3 * with_["top_tier_bytes"] * 0.9  # the top tier really churned
    assert 0 <= unretained["with_retention"] <= 1 and 0 <= unretained["without_retention"] <= 1
    assert "retention under churn" in locality_retain.format_table(result)
