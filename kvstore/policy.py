"""Planner policies as versioned data, and the canary that splits traffic between two.

A ``Policy`` is the planner's knobs (switch margin, sustained window, SLO,
small-payload threshold, which media and codecs it may pick, whether it may
answer "recompute"). It is plain data: the server keeps the baseline and an
optional candidate, clients fetch them (``GET /v1/policy``) and route each
transfer by a stable hash of its namespace or request (``PolicySet.for_key``).

``CanaryJudge`` holds what the decision records say about each version (p50/p95
transfer time) and decides when a candidate must be rolled back: its p95 worse
than the baseline's by ``rollback_margin_frac`` over at least ``min_samples``
transfers. (Each version's prediction error is ``kvstore.decisions.prediction_error``
of its records: the server computes it there, one definition for every view.)
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from kvstore.errors import InvalidInput

__all__ = ["Policy", "PolicySet", "CanaryJudge", "MEDIA", "CODECS"]

MEDIA = ("inproc", "shm", "http", "flight", "redis")
"""Every medium a policy may name, fastest-to-set-up first (the small-payload default order)."""
CODECS = ("raw", "int8")
"""Wire codecs a get may ask for ("raw": as stored when stored raw)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The planner's rules for one version. Every threshold carries its unit."""

    version: int = 1
    margin_frac: float = 0.2
    """Switch only to an option predicted faster than the current one by this fraction..."""
    window_s: float = 5.0
    """...for this long without a break (no flapping on a short blip)."""
    ewma_alpha: float = 0.3
    """Weight of the newest sample in every latency, bandwidth and codec estimate."""
    small_bytes: int = 8192
    """At or under this payload the default lowest-latency medium is taken without deliberation."""
    slo_s: float | None = None
    """Default latency SLO of a transfer; an option predicted over it is a candidate of last resort."""
    media: tuple[str, ...] = MEDIA
    """Media this policy may pick, in preference order for small payloads."""
    codecs: tuple[str, ...] = ("raw",)
    """Wire codecs it may pick for gets; add "int8" to trade <1% error for half the bytes on slow links."""
    recompute: bool = True
    """Whether get_kv may answer "recompute" when fetching is predicted slower than prefill."""
    prefetch: bool = True
    """Whether the server may prefetch on its own: hold a new put in the top tier for the next
    agent in a namespace that has shown hand-offs (``kvstore.engine.prefetch``). A candidate that
    turns this on or off is judged by its transfers' times and rolled back like any policy."""
    explore_after_s: float = 30.0
    """Probe a medium whose estimate is older than this (a bounded probe); give an option without two
    real transfers of a size class in this long two of them (real transfers); set a failed medium
    aside for this long."""
    probe_bytes: int = 2 << 20
    """Bytes a bandwidth probe moves: a few MB at most, a fraction of a second."""
    note: str = ""

    def __post_init__(self) -> None:
        _check(self.version, int, "version", lo=1)
        _check(self.margin_frac, float, "margin_frac", lo=0.0, hi=10.0)
        _check(self.window_s, float, "window_s", lo=0.0, hi=86400.0)
        _check(self.ewma_alpha, float, "ewma_alpha", lo=0.001, hi=1.0)
        _check(self.small_bytes, int, "small_bytes", lo=0, hi=1 << 30)
        if self.slo_s is not None:
            _check(self.slo_s, float, "slo_s", lo=1e-6, hi=86400.0)
        _check(self.explore_after_s, float, "explore_after_s", lo=0.0, hi=86400.0)
        _check(self.probe_bytes, int, "probe_bytes", lo=0, hi=16 << 20)
        object.__setattr__(self, "media", _names(self.media, MEDIA, "media"))
        object.__setattr__(self, "codecs", _names(self.codecs, CODECS, "codecs"))
        if not isinstance(self.recompute, bool):
            raise InvalidInput(f"policy.recompute must be true or false, got {self.recompute!r}")
        if not isinstance(self.prefetch, bool):
            raise InvalidInput(f"policy.prefetch must be true or false, got {self.prefetch!r}")
        if not isinstance(self.note, str) or len(self.note) > 200:
            raise InvalidInput("policy.note must be a string of at most 200 characters")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["media"], out["codecs"] = list(self.media), list(self.codecs)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Policy":
        """Build from JSON; unknown fields and bad values raise ``InvalidInput`` naming the field."""
        if not isinstance(data, Mapping):
            raise InvalidInput("policy must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidInput(f"policy: unknown fields {unknown}; known: {sorted(known)}")
        values = dict(data)
        for name in ("media", "codecs"):
            if name in values and isinstance(values[name], list):
                values[name] = tuple(values[name])
        return cls(**values)

    def replace(self, **changes: Any) -> "Policy":
        return replace(self, **changes)


def _check(value: Any, kind: type, name: str, *, lo: float | None = None, hi: float | None = None) -> None:
    ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise InvalidInput(f"policy.{name} must be a{'n integer' if kind is int else ' number'}{span}, got {value!r}")


def _names(value: Any, known: tuple[str, ...], name: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value) or not value:
        raise InvalidInput(f"policy.{name} must be a non-empty list of names from {list(known)}")
    bad = [v for v in value if v not in known]
    if bad or len(set(value)) != len(value):
        raise InvalidInput(f"policy.{name}: unknown or repeated {bad or list(value)}; known: {list(known)}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class PolicySet:
    """The baseline, and optionally a candidate taking ``fraction`` of traffic."""

    baseline: Policy = field(default_factory=Policy)
    candidate: Policy | None = None
    fraction: float = 0.0
    """Share of routing keys the candidate gets, in [0, 1]."""

    def __post_init__(self) -> None:
        _check(self.fraction, float, "fraction", lo=0.0, hi=1.0)
        if self.candidate is not None and self.candidate.version == self.baseline.version:
            raise InvalidInput(f"the candidate needs a version other than the baseline's ({self.baseline.version})")

    def for_key(self, routing_key: str) -> Policy:
        """The policy of one routing key (a namespace or a request id): the same key, the same policy."""
        if self.candidate is None or self.fraction <= 0.0:
            return self.baseline
        return self.candidate if bucket(routing_key) < self.fraction else self.baseline

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline.to_dict(), "fraction": self.fraction,
                "candidate": None if self.candidate is None else self.candidate.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> "PolicySet":
        if not isinstance(data, Mapping):
            raise InvalidInput("policies must be a JSON object")
        cand = data.get("candidate")
        return cls(Policy.from_dict(data.get("baseline", {})), None if cand is None else Policy.from_dict(cand),
                   data.get("fraction", 0.0))


def bucket(routing_key: str) -> float:
    """A stable number in [0, 1) for ``routing_key``: the same in every process and run."""
    digest = hashlib.blake2b(routing_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


class CanaryJudge:
    """Per-version transfer times, and the rollback rule.

    Args:
        min_samples: transfers each version needs before the candidate can be judged.
        rollback_margin_frac: roll back when the candidate's p95 exceeds the baseline's by this fraction.
        keep: newest samples kept per version.
    """

    def __init__(self, min_samples: int = 20, rollback_margin_frac: float = 0.25, keep: int = 2048) -> None:
        self.min_samples = 1
        self.rollback_margin_frac = 0.25
        self.configure(min_samples=min_samples, rollback_margin_frac=rollback_margin_frac)
        self._times: dict[int, deque[float]] = {}
        self._keep = keep

    @staticmethod
    def check(min_samples: Any = None, rollback_margin_frac: Any = None) -> None:
        """Raise ``InvalidInput`` naming the first bad setting (nothing is changed)."""
        if min_samples is not None and (isinstance(min_samples, bool) or not isinstance(min_samples, int)
                                        or not 1 <= min_samples <= 1_000_000):
            raise InvalidInput(f"min_samples must be an integer in [1, 1000000], got {min_samples!r}")
        if rollback_margin_frac is not None:
            _check(rollback_margin_frac, float, "rollback_margin_frac", lo=0.0, hi=100.0)

    def configure(self, min_samples: Any = None, rollback_margin_frac: Any = None) -> None:
        self.check(min_samples, rollback_margin_frac)
        if min_samples is not None:
            self.min_samples = min_samples
        if rollback_margin_frac is not None:
            self.rollback_margin_frac = float(rollback_margin_frac)

    def observe(self, version: int, actual_s: float) -> None:
        """One measured transfer of ``version``."""
        self._times.setdefault(version, deque(maxlen=self._keep)).append(actual_s)

    def forget(self, version: int) -> None:
        self._times.pop(version, None)

    def summary(self, version: int) -> dict[str, Any]:
        times = sorted(self._times.get(version, ()))
        return {"samples": len(times), "p50_s": _quantile(times, 0.5), "p95_s": _quantile(times, 0.95)}

    def verdict(self, baseline: int, candidate: int) -> str | None:
        """Why the candidate must be rolled back, or None while it holds (or has too few samples)."""
        base, cand = self.summary(baseline), self.summary(candidate)
        if min(base["samples"], cand["samples"]) < self.min_samples:
            return None
        limit = base["p95_s"] * (1.0 + self.rollback_margin_frac)
        if cand["p95_s"] > limit:
            return (f"candidate v{candidate} p95 {cand['p95_s'] * 1e3:.2f} ms is over the baseline v{baseline}'s "
                    f"{base['p95_s'] * 1e3:.2f} ms by more than {self.rollback_margin_frac:.0%} "
                    f"({cand['samples']} vs {base['samples']} samples)")
        return None


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
