"""Pooled puts: one request a put, into top-tier slots lent to the writer ahead.

A reservation costs a request before the writer can copy and
another to commit. So a writer may also hold a *pool*: top-tier slots of one size, granted ahead
(``grant``) to its process, invisible and kept out of reuse like a reservation's. It writes a
put's new blocks into pool slots (it computes their keys and metadata itself, and skips blocks
the arena's key index shows stored) and sends one request (``put_pooled``) that names, per
block, its depth, slot and body checksum; the server computes the keys from the tokens, checks
each frame's header as a commit does, publishes, and grants as many fresh slots as were used.
A slot whose block was stored meanwhile goes back to the pool. A pool that sees no put for
``ttl_s``, or whose process exits, is reclaimed by the reaper; the writer, told ``ttl_s``,
stops writing into its slots well before (``client_sdk``: after half of it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore, is_current
from kvstore.engine.index import IndexEntry
from kvstore.engine.placement import RoomHold
from kvstore.engine.slots import (Progress, ReservedBlock, WrittenHeaders, block_tokens, check_written, give_back,
                                  publish_written)
from kvstore.engine.recovery import entry_from_header
from kvstore.errors import CorruptFrame, Forbidden, FrameError, InvalidInput
from kvstore.keys import BlockHash, block_hashes, block_meta
from kvstore.memory.shm import start_ticks
from kvstore.spec import KVSpec

__all__ = ["PooledPuts", "PooledPut", "PooledFrames", "POOL_KEY", "MAX_POOL_BYTES", "SLOT_SLACK"]

log = logging.getLogger("kvstore.engine.pools")


POOL_KEY = bytes(32)
"""The key a pool slot is reserved under until a put names its block: never a block's (a block
key is a cryptographic hash)."""

MAX_POOL_BYTES = 64 << 20
"""The most pool bytes one writer process holds, and at most an eighth of the top tier: enough
for a 32 MiB put and the next one's, without a few idle writers holding the tier apart."""

SLOT_SLACK = 4096
"""How much larger than a block's raw frame a pool slot may be asked for (room for metadata that
grows with the chain's depth; the frame is shrunk to its length at publish)."""


@dataclass(slots=True)
class PoolSlot:
    slot: Any
    """The tier's handle for the reserved range (``tiers.arena.Slot``)."""
    size: int
    room: RoomHold | None

    def to_dict(self) -> dict[str, int]:
        return {"offset": self.slot.offset, "length": self.size}


@dataclass(slots=True)
class Pool:
    """One writer process's granted slots, by offset."""

    owner: str
    pid: int
    name: str
    """The writer's own name for it: two clients in one process hold a pool each."""
    ticks: int | None
    slots: dict[int, PoolSlot]
    expires_s: float


@dataclass(slots=True)
class PooledPut:
    """What ``put_pooled`` did: tokens covered, KV bytes published, depths neither written nor
    stored (the writer sends those another way), and the slots now the writer's again (returned
    unused, or newly granted)."""

    n_tokens: int
    nbytes: int
    missing: list[int]
    slots: list[dict[str, int]]
    keys: list[BlockHash]


@dataclass(slots=True)
class PooledFrames:
    """What ``put_frames`` did: frames accepted (published, or held already), KV bytes published,
    and the slots now the writer's again."""

    stored: int
    nbytes: int
    slots: list[dict[str, int]]


