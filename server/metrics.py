"""Prometheus metrics: request latencies measured here, store and tier figures read at scrape.

Each app has its own registry, so several apps in one process (tests) never
share series. Store figures come from one ``store.stats()`` per scrape, taken
by a custom collector; ``/metrics`` runs it off the event loop because a
Redis tier's stats are a network round trip. The planner's prediction error is
worked out at scrape too, from the decision records the server keeps
(``Metrics.read_decisions``), by the one definition (``kvstore.decisions``).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvstore.decisions import PREDICTION_ERROR, prediction_error

__all__ = ["Metrics"]

log = logging.getLogger("kvstore.server")

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


_READS_DOC = ("Block reads served from the tier since start, on every read path: server gets, co-located "
              "clients' shm reads (reported back), block routes. The store's reads_by_tier, as /admin/stats "
              "and the dashboard show it; lm:// listener reads are not counted.")
_HITS_DOC = "Same as kvstore_tier_reads_total (the name kept for existing dashboards and alerts)."
_BACKEND_NOTE = (" As the tier itself saw them: only what went through its methods (the server's own reads and "
                 "writes, placement's moves), never a co-located client's read of an shm slot.")
_BACKEND_COUNTERS = (
    ("gets", "Frame reads the tier answered."),
    ("hits", "Frame reads the tier answered with a frame."),
    ("misses", "Frame reads the tier answered with nothing."),
    ("puts", "Frames written to the tier."),
    ("deletes", "Frame deletes the tier answered."),
    ("errors", "Tier operations that failed."),
)
_LEGACY_COUNTERS = ("misses", "puts", "gets", "errors", "deletes")
"""The tier's own counters under their old names (before the ``backend_`` ones), kept so existing
queries keep working; ``kvstore_tier_hits`` now reports reads served (``kvstore_tier_reads``)."""


class _StoreCollector:
    """Turns one ``store.stats()`` snapshot into metric families."""

    def __init__(self, stats: Callable[[], Any], extra: Callable[[], dict[str, float]]) -> None:
        self._stats = stats
        self._extra = extra

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception as exc:  # a closed store: report nothing rather than fail the scrape
            log.warning("metrics: store stats failed: %s", exc)
            return
        g = {name: GaugeMetricFamily(f"kvstore_tier_{name}", doc, labels=["tier", "kind"]) for name, doc in (
            ("bytes", "Frame bytes held by the tier."),
            ("capacity_bytes", "Capacity of the tier, bytes."),
            ("entries", "Frames held by the tier."),
            ("up", "1 when the tier's backing answers, 0 when it is unavailable."),
        )}
        # Reads by the tier that served them, however the bytes travelled: the store's one account.
        reads = CounterMetricFamily("kvstore_tier_reads", _READS_DOC, labels=["tier", "kind"])
        hits = CounterMetricFamily("kvstore_tier_hits", _HITS_DOC, labels=["tier", "kind"])
        # The tier's own operation counters, as its methods saw them.
        backend = {name: CounterMetricFamily(f"kvstore_tier_backend_{name}", doc + _BACKEND_NOTE,
                                             labels=["tier", "kind"]) for name, doc in _BACKEND_COUNTERS}
        legacy = {name: CounterMetricFamily(f"kvstore_tier_{name}", f"Deprecated name of kvstore_tier_backend_{name}"
                                            "_total, the tier's own counter.", labels=["tier", "kind"])
                  for name in _LEGACY_COUNTERS}
        for t in s.tiers:
            labels = [t.name, t.kind]
            g["bytes"].add_metric(labels, t.used_bytes)
            g["capacity_bytes"].add_metric(labels, t.capacity_bytes)
            g["entries"].add_metric(labels, t.entries)
            g["up"].add_metric(labels, 0 if t.details.get("connected") == "no" else 1)
            served = s.reads_by_tier.get(t.name, 0)
            reads.add_metric(labels, served)
            hits.add_metric(labels, served)
            for name, family in backend.items():
                family.add_metric(labels, getattr(t.counters, name))
            for name, family in legacy.items():
                family.add_metric(labels, getattr(t.counters, name))
        yield from g.values()
        yield reads
        yield hits
        yield from backend.values()
        yield from legacy.values()
        moves = CounterMetricFamily("kvstore_moves", "Placement moves by reason.", labels=["reason"])
        for reason, n in s.moves.items():
            if reason not in ("bytes_moved", "entries"):
                moves.add_metric([reason], n)
        yield moves
        yield CounterMetricFamily("kvstore_moved_bytes", "Bytes moved by placement.",
                                  value=s.moves.get("bytes_moved", 0))
        yield GaugeMetricFamily("kvstore_codec_bytes_saved", "Raw KV bytes minus frame bytes held.",
                                value=s.codec_bytes_saved)
        yield GaugeMetricFamily("kvstore_blocks", "Blocks indexed.", value=s.blocks)
        yield GaugeMetricFamily("kvstore_frame_bytes", "Frame bytes held across tiers.", value=s.frame_bytes)
        yield GaugeMetricFamily("kvstore_raw_bytes", "Decoded KV bytes of the blocks held.", value=s.raw_bytes)
        ops = CounterMetricFamily("kvstore_store_ops", "Store counters since start.", labels=["counter"])
        for name in ("put_calls", "get_calls", "lookup_calls", "blocks_written", "blocks_deduped", "blocks_deleted",
                     "tokens_requested", "tokens_hit", "corrupt_blocks", "stale_blocks", "tier_errors"):
            ops.add_metric([name], getattr(s.counters, name))
        yield ops
        sc = s.scrub or {}
        for name, key, doc in (
                ("verify_behind_blocks", "verified_blocks", "Frames the server verified right after their publish."),
                ("verify_behind_bytes", "verified_bytes", "Bytes of the frames verified right after their publish."),
                ("scrub_blocks", "scrubbed_blocks", "Arena frames re-verified by the scrubber."),
                ("scrub_bytes", "scrubbed_bytes", "Arena bytes re-verified by the scrubber."),
                ("scrub_cycles", "cycles", "Scrub cycles completed over every arena block."),
                ("scrub_damaged", "damaged_found", "Damaged frames the verifier or scrubber found and dropped.")):
            yield CounterMetricFamily(f"kvstore_{name}", doc, value=sc.get(key, 0))
        yield GaugeMetricFamily("kvstore_scrub_last_cycle_seconds", "How long the last scrub cycle took.",
                                value=sc.get("last_cycle_s", 0.0))
        yield GaugeMetricFamily("kvstore_scrub_rate_bytes_per_second",
                                "The scrubber's rate (KVSTORE_SCRUB_BYTES_PER_S; 0: off).",
                                value=sc.get("rate_bytes_per_s", 0))
        rc = s.recode or {}
        for name, key, doc in (
                ("recode_spilled_raw_blocks", "spilled_raw_blocks",
                 "Blocks puts wrote raw into a cold tier, owed an int8 re-encode."),
                ("recode_demoted_raw_blocks", "demoted_raw_blocks",
                 "Blocks the mover demoted raw into a cold tier, owed an int8 re-encode."),
                ("recode_blocks", "recoded_blocks", "Raw cold-tier frames re-encoded behind the put."),
                ("recode_bytes_saved", "recoded_bytes_saved", "Frame bytes the re-encodes saved.")):
            yield CounterMetricFamily(f"kvstore_{name}", doc, value=rc.get(key, 0))
        yield GaugeMetricFamily("kvstore_recode_pending_bytes", "Raw cold-tier frame bytes owed a re-encode now.",
                                value=rc.get("pending_bytes", 0))
        yield GaugeMetricFamily("kvstore_recode_backlog_limit_bytes",
                                "The bound on bytes owed a re-encode (KVSTORE_RECODE_BACKLOG_BYTES; 0: off).",
                                value=rc.get("backlog_bytes", 0))
        for name, value in self._extra().items():
            yield GaugeMetricFamily(f"kvstore_{name}", f"Service figure {name}.", value=value)


class _PlannerCollector:
    """The planner's prediction error at scrape time, over the decision records the server keeps.

    The figure is ``kvstore.decisions.prediction_error`` of every kept record, the one the
    dashboard's decisions panel and ``/admin/decisions`` (unfiltered) show; ``records`` is where
    those records are read (``Metrics.read_decisions``), off the event loop.
    """

    def __init__(self) -> None:
        self.records: Callable[[], Iterable[Mapping[str, Any]]] = tuple

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        try:
            error = prediction_error(self.records())
        except Exception as exc:  # a record source that failed: leave the figure out rather than fail the scrape
            log.warning("metrics: planner decision records failed: %s", exc)
            return
        median = error["median"]
        yield GaugeMetricFamily("kvstore_planner_prediction_error",
                                f"The planner's prediction error, as the dashboard shows it: the {PREDICTION_ERROR}. "
                                "NaN while no transfer counts.", value=math.nan if median is None else median)
        yield GaugeMetricFamily("kvstore_planner_prediction_error_samples",
                                "Transfers kvstore_planner_prediction_error is the median over.",
                                value=error["samples"])


_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, float("inf"))
"""actual/predicted: 1.0 is a perfect prediction; the buckets are finer near it."""


class Metrics:
    """The series the server records itself, plus the store collector."""

    def __init__(self, stats: Callable[[], Any], extra: Callable[[], dict[str, float]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram("kvstore_request_duration_seconds", "Request latency by route.",
                                 ["route", "method"], buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.requests = Counter("kvstore_requests", "Requests by route and status.",
                                ["route", "method", "status"], registry=self.registry)
        self.transfer = Counter("kvstore_transfer_bytes", "KV bytes carried, by direction and medium.",
                                ["direction", "medium"], registry=self.registry)
        self.colocated = Counter("kvstore_colocated_ops", "Requests served through shared memory.",
                                 ["op"], registry=self.registry)
        self.channel = Counter("kvstore_commit_channel_requests", "Requests over the commit channel (a Unix "
                               "socket; server.commit_channel), by status; also counted in kvstore_requests.",
                               ["status"], registry=self.registry)
        self.auth_failures = Counter("kvstore_auth_failures", "Requests refused with 401 or 403.",
                                     ["status"], registry=self.registry)
        self.evicted = Counter("kvstore_admin_evicted_blocks", "Blocks removed by eviction requests.",
                               registry=self.registry)
        self.prediction = Histogram("kvstore_planner_prediction_ratio",
                                    "Planner decisions' actual over predicted transfer time, by medium.",
                                    ["medium"], buckets=_RATIO_BUCKETS, registry=self.registry)
        self.decisions = Counter("kvstore_planner_decisions", "Planner decisions reported by clients, by option.",
                                 ["op", "choice"], registry=self.registry)
        self.rollbacks = Counter("kvstore_planner_rollbacks", "Canary policies rolled back, by who.",
                                 ["by"], registry=self.registry)
        self.lmcache_requests = Counter("kvstore_lmcache_requests", "lm:// listener requests, by command and outcome.",
                                        ["command", "result"], registry=self.registry)
        self.lmcache_closed = Counter("kvstore_lmcache_closed_connections",
                                      "lm:// connections the listener closed on bad input, by reason.",
                                      ["reason"], registry=self.registry)
        self.lmcache_connections = Gauge("kvstore_lmcache_connections", "Open lm:// connections.",
                                         registry=self.registry)
        self.registry.register(_StoreCollector(stats, extra))  # type: ignore[arg-type]
        self._planner = _PlannerCollector()
        self.registry.register(self._planner)  # type: ignore[arg-type]

    def read_decisions(self, records: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        """Make ``kvstore_planner_prediction_error`` the prediction error of ``records()``.

        Args:
            records: the server's kept decision records, oldest first (as ``/admin/decisions``
                reads them). Called at each scrape from a pool thread, so it must be safe to call
                while the event loop adds records.
        """
        self._planner.records = records
