"""Puts into a full top tier that holds many blocks against one that holds few, the same run.

Part of ``kvstore bench steady``: an in-process store over two memory tiers whose top tier holds
``N`` small blocks (16-token blocks of a one-layer toy model, under 1 KiB a frame) and is filled
to its capacity first; each sample is one put of 16 fresh blocks, which must make room (16 of the
coldest go one tier down, on the put's path) and be placed. Stores of 10k and 1M blocks
(``--quick``: 2k and 20k) are timed interleaved; the row is the median put time at each size and
their ratio (issue 34's target: <= 1.2x). What it isolates is what grows with the tier: choosing
the coldest, admission, the index.

The background mover is off (``background=False``) so that every sample's room is made on its
own path, the worst case; the lower tier is large enough never to fill.

A second row, on the same two stores with a placement round every ``interval_s`` (as a server's
mover runs them, on the store being sampled only): put and get p50 and p99, each sample a put of
16 fresh blocks and a get of an earlier one, the sizes taking turns in blocks (issue 34's target:
p99 at 1M <= 2x p99 at 10k).

A third row isolates the arena tiers' allocator (``kvstore.memory.slab``), which memory tiers do
not use: an arena of ``N`` frames of a 64 KiB block, full, then a tenth freed at random (a full
arena at its low watermark after demotions of scattered cold blocks leaves that many holes); each
sample frees a random frame and allocates one (a put's slot), and allocates one from the top (a
pool slot). The row is the median time of an allocation at each size and their ratio.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

__all__ = ["run_scale", "run_arena_scale", "SCALES", "QUICK_SCALES"]

SCALES = (10_000, 1_000_000)
QUICK_SCALES = (2_000, 20_000)
PUT_BLOCKS = 16
FILL_BLOCKS = 4096
"""Blocks per put while filling (untimed)."""


def _spec():
    from kvstore.spec import KVSpec

    return KVSpec("bench-scale", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16,
                  fingerprint="bench-scale")


def _store(blocks: int):
    from kvstore.engine.placement import PlacementConfig
    from kvstore.engine.store import KVStore
    from tiers.memory import MemoryTier

    spec = _spec()
    kv = torch.zeros(spec.kv_shape(spec.block_tokens), dtype=spec.torch_dtype)
    probe = KVStore([MemoryTier(1 << 20, name="probe")], background=False)
    probe.put_kv(spec, list(range(spec.block_tokens)), kv)
    frame = probe.core.tiers[0].stats().used_bytes
    probe.close()
    top = MemoryTier(frame * blocks, name="top")
    low = MemoryTier(frame * (blocks + 64 * PUT_BLOCKS * 64), name="low")
    # The high watermark at the capacity: filled to it, every later put must make room on its path
    # (below it, new blocks would be written one tier down: admission).
    policies = {"top": {"high_watermark_frac": 1.0, "low_watermark_frac": 0.95}}
    # Admission off: a new block could otherwise start one tier down (not hotter than the coldest
    # resident yet), and the put would make no room at all.
    return KVStore([top, low], background=False, tier_policies=policies,
                   placement=PlacementConfig(admission=False)), frame


def _fill(store: Any, frame: int) -> int:
    """Fresh chains until the top tier is full (one more put must make room); the next free token."""
    spec = _spec()
    top = store.core.tiers[0]
    next_token = 0
    while True:
        room = (top.capacity_bytes - top.stats().used_bytes) // frame
        n = min(FILL_BLOCKS, room)
        # Deeper blocks' frames are a little larger than ``frame``: the first put that had to
        # make room says the tier is full.
        if n < PUT_BLOCKS or store.placement.counters()["demoted"]:
            return next_token
        kv = torch.zeros(spec.kv_shape(n * spec.block_tokens), dtype=spec.torch_dtype)
        store.put_kv(spec, [next_token] + [0] * (n * spec.block_tokens - 1), kv)  # a chain of its own
        next_token += 1


def run_scale(*, quick: bool = False, repeats: int = 21) -> dict[str, Any]:
    """The scale rows: median put time into a full top tier at each size, and the ratio."""
    sizes = QUICK_SCALES if quick else SCALES
    spec = _spec()
    kv = torch.zeros(spec.kv_shape(PUT_BLOCKS * spec.block_tokens), dtype=spec.torch_dtype)
    stores, cursors, times, filled = {}, {}, {n: [] for n in sizes}, {}
    try:
        for n in sizes:
            store, frame = _store(n)
            t0 = time.perf_counter()
            cursors[n] = _fill(store, frame) + 10**9
            filled[n] = {"blocks": store.core.tiers[0].stats().used_bytes // frame,
                         "fill_s": round(time.perf_counter() - t0, 1)}
            stores[n] = store
        gc.collect()
        for r in range(repeats):
            for n in (sizes if r % 2 == 0 else sizes[::-1]):
                tokens = list(range(cursors[n], cursors[n] + PUT_BLOCKS * spec.block_tokens))
                cursors[n] += len(tokens)
                t0 = time.perf_counter()
                stores[n].put_kv(spec, tokens, kv)
                times[n].append(time.perf_counter() - t0)
        where = {n: stores[n].placement.counters() for n in sizes}
        latency = _latencies(stores, cursors, sizes, kv, LATENCY_SAMPLES[quick])
    finally:
        for store in stores.values():
            store.close()
    small, large = sizes
    med = {n: statistics.median(times[n]) for n in sizes}
    return {"sizes": list(sizes), "put_blocks": PUT_BLOCKS, "median_ms": {str(n): round(1e3 * med[n], 3) for n in sizes},
            "ratio": round(med[large] / med[small], 2), "filled": {str(n): filled[n] for n in sizes},
            "moves": {str(n): where[n] for n in sizes}, "latency": latency}


LATENCY_SAMPLES = {False: 1500, True: 200}
"""Samples of the latency row at each size (``quick``: True)."""


def _latencies(stores: dict, cursors: dict, sizes: tuple, kv: torch.Tensor, samples: int) -> dict[str, Any]:
    """Put and get p50 / p99 at each size with placement running, as a server's mover runs it.

    A thread runs a placement round every ``interval_s`` on the store being sampled (what its
    background mover does; the stores were built without one so that the row above makes its room
    on the put's path), and only on it: one process holds both stores, and a round of the large one
    would otherwise stall the small one's samples for the GIL. The sizes take turns in blocks of
    ``samples // 6``; each sample, a put of 16 fresh blocks, then a get of one of the sequences put
    before it (random), both timed.
    """
    import random
    import threading

    spec, rng = _spec(), random.Random(34)
    puts: dict[int, list[float]] = {n: [] for n in sizes}
    gets: dict[int, list[float]] = {n: [] for n in sizes}
    put_seqs: dict[int, list[list[int]]] = {n: [] for n in sizes}
    block = max(1, samples // 6)
    rounds_run = {n: 0 for n in sizes}
    failed: list[BaseException] = []
    for turn in range(2 * (samples // block)):
        n = sizes[turn % 2] if turn % 4 < 2 else sizes[1 - turn % 2]
        store, stop = stores[n], threading.Event()

        def rounds(store=store, stop=stop, n=n) -> None:
            try:
                while True:  # a round at once: a quick run's turn is shorter than the interval
                    store.run_placement(bounded=True)
                    rounds_run[n] += 1
                    if stop.wait(store.placement.config.interval_s):
                        return
            except BaseException as exc:  # noqa: BLE001 - re-raised in the sampling thread below
                failed.append(exc)
        mover = threading.Thread(target=rounds, name="bench-scale-placement", daemon=True)
        mover.start()
        try:
            for _ in range(block):
                tokens = list(range(cursors[n], cursors[n] + PUT_BLOCKS * spec.block_tokens))
                cursors[n] += len(tokens)
                t0 = time.perf_counter()
                store.put_kv(spec, tokens, kv)
                puts[n].append(time.perf_counter() - t0)
                put_seqs[n].append(tokens)
                again = rng.choice(put_seqs[n])
                t0 = time.perf_counter()
                store.get_kv(spec, again)
                gets[n].append(time.perf_counter() - t0)
        finally:
            stop.set()
            mover.join()
        if failed:
            raise failed[0]

    def pct(ts: list[float], q: float) -> float:
        return round(1e3 * sorted(ts)[min(len(ts) - 1, int(q * len(ts)))], 3)
    small, large = sizes
    out: dict[str, Any] = {"samples": samples, "placement_rounds": {str(n): rounds_run[n] for n in sizes}}
    for op, ts in (("put", puts), ("get", gets)):
        out[op] = {str(n): {"p50_ms": pct(ts[n], 0.5), "p99_ms": pct(ts[n], 0.99)} for n in sizes}
        out[op]["p99_ratio"] = round(out[op][str(large)]["p99_ms"] / out[op][str(small)]["p99_ms"], 2)
    return out


ARENA_FRAME = (64 << 10) + 512
"""A 64 KiB block's frame (header and metadata included), as the arena allocates it."""


def run_arena_scale(*, quick: bool = False, samples: int = 2000) -> dict[str, Any]:
    """The allocator row: median ``alloc`` and ``alloc_high`` time in a full, churned arena at each size."""
    import random

    from kvstore.memory.slab import SlabAllocator

    sizes = QUICK_SCALES if quick else SCALES
    times: dict[int, dict[str, list[float]]] = {n: {"alloc": [], "alloc_high": []} for n in sizes}
    arenas, live, holes = {}, {}, {}
    rng = random.Random(34)
    for n in sizes:
        arena = SlabAllocator(n * ARENA_FRAME)
        frames = [arena.alloc(ARENA_FRAME) for _ in range(n)]
        rng.shuffle(frames)
        for off in frames[:n // 10]:
            arena.free(off)
        arenas[n], live[n] = arena, frames[n // 10:]
        holes[n] = arena.free_ranges()
    for r in range(samples):
        for n in (sizes if r % 2 == 0 else sizes[::-1]):
            for how in ("alloc", "alloc_high"):
                i = rng.randrange(len(live[n]))
                arenas[n].free(live[n][i])
                take = getattr(arenas[n], how)
                t0 = time.perf_counter()
                live[n][i] = take(ARENA_FRAME)
                times[n][how].append(time.perf_counter() - t0)
    med = {n: {how: statistics.median(ts) for how, ts in times[n].items()} for n in sizes}
    small, large = sizes
    return {"sizes": list(sizes), "free_ranges": {str(n): holes[n] for n in sizes},
            "median_us": {str(n): {how: round(1e6 * t, 2) for how, t in med[n].items()} for n in sizes},
            "ratio": {how: round(med[large][how] / med[small][how], 2) for how in ("alloc", "alloc_high")}}


def format_scale(scale: dict[str, Any], arena: dict[str, Any] | None = None) -> list[str]:
    small, large = scale["sizes"]
    ms = scale["median_ms"]
    lines = [f"full top tier of {large:,} blocks vs {small:,}: a {scale['put_blocks']}-block put (room made on its path) "
             f"{ms[str(large)]:.2f} vs {ms[str(small)]:.2f} ms median, {scale['ratio']:.2f}x (target <= 1.2x)"]
    lat = scale.get("latency")
    if lat is not None:
        lines.append("  with placement rounds running: " + "; ".join(
            f"{op} p50 {lat[op][str(large)]['p50_ms']:.2f} vs {lat[op][str(small)]['p50_ms']:.2f} ms, p99 "
            f"{lat[op][str(large)]['p99_ms']:.2f} vs {lat[op][str(small)]['p99_ms']:.2f} ms, {lat[op]['p99_ratio']:.2f}x"
            for op in ("put", "get")) + " (p99 target <= 2x)")
    if arena is not None:
        small, large = arena["sizes"]
        us, holes = arena["median_us"], arena["free_ranges"]
        lines.append(f"full arena of {large:,} frames vs {small:,} ({holes[str(large)]:,} vs {holes[str(small)]:,} free "
                     f"ranges): alloc {us[str(large)]['alloc']:.1f} vs {us[str(small)]['alloc']:.1f} us, "
                     f"{arena['ratio']['alloc']:.2f}x; from the top (pool slots) {us[str(large)]['alloc_high']:.1f} vs "
                     f"{us[str(small)]['alloc_high']:.1f} us, {arena['ratio']['alloc_high']:.2f}x")
    return lines
