"""The planner's cost model: options, measured seconds per byte, predictions.

An ``Option`` is a medium (and, for gets, a wire codec). ``Estimate`` keeps an
EWMA of seconds per byte per payload size class from real transfers, with a
line fitted through the measured classes for sizes not seen yet, and the
probes' line (plus the work they do not do) before any real transfer;
``CostModel`` holds the estimates of every option and path and the codecs'
measured costs, and predicts a transfer's seconds (``kvstore.planner``
explains the formula).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvstore.errors import InvalidInput
from kvstore.policy import Policy

__all__ = ["Option", "Estimate", "CostModel", "wire_bytes", "shared_wire", "size_class"]

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


BURST_MAX = 8
BURST_GAIN = 0.9
BURST_CLOSE = 1.5
"""An option explored for a size class gets a burst of real transfers in a row, and only the
fastest of them is learnt: a medium warms up over its first transfers after other media's
(1 MiB HTTP gets measured 1.31, 1.00, 0.84, 0.78, 0.73, then 0.72-0.78 ms; a first 8 MiB int8
get 12x its later ones). A contender within ``BURST_CLOSE`` of the best option gets all
``BURST_MAX`` (a close call needs the warm figure, and trying it costs little: with five, an
8 MiB int8 get still measured 5% over its steady state, and lost a 10% lead to hysteresis); one
further behind stops once a transfer is no longer ``BURST_GAIN`` times faster than the fastest
before it: a 670 ms transfer, twice the best, is not repeated eight times."""
EXPLORE_WITHIN = 4.0  # explore an unmeasured option predicted at most this many times the best
EXPLORE_SHARE = 0.25
"""Exploring is paid for by exploiting: each size class earns this fraction of its chosen
transfers' time as exploration budget, and a burst starts only when the budget covers one
transfer of the explored option. An agent that gets once gets the best option, not a try of
another (a demo agent's only get once went to HTTP at 2.7x shm's predicted time)."""
_SPIKE = 2.0  # a real transfer's seconds per byte counts as at most this many times its class's estimate
_FIRST = 3
"""The first transfers of a size class pay first-call costs (a first 256 KiB shm put took 75 ms,
the next ones 13, 9.7 and 7.1, then 2.6): while a class has learnt fewer than this many, a faster
transfer replaces its estimate instead of being averaged in."""
_PROBE_WEIGHT = 0.25  # a probe moves filler over a bare route: it counts, but less than a real transfer


@dataclass(slots=True)
class Estimate:
    """What one option costs: per size class, an EWMA of seconds per byte; across sizes, a fit.

    A size class (4x wide) with a real transfer learnt predicts from its own
    EWMA. A class not measured yet takes a line, ``latency + bytes / bandwidth``:

    - through the measured classes, two or more of them: a weighted least-squares fit
      of one point per class (its latest size at its EWMA's rate), weighing points by
      ``1 / seconds**2`` so that the fit minimizes relative error (a 64 KiB class counts
      as much as a 64 MiB one). One point per class, not per transfer: thousands of
      64 KiB gets must not decide alone what 16 MiB costs.
    - through one measured class: the probes' line (below), scaled to meet that class.
      The probes tell how cost grows with size; a real transfer tells its level. A real
      put or get pays fixed costs a probe does not (the server's handling, the requests
      of a shm put), so a first 64 KiB shm put measured 43x what its probe said; scaled,
      the next size's first transfer is predicted within about 4x instead of 40x.
    - with no real transfer yet: the probes' line, a fit through the empty round trips
      and the bounded probe, plus ``overhead_s``: the work a real transfer does that the
      probe does not (set by the client: a shm put's reserve and commit requests).
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
    _learnt_by_class: dict[int, int] = field(default_factory=dict)
    """Size class -> real measurements learnt there (``_FIRST``)."""
    _bytes_by_class: dict[int, int] = field(default_factory=dict)
    """Size class -> wire bytes of its latest real transfer (where its point sits in the fit)."""
    _probes: dict[int, list[float]] = field(default_factory=dict)
    """Size class -> [bytes, seconds] EWMA of probe transfers; key -1: empty round trips."""
    _bursts: dict[int, list[float]] = field(default_factory=dict)
    """Size class -> [transfers, fastest seconds per byte] of an exploration burst under way (one
    cut short by a failed or empty try is dropped: ``abandon_burst``)."""
    overhead_s: float = 0.0
    """Fixed seconds a real transfer pays that the probes do not (work the probe does not do: a
    shm put's reserve and commit); the prior's only, until a real transfer is learnt."""
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
                warm = b[0] >= 1 and spb >= BURST_GAIN * b[1]
                b[0], b[1] = b[0] + 1, min(b[1], spb)
                close = b[1] * nbytes <= BURST_CLOSE * burst_best_s
                if b[0] >= BURST_MAX or (warm and not close):
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
        """One real measurement of a size class: into its EWMA, taken in log space (a geometric
        mean: a transfer's time is skewed, stalls make it longer, nothing makes it much shorter)
        and capped at ``_SPIKE`` times the estimate. A lone stall (a 4 ms get among 0.8 ms ones)
        then moves it by at most a factor ``_SPIKE ** alpha`` (1.23) instead of flipping the
        choice, while a lasting slowdown still raises it by that factor per transfer (10x in
        about eleven transfers at the default alpha). Replayed over four mixed sessions on a
        loaded 2-core machine, the median prediction error was 0.39 with a plain mean of the
        capped times, 0.34 with the geometric one, and 0.29 with ``_FIRST`` too."""
        self.real_by_class[cls] = now_s
        self._bytes_by_class[cls] = nbytes
        self._bursts.pop(cls, None)  # learnt: a burst under way there has nothing left to add
        old = self.s_per_byte_by_class.get(cls)
        n = self._learnt_by_class.get(cls, 0)
        self._learnt_by_class[cls] = n + 1
        if old is None or (n < _FIRST and spb < old):
            self.s_per_byte_by_class[cls] = spb
        else:
            self.s_per_byte_by_class[cls] = old * min(spb / old, _SPIKE) ** alpha

    def _fit(self) -> None:
        self._fit_stale = False
        real = [(float(x), self.s_per_byte_by_class[c] * x, 1.0) for c, x in self._bytes_by_class.items()]
        prior = self._probe_line()
        if prior is not None:
            prior = (prior[0] + self.overhead_s, prior[1])
        if len(real) >= 2:
            line = _wls(real)
            if line is not None:
                self._latency_s, self._s_per_byte = line
                return
        if not real:
            if prior is not None:
                self._latency_s, self._s_per_byte = prior
            return
        x, t, _ = max(real)
        if prior is not None and prior[1] is not None:  # the probes' shape, at the measured level
            k = t / (prior[0] + prior[1] * x)
            self._latency_s, self._s_per_byte = k * prior[0], k * prior[1]
            return
        # No sized probe: latency from the empty round trips (at most half the fastest point:
        # faster than the fixed cost alone means that estimate was high), the rest as bandwidth.
        lat = min(prior[0] if prior else 0.0, 0.5 * min(p[1] for p in real))
        self._latency_s, self._s_per_byte = lat, max(t - lat, 1e-12) / x

    def _probe_line(self) -> tuple[float, float | None] | None:
        """(latency, seconds per byte) from the probes alone (None per byte: no sized probe)."""
        pts = [(x, t, 1.0 if x == 0 else _PROBE_WEIGHT) for x, t in self._probes.values()]
        sized = [p for p in pts if p[0] > 0]
        if not sized:
            return (pts[0][1], None) if pts else None
        line = _wls(pts) if len({p[0] for p in pts}) >= 2 else None
        if line is not None:
            return line
        # One size, or points no line with a non-negative latency fits: latency from the empty
        # round trips (at most half the fastest point), the rest as bandwidth, by the largest point.
        rtt = self._probes.get(-1)
        x, t, _ = max(sized)
        lat = min(rtt[1] if rtt else 0.0, 0.5 * min(p[1] for p in sized))
        return lat, max(t - lat, 1e-12) / x

    def to_dict(self) -> dict[str, Any]:
        bw = None if not self.s_per_byte else 1.0 / self.s_per_byte / 1e9
        return {"latency_ms": None if self.latency_s is None else self.latency_s * 1e3,
                "bandwidth_gbps": bw, "samples": self.samples, "real_samples": self.real_samples,
                "overhead_ms": self.overhead_s * 1e3, "real_classes": len(self.s_per_byte_by_class)}


def _wls(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(latency, seconds per byte) of the least-squares line through ``(bytes, seconds, weight)``
    points, each weighed ``weight / seconds**2`` (relative error); None when no line with a
    positive slope and a non-negative latency fits."""
    sw = sx = sy = sxx = sxy = 0.0
    for x, t, weight in points:
        w = weight / (t * t)
        sw, sx, sy, sxx, sxy = sw + w, sx + w * x, sy + w * t, sxx + w * x * x, sxy + w * x * t
    var_x = sxx / sw - (sx / sw) ** 2
    if var_x <= 0:
        return None
    slope = (sxy / sw - (sx / sw) * (sy / sw)) / var_x
    icpt = sy / sw - slope * sx / sw
    return (icpt, slope) if slope > 0 and icpt >= 0 else None


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


def _key(op: str, option: str, path: str = "") -> str:
    """An estimate's name: "get:shm", or with a path "get:shm@cached"."""
    return f"{op}:{option}@{path}" if path else f"{op}:{option}"


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
                real: bool = True, raw_bytes: int | None = None, burst_best_s: float | None = None,
                path: str = "") -> None:
        """One timed transfer (``real``) or probe of ``op`` ("get" or "put") over ``option``.

        Args:
            nbytes: bytes on the wire.
            raw_bytes: the KV bytes they carry, when a codec made them fewer (names the size class).
            burst_best_s: for a transfer of an exploration burst, the best option's predicted
                seconds for the same KV (``Estimate.observe``).
            path: how the medium did it, where it has more than one way ("cached": a shm get
                from remembered slot handles, without a request); each has its own estimate.
        """
        with self._lock:
            self.links.setdefault(_key(op, option, path), Estimate()).observe(
                nbytes, seconds, policy.ewma_alpha, policy.small_bytes, self.clock(), real, raw_bytes, burst_best_s)

    def set_overhead(self, op: str, option: str, seconds: float, path: str = "") -> None:
        """What a real ``op`` over ``option`` pays that its probe does not (``Estimate.overhead_s``)."""
        with self._lock:
            est = self.links.setdefault(_key(op, option, path), Estimate())
            if est.overhead_s != seconds:
                est.overhead_s, est._fit_stale = max(0.0, seconds), True

    def learnt(self, op: str, option: str, path: str = "") -> int:
        """Real transfers the estimate of ``op`` over ``option`` (and ``path``) has learnt from."""
        with self._lock:
            est = self.links.get(_key(op, option, path))
            return 0 if est is None else est.real_samples

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

    def predict(self, op: str, option: Option, raw_bytes: int, queued: Sequence[int] = (),
                path: str = "") -> float | None:
        """Seconds to ``op`` ``raw_bytes`` of KV over ``option`` (and ``path``); None before any
        estimate exists.

        ``queued``: wire bytes of each transfer this client already has in flight over the same
        medium. They share the link (``shared_wire``).
        """
        with self._lock:
            est = self.links.get(_key(op, option.name, path))
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

    def abandon_burst(self, op: str, option: str, raw_bytes: int, path: str = "") -> None:
        with self._lock:
            est = self.links.get(_key(op, option, path))
            if est is not None:
                est.abandon_burst(raw_bytes)

    def recompute_s(self, fingerprint: str, tokens: int) -> float | None:
        with self._lock:
            rate = self.prefill_tps.get(fingerprint)
        return None if rate is None else tokens / rate

    def age_s(self, op: str, option: str, *, nbytes: int | None = None, path: str = "") -> float:
        """Seconds since the last sample, probe or real; with ``nbytes``, since the last real transfer
        (or exploration burst) of its size class was learnt (inf before any)."""
        with self._lock:
            est = self.links.get(_key(op, option, path))
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
