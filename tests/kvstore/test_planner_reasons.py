"""Every decision's reason names its choice first: ``"<verb> <choice>: <why>"``.

A user saw choice ``shm`` with the reason ``kept: http (1.64 ms) beats shm (4.54 ms) by the
margin``: the hysteresis window kept shm, but the text read as if http had been kept. Reasons are
now built from a code and the choice (``kvstore.decisions.reason_text``); these tests read the
choice back out of the text (``reason_choice``) for decisions in many generated situations, and
walk through every reason code once.
"""

from __future__ import annotations


from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.decisions import REASONS, reason_choice
from kvstore.planner import RECOMPUTE, CostModel, Decision, Option, Planner
from kvstore.policy import Policy

MB = 1 << 20
OPTIONS = [Option("shm"), Option("http"), Option("flight"), Option("http", "int8")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _check(d: Decision) -> None:
    assert d.reason_code in REASONS, d
    assert reason_choice(d.reason) == d.choice, (d.reason_code, d.choice, d.reason)
    assert d.reason.startswith(f"{REASONS[d.reason_code]} {d.choice}: "), d.reason


times = st.floats(min_value=1e-5, max_value=2.0, allow_nan=False, allow_infinity=False)
sizes = st.sampled_from([4096, 8192, 64 << 10, 1 * MB, 4 * MB, 64 * MB])


@settings(max_examples=200)
@given(data=st.data())
def test_every_reason_names_the_choice_first(data):
    clock = Clock()
    planner = Planner(CostModel(clock), clock=clock)
    policy = Policy(margin_frac=data.draw(st.sampled_from([0.0, 0.1, 0.2, 0.5])),
                    window_s=data.draw(st.sampled_from([0.0, 1.0, 5.0])),
                    ewma_alpha=data.draw(st.sampled_from([0.3, 1.0])),
                    explore_after_s=data.draw(st.sampled_from([0.0, 5.0, 30.0])),
                    recompute=data.draw(st.booleans()),
                    codecs=data.draw(st.sampled_from([("raw",), ("raw", "int8")])),
                    slo_s=data.draw(st.sampled_from([None, 0.001, 0.1])))
    if data.draw(st.booleans()):
        planner.model.set_prefill_rate("fp", data.draw(st.sampled_from([1000.0, 1e5, 1e7])))
    for _ in range(data.draw(st.integers(0, 6))):  # probes and real transfers seen before
        opt = data.draw(st.sampled_from(OPTIONS))
        planner.model.observe(data.draw(st.sampled_from(["get", "put"])), opt.name, data.draw(sizes),
                              data.draw(times), policy, real=data.draw(st.booleans()),
                              path=data.draw(st.sampled_from(["", "cached"])))
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["get", "put"]))
        opts = data.draw(st.lists(st.sampled_from(OPTIONS), min_size=1, max_size=4, unique=True))
        opts = [o for o in opts if o.codec in (policy.codecs if op == "get" else ("raw",))] or [Option("http")]
        nbytes = data.draw(sizes)
        queued = {o.medium: data.draw(st.lists(sizes, max_size=2)) for o in opts if data.draw(st.booleans())}
        d = planner.decide(op, opts, nbytes=nbytes, tokens=data.draw(st.sampled_from([0, 1, 64, 4096])),
                           policy=policy, fingerprint="fp", queued=queued,
                           free_bytes=data.draw(st.sampled_from([None, 2 * MB, 1 << 30])),
                           paths=data.draw(st.sampled_from([None, {"shm": "cached"}])))
        _check(d)
        if d.choice != RECOMPUTE and data.draw(st.booleans()):
            failed = data.draw(st.booleans()) and data.draw(st.booleans())
            planner.finish(d, policy, actual_s=data.draw(times), actual_bytes=0 if failed else nbytes,
                           error="ConnectionFailed('injected')" if failed else None)
        clock.now += data.draw(st.sampled_from([0.0, 0.5, 2.0, 6.0, 40.0]))
    for d in planner.log.records(1000):
        _check(d)


