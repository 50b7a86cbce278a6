"""Writer threads in one process putting into a full store: 4 threads against 1, the same run.

Part of ``kvstore bench steady`` (issue 34's row "4 writer threads / 1 thread, puts per second
into a full store, in-process: >= 1.5x"). An embedded store over the server's default tiers as
the bench runs them: ``shm`` (64 MiB) over ``nvme`` (the log layout under a 0.1 s group commit),
with its background threads (mover, scrubber, re-encoder) on, filled to the top tier's high
watermark first, so that every later put spills one tier down as a full store's do. Each window
runs ``threads`` writers for ``window_s`` seconds, each putting fresh 1 MiB sequences (16 blocks
of 64 KiB) in a loop; 1- and 4-thread windows alternate, and a round's ratio is its 4-thread
puts/s over its 1-thread puts/s; the row is the median of the rounds' ratios. The process keeps
torch at one intra-op thread, as the server does (``KVSTORE_TORCH_THREADS``).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from typing import Any

import torch

from bench.steady_specs import block_spec

__all__ = ["run_writers", "format_writers", "THREADS"]

THREADS = (1, 4)
TOP_BYTES = 64 << 20
TOKENS = 256  # 1 MiB of the 64 KiB-block spec


def _store(path: str):
    from kvstore.engine.store import KVStore
    from tiers.nvme_log import LogTier
    from tiers.shm import ShmTier

    return KVStore([ShmTier(TOP_BYTES), LogTier(path, 16 << 30, sync_interval_s=0.1)])


class _Fresh:
    """Sequences no earlier put stored (a first token of their own), shared by the writers."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self) -> list[int]:
        with self._lock:
            self._next += 1
            return [900_000_000 + self._next] + [7] * (TOKENS - 1)


def _window(store, threads: int, window_s: float, fresh: _Fresh, kv: torch.Tensor) -> float:
    """Puts per second, all writers together, over one window started at one instant."""
    spec = block_spec("64 KiB")
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        start.wait()
        end = time.perf_counter() + window_s
        try:
            while time.perf_counter() < end:
                store.put_kv(spec, fresh(), kv)
                counts[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def run_writers(*, quick: bool = False, rounds: int | None = None, window_s: float | None = None) -> dict[str, Any]:
    """The writers row: puts/s with 1 and 4 threads into a full store, and their ratio."""
    rounds = rounds or (3 if quick else 5)
    window_s = window_s or (1.0 if quick else 3.0)
    spec = block_spec("64 KiB")
    kv = torch.randn(spec.kv_shape(TOKENS)).to(spec.torch_dtype)
    fresh = _Fresh()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    per: dict[int, list[float]] = {n: [] for n in THREADS}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-steady-writers-") as path, _store(path) as store:
        top = store.placement.tiers[0]
        t0 = time.perf_counter()
        while store.placement.usage()[top.name] < 0.9 * top.high_watermark_frac * top.capacity_bytes:
            store.put_kv(spec, fresh(), kv)
        fill_s = time.perf_counter() - t0
        for r in range(rounds):
            got = {}
            for n in (THREADS if r % 2 == 0 else THREADS[::-1]):
                got[n] = _window(store, n, window_s, fresh, kv)
                per[n].append(got[n])
            ratios.append(got[THREADS[1]] / got[THREADS[0]])
        landed = {t: sum(1 for e in store.entries() if e.tier == t) for t in store.core.tier_names}
        recode = store.stats().recode
    torch.set_num_threads(threads_before)
    return {"threads": list(THREADS), "window_s": window_s, "rounds": rounds, "fill_s": round(fill_s, 1),
            "puts_per_s": {str(n): round(statistics.median(v), 1) for n, v in per.items()},
            "ratio": round(statistics.median(ratios), 2), "ratios": [round(x, 2) for x in ratios],
            "blocks_by_tier": landed, "recode": recode}


def format_writers(w: dict[str, Any]) -> list[str]:
    one, many = (str(n) for n in w["threads"])
    return [f"writer threads in process, full store (1 MiB puts, 64 KiB blocks): {w['puts_per_s'][many]:.0f} puts/s "
            f"with {many} vs {w['puts_per_s'][one]:.0f} with {one}: {w['ratio']:.2f}x (median of rounds "
            f"{w['ratios']}; target >= 1.5x); blocks by tier {w['blocks_by_tier']}"]
