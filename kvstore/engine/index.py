"""The block index: key -> where the frame lives and what it is.

One owner (the store), one lock. Every method is one short critical section;
multi-step changes to one key (write the frame, then publish it; unpublish,
then delete the frame) run under ``claim(key)``, a per-key exclusive section,
so a concurrent put and delete of the same key cannot interleave and leave the
index pointing at a frame that is gone. Tier I/O never runs under the lock.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

from kvstore.codec import Codec
from kvstore.keys import BlockHash

__all__ = ["Index", "IndexEntry", "Kept"]


@dataclass(frozen=True, slots=True)
class Kept:
    """The copy of a frame a durable tier still holds after placement promoted the block out of
    it (``kvstore.engine.mover``): what the durable tier's file says, not the promoted frame."""

    tier: str
    size: int
    codec: Codec
    checksum: int


@dataclass(slots=True)
class IndexEntry:
    """One stored block. Mutated only by ``Index`` under its lock; read freely."""

    key: BlockHash
    tier: str
    """Name of the tier holding the frame."""
    size: int
    """Frame bytes in that tier (what capacity is charged)."""
    codec: Codec
    checksum: int
    """The frame's body checksum: tells two writes of one key apart."""
    raw_bytes: int
    """Decoded KV bytes, so the store can report what the codec saved."""
    namespace: str
    """Checked on read: a key found under another namespace is a miss, never data."""
    spec_fp: str
    """The spec fingerprint the block was written under; checked on read too."""
    depth: int
    """Position of the block in its chain (0 = first block of a sequence)."""
    created_s: float
    """Time of the write, by the store's clock (``KVStore(clock=)``; wall time by default)."""
    last_access_s: float
    """Time of the last read (the write until then), by the same clock."""
    hits: int = 0
    engine_hash: bytes | int | None = None
    """An engine's own name for the block (vLLM's block hash), once the engine named it
    (``EngineCore.name_blocks``): KV events carry it beside the key, for the engine's routers."""
    kept: Kept | None = None
    """A durable tier's copy left behind when the block was promoted out of it: the block stays
    durable while it is served from above (None: the frame in ``tier`` is the only one)."""


