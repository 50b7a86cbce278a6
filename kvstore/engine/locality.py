"""Locality: prefetch, hand-offs and retention, where the next reader will read.

``KVStore.prefetch``, ``retain``, ``release`` and ``handoff`` check their input and walk the
stored prefix (``EngineCore.current_prefix``); ``Locality`` decides what to do with it: queue a
prefetch (``kvstore.engine.prefetch.Prefetcher``), retain it in placement (rule 5), or copy it
to the shared tier for another node. It also turns an agent's put into a learned hand-off hold
when its namespace has shown hand-offs (``HandoffLearner``) and its policy lets it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from kvstore.engine.core import EngineCore
from kvstore.engine.prefetch import HandoffLearner, Job, Prefetcher
from kvstore.engine.shared import SharedTier
from kvstore.errors import InvalidInput
from kvstore.keys import BlockHash
from kvstore.spec import KVSpec

__all__ = ["Locality", "check_retention", "MAX_RETAIN_S", "PREFETCH_HOLD_S", "HANDOFF_TTL_S"]

PREFETCH_HOLD_S = 60.0
"""How long a prefetched prefix is held for its reader by default (its first read ends the hold)."""

MAX_RETAIN_S = 86400.0
"""The longest retention the engine takes (a day); a server may allow less."""

HANDOFF_TTL_S = 120.0
"""How long a hand-off to ``"here"`` holds the prefix by default."""


def check_retention(ttl_s: Any, priority: Any) -> None:
    """Raises InvalidInput naming the field for a retention's bad ``ttl_s`` or ``priority``."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_RETAIN_S:
        raise InvalidInput(f"ttl_s must be a number of seconds in (0, {MAX_RETAIN_S:g}], got {ttl_s!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        raise InvalidInput(f"priority must be an int in 0..9, got {priority!r}")


class Locality:
    """Prefetch, hand-off and retention decisions of one store.

    Args:
        core: the store's engine core (its placement holds the retentions).
        shared: its shared tier, if any.
        prefetcher: carries the prefetches out in the background.
        handoffs: what agents wrote and who read it next.
        policy_for: (policy version, whether learned hand-offs may be prefetched) for a namespace;
            read at each decision, so a server that repoints the store's ``policy_for`` is heard.
    """

    def __init__(self, core: EngineCore, shared: SharedTier | None, prefetcher: Prefetcher,
                 handoffs: HandoffLearner, policy_for: Callable[[str], tuple[int | None, bool]]) -> None:
        self._core = core
        self._placement = core.placement
        self._shared = shared
        self._prefetcher = prefetcher
        self.handoffs = handoffs
        self._policy_for = policy_for

    def prefetch(self, spec: KVSpec, keys: list[BlockHash], namespace: str, *, reason: str, trigger: str,
                 hold_s: float) -> int:
        """Queue a prefetch of the stored prefix of ``keys``; the tokens it will bring."""
        spec_fp = spec.fingerprint()
        n = len(self._core.current_prefix(keys, namespace, spec_fp))
        if n < len(keys) and self._shared is not None:
            n += self._shared.count_prefix(keys[n:])
        if n:
            self._prefetcher.submit(Job(keys[:n], namespace, spec_fp, trigger, reason, hold_s=hold_s,
                                        policy_version=self._policy_for(namespace)[0],
                                        block_tokens=spec.block_tokens))
        return n * spec.block_tokens

    def retain(self, spec: KVSpec, keys: list[BlockHash], namespace: str, *, ttl_s: float, priority: int,
               owner: str, quota_bytes: int | None) -> dict[str, Any]:
        """Retain ``keys`` (a stored prefix) for ``owner``; what ``KVStore.retain`` returns."""
        n, nbytes, total = self._placement.retain(keys, float(ttl_s), owner=owner, priority=priority,
                                                  quota_bytes=quota_bytes)
        top = self._core.tiers[0].name
        below = [k for k in keys if (e := self._core.entry(k)) is not None and e.tier != top]
        if below:  # the mover would promote them too, but only at its next round and within its budget
            self._prefetcher.submit(Job(keys, namespace, spec.fingerprint(), "retain",
                                        f"retained by {owner!r} for {ttl_s:g} s",
                                        policy_version=self._policy_for(namespace)[0],
                                        block_tokens=spec.block_tokens))
        return {"tokens": n * spec.block_tokens, "blocks": n, "bytes": nbytes, "expires_in_s": float(ttl_s),
                "priority": priority, "owner": owner, "retained_bytes": total, "quota_bytes": quota_bytes}

    def handoff(self, spec: KVSpec, keys: list[BlockHash], namespace: str, *, to: str, ttl_s: float | None,
                owner: str | None, quota_bytes: int | None) -> dict[str, Any]:
        """Place ``keys`` (a stored prefix) for their next reader; what ``KVStore.handoff`` returns."""
        out = {"tokens": len(keys) * spec.block_tokens, "blocks": len(keys), "held": 0, "shared": 0, "to": to}
        if to == "here":
            ttl = HANDOFF_TTL_S if ttl_s is None else ttl_s
            check_retention(ttl, 0)
            out["held"] = self._placement.retain(keys, float(ttl), owner=namespace if owner is None else owner,
                                                 quota_bytes=quota_bytes)[0]
            return out
        if self._shared is None:
            raise InvalidInput(f"a hand-off to {to!r} needs a shared tier (KVSTORE_REDIS_URL) that both nodes "
                               "use; this store has none")
        shared = 0
        for key in keys:
            entry = self._core.entry(key)
            if entry is None:
                break
            if entry.tier == self._shared.name or self._shared.replica(key) is not None \
                    or self._shared.replicate(entry):
                shared += 1
        out["shared"] = shared
        return out

    def wrote(self, keys: Sequence[BlockHash], namespace: str, spec: KVSpec, agent: str) -> None:
        """An agent stored ``keys``: remember it for hand-off learning, and when this namespace has
        shown hand-offs (and its policy lets it), hold the chain in the top tier for its reader."""
        self.handoffs.wrote(keys, namespace, agent)
        learned = self.handoffs.pattern(namespace)
        if learned is None or not keys:
            return
        version, allowed = self._policy_for(namespace)
        if not allowed:
            return
        count, gap = learned
        hold = min(600.0, max(10.0, 2 * gap))
        self._prefetcher.submit(Job(list(keys), namespace, spec.fingerprint(), "hand-off",
                                    f"{namespace!r} showed {count} hand-offs in {self.handoffs.window_s:g} s "
                                    f"(median gap {gap:.1f} s): held {hold:.0f} s for the next agent",
                                    hold_s=hold, policy_version=version, block_tokens=spec.block_tokens))
