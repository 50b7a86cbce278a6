"""The log layout's segments: the bookkeeping of one segment file, appends, and the start-up scan.

``load_segments`` rebuilds what ``tiers.nvme_log.LogTier`` knows from the files alone: each
key's newest record wins (by seq), tombstones included; sealed segments are read header by
header; an ``.open`` one (the tier stopped while appending to it) is hashed record by record,
cut at the first that fails (a torn append) and sealed, so it is never appended to again.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field

from kvstore.errors import TierIOError, TierUnavailable
from tiers.nvme_file import fsync_dir
from tiers.nvme_log_format import FRAME, record_size, scan

__all__ = ["Segment", "Loaded", "load_segments", "lock_dir", "pwrite_all"]

_NAME = re.compile(r"^([0-9a-f]{16})\.(seg|open)$")


class Segment:
    """One segment file and what the index knows about it."""

    __slots__ = ("id", "fd", "path", "tail", "live", "sealed", "full", "pins", "writing", "retired", "damaged")

    def __init__(self, seg_id: int, fd: int, path: str, tail: int = 0, sealed: bool = False) -> None:
        self.id, self.fd, self.path = seg_id, fd, path
        self.tail = tail  # bytes of records (the next append's offset)
        self.live = 0  # bytes of records the index points at
        self.sealed = sealed
        self.full = sealed  # no more appends: sealed, or rolled past
        self.pins = 0  # reads and writes using the fd; a retired segment closes it at 0
        self.writing = 0  # appends reserved here and not yet published
        self.retired = False
        self.damaged = False  # a compaction's scan stopped short of the tail: never compacted


@dataclass
class Loaded:
    """What a start-up scan found."""

    segments: dict[int, Segment] = field(default_factory=dict)
    index: dict[bytes, tuple[int, int, int, int]] = field(default_factory=dict)
    """key -> (segment id, offset, frame length, seq) of its newest record, when that is a frame."""
    shadowed: dict[bytes, int] = field(default_factory=dict)
    """key -> how many of its frame records on disk are dead (older than its newest record)."""
    torn_bytes: int = 0
    top_seq: int = 0


def load_segments(seg_dir: str, *, verify_all: bool, fsync: bool) -> Loaded:
    """Open and scan every segment under ``seg_dir``; empty ones are removed.

    Raises:
        TierIOError: a segment could not be opened, read, cut or renamed.
    """
    found = Loaded()
    best: dict[bytes, tuple[int, int, int, int, int]] = {}  # key -> (seq, kind, segment id, offset, length)
    frames: dict[bytes, int] = {}
    try:
        for name in sorted(os.listdir(seg_dir)):
            match = _NAME.match(name)
            if match is None:
                continue  # not ours: left alone
            seg_id, path = int(match.group(1), 16), os.path.join(seg_dir, name)
            seg = Segment(seg_id, os.open(path, os.O_RDWR | os.O_CLOEXEC), path, sealed=match.group(2) == "seg")
            found.segments[seg_id] = seg
            size = os.fstat(seg.fd).st_size
            for rec in scan(seg.fd, size, verify=verify_all or not seg.sealed):
                seg.tail = rec.offset + rec.size
                found.top_seq = max(found.top_seq, rec.seq)
                if rec.kind == FRAME:
                    frames[rec.key] = frames.get(rec.key, 0) + 1
                if rec.seq >= best.get(rec.key, (-1,))[0]:
                    best[rec.key] = (rec.seq, rec.kind, seg_id, rec.offset, rec.length)
            found.torn_bytes += size - seg.tail
            if not seg.sealed:
                os.ftruncate(seg.fd, seg.tail)
                if fsync:
                    os.fdatasync(seg.fd)
                seg.path = path[: -len(".open")] + ".seg"
                os.rename(path, seg.path)
                seg.sealed = seg.full = True
            elif seg.tail < size:  # sealed, then damaged: kept (it may hold tombstones), never compacted
                seg.damaged = True
        for seg in [s for s in found.segments.values() if s.tail == 0 and not s.damaged]:
            os.close(seg.fd)
            os.unlink(seg.path)
            del found.segments[seg.id]
        if fsync:
            fsync_dir(seg_dir)
    except OSError as exc:
        for seg in found.segments.values():
            os.close(seg.fd)
        raise TierIOError(f"scanning the segments under {seg_dir} failed: {exc}") from exc
    for key, (seq, kind, seg_id, offset, length) in best.items():
        dead = frames.get(key, 0)
        if kind == FRAME:
            found.index[key] = (seg_id, offset, length, seq)
            found.segments[seg_id].live += record_size(length)
            dead -= 1
        if dead:
            found.shadowed[key] = dead
    return found


def pwrite_all(fd: int, parts: list, offset: int) -> None:
    """``pwritev`` every byte of ``parts`` at ``offset`` (a short write is continued, not lost)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def lock_dir(data_dir: str, seg_dir: str, name: str) -> int:
    """Make the tier's directories and take its lock (one index per directory); the lock's fd.

    Raises:
        TierUnavailable: another tier holds the directory. TierIOError: it cannot be made or locked.
    """
    fd = -1
    try:
        os.makedirs(seg_dir, exist_ok=True)
        fd = os.open(os.path.join(data_dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        if isinstance(exc, BlockingIOError):
            raise TierUnavailable(f"tier {name!r}: {data_dir} is in use by another tier (its index lives there)",
                                  tier=name) from exc
        raise TierIOError(f"tier {name!r}: cannot open {data_dir}: {exc}", tier=name) from exc
