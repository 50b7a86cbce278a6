"""Heat scorers: how hot an entry is, as one number that sorts.

A scorer turns accesses into a ``score`` kept on each entry's ``Heat``. Higher
is hotter. Scores must compare across entries *without* knowing the time, so
placement can sort residents once and reuse the order; each scorer below keeps
that property. ``beats(a, b)`` says whether ``a`` is hotter than ``b`` by the
scorer's margin: the first line of defence against ping-pong.

- ``DecayedRate``: an exponentially decayed access count that saturates (kvstore's default).
- ``LRU``: the last access time; what LMCache and Mooncake approximate.
- ``LFU``: the access count, never decayed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvstore.errors import InvalidInput

__all__ = ["Heat", "Scorer", "DecayedRate", "LRU", "LFU", "scorer_by_name"]


@dataclass(slots=True)
class Heat:
    """Access history of one entry, as its scorer keeps it."""

    score: float = -math.inf
    """Scorer-specific and time-free: sorts entries coldest first at any moment."""
    count: int = 0
    """Accesses seen (puts count as one)."""
    last_s: float = 0.0
    """Clock time of the last access."""


class Scorer(ABC):
    """A heat strategy: one update rule and one comparison."""

    name: str

    @abstractmethod
    def touch(self, heat: Heat, now_s: float) -> None:
        """Record one access at ``now_s``."""

    @abstractmethod
    def beats(self, a: float, b: float) -> bool:
        """Whether score ``a`` is hotter than score ``b`` by this scorer's margin."""

    def rate(self, heat: Heat, now_s: float) -> float:
        """Accesses per second, for people reading ``explain``."""
        age = max(now_s - heat.last_s, 1e-9)
        return heat.count / age if heat.count else 0.0


class DecayedRate(Scorer):
    """An access count that halves every ``half_life_s`` seconds, saturating at ``max_count``.

    Stored as ``log2(count at t) + t / half_life_s``: decay shifts every entry's
    log by the same amount, so this number does not change as time passes and
    entries sort without recomputing anything. ``beats`` asks for
    ``margin_frac`` more decayed accesses (20% by default).

    The count saturates (4 by default) because a very hot entry would otherwise
    take several half-lives to cool once its traffic moves on, and the new hot
    set waits that long for the fast tier. Entries at the cap still sort, by
    their last access: frequent enough, then most recent first. TinyLFU's
    counters saturate (at 15) for the same reason.
    """

    name = "decayed-rate"

    def __init__(self, half_life_s: float = 60.0, margin_frac: float = 0.2, max_count: float = 4.0) -> None:
        if not half_life_s > 0 or not margin_frac >= 0 or not max_count >= 1:
            raise InvalidInput(f"need half_life_s > 0, margin_frac >= 0 and max_count >= 1, "
                               f"got {half_life_s}, {margin_frac}, {max_count}")
        self.half_life_s = float(half_life_s)
        self.margin_frac = float(margin_frac)
        self.max_count = float(max_count)
        self._margin_log = math.log2(1.0 + margin_frac)

    def touch(self, heat: Heat, now_s: float) -> None:
        shift = now_s / self.half_life_s
        current = 2.0 ** (heat.score - shift) if heat.count else 0.0
        heat.score = math.log2(min(current + 1.0, self.max_count)) + shift
        heat.count += 1
        heat.last_s = now_s

    def beats(self, a: float, b: float) -> bool:
        return a - b > self._margin_log if self._margin_log else a > b

    def rate(self, heat: Heat, now_s: float) -> float:
        # A steady rate r holds the decayed count at r * half_life / ln 2. Saturated
        # entries read as max_count * ln 2 / half_life (about 0.046/s by default): "at least".
        if not heat.count:
            return 0.0
        return 2.0 ** (heat.score - now_s / self.half_life_s) * math.log(2) / self.half_life_s


class LRU(Scorer):
    """Least recently used: the score is the last access time."""

    name = "lru"

    def touch(self, heat: Heat, now_s: float) -> None:
        heat.score = now_s
        heat.count += 1
        heat.last_s = now_s

    def beats(self, a: float, b: float) -> bool:
        return a > b


class LFU(Scorer):
    """Least frequently used: the score is the access count, never decayed.

    Ties break towards the more recent entry (a tiny time term), so a cold
    start does not freeze whichever entries came first.
    """

    name = "lfu"

    def __init__(self, margin_frac: float = 0.0) -> None:
        self.margin_frac = float(margin_frac)

    def touch(self, heat: Heat, now_s: float) -> None:
        heat.count += 1
        heat.last_s = now_s
        heat.score = heat.count + 1e-12 * now_s

    def beats(self, a: float, b: float) -> bool:
        return a > b * (1.0 + self.margin_frac) if self.margin_frac else a > b


def scorer_by_name(name: str, **kwargs: float) -> Scorer:
    """``decayed-rate``, ``lru`` or ``lfu``.

    Raises:
        InvalidInput: another name.
    """
    table = {"decayed-rate": DecayedRate, "lru": LRU, "lfu": LFU}
    if name not in table:
        raise InvalidInput(f"heat scorer must be one of {', '.join(table)}, got {name!r}")
    return table[name](**kwargs)
