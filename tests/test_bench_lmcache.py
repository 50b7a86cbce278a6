"""``kvstore bench lmcache`` end to end at its smallest: two real servers, LMCache's own client.

It checks the rows, ratios and the rendered page section, never the timings (those are
for the bench itself, not for a test). Refusals need no LMCache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvstore.cli import main
from tests.server.test_lmcache_client import lmcache  # noqa: F401 - the fixture: skip or fail without LMCache

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.lmcache
def test_bench_lmcache_quick(lmcache, tmp_path, monkeypatch, capsys):  # noqa: F811
    from bench.lm_backend import ROWS, run

    page = tmp_path / "benchmarks.md"
    shutil.copyfile(ROOT / "docs" / "benchmarks.md", page)
    monkeypatch.chdir(tmp_path)  # its temp dirs go here
    result = run(quick=True, repeats=2, out_dir=tmp_path / "out", docs=page)
    assert set(result["rows"]) == set(ROWS)
    for figures in result["rows"].values():
        assert 0 < figures["min"] <= figures["median"] <= figures["max"]
    assert set(result["ratios"]) == set(result["met"]) == {"put", "get"}
    saved = json.loads(Path(result["path"]).read_text())
    assert saved["bench"] == "lmcache" and saved["chunk"] == [2, 32, 256, 1024]
    text = page.read_text()
    section = text.split("<!-- bench:lmcache -->")[1].split("<!-- /bench:lmcache -->")[0]
    assert "| kvstore lm:// get |" in section and "| lmcache server put |" in section and ">= 2.0x" in section
    assert "<!-- bench:results -->" in text  # the other section is left as it was
    assert "kvstore / LMCache put" in capsys.readouterr().out


def test_bench_lmcache_refuses_bad_options(tmp_path, capsys):
    assert main(["bench", "lmcache", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
    assert main(["bench", "lmcache", "--docs", str(tmp_path / "missing.md")]) == 2
    assert "no such page" in capsys.readouterr().err
