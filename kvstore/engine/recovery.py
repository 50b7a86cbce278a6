"""Rebuild the index at start from what durable tiers still hold.

Every frame carries its namespace, spec fingerprint and depth in its metadata
(``keys.block_meta``), so a durable tier alone is enough to serve a block
again after a crash or restart. Only each frame's first 4 KiB is read
(``Tier.head``): the header and metadata; the body is verified on first read. Only tiers that are durable and private to this
store are scanned: a shared tier (Redis) is consulted on a miss instead, since
scanning a store-wide keyspace at every start would not scale.

Where a key turns up in two tiers (a crash in the middle of a move), the
faster tier's copy wins and the other is deleted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from kvstore import codec as codec_mod
from kvstore.engine.core import EngineCore
from kvstore.errors import FrameError, TierError
from kvstore.engine.index import IndexEntry

__all__ = ["recover", "entry_from_frame", "entry_from_head", "entry_from_header", "RecoveryReport"]

log = logging.getLogger("kvstore.engine.recovery")


@dataclass(slots=True)
class RecoveryReport:
    """What a start-up scan found."""

    entries: int = 0
    duplicates_removed: int = 0
    unreadable: int = 0
    """Frames that failed to verify or carry no kvstore metadata; left in place."""


def entry_from_frame(key: bytes, tier: str, frame, now_s: float) -> IndexEntry:
    """An index entry for ``frame``, from its header and metadata.

    Raises:
        FrameError: the frame does not verify or carries no kvstore metadata.
    """
    header = codec_mod.verify(frame)
    try:
        meta = json.loads(codec_mod.frame_meta(frame))
        ns, spec_fp, depth = meta["ns"], meta["spec"], int(meta["depth"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"frame of {key.hex()} carries no kvstore metadata: {exc}") from exc
    return IndexEntry(key=key, tier=tier, size=len(memoryview(frame).cast("B")), codec=header.codec,
                      checksum=header.body_checksum, raw_bytes=header.raw_nbytes, namespace=ns,
                      spec_fp=spec_fp, depth=depth, created_s=now_s, last_access_s=now_s)


_HEAD_BYTES = 4096  # a frame's header and metadata fit well inside this


def entry_from_head(key: bytes, tier: str, head, length: int, now_s: float) -> IndexEntry:
    """An index entry from a frame's first bytes (header checked, metadata read, body trusted
    until its first real read verifies it).

    Raises:
        FrameError: the header is damaged, or the metadata is missing or cut off.
    """
    header = codec_mod.read_header(head, prefix=True)
    if header.frame_len != length:
        raise FrameError(f"frame of {key.hex()} is {length} bytes, its header says {header.frame_len}")
    return entry_from_header(key, tier, header, head, now_s)


def entry_from_header(key: bytes, tier: str, header: codec_mod.FrameHeader, head, now_s: float) -> IndexEntry:
    """An index entry from a frame's header, read already, and its first bytes (``head``), which
    hold its metadata.

    Raises:
        FrameError: the metadata is missing or cut off.
    """
    start, end = header.meta_offset, header.meta_offset + header.meta_len
    view = memoryview(head).cast("B")
    if end > len(view):
        raise FrameError(f"metadata of {key.hex()} lies beyond the first {len(view)} bytes")
    try:
        meta = json.loads(bytes(view[start:end]))
        ns, spec_fp, depth = meta["ns"], meta["spec"], int(meta["depth"])
    except (ValueError, KeyError, TypeError) as exc:
        raise FrameError(f"frame of {key.hex()} carries no kvstore metadata: {exc}") from exc
    return IndexEntry(key=key, tier=tier, size=header.frame_len, codec=header.codec, checksum=header.body_checksum,
                      raw_bytes=header.raw_nbytes, namespace=ns, spec_fp=spec_fp, depth=depth,
                      created_s=now_s, last_access_s=now_s)


def recover(core: EngineCore) -> RecoveryReport:
    """Index every frame in the store's durable, private tiers (fastest first)."""
    report = RecoveryReport()
    now = core.clock()
    for tier in core.tiers:
        if not tier.durable or tier.shared:
            continue
        try:
            keys = list(tier.keys())
        except TierError as exc:
            log.warning("recovery: tier %s cannot list its keys (%s); skipped", tier.name, exc)
            continue
        for key in keys:
            if core.entry(key) is not None:  # a faster tier has it: a move was cut short
                try:
                    tier.delete(key)
                    report.duplicates_removed += 1
                except TierError:
                    pass
                continue
            try:
                # Header and metadata only: a start must not read a whole nvme tier. The body
                # is checked when first read, and a damaged one is then a miss.
                head = tier.head(key, _HEAD_BYTES)
                if head is None:
                    continue
                entry = entry_from_head(key, tier.name, head[0], head[1], now)
            except (FrameError, TierError) as exc:
                log.warning("recovery: %s in %s is unreadable (%s); left alone", key.hex(), tier.name, exc)
                report.unreadable += 1
                continue
            with core.claim(key):  # before the mover starts, but the index checks every change's claim
                core.publish(entry, access=False, reason="recovered")
            report.entries += 1
    if report.entries or report.duplicates_removed or report.unreadable:
        log.info("recovery: %s", report)
    return report
