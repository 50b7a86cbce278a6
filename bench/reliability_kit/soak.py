"""A full-store soak: ``kvstore serve`` kept full for a while, every read checked.

The server runs ``shm`` (64 MiB) over ``nvme`` (256 MiB, the log layout, a group commit): a
client puts fresh 256-token sequences (16 blocks of 32 KiB, 512 KiB a put) as fast as it can
and, after each put, reads back a random earlier one. Within a few seconds both tiers are full:
puts spill or demote into nvme, nvme drops its coldest blocks, and its compactor rewrites the
segments that leaves dead. Figures:

- ``wrong``: reads that returned KV other than what was put for those tokens (must be 0);
- ``p50_ms``/``p99_ms`` of the puts, and the p99 of the first and the last half of the run,
  so a latency that grows with the time full shows;
- ``rss_anon_mib``: the server's anonymous memory sampled every second (the index, buffers:
  the arenas are shared memory and the segments page cache, counted elsewhere);
- the nvme tier's ``disk_bytes``, ``dead_bytes`` and ``compactions`` at the end.

A put of a full store is never refused here: a fresh block always finds room by dropping
the coldest (nvme is the last tier). What the soak does not do: drive the disk at twice its
rate (one Python client writes at a few hundred MB/s through the page cache).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess, small_env

__all__ = ["soak"]

SPEC = SPECS[0]
TOKENS = 256


def _sequence(i: int) -> list[int]:
    return [i * 1_000 + t for t in range(TOKENS)]


def _rss_anon_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def soak(tmp_path: Path, seconds: float, seed: int = 0, min_puts: int = 0) -> dict:
    """Run the soak for ``seconds``, and on until ``min_puts`` puts were made (three times
    ``seconds`` at most: a slower machine still fills the store as often); its figures (see the
    module's docstring)."""
    from client_sdk import KVClient

    torch.set_num_threads(1)
    rng = random.Random(seed)
    env = small_env(tmp_path / "data", KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="64MiB",
                    KVSTORE_NVME_BYTES="256MiB", KVSTORE_NVME_LAYOUT="log", KVSTORE_NVME_SYNC_INTERVAL_S="0.1",
                    KVSTORE_TIER_CODECS="nvme=raw")  # raw below too: any difference is damage, not rounding
    server = ServeProcess(env).start()
    figures: dict = {"puts": 0, "reads": 0, "hits": 0, "wrong": 0, "rss_anon_mib": []}
    puts: list[tuple[float, float]] = []  # (when, seconds)
    try:
        with KVClient(server.url, namespace="soak") as client:
            started = time.monotonic()
            next_sample = started
            i = 0
            while ((now := time.monotonic()) - started < seconds
                   or (i < min_puts and now - started < 3 * seconds)):
                if now >= next_sample:
                    figures["rss_anon_mib"].append(round(_rss_anon_mib(server.proc.pid), 1))
                    next_sample += 1.0
                tokens = _sequence(i)
                t0 = time.perf_counter()
                client.put_kv(SPEC, tokens, expected_kv(0, tokens))
                puts.append((now - started, time.perf_counter() - t0))
                j = rng.randrange(max(0, i - 1_000), i + 1)
                back = _sequence(j)
                kv, n = client.get_kv(SPEC, back)
                figures["reads"] += 1
                if n:
                    figures["hits"] += 1
                    figures["wrong"] += not torch.equal(kv, expected_kv(0, back[:n]))
                i += 1
            figures["puts"] = i
            elapsed = time.monotonic() - started
            nvme = next(t for t in client.admin.tiers() if t["name"] == "nvme")
    finally:
        server.stop()
    times = sorted(s for _, s in puts)
    half = elapsed / 2
    first = sorted(s for w, s in puts if w < half)
    last = sorted(s for w, s in puts if w >= half)
    figures.update(
        seconds=round(elapsed, 1), put_mb_s=len(puts) * TOKENS // SPEC.block_tokens * _block_bytes() / sum(times) / 1e6,
        p50_ms=statistics.median(times) * 1e3, p99_ms=_p99(times) * 1e3,
        p99_first_half_ms=_p99(first) * 1e3, p99_last_half_ms=_p99(last) * 1e3, max_ms=times[-1] * 1e3,
        nvme={k: nvme["details"].get(k) for k in ("disk_bytes", "dead_bytes", "compactions", "segments")},
        nvme_used_mib=nvme["used_bytes"] / (1 << 20),
    )
    return figures


def _block_bytes() -> int:
    return SPEC.num_layers * 2 * SPEC.num_kv_heads * SPEC.block_tokens * SPEC.head_dim * 2


def _p99(sorted_times: list[float]) -> float:
    return sorted_times[min(len(sorted_times) - 1, int(0.99 * len(sorted_times)))] if sorted_times else 0.0
