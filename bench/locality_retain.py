"""Conversation retention under churn, against a real ``kvstore serve``.

The Retention target of issue 24: while other tenants fill the top tier three times over,
conversations retained within the retention quota keep a top-tier hit ratio >= 0.99, and the
unretained traffic's hit ratio drops by no more than the share of the tier the retained ones hold.

One scripted workload runs twice, each time on a fresh server with a small top tier: once with
the conversations retained (``retain``, within the default quota: a quarter of the top tier),
once without. Two kinds of traffic share it:

- retained conversations (namespace ``chat``): put once, then read only after long pauses (a
  tool call each), the reads that retention is for;
- the other tenants (namespaces ``tenant-*``): fresh puts, three top tiers' worth of bytes in
  all, each followed by reads of their recent conversations (a working set about the size of
  the top tier), so their traffic is hot too. This is the unretained traffic.

Each read looks the conversation up first (``lookup_blocks``: each block's tier, no read
counted), then reads it (``get_kv``). A block found in the top tier is a hit. The unretained
drop is the same-run difference of the other tenants' ratio without retention and with it.

    python -m bench.locality_retain [--quick]
"""

from __future__ import annotations

import random
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from bench.reliability_kit.serve_process import serving, small_env
from bench.report import header, publish
from client_sdk import KVClient
from kvstore.spec import KVSpec

__all__ = ["run", "format_table", "TARGET_RETAINED_RATIO"]

SPEC = KVSpec(model_id="bench-retain", num_layers=4, num_kv_heads=2, head_dim=16, dtype="float16",
              block_tokens=16, fingerprint="bench-weights-1")
"""8 KiB blocks (8448 bytes framed)."""
TARGET_RETAINED_RATIO = 0.99
CHURN_TIMES = 3
"""The other tenants put this many top tiers' worth of bytes."""
CHECKPOINTS = 6
"""Reads of the retained conversations, spread evenly over the churn (two per top tier churned)."""
CHURN_BLOCKS = 8
"""Blocks of each conversation the other tenants put."""
TENANT_READS = 2
"""Reads of their recent conversations the other tenants make per put (their traffic is hot too)."""


def _kv(tokens: int) -> torch.Tensor:
    return torch.zeros(SPEC.kv_shape(tokens), dtype=SPEC.torch_dtype)


def _conversations(rng: random.Random, count: int, blocks: int) -> list[list[int]]:
    return [[rng.randrange(50_000) for _ in range(blocks * SPEC.block_tokens)] for _ in range(count)]


