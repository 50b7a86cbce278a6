"""Two-phase puts: a co-located writer fills slots of the top tier itself, then commits them.

A put through the service copies a KV twice before it is stored (into a body or
staging buffer, then into the tier) and hashes it once more. Here the server only
reserves: for each new block of the sequence, a slot of the top (shm) tier, sized
for its raw frame, kept out of compaction and reuse and invisible to readers. The
client encodes each block straight into its slot (copy and hash in one pass) and
commits with the body checksums it computed; the server checks each frame's header
(its own checksum, shape, dtype and metadata, a few hundred bytes) against the
reservation and the claimed checksum, and publishes. It does not hash the bodies
again: it trusts a writer it handed a slot to (the arena is ``0600``: such a
writer runs as the server's user), and the first read of each frame verifies it
in full all the same (``Frames.read_with``), so a body that does not match its
checksum is a miss, never wrong KV.

A reservation belongs to its owner (the tenant) and its process. It ends in a
commit or an abort; one whose process is gone, or that outlives ``ttl_s``, is
aborted by a reaper thread within ``reap_every_s``, so a writer killed between
reserve and commit, or during its copy, leaks nothing and leaves nothing
visible. A writer still alive past ``ttl_s`` loses its slots, and its commit is
refused; a late write into a reaped slot lands in memory that may already hold
another frame, whose first read then finds it damaged (unless that frame was read
and vouched for before; ``docs/design.md`` says what this trust gives up).

Pooled puts (``kvstore.engine.pools``) take one request a put from slots lent ahead; their
pools are reaped here with the reservations.

Reservations are offered only where a put would write raw frames into an shm
top tier and no tier is shared between nodes (a shared tier's write-through
needs the bytes on this side); elsewhere ``reserve`` says why and the client
puts another way.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore, is_current
from kvstore.errors import Forbidden, InvalidInput, TierFull
from kvstore.engine.index import IndexEntry
from kvstore.keys import BlockHash, block_hashes, block_meta
from kvstore.memory.shm import start_ticks
from kvstore.engine.placement import RoomHold
from kvstore.engine.pools import PooledPuts
from kvstore.engine.slots import Progress, ReservedBlock, block_tokens, check_written, give_back, publish_written
from kvstore.spec import KVSpec

__all__ = ["ReservedPuts", "Reservation", "ReservedBlock"]

log = logging.getLogger("kvstore.engine.reserved")


@dataclass(slots=True)
class Reservation:
    id: str
    owner: str
    namespace: str
    spec: KVSpec
    blocks: list[ReservedBlock]
    n_tokens: int
    """Tokens the put covers once committed (blocks already stored count)."""
    pid: int | None
    ticks: int | None
    expires_s: float
    keys: list[BlockHash] = field(default_factory=list)
    """Every block key of the put, stored already or not (for hand-off learning)."""

    def to_dict(self) -> dict[str, Any]:
        return {"reservation": self.id, "n_tokens": self.n_tokens,
                "blocks": [{"depth": b.depth, "offset": b.slot.offset, "length": b.size, "meta": b.meta.hex()}
                           for b in self.blocks]}


class ReservedPuts:
    """The reservations of one store.

    Args:
        core: the engine core (index, tiers, counters, clock).
        take_room: the store's admission rule: room for a new frame of n bytes, made in the
            tier admission picks and held until released (``RoomHold``).
        shared: whether a tier is shared between nodes (then nothing is reserved).
        ttl_s: the longest a reservation lives uncommitted, by the engine's clock (``core.clock``).
        reap_every_s: how often the reaper looks for dead writers and expired reservations.
    """

    def __init__(self, core: EngineCore, take_room: Callable[[int], RoomHold], *, shared: bool,
                 ttl_s: float = 30.0, reap_every_s: float = 0.5) -> None:
        self._core, self._take_room, self._shared = core, take_room, shared
        self.ttl_s, self.reap_every_s = ttl_s, reap_every_s
        self._open: dict[str, Reservation] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._closed = False
        self.reaped = 0
        """Reservations aborted, and pools reclaimed, because their writer died or they expired."""
        self.pools = PooledPuts(core, self.unavailable, self._lent, ttl_s)
        """Slots lent ahead for one-request puts (``kvstore.engine.pools``); reaped with the reservations."""

    # -- why not --------------------------------------------------------------------------------

    def unavailable(self) -> str | None:
        """Why this store cannot take reserved puts, or None."""
        top = self._core.tiers[0]
        if self._shared:
            return "a tier is shared between nodes: its write-through needs the bytes here"
        if not callable(getattr(top, "reserve", None)) or getattr(top, "kind", None) != "shm":
            return f"the top tier {top.name!r} is not an shm arena"
        if self._core.codec_of(top.name) is not Codec.RAW:
            return f"the top tier {top.name!r} stores {self._core.codec_of(top.name).value} frames, not raw"
        return None

    # -- reserve ----------------------------------------------------------------------------------

    def reserve(self, spec: KVSpec, tokens: Any, namespace: str, owner: str, pid: int | None) -> Reservation | None:
        """Slots for every block of ``tokens`` not stored yet, or None when the top tier has no room
        for all of them (nothing is held then: the caller puts another way). A reservation with
        no blocks (all stored) has the id "" and needs no commit.

        Raises:
            InvalidInput: the store cannot take reserved puts (``unavailable``), or a bad pid.
        """
        why = self.unavailable()
        if why is not None:
            raise InvalidInput(f"reserved puts are off here: {why}")
        ticks = None
        if pid is not None:
            ticks = start_ticks(pid)
            if ticks is None:
                raise InvalidInput(f"pid: no process {pid} on this host")
        top = self._core.tiers[0]
        keys = block_hashes(spec, tokens, namespace)
        spec_fp, bt = spec.fingerprint(), spec.block_tokens
        shape = spec.kv_shape(bt)
        keep = self._core.events.keep_tokens  # only vLLM's event format carries token ids
        blocks: list[ReservedBlock] = []
        deduped = 0
        try:
            for depth, key in enumerate(keys):
                if is_current(self._core.entry(key), namespace, spec_fp):
                    deduped += 1
                    continue
                meta = block_meta(namespace, spec_fp, depth)
                size = codec_mod.frame_size(shape, spec.dtype, Codec.RAW, meta_len=len(meta))
                room = self._take_room(size)
                try:
                    if room.tier != 0:  # admission puts it lower: not for this path
                        raise TierFull(f"placement puts new blocks below {top.name!r}", tier=top.name)
                    slot = top.reserve(key, size)
                except BaseException:
                    room.release()
                    raise
                blocks.append(ReservedBlock(depth, key, slot, size, meta, keys[depth - 1] if depth else None,
                                            block_tokens(tokens, depth, bt) if keep else b"", room))
        except TierFull:
            give_back(top, blocks)
            return None
        except BaseException:
            give_back(top, blocks)
            raise
        self._core.count(put_calls=1, blocks_deduped=deduped)
        res = Reservation(secrets.token_urlsafe(12) if blocks else "", owner, namespace, spec, blocks,
                          len(keys) * bt, pid, ticks, self._core.clock() + self.ttl_s, keys)
        if not blocks:  # all stored already: nothing to write or commit
            return res
        with self._lock:
            self._open[res.id] = res
            self._start_reaper()
        return res

    # -- commit -----------------------------------------------------------------------------------

    def get(self, rid: str) -> Reservation | None:
        """The open reservation ``rid``, or None."""
        with self._lock:
            return self._open.get(rid)

    def commit(self, rid: str, owner: str, checksums: list[int], *, sealed: bool = False) -> tuple[int, int]:
        """Publish the reservation's frames, written by its owner with these body checksums.

        A block written meanwhile by another put (the same prefix from another writer) keeps
        that writer's frame; this one's slot goes back.
        ``sealed``: the server wrote and sealed these frames itself (an HTTP block-major put),
        hashing the bytes in the slot: they are vouched for at once, not hashed again behind.

        Returns:
            Tokens covered, as ``put_kv`` returns them, and the KV bytes the writer put in the slots.

        Raises:
            Forbidden: no such reservation of ``owner`` (never made, ended, or reaped).
            InvalidInput: ``checksums`` does not have one int per reserved block.
            CorruptFrame: a frame's header is damaged, or does not match the reservation or its
                claimed checksum; every slot of the reservation goes back, nothing is stored.
        """
        res = self._take(rid, owner)
        top = self._core.tiers[0]
        try:
            if len(checksums) != len(res.blocks) or not all(
                    isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 64 for c in checksums):
                raise InvalidInput(f"checksums: {len(res.blocks)} unsigned 64-bit ints expected, "
                                   f"one per reserved block")
            headers = [check_written(top, b, c, res.spec) for b, c in zip(res.blocks, checksums)]
        except BaseException:
            give_back(top, res.blocks)
            raise
        now, heat_now = self._core.clock(), self._core.placement.clock()
        spec_fp = res.spec.fingerprint()
        entries = [IndexEntry(key=b.key, tier=top.name, size=h.frame_len, codec=h.codec, checksum=h.body_checksum,
                              raw_bytes=h.raw_nbytes, namespace=res.namespace, spec_fp=spec_fp, depth=b.depth,
                              created_s=now, last_access_s=now) for b, h in zip(res.blocks, headers)]
        progress = Progress()
        try:  # sealed: this process hashed the bytes in place as it sealed them: verified
            publish_written(self._core, entries, [(b.slot, b.size) for b in res.blocks],
                            lambda old, e: is_current(old, res.namespace, spec_fp), now=heat_now, vouch=sealed,
                            chain=[(b.parent, b.tokens or None) for b in res.blocks], progress=progress)
        except BaseException:
            give_back(top, res.blocks[progress.untouched():])
            raise
        finally:
            give_back(top, [res.blocks[i] for i in progress.held])  # another put's frame stays
            for b in res.blocks:
                if b.room is not None:
                    b.room.release()  # published (placement counts it now), given back, or failed
        return res.n_tokens, sum(h.raw_nbytes for h in headers)

    # -- abort, reap ------------------------------------------------------------------------------

    def abort(self, rid: str, owner: str) -> None:
        """Give the reservation's slots back unpublished.

        Raises:
            Forbidden: no such reservation of ``owner``.
        """
        res = self._take(rid, owner)
        give_back(self._core.tiers[0], res.blocks)

    def _take(self, rid: str, owner: str) -> Reservation:
        with self._lock:
            res = self._open.get(rid)
            if res is None or res.owner != owner:
                raise Forbidden(f"reservation {rid!r}: not held (never made, already ended, or expired "
                                f"and reclaimed after {self.ttl_s:g} s or its writer's exit)")
            del self._open[rid]
            return res

    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def reap(self) -> int:
        """Abort reservations whose writer is gone or whose time is up; how many."""
        now = self._core.clock()
        with self._lock:
            gone = [r for r in self._open.values()
                    if now >= r.expires_s or (r.pid is not None and start_ticks(r.pid) != r.ticks)]
            for r in gone:
                del self._open[r.id]
        pools = self.pools.reap(now)
        self.reaped += pools
        top = self._core.tiers[0]
        reclaimed = len(gone) + pools
        for r in gone:
            give_back(top, r.blocks)
            log.info("kvstore: reservation %s of %s reclaimed (%d slots): its writer %s", r.id, r.owner,
                     len(r.blocks), "exited" if now < r.expires_s else f"did not commit within {self.ttl_s:g} s")
        self.reaped += len(gone)
        return reclaimed

    def _lent(self) -> None:
        """Slots were lent to a pool: the reaper runs while any pool is held."""
        with self._lock:
            self._start_reaper()

    def _start_reaper(self) -> None:
        """Under the lock: a reaper runs while any reservation is open."""
        if self._reaper is None and not self._closed:
            self._reaper = threading.Thread(target=self._reap_loop, name="kvstore-reservations", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed or not (self._open or self.pools.count()):
                    self._reaper = None
                    return
                self._wake.wait(self.reap_every_s)
                if self._closed:
                    self._reaper = None
                    return
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - a failed sweep must not end the reaper
                log.exception("kvstore: reaping reservations failed")

    def close(self) -> None:
        """Abort every open reservation and stop the reaper (before the tiers close)."""
        with self._lock:
            self._closed = True
            gone = list(self._open.values())
            self._open.clear()
            self._wake.notify_all()
        top = self._core.tiers[0]
        try:
            self.pools.close()
        except Exception:  # noqa: BLE001 - closing: the arena goes anyway
            pass
        for r in gone:
            try:
                give_back(top, r.blocks)
            except Exception:  # noqa: BLE001 - closing: the arena goes anyway
                pass


