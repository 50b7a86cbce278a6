"""What placement's parts share: the tier policies and knobs they read, the record they keep per
entry (``Resident``), the orders they give and the moves they log; the scorer a config names by
default (``default_scorer``) and the records' heats as the scorer calibrates over them (``Heats``).

They live apart from ``kvstore.engine.placement`` so that ``room`` and ``retention``, which it
imports, can name them without importing it back; callers import them from ``placement``, which
re-exports all but ``Resident`` (placement's own bookkeeping).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.config import HIGH_WATERMARK_FRAC, LOW_WATERMARK_FRAC
from kvstore.errors import InvalidInput
from kvstore.engine.heat import AdaptiveRate, DecayedRate, Heat, Scorer

__all__ = ["TierPolicy", "PlacementConfig", "MoveOrder", "MoveRecord", "Resident", "Heats", "default_scorer",
           "describe"]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How placement treats one tier."""

    name: str
    capacity_bytes: int
    high_watermark_frac: float = HIGH_WATERMARK_FRAC
    """Above this share of capacity, the coldest entries go down."""
    low_watermark_frac: float = LOW_WATERMARK_FRAC
    """... until the tier is back under this share."""
    cold: bool = False
    """Frames demoted into a cold tier are re-encoded int8 (nvme and redis by default)."""

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark_frac <= self.high_watermark_frac <= 1:
            raise InvalidInput(f"tier {self.name!r}: need 0 < low_watermark_frac <= high_watermark_frac <= 1, "
                               f"got {self.low_watermark_frac}, {self.high_watermark_frac}")
        if self.capacity_bytes <= 0:
            raise InvalidInput(f"tier {self.name!r}: capacity_bytes must be positive")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """Placement knobs, with units in their names."""

    half_life_s: float = 60.0
    """Heat's short memory halves after this long without access."""
    heat_max_count: float = 4.0
    """Decayed accesses at which the short memory saturates, so a cooled-off hot set yields soon."""
    long_half_life_s: float | None = 300.0
    """Heat's long memory (``AdaptiveRate``); None keeps only the short one (``DecayedRate``)."""
    long_max_count: float = 16.0
    """Decayed accesses at which the long memory saturates."""
    admission: bool = True
    """New blocks enter the top tier while it has room under its high watermark, else one tier down
    (``place_new``); False: always the top tier, room made there on the put's path."""
    full_top: str = "spill"
    """What a put does when the top tier is past its high watermark: ``spill``: the block is written
    one tier down (admission as above; nothing dropped, no demotion on the put's path: while puts
    leave the top tier above its low watermark the mover sends its coldest down to it, and later
    puts land in that room); ``evict``: the block enters the top tier and the coldest residents
    there are dropped to make room (no lower-tier write on the put's path)."""
    margin_frac: float = 0.2
    """A promotion needs this much more heat than the resident it displaces."""
    min_residency_s: float = 5.0
    """An entry stays this long in a tier before placement moves it again."""
    promote: bool = True
    hysteresis: bool = True
    """False turns off the margin and the residency time (the bench's control)."""
    move_bytes_per_s: int = 512 * 2**20
    """Budget of the background mover."""
    interval_s: float = 0.25
    """How often the background mover plans."""
    move_cpu_frac: float = 0.25
    """Share of each interval the mover's thread may spend on the CPU (mostly holding the GIL,
    which puts and gets need too): a round ends there and leaves the rest to the next."""
    entry_log: int = 8
    """Moves remembered per entry, for explain."""

    store_log: int = 10_000
    """Moves remembered store-wide."""

    def __post_init__(self) -> None:
        if self.full_top not in ("spill", "evict"):
            raise InvalidInput(f"full_top must be spill or evict, got {self.full_top!r}")
        if not 0 < self.move_cpu_frac <= 1:
            raise InvalidInput(f"move_cpu_frac must be in (0, 1], got {self.move_cpu_frac!r}")


