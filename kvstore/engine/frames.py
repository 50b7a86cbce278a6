"""Frames by key: the reads and puts of single frames beside ``put_kv``/``get_kv``.

The server's block routes, its shm handles, the LMCache listener and the SDK's
engine plug-ins name blocks themselves and move frames that are already encoded.
``Frames`` does that over the engine core: a put verifies the frame's metadata
(a tenant cannot plant a block in another's namespace) and publishes it as
``put_kv`` publishes a block; a read verifies what it serves, and a frame found
damaged or gone is dropped from the index, so every later reader gets a miss
rather than the same bad bytes. Callers reach it as ``KVStore.frames``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, TypeVar

from kvstore import codec as codec_mod
from kvstore.codec import FrameHeader
from kvstore.engine.core import EngineCore, is_current
from kvstore.errors import FrameError, InvalidInput, StoreClosed, TierError, TierFull
from kvstore.engine.index import IndexEntry
from kvstore.keys import BlockHash, check_key
from kvstore.engine.placement import RoomHold
from kvstore.engine.recovery import entry_from_frame, entry_from_head
from kvstore.engine.shared import SharedTier
from kvstore.tier import FrameWriter, Tier

__all__ = ["Frames", "PrefixBlock"]

log = logging.getLogger("kvstore.engine.store")
T = TypeVar("T")
_DAMAGED = object()


@dataclass(frozen=True, slots=True)
class PrefixBlock:
    """One block of a stored prefix: indexed here, or only in the shared tier (another node's)."""

    key: BlockHash
    tier: str
    entry: IndexEntry | None
    """None for a block only the shared tier holds; ``Frames.read`` serves it from there."""


@dataclass(slots=True)
class _Written:
    """What ``put_frame_with``'s writer did: started (its bytes are spent), and the entry it wrote."""

    started: bool = False
    entry: IndexEntry | None = None


class Frames:
    """Single-frame reads and puts of one store.

    Args:
        core: the store's engine core.
        shared: its shared tier (write-through copies, frames another node stored), if any.
        take_room: room for a new frame of n bytes, made in the tier admission picks and
            held until released (``RoomHold``; the store's placement and mover); ``force``
            frees n bytes even where the accounting says they are free.
    """

    def __init__(self, core: EngineCore, shared: SharedTier | None,
                 take_room: Callable[..., RoomHold]) -> None:
        self._core = core
        self._shared = shared
        self._take_room = take_room

    def _check_open(self) -> None:
        if self._core.closed:
            raise StoreClosed("the store is closed")

    @property
    def shared_tier(self) -> Tier | None:
        return None if self._shared is None else self._shared.tier

    def durable_count(self, blocks: Sequence[PrefixBlock]) -> int:
        """How many of ``blocks``, from the first, sit on durable tiers in this store's index
        (as ``KVStore.durable_tokens`` counts, without walking the keys again)."""
        n, durable = 0, self._core.durable_tiers
        for b in blocks:
            if b.entry is None or (b.tier not in durable and (b.entry.kept is None or b.entry.kept.tier not in durable)):
                break
            n += 1
        return n

    # -- reads ----------------------------------------------------------------------------

    def current_entry(self, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
        """``key``'s entry if its namespace is one of ``namespaces`` (None: any); else None."""
        key = check_key(key)
        entry = self._core.entry(key)
        if entry is None or (namespaces is not None and entry.namespace not in namespaces):
            return None
        return entry

    def local_prefix(self, keys: Sequence[BlockHash], namespace: str, spec_fp: str) -> list[PrefixBlock]:
        """The blocks of the longest prefix of ``keys`` this store's index holds."""
        return [PrefixBlock(e.key, e.tier, e) for e in self._core.current_prefix(keys, namespace, spec_fp)]

    def extend_prefix(self, found: list[PrefixBlock], keys: Sequence[BlockHash], namespace: str,
                      spec_fp: str) -> list[PrefixBlock]:
        """``found`` extended over ``keys`` past it, which a lookup counted as stored: blocks indexed
        meanwhile (or adopted) with their entry, the shared tier's without one."""
        shared = self.shared_tier
        for key in keys[len(found):]:
            entry = self._core.entry(key)
            entry = entry if is_current(entry, namespace, spec_fp) else None
            if entry is None and shared is None:
                break
            found.append(PrefixBlock(key, entry.tier if entry else shared.name, entry))
        return found

    def read(self, key: BlockHash, namespaces: frozenset[str] | None) -> tuple[Any, IndexEntry] | None:
        """The stored frame of ``key`` and its entry; None when absent, of another namespace, or gone.

        A block that moved between the index read and the tier read is looked up
        once more. One this store has not indexed is read from the shared tier,
        where another node may have put it (its entry then comes from the frame).
        Counted as a read.
        """
        key = check_key(key)
        for _ in range(2):
            entry = self.current_entry(key, namespaces)
            if entry is None:
                return self._shared_frame(key, namespaces)
            try:
                frame = self._core.tier(entry.tier).get(key)
            except TierError as exc:
                log.warning("tier %s failed a block get (%s); served as a miss", entry.tier, exc)
                return None
            if frame is not None and not _rewritten(frame, entry):
                self._core.touch([key])
                return frame, entry
            self._settle(key)
        return None

    def _settle(self, key: BlockHash) -> None:
        """Wait until nobody holds ``key``'s claim: a rewrite in place (a re-encode) or a move
        between its tier write and its index switch has finished, so a second look sees both."""
        with self._core.claim(key):
            pass

    def read_with(self, key: BlockHash, namespaces: frozenset[str] | None,
                  reader: Callable[[memoryview, FrameHeader, IndexEntry], T], *, tally: bool = True) -> T | None:
        """``reader(frame, header, entry)`` over ``key``'s verified frame, lent by its tier for the call.

        An arena tier in host memory lends the slot itself, held so it is neither freed nor
        moved meanwhile, so a frame can be checked and then sent with no copy. There the body
        is hashed by the first read after each publish of the slot only (``ArenaTier.vouch``);
        later reads check the header. Returns None (reader not called) when the block is
        absent, of another namespace, unreadable or damaged; a damaged frame, or an entry whose
        frame is gone, is dropped. Counted as a read (heat); ``tally=False`` leaves it out of
        the per-tier read counts, for reads whose tokens no get counted (another protocol's).
        ``reader`` must not return None, which means "moved meanwhile: look again" here.
        """
        key = check_key(key)
        entry = None
        for _ in range(2):  # a block that moved between the index read and the tier read: once more
            last, entry = entry, self.current_entry(key, namespaces)
            if entry is None:
                return None
            damage: list[FrameError] = []
            tier = self._core.tier(entry.tier)

            def checked(view: memoryview, stamp: int = 0, vouched: bool = False, entry: IndexEntry = entry) -> Any:
                try:
                    # Hashed once per slot publication: see "Verified once" in docs/design.md.
                    header = codec_mod.read_header(view) if vouched else codec_mod.verify(view)
                except FrameError as exc:
                    damage.append(exc)
                    return _DAMAGED
                if stamp and not vouched:
                    tier.vouch(key, stamp)
                if header.body_checksum != entry.checksum:  # sound, but rewritten since the index read
                    return None
                return reader(view, header, entry)

            try:
                # Arena tiers (tiers/arena.py) stamp each slot's publication; other tiers verify every read.
                got = tier.read_vouched(key, checked)
            except TierError as exc:
                log.warning("tier %s failed a block read (%s); served as a miss", entry.tier, exc)
                return None
            if got is _DAMAGED:
                log.warning("block %s in tier %s is damaged (%s); dropped as a miss", key.hex(), entry.tier, damage[0])
                self._core.drop(entry, corrupt=True)
                return None
            if got is not None:
                self._core.touch([key], tally=tally)
                return got
            if entry is last:  # the same entry twice and no frame: it is gone from its tier
                self._core.drop(entry, corrupt=False)
                return None
            self._settle(key)
        return None

    def block_entry(self, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
        """What ``read`` would serve, without counting a read: the index entry, or one made from
        the shared tier's frame."""
        key = check_key(key)
        entry = self.current_entry(key, namespaces)
        if entry is not None:
            return entry
        got = self._shared_frame(key, namespaces)
        return None if got is None else got[1]

    def _shared_frame(self, key: BlockHash, namespaces: frozenset[str] | None) -> tuple[Any, IndexEntry] | None:
        shared = self.shared_tier
        if shared is None:
            return None
        try:
            frame = shared.get(key)
            if frame is None:
                return None
            entry = entry_from_frame(key, shared.name, frame, self._core.clock())
        except (TierError, FrameError) as exc:
            log.warning("shared tier %s: block %s unreadable (%s); served as a miss", shared.name, key.hex(), exc)
            return None
        if namespaces is not None and entry.namespace not in namespaces:
            return None
        return frame, entry

    # -- puts -----------------------------------------------------------------------------

    def put(self, key: BlockHash, frame: Any, namespace: str, *, make_room: bool = False) -> IndexEntry:
        """Store an already encoded frame under ``key``, in the first tier with room.

        The frame must verify and carry kvstore metadata for ``namespace``: a
        tenant cannot plant a block in another's namespace. The same frame again,
        or a key another namespace holds, is a no-op that returns the current entry.

        Args:
            make_room: place it as ``put_kv`` places a block (admission, then demote or
                evict colder entries to make room) instead of falling through full tiers.

        Raises:
            FrameError: the frame does not verify or has no kvstore metadata.
            InvalidInput: its namespace is not ``namespace``.
            TierFull: no tier has room. TierError: every tier with room failed.
        """
        self._check_open()
        key = check_key(key)
        probe = entry_from_frame(key, "", frame, self._core.clock())
        if probe.namespace != namespace:
            raise InvalidInput(f"frame metadata namespace {probe.namespace!r} is not the request's {namespace!r}")

        def write(tier: Tier) -> IndexEntry:
            tier.put(key, frame)
            return replace(probe, tier=tier.name)

        for force in (False, True) if make_room else (False,):
            room = self._take_room(probe.size, force=force) if make_room else None  # outside the claim
            try:
                with self._core.claim(key):
                    old = self._core.entry(key)
                    if old is not None and (old.namespace != namespace or old.checksum == probe.checksum):
                        return old
                    return self._publish(key, old, room.tier if room else 0, probe.size, write,
                                         lambda: frame, lambda: False)
            except TierFull:
                if force or not make_room:
                    raise  # a tier that refused although room was made gets one more try, forced
            finally:
                if room is not None:
                    room.release()
        raise AssertionError("unreachable: the last try returns or raises")

    def put_with(self, key: BlockHash, namespace: str, size: int, writer: FrameWriter, *,
                       make_room: bool = False) -> IndexEntry:
        """Store a frame that ``writer`` writes in place: into the tier's own memory where the
        tier lends it (``Tier.put_with``), so bytes read from a socket land in their slot with
        no staging copy.

        ``writer`` gets a writable view of ``size`` bytes, writes a whole sealed frame that
        carries kvstore metadata for ``namespace``, and returns its length. Its header is
        checked and its metadata read; its body checksum is the one ``writer`` sealed (this is
        for frames the server builds itself, not ones a client sent). A tier that refuses
        before ``writer`` ran (full) passes the put to the next; once it ran, the put ends there.

        A failed ``writer`` stores nothing, but an overwrite may lose the frame it replaced
        (a full arena frees it to make room): its index entry then goes too, never left
        pointing at nothing.

        Args:
            make_room: demote or evict colder entries first, as ``put_kv`` does; off by default,
                so that nothing is evicted for bytes that may never arrive.

        Raises:
            whatever ``writer`` raises: nothing is stored.
            FrameError, InvalidInput: the frame is not a kvstore frame of ``namespace``.
            TierFull: no tier has room. TierError: the tier failed.
        """
        self._check_open()
        key = check_key(key)
        written = _Written()

        def write(tier: Tier) -> IndexEntry:
            def fill(view: memoryview) -> int:
                written.started = True  # the bytes are being spent: no other tier gets a try
                n = writer(view)
                entry = entry_from_head(key, tier.name, view[:n], n, self._core.clock())
                if entry.namespace != namespace:  # refused before commit: the tier keeps what it had
                    raise InvalidInput(f"frame metadata namespace {entry.namespace!r} is not {namespace!r}")
                written.entry = entry
                return n

            tier.put_with(key, size, fill)
            assert written.entry is not None
            return written.entry

        def frame_of() -> Any:  # for write-through only
            return self._core.tier(written.entry.tier).get(key) if written.entry is not None else None

        for force in (False, True) if make_room else (False,):
            room = self._take_room(size, force=force) if make_room else None  # outside the claim
            old: IndexEntry | None = None
            try:
                with self._core.claim(key):
                    old = self._core.entry(key)
                    if old is not None and old.namespace != namespace:
                        raise InvalidInput(f"key {key.hex()} belongs to another namespace")
                    return self._publish(key, old, room.tier if room else 0, size, write, frame_of,
                                         lambda: written.started)
            except TierFull:
                if force or not make_room or written.started:
                    self._drop_lost(key, old, written)
                    raise  # refused before ``writer`` ran although room was made: one more try, forced
            except BaseException:
                self._drop_lost(key, old, written)
                raise
            finally:
                if room is not None:
                    room.release()
        raise AssertionError("unreachable: the last try returns or raises")

    def _drop_lost(self, key: BlockHash, old: IndexEntry | None, written: _Written) -> None:
        """A failed overwrite may have lost the frame it replaced: its entry goes too."""
        if old is not None and written.entry is None and not self._core.tier(old.tier).contains(key):
            self._core.drop(old, corrupt=False)  # outside the claim: drop takes it

    def _publish(self, key: BlockHash, old: IndexEntry | None, first: int, size: int,
                       write: Callable[[Tier], IndexEntry], frame_of: Callable[[], Any],
                       committed: Callable[[], bool]) -> IndexEntry:
        """Under ``key``'s claim: ``write`` the frame into the first tier from ``first`` that takes
        it, then index it. A failure once ``committed()`` says the bytes are spent is raised."""
        failure: TierError | None = None
        for tier in self._core.tiers[first:]:
            try:
                entry = write(tier)
            except TierFull as exc:
                if committed():
                    raise
                failure = failure or exc
                continue
            except TierError as exc:
                self._core.count(tier_errors=1)
                if committed():
                    raise
                log.warning("tier %s failed a frame put (%s); trying the next", tier.name, exc)
                failure = exc
                continue
            self._core.publish(entry, reason="frame")
            if old is not None and old.tier != tier.name:
                self._core.delete_frame(old)
            elif old is not None:  # rewritten in place: a durable copy of the old frame would outlive it
                self._core.drop_kept(old)
            if self._shared is not None and self._shared.policy.mode == "write_through" \
                    and tier.name != self._shared.name:
                try:  # the shared tier holds a copy: losing it degrades, never fails, a put that is stored
                    frame = frame_of()
                    if frame is not None:
                        self._shared.after_put(entry, codec_mod.decode(frame), codec_mod.frame_meta(frame))
                except (FrameError, TierError) as exc:
                    log.warning("write-through of %s failed: %s", key.hex(), exc)
            self._core.count(blocks_written=1)
            return entry
        if isinstance(failure, TierError) and not isinstance(failure, TierFull):
            raise failure
        raise TierFull(f"no tier has room for a {size}-byte frame", stored_tokens=0) from failure


def _rewritten(frame: Any, entry: IndexEntry) -> bool:
    """``frame`` is sound but not the one ``entry`` names (rewritten in place since the index read)."""
    try:
        return codec_mod.read_header(frame).body_checksum != entry.checksum
    except FrameError:  # damaged: the caller's verify says so
        return False
