"""The transfer planner: per transfer, pick the medium and wire codec, or say "recompute".

Cost model, per option (a medium, and for gets a wire codec):

    predicted = latency + wire_bytes / bandwidth + codec_cost_per_byte * raw_bytes

plus, where this client already has transfers in flight over the same medium,
the wait behind them (``shared_wire``), against ``recompute = tokens /
prefill_rate`` for the caller's spec. Per option and payload size class, an
EWMA of seconds per byte from every real transfer (``Estimate``); sizes not
measured yet take a line fitted through the measured classes and a bounded
probe at connect. Codec costs are EWMAs of measured encode and decode seconds
per byte.

Exploration: an option not measured in a size class lately gets a burst of
real transfers, paid for by the class's chosen transfers (``_EXPLORE_SHARE``).

Stability: the planner keeps a current choice per (operation, size class). It
moves to another option only when that option has been the predicted best for
``window_s`` without a break, better by ``margin_frac`` when the window starts
and when it ends; a choice that becomes unavailable is left at once. A queue
on this client's side moves one transfer, never the choice. Payloads of at most
``small_bytes`` take the first available medium in the policy's order without
deliberation.

Every decision is a ``Decision`` record (inputs, candidates with predictions,
choice, reason, then the actual cost), kept in a bounded ``DecisionLog``.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from kvstore.errors import InvalidInput
from kvstore.policy import Policy

__all__ = ["Option", "RECOMPUTE", "Estimate", "CostModel", "Candidate", "Decision", "DecisionLog", "Planner"]

RECOMPUTE = "recompute"
_INT8_WIRE_FRAC = 0.5  # int8 frames of fp16 KV: half the payload, plus scales (measured 0.51-0.53)


@dataclass(frozen=True, slots=True)
class Option:
    """One way to do a transfer: a medium, and the codec the bytes travel in."""

    medium: str
    codec: str = "raw"

    @property
    def name(self) -> str:
        return self.medium if self.codec == "raw" else f"{self.medium}+{self.codec}"

    @classmethod
    def parse(cls, name: str) -> "Option":
        medium, _, codec = name.partition("+")
        return cls(medium, codec or "raw")


_BURST_MAX = 8
_BURST_GAIN = 0.9
_BURST_CLOSE = 1.5
"""An option explored for a size class gets a burst of real transfers in a row, and only the
fastest of them is learnt: a medium warms up over its first transfers after other media's
(1 MiB HTTP gets measured 1.31, 1.00, 0.84, 0.78, 0.73, then 0.72-0.78 ms; a first 8 MiB int8
get 12x its later ones). A contender within ``_BURST_CLOSE`` of the best option gets all
``_BURST_MAX`` (a close call needs the warm figure, and trying it costs little: with five, an
8 MiB int8 get still measured 5% over its steady state, and lost a 10% lead to hysteresis); one
further behind stops once a transfer is no longer ``_BURST_GAIN`` times faster than the fastest
before it: a 670 ms transfer, twice the best, is not repeated eight times."""
_EXPLORE_WITHIN = 4.0  # explore an unmeasured option predicted at most this many times the best
_EXPLORE_SHARE = 0.25
"""Exploring is paid for by exploiting: each size class earns this fraction of its chosen
transfers' time as exploration budget, and a burst starts only when the budget covers one
transfer of the explored option. An agent that gets once gets the best option, not a try of
another (a demo agent's only get once went to HTTP at 2.7x shm's predicted time)."""
_SPIKE = 2.0  # a real transfer's seconds per byte counts as at most this many times its class's estimate
_PROBE_WEIGHT = 0.25  # a probe moves filler over a bare route: it counts, but less than a real transfer


@dataclass(slots=True)
class Estimate:
    """What one option costs: per size class, an EWMA of seconds per byte; across sizes, a fit.

    A size class (4x wide) with a real transfer learnt predicts from its own
    EWMA. A class not measured yet takes a line fitted to the classes that are:
    a weighted least-squares fit of ``latency + bytes / bandwidth`` through one
    point per class (its latest size at its EWMA's rate), the empty round trips,
    and the probe's transfer where no real one of its size exists (a probe
    moves filler over a bare route: it counts a quarter). Points weigh
    ``1 / seconds**2``, so the fit minimizes relative error: a 64 KiB class
    counts as much as a 64 MiB one. One point per class, not per transfer:
    thousands of 64 KiB gets must not erase what a 2 MiB probe said about
    bandwidth (they did, when the fit decayed per sample; extrapolated from
    64 KiB alone, 1 MiB looked 8x slower than it was).
    """

    samples: int = 0
    updated_s: float = 0.0
    real_samples: int = 0
    """Samples from real transfers, not probes: filler over a bare link flatters a medium."""
    real_by_class: dict[int, float] = field(default_factory=dict)
    """Size class -> when a real transfer of that size (or an exploration burst) was last learnt
    (exploration is per size class: a fit learnt on 64 KiB gets extrapolates poorly to 64 MiB)."""
    s_per_byte_by_class: dict[int, float] = field(default_factory=dict)
    """Size class -> EWMA of seconds per byte of its real transfers."""
    _bytes_by_class: dict[int, int] = field(default_factory=dict)
    """Size class -> wire bytes of its latest real transfer (where its point sits in the fit)."""
    _probes: dict[int, list[float]] = field(default_factory=dict)
    """Size class -> [bytes, seconds] EWMA of probe transfers; key -1: empty round trips."""
    _bursts: dict[int, list[float]] = field(default_factory=dict)
    """Size class -> [transfers, fastest seconds per byte] of an exploration burst under way (one
    cut short by a failed or empty try is dropped: ``abandon_burst``)."""
    _latency_s: float | None = None
    _s_per_byte: float | None = None
    _fit_stale: bool = False
    """A sample came since the last fit. The fit runs when a prediction needs it (a size class
    not measured yet), not on every transfer: most predictions use their class's own EWMA."""

    @property
    def latency_s(self) -> float | None:
        """The fit's fixed cost per transfer (None before any sample)."""
        if self._fit_stale:
            self._fit()
        return self._latency_s

    @property
    def s_per_byte(self) -> float | None:
        """The fit's seconds per byte across sizes (None before a sized sample)."""
        if self._fit_stale:
            self._fit()
        return self._s_per_byte

    def abandon_burst(self, class_bytes: int) -> None:
        """Forget the burst under way in a size class (a try failed or moved nothing)."""
        self._bursts.pop(size_class(class_bytes), None)

    def predict(self, nbytes: int, class_bytes: int | None = None) -> float | None:
        """Seconds for ``nbytes`` on the wire; ``class_bytes``: the raw KV bytes that name the size class."""
        local = self.s_per_byte_by_class.get(size_class(nbytes if class_bytes is None else class_bytes))
        if local is not None and nbytes > 0:
            return nbytes * local
        if self.latency_s is None or (self.s_per_byte is None and nbytes > 0):
            return None
        return self.latency_s + nbytes * (self.s_per_byte or 0.0)

    def observe(self, nbytes: int, seconds: float, alpha: float, small_bytes: int, now_s: float,
                real: bool = True, class_bytes: int | None = None, burst_best_s: float | None = None) -> None:
        """One sample of ``nbytes`` on the wire; ``class_bytes`` (raw KV bytes) names its size class,
        as the planner's lookups do: an int8 get moves half its raw bytes. ``burst_best_s``: set for
        a transfer of an exploration burst (only the burst's fastest is learnt, when it ends), the
        seconds the best option was predicted to take for the same KV."""
        seconds = max(seconds, 1e-9)
        self.samples += 1
        self.updated_s = now_s
        raw = nbytes if class_bytes is None else class_bytes
        cls = size_class(raw)
        if real and nbytes > 0 and raw > small_bytes:
            self.real_samples += 1
            spb = seconds / nbytes
            if burst_best_s is None:
                self._learn(cls, nbytes, spb, alpha, now_s)
            else:
                b = self._bursts.setdefault(cls, [0, spb])
                warm = b[0] >= 1 and spb >= _BURST_GAIN * b[1]
                b[0], b[1] = b[0] + 1, min(b[1], spb)
                close = b[1] * nbytes <= _BURST_CLOSE * burst_best_s
                if b[0] >= _BURST_MAX or (warm and not close):
                    del self._bursts[cls]
                    self._learn(cls, nbytes, b[1], alpha, now_s)
        elif not real or nbytes == 0:  # a probe, or an empty round trip (latency alone)
            key = cls if nbytes > 0 else -1
            old = self._probes.get(key)
            self._probes[key] = [float(nbytes), seconds] if old is None else [
                float(nbytes), _ewma(old[1] * nbytes / old[0] if old[0] else old[1], seconds, alpha)]
        else:
            return  # a small real transfer: the default medium's, not the planner's to learn from
        self._fit_stale = True

    def _learn(self, cls: int, nbytes: int, spb: float, alpha: float, now_s: float) -> None:
        """One real measurement of a size class: into its EWMA, capped at ``_SPIKE`` times the
        estimate. A lone stall (a 4 ms get among 0.8 ms ones) then moves it by at most
        alpha x (_SPIKE - 1) instead of flipping the choice, while a lasting slowdown still
        raises it by that factor per transfer (10x in about nine transfers at the default alpha)."""
        self.real_by_class[cls] = now_s
        self._bytes_by_class[cls] = nbytes
        self._bursts.pop(cls, None)  # learnt: a burst under way there has nothing left to add
        old = self.s_per_byte_by_class.get(cls)
        self.s_per_byte_by_class[cls] = _ewma(old, spb if old is None else min(spb, _SPIKE * old), alpha)

    def _fit(self) -> None:
        self._fit_stale = False
        pts = [(float(x), self.s_per_byte_by_class[c] * x, 1.0) for c, x in self._bytes_by_class.items()]
        pts += [(x, t, 1.0 if x == 0 else _PROBE_WEIGHT) for c, (x, t) in self._probes.items()
                if c not in self._bytes_by_class]
        sized = [p for p in pts if p[0] > 0]
        if not sized:
            if pts:  # empty round trips only: latency
                self._latency_s = pts[0][1]
            return
        rtt = self._probes.get(-1)
        if len({p[0] for p in pts}) >= 2:
            sw = sx = sy = sxx = sxy = 0.0
            for x, t, weight in pts:
                w = weight / (t * t)
                sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * t, sxx + w * x * x, sxy + w * x * t
            var_x = sxx / sw - (sx / sw) ** 2
            if var_x > 0:
                slope = (sxy / sw - (sx / sw) * (sy / sw)) / var_x
                icpt = sy / sw - slope * sx / sw
                if slope > 0 and icpt >= 0:
                    self._latency_s, self._s_per_byte = icpt, slope
                    return
        # One size, or points no line with a non-negative latency fits: latency from the empty
        # round trips (at most half the fastest point: faster than the fixed cost alone means
        # that estimate was high), the rest as bandwidth, by the largest point.
        x, t, _ = max(sized)
        lat = min(rtt[1] if rtt else 0.0, 0.5 * min(p[1] for p in sized))
        self._latency_s, self._s_per_byte = lat, max(t - lat, 1e-12) / x

    def to_dict(self) -> dict[str, Any]:
        bw = None if not self.s_per_byte else 1.0 / self.s_per_byte / 1e9
        return {"latency_ms": None if self.latency_s is None else self.latency_s * 1e3,
                "bandwidth_gbps": bw, "samples": self.samples, "real_samples": self.real_samples}


