"""PlacementManager on its own: promotion, watermarks, hysteresis, pins, leases, explain, make_room.

A fake clock drives the manager and ``apply`` plays the mover: it carries each
order out with ``moved`` (making room in a full destination first), as a store
or the bench's simulator would.
"""

import math

import numpy as np
import pytest

from kvstore.errors import InvalidInput
from kvstore.engine.heat import LRU, AdaptiveRate, DecayedRate, Heat
from kvstore.engine.placement import MoveOrder, PlacementConfig, PlacementManager, TierPolicy, default_scorer

B = 100  # bytes per entry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> bytes:
    return b"k%04d" % i


def manager(top_blocks=10, low_blocks=100, *, high=0.9, low=0.5, single=False, **config):
    clock = Clock()
    tiers = [TierPolicy("top", top_blocks * B, high_watermark_frac=high, low_watermark_frac=low)]
    if not single:
        tiers.append(TierPolicy("low", low_blocks * B))
    return PlacementManager(tiers, config=PlacementConfig(**config), clock=clock), clock


def apply(m: PlacementManager, orders: list[MoveOrder]) -> int:
    """Carry orders out in order; returns how many applied."""
    done = 0
    for order in orders:
        if m.tier_of(order.key) != order.src:
            continue
        if order.dst is not None:
            done += apply(m, m.make_room(order.dst, order.size))
        m.moved(order)
        done += 1
    return done


def touch(m: PlacementManager, clock: Clock, keys, times: int = 1, dt: float = 0.01) -> None:
    for _ in range(times):
        for k in keys:
            clock.now += dt
            m.accessed([k])


def test_lower_tier_hit_is_promoted_into_room_and_explained():
    m, clock = manager()
    m.admitted(key(1), "low", B)
    touch(m, clock, [key(1)])
    orders = m.plan()
    assert [(o.key, o.src, o.dst) for o in orders] == [(key(1), "low", "top")]
    assert orders[0].reason.startswith("promoted") and "room" in orders[0].reason
    apply(m, orders)
    info = m.explain(key(1))
    assert info["tier"] == "top" and info["accesses"] == 2
    assert [mv["reason"] for mv in info["moves"]] == [orders[0].reason]
    assert info["moves"][0]["src"] == "low" and info["moves"][0]["dst"] == "top"
    assert m.counters()["promoted"] == 1 and m.counters()["bytes_moved"] == B


def test_above_high_watermark_demotes_coldest_down_to_low_watermark():
    m, clock = manager(high=0.9, low=0.5)
    for i in range(10):
        clock.now += 1
        m.admitted(key(i), "top", B)  # top 100% full
    touch(m, clock, [key(i) for i in range(5, 10)], times=3)  # 5..9 are hot
    orders = m.plan()
    assert all(o.dst == "low" for o in orders)
    assert {o.key for o in orders} == {key(i) for i in range(5)}  # the coldest five, down to 50%
    apply(m, orders)
    assert m.usage()["top"] <= 0.5 * 10 * B
    assert "above high watermark" in m.explain(key(0))["moves"][-1]["reason"]
    assert m.plan() == []  # under the high watermark: nothing more to do


def test_hot_candidate_displaces_the_coldest_resident_demotion_first():
    m, clock = manager(high=1.0, low=1.0, min_residency_s=0)  # no room made ahead: only the exchange
    for i in range(10):
        m.admitted(key(i), "top", B)
    touch(m, clock, [key(i) for i in range(1, 10)], times=3)  # key 0 is the coldest
    m.admitted(key(99), "low", B)
    touch(m, clock, [key(99)], times=6)
    orders = m.plan()
    assert [(o.key, o.dst) for o in orders] == [(key(0), "low"), (key(99), "top")]
    assert "displaced" in orders[0].reason and "beats the coldest" in orders[1].reason
    apply(m, orders)
    assert m.tier_of(key(99)) == "top" and m.tier_of(key(0)) == "low"
    assert m.usage()["top"] == 10 * B