class _Hits:
    """Top-tier hits of one kind of traffic: blocks found in the top tier over blocks asked for."""

    def __init__(self) -> None:
        self.hits = self.blocks = 0

    def read(self, client: KVClient, tokens: list[int], top: str) -> None:
        """Look ``tokens`` up (where each block is, no read counted), then read them (heat)."""
        found = client.lookup_blocks(SPEC, tokens)["blocks"]
        self.hits += sum(b["tier"] == top for b in found)
        self.blocks += len(tokens) // SPEC.block_tokens  # a block stored nowhere is a miss too
        client.get_kv(SPEC, tokens)

    @property
    def ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def _one_run(retain: bool, shm: str, seed: int, tmp: Path) -> dict:
    rng = random.Random(seed)  # the same workload with and without retention
    env = small_env(tmp / ("retain" if retain else "plain"), KVSTORE_SHM_BYTES=shm, KVSTORE_CXL_BYTES="16MiB",
                    KVSTORE_NVME_BYTES="64MiB")
    with ExitStack() as stack:
        node = stack.enter_context(serving(env))
        chat = stack.enter_context(KVClient(node.url, namespace="chat"))
        tenants = [stack.enter_context(KVClient(node.url, namespace=f"tenant-{i}")) for i in range(3)]
        top = chat.admin.tiers()[0]
        frame = SPEC.block_nbytes + 256  # a block's frame, header included (about)
        top_blocks = top["capacity_bytes"] // frame
        # Retained: about a fifth of the top tier (the default quota is a quarter of it).
        retained = _conversations(rng, 4, max(2, top_blocks // 20))
        for tokens in retained:
            chat.put_kv(SPEC, tokens, _kv(len(tokens)))
        retained_bytes = quota = 0
        if retain:
            for tokens in retained:
                answer = chat.retain(SPEC, tokens, ttl_s=600)
                retained_bytes, quota = answer["retained_bytes"], answer["quota_bytes"]
        churn_puts = CHURN_TIMES * top_blocks // CHURN_BLOCKS
        window = max(2, top_blocks // CHURN_BLOCKS)  # the tenants' working set: about one top tier
        pause = max(1, churn_puts // CHECKPOINTS)
        kept, other = _Hits(), _Hits()
        history: list[tuple[KVClient, list[int]]] = []
        for i in range(churn_puts):
            client = rng.choice(tenants)
            tokens = [rng.randrange(50_000) for _ in range(CHURN_BLOCKS * SPEC.block_tokens)]
            client.put_kv(SPEC, tokens, _kv(len(tokens)))
            history.append((client, tokens))
            for _ in range(TENANT_READS):
                other.read(*rng.choice(history[-window:]), top["name"])
            if (i + 1) % pause == 0:  # the tool call is over: the retained conversations are read again
                for tokens in retained:
                    kept.read(chat, tokens, top["name"])
        return {"retain": retain, "top_tier": top["name"], "top_tier_bytes": top["capacity_bytes"],
                "churn_bytes": churn_puts * CHURN_BLOCKS * frame, "retained_bytes": retained_bytes,
                "quota_bytes": quota, "retained_share": retained_bytes / top["capacity_bytes"],
                "retained_ratio": kept.ratio, "unretained_ratio": other.ratio,
                "blocks_looked_up": {"retained": kept.blocks, "unretained": other.blocks}}


def run(quick: bool = False, *, out_dir: str | Path | None = None, seed: int = 0) -> dict:
    """Run the workload with and without retention; return both runs and the target rows.

    Args:
        quick: a smoke run (well under 30 s): a 2 MiB top tier instead of 8 MiB.
        out_dir: also print the table and write the JSON there (None: only return it).

    Returns:
        ``{"bench": "locality-retain", "runs": [with, without], "rows": [retained, unretained]}``;
        each row has its ``target`` and whether it was ``met``.
    """
    shm = "2MiB" if quick else "8MiB"
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-retain-") as tmp:
        with_, without = (_one_run(retain, shm, seed, Path(tmp)) for retain in (True, False))
    drop = without["unretained_ratio"] - with_["unretained_ratio"]
    rows = [
        {"name": "retained conversations, top-tier hit ratio", "with_retention": with_["retained_ratio"],
         "without_retention": without["retained_ratio"], "within_quota": with_["retained_bytes"] <= with_["quota_bytes"],
         "target": f">= {TARGET_RETAINED_RATIO:g}", "met": with_["retained_ratio"] >= TARGET_RETAINED_RATIO},
        {"name": "unretained traffic, top-tier hit ratio drop", "with_retention": with_["unretained_ratio"],
         "without_retention": without["unretained_ratio"], "drop": drop, "retained_share": with_["retained_share"],
         "target": "drop <= retained share", "met": drop <= with_["retained_share"]},
    ]
    result = header("locality-retain", quick=quick, churn_times=CHURN_TIMES, runs=[with_, without], rows=rows)
    if out_dir is not None:
        publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    kept, other = result["rows"]
    run_ = result["runs"][0]
    lines = [f"kvstore bench: retention under churn (other tenants put {result['churn_times']}x the "
             f"{run_['top_tier']} tier, {run_['top_tier_bytes'] / 2**20:.0f} MiB)",
             f"{'traffic':46} {'with':>7} {'without':>8} {'target':>24} met"]
    for row in (kept, other):
        lines.append(f"{row['name']:46} {row['with_retention']:7.3f} {row['without_retention']:8.3f} "
                     f"{row['target']:>24} {'yes' if row['met'] else 'NO'}")
    lines.append(f"retained {run_['retained_bytes'] / 2**20:.2f} MiB of a {run_['quota_bytes'] / 2**20:.2f} MiB quota "
                 f"({other['retained_share']:.1%} of the tier); unretained drop {other['drop']:+.3f}")
    return "\n".join(lines)
