"""Python's garbage collector in ``kvstore serve``: long-lived objects frozen out of its walks.

A full collection (generation 2) walks every tracked object in the process. A server holds two
per stored block (its index entry and placement's record), so at a million blocks a full
collection took 1.18 s, and every thread waited: the GIL is held throughout. It comes once the
objects that survived younger collections pass a quarter of the older ones, so a store that grows
or churns meets it again and again. Even an empty server walks some 240k objects of its imports
(torch among them), about 0.1 s a time.

``gc.freeze()`` moves every object alive at that moment out of the collector's walks for good.
The server freezes once after start (its imports and its recovered index) and again after a full
collection that took longer than ``freeze_after_s``: what survived it is long-lived, and the next
full collections walk only what was made since. Frozen objects that become garbage are still
freed, by their reference counts, as the index's are (no cycles); only a cycle among frozen
objects stays, and freezes are rare (each one takes a slow collection, and the next slow one needs
another quarter's growth), so what can stay is the few cycles in flight at each freeze.

A process-wide policy: only the server's own process (``server.serve``) installs it; an embedded
store never touches its host's collector.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Callable

__all__ = ["Collector"]

log = logging.getLogger("kvstore.server.collector")


class Collector:
    """Freezes long-lived objects at start and after each slow full collection.

    Args:
        freeze_after_s: a full collection that took longer is followed by a freeze; 0 turns the
            whole policy off (nothing frozen, not even at start).
        clock: seconds, for timing collections.
    """

    def __init__(self, freeze_after_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.freeze_after_s = freeze_after_s
        self.freezes = 0
        self.last_full_s: float | None = None
        """How long the latest full collection took."""
        self._clock = clock
        self._started: float | None = None

    def install(self) -> Callable[[], None]:
        """Freeze what start made, and watch full collections; returns the uninstall."""
        if not self.freeze_after_s:
            return lambda: None
        gc.collect()
        self._freeze("at start")
        gc.callbacks.append(self._on_collect)
        return self.uninstall

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        self.last_full_s, self._started = self._clock() - self._started, None
        if self.last_full_s > self.freeze_after_s:
            # Safe here: the "stop" callback runs after the collection has put its lists back.
            self._freeze(f"after a full collection of {self.last_full_s:.2f} s")

    def _freeze(self, why: str) -> None:
        gc.freeze()
        self.freezes += 1
        log.info("kvstore: froze %d long-lived objects out of the collector's walks (%s)", gc.get_freeze_count(), why)
