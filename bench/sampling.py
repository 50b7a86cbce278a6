"""Interleaved sampling for side-by-side rows: A B C, then C A B..., shuffled each round; medians and min-max.

A row is one operation on ``nbytes`` that times itself (``() -> seconds``), so
set-up and clean-up around it (fresh token ids before a put, a delete after
it) stay outside the clock. Small operations run several times a sample
(``inner``), so each sample moves about 8 MiB and the clock's noise stays small.
Every timed operation's seconds are kept too (``Row.times``), for latency
percentiles: a sample's mean hides the slow operation a p99 is about.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Row", "interleave", "summary", "timed"]

MiB = 1 << 20
SAMPLE_BYTES = 8 * MiB


@dataclass(slots=True)
class Row:
    """One side of a comparison: ``op`` moves ``nbytes`` and returns the seconds it took."""

    nbytes: int
    op: Callable[[], float]
    times: list[float] = field(default_factory=list)
    """Seconds of each operation ``sample`` timed, in order (not the untimed calls around them)."""

    @property
    def inner(self) -> int:
        return max(1, SAMPLE_BYTES // self.nbytes)

    def sample(self) -> float:
        """Seconds a byte, over ``inner`` operations."""
        total = 0.0
        for _ in range(self.inner):
            took = self.op()
            self.times.append(took)
            total += took
        return total / (self.inner * self.nbytes)


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """``fn`` as a row's op: the seconds one call takes."""
    def once() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return once


def interleave(rows: dict[str, Row], repeats: int, *, warmup: int = 2,
               tick: Callable[[int], None] = lambda r: None) -> dict[str, list[float]]:
    """Seconds a byte for every row, ``repeats`` samples each, taken A B C A B C.

    The order is shuffled every round (seeded, so runs repeat): whatever runs right after
    a put or a big copy runs slower, and a fixed order, or a rotated one, would always
    hand that to the same row. Each sample follows an untimed call of the same row, as
    in a loop over one buffer, so no row starts from caches another row left cold.

    Args:
        warmup: untimed rounds first (connections, leases, page faults, pooled buffers).
        tick: called with the round number after each round (a progress display).
    """
    order = list(rows.items())
    for _ in range(warmup):
        for _, row in order:
            row.op()
    samples: dict[str, list[float]] = {name: [] for name in rows}
    shuffle = random.Random(0).shuffle
    for r in range(repeats):
        shuffle(order)
        for name, row in order:
            row.op()
            samples[name].append(row.sample())
        tick(r)
    return samples


def summary(per_byte: list[float], op_s: list[float] | None = None) -> dict[str, float]:
    """GB/s (1e9 B/s): median and min-max over samples of seconds a byte.

    Args:
        op_s: the seconds of every timed operation (``Row.times``); adds their p50 and p99
            (nearest rank: with fewer than 100 operations, p99 is the slowest), in ms, and
            how many there were (``ops``).
    """
    rates = [1e-9 / s for s in per_byte]
    out = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    if op_s:
        ranked = sorted(op_s)
        out.update(p50_ms=1e3 * statistics.median(ranked), ops=len(ranked),
                   p99_ms=1e3 * ranked[math.ceil(0.99 * len(ranked)) - 1])
    return out
