"""``kvstore demo agents``'s hand-off scenario end to end: a real ``kvstore serve``, three real agent
processes (each a small random Llama) that live across the three variants, real churn between
them. Every agent's first token is the same with and without cached KV; the pause sank the
context when nothing was done; a prefetch at the hand-off, or retention across the pause, had
it in shm when the next agent arrived."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench.agents import run  # noqa: E402
from bench.agents_handoff import HANDOFF_VARIANTS  # noqa: E402
from bench.agents_model import ROLES, DemoConfig  # noqa: E402

CONTEXT = 512
BLOCKS = CONTEXT // 16


def test_handoff_scenario_reads_the_context_from_shm_with_prefetch_or_retention(tmp_path, capsys):
    result = run(out_dir=tmp_path, config=DemoConfig.quick(context_tokens=CONTEXT), scenario="handoff")
    roles = [r for r, _ in ROLES]
    turns = result["turns"]
    assert [(t["variant"], t["role"]) for t in turns] == [(v, r) for v in HANDOFF_VARIANTS for r in roles]
    assert len({a["pid"] for a in result["agents"]}) == 3, "each agent runs in its own process"
    assert len({a["weights_digest"] for a in result["agents"]}) == 1
    for t in turns:
        assert t["first_token_match"], t
        assert t["put_tokens"] == t["prompt_tokens"] // 16 * 16
        assert math.isfinite(t["ttft_with_s"]) and t["ttft_with_s"] > 0 and t["ttft_without_s"] > 0, t
    by = {(t["role"], t["variant"]): t for t in turns}
    for variant in HANDOFF_VARIANTS:
        assert by["planner", variant]["hit_tokens"] == 0 and by["planner", variant]["handoff"] is None
    for role in roles[1:]:
        none = by[role, "none"]
        assert none["hit_tokens"] == CONTEXT
        assert none["tiers_at_arrival"].get("nvme", 0) > 0, f"the pause's churn did not sink the context: {none}"
        assert none["handoff"]["churn_bytes"] >= 3 * result["top_tier_bytes"]
        for variant in ("prefetch", "retain"):
            t = by[role, variant]
            assert t["hit_tokens"] == CONTEXT, t
            # The message in full (the server's record of the prefetch): a tuple's repr is cut short.
            assert t["tiers_at_arrival"] == {"shm": BLOCKS}, json.dumps(
                {"variant": variant, "arrival": t["tiers_at_arrival"], "handoff": t["handoff"]}, default=str)
            assert t["medium"] == "shm" and t["blocks_over_http"] == 0, (variant, t)
        prefetch = by[role, "prefetch"]
        assert prefetch["handoff"]["prefetch_tokens"] == CONTEXT and prefetch["handoff"]["prefetch_complete"]
        assert prefetch["prefetch_lead_s"] > 0
        assert by[role, "retain"]["released_blocks"] >= BLOCKS  # it ended the writer's retention after reading
    for role in roles[:-1]:
        assert by[role, "retain"]["retained"]["blocks"] == by[role, "retain"]["prompt_tokens"] // 16
    out = capsys.readouterr().out
    assert "[prefetch] coder:" in out and "context at arrival" in out
    saved = json.loads((tmp_path / result["path"].rsplit("/", 1)[-1]).read_text())
    assert saved["turns"] == turns
    assert (tmp_path / result["plot"].rsplit("/", 1)[-1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_scenario_is_refused(tmp_path):
    with pytest.raises(ValueError, match="scenario"):
        run(out_dir=tmp_path, scenario="nope")
    assert not list(tmp_path.iterdir())
