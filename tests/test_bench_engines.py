"""``kvstore bench engines``' figures: ratios, targets and the rendered page, from synthetic rows
(SGLang and LMCache themselves run in tests/kvstore/integrations/test_sglang.py, tests/kvstore/integrations/test_lmcache_l2.py and the bench)."""

from __future__ import annotations

import json

import pytest

from bench.engine_backends import TARGETS, _ratios, markdown
from bench.report import header


def row(layout: str, backend: str, get_ms: float, again_ms: float = 5.0) -> dict:
    return {"layout": layout, "backend": backend, "bytes": 32 << 20, "set_s": 0.05, "get_s": get_ms / 1e3,
            "get_repeat_s": again_ms / 1e3, "memcpy_s": 0.006}


def result(rows: list[dict], lmcache) -> dict:
    out = header("engines", quick=False, repeats=3, sglang=rows, lmcache=lmcache, ratios=_ratios(rows),
                 targets=TARGETS, elapsed_s=1.0)
    out["machine"]["cpus"] = 2
    out["met"] = {k: out["ratios"][k] >= t for k, t in TARGETS.items()}
    return out


def test_a_target_holds_only_in_every_layout():
    rows = [row("page_first", "kvstore", 10), row("page_first", "file", 40),
            row("layer_first", "kvstore", 20), row("layer_first", "file", 30)]
    ratios = _ratios(rows)
    assert ratios["get_vs_file"] == pytest.approx(1.5)  # the worse layout's, not the better one's 4x
    assert ratios["get_vs_memcpy"] == pytest.approx(0.3)
    assert ratios["get_again_vs_memcpy"] == pytest.approx(1.2)


def test_the_page_names_each_row_verdict_and_a_missing_peer():
    rows = [row("page_first", "kvstore", 10), row("page_first", "file", 40)]
    lm = {"chunk_bytes": 512 << 10, "chunks": 64, "repeats": 3, "rows": [
        {"adapter": a, "l2_store_s": 0.04, "l2_store_gbps": 0.8, "lookup_s": 0.03, "lookup_gbps": 1.1,
         "retrieve_s": 0.2, "hit_tokens": 4096, "identical": True} for a in ("kvstore", "mock", "fs")]}
    page = markdown(result(rows, lm))
    assert "| page_first | kvstore |" in page and "| fs |" in page and "4096, yes" in page
    assert "**4.00x** (target >= 1.5x, met)" in page and "**0.60x** (target >= 0.5x, met)" in page
    assert "set / file **1.00x** (target >= 1.0x, met)" in page
    assert "lookup **1.00x** (target >= 0.8x, met); store **1.00x** (target >= 0.9x, met)" in page
    skipped = markdown(result(rows, {"skipped": "no .venv-lmcache"}))
    assert "not run: no .venv-lmcache" in skipped
    json.dumps(result(rows, lm))
