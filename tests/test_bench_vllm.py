"""``kvstore bench vllm``'s figures: ratios, targets and the rendered tables, from synthetic samples
(the engines themselves run in tests/kvstore/integrations/test_vllm.py and in the bench)."""

from __future__ import annotations

import json

import pytest

from bench.vllm_ttft import SIZES, _result, format_table, markdown


def samples(hit_ms: float, decode_saving: float) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for n in SIZES:
        out[f"recompute {n}"] = [n / 2000] * 3  # 2k: 1.024 s
        out[f"vllm prefix hit {n}"] = [0.080] * 3
        out[f"kvstore shm hit {n}"] = [hit_ms / 1000] * 3
        out[f"kvstore http hit {n}"] = [0.110] * 3 if hit_ms < 100 else [0.150] * 3
        out[f"example hit {n}"] = [0.090] * 3
        out[f"kvstore miss {n}"] = [n / 2000 * 1.04] * 3
    out["decode none"] = [70.0] * 3
    out["decode kvstore saving"] = [70.0 * decode_saving] * 3
    return out


def test_targets_are_judged_from_the_same_run_medians():
    met = _result(samples(85, 0.95), quick=True, repeats=3, elapsed=1.0)
    assert met["ratios"]["shm_vs_prefix_hit"] == pytest.approx(0.085 / 0.080)
    assert all(met["met"].values()), met["met"]
    missed = _result(samples(120, 0.85), quick=True, repeats=3, elapsed=1.0)
    assert missed["met"] == {"shm_vs_prefix_hit": False, "http_vs_prefix_hit": False,
                             "miss_vs_recompute": True, "decode_saving_vs_none": False,
                             "faster_than_example": False}
    json.dumps(missed)  # the result is what gets written


def test_the_tables_name_every_row_and_verdict():
    result = _result(samples(120, 0.85), quick=False, repeats=3, elapsed=1.0)
    page, table = markdown(result), format_table(result)
    for row in ("recompute", "vllm prefix hit", "kvstore shm hit", "kvstore http hit", "example hit", "kvstore miss"):
        assert f"| {row} |" in page and row in table
    assert "| kvstore shm hit / vLLM prefix hit, worst size | 1.50x | <= 1.1x | no |" in page
    assert "recompute / vLLM's own prefix hit at 2k = 12.8x" in page
    assert "(target >= 0.9x: missed)" in table