def _written_entry(top: Any, ps: PoolSlot, key: BlockHash, checksum: int, namespace: str, now: float,
                   headers: WrittenHeaders) -> IndexEntry:
    """The index entry of the frame a writer wrote into pool slot ``ps`` under ``key``, from its
    header and metadata (the body is verified after publish), once it names ``namespace``,
    fits the slot and carries the claimed checksum."""
    view = top.reserved_view(ps.slot)
    try:
        header = headers.read(view)
        if header.frame_len > ps.size:
            raise FrameError(f"its header says {header.frame_len} bytes, the slot holds {ps.size}")
        entry = entry_from_header(key, top.name, header, view[:header.frame_len], now)
    except FrameError as exc:
        raise CorruptFrame(f"block {key.hex()}: the frame written into its slot is damaged: {exc}") from None
    if entry.namespace != namespace:
        raise InvalidInput(f"block {key.hex()}: frame metadata namespace {entry.namespace!r} is not the "
                           f"request's {namespace!r}")
    if entry.checksum != checksum:
        raise CorruptFrame(f"block {key.hex()}: the frame says body checksum {entry.checksum:#x}, "
                           f"the put {checksum:#x}")
    return entry


SLOT_SIZES_KEPT = 1024
"""Specs whose slot size ``PooledPuts.slot_bytes`` keeps (then it starts over): a store serves a few."""