def _two(planner: Planner, policy: Policy, shm_s: float, http_s: float, nbytes: int = 4 * MB) -> None:
    for name, s in (("shm", shm_s), ("http", http_s)):
        for _ in range(3):
            planner.model.observe("get", name, nbytes, s, policy)


def test_each_reason_code_in_turn():
    """One situation per code, each reason checked for its form, and every code met."""
    seen: dict[str, str] = {}
    opts = [Option("shm"), Option("http")]

    def take(d: Decision, code: str) -> Decision:
        _check(d)
        assert d.reason_code == code, (code, d.reason)
        seen[code] = d.reason
        return d

    clock = Clock()
    policy = Policy(media=("shm", "http"), window_s=5.0, margin_frac=0.2, ewma_alpha=1.0, explore_after_s=86400.0)
    planner = Planner(CostModel(clock), clock=clock)
    take(planner.decide("get", opts, nbytes=4096, tokens=1, policy=policy), "small")
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "unmeasured")
    _two(planner, policy, 0.002, 0.004)
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy, free_bytes=MB), "infeasible")
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "best")
    _two(planner, policy, 0.0022, 0.002)  # http a little faster: under the margin
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "kept")
    _two(planner, policy, 0.004, 0.001)  # http far faster: its window starts
    d = take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "waiting")
    assert d.choice == "shm" and "http" in d.reason and "takes over once that holds for the window" in d.reason
    clock.now += 6.0
    d = take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "switched")
    assert d.choice == "http" and "from shm" in d.reason
    take(planner.decide("get", [Option("shm")], nbytes=4 * MB, tokens=1, policy=policy), "replaced")
    # shm is held again (the only option last time); 16 MiB in flight over it: http, this once.
    d = take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy, queued={"shm": [16 * MB]}),
             "queue")
    assert d.choice == "http" and "this transfer only" in d.reason
    planner.model.set_prefill_rate("fp", 1000.0)  # 1 token a ms
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy, fingerprint="fp"), "recompute")
    # every block in the co-located arena: shm, whatever the estimates say of http
    d = take(planner.decide("get", opts, nbytes=4 * MB, tokens=1000, policy=policy, paths={"shm": "indexed"}),
             "arena")
    assert d.choice == "shm" and {c.option for c in d.candidates} == {"shm", "http"}

    # Recompute beats the held option, and the best fetch beats recompute.
    clock2 = Clock()
    planner = Planner(CostModel(clock2), clock=clock2)
    _two(planner, policy, 0.008, 0.0095)
    assert planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy).choice == "shm"
    _two(planner, policy, 0.010, 0.0085)
    planner.model.set_prefill_rate("fp", 1000.0)
    take(planner.decide("get", opts, nbytes=4 * MB, tokens=9, policy=policy, fingerprint="fp"), "beats-recompute")

    # A first choice made on probes alone, then real transfers show another better.
    clock3 = Clock()
    planner = Planner(CostModel(clock3), clock=clock3)
    planner.model.observe("get", "shm", 4 * MB, 0.001, policy, real=False)
    planner.model.observe("get", "http", 4 * MB, 0.002, policy, real=False)
    assert planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy).choice == "shm"
    planner.model.observe("get", "http", 4 * MB, 0.0005, policy)  # real, and twice as fast as shm's probe
    d = take(planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=policy), "proven")
    assert d.choice == "http" and "from shm" in d.reason

    # An option known from a probe only gets explored once exploiting has paid for it.
    clock4 = Clock()
    explore = Policy(media=("shm", "http"), explore_after_s=30.0)
    planner = Planner(CostModel(clock4), clock=clock4)
    planner.model.observe("get", "shm", 4 * MB, 0.001, explore)
    planner.model.observe("get", "http", 4 * MB, 0.0015, explore, real=False)
    for _ in range(10):
        d = planner.decide("get", opts, nbytes=4 * MB, tokens=1, policy=explore)
        _check(d)
        if d.explore:
            take(d, "explore")
            break
        planner.finish(d, explore, actual_s=0.001, actual_bytes=4 * MB)
    assert set(seen) == set(REASONS), sorted(set(REASONS) - set(seen))