def test_margin_holds_back_a_barely_hotter_candidate():
    def run(hysteresis: bool) -> str | None:
        clock = Clock()
        tiers = [TierPolicy("top", 10 * B, 1.0, 0.9), TierPolicy("low", 100 * B)]
        m = PlacementManager(tiers, scorer=DecayedRate(60, margin_frac=0.2, max_count=math.inf),
                             config=PlacementConfig(hysteresis=hysteresis, min_residency_s=0), clock=clock)
        for i in range(10):
            m.admitted(key(i), "top", B)
        m.admitted(key(99), "low", B)
        touch(m, clock, [key(i) for i in range(10)] + [key(99)], times=8)  # 9 accesses each
        touch(m, clock, [key(99)])  # 10 against 9: hotter, by less than the 20% margin
        apply(m, m.plan())
        return m.tier_of(key(99))

    assert run(hysteresis=False) == "top"
    assert run(hysteresis=True) == "low"
    s = DecayedRate(60, margin_frac=1.0)
    assert s.beats(math.log2(2.5), 0.0) and not s.beats(math.log2(1.5), 0.0)


def test_min_residency_keeps_a_promoted_entry_but_make_room_may_move_it():
    m, clock = manager(high=0.9, low=0.5, min_residency_s=5.0)
    m.admitted(key(0), "low", B)
    touch(m, clock, [key(0)])
    apply(m, m.plan())
    assert m.tier_of(key(0)) == "top"
    for i in range(1, 10):
        m.admitted(key(i), "top", B)
    touch(m, clock, [key(i) for i in range(1, 10)], times=5)  # key 0 is now the coldest, but just arrived
    assert m.plan() == []  # the watermark waits rather than send hotter entries down instead
    room = m.make_room("top", B)  # a put is waiting: residency does not hold it up
    assert [o.key for o in room] == [key(0)]
    clock.now += 5.0
    assert key(0) in {o.key for o in m.plan()}


def test_hysteresis_cuts_moves_on_an_oscillating_pattern():
    def moves(hysteresis: bool) -> tuple[int, float]:
        m, clock = manager(top_blocks=30, low_blocks=200, high=0.9, low=0.75, hysteresis=hysteresis)
        sets = [[key(i) for i in range(20)], [key(i) for i in range(100, 120)]]
        for k in sets[0] + sets[1]:
            m.admitted(k, "low", B)
        hits = total = 0
        for phase in range(40):  # two sets of 20 (2/3 of the top tier each) take turns every 2 s
            for step in range(200):
                clock.now += 0.01
                k = sets[phase % 2][(step * 7 + phase) % 20]
                hits += m.tier_of(k) == "top"
                total += 1
                m.accessed([k])
                if step % 25 == 0:
                    apply(m, m.plan())
        c = m.counters()
        return c["promoted"] + c["demoted"], hits / total

    (on, hit_on), (off, _) = moves(True), moves(False)
    assert on <= 0.2 * off, (on, off)
    assert hit_on >= 0.6  # a stable mix: one set and a third of the other stay in the top tier


def test_pinned_entries_never_leave_even_for_make_room():
    m, clock = manager(high=0.9, low=0.5)
    for i in range(10):
        m.admitted(key(i), "top", B)
    touch(m, clock, [key(i) for i in range(5, 10)], times=3)
    for i in range(3):
        assert m.pin(key(i))  # the three coldest
    assert m.is_pinned(key(0)) and m.explain(key(0))["pinned"]
    apply(m, m.plan())
    assert all(m.tier_of(key(i)) == "top" for i in range(3))
    assert m.usage()["top"] <= 0.5 * 10 * B
    room = m.make_room("top", 8 * B)  # asks for more than the unpinned entries hold
    assert not {o.key for o in room} & {key(0), key(1), key(2)}
    apply(m, room)
    assert all(m.tier_of(key(i)) == "top" for i in range(3))
    assert m.unpin(key(0)) and not m.is_pinned(key(0))
    assert key(0) in {o.key for o in m.make_room("top", 8 * B)}