class Index:
    """Thread-safe map of block keys to ``IndexEntry``."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[bytes, IndexEntry] = {}
        self._busy: dict[bytes, int] = {}
        """Claimed keys -> the claiming thread: ``add`` and ``remove`` check the caller holds it."""
        self._frame_bytes = 0
        self._raw_bytes = 0
        self._reads: dict[str, int] = {}
        """Block reads served from each tier since start: every read path ends in ``touch``."""

    # -- reads ----------------------------------------------------------------

    def get(self, key: BlockHash) -> IndexEntry | None:
        with self._cond:
            return self._entries.get(key)

    def get_many(self, keys: Sequence[BlockHash]) -> list[IndexEntry | None]:
        """``get`` for each key, under one acquisition of the lock (a prefix walk's keys)."""
        with self._cond:
            return list(map(self._entries.get, keys))

    def reads_by_tier(self) -> dict[str, int]:
        """Block reads ``touch`` has counted, by the tier each block was in when read."""
        with self._cond:
            return dict(self._reads)

    def totals(self) -> tuple[int, int, int]:
        """(entries, frame bytes, raw KV bytes)."""
        with self._cond:
            return len(self._entries), self._frame_bytes, self._raw_bytes

    def snapshot(self) -> list[IndexEntry]:
        """Copies of every entry, safe to sort and filter without the lock."""
        with self._cond:
            return [replace(e) for e in self._entries.values()]

    # -- writes ---------------------------------------------------------------

    def add(self, entry: IndexEntry) -> IndexEntry | None:
        """Publish ``entry`` (under its key's claim); returns the entry it replaced, if any."""
        with self._cond:
            return self._add(entry)

    def add_many(self, entries: Sequence[IndexEntry]) -> None:
        """``add`` for each entry (each under its key's claim), under one take of the lock (a put's)."""
        with self._cond:
            for entry in entries:
                self._add(entry)

    def _add(self, entry: IndexEntry) -> IndexEntry | None:
        self._check_claim(entry.key)  # under the lock
        old = self._entries.get(entry.key)
        if old is not None:
            self._frame_bytes -= old.size
            self._raw_bytes -= old.raw_bytes
            if entry.engine_hash is None:  # a key names its tokens: the engine's name still holds
                entry.engine_hash = old.engine_hash
        self._entries[entry.key] = entry
        self._frame_bytes += entry.size
        self._raw_bytes += entry.raw_bytes
        return old

    def remove(self, key: BlockHash, expected: IndexEntry | None = None) -> IndexEntry | None:
        """Unpublish ``key`` (under its claim). With ``expected``, only if that very entry is still current."""
        with self._cond:
            self._check_claim(key)
            entry = self._entries.get(key)
            if entry is None or (expected is not None and entry is not expected):
                return None
            del self._entries[key]
            self._frame_bytes -= entry.size
            self._raw_bytes -= entry.raw_bytes
            return entry

    def name(self, key: BlockHash, engine_hash: bytes | int, namespace: str) -> IndexEntry | None:
        """Set ``key``'s ``engine_hash`` (under its claim) when it is stored in ``namespace``; the
        entry, or None when it is not. The entry is returned whether or not the name changed."""
        with self._cond:
            self._check_claim(key)
            entry = self._entries.get(key)
            if entry is None or entry.namespace != namespace:
                return None
            entry.engine_hash = engine_hash
            return entry

    def touch(self, keys: Iterable[BlockHash], now_s: float, counts: Iterable[int] | None = None, *,
              tally: bool = True) -> None:
        """Record a hit (``counts[i]`` hits) on each key: O(1) per key, one short lock hold.
        ``tally=False`` leaves them out of ``reads_by_tier``."""
        with self._cond:
            reads = self._reads
            for key, n in zip(keys, counts if counts is not None else itertools.repeat(1)):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.hits += n
                    entry.last_access_s = now_s
                    if tally:
                        reads[entry.tier] = reads.get(entry.tier, 0) + n

    def clear(self) -> None:
        with self._cond:
            self._entries.clear()
            self._frame_bytes = self._raw_bytes = 0

    @contextmanager
    def claim(self, key: BlockHash) -> Iterator[None]:
        """Exclusive section for multi-step changes to one key.

        Claims on different keys never block each other. Never hold two claims
        at once (but through ``claim_all``): that is how deadlocks start.
        """
        with self._cond:
            while key in self._busy:
                self._cond.wait()
            self._busy[key] = threading.get_ident()
        try:
            yield
        finally:
            with self._cond:
                del self._busy[key]
                self._cond.notify_all()

    @contextmanager
    def claim_all(self, keys: Sequence[BlockHash]) -> Iterator[None]:
        """``claim`` of every key of ``keys`` (each once) at once: taken together when none is
        claimed, so a thread never holds some while it waits for others (no deadlock), and
        released together. One put publishes its blocks under one, not one claim a block.
        """
        if len(set(keys)) != len(keys):
            raise ValueError("claim_all: each key once")
        me = threading.get_ident()
        with self._cond:
            busy = self._busy
            while not busy.keys().isdisjoint(keys):
                self._cond.wait()
            for key in keys:
                busy[key] = me
        try:
            yield
        finally:
            with self._cond:
                for key in keys:
                    del self._busy[key]
                self._cond.notify_all()

    def _check_claim(self, key: BlockHash) -> None:
        # Called under the lock. Cheap (one dict read), and it turns "every index change runs
        # under the key's claim" from a convention into a rule: a path that forgets the claim
        # fails in every test that takes it, rather than racing a mover once in a million.
        if self._busy.get(key) != threading.get_ident():
            raise RuntimeError(f"index change to block {bytes(key).hex()[:16]}... without its claim "
                               "(take EngineCore.claim(key) around it)")
