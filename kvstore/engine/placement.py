"""Placement: which tier each entry should be in, decided from access heat.

The manager keeps its own small record per entry (tier, size, heat, pins) and
turns events into ``MoveOrder``s; it never touches a tier. The store carries
orders out (copy, switch the index, delete: ``kvstore/mover.py``) and reports
back with ``moved``; the trace simulator (``bench/placement.py``) drives the
very same code with a simulated clock and a mover that only updates records.

Rules, in the order ``plan`` applies them:

1. **Promotion.** A get that hits below the top tier makes the entry a
   candidate. Hottest first, candidates move to the top tier while it has room
   under its high watermark, then each only in exchange for residents it beats
   by the scorer's margin: those are demoted one tier, in orders placed before
   the promotion so that a mover frees the room first.
2. **Demotion.** A tier above ``high_watermark_frac`` sends its coldest
   entries one tier down until it is under ``low_watermark_frac``; the last tier
   evicts. ``make_room`` does the same at once, for a put that found the tier full.
   ``hold_room`` also counts the put's bytes as on their way in until the put is
   done, and keeps the entries it sends down from being picked again meanwhile:
   concurrent puts into a full tier then each make room of their own instead of
   counting the same free bytes (or ordering out the same coldest entry). Entries
   on their way out still count until they are gone: another put's write cannot
   use room that is not free yet, so puts racing each other may free a block more
   than they need, never less.
3. **Hysteresis.** Within ``min_residency_s`` of a move an entry does not go
   back the way it came (a promoted entry is not demoted, a demoted one not
   promoted), except to make room for a put; and promotion needs the margin.
   Watermark demotion stops at such a settling entry rather than demote hotter
   ones in its place. Heat itself is an exponentially decayed count. With
   ``hysteresis=False`` margin and residency are off; the bench measures what
   they save on an oscillating workload.
4. **Pins and leases.** A pinned or leased entry never moves down or out
   (demotion looks past it); a leased one does not move up either.
5. **Retention** (a soft pin, ``retain``). A retained entry is honoured ahead of
   heat: demotion and a put's ``make_room`` look past it as they do past a pin,
   and a retained entry below the top tier is promoted before any other, in
   exchange for unretained residents whatever their heat, or, failing those, for
   retained entries of the *same owner* that expire sooner (lower priority
   first): one tenant's retention never pushes out another's. Retention ends at
   its expiry or on ``unretain``; each owner's retained bytes are bounded by the
   quota its ``retain`` call names. A top tier that only retained entries fill
   sends new blocks one tier down.

Every applied move is logged with its reason, per entry (for ``explain``) and
store-wide (bounded).

This module is one unit, longer than most: the five rules decide over one record per
entry under one lock, and each rule reads the others' state (a retained entry is looked
past by demotion, preferred by promotion, charged to its owner), so splitting them
would split that lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from kvstore.errors import InvalidInput, RetainQuotaExceeded
from kvstore.engine.heat import AdaptiveRate, DecayedRate, Heat, Scorer

__all__ = ["PREFETCH_OWNER", "TierPolicy", "PlacementConfig", "MoveOrder", "MoveRecord", "PlacementManager",
           "RoomHold", "default_scorer"]

PREFETCH_OWNER = "_prefetch"
"""The owner of the holds prefetches place (``kvstore.engine.prefetch``): no tenant, so no tenant's quota
pays for them; the first read of a held block ends its hold (the reader came)."""

_SATURATING_READS = 64
"""Reads of one key reported at one instant that still raise its heat: scores saturate well before."""


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How placement treats one tier."""

    name: str
    capacity_bytes: int
    high_watermark_frac: float = 0.95
    """Above this share of capacity, the coldest entries go down."""
    low_watermark_frac: float = 0.90
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
    """New blocks enter the top tier only past a colder resident (``place_new``); else one tier down."""
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
    entry_log: int = 8
    """Moves remembered per entry, for explain."""
    store_log: int = 10_000
    """Moves remembered store-wide."""


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


