"""The pool slots a co-located client holds for its pooled puts (``kvstore.engine.pools``)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Sequence

__all__ = ["SlotPool"]


class SlotPool:
    """Top-tier slots the server lent this process for pooled puts (``kvstore.engine.reserved``),
    by slot size: a put takes what it writes into, the answer gives back what it did not use and
    the server's new grant.

    The server reclaims a pool that sees no put for ``ttl_s``, and may reuse its slots for other
    blocks then: a write after that would damage them. So a pool is used only within half its
    ``ttl_s`` of the last request that refreshed it (timed from when that request was *sent*,
    before the server refreshed it); after that, its slots are forgotten here and new ones asked for.
    """

    def __init__(self) -> None:
        self.name = secrets.token_hex(8)
        """The server keys a pool by tenant, process and this: each client of a process has its own."""
        self.used = False
        """Whether the server was ever asked for slots (then closing gives them back)."""
        self._free: dict[int, list[dict]] = {}
        self._fresh_until = 0.0
        self._lock = threading.Lock()

    def take(self, size: int, n: int) -> list[dict] | None:
        """``n`` slots of ``size`` bytes, now this caller's alone; None when fewer are free or the
        pool is too old to write into."""
        with self._lock:
            if time.monotonic() >= self._fresh_until:
                self._free.clear()
                return None
            free = self._free.get(size, [])
            if len(free) < n:
                return None
            got, self._free[size] = free[:n], free[n:]
            return got

    def add(self, size: int, slots: Sequence[dict], sent_s: float, ttl_s: float) -> None:
        """Slots the server says this process holds (again), refreshed by a request sent at ``sent_s``."""
        with self._lock:
            self.used = True
            self._fresh_until = sent_s + ttl_s / 2
            self._free.setdefault(size, []).extend(s for s in slots if s["length"] == size)

    def take_others(self, size: int) -> list[dict]:
        """Every free slot of a size other than ``size``, now this caller's alone: to give back to the
        server, whose cap on a pool's bytes counts every size (a writer that moved to another
        spec is lent nothing while it holds the old spec's slots)."""
        with self._lock:
            got = [s for other, free in self._free.items() if other != size for s in free]
            for other in [o for o in self._free if o != size]:
                del self._free[other]
            return got

    def untake(self, size: int, slots: Sequence[dict]) -> None:
        """Slots a put took but did not use (it failed first): free again, the pool's age unchanged."""
        with self._lock:
            self._free.setdefault(size, []).extend(slots)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())