def test_pin_with_ttl_expires():
    m, clock = manager(single=True, high=1.0, low=1.0)
    m.admitted(key(0), "top", 10 * B)
    assert m.pin(key(0), ttl_s=2.0)
    assert m.make_room("top", B) == []
    clock.now += 2.5
    assert not m.is_pinned(key(0))
    assert [o.key for o in m.make_room("top", B)] == [key(0)]
    with pytest.raises(InvalidInput):
        m.pin(key(0), ttl_s=0)
    assert not m.pin(b"unknown")


def test_leased_entries_do_not_move_either_way():
    m, clock = manager(high=0.9, low=0.5, min_residency_s=0)
    for i in range(10):
        m.admitted(key(i), "top", B)
    touch(m, clock, [key(i) for i in range(5, 10)], times=3)
    m.admitted(key(99), "low", B)
    assert m.lease(key(0)) and m.lease(key(99))
    touch(m, clock, [key(99)], times=10)
    orders = m.plan()
    assert key(0) not in {o.key for o in orders} and key(99) not in {o.key for o in orders}
    assert key(0) not in {o.key for o in m.make_room("top", 10 * B)}
    m.release(key(0))
    m.release(key(99))
    touch(m, clock, [key(99)])
    assert {key(0), key(99)} <= {o.key for o in m.plan()}


def test_make_room_frees_enough_and_the_last_tier_evicts():
    m, clock = manager(single=True, high=1.0, low=1.0)
    for i in range(10):
        clock.now += 1
        m.admitted(key(i), "top", B)
    touch(m, clock, [key(i) for i in range(3, 10)], times=2)
    orders = m.make_room("top", 3 * B)
    assert sum(o.size for o in orders) >= 3 * B
    assert {o.key for o in orders} == {key(0), key(1), key(2)}  # the coldest
    assert all(o.dst is None and o.reason.startswith("evicted") for o in orders)
    apply(m, orders)
    assert m.tier_of(key(0)) is None and m.explain(key(0)) is None
    assert m.counters()["evicted"] == 3 and m.counters()["entries"] == 7
    assert m.usage()["top"] == 7 * B
    assert m.make_room("top", 3 * B) == []  # room enough now
    assert m.log(2)[-1].dst is None


def test_make_room_cascades_through_tiers():
    m, clock = manager(top_blocks=2, low_blocks=2)
    for i in range(2):
        m.admitted(key(i), "top", B)
        m.admitted(key(10 + i), "low", B)
    orders = m.make_room("top", B)
    assert len(orders) == 1 and orders[0].dst == "low"
    assert apply(m, orders) == 2  # the low tier had to evict first
    assert m.counters()["evicted"] == 1 and m.usage() == {"top": B, "low": 2 * B}


def test_explain_keeps_a_bounded_move_history():
    m, clock = manager(entry_log=3, min_residency_s=0)
    m.admitted(key(0), "low", B)
    for n in range(5):
        apply(m, [MoveOrder(key(0), "low", "top", B, f"promoted: test {n}")])
        apply(m, [MoveOrder(key(0), "top", "low", B, f"demoted: test {n}")])
    moves = m.explain(key(0))["moves"]
    assert [mv["reason"] for mv in moves] == ["demoted: test 3", "promoted: test 4", "demoted: test 4"]
    assert len(m.log(100)) == 10


def test_events_for_unknown_keys_are_ignored():
    m, _ = manager()
    m.accessed([b"nope"])
    m.removed(b"nope")
    m.moved(MoveOrder(b"nope", "low", "top", B, "promoted: x"))
    m.release(b"nope")
    assert m.counters()["entries"] == 0 and m.tier_of(b"nope") is None