def wire_bytes(option: Option, raw_bytes: int) -> int:
    """Bytes ``raw_bytes`` of KV take on the wire over ``option``."""
    return raw_bytes if option.codec == "raw" else int(raw_bytes * _INT8_WIRE_FRAC)


def shared_wire(wire: int, queued: Sequence[int] = ()) -> int:
    """What a transfer of ``wire`` bytes costs, in bytes' time, with the transfers of ``queued``
    wire bytes already in flight on its link: a fair share, where each of them slows it until
    the shorter of the two is done (``wire + sum(min(q, wire))``)."""
    return wire + sum(min(max(q, 0), wire) for q in queued)


def size_class(nbytes: int) -> int:
    """Payload sizes in classes of 4x: hysteresis and exploration work per class."""
    return max(0, int(math.log2(max(nbytes, 1))) // 2)


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1.0 - alpha) * old + alpha * sample


class CostModel:
    """Estimates per option and per codec, and the caller's prefill rates. Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.links: dict[str, Estimate] = {}
        self.codec_s_per_byte: dict[tuple[str, str], float] = {}
        """(codec, "encode" | "decode") -> EWMA seconds per raw byte."""
        self.prefill_tps: dict[str, float] = {}
        """Spec fingerprint -> the caller's prefill rate, tokens per second."""

    def observe(self, op: str, option: str, nbytes: int, seconds: float, policy: Policy, *,
                real: bool = True, raw_bytes: int | None = None, burst_best_s: float | None = None) -> None:
        """One timed transfer (``real``) or probe of ``op`` ("get" or "put") over ``option``.

        Args:
            nbytes: bytes on the wire.
            raw_bytes: the KV bytes they carry, when a codec made them fewer (names the size class).
            burst_best_s: for a transfer of an exploration burst, the best option's predicted
                seconds for the same KV (``Estimate.observe``).
        """
        with self._lock:
            self.links.setdefault(f"{op}:{option}", Estimate()).observe(
                nbytes, seconds, policy.ewma_alpha, policy.small_bytes, self.clock(), real, raw_bytes, burst_best_s)

    def observe_codec(self, codec: str, direction: str, raw_bytes: int, seconds: float, alpha: float = 0.3) -> None:
        if raw_bytes <= 0:
            return
        with self._lock:
            key = (codec, direction)
            self.codec_s_per_byte[key] = _ewma(self.codec_s_per_byte.get(key), seconds / raw_bytes, alpha)

    def set_prefill_rate(self, fingerprint: str, tokens_per_s: float) -> None:
        if not isinstance(tokens_per_s, (int, float)) or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
            raise InvalidInput(f"prefill rate must be a positive number of tokens per second, got {tokens_per_s!r}")
        with self._lock:
            self.prefill_tps[fingerprint] = float(tokens_per_s)

    def predict(self, op: str, option: Option, raw_bytes: int, queued: Sequence[int] = ()) -> float | None:
        """Seconds to ``op`` ``raw_bytes`` of KV over ``option``; None before any estimate exists.

        ``queued``: wire bytes of each transfer this client already has in flight over the same
        medium. They share the link (``shared_wire``).
        """
        with self._lock:
            est = self.links.get(f"{op}:{option.name}")
            if est is None:
                return None
            wire = wire_bytes(option, raw_bytes)
            link = est.predict(shared_wire(wire, queued), raw_bytes)
            if link is None:
                return None
            if option.codec == "raw":
                return link
            codec = (self.codec_s_per_byte.get((option.codec, "encode"), 0.0)
                     + self.codec_s_per_byte.get((option.codec, "decode"), 0.0))
            return link + codec * raw_bytes

    def abandon_burst(self, op: str, option: str, raw_bytes: int) -> None:
        with self._lock:
            est = self.links.get(f"{op}:{option}")
            if est is not None:
                est.abandon_burst(raw_bytes)

    def recompute_s(self, fingerprint: str, tokens: int) -> float | None:
        with self._lock:
            rate = self.prefill_tps.get(fingerprint)
        return None if rate is None else tokens / rate

    def age_s(self, op: str, option: str, *, nbytes: int | None = None) -> float:
        """Seconds since the last sample, probe or real; with ``nbytes``, since the last real transfer
        (or exploration burst) of its size class was learnt (inf before any)."""
        with self._lock:
            est = self.links.get(f"{op}:{option}")
            if est is None or not est.samples:
                return math.inf
            if nbytes is None:
                return self.clock() - est.updated_s
            learnt = est.real_by_class.get(size_class(nbytes))
            return math.inf if learnt is None else self.clock() - learnt

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"links": {k: v.to_dict() for k, v in self.links.items()},
                    "codecs": {f"{c}/{d}": v * 1e9 for (c, d), v in self.codec_s_per_byte.items()},
                    "prefill_tokens_per_s": dict(self.prefill_tps)}


