"""The planner's decision records: what it weighed, what it chose and why, what it cost.

Every transfer the planner plans is a ``Decision`` (inputs, candidates with their
predictions, the choice, the reason, then the actual cost once it ran), kept in a
bounded ``DecisionLog`` that the client reports to the server's decision log.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvstore.costs import Option

__all__ = ["RECOMPUTE", "Candidate", "Decision", "DecisionLog"]

RECOMPUTE = "recompute"


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