@dataclass(slots=True)
class _Resident:
    tier: int
    size: int
    since_s: float
    """When it arrived in its current tier (residency starts here)."""
    came: int = 0
    """How it arrived: +1 promoted, -1 demoted, 0 written. Residency only blocks going back."""
    heat: Heat = field(default_factory=Heat)
    pinned_until: float = 0.0
    leases: int = 0
    moves: deque = field(default_factory=deque)
    depth: int = 0
    """Position in its chain: breaks ties between equally hot blocks, deepest first."""
    retained_until: float = 0.0
    """Retained (a soft pin) until then; 0: not retained."""
    retain_priority: int = 0
    retain_owner: str | None = None


class RoomHold:
    """Room made in a tier for one write on its way (``PlacementManager.hold_room``).

    Until ``release`` (or the end of a ``with`` block), placement counts ``nbytes`` as
    already in ``tier`` and the entries ``orders`` send out of it as already gone, so a
    concurrent put asks for room of its own. Release it once the write has been indexed
    or has failed; releasing twice is harmless.
    """

    __slots__ = ("tier", "nbytes", "orders", "_manager")

    def __init__(self, manager: "PlacementManager", tier: int, nbytes: int, orders: list[MoveOrder]) -> None:
        self.tier = tier
        """Position of the tier in placement's (and the store's) tier list."""
        self.nbytes = nbytes
        self.orders = orders
        self._manager: PlacementManager | None = manager

    def release(self) -> None:
        manager, self._manager = self._manager, None
        if manager is not None:
            manager._release_room(self)

    def __enter__(self) -> "RoomHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def default_scorer(config: PlacementConfig) -> Scorer:
    """``AdaptiveRate`` over the config's short and long memories, or ``DecayedRate``
    over the short one when ``long_half_life_s`` is None."""
    short = DecayedRate(config.half_life_s, config.margin_frac, config.heat_max_count)
    if config.long_half_life_s is None:
        return short
    return AdaptiveRate(short, DecayedRate(config.long_half_life_s, config.margin_frac, config.long_max_count))


class _Heats:
    """Every entry's heat, iterable more than once (for ``Scorer.calibrate``)."""

    __slots__ = ("_res",)

    def __init__(self, res: dict[bytes, _Resident]) -> None:
        self._res = res

    def __iter__(self):
        return map(operator.attrgetter("heat"), self._res.values())


