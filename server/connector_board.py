"""Engine connectors' own counters: what vLLM (or another engine) saw of the store, by namespace.

A connector inside an engine knows things the server cannot: how many prompt
tokens the engine asked it about past what the engine held itself (looked up),
how many of those it said the store could provide (offered), how many its loads
put into the engine's cache (loaded) and its saves stored (saved); how many
blocks the engine recomputed after a failed load, how long loads and saves took.
The hit ratio is loaded over looked-up tokens (``hit_ratio``). Each connector
instance sends its cumulative counters every few seconds (``POST
/v1/connectors/report``, ``server.connectors``); the board keeps the latest
report of each instance and sums them by namespace and engine for ``/metrics``
(``kvstore_connector_*``), ``/admin/connectors`` and the dashboard. Reports are
advisory: a lost one is made good by the next.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["ConnectorBoard", "COUNTERS", "RETIRED", "hit_ratio"]

COUNTERS = {
    "lookups": "Lookups the connectors sent to the store.",
    "looked_up_tokens": "Prompt tokens the engines asked their connectors about, past those the engine "
                        "held itself (its own prefix cache), counted when a request was scheduled.",
    "offered_tokens": "Of the looked-up tokens, those the connectors answered the store could provide.",
    "lookup_errors": "Lookups that failed (each a miss for its request).",
    "loads": "Requests' loads that put blocks into the engine's cache.",
    "loaded_tokens": "Tokens the connectors' loads put into the engine's cache: what the engine took from "
                     "the store. The hit ratio is loaded over looked-up tokens.",
    "load_errors": "Loads that failed or broke part-way.",
    "failed_blocks": "Blocks promised by a lookup that did not load: the engine recomputed them.",
    "load_seconds": "Time the connectors spent loading, seconds.",
    "saves": "Saves the connectors finished.",
    "saved_tokens": "Tokens the connectors' saves stored that the store lacked.",
    "save_errors": "Saves that failed or were dropped.",
    "save_seconds": "Time the connectors spent saving, seconds.",
}
"""The counters a report may carry (``kvstore.integrations.vllm_transfer.Counters``), with the help
text ``/metrics`` gives ``kvstore_connector_<name>_total``."""
RETIRED = frozenset({"hit_tokens", "miss_tokens"})
"""Counters of connectors from before the looked-up/offered split: what the store held of a prompt,
whether or not the engine then took it from the store. Accepted and dropped, so that an engine not
yet upgraded still reports its other counters."""
_MAX_INSTANCES = 1024
_STALE_S = 3600.0
"""An instance silent this long (an engine that exited) leaves the board; its totals go with it."""


def hit_ratio(counters: dict[str, float]) -> float | None:
    """``loaded_tokens / looked_up_tokens``: of the prompt tokens the engine asked about past its own
    prefix cache, the share the store put into the engine's cache; None when nothing was looked up."""
    looked = counters.get("looked_up_tokens", 0)
    return counters.get("loaded_tokens", 0) / looked if looked else None


class ConnectorBoard:
    """The latest counters of each reporting connector instance, bounded in count."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str, str], tuple[dict[str, float], float]] = {}

    def report(self, namespace: str, engine: str, instance: str, counters: dict[str, float]) -> None:
        """Keep ``counters`` (cumulative, names of ``COUNTERS``) as the instance's latest report."""
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
        """One row per (namespace, engine): summed counters, ``hit_ratio``, instances and the newest
        report's age."""
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
        for row in rows.values():  # over the row's sums: scheduler (looked up) and workers (loaded) report apart
            row["hit_ratio"] = hit_ratio(row)
        return [rows[k] for k in sorted(rows)]

    def collect(self) -> Iterator[Metric]:
        families = {name: CounterMetricFamily(f"kvstore_connector_{name}", doc, labels=["namespace", "engine"])
                    for name, doc in COUNTERS.items()}
        for row in self.summary():
            for name, family in families.items():
                family.add_metric([row["namespace"], row["engine"]], row[name])
        yield from families.values()

    def describe(self) -> list[Metric]:
        return []
