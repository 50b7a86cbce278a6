"""Placement: which tier each entry should be in, decided from access heat.

The manager keeps its own small record per entry (tier, size, heat, pins) and
turns events into ``MoveOrder``s; it never touches a tier. The store carries
orders out (copy, switch the index, delete: ``kvstore/engine/mover.py``) and reports
back with ``moved``; the trace simulator (``bench/placement.py``) drives the
very same code with a simulated clock and a mover that only updates records.

Rules, in the order ``plan`` applies them:

1. **Promotion.** A get that hits below the top tier makes the entry a
   candidate. Hottest first, candidates move to the top tier while it has room
   under its high watermark, then each only in exchange for residents it beats
   by the scorer's margin: those are demoted one tier, in orders placed before
   the promotion so that a mover frees the room first.
2. **Demotion.** A tier above ``high_watermark_frac`` sends its coldest entries one tier down
   until it is under ``low_watermark_frac``; the last tier evicts. A mover's plan is bounded
   (``plan(limit=)``), so the tier drains over as many rounds as it takes: it stays draining
   until its real use is under the low watermark, meanwhile new blocks (``place_new``) and
   promotions into free room get only the room under it, and a pass over the whole tier that
   finds nothing that can go ends the drain. ``make_room`` does the same at once, for a put
   that found the tier full. While writes (or a lease's end) leave the top tier above its low
   watermark, it sends its coldest down to it (the first wakes the mover, ``on_pressure``):
   room for new blocks made ahead of them; with ``spill``, reads alone send down only residents
   a block read once now would beat by the margin. ``hold_room`` counts the put's bytes as on
   their way in until the put is done, and keeps the entries it sends down from being picked
   again meanwhile: concurrent puts each make room of their own instead of counting the same
   free bytes. Entries on their way out still count until they are gone, so puts racing each
   other may free a block more than they need, never less.
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

The rules decide over one record per entry (``placement_types.Resident``) under one lock, the
manager's, and read each other's state (a retained entry is looked past by demotion, preferred by
promotion, charged to its owner): one object in three modules sharing its records and lock. ``room``
(``RoomMaker``) chooses the residents that go down; ``retention`` (``Retention``) keeps the owners'
books; this module admits, plans, promotes, and is the public face (value types: ``placement_types``).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Callable, Iterable

from kvstore.errors import InvalidInput
from kvstore.engine.heat import Heat, Scorer
from kvstore.engine.heat_order import HeatOrder
from kvstore.engine.placement_types import (Heats, MoveOrder, MoveRecord, PlacementConfig, Resident, TierPolicy,
                                           default_scorer, describe)
from kvstore.engine.retention import PREFETCH_OWNER, Retention
from kvstore.engine.room import RoomHold, RoomMaker

__all__ = ["PREFETCH_OWNER", "TierPolicy", "PlacementConfig", "MoveOrder", "MoveRecord", "PlacementManager",
           "RoomHold", "default_scorer"]

_SATURATING_READS = 64
"""Reads of one key reported at one instant that still raise its heat: scores saturate well before."""


class PlacementManager:
    """Decides moves across ``tiers`` (fastest first). Thread-safe; every event is O(log n).

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
        self._res: dict[bytes, Resident] = {}
        self._members: list[dict[bytes, Resident]] = [{} for _ in self.tiers]
        self._order = [HeatOrder() for _ in self.tiers]  # each tier's members, coldest first
        self._used = [0] * len(self.tiers)
        self._kept: dict[bytes, tuple[int, int]] = {}  # key -> (tier, bytes) of a durable copy left behind
        self._incoming = [0] * len(self.tiers)  # bytes of held writes not yet indexed (``hold_room``)
        # Above its high watermark a tier drains to its low one, over as many rounds as a bounded
        # plan needs: it stays draining until its real use (not a plan's projection) is down there.
        self._draining = [False] * len(self.tiers)
        self._leaving: set[bytes] = set()  # ordered by a held make_room or plan, not moved yet: not picked again
        self._candidates: dict[bytes, None] = {}  # an ordered set
        self._log: deque[MoveRecord] = deque(maxlen=self.config.store_log)
        self._moved, self._moved_bytes = {"promoted": 0, "demoted": 0, "evicted": 0}, 0
        self._lock = threading.Lock()
        self._room = RoomMaker(self.tiers, self.config, self.scorer, self.clock, self._lock, members=self._members,
                               order=self._order, used=self._used, incoming=self._incoming, leaving=self._leaving)
        self._retention = Retention(self._res, self._candidates, self.config)
        self._wake_above = self.tiers[0].low_watermark_frac * self.tiers[0].capacity_bytes if len(tiers) > 1 else math.inf
        self._written_above = False  # since the last plan, writes left the top tier above its low watermark
        self._spill_ahead = self.config.full_top == "spill" and len(self.tiers) > 1
        self.on_pressure: Callable[[], None] | None = None  # called when that starts, under the lock (must not block)

    # -- events from the store ------------------------------------------------------

    def admitted(self, key: bytes, tier: str, size: int, *, access: bool = True, depth: int = 0,
                 now: float | None = None) -> None:
        """``key`` was written (or found at start) in ``tier``; a write counts as an access.

        Args:
            depth: the block's position in its chain. Among equally hot blocks the deepest goes
                first: a chain without its head is unreachable, one without its tail still
                serves a prefix.
            now: the clock reading to record; one put passes the same for all its blocks, so
                they tie and ``depth`` decides.
        """
        with self._lock:
            self._admit(key, self._pos[tier], size, depth, access, self.clock() if now is None else now)

    def admitted_many(self, tier: str, blocks: Iterable[tuple[bytes, int, int]], *, access: bool = True,
                      now: float | None = None) -> None:
        """``admitted`` for each ``(key, size, depth)`` written in ``tier``, under one take of the lock."""
        now, pos = self.clock() if now is None else now, self._pos[tier]
        with self._lock:
            for key, size, depth in blocks:
                self._admit(key, pos, size, depth, access, now)

    def _admit(self, key: bytes, pos: int, size: int, depth: int, access: bool, now: float) -> None:
        r = self._res.get(key)  # under the lock
        if r is None:
            r = self._res[key] = Resident(tier=pos, size=size, since_s=now)
        else:
            self._leave(key, r)
            r.tier, r.size, r.since_s, r.came = pos, size, now, 0
        r.depth = depth
        self._members[pos][key] = r
        self._used[pos] += size
        if pos == 0:
            self._may_go_down()
        if access:
            self.scorer.touch(r.heat, now)
        self._order[pos].put(key, r.heat.score, depth)

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
                self._order[r.tier].put(key, r.heat.score, r.depth)
                if r.retain_owner == PREFETCH_OWNER:
                    self._retention.forget(key, r)
                if r.tier and self.config.promote:
                    self._candidates[key] = None

    def keep(self, key: bytes, tier: str, size: int) -> None:
        """``tier`` keeps a ``size``-byte durable copy of ``key``, promoted out of it: counted there
        as used (``IndexEntry.kept``), though no entry lives there, until ``unkeep``."""
        with self._lock:
            _unkeep(self._kept, self._used, key)
            self._kept[key] = (pos := self._pos[tier], size)
            self._used[pos] += size

    def unkeep(self, key: bytes) -> None:
        with self._lock:  # the copy is gone, or is its entry's frame again
            _unkeep(self._kept, self._used, key)

    def removed(self, key: bytes) -> None:
        """``key`` is gone (deleted, overwritten elsewhere, found missing)."""
        with self._lock:
            _unkeep(self._kept, self._used, key)
            r = self._res.pop(key, None)
            if r is not None:
                self._leave(key, r)
                self._retention.forget(key, r)
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
                self._retention.forget(order.key, r)
                return
            r.came = 1 if self._pos[order.dst] < r.tier else -1
            r.tier, r.since_s = self._pos[order.dst], now
            r.size = order.size if size is None else size
            self._members[r.tier][order.key] = r
            self._order[r.tier].put(order.key, r.heat.score, r.depth)
            self._used[r.tier] += r.size
            if r.moves is None:  # made on the first move: most entries never move, and a deque
                r.moves = deque(maxlen=self.config.entry_log)  # each was one more object for the collector
            r.moves.append(record)

    def resized(self, key: bytes, size: int) -> None:
        """``key``'s frame was rewritten in place at ``size`` bytes (re-encoded): same tier, heat."""
        with self._lock:
            r = self._res.get(key)
            if r is not None:
                self._used[r.tier] += size - r.size
                r.size = size

    def _leave(self, key: bytes, r: Resident) -> None:
        self._members[r.tier].pop(key, None)
        self._order[r.tier].discard(key)
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
            if (r := self._res.get(key)) is not None:
                r.leases += 1
            return r is not None

    def release(self, key: bytes) -> None:
        with self._lock:
            if (r := self._res.get(key)) is not None and r.leases:
                r.leases -= 1
                if not r.leases and r.tier == 0:
                    self._may_go_down()

    def _may_go_down(self) -> None:
        """Under the lock, after a top-tier write or lease's end: above the low watermark, the next
        round makes room (the round a put's crossing woke may have found only its leased blocks)."""
        if self._used[0] > self._wake_above and not self._written_above:
            self._written_above = True
            if self.on_pressure is not None:
                self.on_pressure()

    def is_held(self, key: bytes) -> bool:
        """Pinned or leased right now: placement must not move it down or out."""
        with self._lock:
            r = self._res.get(key)
            return r is not None and r.held(self.clock())

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
            return self._retention.retain(keys, until, now, owner=owner, priority=priority, quota_bytes=quota_bytes)

    def unretain(self, keys: Sequence[bytes], owner: str | None = None) -> int:
        """End the retention of ``keys`` (only ``owner``'s, when given); how many ended."""
        now = self.clock()
        with self._lock:
            return self._retention.unretain(keys, owner, now)

    def retention(self, key: bytes) -> dict | None:
        """``key``'s live retention: owner, priority and seconds left; None when not retained."""
        now = self.clock()
        with self._lock:
            return self._retention.retention(key, now)

    def retained_bytes(self, owner: str | None = None) -> dict[str, int]:
        """Bytes each owner (or only ``owner``) retains now."""
        now = self.clock()
        with self._lock:
            return self._retention.retained_bytes(owner, now)

    def is_retained(self, key: bytes) -> bool:
        with self._lock:
            r = self._res.get(key)
            return r is not None and r.retained(self.clock())

    # -- decisions -------------------------------------------------------------------

    def plan(self, *, hold: bool = False, limit: int | None = None) -> list[MoveOrder]:
        """Promotions (each after the demotion that makes its room), then demotions
        for every tier above its high watermark, or still draining to its low one.
        A mover carries them out in order.

        Args:
            hold: keep the ordered entries from a put's ``make_room`` until ``settle(orders)``,
                so that the room a put counts on is not the room this round frees anyway.
            limit: the most demotions planned for each tier (and about four times as many
                residents looked at). A mover that carries out a round's worth passes it: a
                full tier of a million small blocks has tens of thousands in excess, and
                planning them all each round would be work thrown away under the lock. A tier
                left above its low watermark goes on draining next round.
        """
        now = self.clock()
        with self._lock:
            switches = getattr(self.scorer, "switches", 0)
            self.scorer.calibrate(Heats(self._res), len(self._members[0]), len(self._res), now)
            if getattr(self.scorer, "switches", 0) != switches:  # every score changed: rank afresh
                for i, (members, order) in enumerate(zip(self._members, self._order)):
                    order.rebuild((key, r.heat.score, r.depth) for key, r in members.items())
                    self._room.forget_walk(i)  # a place in the old order means nothing in the new
            projected = list(self._used)
            written, self._written_above = self._written_above, False
            for i, tier in enumerate(self.tiers):  # from real use: never from a plan's projection
                if projected[i] <= tier.low_watermark_frac * tier.capacity_bytes:
                    self._draining[i] = False
                    self._room.forget_walk(i)
                elif projected[i] > tier.high_watermark_frac * tier.capacity_bytes:
                    self._draining[i] = True
            orders: list[MoveOrder] = []
            ordered: set[bytes] = set(self._leaving)  # a held put's make_room is moving these now
            if self.config.promote:
                self._retention.keep_asking(now)
            if self.config.promote and self._candidates:
                orders += self._promotions(now, projected, ordered)
            for i, tier in enumerate(self.tiers):
                high = tier.high_watermark_frac * tier.capacity_bytes
                target = tier.low_watermark_frac * tier.capacity_bytes
                if projected[i] > high or (self._draining[i] and projected[i] > target):
                    frac = projected[i] / tier.capacity_bytes
                    reason = (f"demoted: {tier.name} above high watermark {tier.high_watermark_frac:.2f} "
                              f"({frac:.2f})" if projected[i] > high else
                              f"demoted: {tier.name} draining to low watermark {tier.low_watermark_frac:.2f} "
                              f"({frac:.2f})")
                    down = self._room.demote(i, projected[i] - target, now, projected, ordered, reason,
                                             respect_residency=True, limit=limit)
                    if not down and self._room.walked_all[i]:
                        self._draining[i] = False  # nothing left to move (pinned, retained): stop draining
                    orders += down
                elif i == 0 and projected[0] > target and (written or self._spill_ahead):
                    # Room for new blocks, off the puts' path (rule 2): after writes, the coldest go down
                    why, colder = "above low watermark (room for new blocks)", None
                    if not written:
                        probe = Heat()
                        self.scorer.touch(probe, now)
                        why, colder = "holds blocks colder than a new one", probe.score
                    orders += self._room.demote(0, projected[0] - target, now, projected, ordered,
                                                f"demoted: {tier.name} {why}", respect_residency=True,
                                                colder_than=colder, limit=limit)
            if hold:
                self._leaving.update(order.key for order in orders)
            return orders

    def settle(self, orders: Iterable[MoveOrder]) -> None:
        """The held ``orders`` were carried out or given up: their entries may be picked again. A
        promotion given up (a round's share ran out, or the top tier refused) stays a candidate."""
        with self._lock:
            for order in orders:
                self._leaving.discard(order.key)
                r = self._res.get(order.key) if order.dst == self.tiers[0].name else None
                if r is not None and r.tier and r.tier == self._pos[order.src] and self.config.promote:
                    self._candidates[order.key] = None

    def place_new(self, nbytes: int) -> str:
        """The tier a new block should be written to.

        The top tier while it has room under its high watermark (the mover keeps it at its low
        one, ``plan``). Past that, puts outran the mover: with ``full_top="evict"`` the top tier
        still (the coldest residents are dropped to make room), with ``spill`` one tier down (it
        earns its way up with a second read). A put never waits for a demotion.
        """
        if self._always_top():
            return self.tiers[0].name
        with self._lock:
            return self.tiers[0].name if self._fits(nbytes, admitted=True) else self.tiers[1].name

    def _always_top(self) -> bool:
        """New blocks go up top whatever its use: no admission filter, one tier, or ``full_top="evict"``."""
        return self.config.full_top == "evict" or not self.config.admission or len(self.tiers) == 1

    def _fits(self, nbytes: int, *, admitted: bool) -> bool:
        """Under the lock: whether ``nbytes`` more keep the top tier (and what is held) within its capacity,
        or (``admitted``) its mark for new blocks: a draining tier's is its low watermark (room above it
        is what the drain is making: blocks put there would go down again next round)."""
        top = self.tiers[0]
        mark = 1.0 if not admitted else top.low_watermark_frac if self._draining[0] else top.high_watermark_frac
        return self._used[0] + self._incoming[0] + nbytes <= mark * top.capacity_bytes

    def hold_free(self, nbytes: int, n: int) -> list[RoomHold]:
        """Up to ``n`` holds of ``nbytes`` of free top-tier room (a pool's grant), in one take of the lock:
        each while the tier stays where ``place_new`` admits new blocks (nothing is ordered out)."""
        admitted = not self._always_top()
        holds: list[RoomHold] = []
        with self._lock:
            while len(holds) < n and self._fits(nbytes, admitted=admitted):
                self._incoming[0] += nbytes
                holds.append(RoomHold(self._room, 0, nbytes, []))
        return holds

    def make_room(self, tier: str, nbytes: int, *, force: bool = False) -> list[MoveOrder]:
        """Orders that free ``nbytes`` in ``tier`` now, for a put that found it full.

        Residency is not waited for here: the put is waiting. Pinned and leased
        entries still stay, so the orders may free less than asked.

        Args:
            force: free ``nbytes`` even where the accounting says they are free (the
                tier refused a write all the same: readers still hold ranges it freed).
        """
        return self._room.make(tier, nbytes, force=force, hold=False).orders

    def hold_room(self, tier: str, nbytes: int, *, force: bool = False) -> RoomHold:
        """``make_room``, held: ``nbytes`` count as in ``tier`` until the hold is released, and the
        entries the orders send out are not picked again meanwhile, so that puts running at once
        each get room of their own."""
        return self._room.make(tier, nbytes, force=force, hold=True)

    def _promotions(self, now: float, projected: list[int], ordered: set[bytes]) -> list[MoveOrder]:
        """Hottest candidates first: into free room below the top tier's high watermark,
        else in exchange for colder residents (demoted first, so the mover has the room)."""
        top = self.tiers[0]
        room = top.high_watermark_frac * top.capacity_bytes - projected[0]
        # A draining top tier lends as free only its room under the low watermark: room between
        # the two is what the drain is making, and filling it would trade residents for candidates
        # without the scorer's margin. Exchanges (by the margin) still count from the high one.
        reserve = ((top.high_watermark_frac - top.low_watermark_frac) * top.capacity_bytes
                   if self._draining[0] else 0)
        candidates = []
        for key in self._candidates:
            r = self._res.get(key)
            if r is None or not r.tier or key in ordered or r.leases:
                continue
            if r.retained(now):  # a soft pin goes first, whatever its heat or residency
                candidates.append((True, r.retain_priority, r.heat.score, key, r))
            elif not self._room.settling(r, now, True):
                candidates.append((False, 0, r.heat.score, key, r))
        self._candidates.clear()
        candidates.sort(key=lambda c: c[:3], reverse=True)
        victims = ((s, k, r) for s, k, r in self._room.coldest(0, ordered)
                   if not r.held(now) and not r.retained(now) and not self._room.settling(r, now, False))
        orders: list[MoveOrder] = []
        retained_failed = False
        for kept, _, score, key, r in candidates:
            if kept and retained_failed:
                continue
            if r.size <= max(0, room - reserve):
                room -= r.size
                reason = f"promoted: {top.name} has room ({projected[0] / top.capacity_bytes:.2f} full)"
                if kept:
                    reason = f"promoted: retained by {r.retain_owner!r}; {top.name} has room"
            elif kept:
                displaced = self._room.displace_for_retained(r, r.size - max(0, room - reserve), now, projected,
                                                             ordered)
                if displaced is None:
                    retained_failed = True  # nothing left to give way; keep it where it is
                    continue
                orders += displaced[0]
                room += displaced[1] - r.size
                reason = f"promoted: retained by {r.retain_owner!r} (soft pin, ahead of heat)"
            else:
                displaced = self._room.displace(score, r.size - max(0, room - reserve), victims, now, projected,
                                                ordered)
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

    def _beat_reason(self, r: Resident, score: float, coldest: float, now: float) -> str:
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
            return None if r is None else describe(r, self.tiers[r.tier].name, self.scorer, now)

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
            return None if (r := self._res.get(key)) is None else self.tiers[r.tier].name

    def scorer_state(self) -> dict:
        with self._lock:
            return self.scorer.describe()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._moved, "bytes_moved": self._moved_bytes, "entries": len(self._res)}


def _unkeep(kept: dict[bytes, tuple[int, int]], used: list[int], key: bytes) -> None:
    """Forget ``key``'s durable copy, its bytes no longer counted (the manager's lock held)."""
    pos, size = kept.pop(key, (0, 0))
    used[pos] -= size