def test_lru_scorer_without_hysteresis_promotes_every_lower_hit():
    clock = Clock()
    m = PlacementManager([TierPolicy("top", 3 * B, 1.0, 1.0), TierPolicy("low", 10 * B)], scorer=LRU(),
                         config=PlacementConfig(hysteresis=False), clock=clock)
    for i in range(3):
        clock.now += 1
        m.admitted(key(i), "top", B)
    m.admitted(key(9), "low", B)
    clock.now += 1
    m.accessed([key(9)])
    orders = m.plan()
    assert [(o.key, o.dst) for o in orders] == [(key(0), "low"), (key(9), "top")]  # least recent goes


def test_decayed_rate_saturates_so_a_cooled_hot_entry_yields():
    s = DecayedRate(half_life_s=10.0, max_count=4.0)
    old, new = Heat(), Heat()
    for t in range(100):
        s.touch(old, t * 0.1)  # 100 accesses in 10 s
    assert 2.0 ** (old.score - 9.9 / 10.0) == pytest.approx(4.0)
    for t in range(30):  # then its traffic moves on: one access a second elsewhere
        s.touch(new, 10.0 + t)
    assert s.beats(new.score, old.score)  # well within a few half-lives
    with pytest.raises(InvalidInput):
        DecayedRate(max_count=0.5)


def _drive(m: PlacementManager, clock: Clock, draw, seconds: float, rate: int = 100) -> None:
    """``rate`` reads per second of keys from ``draw()``, with ``plan`` every 0.25 s (as the mover)."""
    next_plan = clock.now + 0.25
    for _ in range(int(seconds * rate)):
        clock.now += 1.0 / rate
        if clock.now >= next_plan:
            apply(m, m.plan())
            next_plan += 0.25
        m.accessed([key(draw())])


def _skewed_manager(n: int = 400, top: int = 40):
    m, clock = manager(top_blocks=top, low_blocks=2 * n, high=0.95, low=0.9)
    for i in range(n):
        clock.now += 0.001
        m.admitted(key(i), "low", B)
    return m, clock


def test_adaptive_rate_follows_the_long_memory_on_steady_skew_and_the_short_one_after_a_shift():
    rng = np.random.default_rng(7)
    m, clock = _skewed_manager()
    scorer = m.scorer
    assert isinstance(scorer, AdaptiveRate) and scorer.active == 0  # starts on the short memory
    p = 1.0 / np.arange(1, 401)
    p /= p.sum()
    zipf = iter(rng.choice(400, size=60_000, p=p).tolist())
    _drive(m, clock, lambda: next(zipf), 200)
    assert scorer.active == 1, scorer.describe()  # a steady popularity: the long memory ranks the edge better
    assert scorer.switches == 1  # and it stayed there
    state = m.scorer_state()
    assert state["active_half_life_s"] == 300.0 and state["shadow_hits"][1] > state["shadow_hits"][0]
    for i in range(400):  # every score was rewritten to the long memory's
        parts = m.explain(key(i))["heat_memories"]
        assert m._res[key(i)].heat.score == parts[1]

    # The hot set moves to keys that were cold; what the long memory remembers is now wrong.
    hot = rng.choice(np.arange(200, 400), size=30, replace=False).tolist()
    _drive(m, clock, lambda: int(hot[rng.integers(30)]) if rng.random() < 0.9 else int(rng.integers(400)), 60)
    assert scorer.active == 0, scorer.describe()
    assert sum(m.tier_of(key(k)) == "top" for k in hot) >= 25  # and the new hot set is in the fast tier


def test_adaptive_rate_does_not_switch_while_the_memories_agree():
    m, clock = _skewed_manager()
    hot = list(range(20))
    rng = np.random.default_rng(3)
    _drive(m, clock, lambda: hot[rng.integers(20)], 120)  # a small fixed hot set: both memories see the same
    assert m.scorer.switches == 0, m.scorer.describe()


