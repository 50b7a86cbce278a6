"""Each tier's kept heat order (``HeatOrder``) against a sort done afresh: on its own under
random puts and discards, and inside the placement manager under random writes, reads, moves,
removals and a scorer that switches memories (every score changes at once)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.engine.heat import AdaptiveRate
from kvstore.engine.heat_order import HeatOrder
from kvstore.engine.placement import MoveOrder, PlacementConfig, PlacementManager, TierPolicy

KEYS = [b"k%03d" % i for i in range(12)]

ops = st.lists(st.tuples(st.sampled_from(["put", "discard"]), st.sampled_from(KEYS),
                         st.sampled_from([-np.inf, 0.0, 1.0, 1.5, 2.0]), st.integers(0, 3)), max_size=60)


@given(ops)
@settings(max_examples=150, deadline=None)
def test_the_order_is_a_fresh_sort_after_any_puts_and_discards(steps):
    order, truth = HeatOrder(), {}
    for op, key, score, depth in steps:
        if op == "put":
            order.put(key, score, depth)
            truth[key] = (score, -depth, key)
        else:
            order.discard(key)
            truth.pop(key, None)
    assert list(order) == [(s, k) for s, _, k in sorted(truth.values())]
    assert len(order) == len(truth)


def _fresh(m: PlacementManager, i: int) -> list[tuple[float, bytes]]:
    members = m._members[i]
    return [(s, k) for s, _, k in sorted((r.heat.score, -r.depth, k) for k, r in members.items())]


def test_the_managers_order_follows_writes_reads_moves_removals_and_a_scorer_switch():
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    scorer = AdaptiveRate(min_switch_s=0.0, min_lead=1.0, switch_margin_frac=0.0, interval_s=0.0)
    m = PlacementManager([TierPolicy("top", 4000), TierPolicy("low", 100_000)], scorer=scorer,
                         config=PlacementConfig(), clock=clock)
    rng = np.random.default_rng(7)
    keys = [b"key%03d" % i for i in range(60)]
    for step in range(3000):
        clock.now += float(rng.uniform(0, 2))
        key = keys[rng.integers(len(keys))]
        r = m._res.get(key)
        what = rng.integers(6)
        if r is None or what == 0:
            m.admitted(key, ["top", "low"][rng.integers(2)], 100, depth=int(rng.integers(4)))
        elif what <= 2:
            m.accessed([key], [int(rng.integers(1, 3))])
        elif what == 3:
            src = m.tiers[r.tier].name
            m.moved(MoveOrder(key, src, "low" if src == "top" else "top", r.size, "test"))
        elif what == 4:
            m.removed(key)
        else:
            scorer._fresh = [0, 50] if scorer.active == 0 else [50, 0]  # the other memory leads
            for o in m.plan():
                m.moved(o)
        for i in range(2):
            assert list(m._order[i]) == _fresh(m, i), (step, i)
    assert scorer.switches > 0
