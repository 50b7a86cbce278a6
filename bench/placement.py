"""``kvstore bench placement``: tier placement policies replayed over access traces.

The real ``PlacementManager`` runs on a simulated clock (nothing sleeps) over
three tiers sized from each trace's working set (its distinct blocks): ``top``
holds 10% of its bytes, ``mid`` 30%, ``last`` all of it, so nothing is lost
and every difference is about which blocks sit in ``top``. Blocks are all
``BLOCK_BYTES`` (KV blocks of one model are equal).

Simulation, one access = one block read, ``ACCESS_RATE_PER_S`` per simulated s:

- a block not yet stored is a put: ``make_room("top")`` orders run, then
  ``admitted`` into ``top``; it counts as a top-tier miss;
- a stored block is a hit when ``tier_of`` says ``top``, else a miss; either
  way ``accessed`` is called;
- every ``PLAN_INTERVAL_S`` simulated seconds ``plan()`` runs, like the
  store's mover; a simulated mover applies each order at once (``moved``),
  first making room in a full destination (cascading; the last tier evicts)
  and skipping orders that went stale;
- the first ``WARMUP_FRAC`` of every trace fills the tiers and is not
  measured (for every policy, Belady included); ``hit_ratio_all`` in the JSON
  counts the whole trace.

The rate is 100 reads/s because placement's knobs are in seconds and what
matters is how they compare with how fast the top tier turns over: a real
node's shm tier (~32k blocks of 2 MiB read at ~5k blocks/s) holds a few to
twenty seconds of reads, and so do these tiers of 250-1,500 blocks at 100/s.

Traces (seeded; full size 40,000 accesses, ``--quick`` a tenth):

==============  ==========================================================
zipf-a          Zipf(a), a = 0.8, 1.0, 1.2, over 5,000 blocks
zipf-1+scan     Zipf 1.0; after every 5,000 of its accesses a sequential
                scan of 2,000 never-seen blocks (longer than ``top``)
shifting-hot    10% of 5,000 blocks take 90% of the accesses (uniform), the
                rest uniform over all; a new random hot set every 10,000
agent-sessions  40 open sessions over 4 system prompts (32 blocks each,
                Zipf 1.0 popularity); a turn reads the prompt, then the
                session's tail, then writes 2 new blocks; sessions start
                with 8 blocks and last a geometric number of turns (mean 10)
oscillation     2,600 cold blocks written once, then two hot sets of 200
                blocks (2/3 of ``top`` each) take turns every 3 s, uniform
==============  ==========================================================

Policies: ``heat`` (the manager's defaults: ``AdaptiveRate`` with
hysteresis), ``lru`` (``LRU`` with hysteresis off: promote on every lower-tier
hit), ``lfu`` (``LFU``), and ``belady``: the offline optimum of a demand cache
of ``top``'s size in blocks, computed from the trace (its "moves" are its
insertions). The control ``heat-nohyst`` is ``heat`` with ``hysteresis=False``
on the oscillation trace.
"""

from __future__ import annotations

import heapq
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np

from kvstore.engine.heat import LFU, LRU
from kvstore.engine.placement import MoveOrder, PlacementConfig, PlacementManager, TierPolicy

__all__ = ["run", "format_table", "belady", "make_traces", "simulate", "Trace", "POLICIES"]

ACCESS_RATE_PER_S = 100
"""Simulated block reads per second (see the module docstring for why)."""
PLAN_INTERVAL_S = 0.25
"""How often the simulated mover plans (the store's default ``interval_s``)."""
OSCILLATION_PHASE_S = 3.0
"""How long each hot set of the oscillation trace lasts."""
WARMUP_FRAC = 0.1
"""Leading share of every trace that fills the tiers and is not measured."""
BLOCK_BYTES = 2 << 20
"""A 16-token KV block of a 7B-class GQA model in fp16 (32 layers x 2 x 8 heads x 128 dims x 2 B)."""
TIER_FRACS = {"top": 0.10, "mid": 0.30, "last": 1.0}
"""Share of the working set's bytes each tier holds."""
POLICY_NAMES = ("heat", "lru", "lfu")
CONTROL = ("oscillation", "heat-nohyst")
"""The hysteresis control: this trace, this policy."""
TARGET_BELADY_FRAC = 0.9
"""heat's top-tier hit ratio on zipf-1 must be at least this share of Belady's."""
TARGET_MOVES_FRAC = 0.2
"""heat's moves on the oscillation trace must be at most this share of heat-nohyst's."""


