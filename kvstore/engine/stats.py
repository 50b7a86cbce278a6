"""``StoreStats``: one snapshot of a store for operators (``KVStore.stats``, ``/admin/stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from kvstore.engine.core import StoreCounters
from kvstore.tier import TierStats

__all__ = ["StoreStats"]


@dataclass(slots=True)
class StoreStats:
    """A snapshot for operators and ``/admin/stats``."""

    blocks: int
    frame_bytes: int
    """Bytes of frames held, across tiers."""
    raw_bytes: int
    """Bytes the same KV takes decoded."""
    codec_bytes_saved: int
    counters: StoreCounters
    tiers: list[TierStats] = field(default_factory=list)
    moves: dict[str, int] = field(default_factory=dict)
    """Placement moves by kind (promoted, demoted, evicted, migrated) and bytes moved."""
    shared: dict[str, Any] = field(default_factory=dict)
    """The shared tier's write policy, bytes written and blocks adopted from other nodes."""
    heat: dict[str, Any] = field(default_factory=dict)
    """The heat scorer; for ``adaptive-rate``, the memory it follows and its shadow hits."""
    reads_by_tier: dict[str, int] = field(default_factory=dict)
    """Block reads served from each tier since start, on every read path (gets, shm handles,
    block routes, co-located reads reported back): with ``tokens_hit`` it splits hits by tier.
    The one account of reads by tier: ``/admin/stats``, ``/admin/tiers``, ``/metrics``
    (``kvstore_tier_reads_total``), the dashboard and ``kvstore stats`` all report this."""
    scrub: dict[str, Any] = field(default_factory=dict)
    """The background verifier and scrubber (``kvstore.engine.scrub.ScrubStats``): frames verified
    behind their publish, blocks and bytes scrubbed, cycles completed and the last one's length,
    damaged frames they found (``counters.corrupt_blocks`` counts those with the readers')."""
    recode: dict[str, Any] = field(default_factory=dict)
    """The re-encoder (``kvstore.engine.recode.RecodeStats``): raw frames puts spilled into cold
    tiers, owed and re-encoded, and the bound on what is owed."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tiers"] = [self.tier_dict(t, self.reads_by_tier) for t in self.tiers]
        return data

    @staticmethod
    def tier_dict(tier: TierStats, reads_by_tier: Mapping[str, int]) -> dict[str, Any]:
        """``tier`` as the JSON routes show it: ``reads``, the block reads it served (from
        ``reads_by_tier``, however the bytes travelled), and ``backend_counters``, the tier's
        own operation counters (``TierCounters``). Those count only what went through the tier's
        methods (the server's reads and writes, placement's moves), never a co-located client's
        read of an shm slot: a tier that served every token can show 0 backend hits."""
        data = tier.to_dict()
        data["reads"] = reads_by_tier.get(tier.name, 0)
        data["backend_counters"] = data.pop("counters")
        return data
