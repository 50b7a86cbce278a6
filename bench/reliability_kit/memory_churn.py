"""Put/delete churn through an ``EmbeddedStore``, reporting its resident set and arena fragmentation.

    python -m bench.reliability_kit.memory_churn CYCLES DATA_DIR

Each cycle puts one sequence of 1-4 blocks of one of three block sizes (8 KiB,
64 KiB, 256 KiB) and, once 64 are live, deletes a random live one, so the
arena is churned in mixed sizes. The process prints one JSON line: the resident
set (VmRSS) after each tenth of the cycles, and the shm arena's fragmentation
(1 - largest free range / free bytes) at the end.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from kvstore import EmbeddedStore, KVSpec
from kvstore.config import Settings

SPECS = tuple(KVSpec(f"churn-{n}", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=n,
                     fingerprint=f"churn-{n}") for n in (8, 64, 256))  # 8, 64 and 256 KiB blocks
LIVE = 64


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main(cycles: int, data_dir: str) -> dict:
    torch.set_num_threads(1)
    rng = random.Random(0)
    kvs = [torch.randn(s.kv_shape(4 * s.block_tokens)).half() for s in SPECS]
    store = EmbeddedStore(settings=Settings(tiers="shm", shm_bytes=64 << 20, data_dir=data_dir))
    live: list[tuple[int, list[int]]] = []
    samples = []
    try:
        for cycle in range(cycles):
            which = rng.randrange(len(SPECS))
            spec = SPECS[which]
            tokens = [cycle * 1024 + i for i in range(rng.randint(1, 4) * spec.block_tokens)]
            stored = store.put_kv(spec, tokens, kvs[which][:, :, :, :len(tokens)])
            if stored != len(tokens):
                raise AssertionError(f"cycle {cycle}: stored {stored} of {len(tokens)} tokens")
            live.append((which, tokens))
            if len(live) > LIVE:
                which, tokens = live.pop(rng.randrange(len(live)))
                if store.delete(SPECS[which], tokens, "default") < 1:
                    raise AssertionError(f"cycle {cycle}: a live sequence was not there to delete")
            if (cycle + 1) % max(1, cycles // 10) == 0:
                samples.append(rss())
        details = next(t for t in store.stats().tiers if t.name == "shm").details
        free, largest = int(details["arena_free_bytes"]), int(details["largest_free_bytes"])
        return {"cycles": cycles, "rss": samples, "fragmentation": 1 - largest / free if free else 0.0,
                "compactions": int(details["compactions"]), "live_entries": len(live)}
    finally:
        store.close()


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])), flush=True)