@dataclass(frozen=True)
class Trace:
    """A seeded access trace: block ids in access order, and how it was made."""

    name: str
    keys: np.ndarray
    params: dict = field(default_factory=dict)

    @property
    def warmup(self) -> int:
        """Accesses before measuring starts."""
        return int(len(self.keys) * WARMUP_FRAC)

    @cached_property
    def distinct(self) -> int:
        """The working set, in blocks."""
        return int(np.unique(self.keys).size)

    @property
    def top_blocks(self) -> int:
        return tier_blocks(self.distinct)["top"]


# -- traces ------------------------------------------------------------------------------


def _zipf_ranks(rng: np.random.Generator, n_keys: int, alpha: float, n: int) -> np.ndarray:
    """``n`` draws from a finite Zipf(alpha) over ``n_keys`` ranks, mapped to shuffled ids."""
    p = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** alpha
    ranks = rng.choice(n_keys, size=n, p=p / p.sum())
    return rng.permutation(n_keys)[ranks]


def zipf_trace(alpha: float, *, n_keys: int, n_accesses: int, seed: int) -> Trace:
    """Independent draws from Zipf(``alpha``): the static skewed workload."""
    rng = np.random.default_rng(seed)
    keys = _zipf_ranks(rng, n_keys, alpha, n_accesses)
    return Trace(f"zipf-{alpha:g}", keys, {"alpha": alpha, "n_keys": n_keys, "n_accesses": n_accesses})


def scan_trace(*, n_keys: int, n_accesses: int, scan_len: int, scan_every: int, seed: int) -> Trace:
    """Zipf 1.0 accesses, with a sequential scan of ``scan_len`` never-seen blocks after every ``scan_every``."""
    rng = np.random.default_rng(seed)
    zipf = _zipf_ranks(rng, n_keys, 1.0, n_accesses)
    parts, used, fresh, total = [], 0, n_keys, 0
    while total < n_accesses:
        parts += [zipf[used:used + scan_every], np.arange(fresh, fresh + scan_len)]
        used, fresh, total = used + scan_every, fresh + scan_len, total + scan_every + scan_len
    return Trace("zipf-1+scan", np.concatenate(parts)[:n_accesses],
                 {"alpha": 1.0, "n_keys": n_keys, "n_accesses": n_accesses, "scan_len": scan_len,
                  "scan_every": scan_every})


def _overlay(rng: np.random.Generator, keys: np.ndarray, hot: np.ndarray, frac: float) -> None:
    """Send a ``frac`` share of ``keys`` (a view) to uniform draws from ``hot``, in place."""
    to_hot = rng.random(keys.size) < frac
    keys[to_hot] = hot[rng.integers(0, hot.size, int(to_hot.sum()))]


