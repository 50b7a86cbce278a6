"""The server's calls into the engine beyond ``put_kv``/``get_kv``/``lookup``.

Prefix walks over the index, reads of single frames (with the shared tier as a
fallback), and the bookkeeping for reads that bypass ``get_kv`` live here, so
the routes stay thin. Everything goes through ``KVStore``'s public methods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from kvstore import codec as codec_mod
from kvstore.codec import FrameHeader
from kvstore.errors import FrameError, TierError
from kvstore.index import IndexEntry
from kvstore.keys import BlockHash, block_hashes, normalize_tokens
from kvstore.recovery import entry_from_frame
from kvstore.shared import find_shared
from kvstore.spec import KVSpec
from kvstore.store import KVStore
from kvstore.tier import Tier

__all__ = ["PrefixBlock", "is_closed", "prefix_blocks", "shared_tier", "record_hits", "record_get", "record_lookup",
           "read_frame", "read_frame_with", "put_frame", "tier_named", "current_entry", "block_entry", "durable_blocks"]

log = logging.getLogger("kvstore.server")
T = TypeVar("T")


def is_closed(store: KVStore) -> bool:
    return store.closed


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


def durable_blocks(store: KVStore, blocks: Sequence[PrefixBlock]) -> int:
    """How many of ``blocks``, from the first, this store's index holds on durable tiers: as
    ``KVStore.durable_tokens`` counts, without walking the keys again. A block only the shared
    tier holds (no entry) is not vouched for."""
    n = 0
    for b in blocks:
        if b.entry is None or b.tier not in store.durable_tiers:
            break
        n += 1
    return n


def _current(entry: IndexEntry | None, namespace: str, fp: str) -> IndexEntry | None:
    return entry if entry is not None and entry.namespace == namespace and entry.spec_fp == fp else None


def _walk(store: KVStore, keys: Sequence[BlockHash], namespace: str, fp: str) -> list[IndexEntry]:
    found = []
    for entry in store.entries_of(keys):
        if entry is None or entry.namespace != namespace or entry.spec_fp != fp:
            break
        found.append(entry)
    return found


def shared_tier(store: KVStore) -> Tier | None:
    """The tier other stores write to (Redis), where this store's index may be behind."""
    return find_shared(store.tiers)


def record_lookup(store: KVStore) -> None:
    """Count a lookup answered from the index walk, as ``store.lookup`` counts its own."""
    store.count_lookup()


def record_hits(store: KVStore, keys: Sequence[BlockHash], counts: Sequence[int] | None = None, *,
                tally: bool = True) -> None:
    """Count reads that bypassed ``get_kv`` (shm handles, block gets) as accesses
    (``counts[i]`` reads of ``keys[i]`` when given); ``tally`` as for ``KVStore.touch``."""
    if keys:
        store.touch(keys, counts, tally=tally)


def record_get(store: KVStore, tokens_requested: int, tokens_hit: int, gets: int = 1) -> None:
    """Count co-located gets in the store's counters, as ``get_kv`` counts its own
    (``gets`` of them at once when a client reports reads it served itself)."""
    store.count_get(tokens_requested, tokens_hit, calls=gets)


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


_DAMAGED = object()


def read_frame_with(store: KVStore, key: BlockHash, namespaces: frozenset[str] | None,
                    reader: Callable[[memoryview, FrameHeader, IndexEntry], T], *, tally: bool = True) -> T | None:
    """``reader(frame, header, entry)`` over ``key``'s verified frame, lent by its tier for the call.

    An arena tier in host memory lends the slot itself, held so it is neither freed nor
    moved meanwhile, so a frame can be checked and then sent with no copy. Returns None
    (reader not called) when the block is absent, of another namespace, unreadable or
    damaged; a damaged frame, or an entry whose frame is gone, is dropped. Counted as a
    read (heat); ``tally=False`` leaves it out of the per-tier read counts, for reads whose
    tokens no get counted (another protocol's). ``reader`` must not return None, which
    means "moved meanwhile: look again" here.
    """
    entry = None
    for _ in range(2):  # a block that moved between the index read and the tier read: once more
        last, entry = entry, current_entry(store, key, namespaces)
        tier = None if entry is None else tier_named(store, entry.tier)
        if entry is None or tier is None:
            return None
        damage: list[FrameError] = []

        def checked(view: memoryview) -> Any:
            try:
                header = codec_mod.verify(view)
            except FrameError as exc:
                damage.append(exc)
                return _DAMAGED
            if header.body_checksum != entry.checksum:  # sound, but rewritten since the index read
                return None
            return reader(view, header, entry)

        try:
            got = tier.read_with(key, checked)
        except TierError as exc:
            log.warning("tier %s failed a block read (%s); served as a miss", entry.tier, exc)
            return None
        if got is _DAMAGED:
            log.warning("block %s in tier %s is damaged (%s); dropped as a miss", key.hex(), entry.tier, damage[0])
            store.drop_entry(entry, corrupt=True)
            return None
        if got is not None:
            record_hits(store, [key], tally=tally)
            return got
        if entry is last:  # the same entry twice and no frame: it is gone from its tier
            store.drop_entry(entry, corrupt=False)
            return None
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


def put_frame(store: KVStore, key: BlockHash, frame: Any, namespace: str, *, make_room: bool = False) -> IndexEntry:
    """Store an already encoded frame under ``key`` (see ``KVStore.put_frame``)."""
    return store.put_frame(key, frame, namespace=namespace, make_room=make_room)
