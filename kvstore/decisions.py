"""The planner's decision records: what it weighed, what it chose and why, what it cost.

Every transfer the planner plans is a ``Decision`` (inputs, candidates with their
predictions, the choice, the reason, then the actual cost once it ran), kept in a
bounded ``DecisionLog`` that the client reports to the server's decision log.

A reason names the choice first: ``"<verb> <choice>: <why>"`` (``reason_text``), with
the verb fixed by the reason's code (``REASONS``), so the text cannot name another
option than the one taken; ``reason_choice`` reads the choice back out of it.

The prediction error is defined here, once (``PREDICTION_ERROR``, ``prediction_error``):
the server's ``/admin/decisions``, ``/admin/policy`` and the dashboard all show this figure.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from kvstore.costs import Option

__all__ = ["RECOMPUTE", "REASONS", "Candidate", "Decision", "DecisionLog", "reason_text", "reason_choice",
           "WARMUP_TRANSFERS", "ERROR_WINDOW", "PREDICTION_ERROR", "relative_error", "prediction_error"]

RECOMPUTE = "recompute"

REASONS = {
    "small": "took",          # a payload of at most small_bytes: the policy's first medium, no deliberation
    "infeasible": "took",     # no option fits the receiver's buffer: the first, to fail with the typed error
    "unmeasured": "took",     # no estimate yet: the first available medium in the policy's order
    "arena": "took",          # every block in the co-located arena: read there, no request (no medium is faster)
    "explore": "explored",    # a burst of real transfers to measure an option, not because it is best
    "best": "chose",          # the lowest predicted time (and the current choice, or the first one)
    "replaced": "chose",      # the current choice became unavailable: the lowest predicted time
    "kept": "kept",           # another option is predicted faster, by less than the margin
    "waiting": "kept",        # another option beats it by the margin, not yet for the whole window
    "switched": "switched to",  # another option beat it by the margin for the window
    "proven": "switched to",  # the current choice was made before a real transfer, which showed another better
    "queue": "moved to",      # this client's own transfers in flight: another option, for this transfer only
    "beats-recompute": "chose",  # recompute beats the held option, the best fetch beats recompute
    "recompute": "chose",     # recomputing is predicted faster than fetching
}
"""Reason code -> the verb its text starts with."""

_LEADING = re.compile(r"^(?:took|chose|kept|switched to|explored|moved to) (\S+): ")


def reason_text(code: str, choice: str, why: str) -> str:
    """``"<verb> <choice>: <why>"``: the choice named first, then why that one."""
    return f"{REASONS[code]} {choice}: {why}"


def reason_choice(reason: str) -> str | None:
    """The option a reason names first (its choice), or None when it has not that form."""
    m = _LEADING.match(reason)
    return None if m is None else m.group(1)


WARMUP_TRANSFERS = 4
"""Real transfers an (op, option, path) estimate learns from before its predictions count in the
prediction error: the first ones of a process pay first-call costs and extrapolate from
probes and other sizes (they show how fast the model converges, not how well it predicts)."""
ERROR_WINDOW = 200
"""The prediction error is over the newest this many counted transfers."""
PREDICTION_ERROR = (f"median of |actual - predicted| / actual over the newest {ERROR_WINDOW} finished transfers, "
                    f"leaving out failures, recomputes, explorations and the first {WARMUP_TRANSFERS} real "
                    f"transfers of each (op, option, path) (warm-up)")
"""The definition, as the dashboard and ``/admin/decisions`` state it next to the figure."""


def relative_error(record: Mapping[str, Any]) -> float | None:
    """``|actual - predicted| / actual`` of one finished decision record (``Decision.to_dict``
    or the server's copy), or None when it does not count (``PREDICTION_ERROR``).

    Relative to the actual time, so a prediction 10x too low counts 0.9 and 10x too high 9:
    both bad, neither unbounded by a near-zero prediction. A record without ``learnt`` (a
    client from before it was reported) counts: its warm-up cannot be told apart.
    """
    actual, predicted = record.get("actual_s"), record.get("predicted_actual_s")
    if (not actual or not predicted or record.get("error") or record.get("explore")
            or record.get("choice") == RECOMPUTE):
        return None
    learnt = record.get("learnt")
    if learnt is not None and learnt < WARMUP_TRANSFERS:
        return None
    return abs(actual - predicted) / actual


def prediction_error(records: Iterable[Mapping[str, Any]], window: int = ERROR_WINDOW) -> dict[str, Any]:
    """The prediction error of ``records`` (oldest first): ``median`` (None without a counted
    record), ``p90``, ``samples`` counted, and the ``definition``; also ``by_op``, the same
    median per op."""
    errors = [(r.get("op"), e) for r in records if (e := relative_error(r)) is not None][-window:]
    by_op = {op: _median([e for o, e in errors if o == op]) for op in sorted({o for o, _ in errors})}
    values = sorted(e for _, e in errors)
    return {"median": _median(values), "p90": values[int(0.9 * (len(values) - 1))] if values else None,
            "samples": len(values), "by_op": by_op, "definition": PREDICTION_ERROR}


def _median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


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
    path: str = ""
    """How the medium would do this transfer, where it has more than one way ("cached": a shm get
    from remembered slot handles, no request); each path has its own estimate."""
    learnt: int = 0
    """Real transfers the (op, option, path) estimate had learnt from when it predicted this."""

    @property
    def alone_s(self) -> float | None:
        """The prediction without the wait: what hysteresis weighs (a queue passes; a medium's speed stays)."""
        return None if self.predicted_s is None else self.predicted_s - self.wait_s

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "predicted_s": self.predicted_s, "feasible": self.feasible, "why": self.why,
                "queued_bytes": sum(self.queued), "wait_s": self.wait_s, "path": self.path, "learnt": self.learnt}


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
    """``"<verb> <choice>: <why>"`` (``reason_text``)."""
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
    reason_code: str = ""
    """Which rule decided (a key of ``REASONS``)."""
    path: str = ""
    """The chosen candidate's path ("" or "cached")."""
    learnt: int | None = None
    """Real transfers the chosen estimate had learnt from when it predicted (under
    ``WARMUP_TRANSFERS``: warm-up, left out of the prediction error); None for recompute."""

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
                "explore": self.explore, "reason_code": self.reason_code, "path": self.path, "learnt": self.learnt}


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
