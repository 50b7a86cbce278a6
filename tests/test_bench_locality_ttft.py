"""``bench.locality_ttft`` in quick mode: real ``kvstore serve`` nodes, a real redis-server, the
demo's model. What must always hold, not the timing targets (those are the bench's to judge): the
no-prefetch consumer found its prefix in the cold tier, and the consumer after a prefetch was
served every block from its own node's arena."""

from __future__ import annotations

import json
import math
import shutil

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

from bench.locality_ttft import VARIANTS, run  # noqa: E402

COLD = {"nvme": "nvme", "redis": "redis", "two-node": "redis"}
"""Where the context was when the no-prefetch consumer arrived (on node B: only in Redis)."""


def _finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_quick_mode_serves_the_prefetched_consumer_from_shm(tmp_path):
    result = run(quick=True, out_dir=tmp_path)
    context = result["config"]["context_tokens"]
    blocks = context // result["config"]["block_tokens"]
    assert [c["case"] for c in result["cases"]] == ["nvme", "redis", "two-node"]
    assert result["judged_on"] == "ttft"
    for case in result["cases"]:
        variants = case["variants"]
        for name in VARIANTS:
            row = variants[name]
            assert _finite(row["ttft_s"]) and _finite(row["get_s"]), (case["case"], name)
            assert len(row["samples"]) == result["rounds"]
            for s in row["samples"]:
                assert s["hit"] == context, (case["case"], name, s)
                assert s["ttft_s"] > s["get_s"] > 0  # TTFT holds the fetch and a prefill
        for s in variants["baseline"]["samples"]:
            assert s["tiers_at_arrival"] == {"shm": blocks} and s["blocks_over_http"] == 0, s
        for s in variants["no_prefetch"]["samples"]:
            assert s["tiers_at_arrival"] == {COLD[case["case"]]: blocks}, (case["case"], s)
            assert s["blocks_over_http"] == blocks, s  # not in the arena: every block came over HTTP
        for s in variants["prefetch"]["samples"]:
            assert s["prefetch_tokens"] == context and _finite(s["prefetch_s"]), s
            assert s["tiers_at_arrival"] == {"shm": blocks}, (case["case"], s)
            assert s["medium"] == "shm" and s["blocks_over_http"] == 0, (case["case"], s)
        if case["case"] == "two-node":
            for name in ("no_prefetch", "prefetch"):
                assert all(s["handoff"]["shared"] == blocks for s in variants[name]["samples"])
        for field in ("ttft", "fetch"):
            assert all(_finite(r) for r in case["ratios"][field].values()), case["ratios"]
        assert case["met"] == (case["ratios"]["ttft"]["prefetch"] <= result["target_ratio"])
    (path,) = tmp_path.glob("locality-ttft-*.json")
    assert json.loads(path.read_text())["cases"] == result["cases"]
