"""The engine core: the state the engine's parts share, and the one owner of the index.

``KVStore`` (the facade), the mover, the shared tier and recovery all work on
the same index, tiers, codecs and counters. They get this object, passed to
them explicitly, and change that state only through its methods: nothing else
holds the index, so every change to it is one of the few here, and each takes
the key's claim (``Index.claim``) the same way.

Who calls what:

- publishing: ``publish`` (a new frame: index it, tell placement) and
  ``switch`` (a moved frame, under the key's claim);
- removing: ``unpublish`` (under the claim), ``drop`` (a frame found damaged or
  gone), ``delete_key`` (a delete: the index entry first, then the data) and
  ``delete_frame``;
- reading: ``entry``, ``entries_of``, ``current_prefix`` (the one prefix walk),
  ``read_into``;
- counting: ``count`` and ``touch``.

Every change to the index is also an event in ``events`` (``kvstore.engine.events``), emitted
right after the change and under the key's claim, so one key's events come in the order
its changes happened, and a snapshot taken after reading the log's sequence number is
exact (the module's note says why).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Protocol, Sequence

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.errors import InvalidInput, TierError
from kvstore.engine.events import CLEARED, DEFAULT_CAPACITY, MOVED, REMOVED, STORED, EventLog
from kvstore.engine.index import Index, IndexEntry
from kvstore.keys import BlockHash
from kvstore.engine.placement import PlacementManager
from kvstore.tier import Tier

__all__ = ["EngineCore", "StoreCounters", "SharedCopies", "is_current"]

log = logging.getLogger("kvstore.engine.store")


@dataclass(slots=True)
class StoreCounters:
    """What the store did since it started."""

    put_calls: int = 0
    get_calls: int = 0
    lookup_calls: int = 0
    blocks_written: int = 0
    blocks_deduped: int = 0
    """Blocks a put found already stored and did not write again."""
    blocks_deleted: int = 0
    tokens_requested: int = 0
    """Full-block tokens asked for by get_kv."""
    tokens_hit: int = 0
    corrupt_blocks: int = 0
    """Frames that failed verification on read; dropped and served as misses."""
    stale_blocks: int = 0
    """Index entries whose frame the tier no longer had; dropped."""
    tier_errors: int = 0
    blocks_promoted: int = 0
    blocks_demoted: int = 0
    blocks_evicted: int = 0
    """Dropped from the last tier by placement."""
    blocks_migrated: int = 0
    blocks_adopted: int = 0
    """Blocks this store served from the shared tier that another node had stored."""
    blocks_kept_raw: int = 0
    """Blocks written raw into a tier whose codec could not hold them (NaN or Inf for int8)."""
    room_forced: int = 0
    """Writes a tier refused although placement had made room for them (a reader still held
    a range it freed, or its disk holds less than its capacity), tried again with room forced."""


class SharedCopies(Protocol):
    """What the core needs of the shared tier (``kvstore.engine.shared.SharedTier``): its copies."""

    name: str

    def forget(self, key: bytes) -> object: ...

    def delete(self, key: bytes) -> None: ...

    def adopt(self, key: bytes, namespace: str, spec_fp: str) -> tuple[IndexEntry, Any] | None: ...


def is_current(entry: IndexEntry | None, namespace: str, spec_fp: str) -> bool:
    """A key matches only under the namespace and spec it was written with."""
    return entry is not None and entry.namespace == namespace and entry.spec_fp == spec_fp


class EngineCore:
    """Index, tiers, codecs and counters of one store, and the operations on them.

    Args:
        tiers: fastest first; names are unique (the facade checks).
        codecs: the codec of new frames in each tier, by tier name.
        placement: the store's placement manager, told of every publish and removal.
        clock: wall-clock seconds (default ``time.time``): every ``created_s`` and
            ``last_access_s`` the engine records is a reading of it. Tests pass a fake one
            to age entries without sleeping.
    """

    def __init__(self, tiers: Sequence[Tier], codecs: dict[str, Codec], placement: PlacementManager,
                 clock: Callable[[], float] | None = None, *, event_capacity: int = DEFAULT_CAPACITY) -> None:
        self.clock: Callable[[], float] = time.time if clock is None else clock
        """The engine's wall clock: the facade, frames, the shared tier and recovery read it too."""
        self.events = EventLog(event_capacity, clock=self.clock)
        """Every change to the index, numbered (``kvstore.engine.events``)."""
        self._tiers = list(tiers)
        self.durable_tiers = frozenset(t.name for t in self._tiers if t.durable)
        """Names of the tiers whose acknowledged writes survive a crash (``Tier.durable``, as at start)."""
        self._by_name = {t.name: t for t in self._tiers}
        self._codecs = dict(codecs)
        self.placement = placement
        self._index = Index()
        self._counters = StoreCounters()
        self._counter_lock = threading.Lock()
        self.shared: SharedCopies | None = None
        """The shared tier's copies, once the facade has built it (None: no shared tier)."""
        self.closed = False
        self.last_put_s = 0.0
        """``time.monotonic()`` when a put last started or wrote a block (``putting``): background
        work that competes with puts for the CPU (the re-encoder) waits for a gap after it."""

    def putting(self) -> None:
        """A put is under way: ``last_put_s`` is now. One float store (atomic under the GIL), no lock."""
        self.last_put_s = time.monotonic()

    # -- tiers --------------------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return list(self._tiers)

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def tier(self, name: str) -> Tier:
        """The tier called ``name``.

        Raises:
            InvalidInput: no such tier.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidInput(f"unknown tier {name!r}; tiers are {self.tier_names}") from None

    def has_tier(self, name: str) -> bool:
        return name in self._by_name

    def codec_of(self, tier: str) -> Codec:
        """The codec new frames get in ``tier``."""
        return self._codecs[tier]

    # -- the index: reads -----------------------------------------------------------------

    def entry(self, key: BlockHash) -> IndexEntry | None:
        """``key``'s index entry (a live object: read, do not change)."""
        return self._index.get(key)

    def entries_of(self, keys: Sequence[BlockHash]) -> list[IndexEntry | None]:
        return self._index.get_many(keys)

    def snapshot(self) -> list[IndexEntry]:
        """Copies of every index entry."""
        return self._index.snapshot()

    def totals(self) -> tuple[int, int, int]:
        """(blocks, frame bytes, raw bytes) held."""
        return self._index.totals()

    def reads_by_tier(self) -> dict[str, int]:
        return self._index.reads_by_tier()

    def current_prefix(self, keys: Iterable[BlockHash], namespace: str, spec_fp: str, *,
                       tiers: frozenset[str] | None = None,
                       adopted: dict[BlockHash, Any] | None = None) -> list[IndexEntry]:
        """The entries of the longest prefix of ``keys`` stored under ``namespace`` and ``spec_fp``:
        the one prefix walk of the engine (lookups, gets, prefetches, pins and retention all take it).

        Args:
            keys: the chain, from its first block; an iterator is walked only as far as the prefix
                goes (``iter_block_hashes`` then hashes no more than that).
            tiers: only blocks held in one of these tiers count (``durable_tokens``).
            adopted: the hook for blocks this index lacks: when given, such a block that the shared
                tier holds (another node stored it) is adopted into this index and the walk goes
                on; the frames adoption read are put here by key, so a get does not read them twice.
        """
        shared = self.shared if adopted is not None else None
        found: list[IndexEntry] = []
        for key in keys:
            entry = self._index.get(key)
            if is_current(entry, namespace, spec_fp):
                if tiers is not None and entry.tier not in tiers and (entry.kept is None or entry.kept.tier not in tiers):
                    break
            else:
                got = shared.adopt(key, namespace, spec_fp) if shared is not None else None
                if got is None or not is_current(got[0], namespace, spec_fp):
                    break
                entry, frame = got
                if frame is not None:
                    adopted[key] = frame
            found.append(entry)
        return found

    def claim(self, key: BlockHash) -> AbstractContextManager[None]:
        """Exclusive right to change ``key``'s entry (and its frames) until the block exits."""
        return self._index.claim(key)

    def claim_all(self, keys: Sequence[BlockHash]) -> AbstractContextManager[None]:
        """``claim`` of each of ``keys`` (each once), taken and released together (``Index.claim_all``)."""
        return self._index.claim_all(keys)

    # -- the index: changes -----------------------------------------------------------------

    def publish(self, entry: IndexEntry, *, access: bool = True, now: float | None = None, reason: str = "put",
                parent: BlockHash | None = None, tokens: bytes | None = None) -> None:
        """Index a frame just written (under its key's claim), tell placement, emit ``stored``.

        Args:
            access: count it as an access for heat (a put); False for a block found at start.
            now: placement's clock reading for the put (one per chain: its blocks tie).
            reason: what stored it, for the event (put, frame, reserved, adopted, recovered).
            parent: the chain's previous block, when the caller knows it.
            tokens: the block's token ids as <u4 bytes; callers make them only when the event log
                keeps them (``events.keep_tokens``), so a put allocates nothing for them otherwise.
        """
        self._index.add(entry)
        self.placement.admitted(entry.key, entry.tier, entry.size, access=access, depth=entry.depth, now=now)
        self._stored(entry, reason, parent, tokens)

    def publish_many(self, entries: Sequence[IndexEntry], *, now: float, reason: str,
                     chain: Sequence[tuple[BlockHash | None, bytes | None]]) -> None:
        """``publish`` of a put's frames, all in one tier, under their claims (``claim_all``): the
        index, placement and the event log each taken once, not once a block. ``chain``: each
        block's parent and token ids."""
        if not entries:
            return
        if any(e.tier != entries[0].tier for e in entries):
            raise ValueError("publish_many: frames of one tier")
        self._index.add_many(entries)
        self.placement.admitted_many(entries[0].tier, [(e.key, e.size, e.depth) for e in entries], now=now)
        self.events.emit_many(STORED, [
            {"key": e.key, "namespace": e.namespace, "tier": e.tier, "size": e.size, "depth": e.depth,
             "spec_fp": e.spec_fp, "parent": parent, "reason": reason, "tokens": tokens}
            for e, (parent, tokens) in zip(entries, chain)])

    def _stored(self, entry: IndexEntry, reason: str, parent: BlockHash | None,
                tokens: bytes | None) -> None:
        self.events.emit(STORED, key=entry.key, namespace=entry.namespace, tier=entry.tier, size=entry.size,
                         depth=entry.depth, spec_fp=entry.spec_fp, parent=parent, reason=reason, tokens=tokens)

    def switch(self, entry: IndexEntry, *, src: str, reason: str = "moved") -> None:
        """Point the index at a moved frame (under the key's claim) and emit ``moved``; placement
        hears of the move from the mover."""
        self._index.add(entry)
        self.events.emit(MOVED, key=entry.key, namespace=entry.namespace, tier=entry.tier, src=src,
                         size=entry.size, depth=entry.depth, spec_fp=entry.spec_fp, reason=reason,
                         engine_hash=entry.engine_hash)

    def unpublish(self, key: BlockHash, expected: IndexEntry | None = None, *,
                  reason: str = "replaced") -> IndexEntry | None:
        """Remove ``key``'s entry (only if it is still ``expected``, when given) and emit ``removed``;
        the entry removed. Under the key's claim."""
        entry = self._index.remove(key, expected=expected)
        if entry is not None:
            self._removed(entry, reason)
        return entry

    def _removed(self, entry: IndexEntry, reason: str) -> None:
        self.events.emit(REMOVED, key=entry.key, namespace=entry.namespace, tier=entry.tier, size=entry.size,
                         depth=entry.depth, spec_fp=entry.spec_fp, reason=reason, engine_hash=entry.engine_hash)

    def sync_durable(self) -> None:
        """Wait until every write acknowledged by a durable tier is durable (``Tier.sync``): what a
        durable put's check waits for, so that it vouches for blocks a crash cannot take."""
        for tier in self._tiers:
            if tier.durable:
                tier.sync()

    def name_blocks(self, names: Sequence[tuple[BlockHash, bytes | int, bytes | int | None, bytes | None]],
                    namespace: str) -> int:
        """Record an engine's own names for stored blocks of ``namespace``; returns how many are named.

        ``names``: (key, engine hash, the engine's name for the chain's previous block or None,
        the block's token ids as <u4 bytes or None). A block named anew, or renamed, emits
        ``stored`` with reason ``named`` and both names, so a router that indexes the engine's
        own KV events (vLLM's block hashes) can count kvstore's copy; later moves and removals
        carry the engine's name too. Keys that are not stored in ``namespace`` are skipped.
        """
        named = 0
        for key, engine_hash, parent, tokens in names:
            with self._index.claim(key):
                before = self._index.get(key)
                old = None if before is None else before.engine_hash
                entry = self._index.name(key, engine_hash, namespace)
                if entry is None:
                    continue
                named += 1
                if old != engine_hash:
                    self.events.emit(STORED, key=key, namespace=namespace, tier=entry.tier, size=entry.size,
                                     depth=entry.depth, spec_fp=entry.spec_fp, reason="named",
                                     tokens=tokens if self.events.keep_tokens else None,
                                     engine_hash=engine_hash, engine_parent=parent)
        return named

    def drop(self, entry: IndexEntry, *, corrupt: bool) -> None:
        """Unpublish a block found gone (``stale_blocks``) or damaged (``corrupt_blocks``: its frame
        is deleted too), unless it was rewritten meanwhile; a block whose durable tier kept a copy
        (``IndexEntry.kept``) falls back to it instead, and stays stored."""
        with self._index.claim(entry.key):
            if entry.kept is not None and self._index.get(entry.key) is entry \
                    and self._by_name[entry.kept.tier].contains(entry.key):
                self._fall_back(entry, corrupt)
                return
            if self._index.remove(entry.key, expected=entry) is None:
                return
            self._removed(entry, "corrupt" if corrupt else "stale")
            self.placement.removed(entry.key)
            if self.shared is not None and entry.tier == self.shared.name:
                self.shared.forget(entry.key)
            self.count(**{"corrupt_blocks" if corrupt else "stale_blocks": 1})
            if corrupt:
                self.delete_frame(entry)
            else:  # its frame is gone already; a copy left behind would come back at the next start
                self.drop_kept(entry)

    def _fall_back(self, entry: IndexEntry, corrupt: bool) -> None:
        """Point ``entry``'s key at the durable copy it kept, its own frame gone or damaged (under
        the key's claim): a read sees the copy; placement counts it where it lies."""
        k = entry.kept
        assert k is not None
        self.switch(replace(entry, tier=k.tier, size=k.size, codec=k.codec, checksum=k.checksum, kept=None),
                    src=entry.tier, reason="corrupt" if corrupt else "stale")
        self.placement.unkeep(entry.key)
        self.placement.admitted(entry.key, k.tier, k.size, access=False, depth=entry.depth)
        self.count(**{"corrupt_blocks" if corrupt else "stale_blocks": 1})
        if self.shared is not None and entry.tier == self.shared.name:
            self.shared.forget(entry.key)
        if corrupt:
            self._delete_in(entry.tier, entry.key)

    def delete_key(self, key: BlockHash, *, reason: str = "deleted") -> int:
        """Delete a block: unpublish first, then its frame and any shared copy. 1 if it was stored.
        ``reason`` is the ``removed`` event's (an operator's eviction says ``evicted``)."""
        with self._index.claim(key):
            entry = self._index.remove(key)
            if entry is None:
                return 0
            self._removed(entry, reason)
            self.placement.removed(key)
            self.delete_frame(entry)
            if self.shared is not None:
                self.shared.delete(key)
        self.count(blocks_deleted=1)
        return 1

    def delete_frame(self, entry: IndexEntry) -> None:
        """Delete ``entry``'s frame from its tier (the index no longer names it), and the copy a
        durable tier kept of it unless the index's entry of the key now lives there."""
        if self.shared is not None and entry.tier == self.shared.name:
            self.shared.forget(entry.key)  # the copy other nodes read is going: forget we had one
        self._delete_in(entry.tier, entry.key)
        self.drop_kept(entry)

    def drop_kept(self, entry: IndexEntry) -> None:
        """Delete the durable copy ``entry`` kept (``IndexEntry.kept``), unless the key's entry now
        lives in that tier (a rewrite landed there): left behind, a restart would index it again."""
        if entry.kept is None:
            return
        self.placement.unkeep(entry.key)
        now = self._index.get(entry.key)
        if now is None or now.tier != entry.kept.tier:
            self._delete_in(entry.kept.tier, entry.key)

    def _delete_in(self, tier: str, key: BlockHash) -> None:
        try:
            self._by_name[tier].delete(key)
        except TierError as exc:  # unreachable now; the index no longer serves it
            self.count(tier_errors=1)
            log.warning("tier %s failed to delete %s: %s", tier, key.hex(), exc)

    def clear(self) -> None:
        """Forget every entry (the store is closing) and emit ``cleared``."""
        self._index.clear()
        self.events.emit(CLEARED, reason="closed")

    def events_snapshot(self, namespaces: frozenset[str] | None = None) -> tuple[int, list[IndexEntry]]:
        """The block set (of ``namespaces``; None: all) and the event number it is valid at.

        The number is read before the copy: every change numbered at or below it is in the
        copy, and replaying the events after it gives the index (``kvstore.engine.events``)."""
        seq = self.events.snapshot_seq()
        entries = self._index.snapshot()
        if namespaces is not None:
            entries = [e for e in entries if e.namespace in namespaces]
        return seq, entries

    # -- frames ---------------------------------------------------------------------------

    def read_into(self, entry: IndexEntry, out: memoryview) -> int | None:
        """Copy ``entry``'s frame into ``out``; ``None`` (and the entry dropped) when it is gone."""
        tier = self._by_name[entry.tier]
        try:
            n = tier.get_into(entry.key, out)
        except InvalidInput:  # the frame outgrew what the index recorded: not the frame indexed
            self.drop(entry, corrupt=True)
            return None
        except TierError as exc:
            return self._failed_read(tier, exc)
        if n is None:
            self.drop(entry, corrupt=False)
        return n

    def decode_into(self, entry: IndexEntry, out: Any) -> bool | None:
        """Decode ``entry``'s frame straight out of a tier that lends it (``Tier.lends_frames``) into
        ``out``: no copy into a buffer first, and no body hash for a frame this tier's slot vouches
        for (``docs/design.md``, "Verified once"). True; None (and the entry dropped) when it is
        gone or its tier failed.

        Raises:
            FrameError, InvalidKV: the frame is damaged or not the one indexed (the caller drops it).
        """
        tier = self._by_name[entry.tier]

        def decode(view: memoryview, stamp: int, vouched: bool) -> bool:
            codec_mod.decode(view, out=out, expect_checksum=entry.checksum, verified=vouched)
            if stamp and not vouched:
                tier.vouch(entry.key, stamp)
            return True

        try:
            got = tier.read_vouched(entry.key, decode)
        except TierError as exc:
            return self._failed_read(tier, exc)
        if got is None:
            self.drop(entry, corrupt=False)
        return got

    def _failed_read(self, tier: Tier, exc: TierError) -> None:
        self.count(tier_errors=1)
        log.warning("tier %s failed a get (%s); served as a miss", tier.name, exc)

    # -- counting -------------------------------------------------------------------------

    def count(self, **deltas: int) -> None:
        if "put_calls" in deltas:  # every put path counts its call: the re-encoder's gap starts later
            self.putting()
        with self._counter_lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def counters(self) -> StoreCounters:
        """A copy of the counters."""
        with self._counter_lock:
            return StoreCounters(**asdict(self._counters))

    def touch(self, keys: Sequence[BlockHash], counts: Sequence[int] | None = None, *, tally: bool = True,
              now: float | None = None) -> None:
        """Count reads of ``keys`` (one each, or ``counts``) for recency, hit counts and heat: a
        get's own, or reads that bypassed it (a co-located client, a block route).

        Args:
            tally: count them in ``reads_by_tier`` too; False for reads whose tokens no get counted
                (another protocol's), which would otherwise skew the per-tier hit ratio.

        Raises:
            InvalidInput: ``counts`` is not one count per key.
        """
        keys = list(keys)
        if counts is not None and len(counts) != len(keys):
            raise InvalidInput(f"touch: {len(counts)} counts for {len(keys)} keys")
        self._index.touch(keys, self.clock() if now is None else now, counts, tally=tally)
        self.placement.accessed(keys, counts)
