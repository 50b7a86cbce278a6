"""An idle store shrinks: the tiers hand back the memory their free space holds.

A THP cxl arena takes its pages at their first write (``tiers/cxl.py``) and, until now, kept
them: a default server that once spilled 1 GiB into cxl and then deleted everything held
1.2 GiB of anonymous memory idle, four times issue 34's target (<= 300 MiB). ``Trimmer`` is a
thread that, once no put has started for ``idle_s`` (``EngineCore.last_put_s``), asks every tier
to ``release_free`` (``kvstore.tier.Tier``): an arena drops the whole huge pages of its free
ranges, under its lock, so nothing is allocated there meanwhile. It trims once per quiet spell,
and again only after a put, or after ``RETRIM_S`` of quiet (deletes, evictions and the drain free
space without a put). The price is paid by the first writes after the spell: a fresh page's
fault (2 MiB puts into a fresh THP arena took 0.68 ms each against 0.26 ms into pages held;
docs/benchmarks.md, "Idle memory"). Puts never wait for it: it runs only in a quiet spell, and
each tier holds its lock for one pass over its free ranges (a 1 GiB THP arena, all of it free
and resident, released in 2.8 ms; nothing left to release, 0.1 ms).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvstore.engine.core import EngineCore

__all__ = ["Trimmer", "IDLE_S", "RETRIM_S"]

log = logging.getLogger("kvstore.engine.trim")

IDLE_S = 10.0
"""No put for this long: the store is idle, and trims."""
RETRIM_S = 60.0
"""Quiet this long since the last trim: trim again (space freed by deletes and moves since)."""


class Trimmer:
    """Trims the tiers of an idle store in a thread (``start``/``close``); ``trim`` runs one pass now."""

    def __init__(self, core: EngineCore, *, idle_s: float = IDLE_S, retrim_s: float = RETRIM_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._core = core
        self.idle_s = idle_s
        self.retrim_s = retrim_s
        self._clock = clock
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._trimmed_at: float | None = None  # the clock at the last trim
        self.trims = 0
        self.released_bytes = 0
        """What the last trim handed back, over every tier."""

    def start(self) -> None:
        """Start the thread (once; a no-op after ``close`` or with ``idle_s`` 0: trimming off)."""
        with self._cond:
            if self._closed or self._thread is not None or not self.idle_s:
                return
            self._thread = threading.Thread(target=self._run, name="kvstore-trim", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (before the tiers close: a trim reads their free ranges)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def trim(self) -> int:
        """Ask every tier to hand back its free space's memory now; bytes released."""
        released = 0
        for tier in self._core.tiers:
            try:
                released += tier.release_free()
            except Exception:  # noqa: BLE001 - memory not handed back is only memory; the next trim tries
                log.exception("kvstore: tier %s failed to release its free memory", tier.name)
        self._trimmed_at = self._clock()
        self.trims += 1
        self.released_bytes = released
        return released

    def _due_in(self) -> float:
        """Seconds until a trim is due (0: now)."""
        now, last_put = self._clock(), self._core.last_put_s
        quiet_at = last_put + self.idle_s  # the quiet spell starts counting at the last put
        if self._trimmed_at is not None and self._trimmed_at >= quiet_at:  # trimmed in this spell
            quiet_at = self._trimmed_at + self.retrim_s
        return max(0.0, quiet_at - now)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            wait = self._due_in()
            if wait <= 0:
                self.trim()
                continue
            with self._cond:  # a put meanwhile moves the next trim later: looked at again within idle_s
                self._cond.wait_for(lambda: self._closed, min(wait, self.idle_s))
