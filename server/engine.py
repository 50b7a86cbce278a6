"""The server's calls into the engine that ``KVStore``'s public API does not cover yet.

Everything the routes need beyond ``put_kv``/``get_kv``/``lookup``/``delete``/
``entry``/``entries``/``stats``/pins/``migrate``/``explain`` goes through this
module, so the gaps sit in one place. Each function prefers a public store
method of the same purpose when the store has one and otherwise falls back to
the store's internals, as ``kvstore.recovery`` does; the fallbacks go away when
the engine grows these methods:

- ``KVStore.touch(keys)``: count reads that bypassed ``get_kv`` (``_index.touch``
  and ``placement.accessed`` today);
- ``KVStore.count_get(requested, hit)`` and ``count_lookup()``: the store
  counters for co-located gets and index-walk lookups (``_count`` today);
- ``KVStore.put_frame(key, frame, namespace)``: store an encoded frame by key
  (``_index.claim/get/add`` today);
- ``KVStore.closed``: ``_closed`` today.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from kvstore.errors import FrameError, InvalidInput, TierError, TierFull
from kvstore.index import IndexEntry
from kvstore.keys import BlockHash, block_hashes, normalize_tokens
from kvstore.recovery import entry_from_frame
from kvstore.shared import find_shared
from kvstore.spec import KVSpec
from kvstore.store import KVStore
from kvstore.tier import Tier

__all__ = ["PrefixBlock", "is_closed", "prefix_blocks", "shared_tier", "record_hits", "record_get", "record_lookup",
           "read_frame", "put_frame", "tier_named", "current_entry", "block_entry"]

log = logging.getLogger("kvstore.server")


def is_closed(store: KVStore) -> bool:
    closed = getattr(store, "closed", None)  # until KVStore.closed exists
    return bool(store._closed if closed is None else closed)


def tier_named(store: KVStore, name: str) -> Tier | None:
    for tier in store.tiers:
        if tier.name == name:
            return tier
    return None


def current_entry(store: KVStore, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
    """``key``'s entry if its namespace is one of ``namespaces`` (None: any); else None.

    A block of another namespace is reported exactly like an absent one.
    """
    entry = store.entry(key)
    if entry is None or (namespaces is not None and entry.namespace not in namespaces):
        return None
    return entry


@dataclass(frozen=True, slots=True)
class PrefixBlock:
    """One block of a stored prefix: indexed here, or only in the shared tier (another node's)."""

    key: BlockHash
    tier: str
    entry: IndexEntry | None
    """None for a block only the shared tier holds; ``read_frame`` serves it from there."""


def prefix_blocks(store: KVStore, spec: KVSpec, tokens: Any, namespace: str) -> list[PrefixBlock]:
    """The blocks of the longest stored prefix of ``tokens``.

    The walk reads the index directly. Only when it stops short does it ask
    ``store.lookup``, which counts what the shared tier (Redis) holds past the
    local prefix; those blocks come back with no entry. Counted as one lookup.
    """
    toks = normalize_tokens(tokens)
    keys = block_hashes(spec, toks, namespace)
    fp = spec.fingerprint()
    found = [PrefixBlock(e.key, e.tier, e) for e in _walk(store, keys, namespace, fp)]
    if len(found) == len(keys):
        record_lookup(store)
        return found
    n = store.lookup(spec, toks, namespace) // spec.block_tokens  # counts the call
    shared = shared_tier(store)
    for key in keys[len(found):n]:
        entry = _current(store.entry(key), namespace, fp)  # indexed meanwhile, or adopted
        if entry is None and shared is None:
            break
        found.append(PrefixBlock(key, entry.tier if entry else shared.name, entry))
    return found


def _current(entry: IndexEntry | None, namespace: str, fp: str) -> IndexEntry | None:
    return entry if entry is not None and entry.namespace == namespace and entry.spec_fp == fp else None


def _walk(store: KVStore, keys: Sequence[BlockHash], namespace: str, fp: str) -> list[IndexEntry]:
    found = []
    for key in keys:
        entry = _current(store.entry(key), namespace, fp)
        if entry is None:
            break
        found.append(entry)
    return found


def shared_tier(store: KVStore) -> Tier | None:
    """The tier other stores write to (Redis), where this store's index may be behind."""
    return find_shared(store.tiers)


def record_lookup(store: KVStore) -> None:
    """Count a lookup answered from the index walk, as ``store.lookup`` counts its own."""
    count = getattr(store, "count_lookup", None)
    if callable(count):
        count()
        return
    store._count(lookup_calls=1)  # until KVStore.count_lookup exists


def record_hits(store: KVStore, keys: Sequence[BlockHash]) -> None:
    """Count reads that bypassed ``get_kv`` (shm handles, block gets) as accesses."""
    if not keys:
        return
    touch = getattr(store, "touch", None)
    if callable(touch):
        touch(keys)
        return
    store._index.touch(keys, time.time())  # until KVStore.touch(keys) exists
    store.placement.accessed(keys)


def record_get(store: KVStore, tokens_requested: int, tokens_hit: int) -> None:
    """Count a co-located get in the store's counters, as ``get_kv`` counts its own."""
    count = getattr(store, "count_get", None)
    if callable(count):
        count(tokens_requested, tokens_hit)
        return
    store._count(get_calls=1, tokens_requested=tokens_requested, tokens_hit=tokens_hit)  # until count_get exists


def read_frame(store: KVStore, key: BlockHash, namespaces: frozenset[str] | None) -> tuple[Any, IndexEntry] | None:
    """The stored frame of ``key`` and its entry; None when absent, of another namespace, or gone.

    A block that moved between the index read and the tier read is looked up
    once more. One this store has not indexed is read from the shared tier,
    where another node may have put it (its entry then comes from the frame).
    """
    for _ in range(2):
        entry = current_entry(store, key, namespaces)
        if entry is None:
            return _shared_frame(store, key, namespaces)
        tier = tier_named(store, entry.tier)
        try:
            frame = tier.get(key) if tier is not None else None
        except TierError as exc:
            log.warning("tier %s failed a block get (%s); served as a miss", entry.tier, exc)
            return None
        if frame is not None:
            record_hits(store, [key])
            return frame, entry
    return None


def block_entry(store: KVStore, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
    """What ``read_frame`` would serve, without counting a read: the index entry, or one
    made from the shared tier's frame."""
    entry = current_entry(store, key, namespaces)
    if entry is not None:
        return entry
    got = _shared_frame(store, key, namespaces)
    return None if got is None else got[1]


def _shared_frame(store: KVStore, key: BlockHash, namespaces: frozenset[str] | None) -> tuple[Any, IndexEntry] | None:
    shared = shared_tier(store)
    if shared is None:
        return None
    try:
        frame = shared.get(key)
        if frame is None:
            return None
        entry = entry_from_frame(key, shared.name, frame, time.time())
    except (TierError, FrameError) as exc:
        log.warning("shared tier %s: block %s unreadable (%s); served as a miss", shared.name, key.hex(), exc)
        return None
    if namespaces is not None and entry.namespace not in namespaces:
        return None
    return frame, entry


def put_frame(store: KVStore, key: BlockHash, frame: Any, namespace: str) -> IndexEntry:
    """Store an already encoded frame under ``key`` in the first tier with room.

    The frame must verify and carry kvstore metadata whose namespace is
    ``namespace`` (the caller's): a tenant cannot plant a block in another
    tenant's namespace. The same frame stored again is a no-op, and so is a
    key that another namespace holds.

    Raises:
        FrameError: the frame does not verify or has no kvstore metadata.
        InvalidInput: its namespace is not ``namespace``.
        TierFull: no tier has room.
    """
    put = getattr(store, "put_frame", None)
    if callable(put):
        return put(key, frame, namespace=namespace)
    now = time.time()
    probe = entry_from_frame(key, "", frame, now)  # raises FrameError on a bad frame
    if probe.namespace != namespace:
        raise InvalidInput(f"frame metadata namespace {probe.namespace!r} is not the request's {namespace!r}")
    index = store._index  # until KVStore.put_frame(key, frame, namespace) exists
    with index.claim(key):
        old = index.get(key)
        if old is not None and (old.namespace != namespace or old.checksum == probe.checksum):
            # Another namespace's block is neither replaced nor revealed: the caller sees what
            # it sees for a duplicate. Computing that key took that namespace's tokens anyway.
            return old
        failure: Exception | None = None
        for tier in store.tiers:
            try:
                tier.put(key, frame)
            except TierFull as exc:
                failure = failure or exc
                continue
            except TierError as exc:
                log.warning("tier %s failed a frame put (%s); trying the next", tier.name, exc)
                failure = exc
                continue
            entry = replace(probe, tier=tier.name)
            index.add(entry)
            if old is not None and old.tier != tier.name:
                try:
                    tier_named(store, old.tier).delete(key)
                except TierError as exc:
                    log.warning("tier %s failed to drop a replaced frame: %s", old.tier, exc)
            store.placement.admitted(key, tier.name, entry.size)
            return entry
    if isinstance(failure, TierError) and not isinstance(failure, TierFull):
        raise failure
    raise TierFull(f"no tier has room for a {len(memoryview(frame).cast('B'))}-byte frame", stored_tokens=0)
