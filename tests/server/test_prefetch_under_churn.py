"""Prefetch into a full top tier that other tenants churn, against a real ``kvstore serve``: the
hand-off demo's own churn (``bench.agents_handoff``), round after round, and no reader between
rounds, so every earlier prefetch still holds its budget. Each prefetch must bring its whole
prefix up and keep it there through the next pause's churn: before the fixes this tests, about one round in three left blocks
below (an unread hold kept the budget, and the promoted blocks, unheld, went straight back down;
or slots lent to the co-located churn writer filled the arena while placement counted room)."""

from __future__ import annotations

import json
import random
import urllib.request

import torch

from bench.agents_handoff import _Churn, _handoff_env, _prefetch
from bench.agents_model import DemoConfig
from bench.agents_proc import serving
from client_sdk import KVClient
from kvstore.spec import KVSpec

ROUNDS = 3
AFTER = 3
"""Pauses of churn between the prefetch and the check: 6 s, past placement's residency time (5 s),
after which the drain may send an unheld promoted block back down."""
SPEC = KVSpec(model_id="prefetch-churn", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32",
              block_tokens=16, fingerprint="prefetch-churn-1")  # the demo's 4 KiB a token, 64 KiB blocks


def _record(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/admin/prefetches?limit=3", timeout=30) as r:
        return json.loads(r.read())


def test_every_prefetch_after_churn_brings_its_whole_prefix_up_and_holds_it(tmp_path):
    env, top_bytes = _handoff_env(DemoConfig.quick(context_tokens=512))
    rng = random.Random(7)
    with serving(tmp_path, env=env) as url:
        churn = _Churn(url, top_bytes)
        try:
            for i in range(ROUNDS):
                ns = f"round-{i}"
                prompt = [rng.randrange(30_000) for _ in range(552)]
                with KVClient(url, namespace=ns, agent="writer", plan=False) as writer:
                    writer.put_kv(SPEC, prompt[:544], torch.randn(SPEC.kv_shape(544)))
                churn.pause()  # three top tiers of hot puts: the prefix sinks to nvme
                with KVClient(url, namespace=ns, agent="orchestrator", plan=False) as orchestrator:
                    top = orchestrator.admin.tiers()[0]["name"]
                    out = _prefetch(orchestrator, url, SPEC, prompt, top)
                    assert out["prefetch_tokens"] == 544
                    assert out["prefetch_complete"], json.dumps({"round": i, **out}, default=str)
                    for _ in range(AFTER):  # the reader is not here yet: the hold keeps the prefix up for it
                        churn.pause()
                    found = orchestrator.lookup_blocks(SPEC, prompt)["blocks"]
                    below = [b for b in found if b["tier"] != top]
                    assert len(found) == 34 and not below, json.dumps(
                        {"round": i, "below": len(below), "prefetches": _record(url)}, default=str)
        finally:
            churn.close()
