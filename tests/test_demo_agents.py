"""``kvstore demo agents`` end to end: a real ``kvstore serve``, three real agent processes,
a real (small, random) Llama in each; the later agents resume from the planner's KV."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench.agents import run  # noqa: E402
from bench.agents_model import DemoConfig  # noqa: E402
from kvstore.cli import main  # noqa: E402


def test_three_agents_share_the_context(tmp_path, capsys):
    result = run(out_dir=tmp_path, config=DemoConfig.quick(context_tokens=512))
    agents = result["agents"]
    assert [a["role"] for a in agents] == ["planner", "coder", "reviewer"]
    assert len({a["pid"] for a in agents}) == 3, "each agent runs in its own process"
    assert len({a["weights_digest"] for a in agents}) == 1, "every process built the same weights"
    assert agents[0]["hit_tokens"] == 0  # nothing stored yet
    for a in agents:
        assert a["first_token_match"], a
        assert a["put_tokens"] == a["prompt_tokens"] // 16 * 16
    for a in agents[1:]:
        assert a["hit_tokens"] == 512, a  # the shared context, every full block of it
        # Timings are the demo's output, not this test's to judge: a tiny test model's prefill can
        # be as quick as a fetch. `kvstore demo agents` (8 layers, 1,536 shared tokens) shows the gap.
        assert a["ttft_with_s"] > 0 and a["ttft_without_s"] > 0, a
        assert a["medium"] is not None
    out = capsys.readouterr().out
    assert "[2/3] coder: get_kv hit 512 tokens via" in out and "speed-up" in out
    saved = json.loads((tmp_path / result["path"].rsplit("/", 1)[-1]).read_text())
    assert saved["agents"] == agents
    assert result["plot"].endswith(".png")
    assert (tmp_path / result["plot"].rsplit("/", 1)[-1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_runs_the_agents_demo(tmp_path, capsys):
    assert main(["demo", "agents", "--quick", "--context-tokens", "256", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("agents-*.json")
    result = json.loads(path.read_text())
    assert result["config"]["context_tokens"] == 256
    assert [a["hit_tokens"] for a in result["agents"]] == [0, 256, 256]
    assert path.with_suffix(".png").exists()
    assert "reviewer" in capsys.readouterr().out


def test_cli_rejects_a_bad_context_length(tmp_path, capsys):
    assert main(["demo", "agents", "--context-tokens", "3", "--out", str(tmp_path)]) == 2
    assert "context_tokens" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
