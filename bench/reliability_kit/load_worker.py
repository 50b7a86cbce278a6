"""One client process of the concurrent-load scenario: seeded mixed ops, every get checked.

    python -m bench.reliability_kit.load_worker URL WORKER OPS SEED [lossy]

Workers share a pool of sequences: families of sequences share a first prefix,
and any worker may put, get, look up, delete or evict any of them at any time.
KV is a pure function of (spec, token id, position in the layout), so a get is
checked without knowing who put what or when: whatever prefix comes back must
be the expected one, bit for bit (with ``lossy``: within int8's rounding, for
a server whose cold tiers keep int8, their default). Even workers go through shared memory, odd
ones over HTTP. The last line on stdout is a JSON summary.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter, defaultdict

import torch

from kvstore.errors import KVStoreError
from kvstore.spec import KVSpec

SPECS = (
    KVSpec("reliability-a", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16,
           fingerprint="rel-a"),
    KVSpec("reliability-b", num_layers=2, num_kv_heads=4, head_dim=32, dtype="float16", block_tokens=8,
           fingerprint="rel-b"),
)
FAMILIES, PER_FAMILY, PREFIX, NAMESPACE = 6, 6, 64, "reliability"
MIX = (("put", 30), ("get", 45), ("lookup", 15), ("delete", 7), ("evict", 3))


def tokens_of(seq: int) -> list[int]:
    """Sequence ``seq``'s token ids: its family's 64-token prefix, then its own 32-448 tokens."""
    family = seq % FAMILIES
    own = 32 + (seq * 97) % 417
    return [family * 1_000_000 + i for i in range(PREFIX)] + [seq * 1_000_000 + 500_000 + i for i in range(own)]


def expected_kv(which: int, tokens: list[int]) -> torch.Tensor:
    """The KV every worker puts for ``tokens`` under spec ``which``: exact in fp16 (multiples of 1/4 below 256)."""
    spec = SPECS[which]
    tok = torch.tensor(tokens, dtype=torch.int64)
    layer = torch.arange(spec.num_layers).view(-1, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, -1, 1, 1, 1)
    head = torch.arange(spec.num_kv_heads).view(1, 1, -1, 1, 1)
    d = torch.arange(spec.head_dim).view(1, 1, 1, 1, -1)
    v = (tok.view(1, 1, 1, -1, 1) * 13 + layer * 7 + kv * 5 + head * 3 + d + which * 101) % 1024
    return (v.to(torch.float32) / 4).to(torch.float16)


INT8_ERROR = 1.02
"""Largest |error| int8 may add here: values lie in [0, 256), one scale per token or channel of
absmax / 127, so rounding is off by at most 256 / 254. Another block's KV is off by up to 255."""


def matches(got: torch.Tensor, want: torch.Tensor, lossy: bool) -> bool:
    """Bit for bit; with ``lossy`` (int8 cold tiers), within int8's rounding of the expected KV."""
    if not lossy:
        return torch.equal(got, want)
    return bool((got.float() - want.float()).abs().max() <= INT8_ERROR)


def _difference(which: int, seq: int, n: int, got: torch.Tensor, want: torch.Tensor, medium: str | None) -> str:
    """Where a get went wrong: which tokens differ, and which block that is."""
    bad = (got != want).any(dim=(0, 1, 2, 4)).nonzero().flatten().tolist()
    bt = SPECS[which].block_tokens
    return (f"spec {which} seq {seq} via {medium}: {n} tokens back, {len(bad)} differ, blocks "
            f"{sorted({t // bt for t in bad})[:8]}")


def main(url: str, worker: int, ops: int, seed: int, lossy: bool = False) -> dict:
    from client_sdk import KVClient

    torch.set_num_threads(1)
    rng = random.Random(seed * 1000 + worker)
    names, weights = zip(*MIX)
    latencies: dict[str, list[float]] = defaultdict(list)
    errors: Counter[str] = Counter()
    done = mismatches = verified_tokens = 0
    examples: list[str] = []
    arenas_read: set[str] = set()
    arenas_mapped: set[str] = set()
    cached = 0
    with KVClient(url, namespace=NAMESPACE, colocated=worker % 2 == 0, plan=False, timeout_s=60) as client:
        for _ in range(ops):
            op = rng.choices(names, weights)[0]
            which = rng.randrange(len(SPECS))
            spec = SPECS[which]
            seq = rng.randrange(FAMILIES * PER_FAMILY)
            tokens = tokens_of(seq)
            t0 = time.perf_counter()
            try:
                if op == "put":
                    client.put_kv(spec, tokens, expected_kv(which, tokens))
                elif op == "get":
                    kv, n = client.get_kv(spec, tokens)
                    if n and not matches(kv, want := expected_kv(which, tokens[:n]), lossy):
                        mismatches += 1
                        if len(examples) < 5:
                            examples.append(_difference(which, seq, n, kv, want, client.stats.last_medium))
                    verified_tokens += n
                elif op == "lookup":
                    if not 0 <= client.lookup(spec, tokens) <= len(tokens):
                        mismatches += 1
                elif op == "delete":
                    client.delete(spec, tokens)
                else:  # a whole family's shared prefix, and every chain under it
                    client.evict_mine(prefix={"spec": spec.to_dict(), "tokens": tokens[:PREFIX]})
            except KVStoreError as exc:  # typed: counted; anything else fails the worker
                errors[type(exc).__name__] += 1
            latencies[op].append(time.perf_counter() - t0)
            done += 1
            arena = client.colocation.arena
            if arena is not None:
                arenas_mapped.add(str(arena.segment))
                if client.stats.shm_cached_gets > cached:  # a get read this arena with no request
                    arenas_read.add(str(arena.segment))
            cached = client.stats.shm_cached_gets
        medium = client.stats.last_medium
        no_request = client.stats.shm_cached_gets
    return {"worker": worker, "ops": done, "mismatches": mismatches, "examples": examples,
            "verified_tokens": verified_tokens, "gets_with_no_request": no_request,
            "errors": dict(errors), "medium": medium, "arenas_read": sorted(arenas_read),
            "arenas_mapped": sorted(arenas_mapped), "latencies": {k: v for k, v in latencies.items()}}


if __name__ == "__main__":
    url, worker, ops, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(main(url, worker, ops, seed, lossy=sys.argv[5:] == ["lossy"])), flush=True)
