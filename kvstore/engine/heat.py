"""Heat scorers: how hot an entry is, as one number that sorts.

A scorer turns accesses into a ``score`` kept on each entry's ``Heat``. Higher
is hotter. Scores must compare across entries *without* knowing the time, so
placement can sort residents once and reuse the order; each scorer below keeps
that property. ``beats(a, b)`` says whether ``a`` is hotter than ``b`` by the
scorer's margin: the first line of defence against ping-pong.

- ``DecayedRate``: an exponentially decayed access count that saturates.
- ``AdaptiveRate``: two ``DecayedRate`` memories, a short and a long one; it
  sorts by whichever would have served more hits lately (kvstore's default).
- ``LRU``: the last access time; what LMCache and Mooncake approximate.
- ``LFU``: the access count, never decayed.
"""

from __future__ import annotations

import math
import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Iterable

from kvstore.errors import InvalidInput

__all__ = ["Heat", "Scorer", "DecayedRate", "AdaptiveRate", "LRU", "LFU", "scorer_by_name"]


@dataclass(slots=True)
class Heat:
    """Access history of one entry, as its scorer keeps it."""

    score: float = -math.inf
    """Scorer-specific and time-free: sorts entries coldest first at any moment."""
    count: int = 0
    """Accesses seen (puts count as one)."""
    last_s: float = 0.0
    """Clock time of the last access."""
    parts: tuple[float, ...] = ()
    """Per-memory scores, for scorers that keep more than one (``AdaptiveRate``)."""


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

    def calibrate(self, heats: Iterable[Heat], size: int, total: int, now_s: float) -> None:
        """Hook run by placement's planner with every entry's heat (``total`` of them)
        and the number of entries the top tier holds (``size``). Fixed scorers ignore it."""

    def describe(self) -> dict:
        """The scorer's state, for ``stats`` and ``explain``."""
        return {"name": self.name}


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
        heat.score = self.bumped(heat.score, heat.count, now_s)
        heat.count += 1
        heat.last_s = now_s

    def bumped(self, score: float, count: int, now_s: float) -> float:
        """``score`` after one more access at ``now_s`` (``count`` accesses so far)."""
        shift = now_s / self.half_life_s
        current = 2.0 ** (score - shift) if count else 0.0
        return math.log2(min(current + 1.0, self.max_count)) + shift

    def beats(self, a: float, b: float) -> bool:
        return a - b > self._margin_log if self._margin_log else a > b

    def rate(self, heat: Heat, now_s: float) -> float:
        # A steady rate r holds the decayed count at r * half_life / ln 2. Saturated
        # entries read as max_count * ln 2 / half_life (about 0.046/s by default): "at least".
        if not heat.count:
            return 0.0
        return 2.0 ** (heat.score - now_s / self.half_life_s) * math.log(2) / self.half_life_s


