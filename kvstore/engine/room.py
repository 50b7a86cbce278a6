"""Room making: which residents go down so that a tier has room, for a put or for a promotion.

Rules 2 and 3 of ``kvstore.engine.placement`` are carried out here: a put that found its tier full
(``make_room``, ``hold_room``) and a tier above its high watermark (``PlacementManager.plan``) send
the coldest residents one tier down, looking past pinned, leased and retained ones, and a promotion
displaces residents it beats by the scorer's margin, or, for a retained entry, unretained residents
and the same owner's lesser retentions (rule 5).

A ``PlacementManager`` holds one ``RoomMaker`` over its own per-tier members and byte counts (the
same objects, not copies) and its lock: ``make`` and a hold's release take that lock, every other
method runs with the manager holding it.
"""

from __future__ import annotations

import threading
from typing import Callable, Container, Iterator, Sequence

from kvstore.engine.heat import Scorer
from kvstore.engine.heat_order import HeatOrder
from kvstore.engine.placement_types import MoveOrder, PlacementConfig, Resident, TierPolicy

__all__ = ["RoomHold", "RoomMaker", "LOOK_PER_ORDER"]

LOOK_PER_ORDER = 4
"""A bounded demotion looks at up to this many residents per order it may place."""


class RoomHold:
    """Room made in a tier for one write on its way (``PlacementManager.hold_room``).

    Until ``release`` (or the end of a ``with`` block), placement counts ``nbytes`` as
    already in ``tier`` and the entries ``orders`` send out of it as already gone, so a
    concurrent put asks for room of its own. Release it once the write has been indexed
    or has failed; releasing twice is harmless.
    """

    __slots__ = ("tier", "nbytes", "orders", "_maker")

    def __init__(self, maker: "RoomMaker", tier: int, nbytes: int, orders: list[MoveOrder]) -> None:
        self.tier = tier
        """Position of the tier in placement's (and the store's) tier list."""
        self.nbytes = nbytes
        self.orders = orders
        self._maker: RoomMaker | None = maker

    def release(self) -> None:
        maker, self._maker = self._maker, None
        if maker is not None:
            maker._release(self)

    def __enter__(self) -> "RoomHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RoomMaker:
    """Victim choice and room making over a ``PlacementManager``'s records.

    Args:
        members: the manager's residents of each tier, by key.
        order: the same residents of each tier, coldest first (the manager keeps it).
        used: the bytes the manager counts in each tier.
        incoming: the bytes of held writes not yet indexed, per tier (``hold_room``).
        leaving: keys a held ``make_room`` or ``plan`` ordered out and not moved yet: not picked again.
        lock: the manager's lock.
    """

    __slots__ = ("tiers", "config", "scorer", "clock", "lock", "pos", "members", "order", "used", "incoming",
                 "leaving", "resume", "walked_all", "pass_found")

    def __init__(self, tiers: Sequence[TierPolicy], config: PlacementConfig, scorer: Scorer,
                 clock: Callable[[], float], lock: threading.Lock, *, members: list[dict[bytes, Resident]],
                 order: list[HeatOrder], used: list[int], incoming: list[int], leaving: set[bytes]) -> None:
        self.tiers = tiers
        self.config = config
        self.scorer = scorer
        self.clock = clock
        self.lock = lock
        self.pos = {t.name: i for i, t in enumerate(tiers)}
        self.members = members
        self.order = order
        self.used = used
        self.incoming = incoming
        self.leaving = leaving
        self.resume: dict[tuple[int, bool], tuple] = {}
        """Where the next bounded walk of a tier starts (absent: at the coldest), per tier and kind
        of walk (a drain, or the spill's "colder than a new block"): set only by a walk that spent
        all its looks on residents that could not go (pinned, leased, retained) and ordered none,
        just past the last of them, and used by one walk only: the walk after starts at the
        coldest again, so a resident passed over that can go now waits a round at most."""
        self.walked_all = [False] * len(tiers)
        """Per tier, whether the last demotion ended a pass over every resident, coldest to
        hottest (in one walk or, bounded, several) that ordered none down."""
        self.pass_found: dict[tuple[int, bool], bool] = {}
        """Per tier and kind of walk, whether the bounded pass under way has ordered any down."""

    def make(self, tier: str, nbytes: int, *, force: bool, hold: bool) -> RoomHold:
        """Room for ``nbytes`` in ``tier``, as ``PlacementManager.hold_room`` makes it; without ``hold``,
        as ``make_room`` does (a hold that holds nothing: its orders only)."""
        now = self.clock()
        with self.lock:
            i = self.pos[tier]
            t = self.tiers[i]
            need = self.used[i] + self.incoming[i] + nbytes - t.capacity_bytes
            if force:
                need = max(need, nbytes)
            orders: list[MoveOrder] = []
            if need > 0:
                evict = i == 0 and self.config.full_top == "evict"  # drop, not a lower-tier write, on the put's path
                reason = (f"evicted: {t.name} full for a {nbytes}-byte put (full_top=evict)" if evict
                          else f"demoted: {t.name} full for a {nbytes}-byte put")
                orders = self.demote(i, need, now, list(self.used), set(self.leaving), reason,
                                     respect_residency=False, evict=evict)
            room = RoomHold(self, i, nbytes, orders)
            if not hold:
                room._maker = None
                return room
            self.incoming[i] += nbytes
            self.leaving.update(order.key for order in orders)
            return room

    def _release(self, room: RoomHold) -> None:
        with self.lock:
            self.incoming[room.tier] -= room.nbytes
            self.leaving.difference_update(order.key for order in room.orders)  # gone, or refused: it stays

    def settling(self, r: Resident, now: float, up: bool) -> bool:
        """Residency forbids this move: it would send ``r`` back the way it came
        within ``min_residency_s``. That is the ping-pong; a fresh write may go
        down at once, and a demoted entry may go further down."""
        return (self.config.hysteresis and r.came == (-1 if up else 1)
                and now - r.since_s < self.config.min_residency_s)

    def beats(self, a: float, b: float) -> bool:
        return self.scorer.beats(a, b) if self.config.hysteresis else a > b

    def coldest(self, i: int, ordered: Container[bytes], after: tuple | None = None,
                ) -> Iterator[tuple[float, bytes, Resident]]:
        """Residents of tier ``i`` not yet ordered, coldest first (those ranked after ``after``, a
        position from ``HeatOrder.position``, when given): read off the tier's kept order, so the k
        coldest cost O(k) plus the ordered ones skipped, not a sort of the tier."""
        members = self.members[i]
        for score, key in self.order[i].walk(after):
            if key not in ordered:
                yield score, key, members[key]

    def forget_walk(self, i: int) -> None:
        """Tier ``i``'s next bounded walks start at the coldest: it is under its low watermark, or
        its order was rebuilt on another scale (a scorer that switched memories)."""
        for drain in (True, False):
            self.resume.pop((i, drain), None)
            self.pass_found.pop((i, drain), None)
        self.walked_all[i] = False

    def demote(self, i: int, need: float, now: float, projected: list[int], ordered: set[bytes],
               reason: str, *, respect_residency: bool, evict: bool = False,
               colder_than: float | None = None, limit: int | None = None) -> list[MoveOrder]:
        """The coldest residents of tier ``i`` sent one tier down (or out) until ``need`` bytes are
        freed; with ``colder_than``, only residents that score beats by the margin; with
        ``limit``, at most that many orders, from at most ``LOOK_PER_ORDER`` times as many
        residents looked at (a tier whose coldest are pinned is not walked whole each round)."""
        dst = self.tiers[i + 1].name if i + 1 < len(self.tiers) and not evict else None
        why = reason if dst else reason.replace("demoted:", "evicted:", 1)
        orders: list[MoveOrder] = []
        freed = 0
        if limit is None:
            walk = self.coldest(i, ordered)
        else:
            # Bounded: a walk that spends its looks on residents that cannot go leaves the next one
            # a place to start past them, so a run of pinned or retained cold residents longer than
            # one round's looks is crossed over rounds, not walked again from the coldest each time.
            cursor = (i, colder_than is None)
            after = self.resume.pop(cursor, None)
            if after is None:
                self.pass_found[cursor] = False
            walk, looks, last = self.coldest(i, ordered, after), LOOK_PER_ORDER * limit, None
        self.walked_all[i] = False
        for score, key, r in walk:
            if freed >= need or (colder_than is not None and not self.beats(colder_than, score)):
                break
            if limit is not None:
                if len(orders) >= limit:
                    break
                if looks <= 0:
                    if not orders:
                        self.resume[cursor] = self.order[i].position(last)
                    break
                looks -= 1
                last = key
            if r.held(now) or r.retained(now):
                continue  # pinned, leased or retained: look past it
            if respect_residency and self.settling(r, now, up=False):
                break  # the coldest must stay a while: sending hotter ones down instead would be worse
            orders.append(self.order_down(i, key, r, why, projected, ordered, evict=evict))
            freed += r.size
        else:  # walked to the hottest: a pass (in one walk or, bounded, several) is over
            if limit is None:
                self.walked_all[i] = not orders
            else:
                self.walked_all[i] = not (self.pass_found[cursor] or orders)
                self.pass_found.pop(cursor, None)
            return orders
        if limit is not None and orders:
            self.pass_found[cursor] = True
        return orders

    def order_down(self, i: int, key: bytes, r: Resident, reason: str, projected: list[int],
                   ordered: set[bytes], *, evict: bool = False) -> MoveOrder:
        dst = self.tiers[i + 1].name if i + 1 < len(self.tiers) and not evict else None
        ordered.add(key)
        projected[i] -= r.size
        if dst is not None:
            projected[i + 1] += r.size
        return MoveOrder(key, self.tiers[i].name, dst, r.size, reason)

    def displace(self, score: float, need: int, victims, now: float, projected: list[int],
                 ordered: set[bytes]) -> tuple[list[MoveOrder], int, float] | None:
        """Demotions of top-tier residents colder than ``score`` (by the margin, with
        hysteresis) that free ``need`` bytes; None, and nothing ordered, when there are not enough."""
        picked = []
        freed = 0
        while freed < need:
            victim = next(victims, None)
            if victim is None or not self.beats(score, victim[0]):
                return None  # an unbeaten victim ends the search: the ones after it are hotter
            picked.append(victim)
            freed += victim[2].size
        reason = f"demoted: displaced from {self.tiers[0].name} by a hotter entry"
        orders = [self.order_down(0, key, r, f"{reason} (score {s:.3g} < {score:.3g})", projected, ordered)
                  for s, key, r in picked]
        return orders, freed, picked[-1][0]

    def displace_for_retained(self, r: Resident, need: int, now: float, projected: list[int],
                              ordered: set[bytes]) -> tuple[list[MoveOrder], int] | None:
        """Demotions that free ``need`` bytes of the top tier for retained ``r``: unretained
        residents first, coldest first, whatever their heat; then retentions of the same owner
        that rank below it (lower priority, then sooner expiry). None, and nothing ordered,
        when those are not enough."""
        picked: list[tuple[str, bytes, Resident]] = []
        freed = 0
        for _, key, v in self.coldest(0, ordered):
            if freed >= need:
                break
            if v.held(now) or v.retained(now):
                continue
            picked.append(("demoted: made room for a retained entry", key, v))
            freed += v.size
        if freed < need:
            rank = (r.retain_priority, r.retained_until)
            same = sorted(((v.retain_priority, v.retained_until), key, v) for key, v in self.members[0].items()
                          if key not in ordered and v.retain_owner == r.retain_owner and v.retained(now)
                          and not v.held(now))
            for vrank, key, v in same:
                if freed >= need or vrank >= rank:
                    break
                picked.append((f"demoted: {r.retain_owner!r}'s sooner-expiring retention yields", key, v))
                freed += v.size
        if freed < need:
            return None
        orders = [self.order_down(0, key, v, why, projected, ordered) for why, key, v in picked]
        return orders, freed