def test_adaptive_rate_switches_at_most_every_min_switch_s():
    s = AdaptiveRate(min_switch_s=50.0, min_lead=1.0, switch_margin_frac=0.0, interval_s=0.0)
    heats = [Heat() for _ in range(10)]
    for h in heats:
        s.touch(h, 0.0)
    s.calibrate(heats, 5, 10, 0.0)
    s._fresh = [0, 10]  # the long memory leads
    s.calibrate(heats, 5, 10, 1.0)
    assert s.active == 1 and all(h.score == h.parts[1] for h in heats)
    s._fresh = [30, 0]  # now the short one, by far, but too soon
    s.calibrate(heats, 5, 10, 2.0)
    assert s.active == 1
    s.calibrate(heats, 5, 10, 51.0)
    assert s.active == 0 and s.switches == 2
    with pytest.raises(InvalidInput):
        AdaptiveRate(window_s=0)


def test_default_scorer_follows_the_config():
    assert isinstance(default_scorer(PlacementConfig()), AdaptiveRate)
    single = default_scorer(PlacementConfig(long_half_life_s=None, half_life_s=7.0))
    assert isinstance(single, DecayedRate) and single.half_life_s == 7.0


def test_explain_of_an_entry_never_accessed_is_strict_json():
    """Recovery admits frames without an access: no heat yet, and -inf must not reach a JSON answer."""
    import json

    m, _ = manager()
    m.admitted(key(1), "top", B, access=False)
    info = m.explain(key(1))
    assert info["heat_score"] is None and info["heat_memories"] == [] and info["accesses"] == 0
    json.dumps(info, allow_nan=False)


def test_held_room_counts_until_released_and_holds_pick_distinct_victims():
    m, clock = manager(single=True, high=1.0, low=1.0)
    for i in range(10):
        clock.now += 1
        m.admitted(key(i), "top", B)
    a = m.hold_room("top", B)
    b = m.hold_room("top", B)  # a's put has not landed: b needs room of its own
    assert [o.key for o in a.orders] == [key(0)]
    # a's victim still counts until it is gone, so b frees a block more than it needs rather
    # than count on room that is not free yet; never less.
    assert [o.key for o in b.orders] == [key(1), key(2)]
    assert m.make_room("top", B)[0].key == key(3)  # full with both held bytes counted
    apply(m, a.orders + b.orders)
    assert m.make_room("top", B) == []  # 7 stored + 2 held: room for one more
    m.admitted(key(20), "top", B)  # a's write landed and is indexed
    a.release()
    a.release()  # twice is harmless
    m.admitted(key(21), "top", B)
    assert m.make_room("top", B)[0].key == key(3)  # b's bytes still count: 9 + b's + 1 > 10
    b.release()
    assert m.make_room("top", B) == []  # 9 of 10 and nothing held: room


def test_a_held_plan_keeps_its_victims_from_a_puts_make_room_until_settled():
    m, clock = manager(single=True, high=0.9, low=0.8, min_residency_s=0)
    for i in range(10):
        clock.now += 1
        m.admitted(key(i), "top", B)
    orders = m.plan(hold=True)  # above 0.9: evicts the coldest two down to 0.8
    assert [o.key for o in orders] == [key(0), key(1)]
    room = m.hold_room("top", B)  # full, and the round's victims are not this put's room
    assert [o.key for o in room.orders] == [key(2)]
    room.release()
    m.settle(orders)
    assert m.make_room("top", B)[0].key == key(0)


def test_force_frees_room_the_accounting_says_is_free():
    m, clock = manager(single=True, high=1.0, low=1.0)
    for i in range(5):
        clock.now += 1
        m.admitted(key(i), "top", B)
    assert m.make_room("top", B) == []
    assert [o.key for o in m.make_room("top", B, force=True)] == [key(0)]