def shifting_trace(*, n_keys: int, n_accesses: int, hot_frac_keys: float, hot_frac_accesses: float,
                   period: int, seed: int) -> Trace:
    """A random hot set of ``hot_frac_keys`` of the keys takes ``hot_frac_accesses`` of the accesses;
    a new hot set is drawn every ``period`` accesses. The rest are uniform over all keys."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, n_keys, n_accesses)
    for start in range(0, n_accesses, period):
        hot = rng.choice(n_keys, int(n_keys * hot_frac_keys), replace=False)
        _overlay(rng, keys[start:start + period], hot, hot_frac_accesses)
    return Trace("shifting-hot", keys, {"n_keys": n_keys, "n_accesses": n_accesses, "hot_frac_keys": hot_frac_keys,
                                        "hot_frac_accesses": hot_frac_accesses, "period_accesses": period})


def oscillation_trace(*, hot_keys: int, cold_keys: int, n_accesses: int, phase_accesses: int,
                      seed: int) -> Trace:
    """Two disjoint hot sets of ``hot_keys`` blocks take turns every ``phase_accesses``
    (uniform draws from the active set), after ``cold_keys`` blocks of cold data are
    written once (the store's other contents, never read again)."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(2 * hot_keys + cold_keys)
    sets, cold = ids[:2 * hot_keys].reshape(2, hot_keys), ids[2 * hot_keys:]
    load = min(cold_keys, n_accesses)
    keys = np.empty(n_accesses, dtype=np.int64)
    keys[:load] = cold[:load]
    for start in range(load, n_accesses, phase_accesses):
        stop = min(start + phase_accesses, n_accesses)
        keys[start:stop] = rng.choice(sets[((start - load) // phase_accesses) % 2], stop - start)
    return Trace("oscillation", keys, {"hot_keys": hot_keys, "cold_keys": cold_keys, "n_accesses": n_accesses,
                                       "phase_accesses": phase_accesses})


@dataclass
class _Session:
    prompt: int
    tail: list[int]
    turns_left: int


def sessions_trace(*, n_accesses: int, n_prompts: int, prefix_blocks: int, active: int, first_tail: int,
                   tail_growth: int, mean_turns: float, seed: int) -> Trace:
    """Multi-agent sessions over shared system prompts, as block chains.

    ``active`` sessions are open at once; each turn picks one at random and
    reads its prompt's ``prefix_blocks`` then its own tail, then writes
    ``tail_growth`` new blocks (the reply and the next message; a write is a
    first access). A session starts with ``first_tail`` blocks, uses one of
    ``n_prompts`` prompts (Zipf 1.0 popularity), lasts a geometric number of
    turns (mean ``mean_turns``) and is then replaced by a new one.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_prompts + 1)
    weights /= weights.sum()
    next_id = n_prompts * prefix_blocks

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    def open_session() -> _Session:
        return _Session(int(rng.choice(n_prompts, p=weights)), fresh(first_tail), int(rng.geometric(1 / mean_turns)))

    sessions = [open_session() for _ in range(active)]
    out: list[int] = []
    while len(out) < n_accesses:
        i = int(rng.integers(active))
        s = sessions[i]
        out += range(s.prompt * prefix_blocks, (s.prompt + 1) * prefix_blocks)
        out += s.tail
        new = fresh(tail_growth)
        out += new
        s.tail += new
        s.turns_left -= 1
        if s.turns_left <= 0:
            sessions[i] = open_session()
    return Trace("agent-sessions", np.array(out[:n_accesses]),
                 {"n_accesses": n_accesses, "n_prompts": n_prompts, "prefix_blocks": prefix_blocks, "active": active,
                  "first_tail": first_tail, "tail_growth": tail_growth, "mean_turns": mean_turns})


def make_traces(*, quick: bool = False, seed: int = 0) -> list[Trace]:
    """The bench's traces, seeded: full size, or ``quick`` (a tenth, for tests)."""
    scale = 10 if quick else 1
    n, keys = 40_000 // scale, 5_000 // scale
    phase = round(OSCILLATION_PHASE_S * ACCESS_RATE_PER_S) // scale
    seeds = [int(s) for s in np.random.SeedSequence(seed).generate_state(7)]
    return [
        *(zipf_trace(a, n_keys=keys, n_accesses=n, seed=s) for a, s in zip((0.8, 1.0, 1.2), seeds)),
        scan_trace(n_keys=keys, n_accesses=n, scan_len=2 * keys // 5, scan_every=keys, seed=seeds[3]),
        shifting_trace(n_keys=keys, n_accesses=n, hot_frac_keys=0.1, hot_frac_accesses=0.9, period=n // 4,
                       seed=seeds[4]),
        sessions_trace(n_accesses=n, n_prompts=4, prefix_blocks=32 // scale, active=40 // scale, first_tail=8,
                       tail_growth=2, mean_turns=10, seed=seeds[5]),
        oscillation_trace(hot_keys=200 // scale, cold_keys=2_600 // scale, n_accesses=n, phase_accesses=phase,
                          seed=seeds[6]),
    ]


# -- Belady ------------------------------------------------------------------------------


def belady(keys: np.ndarray | list[int], capacity: int, warmup: int = 0) -> dict:
    """Belady's MIN for a demand cache of ``capacity`` blocks: every miss is inserted,
    evicting the block whose next use is farthest away (never used again first).

    Returns:
        ``{"hits", "misses", "insertions", "hit_ratio"}`` over the accesses after
        the first ``warmup`` (which run but are not counted), and
        ``hit_ratio_all`` over all of them.
    """
    seq = [int(k) for k in keys]
    never = len(seq)
    next_use = [never] * len(seq)
    seen: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = seen.get(seq[i], never + i)  # distinct "never" values keep heap entries unambiguous
        seen[seq[i]] = i
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries are skipped on pop
    hits = hits_all = 0
    for i, key in enumerate(seq):
        if key in cache:
            hits += i >= warmup
            hits_all += 1
        elif len(cache) >= capacity:
            while True:
                far, victim = heapq.heappop(heap)
                if cache.get(victim) == -far:
                    del cache[victim]
                    break
        cache[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    measured = max(len(seq) - warmup, 0)
    misses = measured - hits
    return {"hits": hits, "misses": misses, "insertions": misses, "hit_ratio": hits / measured if measured else 0.0,
            "hit_ratio_all": hits_all / len(seq) if seq else 0.0}


# -- simulation --------------------------------------------------------------------------


def tier_blocks(distinct_blocks: int) -> dict[str, int]:
    """Blocks each tier holds: ``TIER_FRACS`` of the working set, at least one."""
    return {name: max(1, round(frac * distinct_blocks)) for name, frac in TIER_FRACS.items()}


def tier_stack(distinct_blocks: int) -> list[TierPolicy]:
    """The simulated tiers, fastest first, with the default watermarks."""
    return [TierPolicy(name, n * BLOCK_BYTES) for name, n in tier_blocks(distinct_blocks).items()]


POLICIES: dict[str, Callable[[], dict]] = {
    "heat": lambda: {},
    "lru": lambda: {"scorer": LRU(), "config": PlacementConfig(hysteresis=False)},
    "lfu": lambda: {"scorer": LFU()},
    "heat-nohyst": lambda: {"config": PlacementConfig(hysteresis=False)},
}
"""Keyword arguments for ``PlacementManager`` per policy; fresh objects per run."""


class _Simulator:
    """Drives one ``PlacementManager`` with a simulated clock and an instant mover."""

    def __init__(self, tiers: list[TierPolicy], manager_kwargs: dict) -> None:
        self.now_s = 0.0
        self.top = tiers[0].name
        self.manager = PlacementManager(tiers, clock=lambda: self.now_s, **manager_kwargs)

    def apply(self, orders: list[MoveOrder]) -> None:
        """Carry ``orders`` out in order, making room in a full destination first."""
        for order in orders:
            if self.manager.tier_of(order.key) != order.src:
                continue  # stale: an earlier order (or make_room) already moved it
            if order.dst is not None:
                self.apply(self.manager.make_room(order.dst, order.size))
            self.manager.moved(order)

    def access(self, key: bytes) -> bool:
        """One get (or, for a new block, a put). Returns whether it hit the top tier."""
        tier = self.manager.tier_of(key)
        if tier is None:
            target = self.manager.place_new(BLOCK_BYTES)
            self.apply(self.manager.make_room(target, BLOCK_BYTES))
            self.manager.admitted(key, target, BLOCK_BYTES)
            return False
        self.manager.accessed([key])
        return tier == self.top


def simulate(trace: Trace, policy: str) -> dict:
    """Replay ``trace`` through the real manager under ``policy``.

    Returns:
        over the measured part (after the warm-up): top-tier hit ratio, moves
        (promotions, demotions, evictions) and bytes moved; ``hit_ratio_all``
        is the hit ratio over the whole trace.
    """
    sim = _Simulator(tier_stack(trace.distinct), POLICIES[policy]())
    names = {int(k): int(k).to_bytes(8, "big") for k in np.unique(trace.keys)}
    warmup = trace.warmup
    hits = [0, 0]  # during warm-up, after it
    next_plan_s = PLAN_INTERVAL_S
    for i, key in enumerate(trace.keys.tolist()):
        if i == warmup:
            before = sim.manager.counters()
        sim.now_s = i / ACCESS_RATE_PER_S
        if sim.now_s >= next_plan_s:
            sim.apply(sim.manager.plan())
            next_plan_s += PLAN_INTERVAL_S
        hits[i >= warmup] += sim.access(names[key])
    after = sim.manager.counters()
    delta = {k: after[k] - before[k] for k in ("promoted", "demoted", "evicted", "bytes_moved")}
    moves = delta["promoted"] + delta["demoted"] + delta["evicted"]
    n = len(trace.keys)
    measured = n - warmup
    return {"policy": policy, "hit_ratio": hits[1] / measured, "hit_ratio_all": sum(hits) / n, "moves": moves,
            "moves_per_1k": 1000 * moves / measured, **delta}


# -- the bench ---------------------------------------------------------------------------


def _belady_row(trace: Trace) -> dict:
    b = belady(trace.keys, trace.top_blocks, trace.warmup)
    measured = len(trace.keys) - trace.warmup
    return {"policy": "belady", "hit_ratio": b["hit_ratio"], "hit_ratio_all": b["hit_ratio_all"],
            "moves": b["insertions"], "moves_per_1k": 1000 * b["insertions"] / measured,
            "bytes_moved": b["insertions"] * BLOCK_BYTES, "insertions": b["insertions"]}


def _trace_rows(trace: Trace) -> list[dict]:
    """Every policy on one trace, plus Belady; ``vs_belady`` is the hit ratio over Belady's."""
    best = _belady_row(trace)
    policies = POLICY_NAMES + ((CONTROL[1],) if trace.name == CONTROL[0] else ())
    rows = [simulate(trace, p) for p in policies] + [best]
    for row in rows:
        row["trace"] = trace.name
        row["vs_belady"] = row["hit_ratio"] / best["hit_ratio"] if best["hit_ratio"] else float("nan")
    return rows


def _checks(rows: list[dict]) -> list[dict]:
    """The issue's acceptance targets, each with the numbers behind it."""
    by = {(r["trace"], r["policy"]): r for r in rows}
    heat, best = by[("zipf-1", "heat")], by[("zipf-1", "belady")]
    checks = [{
        "name": f"zipf-1: heat hit ratio >= {TARGET_BELADY_FRAC} x Belady",
        "passed": heat["hit_ratio"] >= TARGET_BELADY_FRAC * best["hit_ratio"],
        "detail": f"{heat['hit_ratio']:.3f} vs {TARGET_BELADY_FRAC * best['hit_ratio']:.3f} "
                  f"({heat['vs_belady']:.3f} x Belady {best['hit_ratio']:.3f})",
    }]
    for trace in dict.fromkeys(r["trace"] for r in rows):
        h, lru = by[(trace, "heat")]["hit_ratio"], by[(trace, "lru")]["hit_ratio"]
        checks.append({"name": f"{trace}: heat hit ratio >= LRU", "passed": h >= lru,
                       "detail": f"{h:.3f} vs {lru:.3f} ({h - lru:+.3f})"})
    on, off = by[(CONTROL[0], "heat")], by[CONTROL]
    ratio = on["moves"] / off["moves"] if off["moves"] else (0.0 if not on["moves"] else float("inf"))
    checks.append({"name": f"{CONTROL[0]}: heat moves <= {TARGET_MOVES_FRAC} x heat without hysteresis",
                   "passed": ratio <= TARGET_MOVES_FRAC, "ratio": ratio,
                   "detail": f"{on['moves_per_1k']:.1f} vs {off['moves_per_1k']:.1f} per 1k accesses "
                             f"(ratio {ratio:.3f})"})
    return checks


def run(*, quick: bool = False, out_dir: str | Path | None = None, seed: int = 0) -> dict:
    """Replay every trace under every policy; print a table; write JSON and a PNG plot.

    Args:
        quick: traces a tenth of the size (a smoke test; the checks mean little there).
        out_dir: where ``placement-<time>.json`` and ``.png`` go (default ``bench/results``).
        seed: seeds every trace.

    Returns:
        the result dict (as written to the JSON), with ``path`` and ``plot`` added.
    """
    start = time.perf_counter()
    traces = make_traces(quick=quick, seed=seed)
    rows = [row for trace in traces for row in _trace_rows(trace)]
    result = {
        "bench": "placement",
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "quick": quick,
        "seed": seed,
        "setup": {"access_rate_per_s": ACCESS_RATE_PER_S, "plan_interval_s": PLAN_INTERVAL_S,
                  "block_bytes": BLOCK_BYTES, "tier_fracs": TIER_FRACS, "warmup_frac": WARMUP_FRAC,
                  "placement_defaults": asdict(PlacementConfig()),
                  "tier_defaults": {k: v for k, v in asdict(TierPolicy("t", 1)).items()
                                    if k.endswith("watermark_frac")}},
        "traces": [{"name": t.name, "accesses": len(t.keys), "distinct_blocks": t.distinct, "warmup": t.warmup,
                    "tier_blocks": tier_blocks(t.distinct), "params": t.params} for t in traces],
        "rows": rows,
        "checks": _checks(rows),
    }
    result["hysteresis_moves_ratio"] = result["checks"][-1]["ratio"]
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    print(format_table(result))
    target = Path(out_dir or "bench/results")
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"placement-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    plot = _plot(result, path.with_suffix(".png"))
    print(f"\nwrote {path}\nwrote {plot}")
    result["path"], result["plot"] = str(path), str(plot)
    return result


def format_table(result: dict) -> str:
    """The rows as a fixed-width table, then the checks."""
    setup = result["setup"]
    tiers = {t["name"]: t for t in result["traces"]}
    head = (f"{'trace':15} {'blocks':>6} {'top':>5}  {'policy':12} {'hit':>6} {'xBelady':>8} "
            f"{'moves/1k':>9} {'GiB moved':>10}")
    lines = [f"kvstore bench placement  ({setup['access_rate_per_s']} reads/s simulated, plan every "
             f"{setup['plan_interval_s']} s, {setup['block_bytes'] >> 20} MiB blocks, first "
             f"{setup['warmup_frac']:.0%} of each trace not measured; {result['elapsed_s']} s)", head, "-" * len(head)]
    last = None
    for r in result["rows"]:
        t = tiers[r["trace"]]
        lead = (f"{r['trace']:15} {t['distinct_blocks']:6d} {t['tier_blocks']['top']:5d}" if r["trace"] != last
                else " " * 27)
        last = r["trace"]
        moves = f"{r['moves_per_1k']:9.1f}" + ("*" if r["policy"] == "belady" else " ")
        lines.append(f"{lead}  {r['policy']:12} {r['hit_ratio']:6.3f} {r['vs_belady']:8.3f} {moves}"
                     f"{r['bytes_moved'] / 2**30:9.1f}")
    lines.append("* Belady: insertions into top, per 1k accesses (it has no tiers below to move to)")
    lines.append("\nchecks:")
    lines.extend(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']}: {c['detail']}" for c in result["checks"])
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> Path:
    """Hit ratio (and moves) by policy and trace, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [t["name"] for t in result["traces"]]
    by = {(r["trace"], r["policy"]): r for r in result["rows"]}
    fig, (hits, moves) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    policies = POLICY_NAMES + ("belady",)
    width = 0.8 / len(policies)
    for k, policy in enumerate(policies):
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(traces))]
        hits.bar(xs, [by[(t, policy)]["hit_ratio"] for t in traces], width, label=policy)
        if policy != "belady":
            moves.bar(xs, [by[(t, policy)]["moves_per_1k"] for t in traces], width, label=policy)
    hits.set_ylabel("top-tier hit ratio")
    hits.set_ylim(0, 1)
    hits.legend(ncol=len(policies), loc="upper left", fontsize=8)
    hits.set_title("kvstore placement: top tier = 10% of the working set")
    moves.set_ylabel("moves per 1k accesses")
    moves.set_yscale("log")
    moves.set_ylim(bottom=1)
    moves.set_xticks(range(len(traces)), traces, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
