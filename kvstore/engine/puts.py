"""The put path: a chain's blocks encoded straight into the tier admission picks, with room made.

``KVStore.put_kv`` checks its input and hashes the chain; ``Puts.write_chain`` writes it. Per
block not already stored, placement's admission picks a tier and makes room there (the mover
demotes or evicts colder entries, each move under its own key's claim) and holds it
(``PlacementManager.hold_room``) until the block is indexed, so puts racing each other and the
mover each free room of their own. Under the block's claim the frame is encoded into the tier's
slot (``Tier.put_with``, ``kvstore.codec.encode_into``) and ``EngineCore.publish`` indexes it.

``take_room`` is the store's one admission rule: frames by key (``kvstore.engine.frames``) and
reserved puts (``kvstore.engine.reserved``) take their room through it too.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore, is_current
from kvstore.engine.index import IndexEntry
from kvstore.engine.placement import MoveOrder, PlacementManager, RoomHold
from kvstore.engine.recode import Recoder
from kvstore.engine.shared import SharedTier
from kvstore.errors import InvalidInput, InvalidKV, TierError, TierFull
from kvstore.keys import BlockHash, block_meta
from kvstore.tier import Tier

__all__ = ["Puts", "Int8Ahead", "check_finite", "tier_codecs_of", "COLD_KINDS", "META_BUDGET", "SMALL_BLOCK_BYTES"]

log = logging.getLogger("kvstore.engine.store")

META_BUDGET = 256
"""Bytes reserved for frame metadata when sizing a block ahead of encoding."""

COLD_KINDS = ("nvme", "redis")
"""Tier kinds whose frames are int8 by default: slow media, where halving bytes pays."""


def tier_codecs_of(tiers: list[Tier], default: Codec, overrides: dict) -> tuple[dict[str, Codec], set[str]]:
    """(the codec of new frames in each tier, the names of the cold tiers): hot tiers keep the
    store's codec, cold ones hold int8 unless told otherwise.

    Raises:
        InvalidInput: ``overrides`` names a tier the store does not have.
    """
    names = [t.name for t in tiers]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise InvalidInput(f"tier_codecs names unknown tier(s) {unknown}; tiers are {names}")
    cold = {t.name for t in tiers if _kind(t) in COLD_KINDS}
    codecs = {t.name: Codec.parse(overrides.get(t.name, Codec.INT8 if t.name in cold and default is Codec.RAW
                                                else default)) for t in tiers}
    return codecs, cold


def _kind(tier: Tier) -> str:
    kind = getattr(tier, "kind", None)
    return kind if isinstance(kind, str) else tier.stats().kind


class Puts:
    """Writes chains of blocks into one store's tiers.

    Args:
        core: the store's engine core.
        shared: its shared tier, which copies each new block under ``write_through``.
        execute: the mover's ``execute``: carries out one of placement's move orders.
        lossy: a put writes where a non-raw codec is the codec (the top tier or the next one),
            so NaN and Inf are refused up front rather than kept raw.
        recoder: where a block written raw below the top tier is owed its re-encode (``None``: a
            put encodes for a cold tier itself).
    """

    def __init__(self, core: EngineCore, shared: SharedTier | None, execute: Callable[[MoveOrder], bool], *,
                 lossy: bool, recoder: Recoder | None = None) -> None:
        self._core = core
        self._recoder = recoder
        self._placement: PlacementManager = core.placement
        self._shared = shared
        self._execute = execute
        self.lossy = lossy
        self._forced_warned: dict[str, float] = {}

    def write_chain(self, keys: list[BlockHash], kv: torch.Tensor, tokens, namespace: str, spec_fp: str,
                    block_tokens: int) -> None:
        """Write every block of ``keys`` not already stored (``kv`` holds them in order).

        Blocks of the chain are leased while it is written: making room for its later blocks must
        not push out the earlier ones. ``tokens`` are the chain's ids, kept for events when the
        event log keeps them (vLLM's format carries them).
        """
        core, placement, bt = self._core, self._placement, block_tokens
        keep = core.events.keep_tokens
        now = core.clock()
        heat_now = placement.clock()  # one reading for the whole chain: its blocks tie, depth decides
        held: list[BlockHash] = []
        ahead = Int8Ahead(kv, bt, len(keys), namespace, spec_fp)
        try:
            for i, key in enumerate(keys):
                if is_current(core.entry(key), namespace, spec_fp):
                    core.count(blocks_deduped=1)
                    placement.accessed([key])  # a shared prefix written again is in use
                    if placement.lease(key):
                        held.append(key)
                    continue
                block = kv[:, :, :, i * bt: (i + 1) * bt]
                if self._put_block(key, block, namespace, spec_fp, i, now, heat_now, held, ahead,
                                   parent=keys[i - 1] if i else None,
                                   tokens=tokens[i * bt:(i + 1) * bt].astype("<u4").tobytes() if keep else None):
                    core.count(blocks_written=1)
                else:
                    core.count(blocks_deduped=1)
        finally:
            for key in held:
                placement.release(key)

    def _put_block(self, key: BlockHash, block: torch.Tensor, namespace: str, spec_fp: str, depth: int,
                   now: float, heat_now: float, held: list[BlockHash], ahead: "Int8Ahead | None" = None, *,
                   parent: BlockHash | None, tokens: bytes | None) -> bool:
        """Write one block where admission places it, with room made there; False if another put
        wrote it meanwhile. A written block is leased and added to ``held``.

        A write the tier refuses although room was made and held (a reader still holds a range
        it freed, or its disk is fuller than its capacity says) is tried once more, with room
        forced.
        """
        core = self._core
        core.putting()  # a long chain's later blocks still hold the re-encoder off (``recode``)
        top = core.tiers[0]
        size = codec_mod.frame_size(block.shape, block.dtype, core.codec_of(top.name), meta_len=META_BUDGET)
        for force in (False, True):
            with self.take_room(size, force=force) as room:  # outside any claim: it moves other keys
                with core.claim(key):
                    if is_current(core.entry(key), namespace, spec_fp):  # written while we waited
                        return False
                    try:
                        entry, spilled = self._write(key, block, namespace, spec_fp, depth, now,
                                                     stored_tokens=depth * block.shape[3], first=room.tier,
                                                     ahead=ahead)
                    except TierFull:
                        if force:
                            raise
                        continue
                    core.publish(entry, now=heat_now, parent=parent, tokens=tokens)
                    if spilled:
                        self._recoder.owe(key, entry.size)  # written raw below the top: int8 comes behind
                    if self._shared is not None:
                        self._shared.after_put(entry, block, block_meta(namespace, spec_fp, depth))
                    if self._placement.lease(key):
                        held.append(key)
                    return True
        raise AssertionError("unreachable: the forced try returns or raises")

    def take_room(self, size: int, *, force: bool = False) -> RoomHold:
        """Room for a new frame of ``size`` bytes in the tier admission picks, made now (colder
        entries demoted or evicted) and held until the hold is released, after the write."""
        target = self._placement.place_new(size)
        if force:
            self._room_forced(target)
        room = self._placement.hold_room(target, size, force=force)
        try:
            for order in room.orders:
                self._execute(order)
        except BaseException:
            room.release()
            raise
        return room

    def _room_forced(self, tier: str) -> None:
        self._core.count(room_forced=1)
        now = time.monotonic()
        if now - self._forced_warned.get(tier, -math.inf) >= 60:  # at most once a minute per tier
            self._forced_warned[tier] = now
            log.warning("tier %s refused a write although placement had made room (a reader holds a freed "
                        "range, or its disk holds less than its capacity): freeing room by force; "
                        "counter room_forced", tier)

    def _write(self, key: BlockHash, block: torch.Tensor, namespace: str, spec_fp: str, depth: int,
               now: float, *, stored_tokens: int, first: int = 0,
               ahead: "Int8Ahead | None" = None) -> tuple[IndexEntry, bool]:
        """Encode ``block`` straight into the first tier with room, from tier ``first`` down: its
        entry, and whether it went raw where the recoder owes its re-encode (``spills_raw``).

        Runs under ``claim(key)``.
        """
        core = self._core
        meta = block_meta(namespace, spec_fp, depth)
        failure: TierError | None = None
        for tier in core.tiers[first:]:
            codec = core.codec_of(tier.name)
            small = block.numel() * block.element_size() <= SMALL_BLOCK_BYTES
            spilled = (codec is not Codec.RAW and not small and self._recoder is not None and self._recoder.spills_raw(
                tier.name, codec_mod.frame_size(block.shape, block.dtype, Codec.RAW, meta_len=len(meta))))
            if spilled:
                codec = Codec.RAW  # below the top tier: the recoder re-encodes it off the put's path
            try:
                try:
                    frame = ahead.frame(depth) if ahead is not None and codec is Codec.INT8 and small else None
                    if frame is not None:  # quantized with the chain's other small blocks
                        tier.put(key, frame)
                        n, header = len(frame), codec_mod.read_header(frame)
                    else:
                        n, header = encode_into_tier(tier, key, block, codec, meta)
                except InvalidKV:
                    if codec is Codec.RAW or self.lossy:
                        raise
                    # int8 cannot hold it (NaN or Inf): keep it exact, as a demotion would
                    n, header = encode_into_tier(tier, key, block, Codec.RAW, meta)
                    core.count(blocks_kept_raw=1)
            except TierFull as exc:
                failure = failure or exc
                continue
            except TierError as exc:  # down or failing: degrade to the next tier
                core.count(tier_errors=1)
                log.warning("tier %s failed a put (%s); trying the next tier", tier.name, exc)
                failure = exc if failure is None or isinstance(failure, TierFull) else failure
                continue
            return IndexEntry(
                key=key, tier=tier.name, size=n, codec=header.codec, checksum=header.body_checksum,
                raw_bytes=header.raw_nbytes, namespace=namespace, spec_fp=spec_fp, depth=depth,
                created_s=now, last_access_s=now,
            ), spilled
        if isinstance(failure, TierFull) or failure is None:
            raise TierFull(
                f"no tier has room for a block ({', '.join(core.tier_names)} are full); "
                f"{stored_tokens} tokens are stored",
                stored_tokens=stored_tokens,
            ) from failure
        raise failure


SMALL_BLOCK_BYTES = codec_mod.MANY_PAYS_BELOW
"""Blocks of at most this many KV bytes going into an int8 tier are quantized with the rest of
their chain in one pass (``Int8Ahead``), on the put's path; larger ones are written raw and
re-encoded behind the put (``kvstore.engine.recode``), where the recoder takes them. Measured
(py-spy on a server under one co-located writer of 1 MiB puts into a full store): spilling 64 KiB
blocks raw cost the re-encoder 5.5 ms of CPU a put (a read back, the encode, a second write and
the compaction of the dead raw frames) against about 1 ms to quantize the put's 16 blocks at once."""
AHEAD_BLOCKS = 64
"""Blocks quantized at a time ahead of their writes."""


class Int8Ahead:
    """int8 frames of a chain's small blocks, quantized together (``codec.encode_many``) the first
    time one of them is wanted, then handed out block by block: one at a time, a 64 KiB block
    quantizes at a fifth of the speed (per-op overhead; 0.37 against 1.8 GB/s, stop 48)."""

    __slots__ = ("_kv", "_bt", "_n", "_namespace", "_spec_fp", "_frames", "_upto")

    def __init__(self, kv: torch.Tensor, block_tokens: int, n_blocks: int, namespace: str, spec_fp: str) -> None:
        self._kv, self._bt, self._n = kv, block_tokens, n_blocks
        self._namespace, self._spec_fp = namespace, spec_fp
        self._frames: dict[int, bytearray] = {}
        self._upto = 0  # blocks before this one were quantized ahead (or found unfit)

    def frame(self, depth: int) -> bytearray | None:
        """Block ``depth``'s int8 frame; None when it must be encoded alone (the batch had a block
        int8 cannot hold, or the block was quantized ahead and is being written again)."""
        if depth >= self._upto:
            self._frames.clear()
            upto = min(self._n, depth + AHEAD_BLOCKS)
            bt = self._bt
            blocks = [self._kv[:, :, :, d * bt:(d + 1) * bt] for d in range(depth, upto)]
            metas = [block_meta(self._namespace, self._spec_fp, d) for d in range(depth, upto)]
            self._upto = upto
            try:
                self._frames = dict(zip(range(depth, upto), codec_mod.encode_many(blocks, metas)))
            except InvalidKV:  # one of them cannot be int8: each is encoded alone, as before
                return None
        return self._frames.pop(depth, None)


def encode_into_tier(tier: Tier, key: BlockHash, block: torch.Tensor, codec: Codec,
                     meta: bytes) -> tuple[int, codec_mod.FrameHeader]:
    """Encode ``block`` in ``codec`` straight into ``tier``'s slot for ``key``: (frame bytes, its header)."""
    headers: list[codec_mod.FrameHeader] = []

    def writer(view: memoryview) -> int:
        n = codec_mod.encode_into(block, view, codec, meta=meta)
        headers.append(codec_mod.read_header(view[:n]))
        return n

    n = tier.put_with(key, codec_mod.frame_size(block.shape, block.dtype, codec, meta_len=len(meta)), writer)
    return n, headers[-1]


def check_finite(kv: torch.Tensor) -> None:
    """Refuse NaN and Inf before anything is stored where int8 is the codec.

    Raises:
        InvalidKV: ``kv`` holds NaN or Inf.
    """
    # aminmax propagates NaN and Inf and runs ~20x faster than isfinite().all() on fp16
    # (13 ms against 265 ms for 128 MiB here): a tenth of the int8 encode it protects.
    if kv.numel() == 0:
        return
    lo, hi = torch.aminmax(kv)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise InvalidKV("kv holds NaN or Inf values; the int8 codec cannot store them (nothing was stored)")