def _drain_case(blocks: int, *, pinned: int = 0):
    """A top tier of 100 blocks (watermarks 0.9 / 0.5) holding ``blocks``, the ``pinned`` coldest
    pinned; ``evict``: no spill rule sends residents down, only the drain does."""
    m, clock = manager(top_blocks=100, low_blocks=1000, high=0.9, low=0.5, min_residency_s=0, full_top="evict")
    for i in range(blocks):
        m.admitted(key(i), "top", B)
    for i in range(pinned):
        assert m.pin(key(i))
    return m, clock


def test_a_bounded_plan_drains_a_tier_over_rounds_to_its_low_watermark_and_stops_there():
    m, clock = _drain_case(100)
    planned = m.plan(limit=8)
    assert len(planned) == 8 and m.plan(limit=8) == planned  # not carried out: planned again
    rounds = 0
    while orders := m.plan(limit=8):
        assert len(orders) <= 8 and all(o.src == "top" for o in orders)
        apply(m, orders)
        rounds += 1
        assert rounds < 20
    assert m.usage()["top"] == 50 * B and rounds == 7  # 100 -> 50: past the high watermark, 8 a round
    assert m.plan(limit=8) == []  # drained: the tier holds
    for i in range(100, 120):
        m.admitted(key(i), "top", B)  # writes back inside the band: room for more is made ahead
    orders = m.plan()
    assert len(orders) == 20 and all("room for new blocks" in o.reason for o in orders)


def test_a_draining_top_tier_lends_no_room_between_its_watermarks():
    m, clock = _drain_case(95)
    touch(m, clock, [key(i) for i in range(95)], times=20)  # in use: a candidate read once a round never beats them
    m.admitted(key(500), "low", B)
    promoted = []
    while True:
        touch(m, clock, [key(500)])  # read once: not hot enough to displace a resident by the margin
        orders = m.plan(limit=8)
        if any(o.key == key(500) for o in orders):
            promoted.append((m.usage()["top"], orders))
        if not orders:
            break
        apply(m, orders)
    assert len(promoted) == 1 and m.tier_of(key(500)) == "top"
    used, orders = promoted[0]
    assert used <= 50 * B and orders == [o for o in orders if o.key == key(500)]  # only once drained, by itself
    assert "has room" in orders[0].reason


def test_a_bounded_plan_crosses_a_run_of_pinned_residents_over_rounds():
    m, clock = _drain_case(100, pinned=40)  # more pinned than a round of 8 orders looks at (32)
    assert m.plan(limit=8) == []  # 32 looked at, none can go
    orders = m.plan(limit=8)  # this walk starts past them: the drain goes on
    assert [o.key for o in orders] == [key(i) for i in range(40, 48)]
    apply(m, orders)
    for _ in range(20):  # the walk after starts at the coldest again: a round in two moves blocks
        apply(m, m.plan(limit=8))
    assert m.usage()["top"] == 50 * B and {m.tier_of(key(i)) for i in range(40)} == {"top"}
    assert m.plan(limit=8) == []


def test_a_resident_passed_over_that_can_go_now_waits_a_round_at_most():
    m, clock = _drain_case(100, pinned=40)
    assert m.plan(limit=8) == []
    apply(m, m.plan(limit=8))  # from past the pinned run
    m.unpin(key(0))
    assert key(0) in {o.key for o in m.plan(limit=8)}  # the walk after starts at the coldest


def test_a_drain_ends_on_real_use_not_on_what_a_round_planned():
    m, clock = _drain_case(100)
    orders = m.plan()  # unbounded: all 50 planned at once, the projection at the low watermark
    assert len(orders) == 50
    apply(m, orders[:20])  # a mover's budget carried out 20
    assert m.usage()["top"] == 80 * B  # inside the band, but the drain is not over
    assert {o.key for o in m.plan()} == {o.key for o in orders[20:]}