class PlacementManager:
    """Decides moves across ``tiers`` (fastest first). Thread-safe; every event is O(1).

    Args:
        tiers: one policy per tier, fastest first.
        scorer: heat strategy (default: ``default_scorer(config)``).
        config: knobs (``PlacementConfig()`` by default).
        clock: seconds; the simulator passes a simulated one.
    """

    def __init__(self, tiers: Sequence[TierPolicy], *, scorer: Scorer | None = None,
                 config: PlacementConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if not tiers:
            raise InvalidInput("placement needs at least one tier")
        self.tiers = list(tiers)
        self.config = config or PlacementConfig()
        self.scorer = scorer or default_scorer(self.config)
        self.clock = clock
        self._pos = {t.name: i for i, t in enumerate(self.tiers)}
        if len(self._pos) != len(self.tiers):
            raise InvalidInput("tier names must be unique")
        self._res: dict[bytes, _Resident] = {}
        self._members: list[dict[bytes, _Resident]] = [{} for _ in self.tiers]
        self._used = [0] * len(self.tiers)
        self._incoming = [0] * len(self.tiers)  # bytes of held writes not yet indexed (``hold_room``)
        self._leaving: set[bytes] = set()  # ordered by a held make_room or plan, not moved yet: not picked again
        self._candidates: dict[bytes, None] = {}  # an ordered set
        self._log: deque[MoveRecord] = deque(maxlen=self.config.store_log)
        self._moved = {"promoted": 0, "demoted": 0, "evicted": 0}
        self._moved_bytes = 0
        self._owners: dict[str, set[bytes]] = {}
        """Keys each owner retains (expired ones are pruned as they are met)."""
        self._lock = threading.Lock()

    # -- events from the store ------------------------------------------------------

    def admitted(self, key: bytes, tier: str, size: int, *, access: bool = True, depth: int = 0,
                 now: float | None = None) -> None:
        """``key`` was written (or found at start) in ``tier``; a write counts as an access.

        Args:
            depth: the block's position in its chain. Among equally hot blocks the
                deepest goes first: a chain without its head is unreachable, one
                without its tail still serves a prefix.
            now: the clock reading to record; one put passes the same for all its
                blocks, so they tie and ``depth`` decides.
        """
        now = self.clock() if now is None else now
        with self._lock:
            r = self._res.get(key)
            if r is None:
                r = self._res[key] = _Resident(self._pos[tier], size, now)
            else:
                self._leave(key, r)
                r.tier, r.size, r.since_s, r.came = self._pos[tier], size, now, 0
            r.depth = depth
            self._members[r.tier][key] = r
            self._used[r.tier] += size
            if access:
                self.scorer.touch(r.heat, now)

    def accessed(self, keys: Iterable[bytes], counts: Iterable[int] | None = None) -> None:
        """Each key was read (``counts[i]`` times): heat goes up; one below the top tier
        becomes a promotion candidate."""
        now = self.clock()
        with self._lock:
            for key, n in zip(keys, counts if counts is not None else itertools.repeat(1)):
                r = self._res.get(key)
                if r is None:
                    continue
                for _ in range(min(n, _SATURATING_READS)):  # reads at one instant saturate the score
                    self.scorer.touch(r.heat, now)
                if r.retain_owner == PREFETCH_OWNER:
                    self._forget_retention(key, r)
                if r.tier and self.config.promote:
                    self._candidates[key] = None

    def removed(self, key: bytes) -> None:
        """``key`` is gone (deleted, overwritten elsewhere, found missing)."""
        with self._lock:
            r = self._res.pop(key, None)
            if r is not None:
                self._leave(key, r)
                self._forget_retention(key, r)
            self._candidates.pop(key, None)

    def moved(self, order: MoveOrder, size: int | None = None) -> None:
        """The store carried ``order`` out; ``size`` is the frame's size in its new tier."""
        now = self.clock()
        with self._lock:
            r = self._res.get(order.key)
            if r is None:
                return
            self._leave(order.key, r)
            record = MoveRecord(now, order.key, order.src, order.dst, order.size, order.reason)
            self._log.append(record)
            self._moved_bytes += order.size
            kind = order.reason.split(":", 1)[0]
            self._moved[kind] = self._moved.get(kind, 0) + 1
            if order.dst is None:
                del self._res[order.key]
                self._forget_retention(order.key, r)
                return
            r.came = 1 if self._pos[order.dst] < r.tier else -1
            r.tier, r.since_s = self._pos[order.dst], now
            r.size = order.size if size is None else size
            self._members[r.tier][order.key] = r
            self._used[r.tier] += r.size
            r.moves.append(record)
            while len(r.moves) > self.config.entry_log:
                r.moves.popleft()

    def _leave(self, key: bytes, r: _Resident) -> None:
        self._members[r.tier].pop(key, None)
        self._used[r.tier] -= r.size
        self._leaving.discard(key)

    # -- pins and leases ------------------------------------------------------------

    def pin(self, key: bytes, ttl_s: float | None = None) -> bool:
        """Keep ``key`` in its tier or higher, for ``ttl_s`` seconds or until unpinned.

        Returns:
            False when placement does not know the key.
        """
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidInput(f"ttl_s must be positive, got {ttl_s!r}")
        with self._lock:
            r = self._res.get(key)
            if r is None:
                return False
            r.pinned_until = math.inf if ttl_s is None else self.clock() + ttl_s
            return True

    def unpin(self, key: bytes) -> bool:
        with self._lock:
            r = self._res.get(key)
            if r is None or not r.pinned_until:
                return False
            r.pinned_until = 0.0
            return True

    def lease(self, key: bytes) -> bool:
        """A zero-copy reader holds ``key``: it must not move or go until ``release``."""
        with self._lock:
            r = self._res.get(key)
            if r is None:
                return False
            r.leases += 1
            return True

    def release(self, key: bytes) -> None:
        with self._lock:
            r = self._res.get(key)
            if r is not None and r.leases:
                r.leases -= 1

    def is_held(self, key: bytes) -> bool:
        """Pinned or leased right now: placement must not move it down or out."""
        with self._lock:
            r = self._res.get(key)
            return r is not None and self._held(r, self.clock())

    def is_pinned(self, key: bytes) -> bool:
        with self._lock:
            r = self._res.get(key)
            return r is not None and r.pinned_until > self.clock()

    # -- retention (soft pins) --------------------------------------------------------

    def retain(self, keys: Sequence[bytes], ttl_s: float, *, owner: str, priority: int = 0,
               quota_bytes: int | None = None) -> tuple[int, int, int]:
        """Retain ``keys`` for ``owner`` for ``ttl_s`` seconds (a soft pin: rule 5).

        A key this owner retains already is renewed (its expiry and priority replaced); one
        another owner retains stays that owner's, with the later expiry and the higher
        priority of the two, and is not charged to this one; but a prefetch's hold
        (``PREFETCH_OWNER``) passes to the tenant that retains the key. Keys placement does not know are
        skipped.

        Returns:
            (keys retained, their bytes, bytes ``owner`` retains now).

        Raises:
            InvalidInput: ``ttl_s`` is not a positive finite number.
            RetainQuotaExceeded: the owner's retained bytes would pass ``quota_bytes``; nothing
                changed.
        """
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < math.inf:
            raise InvalidInput(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        now = self.clock()
        until = now + ttl_s
        with self._lock:
            held = self._owned_bytes(owner, now)
            mine = self._owners.get(owner, set())
            found: list[tuple[bytes, _Resident]] = []
            extra = 0
            for key in dict.fromkeys(keys):
                r = self._res.get(key)
                if r is None:
                    continue
                found.append((key, r))
                if key not in mine and not self._kept_by_other(r, owner, now):
                    extra += r.size
            if quota_bytes is not None and held + extra > quota_bytes:
                raise RetainQuotaExceeded(
                    f"retaining {extra} more bytes would take {owner!r} to {held + extra} bytes retained, over "
                    f"its retention quota of {quota_bytes} bytes (KVSTORE_RETAIN_QUOTA_BYTES, or the token's "
                    f"retain_quota_bytes); release a conversation or retain fewer tokens",
                    retained_bytes=held, quota_bytes=quota_bytes)
            nbytes = 0
            for key, r in found:
                nbytes += r.size
                if self._kept_by_other(r, owner, now):
                    r.retained_until = max(r.retained_until, until)
                    r.retain_priority = max(r.retain_priority, priority)
                    continue
                if r.retain_owner is not None and r.retain_owner != owner:  # an expired retention of another
                    self._owners.get(r.retain_owner, set()).discard(key)
                r.retained_until, r.retain_priority, r.retain_owner = until, priority, owner
                self._owners.setdefault(owner, set()).add(key)
                if r.tier and self.config.promote:
                    self._candidates[key] = None
            return len(found), nbytes, held + extra

    def unretain(self, keys: Sequence[bytes], owner: str | None = None) -> int:
        """End the retention of ``keys`` (only ``owner``'s, when given); how many ended."""
        now = self.clock()
        n = 0
        with self._lock:
            for key in keys:
                r = self._res.get(key)
                if r is None or not self._retained(r, now) or (owner is not None and r.retain_owner != owner):
                    continue
                self._forget_retention(key, r)
                n += 1
        return n

    def retention(self, key: bytes) -> dict | None:
        """``key``'s live retention: owner, priority and seconds left; None when not retained."""
        now = self.clock()
        with self._lock:
            r = self._res.get(key)
            if r is None or not self._retained(r, now):
                return None
            return {"owner": r.retain_owner, "priority": r.retain_priority,
                    "expires_in_s": r.retained_until - now}

    def retained_bytes(self, owner: str | None = None) -> dict[str, int]:
        """Bytes each owner (or only ``owner``) retains now."""
        now = self.clock()
        with self._lock:
            names = list(self._owners) if owner is None else [owner]
            held = {name: self._owned_bytes(name, now) for name in names if name in self._owners}
            return {name: n for name, n in held.items() if n}

    def is_retained(self, key: bytes) -> bool:
        with self._lock:
            r = self._res.get(key)
            return r is not None and self._retained(r, self.clock())

    def _retained(self, r: _Resident, now: float) -> bool:
        return r.retained_until > now

    def _kept_by_other(self, r: _Resident, owner: str, now: float) -> bool:
        """Retained by another owner, who keeps it: a prefetch's hold gives way to a tenant's
        retention (which takes the entry over, charged to the tenant)."""
        return (self._retained(r, now) and r.retain_owner != owner
                and not (r.retain_owner == PREFETCH_OWNER and owner != PREFETCH_OWNER))

    def _owned_bytes(self, owner: str, now: float) -> int:
        """Bytes ``owner`` retains, pruning its expired keys (under the lock)."""
        keys = self._owners.get(owner)
        if not keys:
            return 0
        total = 0
        for key in list(keys):
            r = self._res.get(key)
            if r is None or not self._retained(r, now) or r.retain_owner != owner:
                keys.discard(key)
                continue
            total += r.size
        if not keys:
            del self._owners[owner]
        return total

    def _forget_retention(self, key: bytes, r: _Resident) -> None:
        if r.retain_owner is not None:
            keys = self._owners.get(r.retain_owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._owners[r.retain_owner]
        r.retained_until, r.retain_priority, r.retain_owner = 0.0, 0, None

    # -- decisions -------------------------------------------------------------------

    def plan(self, *, hold: bool = False) -> list[MoveOrder]:
        """Promotions (each after the demotion that makes its room), then demotions
        for every tier above its high watermark. A mover carries them out in order.

        Args:
            hold: keep the ordered entries from a put's ``make_room`` until ``settle(orders)``,
                so that the room a put counts on is not the room this round frees anyway.
        """
        now = self.clock()
        with self._lock:
            self.scorer.calibrate(_Heats(self._res), len(self._members[0]), len(self._res), now)
            projected = list(self._used)
            orders: list[MoveOrder] = []
            ordered: set[bytes] = set(self._leaving)  # a held put's make_room is moving these now
            if self.config.promote:
                for keys in self._owners.values():  # a retained entry below the top keeps asking
                    for key in keys:
                        r = self._res.get(key)
                        if r is not None and r.tier and self._retained(r, now):
                            self._candidates[key] = None
            if self.config.promote and self._candidates:
                orders += self._promotions(now, projected, ordered)
            for i, tier in enumerate(self.tiers):
                high = tier.high_watermark_frac * tier.capacity_bytes
                if projected[i] > high:
                    frac = projected[i] / tier.capacity_bytes
                    target = tier.low_watermark_frac * tier.capacity_bytes
                    reason = (f"demoted: {tier.name} above high watermark {tier.high_watermark_frac:.2f} "
                              f"({frac:.2f})")
                    orders += self._demote(i, projected[i] - target, now, projected, ordered, reason,
                                           respect_residency=True)
            if hold:
                self._leaving.update(order.key for order in orders)
            return orders

    def settle(self, orders: Iterable[MoveOrder]) -> None:
        """The held ``orders`` were carried out or given up: their entries may be picked again."""
        with self._lock:
            self._leaving.difference_update(order.key for order in orders)

    def place_new(self, nbytes: int) -> str:
        """The tier a new block should be written to.

        The top tier while it has room under its high watermark; past that, only
        when a block read once just now would beat the coldest resident there by
        the margin. Otherwise the block starts one tier down and earns its way up
        with a second read (admission filtering: one-off blocks such as a scan
        do not push out what is being reused).
        """
        if not self.config.admission or len(self.tiers) == 1:
            return self.tiers[0].name
        now = self.clock()
        with self._lock:
            top = self.tiers[0]
            if self._used[0] + self._incoming[0] + nbytes <= top.high_watermark_frac * top.capacity_bytes:
                return top.name
            probe = Heat()
            self.scorer.touch(probe, now)
            coldest = min((r.heat.score for r in self._members[0].values()
                           if not self._held(r, now) and not self._retained(r, now)), default=None)
            if coldest is None or self._beats(probe.score, coldest):
                return top.name
            return self.tiers[1].name

    def make_room(self, tier: str, nbytes: int, *, force: bool = False) -> list[MoveOrder]:
        """Orders that free ``nbytes`` in ``tier`` now, for a put that found it full.

        Residency is not waited for here: the put is waiting. Pinned and leased
        entries still stay, so the orders may free less than asked.

        Args:
            force: free ``nbytes`` even where the accounting says they are free (the
                tier refused a write all the same: readers still hold ranges it freed).
        """
        return self._make_room(tier, nbytes, force=force, hold=False).orders

    def hold_room(self, tier: str, nbytes: int, *, force: bool = False) -> RoomHold:
        """``make_room``, held: ``nbytes`` count as in ``tier`` until the hold is released, and the
        entries the orders send out are not picked again meanwhile, so that puts running at once
        each get room of their own."""
        return self._make_room(tier, nbytes, force=force, hold=True)

    def _make_room(self, tier: str, nbytes: int, *, force: bool, hold: bool) -> RoomHold:
        now = self.clock()
        with self._lock:
            i = self._pos[tier]
            t = self.tiers[i]
            need = self._used[i] + self._incoming[i] + nbytes - t.capacity_bytes
            if force:
                need = max(need, nbytes)
            orders: list[MoveOrder] = []
            if need > 0:
                reason = f"demoted: {t.name} full for a {nbytes}-byte put"
                orders = self._demote(i, need, now, list(self._used), set(self._leaving), reason,
                                      respect_residency=False)
            room = RoomHold(self, i, nbytes, orders)
            if not hold:
                room._manager = None
                return room
            self._incoming[i] += nbytes
            self._leaving.update(order.key for order in orders)
            return room

    def _release_room(self, room: RoomHold) -> None:
        with self._lock:
            self._incoming[room.tier] -= room.nbytes
            self._leaving.difference_update(order.key for order in room.orders)  # gone, or refused: it stays

    def _held(self, r: _Resident, now: float) -> bool:
        """Pinned or leased: it must not go down or out."""
        return bool(r.leases) or r.pinned_until > now

    def _settling(self, r: _Resident, now: float, up: bool) -> bool:
        """Residency forbids this move: it would send ``r`` back the way it came
        within ``min_residency_s``. That is the ping-pong; a fresh write may go
        down at once, and a demoted entry may go further down."""
        return (self.config.hysteresis and r.came == (-1 if up else 1)
                and now - r.since_s < self.config.min_residency_s)

    def _coldest(self, i: int, ordered: set[bytes]):
        """Residents of tier ``i`` not yet ordered, coldest first (a heap popped lazily: O(n + k log n))."""
        heap = [(r.heat.score, -r.depth, key) for key, r in self._members[i].items() if key not in ordered]
        heapq.heapify(heap)
        while heap:
            score, _, key = heapq.heappop(heap)
            yield score, key, self._members[i][key]

    def _demote(self, i: int, need: float, now: float, projected: list[int], ordered: set[bytes],
                reason: str, *, respect_residency: bool) -> list[MoveOrder]:
        dst = self.tiers[i + 1].name if i + 1 < len(self.tiers) else None
        why = reason if dst else reason.replace("demoted:", "evicted:", 1)
        orders = []
        freed = 0
        for _, key, r in self._coldest(i, ordered):
            if freed >= need:
                break
            if self._held(r, now) or self._retained(r, now):
                continue  # pinned, leased or retained: look past it
            if respect_residency and self._settling(r, now, up=False):
                break  # the coldest must stay a while: sending hotter ones down instead would be worse
            orders.append(self._order_down(i, key, r, why, projected, ordered))
            freed += r.size
        return orders

    def _order_down(self, i: int, key: bytes, r: _Resident, reason: str, projected: list[int],
                    ordered: set[bytes]) -> MoveOrder:
        dst = self.tiers[i + 1].name if i + 1 < len(self.tiers) else None
        ordered.add(key)
        projected[i] -= r.size
        if dst is not None:
            projected[i + 1] += r.size
        return MoveOrder(key, self.tiers[i].name, dst, r.size, reason)

    def _promotions(self, now: float, projected: list[int], ordered: set[bytes]) -> list[MoveOrder]:
        """Hottest candidates first: into free room below the top tier's high watermark,
        else in exchange for colder residents (demoted first, so the mover has the room)."""
        top = self.tiers[0]
        room = top.high_watermark_frac * top.capacity_bytes - projected[0]
        candidates = []
        for key in self._candidates:
            r = self._res.get(key)
            if r is None or not r.tier or key in ordered or r.leases:
                continue
            if self._retained(r, now):  # a soft pin goes first, whatever its heat or residency
                candidates.append((True, r.retain_priority, r.heat.score, key, r))
            elif not self._settling(r, now, True):
                candidates.append((False, 0, r.heat.score, key, r))
        self._candidates.clear()
        candidates.sort(key=lambda c: c[:3], reverse=True)
        victims = ((s, k, r) for s, k, r in self._coldest(0, ordered)
                   if not self._held(r, now) and not self._retained(r, now) and not self._settling(r, now, False))
        orders: list[MoveOrder] = []
        retained_failed = False
        for kept, _, score, key, r in candidates:
            if kept and retained_failed:
                continue
            if r.size <= room:
                room -= r.size
                reason = f"promoted: {top.name} has room ({projected[0] / top.capacity_bytes:.2f} full)"
                if kept:
                    reason = f"promoted: retained by {r.retain_owner!r}; {top.name} has room"
            elif kept:
                displaced = self._displace_for_retained(r, r.size - room, now, projected, ordered)
                if displaced is None:
                    retained_failed = True  # nothing left to give way; keep it where it is
                    continue
                orders += displaced[0]
                room += displaced[1] - r.size
                reason = f"promoted: retained by {r.retain_owner!r} (soft pin, ahead of heat)"
            else:
                displaced = self._displace(score, r.size - room, victims, now, projected, ordered)
                if displaced is None:
                    break  # later candidates are colder and the residents left hotter: none would win
                orders += displaced[0]
                room += displaced[1] - r.size
                reason = self._beat_reason(r, score, displaced[2], now)
            orders.append(MoveOrder(key, self.tiers[r.tier].name, top.name, r.size, reason))
            ordered.add(key)
            projected[r.tier] -= r.size
            projected[0] += r.size
        return orders

    def _displace(self, score: float, need: int, victims, now: float, projected: list[int],
                  ordered: set[bytes]) -> tuple[list[MoveOrder], int, float] | None:
        """Demotions of top-tier residents colder than ``score`` (by the margin, with
        hysteresis) that free ``need`` bytes; None, and nothing ordered, when there are not enough."""
        picked = []
        freed = 0
        while freed < need:
            victim = next(victims, None)
            if victim is None or not self._beats(score, victim[0]):
                return None  # an unbeaten victim ends the search: the ones after it are hotter
            picked.append(victim)
            freed += victim[2].size
        reason = f"demoted: displaced from {self.tiers[0].name} by a hotter entry"
        orders = [self._order_down(0, key, r, f"{reason} (score {s:.3g} < {score:.3g})", projected, ordered)
                  for s, key, r in picked]
        return orders, freed, picked[-1][0]

    def _displace_for_retained(self, r: _Resident, need: int, now: float, projected: list[int],
                               ordered: set[bytes]) -> tuple[list[MoveOrder], int] | None:
        """Demotions that free ``need`` bytes of the top tier for retained ``r``: unretained
        residents first, coldest first, whatever their heat; then retentions of the same owner
        that rank below it (lower priority, then sooner expiry). None, and nothing ordered,
        when those are not enough."""
        picked: list[tuple[str, bytes, _Resident]] = []
        freed = 0
        for _, key, v in self._coldest(0, ordered):
            if freed >= need:
                break
            if self._held(v, now) or self._retained(v, now):
                continue
            picked.append(("demoted: made room for a retained entry", key, v))
            freed += v.size
        if freed < need:
            rank = (r.retain_priority, r.retained_until)
            same = sorted(((v.retain_priority, v.retained_until), key, v) for key, v in self._members[0].items()
                          if key not in ordered and v.retain_owner == r.retain_owner and self._retained(v, now)
                          and not self._held(v, now))
            for vrank, key, v in same:
                if freed >= need or vrank >= rank:
                    break
                picked.append((f"demoted: {r.retain_owner!r}'s sooner-expiring retention yields", key, v))
                freed += v.size
        if freed < need:
            return None
        orders = [self._order_down(0, key, v, why, projected, ordered) for why, key, v in picked]
        return orders, freed

    def _beats(self, a: float, b: float) -> bool:
        return self.scorer.beats(a, b) if self.config.hysteresis else a > b

    def _beat_reason(self, r: _Resident, score: float, coldest: float, now: float) -> str:
        top = self.tiers[0].name
        if self.config.hysteresis:
            head = (f"promoted: heat {self.scorer.rate(r.heat, now):.3g}/s beats the coldest in {top} "
                    f"by more than the scorer's margin")
        else:
            head = f"promoted: hotter than the coldest in {top}"
        return f"{head} (score {score:.3g} > {coldest:.3g})"

    # -- what happened ---------------------------------------------------------------

    def explain(self, key: bytes) -> dict | None:
        """Where ``key`` is and why, or None when placement does not know it."""
        now = self.clock()
        with self._lock:
            r = self._res.get(key)
            if r is None:
                return None
            return {
                "tier": self.tiers[r.tier].name,
                "size": r.size,
                "heat_score": r.heat.score if math.isfinite(r.heat.score) else None,  # None: no access seen yet
                "heat_per_s": self.scorer.rate(r.heat, now),
                "accesses": r.heat.count,
                "last_access_age_s": now - r.heat.last_s,
                "resident_for_s": now - r.since_s,
                "pinned": r.pinned_until > now,
                "pinned_for_s": None if r.pinned_until in (0.0, math.inf) or r.pinned_until <= now
                else r.pinned_until - now,
                "leases": r.leases,
                "retained": None if not self._retained(r, now) else {
                    "owner": r.retain_owner, "priority": r.retain_priority,
                    "expires_in_s": r.retained_until - now},
                "scorer": self.scorer.name,
                "heat_memories": list(r.heat.parts),
                "moves": [m.to_dict(now) for m in r.moves],
            }

    def heat_rates(self, sample: int = 100_000) -> tuple[list[tuple[str, float]], int]:
        """(tier, reads per second now) of up to ``sample`` entries, and how many entries there are.

        Beyond ``sample`` entries every k-th is taken, so the scorer runs on at most ``sample``
        of them (a dashboard asks every few seconds); the walk over the rest, under the lock,
        is a skip per entry. A never-read entry reads 0.0.
        """
        now = self.clock()
        with self._lock:
            total = len(self._res)
            step = max(1, -(-total // sample)) if sample > 0 else 1
            residents = itertools.islice(self._res.values(), 0, None, step)
            rate, names = self.scorer.rate, [t.name for t in self.tiers]
            return [(names[r.tier], rate(r.heat, now)) for r in residents], total

    def log(self, limit: int = 100) -> list[MoveRecord]:
        """The latest moves, newest last."""
        with self._lock:
            return list(self._log)[-limit:]

    def usage(self) -> dict[str, int]:
        """Bytes placement believes each tier holds."""
        with self._lock:
            return {t.name: self._used[i] for i, t in enumerate(self.tiers)}

    def tier_of(self, key: bytes) -> str | None:
        with self._lock:
            r = self._res.get(key)
            return None if r is None else self.tiers[r.tier].name

    def scorer_state(self) -> dict:
        with self._lock:
            return self.scorer.describe()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._moved, "bytes_moved": self._moved_bytes, "entries": len(self._res)}
