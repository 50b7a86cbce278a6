"""Engine connectors' own counters: what vLLM (or another engine) saw of the store, by namespace.

A connector inside an engine knows things the server cannot: how many prompt
tokens it looked up and missed, how many blocks it had to recompute after a
failed load, how long its loads and saves took. It sends its cumulative counters
every few seconds (``POST /v1/connectors/report``, ``server.connectors``); the
board keeps the latest report of each instance and sums them by namespace and
engine for ``/metrics`` (``kvstore_connector_*``), ``/admin/connectors`` and the
dashboard. Reports are advisory: a lost one is made good by the next.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["ConnectorBoard", "COUNTERS"]

COUNTERS = ("lookups", "hit_tokens", "miss_tokens", "lookup_errors", "loads", "loaded_tokens", "load_errors",
            "failed_blocks", "load_seconds", "saves", "saved_tokens", "save_errors", "save_seconds")
"""The counters a report may carry (``kvstore.integrations.vllm_transfer.Counters``)."""
_MAX_INSTANCES = 1024
_STALE_S = 3600.0
"""An instance silent this long (an engine that exited) leaves the board; its totals go with it."""


class ConnectorBoard:
    """The latest counters of each reporting connector instance, bounded in count."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str, str], tuple[dict[str, float], float]] = {}

    def report(self, namespace: str, engine: str, instance: str, counters: dict[str, float]) -> None:
        now = self._clock()
        with self._lock:
            self._latest.pop((namespace, engine, instance), None)  # re-inserted last: dict order is recency
            self._latest[(namespace, engine, instance)] = (dict(counters), now)
            self._expire(now)

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, seen) in self._latest.items() if now - seen > _STALE_S]:
            del self._latest[key]
        while len(self._latest) > _MAX_INSTANCES:
            del self._latest[next(iter(self._latest))]

    def summary(self) -> list[dict[str, Any]]:
        """One row per (namespace, engine): summed counters, instances and the newest report's age."""
        now = self._clock()
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        with self._lock:
            self._expire(now)
            for (ns, engine, _), (counters, seen) in self._latest.items():
                row = rows.setdefault((ns, engine), {"namespace": ns, "engine": engine, "instances": 0,
                                                     "age_s": now - seen, **{c: 0 for c in COUNTERS}})
                row["instances"] += 1
                row["age_s"] = min(row["age_s"], now - seen)
                for name in COUNTERS:
                    row[name] += counters.get(name, 0)
        return [rows[k] for k in sorted(rows)]

    def collect(self) -> Iterator[Metric]:
        families = {name: CounterMetricFamily(f"kvstore_connector_{name}",
                                              f"Engine connectors' {name.replace('_', ' ')}, as they reported.",
                                              labels=["namespace", "engine"]) for name in COUNTERS}
        for row in self.summary():
            for name, family in families.items():
                family.add_metric([row["namespace"], row["engine"]], row[name])
        yield from families.values()

    def describe(self) -> list[Metric]:
        return []
