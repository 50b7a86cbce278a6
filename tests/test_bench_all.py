"""``kvstore bench all --quick --no-lmcache`` on tiny sizes: every row, chart and page section is there.

It asserts what the run produced, never how fast: timings belong to the bench.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.all import LIMIT_OF, PEER_OF
from bench.page import END, START, render

SIZES = ("64KiB", "256KiB")
ROWS = {  # written out here, so a row the bench stops measuring fails this test
    "limit memcpy", "limit memcpy x2", "limit memcpy+request", "limit shm out", "limit tcp get", "limit tcp put",
    "limit file put", "limit file get",
    "colocated put", "colocated put, nowait", "handoff", "colocated get", "colocated get out=", "colocated get, asking",
    "colocated get, asking, 64 KiB blocks",
    "http put", "http get", "http get out=", "flight put", "flight get", "flight get out=",
    "redis tier put", "redis tier get", "nvme tier put", "nvme tier get",
    "redis-py put", "redis-py get", "pickle put", "pickle get",
    "remote put", "remote get", "remote get out=",
}
PROMPTS = (32, 64)
CLIENTS = (1, 2)
STORED = (0, 4 << 20)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("bench-all")
    page = tmp / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\nMethod.\n\n{START}\nold results\n{END}\n\nAfter.\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "bench", "all", "--quick", "--no-lmcache", "--sizes", ",".join(SIZES),
         "--prompts", ",".join(map(str, PROMPTS)), "--clients", ",".join(map(str, CLIENTS)),
         "--stored", "0,4MiB", "--out", str(tmp / "out"), "--docs", str(page)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = (tmp / "out").glob("*.json")
    return json.loads(path.read_text()), page, done


def test_every_size_has_every_row_and_ratio(run) -> None:
    result, _, _ = run
    assert [s["size"] for s in result["sizes"]] == list(SIZES)
    assert result["notes"] == []  # nothing was left out
    for s in result["sizes"]:
        assert set(s["gbps"]) == ROWS  # no LMCache rows: --no-lmcache
        for g in s["gbps"].values():
            assert 0 < g["min"] <= g["median"] <= g["max"]
            if "via" not in g:  # a remote row repeats its medium's figures
                assert g["ops"] >= result["repeats"] and 0 < g["p50_ms"] <= g["p99_ms"]
        expected = {f"{row} / {limit}" for row, limit in LIMIT_OF.items()}
        expected |= {f"{row} / {peer}" for row, peers in PEER_OF.items() for peer in peers if peer in ROWS}
        expected.add("colocated get / limit shm out")
        assert set(s["ratios"]) == expected
        assert all(r > 0 for r in s["ratios"].values())
    targets = {(t["name"], t["size"]): t for t in result["targets"]}
    # every target is at 1 or 32 MiB, and LMCache did not run: they say so rather than vanish
    for name, size in (("hand-off, A's put then B's first get, p50 / memcpy", "32MiB"),
                       ("HTTP get / loopback TCP", "32MiB"), ("Redis tier put / LMCache redis put", "32MiB")):
        assert targets[name, size]["value"] is None and targets[name, size]["met"] is None


def test_ttft_scale_and_memory_sections(run) -> None:
    result, _, _ = run
    ttft = result["ttft"]
    assert [r["tokens"] for r in ttft["rows"]] == list(PROMPTS)
    for r in ttft["rows"]:
        assert set(r["media"]) == {"colocated", "http", "flight"}
        for m in r["media"].values():
            # the KV comes back bit for bit, so resuming from it gives the prefill's own first token;
            # the logits differ only by float rounding (one token's matmuls against the whole prompt's)
            assert m["first_token_match"] and m["max_logit_diff"] < 1e-3
            assert m["hit_tokens"] == r["tokens"] and m["speedup"] > 0
    scale = result["scale"]["rows"]
    assert [(r["medium"], r["clients"]) for r in scale] == [(m, n) for m in ("colocated", "colocated asking", "http")
                                                            for n in CLIENTS]
    assert all(r["gets"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in scale)
    memory = result["memory"]["rows"]
    assert [r["stored_bytes"] for r in memory] == list(STORED)
    assert all(r["vmrss"] > 0 for r in memory)
    assert result["lmcache"]["ran"] is False


def test_charts_and_page(run) -> None:
    result, page, done = run
    assert len(result["charts"]) == 3
    for chart in result["charts"]:
        assert Path(chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nMethod.\n\n") and text.endswith("\n\nAfter.\n")
    assert "old results" not in text and "### Targets" in text and "| pickle get |" in text
    assert "| Redis tier put / LMCache redis put (redis tier put / lmcache redis put) | 32MiB | not run |" in text
    for name in ("throughput", "ttft", "scale"):
        assert f"(benchmarks/{name}.png)" in text
        assert (page.parent / "benchmarks" / f"{name}.png").exists()
    assert "### Throughput by path and size" in done.stdout  # the table is printed too
    for size in SIZES:  # and the hand-off's p50 and p99
        assert f"| handoff | {size} | {result['repeats'] * (8 << 20) // (int(size[:-3]) << 10)} |" in done.stdout


def test_render_refuses_a_page_without_markers(run, tmp_path: Path) -> None:
    result, _, _ = run
    page = tmp_path / "plain.md"
    page.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no <!-- bench:results -->"):
        render(result, page)
    assert page.read_text() == "# no markers\n"


@pytest.mark.parametrize("args, message", [
    (["--sizes", "lots"], "kvstore bench all:"),
    (["--prompts", "8"], "values >= 16"),
    (["--clients", "0"], "values >= 1"),
    (["--with-lmcache", "--no-lmcache"], "not allowed with"),
    (["--sizes", "100KiB", "--no-lmcache"], "not a whole number of"),
    (["--docs", "no/such/page.md", "--no-lmcache"], "no such page"),
])
def test_bad_arguments_are_refused(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "all", *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr


def test_a_child_that_never_answers_is_killed_not_waited_on() -> None:
    from bench.serving import reply_line

    quiet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match="did not answer within 0 s; it was killed"):
        reply_line(quiet, 0.3, "the quiet child")
    assert quiet.poll() is not None
    talker = subprocess.Popen([sys.executable, "-c", "print('hi', flush=True)"], stdout=subprocess.PIPE, text=True)
    assert reply_line(talker, 30, "the talker") == "hi\n"
    assert reply_line(talker, 30, "the talker") == ""  # it exited
    talker.wait()
