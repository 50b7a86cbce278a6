"""The residents of one tier in heat order, kept up to date as heats change.

Room making, admission and promotion all ask for a tier's coldest residents. Sorting the tier
for each ask cost O(n) per put into a full top tier (a heap over every resident, and a ``min``
for admission): about 0.5 ms a block at 65k blocks. Scores are time-free (``kvstore.engine.heat``:
they compare across entries without the clock), so one sorted order per tier stays right between
accesses; an access, a write or a move repositions one key in O(log n), and the coldest are read
from the front.

The order is (score, -depth, key): among equally hot blocks the deepest goes first (a chain
without its head is unreachable; one without its tail still serves a prefix), then the key, so
that the order is total and the same on every run. Not thread-safe: the placement manager's
lock guards it, and nothing repositions a key while a walk (``__iter__``) is under way.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from sortedcontainers import SortedList

__all__ = ["HeatOrder"]


class HeatOrder:
    """Keys of one tier sorted coldest first by (score, -depth, key)."""

    __slots__ = ("_items", "_at")

    def __init__(self) -> None:
        self._items = SortedList()
        self._at: dict[bytes, tuple[float, int, bytes]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def put(self, key: bytes, score: float, depth: int) -> None:
        """Add ``key`` or move it to where ``score`` and ``depth`` rank it."""
        new = (score, -depth, key)
        old = self._at.get(key)
        if old == new:
            return
        if old is not None:
            self._items.remove(old)
        self._items.add(new)
        self._at[key] = new

    def discard(self, key: bytes) -> None:
        old = self._at.pop(key, None)
        if old is not None:
            self._items.remove(old)

    def rebuild(self, entries: Iterable[tuple[bytes, float, int]]) -> None:
        """Forget everything and rank ``(key, score, depth)`` afresh: after every score changed
        at once (a scorer switching memories), in O(n log n)."""
        self._at = {key: (score, -depth, key) for key, score, depth in entries}
        self._items = SortedList(self._at.values())

    def __iter__(self) -> Iterator[tuple[float, bytes]]:
        """(score, key), coldest first."""
        for score, _, key in self._items:
            yield score, key

    def position(self, key: bytes) -> tuple | None:
        """Where ``key`` ranks now, for ``walk(after=...)`` (None: not here)."""
        return self._at.get(key)

    def walk(self, after: tuple | None = None) -> Iterator[tuple[float, bytes]]:
        """(score, key), coldest first, from just past the position ``after`` (the start: None).
        A position is a rank, not a key: it holds when its key has moved or gone since."""
        items = self._items if after is None else self._items.irange(after, inclusive=(False, True))
        for score, _, key in items:
            yield score, key