@dataclass(slots=True)
class Candidate:
    option: str
    predicted_s: float | None
    feasible: bool = True
    why: str = ""
    queued: tuple[int, ...] = ()
    """Wire bytes of each transfer this client had in flight over the option's medium when it was weighed."""
    wait_s: float = 0.0
    """Of ``predicted_s``, the time those queued transfers add (the link is shared)."""

    @property
    def alone_s(self) -> float | None:
        """The prediction without the wait: what hysteresis weighs (a queue passes; a medium's speed stays)."""
        return None if self.predicted_s is None else self.predicted_s - self.wait_s

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "predicted_s": self.predicted_s, "feasible": self.feasible, "why": self.why,
                "queued_bytes": sum(self.queued), "wait_s": self.wait_s}


_ids = itertools.count(1)


@dataclass(slots=True)
class Decision:
    """One planner decision: what it knew, what it chose and why, and what it then cost."""

    op: str
    nbytes: int
    """Raw KV bytes the transfer would move (for a get: every full block asked for)."""
    tokens: int
    locality: str
    """"colocated" (same host as the server, shm offered) or "remote"."""
    candidates: list[Candidate]
    choice: str
    """An option name ("http", "flight+int8", ...) or "recompute"."""
    reason: str
    policy_version: int
    slo_s: float | None = None
    free_bytes: int | None = None
    predicted_s: float | None = None
    time_s: float = field(default_factory=time.time)
    id: int = field(default_factory=lambda: next(_ids))
    actual_s: float | None = None
    actual_bytes: int | None = None
    predicted_actual_s: float | None = None
    """The model's prediction for the bytes that actually moved (a get may hit fewer than asked)."""
    error: str | None = None
    """Set when the chosen transfer failed."""
    explore: bool = False
    """The choice is an exploration: the option gets real transfers to be measured, not because it is best."""

    @property
    def option(self) -> Option | None:
        return None if self.choice == RECOMPUTE else Option.parse(self.choice)

    @property
    def ratio(self) -> float | None:
        """actual / predicted, for the bytes that moved; None when either is unknown."""
        if not self.actual_s or not self.predicted_actual_s:
            return None
        return self.actual_s / self.predicted_actual_s

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "time_s": self.time_s, "op": self.op, "bytes": self.nbytes, "tokens": self.tokens,
                "locality": self.locality, "slo_s": self.slo_s, "free_bytes": self.free_bytes,
                "candidates": [c.to_dict() for c in self.candidates], "choice": self.choice, "reason": self.reason,
                "policy_version": self.policy_version, "predicted_s": self.predicted_s,
                "actual_s": self.actual_s, "actual_bytes": self.actual_bytes,
                "predicted_actual_s": self.predicted_actual_s, "ratio": self.ratio, "error": self.error,
                "explore": self.explore}