class AdaptiveRate(Scorer):
    """Two decayed counts per entry, a short memory and a long one; entries sort by
    whichever has lately been the better predictor of reuse.

    A long memory estimates a steady popularity better: on Zipf traffic the
    entries at the edge of the fast tier get a few reads per minute, and one
    minute of history cannot rank them. A short memory follows a hot set that
    moves. Neither wins both (``bench/placement.py``: half-life 300 s reaches
    0.907x Belady on Zipf 1.0 but gets half LRU's hit ratio when the hot set
    shifts; 60 s keeps up with the shift but reaches 0.894x), so this scorer
    keeps both and lets the traffic choose, the way ARC lets ghost hits size
    its lists.

    The choice is a shadow race. ``calibrate`` (from the planner, at most every
    ``interval_s``) finds, for each memory, the score of the ``size``-th hottest
    entry, from a sample of at most ``sample`` entries: the bar an entry clears
    to be in a fast tier of that size under that memory. Every read of a known
    entry whose memories disagree (one clears its bar, the other not) then
    scores a *shadow hit* for the one that clears it; reads both would serve,
    or neither, say nothing about which is better. Shadow hits decay with
    ``window_s``; the active memory changes only when the other leads by
    ``switch_margin_frac`` and at least ``min_lead`` hits, and the last change
    is ``min_switch_s`` old, so the choice does not flap. A change rewrites
    every entry's ``score`` (O(n), rare); the get path stays O(1): two bumps and
    two comparisons.
    """

    name = "adaptive-rate"

    def __init__(self, short: DecayedRate | None = None, long: DecayedRate | None = None, *,
                 window_s: float = 30.0, switch_margin_frac: float = 0.2, min_lead: float = 20.0,
                 min_switch_s: float = 10.0, interval_s: float = 1.0, sample: int = 4096) -> None:
        self.memories = (short or DecayedRate(60.0, 0.2, 4.0), long or DecayedRate(300.0, 0.2, 16.0))
        if not window_s > 0 or not switch_margin_frac >= 0 or not min_switch_s >= 0 or sample < 16:
            raise InvalidInput(f"need window_s > 0, switch_margin_frac >= 0, min_switch_s >= 0 and sample >= 16, "
                               f"got {window_s}, {switch_margin_frac}, {min_switch_s}, {sample}")
        self.window_s = float(window_s)
        self.switch_margin_frac = float(switch_margin_frac)
        self.min_lead = float(min_lead)
        self.min_switch_s = float(min_switch_s)
        self.interval_s = float(interval_s)
        self.sample = int(sample)
        self.active = 0
        """Index into ``memories`` of the one ``score`` follows."""
        self.bars = [math.inf, math.inf]
        self.shadow_hits = [0.0, 0.0]
        self.switches = 0
        self._fresh = [0, 0]
        self._last_calibrate_s: float | None = None
        self._last_switch_s = -math.inf

    def touch(self, heat: Heat, now_s: float) -> None:
        short, long = self.memories
        count = heat.count
        if count:
            was_short, was_long = heat.parts
            if (was_short >= self.bars[0]) != (was_long >= self.bars[1]):
                self._fresh[was_long >= self.bars[1]] += 1
            parts = (short.bumped(was_short, count, now_s), long.bumped(was_long, count, now_s))
        else:
            parts = (short.bumped(0.0, 0, now_s), long.bumped(0.0, 0, now_s))
        heat.parts = parts
        heat.score = parts[self.active]
        heat.count = count + 1
        heat.last_s = now_s

    def beats(self, a: float, b: float) -> bool:
        return self.memories[self.active].beats(a, b)

    def rate(self, heat: Heat, now_s: float) -> float:
        return self.memories[self.active].rate(heat, now_s)

    def calibrate(self, heats: Iterable[Heat], size: int, total: int, now_s: float) -> None:
        if self._last_calibrate_s is not None and now_s - self._last_calibrate_s < self.interval_s:
            return
        if self._last_calibrate_s is not None:
            keep = 0.5 ** ((now_s - self._last_calibrate_s) / self.window_s)
            self.shadow_hits = [h * keep + f for h, f in zip(self.shadow_hits, self._fresh)]
        self._fresh = [0, 0]
        self._last_calibrate_s = now_s
        other = 1 - self.active
        lead = self.shadow_hits[other] - self.shadow_hits[self.active]
        if (lead > self.shadow_hits[self.active] * self.switch_margin_frac and lead >= self.min_lead
                and now_s - self._last_switch_s >= self.min_switch_s):
            self.active, self._last_switch_s = other, now_s
            self.switches += 1
            for heat in heats:
                if heat.parts:
                    heat.score = heat.parts[other]
        self._set_bars(heats, size, total)

    def _set_bars(self, heats: Iterable[Heat], size: int, total: int) -> None:
        if size <= 0 or total <= 0:
            self.bars = [math.inf, math.inf]
            return
        step = max(1, total // self.sample)
        # A sequence is sliced in C: walking a million heats one by one took 34 ms under
        # placement's lock, which every put and get waits for, once a second; sliced, 26 ms (the
        # copy of a million references is most of that: each one touches its object).
        every = heats[::step] if isinstance(heats, Sequence) else itertools.islice(heats, 0, None, step)
        picked = [h.parts for h in every if h.parts]
        if not picked:
            return
        k = min(len(picked), max(1, round(size * len(picked) / total)))
        self.bars = [heapq.nlargest(k, (p[i] for p in picked))[-1] for i in (0, 1)]

    def describe(self) -> dict:
        return {"name": self.name, "active_half_life_s": self.memories[self.active].half_life_s,
                "half_lives_s": [m.half_life_s for m in self.memories], "shadow_hits": list(self.shadow_hits),
                "switches": self.switches}


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
    """``adaptive-rate``, ``decayed-rate``, ``lru`` or ``lfu``.

    Raises:
        InvalidInput: another name.
    """
    table = {"adaptive-rate": AdaptiveRate, "decayed-rate": DecayedRate, "lru": LRU, "lfu": LFU}
    if name not in table:
        raise InvalidInput(f"heat scorer must be one of {', '.join(table)}, got {name!r}")
    return table[name](**kwargs)
