"""KV events: every change to the block set, numbered, for routers and other subscribers.

Every block stored, moved between tiers, removed (deleted, evicted, dropped) and every
clear of the store is one ``Event`` with a sequence number, in the order the changes
happened to each key: ``EngineCore`` emits each under the key's claim, right after it
changes the index. Subscribers (``server.events``: Server-Sent Events and vLLM's ZMQ
format) read the log; nothing here knows of them.

One ring, many cursors. The log keeps the last ``capacity`` events in one ring; a
subscriber is only a cursor (the last sequence number it has seen) into it, so its queue
is bounded by the ring and costs nothing per event: ``emit`` appends once, whatever the
number of subscribers, and a subscriber that stops reading never slows a put. One that
falls more than ``capacity`` events behind has lost some: ``read`` says so, and it
resynchronises from a snapshot (``EngineCore.events_snapshot``: the block set and the
sequence number it is valid at).

Why the snapshot is exact: ``snapshot_seq`` is read *before* the index is copied, and
every event is emitted after its change. So each change whose event is numbered at or
below the snapshot's sequence number is in the copy, and replaying the events after it
(stored and moved set a key's tier, removed deletes it, cleared empties the set) gives
the index as it is. A change may be both in the copy and replayed; the replay is
idempotent.

Sequence numbers restart at 1 with each process; ``epoch`` (random, per log) tells a
subscriber that resumes with an id from an earlier run that it must resynchronise.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Event", "EventLog", "STORED", "MOVED", "REMOVED", "CLEARED", "KINDS", "DEFAULT_CAPACITY"]

STORED, MOVED, REMOVED, CLEARED = "stored", "moved", "removed", "cleared"
KINDS = (STORED, MOVED, REMOVED, CLEARED)
DEFAULT_CAPACITY = 65_536
"""Events kept: how far a subscriber may fall behind before it must resynchronise (about 20 MiB)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One change to the block set.

    ``tier`` is where the block is after the change (stored, moved) or was (removed);
    ``src`` is where a moved block came from. ``reason`` says why: ``put``, ``frame``,
    ``reserved``, ``adopted``, ``recovered``, ``named`` (stored: an engine named a stored block); a placement move's reason (moved);
    ``deleted``, ``evicted``, ``corrupt``, ``stale``, ``replaced`` (removed); ``closed`` (cleared).
    """

    seq: int
    kind: str
    time_s: float
    key: bytes | None = None
    namespace: str | None = None
    tier: str | None = None
    src: str | None = None
    size: int = 0
    depth: int = 0
    spec_fp: str | None = None
    parent: bytes | None = None
    """The previous block of the chain (stored events of token chains whose parent is known)."""
    tokens: bytes | None = None
    """The block's token ids, little-endian uint32 (stored events of puts, when the log keeps them)."""
    reason: str = ""
    engine_hash: bytes | int | None = None
    """The engine's own name for the block (vLLM's block hash), once an engine named it: on the
    ``named`` stored event and on every later move and removal of the block."""
    engine_parent: bytes | int | None = None
    """The engine's name for the chain's previous block (``named`` events, when known)."""

    def to_dict(self) -> dict:
        """The event as JSON-ready fields (keys and parents in hex; no token ids)."""
        out: dict = {"seq": self.seq, "type": self.kind, "time_s": self.time_s}
        if self.key is not None:
            out.update(key=self.key.hex(), namespace=self.namespace, tier=self.tier, size=self.size,
                       depth=self.depth, spec_fingerprint=self.spec_fp,
                       parent=None if self.parent is None else self.parent.hex())
        if self.engine_hash is not None:
            out["engine_hash"] = _name(self.engine_hash)
            if self.kind == STORED:
                out["engine_parent"] = None if self.engine_parent is None else _name(self.engine_parent)
        if self.src is not None:
            out["from"] = self.src
        if self.reason:
            out["reason"] = self.reason
        return out


def _name(h: bytes | int) -> str | int:
    """An engine's block name as JSON: bytes in hex, an int (vLLM's 64-bit form) as it is."""
    return h.hex() if isinstance(h, bytes) else h


