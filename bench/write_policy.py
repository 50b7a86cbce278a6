"""``kvstore bench write-policy``: what each shared-tier write policy costs and buys.

Two real stores ("nodes") share one private ``redis-server``. Node A serves a
multi-agent workload: sessions that share a system-prompt prefix, each with its
own tail, put once and then read with Zipf(1.0) popularity. A's top tier holds
a quarter of the sessions, so placement demotes the rest into Redis. Then node
B, which has stored nothing itself, is asked for sessions drawn the same way.

Per policy it reports the bytes A wrote to Redis (write-through or selective
copies, plus demotions that had to copy: a demotion onto an existing shared
copy writes nothing) and B's cross-node hit ratio: the share of requested
tokens that B served from what A left in Redis.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.report import header, publish
from bench.tiers import private_redis
from kvstore import KVSpec, KVStore
from kvstore.engine.placement import PlacementConfig

__all__ = ["run", "format_table"]

POLICIES = ("write_through", "write_back", "selective")


def _workload(quick: bool, seed: int) -> tuple[KVSpec, list[list[int]], np.ndarray, np.ndarray]:
    spec = KVSpec("bench-llama", 4, 2, 64, "float16", 16, "bench-rev")  # 32 KiB blocks
    sessions = 40 if quick else 160
    prefix = list(range(16 * 4))  # a 4-block system prompt every session shares
    chains = [prefix + list(range(100_000 + i * 1000, 100_000 + i * 1000 + 16 * 4)) for i in range(sessions)]
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, sessions + 1)
    weights /= weights.sum()
    reads_a = rng.choice(sessions, size=(200 if quick else 1500), p=weights)
    reads_b = rng.choice(sessions, size=(100 if quick else 600), p=weights)
    return spec, chains, reads_a, reads_b


def _node(url: str, keyspace: str, policy: str, hot_bytes: int) -> KVStore:
    from tiers.memory import MemoryTier
    from tiers.redis import RedisTier

    return KVStore([MemoryTier(hot_bytes, name="hot"), RedisTier(url, 1 << 30, keyspace=keyspace)],
                   write_policy=policy, placement=PlacementConfig(min_residency_s=0.0), background=False)


def _measure(url: str, policy: str, quick: bool, seed: int) -> dict:
    spec, chains, reads_a, reads_b = _workload(quick, seed)
    block = spec.block_nbytes
    hot = max(1, len(chains) // 4) * 8 * block + (1 << 20)
    keyspace = f"wp-{policy}-{seed}"
    a, b = _node(url, keyspace, policy, hot), _node(url, keyspace, "write_back", hot)
    try:
        gen = np.random.default_rng(seed + 1)
        kvs = {}
        for i in range(len(chains)):
            kvs[i] = gen.standard_normal(spec.kv_shape(len(chains[i])), dtype=np.float32).astype(np.float16)
        import torch

        for i, tokens in enumerate(chains):
            a.put_kv(spec, tokens, torch.from_numpy(kvs[i]))
            if i % 8 == 7:
                a.run_placement()
        for n, i in enumerate(reads_a):
            a.get_kv(spec, chains[i])
            if n % 50 == 49:
                a.run_placement()
        a.run_placement()
        stats_a = a.stats()
        demoted_into_redis = stats_a.shared["bytes_demoted"]
        requested = hit = 0
        for i in reads_b:
            _, got = b.get_kv(spec, chains[i])
            requested += len(chains[i])
            hit += got
        return {
            "policy": policy,
            "sessions": len(chains),
            "bytes_written_to_redis": stats_a.shared["bytes_written"] + demoted_into_redis,
            "write_through_bytes": stats_a.shared["bytes_written"],
            "demoted_bytes": demoted_into_redis,
            "cross_node_hit_ratio": hit / requested,
            "node_a_top_hit_blocks": stats_a.counters.tokens_hit // spec.block_tokens,
        }
    finally:
        a.close()
        b.close()


def run(*, quick: bool = False, out_dir: str | Path | None = None, seed: int = 0) -> dict:
    """Measure every write policy; print a table; write JSON; return the result."""
    with private_redis() as url:
        rows = [_measure(url, policy, quick, seed) for policy in POLICIES]
    result = header("write-policy", quick=quick, rows=rows)
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    head = f"{'policy':14} {'MiB to redis':>13} {'write-through':>14} {'demoted':>9} {'cross-node hit':>15}"
    lines = ["kvstore bench write-policy  (node A writes and reads; node B reads A's sessions)", head,
             "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['policy']:14} {r['bytes_written_to_redis'] / 2**20:13.1f} "
                     f"{r['write_through_bytes'] / 2**20:14.1f} {r['demoted_bytes'] / 2**20:9.1f} "
                     f"{r['cross_node_hit_ratio']:15.3f}")
    return "\n".join(lines)
