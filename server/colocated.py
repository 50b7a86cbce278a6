"""What the co-located read routes do on the event loop without a tier's or placement's lock.

``POST /v1/kv/handles`` and ``/v1/blocks/handles`` are answered on the event loop: a thread hop
cost a 16-block handles request a quarter or more of its latency (a median of 0.57-0.73 ms
against 0.41-0.44 ms on a 2-core host). But the shm tier's ``handle`` takes the tier's lock,
which compaction holds while it copies frames, and counting a read (``EngineCore.touch``) takes
placement's lock, which the mover holds while it plans: a loop that waited on either would stall
every request. So the loop takes neither:

- ``SlotHandles`` remembers the handles the tier gave out and checks one on the loop by reading
  its slot's generation word from the arena's table (``ShmReader.generation``): the owner
  changes the word whenever the slot's frame is replaced, moved or freed, so an unchanged word
  means the handle is still that frame's, exactly as a client's own seqlock check reads it. A
  key without a remembered, current handle is asked of the tier, under its lock, off the loop.
- ``ReadTally`` takes the reads the loop served (heat, hit counts, reads by tier) and counts
  them on a thread of its own. ``flush`` waits for those already handed over: ``Service.run``
  calls it before every store call it makes, so a later request (a report, a stats read) sees
  every read counted by the requests answered before it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Any, Sequence

from kvstore.errors import KVStoreError
from kvstore.keys import BlockHash
from kvstore.memory.shm import ShmReader, SlotHandle

__all__ = ["SlotHandles", "ReadTally", "handle_json"]

log = logging.getLogger("kvstore.server")


def handle_json(handle: SlotHandle | None) -> dict[str, int] | None:
    """A slot handle as the handles routes answer it (the segment is said once, beside the blocks)."""
    if handle is None:
        return None
    return {"index": handle.index, "offset": handle.offset, "length": handle.length, "gen": handle.gen}


class SlotHandles:
    """Slot handles of one shm tier: remembered, and checked on the event loop without its lock.

    Args:
        tier: the shm tier (``tiers.shm.ShmTier``: ``handle``, ``segment``, ``path``). One whose
            arena cannot be attached by name is asked every time (off the loop).
    """

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self._reader: ShmReader | None = None
        try:
            self._reader = ShmReader(tier.segment, os.path.dirname(tier.path))
        except (AttributeError, KVStoreError, OSError) as exc:  # a wrapped or odd tier: no loop path
            log.info("kvstore: shm handles are looked up off the loop only (%s)", exc)
        self._known: dict[BlockHash, SlotHandle] = {}
        """Read on the loop with no lock (one dict read is atomic); changed under ``_lock``."""
        self._lock = threading.Lock()
        self._most = max(1024, getattr(tier, "max_entries", 0))
        """Handles remembered at most: one per slot of the arena, then the oldest go."""

    def known(self, keys: Sequence[BlockHash]) -> list[SlotHandle | None]:
        """The remembered handle of each key that is still current; None where the tier must be
        asked. Takes no lock: for the event loop."""
        reader = self._reader
        if reader is None:
            return [None] * len(keys)
        out: list[SlotHandle | None] = []
        for key in keys:
            handle = self._known.get(key)
            out.append(handle if handle is not None and reader.generation(handle.index) == handle.gen else None)
        return out

    def look_up(self, keys: Sequence[BlockHash]) -> list[SlotHandle | None]:
        """Ask the tier (under its lock: off the loop) and remember what it answers."""
        found = [self.tier.handle(key) for key in keys]
        with self._lock:
            for key, handle in zip(keys, found):
                if handle is None:
                    continue
                self._known[key] = handle
            while len(self._known) > self._most:
                del self._known[next(iter(self._known))]
        return found

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


GATHER_S = 0.005
"""How long the tally's thread lets reads gather after the first one before it counts them all in
one go. Each wake-up of the thread costs the loop a turn at the GIL: woken for every request it
made a 16-block handles request ~10% slower than counting on the loop; at 5 ms it is ~10% faster
(one ``touch`` for a dozen requests' reads)."""


class ReadTally:
    """Reads the event loop served, counted (``EngineCore.touch``) on a thread of their own.

    The loop appends to a deque and sets an event: no lock but the event's own, held for a flag
    flip. The thread wakes on the event, lets ``GATHER_S`` of reads gather (``flush`` cuts that
    short), and counts them in one ``touch``.

    Args:
        core: the store's ``EngineCore``.
        clock: the clock an access is stamped with, read when the loop hands it over.
    """

    def __init__(self, core: Any, clock: Any) -> None:
        self._core = core
        self._clock = clock
        self._pending: deque[tuple[list[BlockHash], float]] = deque()
        self._handed = 0
        """Batches handed over; only the loop's thread adds to it."""
        self._counted = 0
        """Batches counted; only the tally's thread adds to it."""
        self._wake = threading.Event()
        """Set by the loop: something is pending."""
        self._hurry = threading.Event()
        """Set by ``flush`` and ``close``: count now, do not gather."""
        self._done = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvstore-read-tally", daemon=True)
        self._thread.start()

    def add(self, keys: list[BlockHash]) -> None:
        """Count one read of each of ``keys``, soon. For the event loop: takes no tier's or
        placement's lock, and wakes the thread only when it is not already awake."""
        if keys:
            self._pending.append((keys, self._clock()))
            self._handed += 1
            if not self._wake.is_set():
                self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch handed over so far is counted; False if ``timeout_s`` passed
        first (the store is stuck: the caller goes on rather than wait on it too). Off the loop."""
        want = self._handed
        if self._counted >= want:
            return True
        self._hurry.set()
        with self._done:
            return self._done.wait_for(lambda: self._counted >= want, timeout_s)

    def _run(self) -> None:
        while not self._closing or self._pending:
            self._wake.wait()
            self._wake.clear()  # before the drain: a read handed over after it wakes us again
            self._hurry.wait(GATHER_S)
            self._hurry.clear()
            items = []
            while self._pending:
                items.append(self._pending.popleft())
            if not items:
                continue
            try:  # stamped with the last read's time: the others were at most GATHER_S before it
                self._core.touch([k for keys, _ in items for k in keys], now=items[-1][1])
            except KVStoreError as exc:  # the store closed under it: nothing left to count into
                log.debug("kvstore: reads not counted: %s", exc)
            except Exception:  # noqa: BLE001 - a bad batch must not stop the counting of later ones
                log.exception("kvstore: counting reads failed")
            with self._done:
                self._counted += len(items)
                self._done.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Count what is handed over, then stop the thread."""
        self._closing = True
        self._hurry.set()
        self._wake.set()
        self._thread.join(timeout_s)