class PooledPuts:
    """The pools of one store.

    Args:
        core: the engine core (index, tiers, placement, counters, clock): a grant holds free
            room in placement's count for its slots (``PlacementManager.hold_free``).
        unavailable: why the store takes no writes into lent slots now, or None.
        lent: called once slots are lent (the reaper must run).
        ttl_s: how long a pool lives without a put, by the engine's clock.
    """

    def __init__(self, core: EngineCore, unavailable: Callable[[], str | None], lent: Callable[[], None],
                 ttl_s: float) -> None:
        self._core, self.unavailable, self._lent = core, unavailable, lent
        self.ttl_s = ttl_s
        self._pools: dict[tuple[str, int, str], Pool] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.reaped = 0
        self._slot_bytes: dict[str, int] = {}

    def slot_bytes(self, spec: KVSpec) -> int:
        """The raw frame size of one of ``spec``'s blocks at depth 0: the least a pool slot for it
        holds. Asked on every pooled put, so kept per spec (at most ``SLOT_SIZES_KEPT`` specs)."""
        fp = spec.fingerprint()
        size = self._slot_bytes.get(fp)
        if size is None:
            meta = block_meta("default", fp, 0)
            size = codec_mod.frame_size(spec.kv_shape(spec.block_tokens), spec.dtype, Codec.RAW, meta_len=len(meta))
            if len(self._slot_bytes) >= SLOT_SIZES_KEPT:
                self._slot_bytes.clear()
            self._slot_bytes[fp] = size
        return size

    def grant(self, owner: str, pid: int, name: str, size: int, count: int,
              returning: Sequence[int] = ()) -> list[dict[str, int]]:
        """Up to ``count`` more pool slots of ``size`` bytes for ``owner``'s pool ``name`` in process ``pid``, as
        many as the top tier has free (nothing is demoted or evicted for them) and ``MAX_POOL_BYTES``
        allows: their offsets and length.

        Args:
            returning: offsets of slots of this pool that its writer no longer wants (idle slots of
                another size: ``MAX_POOL_BYTES`` counts every size, so a writer that moved to
                another spec would otherwise hold its old slots and be lent none), given back to
                the tier first.

        Raises:
            InvalidInput: the store takes no reserved puts, or no process ``pid`` runs here.
            Forbidden: a ``returning`` offset is not a slot of this pool; nothing is given back or lent.
        """
        why = self.unavailable()
        if why is not None:
            raise InvalidInput(f"reserved puts are off here: {why}")
        if returning:
            self._give_back_pool(self._take(owner, pid, name, list(returning)))
        top = self._core.tiers[0]
        cap = min(MAX_POOL_BYTES, top.capacity_bytes // 8) if hasattr(top, "capacity_bytes") else MAX_POOL_BYTES
        with self._lock:
            pool = self._pools.get((owner, pid, name))
            if pool is None:
                ticks = start_ticks(pid)
                if ticks is None:
                    raise InvalidInput(f"pid: no process {pid} on this host")
                pool = self._pools[(owner, pid, name)] = Pool(owner, pid, name, ticks, {}, 0.0)
            pool.expires_s = self._core.clock() + self.ttl_s
            held = sum(s.size for s in pool.slots.values())
        count = max(0, min(count, (cap - held) // size if size else 0))
        if count:
            # Lend free room only: demoting or evicting stored blocks for a put that may never
            # come would take the top tier from readers (a prefetch found it held apart). In a
            # full tier the writer reserves per put instead (two requests).
            count = min(count, max(0, top.room_bytes() // size - 1))
        rooms = self._core.placement.hold_free(size, count) if count else []  # free room: no demotion
        try:
            slots = top.reserve_many(POOL_KEY, size, len(rooms))
        except BaseException:
            for room in rooms:
                room.release()
            raise
        for room in rooms[len(slots):]:
            room.release()
        got = [PoolSlot(slot, size, room) for slot, room in zip(slots, rooms)]
        self._lent()  # the reaper watches pools from now on
        with self._lock:
            live = self._pools.get((owner, pid, name))
            if live is None or self._closed:  # reaped or closed meanwhile: nothing to lend into
                stale = got
                got = []
            else:
                stale = []
                for ps in got:
                    live.slots[ps.slot.offset] = ps
        self._give_back_pool(stale)
        return [ps.to_dict() for ps in got]

    def put_pooled(self, spec: KVSpec, tokens: Any, namespace: str, owner: str, pid: int, name: str,
                   writes: list[tuple[int, int, int]], refill: int) -> PooledPut:
        """Publish the blocks a writer wrote into its pool slots, one ``(depth, offset, checksum)``
        each, then grant it ``refill`` more slots of the size it used.

        Blocks of ``tokens`` not written must be stored already (the writer's key index showed
        them); one that is not is reported ``missing``, and the tokens covered stop before it.

        Raises:
            Forbidden: a named slot is not one of this writer's pool (never granted, used, or
                reclaimed); nothing is stored and its other slots stay in its pool.
            InvalidInput: a depth outside the sequence or named twice.
            CorruptFrame: a frame's header is damaged, or is not the raw frame of its block, or
                does not carry the claimed checksum: nothing is stored, the slots go back to
                the pool. A frame after the first of its layout is compared with that one byte
                for byte but for its body checksum (``WrittenHeaders``): one whose header
                checksum alone is wrong is published, and the verifier drops it as corrupt
                before any reader trusts it.
        """
        keys = block_hashes(spec, tokens, namespace)
        bt, spec_fp = spec.block_tokens, spec.fingerprint()
        depths = [d for d, _, _ in writes]
        if any(not 0 <= d < len(keys) for d in depths) or len(set(depths)) != len(depths):
            raise InvalidInput(f"writes: each depth once, within the sequence's {len(keys)} blocks")
        taken = self._take(owner, pid, name, [off for _, off, _ in writes])
        top = self._core.tiers[0]
        keep = self._core.events.keep_tokens
        blocks = [ReservedBlock(d, keys[d], ps.slot, ps.size, block_meta(namespace, spec_fp, d),
                                keys[d - 1] if d else None, block_tokens(tokens, d, bt) if keep else b"", None)
                  for (d, _, _), ps in zip(writes, taken)]
        try:
            seen = WrittenHeaders()
            headers = [check_written(top, b, c, spec, exact=False, headers=seen) for b, (_, _, c) in zip(blocks, writes)]
        except BaseException:
            self._back_to_pool(owner, pid, name, taken)
            raise
        now, heat_now = self._core.clock(), self._core.placement.clock()
        entries = [IndexEntry(key=b.key, tier=top.name, size=h.frame_len, codec=h.codec, checksum=h.body_checksum,
                              raw_bytes=h.raw_nbytes, namespace=namespace, spec_fp=spec_fp, depth=b.depth,
                              created_s=now, last_access_s=now) for b, h in zip(blocks, headers)]
        returned, nbytes = self._publish(owner, pid, name, taken, entries, heat_now,
                                         lambda old, e: is_current(old, namespace, spec_fp),
                                         [(b.parent, b.tokens or None) for b in blocks])
        written = set(depths)
        missing = [d for d in range(len(keys))
                   if d not in written and not is_current(self._core.entry(keys[d]), namespace, spec_fp)]
        self._core.count(put_calls=1, blocks_deduped=len(keys) - len(written) - len(missing))
        self._back_to_pool(owner, pid, name, returned)
        size = taken[0].size if taken else self.slot_bytes(spec) + SLOT_SLACK
        granted = self.grant(owner, pid, name, size, refill) if refill else []
        return PooledPut((missing[0] if missing else len(keys)) * bt, nbytes, missing,
                         [ps.to_dict() for ps in returned] + granted, keys)

    def put_frames(self, namespace: str, owner: str, pid: int, name: str, writes: list[tuple[BlockHash, int, int]],
                   refill: int, size: int, charge: Callable[[int], None]) -> PooledFrames:
        """Publish frames a writer wrote into its pool slots by key, one ``(key, offset, checksum)``
        each (a cache backend's pages: ``/v1/blocks/put-pooled``), then grant ``refill`` more
        slots of ``size`` bytes. Each frame is checked as ``put_pooled`` checks a block's, but by
        its own metadata: it must name ``namespace``; its body is hashed in the background after
        publish (``kvstore.engine.scrub``). A key another namespace holds, or that holds the
        same frame already, is left as it is (as ``FrameStore.put`` does) and its slot stays lent.
        ``charge(nbytes)`` is called with the frames' bytes before anything is published (quota).

        Raises:
            Forbidden: a named slot is not one of this writer's pool; nothing is stored.
            InvalidInput: a key named twice, or a frame naming another namespace.
            CorruptFrame: a damaged header, or not the claimed checksum: nothing is stored (a
                header checksum alone wrong after the first frame of a layout: as ``put_pooled``).
        """
        if len({k for k, _, _ in writes}) != len(writes):
            raise InvalidInput("blocks: each key once")
        taken = self._take(owner, pid, name, [off for _, off, _ in writes])
        top = self._core.tiers[0]
        now, heat_now = self._core.clock(), self._core.placement.clock()

        def held(old: IndexEntry | None, e: IndexEntry) -> bool:
            return old is not None and (old.namespace != namespace or old.checksum == e.checksum)
        try:
            seen = WrittenHeaders()
            entries = [_written_entry(top, ps, key, checksum, namespace, now, seen) for (key, _, checksum), ps
                       in zip(writes, taken)]
            # a frame stored already is not stored again, so it is not charged: a writer that
            # skips only what the arena shows copies again what a lower tier holds
            charge(sum(e.size for e in entries if not held(self._core.entry(e.key), e)))
        except BaseException:
            self._back_to_pool(owner, pid, name, taken)
            raise
        returned, nbytes = self._publish(owner, pid, name, taken, entries, heat_now, held)
        self._back_to_pool(owner, pid, name, returned)
        granted = self.grant(owner, pid, name, size, refill) if refill else []
        return PooledFrames(len(writes), nbytes, [ps.to_dict() for ps in returned] + granted)

    def _publish(self, owner: str, pid: int, name: str, taken: list[PoolSlot], entries: list[IndexEntry],
                 heat_now: float, held: Callable[[IndexEntry | None, IndexEntry], bool],
                 chain: list[tuple[BlockHash | None, bytes | None]] | None = None) -> tuple[list[PoolSlot], int]:
        """Commit each slot's frame and publish its entry, in order, as one batch (``publish_written``);
        a key ``held(old, entry)`` already keeps its slot lent (stored meanwhile by another writer,
        or another's). ``chain``: each block's parent and token ids, for its event. Returns the
        slots kept and the raw bytes published; on a failure the slots not yet published go back
        to the pool (but the one whose commit failed: the tier took it back).
        """
        progress = Progress()
        try:
            nbytes = publish_written(self._core, entries, [(ps.slot, ps.size) for ps in taken], held, now=heat_now,
                                     vouch=False, chain=chain or [(None, None)] * len(entries), progress=progress)
        except BaseException:
            self._back_to_pool(owner, pid, name,
                               taken[progress.untouched():] + [taken[i] for i in progress.held])
            raise
        finally:  # placement counts a published block now; the failed one's slot is gone
            for i in progress.published + ([progress.at] if progress.committing else []):
                if taken[i].room is not None:
                    taken[i].room.release()
        return [taken[i] for i in progress.held], nbytes

    def _take(self, owner: str, pid: int, name: str, offsets: list[int]) -> list[PoolSlot]:
        """The writer's pool slots at ``offsets``, out of its pool (a put uses them), its pool refreshed.

        Raises:
            Forbidden: one is not in the pool; none is taken then.
        """
        with self._lock:
            pool = self._pools.get((owner, pid, name))
            taken = [] if pool is None else [pool.slots.pop(off, None) for off in offsets]
            if pool is None or None in taken:
                if pool is not None:
                    for ps in taken:
                        if ps is not None:
                            pool.slots[ps.slot.offset] = ps
                raise Forbidden(f"slot(s) not in this writer's pool (never granted, already used, or "
                                f"reclaimed after {self.ttl_s:g} s without a put or its process's exit)")
            pool.expires_s = self._core.clock() + self.ttl_s
            return taken  # type: ignore[return-value]

    def _back_to_pool(self, owner: str, pid: int, name: str, slots: list[PoolSlot | None]) -> None:
        """Slots the writer keeps (unused by this put); to the tier when its pool is gone."""
        slots = [ps for ps in slots if ps is not None]
        with self._lock:
            pool = self._pools.get((owner, pid, name))
            if pool is not None and not self._closed:
                for ps in slots:
                    pool.slots[ps.slot.offset] = ps
                return
        self._give_back_pool(slots)

    def _give_back_pool(self, slots: list[PoolSlot]) -> None:
        give_back(self._core.tiers[0], slots)  # a pool slot has what a reserved block gives back: slot, size, room

    def release(self, owner: str, pid: int, name: str) -> int:
        """Give ``owner``'s pool ``name`` of process ``pid`` back to the tier (its writer closes); slots returned."""
        with self._lock:
            pool = self._pools.pop((owner, pid, name), None)
        if pool is None:
            return 0
        self._give_back_pool(list(pool.slots.values()))
        return len(pool.slots)

    def lent_bytes(self) -> int:
        """Bytes lent out in pools now."""
        with self._lock:
            return sum(ps.size for pool in self._pools.values() for ps in pool.slots.values())

    def count(self) -> int:
        """Pools held now (the reaper runs while any is)."""
        with self._lock:
            return len(self._pools)

    def reap(self, now: float) -> int:
        """Reclaim pools whose writer is gone or that saw no put for ``ttl_s``; how many."""
        with self._lock:
            gone = [p for p in self._pools.values() if now >= p.expires_s or start_ticks(p.pid) != p.ticks]
            for pool in gone:
                del self._pools[(pool.owner, pool.pid, pool.name)]
        for pool in gone:
            self._give_back_pool(list(pool.slots.values()))
            if pool.slots:
                log.info("kvstore: pool of %s's process %d reclaimed (%d slots): its writer %s", pool.owner, pool.pid,
                         len(pool.slots), "exited" if now < pool.expires_s else f"made no put for {self.ttl_s:g} s")
        self.reaped += len(gone)
        return len(gone)

    def close(self) -> None:
        """Give every lent slot back (before the tiers close)."""
        with self._lock:
            self._closed = True
            lent = [ps for pool in self._pools.values() for ps in pool.slots.values()]
            self._pools.clear()
        self._give_back_pool(lent)