def test_a_draining_top_tier_sends_new_blocks_down_until_it_is_drained():
    m, clock = manager(top_blocks=100, low_blocks=1000, high=0.9, low=0.5, min_residency_s=0)
    for i in range(95):
        m.admitted(key(i), "top", B)
    m.plan(limit=8)  # above the high watermark: draining
    for i in range(85, 95):
        m.removed(key(i))
    assert m.usage()["top"] == 85 * B and m.place_new(B) == "low"  # the band is the drain's room
    while orders := m.plan(limit=8):
        apply(m, orders)
    assert m.usage()["top"] <= 50 * B and m.place_new(B) == "top"


def test_planned_demotions_into_a_tier_do_not_set_it_draining():
    clock = Clock()
    tiers = [TierPolicy(name, 100 * B, high_watermark_frac=0.9, low_watermark_frac=0.5) for name in "abc"]
    m = PlacementManager(tiers, config=PlacementConfig(min_residency_s=0, full_top="evict"), clock=clock)
    for i in range(95):
        m.admitted(key(i), "a", B)
    for i, name in ((100, "b"), (200, "c")):
        for j in range(80):
            m.admitted(key(i + j), name, B)
    assert {o.src for o in m.plan(limit=64)} >= {"a", "b"}  # b's projection passed its high watermark
    for i in range(95):
        m.removed(key(i))  # none of it was carried out, and a is empty now
    assert m.plan(limit=64) == []  # b and c never went past their high watermarks: nothing drains


def test_a_drain_that_only_pinned_residents_hold_up_stops_and_lends_its_room():
    m, clock = _drain_case(95, pinned=70)
    for _ in range(12):  # each round looks at 32: the first ones find only pinned residents
        apply(m, m.plan(limit=8))
    assert m.usage()["top"] == 70 * B  # the drain moved every block it could
    m.admitted(key(500), "low", B)
    for _ in range(5):  # a pass over the pinned residents, a few rounds, finds none that can go
        touch(m, clock, [key(500)])  # read again each round: a candidate not promoted is forgotten
        orders = m.plan(limit=8)
        if orders:
            break
    assert [(o.key, o.dst) for o in orders] == [(key(500), "top")] and "has room" in orders[0].reason


def test_a_zero_byte_candidate_is_promoted_into_a_draining_tier_without_a_search():
    m, clock = _drain_case(95)
    m.admitted(key(500), "low", 0)
    touch(m, clock, [key(500)])
    assert key(500) in {o.key for o in m.plan(limit=8)}


def test_a_promotion_a_round_gave_up_stays_a_candidate():
    m, clock = manager(top_blocks=10, low_blocks=100, high=0.9, low=0.5)
    m.admitted(key(99), "low", B)
    touch(m, clock, [key(99)], times=3)
    orders = m.plan(hold=True)
    assert [o.key for o in orders] == [key(99)]
    m.settle(orders)  # the mover's share ran out before it
    assert [o.key for o in m.plan(hold=True)] == [key(99)]  # planned again without another read
    m.settle([])
    apply(m, orders)
    assert m.tier_of(key(99)) == "top"
    m.settle(orders)  # carried out: nothing to ask again
    assert m.plan() == []


@pytest.mark.parametrize("full_top, room", [("spill", 9), ("evict", 10)])
def test_hold_free_holds_free_room_only_up_to_the_mark_new_blocks_are_admitted_under(full_top, room):
    """A pool's grant: holds while the top tier, with them, stays under its high watermark (its
    capacity where new blocks go up top anyway); nothing is ordered out, and each hold counts
    until it is released."""
    m, _ = manager(top_blocks=10, high=0.9, low=0.5, full_top=full_top)
    for i in range(3):
        m.admitted(key(i), "top", B)
    holds = m.hold_free(B, 20)
    assert len(holds) == room - 3 and all(h.tier == 0 and not h.orders for h in holds)
    assert m.hold_free(B, 1) == []
    assert m.place_new(B) == ("top" if full_top == "evict" else "low")  # the held bytes count
    holds[0].release()
    holds[0].release()  # twice is harmless
    assert len(m.hold_free(B, 5)) == 1
    assert m.hold_free(0, 0) == []