class DecisionLog:
    """The newest ``capacity`` decisions, oldest first; finished ones also queue for reporting."""

    def __init__(self, capacity: int = 1024, report_capacity: int = 4096) -> None:
        self._ring: deque[Decision] = deque(maxlen=capacity)
        self._unreported: deque[Decision] = deque(maxlen=report_capacity)
        self._lock = threading.Lock()

    def add(self, decision: Decision) -> None:
        with self._lock:
            self._ring.append(decision)

    def finished(self, decision: Decision) -> None:
        with self._lock:
            self._unreported.append(decision)

    def records(self, limit: int = 100) -> list[Decision]:
        with self._lock:
            return list(self._ring)[-limit:] if limit else []

    def drain(self, limit: int = 1024) -> list[Decision]:
        with self._lock:
            out = [self._unreported.popleft() for _ in range(min(limit, len(self._unreported)))]
        return out

    def __len__(self) -> int:
        return len(self._ring)


@dataclass(slots=True)
class _Sticky:
    current: str
    challenger: str | None = None
    since_s: float = 0.0
    under_since_s: float | None = None
    """When the challenger, still the predicted best, fell under the margin (its window lapses
    after ``window_s`` of that: a lone stall must not leave one running)."""
    provisional: bool = False
    """Chosen before ``current`` had a real transfer of this size class (on probes or other
    sizes' fits): the first real evidence against it is new information, not noise, so it
    is acted on without waiting out the window."""