@dataclass(frozen=True, slots=True)
class MoveOrder:
    """A decision: move ``key`` from ``src`` to ``dst`` (``None``: evict)."""

    key: bytes
    src: str
    dst: str | None
    size: int
    reason: str


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """A move that happened."""

    time_s: float
    key: bytes
    src: str
    dst: str | None
    size: int
    reason: str

    def to_dict(self, now: float | None = None) -> dict:
        """With ``now`` (a reading of the same clock), also ``age_s``: ``time_s`` is placement's
        clock (monotonic in a store), not wall time."""
        out = {"time_s": self.time_s, "key": self.key.hex(), "src": self.src, "dst": self.dst,
               "bytes": self.size, "reason": self.reason}
        if now is not None:
            out["age_s"] = now - self.time_s
        return out


@dataclass(slots=True, kw_only=True)
class Resident(Heat):
    """What placement knows of one entry; one per key, shared by the manager and its parts.

    It is its own ``Heat`` (``heat`` returns itself): a store of a million blocks keeps a million
    of these, and every object per block is one more the collector walks in a full collection
    (1.65 s at a million blocks with a separate ``Heat`` and a ``deque`` each)."""

    tier: int
    size: int
    since_s: float
    """When it arrived in its current tier (residency starts here)."""
    came: int = 0
    """How it arrived: +1 promoted, -1 demoted, 0 written. Residency only blocks going back."""
    pinned_until: float = 0.0
    leases: int = 0
    moves: deque | None = None
    """Its latest moves, for ``explain`` (None until it first moves)."""
    depth: int = 0
    """Position in its chain: breaks ties between equally hot blocks, deepest first."""
    retained_until: float = 0.0
    """Retained (a soft pin) until then; 0: not retained."""
    retain_priority: int = 0
    retain_owner: str | None = None

    @property
    def heat(self) -> Heat:
        """The entry's access history, as its scorer keeps it: this record itself."""
        return self

    def held(self, now: float) -> bool:
        """Pinned or leased: it must not go down or out."""
        return bool(self.leases) or self.pinned_until > now

    def retained(self, now: float) -> bool:
        return self.retained_until > now


class Heats(Sequence):
    """Every entry's heat, iterable more than once, and sliced in C (for ``Scorer.calibrate``)."""

    __slots__ = ("_res",)

    def __init__(self, res: dict[bytes, Resident]) -> None:
        self._res = res

    def __len__(self) -> int:
        return len(self._res)

    def __getitem__(self, at: slice) -> list[Heat]:
        if not isinstance(at, slice):
            raise TypeError("heats are sliced, not indexed: an index would copy every entry")
        return [r.heat for r in list(self._res.values())[at]]

    def __iter__(self):
        return map(operator.attrgetter("heat"), self._res.values())


def default_scorer(config: PlacementConfig) -> Scorer:
    """``AdaptiveRate`` over the config's short and long memories, or ``DecayedRate``
    over the short one when ``long_half_life_s`` is None."""
    short = DecayedRate(config.half_life_s, config.margin_frac, config.heat_max_count)
    if config.long_half_life_s is None:
        return short
    return AdaptiveRate(short, DecayedRate(config.long_half_life_s, config.margin_frac, config.long_max_count))


def describe(r: Resident, tier: str, scorer: Scorer, now: float) -> dict:
    """``PlacementManager.explain``'s answer for a resident of ``tier``: where it is and why."""
    return {
        "tier": tier,
        "size": r.size,
        "heat_score": r.heat.score if math.isfinite(r.heat.score) else None,  # None: no access seen yet
        "heat_per_s": scorer.rate(r.heat, now),
        "accesses": r.heat.count,
        "last_access_age_s": now - r.heat.last_s,
        "resident_for_s": now - r.since_s,
        "pinned": r.pinned_until > now,
        "pinned_for_s": None if r.pinned_until in (0.0, math.inf) or r.pinned_until <= now
        else r.pinned_until - now,
        "leases": r.leases,
        "retained": None if not r.retained(now) else {
            "owner": r.retain_owner, "priority": r.retain_priority,
            "expires_in_s": r.retained_until - now},
        "scorer": scorer.name,
        "heat_memories": list(r.heat.parts),
        "moves": [m.to_dict(now) for m in r.moves or ()],
    }
