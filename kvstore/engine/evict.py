"""Operator eviction: pick blocks by what they are, then delete them through the store.

An ``EvictionQuery`` names blocks by any mix of selectors, all of which must
hold (AND): explicit keys, a token prefix under a spec and namespace, a
namespace, a spec fingerprint, a tier, a last access older than some age, or
"the coldest of a tier until it is under a watermark". ``select`` turns a query
into an ``EvictionPlan`` from ``store.entries()`` alone (a dry run stops here);
``evict`` carries the plan out with ``store.delete_blocks``.

Pinned blocks are skipped unless the query says ``include_pinned``: a pin is a
promise placement keeps, and an operator breaks it only on purpose.

A prefix selects the stored blocks of that token sequence. Longer sequences
that extend it keep their own later blocks, which no lookup can reach once the
prefix is gone; placement ages them out as it does any cold block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvstore.errors import InvalidInput
from kvstore.engine.index import IndexEntry
from kvstore.keys import BlockHash, block_hashes, check_key, validate_namespace
from kvstore.spec import KVSpec

__all__ = ["EvictionQuery", "EvictionPlan", "EvictionResult", "select", "evict", "coldest_first"]


@dataclass(frozen=True, slots=True)
class EvictionQuery:
    """Which blocks to evict; every selector given must match (AND)."""

    keys: tuple[BlockHash, ...] | None = None
    prefix_spec: KVSpec | None = None
    """With ``prefix_tokens``: the blocks of that token sequence (namespace: ``namespace`` or default)."""
    prefix_tokens: Any = None
    namespace: str | None = None
    fingerprint: str | None = None
    """A spec fingerprint (``KVSpec.fingerprint()``, 64 hex digits): every block of that model."""
    tier: str | None = None
    older_than_s: float | None = None
    """Last access more than this many seconds ago."""
    watermark_frac: float | None = None
    """With ``tier``: the coldest matching blocks until the tier's used bytes are at most
    this share of its capacity."""
    include_pinned: bool = False
    limit: int | None = None
    """At most this many blocks (coldest first)."""
    namespaces_allowed: frozenset[str] | None = None
    """Set by a tenant-scoped caller: blocks of other namespaces are never selected, nor counted."""

    def __post_init__(self) -> None:
        if self.keys is not None:
            try:
                object.__setattr__(self, "keys", tuple(check_key(k) for k in self.keys))
            except InvalidInput as exc:
                raise InvalidInput(f"keys: {exc}") from exc
        if (self.prefix_spec is None) != (self.prefix_tokens is None):
            raise InvalidInput("prefix: give both the spec and the tokens")
        if self.prefix_spec is not None and not isinstance(self.prefix_spec, KVSpec):
            raise InvalidInput("prefix.spec must be a KVSpec")
        if self.namespace is not None:
            validate_namespace(self.namespace)
        if self.fingerprint is not None and (not isinstance(self.fingerprint, str) or len(self.fingerprint) != 64):
            raise InvalidInput(f"fingerprint must be a spec fingerprint of 64 hex digits, got {self.fingerprint!r}")
        age = self.older_than_s
        if age is not None and (isinstance(age, bool) or not isinstance(age, (int, float)) or age < 0):
            raise InvalidInput(f"older_than_s must be a non-negative number of seconds, got {self.older_than_s!r}")
        if self.watermark_frac is not None:
            if self.tier is None:
                raise InvalidInput("watermark: needs a tier")
            if not (isinstance(self.watermark_frac, (int, float)) and 0 <= self.watermark_frac <= 1):
                raise InvalidInput(f"watermark.frac must be in [0, 1], got {self.watermark_frac!r}")
        limit = self.limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise InvalidInput(f"limit must be a non-negative int, got {self.limit!r}")
        if not self.selective:
            raise InvalidInput("an eviction needs at least one selector: keys, prefix, namespace, fingerprint, "
                               "tier, older_than_s or watermark")

    @property
    def selective(self) -> bool:
        return any(v is not None for v in (self.keys, self.prefix_spec, self.namespace, self.fingerprint,
                                           self.tier, self.older_than_s, self.watermark_frac))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for the audit log."""
        out: dict[str, Any] = {}
        if self.keys is not None:
            out["keys"] = len(self.keys)
        if self.prefix_spec is not None:
            out["prefix"] = {"model_id": self.prefix_spec.model_id, "tokens": len(self.prefix_tokens)}
        for name in ("namespace", "fingerprint", "tier", "older_than_s", "watermark_frac", "limit"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.include_pinned:
            out["include_pinned"] = True
        return out


@dataclass(slots=True)
class EvictionPlan:
    """What a query selects; a dry run's answer."""

    entries: list[IndexEntry]
    skipped_pinned: int = 0

    @property
    def blocks(self) -> int:
        return len(self.entries)

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def by_tier(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            t = out.setdefault(e.tier, {"blocks": 0, "bytes": 0})
            t["blocks"] += 1
            t["bytes"] += e.size
        return out


@dataclass(slots=True)
class EvictionResult:
    plan: EvictionPlan
    dry_run: bool
    removed_blocks: int = 0
    removed_bytes: int = 0
    keys: list[str] = field(default_factory=list)


def coldest_first(store: Any, entries: Sequence[IndexEntry]) -> list[IndexEntry]:
    """``entries`` ordered coldest first: placement's heat score, then last access."""
    def key(e: IndexEntry) -> tuple[float, float]:
        info = store.placement.explain(e.key)
        score = info["heat_score"] if info else None
        return (float("-inf") if score is None else score, e.last_access_s)  # None: never accessed, coldest

    return sorted(entries, key=key)


def select(store: Any, query: EvictionQuery, now_s: float | None = None) -> EvictionPlan:
    """The blocks ``query`` selects, coldest first; nothing is removed.

    Raises:
        InvalidInput: an unknown tier.
    """
    now = getattr(store, "clock", time.time)() if now_s is None else now_s  # the clock entries were stamped by
    tiers = {t.name: t for t in store.tiers}
    if query.tier is not None and query.tier not in tiers:
        raise InvalidInput(f"tier: unknown tier {query.tier!r}; tiers are {sorted(tiers)}")
    wanted: set[bytes] | None = set(query.keys) if query.keys is not None else None
    if query.prefix_spec is not None:
        ns = query.namespace or "default"
        chain = set(block_hashes(query.prefix_spec, query.prefix_tokens, ns))
        wanted = chain if wanted is None else wanted & chain
    spec_fp = query.prefix_spec.fingerprint() if query.prefix_spec is not None else None
    matched = []
    for e in store.entries():
        if query.namespaces_allowed is not None and e.namespace not in query.namespaces_allowed:
            continue
        if wanted is not None and e.key not in wanted:
            continue
        if spec_fp is not None and e.spec_fp != spec_fp:
            continue
        if query.namespace is not None and e.namespace != query.namespace:
            continue
        if query.fingerprint is not None and e.spec_fp != query.fingerprint.lower():
            continue
        if query.tier is not None and e.tier != query.tier:
            continue
        if query.older_than_s is not None and e.last_access_s > now - query.older_than_s:
            continue
        matched.append(e)
    skipped = 0
    if not query.include_pinned:
        kept = [e for e in matched if not store.placement.is_pinned(e.key)]
        skipped, matched = len(matched) - len(kept), kept
    matched = coldest_first(store, matched)
    if query.watermark_frac is not None:
        stats = tiers[query.tier].stats()
        excess = stats.used_bytes - int(query.watermark_frac * stats.capacity_bytes)
        chosen = []
        for e in matched:
            if excess <= 0:
                break
            chosen.append(e)
            excess -= e.size
        matched = chosen
    if query.limit is not None:
        matched = matched[:query.limit]
    return EvictionPlan(matched, skipped)


def evict(store: Any, query: EvictionQuery, *, dry_run: bool = False) -> EvictionResult:
    """Select and (unless ``dry_run``) delete; the result counts what actually went."""
    plan = select(store, query)
    result = EvictionResult(plan, dry_run, keys=[e.key.hex() for e in plan.entries])
    if dry_run or not plan.entries:
        return result
    result.removed_blocks = store.delete_blocks([e.key for e in plan.entries], reason="evicted")
    # Bytes of the planned entries now gone; one deleted and re-put meanwhile counts as kept.
    result.removed_bytes = sum(e.size for e in plan.entries if store.entry(e.key) is None)
    return result