class Planner:
    """Decides per transfer from a ``CostModel``, with hysteresis per (op, size class).

    Args:
        model: the shared estimates (a client keeps one per server).
        clock: monotonic seconds (tests drive it).
    """

    def __init__(self, model: CostModel | None = None, *, clock: Callable[[], float] = time.monotonic,
                 log: DecisionLog | None = None) -> None:
        self.model = model or CostModel(clock)
        self.clock = clock
        self.log = log or DecisionLog()
        self._sticky: dict[tuple[int, str, int], _Sticky] = {}
        self._explored: dict[tuple[str, str, int], list[float]] = {}
        self._budget: dict[tuple[str, int], float] = {}
        """(op, size class) -> seconds of exploration earned and not spent (``_EXPLORE_SHARE``)."""
        self._lock = threading.Lock()

    def decide(self, op: str, options: Iterable[Option], *, nbytes: int, tokens: int, policy: Policy,
               fingerprint: str = "", locality: str = "remote", slo_s: float | None = None,
               free_bytes: int | None = None, queued: dict[str, Sequence[int]] | None = None) -> Decision:
        """Pick an option for one transfer (``op`` "get" or "put"), or "recompute" for a get.

        Args:
            options: what is available for this transfer, already filtered by the policy's media.
            nbytes: raw KV bytes the transfer moves at most.
            tokens: tokens the caller would recompute instead.
            slo_s: this transfer's latency bound (default: the policy's).
            free_bytes: the receiver's free buffer space; an option needing more is infeasible.
            queued: medium -> wire bytes of each transfer this client has in flight over it. Their
                wait is predicted for this transfer alone: hysteresis weighs the media without it.
        """
        opts = [o for o in options if o.medium in policy.media and (op == "put" or o.codec in policy.codecs)]
        if not opts:
            raise InvalidInput(f"no medium available for {op} under policy v{policy.version}")
        slo = policy.slo_s if slo_s is None else slo_s
        if nbytes <= policy.small_bytes:
            first = min(opts, key=lambda o: (policy.media.index(o.medium), o.codec != "raw"))
            return self._record(op, nbytes, tokens, locality, [Candidate(first.name, self.model.predict(op, first, nbytes))],
                                first.name, f"payload of {nbytes} B is at most small_bytes: default medium",
                                policy, slo, free_bytes)
        queued = queued or {}
        cands = [self._candidate(op, o, nbytes, slo, free_bytes, tuple(queued.get(o.medium, ()))) for o in opts]
        recompute = None
        if op == "get" and policy.recompute and tokens > 0:
            rs = self.model.recompute_s(fingerprint, tokens)
            if rs is not None:
                recompute = Candidate(RECOMPUTE, rs)
        known = [c for c in cands if c.feasible and c.predicted_s is not None]
        everything = cands + ([recompute] if recompute else [])
        if not any(c.feasible for c in cands):  # the transfer fails where it lands, with the typed error
            return self._record(op, nbytes, tokens, locality, everything, cands[0].option,
                                f"no option fits: {cands[0].why}", policy, slo, free_bytes)
        if not known:  # nothing measured yet: the policy's order decides
            first = next(c for c in cands if c.feasible)
            return self._record(op, nbytes, tokens, locality, everything, first.option,
                                "no estimates yet: first available medium in the policy's order",
                                policy, slo, free_bytes)
        best = min(known, key=lambda c: c.alone_s)  # type: ignore[arg-type, return-value]
        explore = self._to_explore(op, nbytes, policy, cands, best, recompute)
        if explore is not None:
            d = self._record(op, nbytes, tokens, locality, everything, explore.option,
                             f"explore: no real {op} over {explore.option} in {policy.explore_after_s:g} s "
                             f"(predicted {_ms(explore.predicted_s)}, best {best.option} {_ms(best.predicted_s)})",
                             policy, slo, free_bytes)
            d.explore = True
            return d
        by_name = {c.option: c for c in cands}
        choice, reason = self._stable(op, nbytes, policy, by_name, best)
        # This client's own queue is this transfer's state, not a medium's: it is weighed after
        # hysteresis, and moves this transfer alone, when another option beats the wait by the margin.
        now_best = min(known, key=lambda c: c.predicted_s)  # type: ignore[arg-type, return-value]
        held = by_name[choice]
        if (now_best.option != choice and held.wait_s
                and now_best.predicted_s < held.predicted_s * (1.0 - policy.margin_frac)):  # type: ignore[operator]
            choice, reason = now_best.option, (
                f"{held.option} has {sum(held.queued)} B in flight: {_ms(held.predicted_s)} with the wait, "
                f"{now_best.option} {_ms(now_best.predicted_s)} (this transfer only)")
        # Fetch or recompute is this request's question (its tokens, the caller's prefill rate),
        # not a medium's state, so no hysteresis: recompute wins when it beats the fetch that would run.
        fetch = by_name[choice]
        if recompute is not None and recompute.predicted_s < fetch.predicted_s:  # type: ignore[operator]
            if now_best.predicted_s < recompute.predicted_s:  # type: ignore[operator]
                # Recompute beats what hysteresis holds, the best fetch beats recompute: that fetch,
                # for this transfer only (the challenger's window runs on).
                choice, reason = now_best.option, (
                    f"{now_best.option} {_ms(now_best.predicted_s)} beats recomputing {tokens} tokens "
                    f"({_ms(recompute.predicted_s)}), which beats the held {fetch.option} "
                    f"({_ms(fetch.predicted_s)}): this transfer only")
            else:
                choice, reason = RECOMPUTE, (f"recompute {tokens} tokens predicted {_ms(recompute.predicted_s)}, "
                                             f"fetching over {fetch.option} {_ms(fetch.predicted_s)}")
        return self._record(op, nbytes, tokens, locality, everything, choice, reason, policy, slo, free_bytes)

    def _to_explore(self, op: str, nbytes: int, policy: Policy, cands: list[Candidate],
                    best: Candidate, recompute: Candidate | None) -> Candidate | None:
        """An option with no real transfer of this size class learnt in ``explore_after_s`` gets
        a burst of them (``_BURST_MAX``).

        A burst starts only when the option is predicted within 4x of the best
        way to get the KV, recompute included (a medium far behind is not worth
        real transfers), and when the class's exploration budget covers one
        transfer of it (``_EXPLORE_SHARE``). Once started, it goes on unless the option is then over
        16x: a first transfer of a size is often several times slower (a first
        8 MiB int8 get measured 12x its later ones), and one cold sample must not
        stand as the option's estimate until the next interval.
        """
        ref = best.alone_s
        if ref is None:
            return None
        if recompute is not None and recompute.predicted_s is not None:
            ref = min(ref, recompute.predicted_s)
        now = self.clock()
        # The best fetch runs (held, or for single transfers that beat recompute), and so measures
        # itself; not while recompute wins, though.
        fetch_runs = recompute is None or recompute.predicted_s is None or recompute.predicted_s >= best.alone_s
        for c in cands:
            if not c.feasible or c.why or c.predicted_s is None or (fetch_runs and c.option == best.option):
                continue
            if self.model.age_s(op, c.option, nbytes=nbytes) < policy.explore_after_s:
                continue
            key = (op, c.option, size_class(nbytes))
            with self._lock:  # at most _BURST_MAX tries per option, class and interval, failed or not
                tries = [t for t in self._explored.get(key, []) if now - t < policy.explore_after_s]
                within = _EXPLORE_WITHIN * (_EXPLORE_WITHIN if tries else 1.0) * ref
                if len(tries) >= _BURST_MAX or c.alone_s > within:  # type: ignore[operator]
                    continue
                if not tries and self._budget.get((op, key[2]), 0.0) < c.alone_s:  # type: ignore[operator]
                    continue  # a new burst waits until exploiting has paid for a transfer of it
                self._explored[key] = tries + [now]
            return c
        return None

    def _candidate(self, op: str, option: Option, nbytes: int, slo: float | None,
                   free_bytes: int | None, queued: tuple[int, ...] = ()) -> Candidate:
        predicted = self.model.predict(op, option, nbytes, queued)
        cand = Candidate(option.name, predicted, queued=queued)
        if queued and predicted is not None:
            alone = self.model.predict(op, option, nbytes)
            cand.wait_s = max(0.0, predicted - (alone or 0.0))
        if free_bytes is not None and nbytes > free_bytes:
            cand.feasible, cand.why = False, f"needs {nbytes} B of buffer, receiver has {free_bytes}"
        elif slo is not None and predicted is not None and predicted > slo:
            cand.why = f"predicted {predicted * 1e3:.2f} ms is over the SLO of {slo * 1e3:.2f} ms"
        return cand

    def _stable(self, op: str, nbytes: int, policy: Policy, by_name: dict[str, Candidate],
                best: Candidate) -> tuple[str, str]:
        """Hysteresis: keep the current choice unless ``best`` has been best for the window,
        beating it by the margin when the window started and now."""
        best_s = best.alone_s
        key = (policy.version, op, size_class(nbytes))
        now = self.clock()
        with self._lock:
            st = self._sticky.get(key)
            if st is not None and st.provisional:
                st.provisional = self._unproven(op, st.current, nbytes)
            cur = by_name.get(st.current) if st else None
            cur_s = None if cur is None or not cur.feasible else cur.alone_s
            if st is None or cur_s is None:
                gone = f"previous choice {st.current} is unavailable; " if st else ""
                self._sticky[key] = _Sticky(best.option, provisional=self._unproven(op, best.option, nbytes))
                return best.option, f"{gone}lowest predicted time ({_ms(best_s)})"
            if best.option == st.current:
                st.challenger = None
                return st.current, f"lowest predicted time ({_ms(best_s)})"
            if best_s > cur_s * (1.0 - policy.margin_frac):  # type: ignore[operator]
                # A challenger that stays the predicted best keeps its window while noise dips it
                # under the margin (sub-millisecond estimates jitter by about that much), for at
                # most a window; another option becoming best, or the current one again, starts over.
                if st.challenger != best.option:
                    st.challenger = None
                elif st.under_since_s is None:
                    st.under_since_s = now
                elif now - st.under_since_s > policy.window_s:
                    st.challenger, st.under_since_s = None, None
                return st.current, (f"kept: {best.option} ({_ms(best_s)}) is not {policy.margin_frac:.0%} "
                                    f"better than {st.current} ({_ms(cur_s)})")
            if st.under_since_s is not None and now - st.under_since_s > policy.window_s:
                st.challenger = None  # its window lapsed under the margin, however long ago the last look
            st.under_since_s = None
            if st.provisional and not self._unproven(op, best.option, nbytes):
                old = st.current
                self._sticky[key] = _Sticky(best.option)
                return best.option, (f"switched from {old}, chosen before any real transfer of this size: "
                                     f"{best.option} measured {_ms(best_s)} against {_ms(cur_s)}")
            if st.challenger != best.option:
                st.challenger, st.since_s = best.option, now
            held = now - st.since_s
            if held < policy.window_s:
                return st.current, (f"kept: {best.option} ({_ms(best_s)}) beats {st.current} "
                                    f"({_ms(cur_s)}) by the margin for {held:.1f} of {policy.window_s:g} s")
            old = st.current
            self._sticky[key] = _Sticky(best.option)
            return best.option, (f"switched from {old}: {best.option} predicted {_ms(best_s)} against "
                                 f"{_ms(cur_s)} for {held:.1f} s")

    def _unproven(self, op: str, option: str, nbytes: int) -> bool:
        return self.model.age_s(op, option, nbytes=nbytes) == math.inf

    def _record(self, op: str, nbytes: int, tokens: int, locality: str, cands: list[Candidate], choice: str,
                reason: str, policy: Policy, slo: float | None, free_bytes: int | None) -> Decision:
        chosen = next((c for c in cands if c.option == choice), None)
        d = Decision(op, nbytes, tokens, locality, cands, choice, reason, policy.version, slo, free_bytes,
                     None if chosen is None else chosen.predicted_s)
        self.log.add(d)
        return d

    def finish(self, decision: Decision, policy: Policy, *, actual_s: float, actual_bytes: int,
               codec_s: float = 0.0, error: str | None = None) -> None:
        """Record what the chosen transfer cost, and learn from it.

        Args:
            actual_s: the whole transfer, codec work included.
            actual_bytes: raw KV bytes that moved.
            codec_s: of ``actual_s``, seconds spent encoding or decoding (not the link's).
            error: the failure, when the transfer failed (nothing is learnt from it).
        """
        option = decision.option
        decision.actual_s, decision.actual_bytes, decision.error = actual_s, actual_bytes, error
        key = (decision.op, size_class(decision.nbytes))
        if option is not None:
            with self._lock:
                earned = -actual_s if decision.explore else (0.0 if error else _EXPLORE_SHARE * actual_s)
                self._budget[key] = self._budget.get(key, 0.0) + earned
        elif decision.predicted_s:
            # Recomputing pays for exploring too (its predicted time: the caller's, not measured
            # here): else a link that recovered would never be tried while recompute wins.
            with self._lock:
                self._budget[key] = self._budget.get(key, 0.0) + _EXPLORE_SHARE * decision.predicted_s
        if option is not None and decision.explore and (error is not None or not actual_bytes):
            self.model.abandon_burst(decision.op, option.name, decision.nbytes)
        if option is not None and error is None:
            queued = next((c.queued for c in decision.candidates if c.option == decision.choice), ())
            decision.predicted_actual_s = self.model.predict(decision.op, option, actual_bytes, queued)
            # What moved shared the link with what was queued: learnt as that many bytes' time.
            wire = shared_wire(wire_bytes(option, actual_bytes), queued)
            best_s = None
            if decision.explore:  # what the best option was predicted to take for the KV that moved
                preds = [c.predicted_s for c in decision.candidates if c.option != RECOMPUTE and c.predicted_s]
                best_s = min(preds, default=math.inf) * actual_bytes / max(decision.nbytes, 1)
            # A burst's tries are filed under the size asked for, as abandon_burst finds them (a
            # partial hit may move a smaller class's worth).
            self.model.observe(decision.op, option.name, wire, max(actual_s - codec_s, 1e-9), policy,
                               raw_bytes=decision.nbytes if decision.explore else actual_bytes, burst_best_s=best_s)
        self.log.finished(decision)

    def forget_choice(self, option: str) -> None:
        """Drop ``option`` as the current choice everywhere (its medium failed)."""
        with self._lock:
            for key in [k for k, st in self._sticky.items() if st.current == option]:
                del self._sticky[key]


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e3:.2f} ms"
