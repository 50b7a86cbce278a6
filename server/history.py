"""The store's read counters sampled over time, for ``/admin/history`` and the dashboard.

A hit ratio is a ratio of deltas: a lifetime total hides what the store does
now. So the service samples its counters every ``interval_s`` (a timer on the
event loop; a sample takes two short lock holds and asks no tier) into a ring
of ``keep`` samples, and ``points`` turns each pair of neighbours into one
interval's ratios.

Tier ``t``'s hit ratio over an interval is the share of requested tokens that
were served from ``t``: the interval's token hit ratio, split by the tier each
read block was in. The split comes from the store's ``reads_by_tier``, the one
account of reads by tier that ``/admin/stats``, ``/admin/tiers`` and ``/metrics``
report too (co-located reads included); each point also carries those block
reads (``reads``), by tier. Reads whose tokens no get counts (LMCache's chunks over the
``lm://`` listener) are left out of both. The split is by blocks (``IndexEntry`` does not know its
block size in tokens), which is exact when the interval's reads share one
``block_tokens``; the per-tier ratios then add up to the whole hit ratio.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvstore.engine.store import KVStore

__all__ = ["History", "Sample"]

log = logging.getLogger("kvstore.server")


@dataclass(frozen=True, slots=True)
class Sample:
    """The store's read counters at one moment."""

    time_s: float
    """Wall-clock time, for display."""
    mono_s: float
    """Monotonic clock, for the interval's length."""
    get_calls: int
    tokens_requested: int
    tokens_hit: int
    reads_by_tier: dict[str, int]


class History:
    """A ring of ``Sample``s, filled by ``start``'s timer.

    Args:
        store: the store whose counters are sampled.
        interval_s: seconds between samples.
        keep: samples kept (the default 720 at 5 s is an hour).
    """

    def __init__(self, store: KVStore, interval_s: float = 5.0, keep: int = 720) -> None:
        if interval_s <= 0 or keep < 2:
            raise ValueError(f"history: need interval_s > 0 and keep >= 2, got {interval_s}, {keep}")
        self.store, self.interval_s = store, interval_s
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._timer: asyncio.TimerHandle | None = None

    def sample(self) -> Sample:
        """Take one sample now and keep it."""
        s = self._now()
        self._samples.append(s)
        return s

    def _now(self) -> Sample:
        counters, reads = self.store.core.counters(), self.store.core.reads_by_tier()
        return Sample(time.time(), time.monotonic(), counters.get_calls, counters.tokens_requested,
                      counters.tokens_hit, reads)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sample now, then every ``interval_s`` on ``loop`` until ``stop``."""
        self.sample()
        self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.sample()
        except Exception:  # noqa: BLE001 - a failed sample (a closing store) must not end the sampling
            log.exception("history: a sample failed")
        finally:
            self._timer = loop.call_later(self.interval_s, self._tick, loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def points(self, limit: int | None = None) -> list[dict[str, Any]]:
        """One point per interval between samples, the last running to now; oldest first.

        Each point: ``time_s`` (the interval's end), ``seconds``, ``gets``, ``tokens_requested``,
        ``hit_ratio`` (None when nothing was asked for), ``tiers``, each tier's share of the
        requested tokens it served (None likewise), and ``reads``, the block reads each tier
        served in the interval (the deltas of ``reads_by_tier``, the figure ``/admin/stats``,
        ``/admin/tiers`` and ``/metrics`` report as totals).
        """
        samples = [*self._samples, self._now()]
        pairs = list(zip(samples, samples[1:]))
        if limit is not None:
            pairs = pairs[-limit:]
        names = [t.name for t in self.store.tiers]
        return [_point(a, b, names) for a, b in pairs]


def _point(a: Sample, b: Sample, names: list[str]) -> dict[str, Any]:
    requested = b.tokens_requested - a.tokens_requested
    hit = b.tokens_hit - a.tokens_hit
    reads = {t: b.reads_by_tier.get(t, 0) - a.reads_by_tier.get(t, 0) for t in names}
    total_reads = sum(reads.values())
    ratio = min(1.0, hit / requested) if requested > 0 else None
    tiers: dict[str, float | None] = {}
    for t in names:
        if ratio is None:
            tiers[t] = None
        else:
            tiers[t] = ratio * reads[t] / total_reads if total_reads else 0.0
    return {"time_s": b.time_s, "seconds": b.mono_s - a.mono_s, "gets": b.get_calls - a.get_calls,
            "tokens_requested": requested, "hit_ratio": ratio, "tiers": tiers, "reads": reads}
