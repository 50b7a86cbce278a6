"""Retention's bookkeeping: who retains which entry, until when, at what priority, within what quota.

Retention is placement's soft pin (rule 5 of ``kvstore.engine.placement``). ``Retention`` keeps the
owners' books and charges each owner's retained bytes to the quota its ``retain`` names; it decides
no move. The rest of the rule is the manager's: demotion and a put's room making look past a
retained entry (``Resident.retained``), and promotion takes retained entries first, in exchange for
unretained residents or for the same owner's sooner-expiring retentions
(``RoomMaker.displace_for_retained``).

A ``PlacementManager`` holds one ``Retention`` over its own records and candidate set (the same
objects, not copies) and calls it under the manager's lock: nothing here takes a lock of its own.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import RetainQuotaExceeded
from kvstore.engine.placement_types import PlacementConfig, Resident

__all__ = ["PREFETCH_OWNER", "Retention"]

PREFETCH_OWNER = "_prefetch"
"""The owner of the holds prefetches place (``kvstore.engine.prefetch``): no tenant, so no tenant's quota
pays for them; the first read of a held block ends its hold (the reader came)."""


class Retention:
    """The retentions over a ``PlacementManager``'s records; every method runs under its lock.

    Args:
        res: the manager's record per key.
        candidates: the manager's promotion candidates (an ordered set); a retained entry below
            the top tier joins them.
        config: the manager's knobs.
    """

    __slots__ = ("res", "candidates", "config", "owners")

    def __init__(self, res: dict[bytes, Resident], candidates: dict[bytes, None], config: PlacementConfig) -> None:
        self.res = res
        self.candidates = candidates
        self.config = config
        self.owners: dict[str, set[bytes]] = {}
        """Keys each owner retains (expired ones are pruned as they are met)."""

    def retain(self, keys: Sequence[bytes], until: float, now: float, *, owner: str, priority: int,
               quota_bytes: int | None) -> tuple[int, int, int]:
        """``PlacementManager.retain``, until ``until``: (keys retained, their bytes, bytes ``owner``
        retains now); raises ``RetainQuotaExceeded``, having changed nothing, past ``quota_bytes``."""
        held = self.owned_bytes(owner, now)
        mine = self.owners.get(owner, set())
        found: list[tuple[bytes, Resident]] = []
        extra = 0
        for key in dict.fromkeys(keys):
            r = self.res.get(key)
            if r is None:
                continue
            found.append((key, r))
            if key not in mine and not self.kept_by_other(r, owner, now):
                extra += r.size
        if quota_bytes is not None and held + extra > quota_bytes:
            raise RetainQuotaExceeded(
                f"retaining {extra} more bytes would take {owner!r} to {held + extra} bytes retained, over "
                f"its retention quota of {quota_bytes} bytes (KVSTORE_RETAIN_QUOTA_BYTES, or the token's "
                f"retain_quota_bytes); release a conversation or retain fewer tokens",
                retained_bytes=held, quota_bytes=quota_bytes)
        nbytes = 0
        for key, r in found:
            nbytes += r.size
            if self.kept_by_other(r, owner, now):
                r.retained_until = max(r.retained_until, until)
                r.retain_priority = max(r.retain_priority, priority)
                continue
            if r.retain_owner is not None and r.retain_owner != owner:  # an expired retention of another
                self.owners.get(r.retain_owner, set()).discard(key)
            r.retained_until, r.retain_priority, r.retain_owner = until, priority, owner
            self.owners.setdefault(owner, set()).add(key)
            if r.tier and self.config.promote:
                self.candidates[key] = None
        return len(found), nbytes, held + extra

    def unretain(self, keys: Sequence[bytes], owner: str | None, now: float) -> int:
        """``PlacementManager.unretain``: how many retentions ended."""
        n = 0
        for key in keys:
            r = self.res.get(key)
            if r is None or not r.retained(now) or (owner is not None and r.retain_owner != owner):
                continue
            self.forget(key, r)
            n += 1
        return n

    def retention(self, key: bytes, now: float) -> dict | None:
        r = self.res.get(key)
        if r is None or not r.retained(now):
            return None
        return {"owner": r.retain_owner, "priority": r.retain_priority,
                "expires_in_s": r.retained_until - now}

    def retained_bytes(self, owner: str | None, now: float) -> dict[str, int]:
        names = list(self.owners) if owner is None else [owner]
        held = {name: self.owned_bytes(name, now) for name in names if name in self.owners}
        return {name: n for name, n in held.items() if n}

    def keep_asking(self, now: float) -> None:
        """Make every retained entry below the top tier a promotion candidate again: until it is
        up, each plan asks for it anew."""
        for keys in self.owners.values():
            for key in keys:
                r = self.res.get(key)
                if r is not None and r.tier and r.retained(now):
                    self.candidates[key] = None

    def kept_by_other(self, r: Resident, owner: str, now: float) -> bool:
        """Retained by another owner, who keeps it: a prefetch's hold gives way to a tenant's
        retention (which takes the entry over, charged to the tenant)."""
        return (r.retained(now) and r.retain_owner != owner
                and not (r.retain_owner == PREFETCH_OWNER and owner != PREFETCH_OWNER))

    def owned_bytes(self, owner: str, now: float) -> int:
        """Bytes ``owner`` retains, pruning its expired keys."""
        keys = self.owners.get(owner)
        if not keys:
            return 0
        total = 0
        for key in list(keys):
            r = self.res.get(key)
            if r is None or not r.retained(now) or r.retain_owner != owner:
                keys.discard(key)
                continue
            total += r.size
        if not keys:
            del self.owners[owner]
        return total

    def forget(self, key: bytes, r: Resident) -> None:
        """End ``r``'s retention, whoever's it was (and whether or not it had expired)."""
        if r.retain_owner is not None:
            keys = self.owners.get(r.retain_owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.owners[r.retain_owner]
        r.retained_until, r.retain_priority, r.retain_owner = 0.0, 0, None