class EventLog:
    """The numbered change log of one store. Thread-safe; ``emit`` is O(1).

    Args:
        capacity: events kept in the ring (at least 16).
        keep_tokens: keep each stored block's token ids (vLLM's format carries them);
            off by default, since nothing but that publisher reads them.
        clock: wall-clock seconds for ``time_s``.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, keep_tokens: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if capacity < 16:
            raise ValueError(f"an event log keeps at least 16 events, got {capacity}")
        self.capacity = capacity
        self.keep_tokens = keep_tokens
        self.epoch = secrets.token_hex(4)
        """Names this log's numbering: a resumed id from another epoch is from an earlier run."""
        self._clock = clock
        self._ring: list[Event | None] = [None] * capacity
        self._seq = 0
        self._cond = threading.Condition(threading.Lock())
        self._hooks: list[Callable[[int], None]] = []

    # -- writing (the engine core) ---------------------------------------------------

    def emit(self, kind: str, **fields) -> Event:
        """Append one event; wakes threads in ``wait`` and calls every hook with its number."""
        with self._cond:
            ev = self._append(kind, self._clock(), fields)
            self._cond.notify_all()
            hooks = self._hooks
        for hook in hooks:  # outside the lock: a hook schedules a wake-up, it never reads here
            hook(ev.seq)
        return ev

    def emit_many(self, kind: str, fields: Sequence[dict]) -> list[Event]:
        """Append one ``kind`` event for each of ``fields``, numbered in order at one instant (a
        put's blocks); wakes waiters and calls every hook once, with the last number (a hook is
        a wake-up: the events before it are in the log when it reads)."""
        if not fields:
            return []
        with self._cond:
            now = self._clock()
            events = [self._append(kind, now, f) for f in fields]
            self._cond.notify_all()
            hooks = self._hooks
        for hook in hooks:
            hook(events[-1].seq)
        return events

    def _append(self, kind: str, now: float, fields: dict) -> Event:
        self._seq += 1  # under the lock
        ev = self._ring[self._seq % self.capacity] = Event(self._seq, kind, now, **fields)
        return ev

    def add_hook(self, hook: Callable[[int], None]) -> Callable[[], None]:
        """Call ``hook(seq)`` after every emit (from the emitting thread: keep it O(1) and never
        raise). Returns the function that removes it."""
        with self._cond:
            self._hooks = [*self._hooks, hook]

        def remove() -> None:
            with self._cond:
                self._hooks = [h for h in self._hooks if h is not hook]
        return remove

    # -- reading (subscribers) ----------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The number of the latest event (0 before the first)."""
        with self._cond:
            return self._seq

    def snapshot_seq(self) -> int:
        """``last_seq``, read before a snapshot of the index is taken (see the module's note)."""
        return self.last_seq

    def oldest_seq(self) -> int:
        """The number of the oldest event still kept."""
        with self._cond:
            return max(1, self._seq - self.capacity + 1)

    def read(self, after: int, limit: int = 1024) -> tuple[list[Event], bool]:
        """Up to ``limit`` events numbered after ``after``, oldest first, and whether any
        after ``after`` are gone from the ring (the reader lost events and must resynchronise;
        the list then starts at the oldest kept).

        Raises:
            ValueError: ``after`` is negative or beyond the latest event.
        """
        with self._cond:
            last = self._seq
            if after < 0 or after > last:
                raise ValueError(f"event {after} is not in this log (its latest is {last})")
            oldest = max(1, last - self.capacity + 1)
            lost = after + 1 < oldest
            start = max(after + 1, oldest)
            end = min(last, start + limit - 1)
            ring, cap = self._ring, self.capacity
            events = [ring[s % cap] for s in range(start, end + 1)]
        return events, lost  # type: ignore[return-value]

    def wait(self, after: int, timeout_s: float) -> bool:
        """Block until an event after ``after`` exists (True) or ``timeout_s`` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq > after, timeout_s)
