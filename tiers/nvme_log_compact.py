"""The log layout's compaction: sealing full segments and rewriting the ones mostly dead.

``Compaction`` is the half of ``tiers.nvme_log.LogTier`` that the compactor thread runs (a mixin:
it works on the tier's own index, segments and locks). It seals full segments (``fdatasync``,
rename ``.open`` -> ``.seg``) and rewrites a sealed segment at least ``compact_dead_fraction``
dead: its live records are appended to the active segment keeping their seqs, made durable
(the group commit, or an ``fdatasync`` of each segment written), and only then is the old file
deleted. A tombstone is copied only while a dead frame of its key is still on disk elsewhere.
A segment whose scan stops short of its end (damage at rest) is kept and never picked again.
"""

from __future__ import annotations

import logging
import os

from kvstore.errors import StoreClosed
from tiers.nvme_file import fsync_dir
from tiers.nvme_log_format import FRAME, HEADER, frame_checksum, scan
from tiers.nvme_log_segments import Segment

__all__ = ["Compaction"]

log = logging.getLogger("kvstore.tiers")
_SEQ = 3  # an index entry's seq (segment id, offset, length, seq)


class Compaction:
    """Sealing and compaction for ``LogTier`` (which defines every attribute used here)."""

    def compact(self) -> int:
        """Seal full segments and rewrite every sealed one that is dead enough; segments removed.

        The compactor thread calls this; tests and benches may call it directly.
        """
        with self._compacting:
            self._seal_full()
            removed = 0
            while (seg := self._candidate()) is not None:
                self._compact_one(seg)
                removed += 1
            return removed

    def _compact_loop(self, interval_s: float) -> None:
        while True:
            with self._lock:
                self._wake.wait(interval_s)
                if self._closed:
                    return
            try:
                self.compact()
            except StoreClosed:
                return
            except Exception:  # counted and logged; tried again on the next round, never a dead thread
                log.exception("kvstore: tier %r: compaction failed", self.name)
                with self._lock:
                    self._counters.errors += 1

    def _seal_full(self) -> None:
        with self._lock:
            ready = [s for s in self._segments.values() if s.full and not s.sealed and s.writing == 0]
        for seg in ready:  # only this thread seals or retires: the fd stays open
            if self._fsync:
                os.fdatasync(seg.fd)
            sealed = seg.path[: -len(".open")] + ".seg"
            os.rename(seg.path, sealed)
            if self._fsync:
                fsync_dir(self._seg_dir)
            with self._lock:
                seg.path, seg.sealed = sealed, True

    def _candidate(self) -> Segment | None:
        with self._lock:
            self._check_open()
            dead = [(s.tail - s.live, s) for s in self._segments.values()
                    if s.sealed and not s.damaged and s.tail and s.tail - s.live >= self._dead_fraction * s.tail]
        return max(dead, key=lambda d: d[0])[1] if dead else None

    def _compact_one(self, seg: Segment) -> None:
        """Copy ``seg``'s live records (and tombstones still needed) to the active segment, then drop it."""
        wrote: set[int] = set()
        records = list(scan(seg.fd, seg.tail, verify=False))
        for rec in records:
            with self._lock:
                self._check_open()
                loc = self._index.get(rec.key)
                if rec.kind == FRAME:
                    keep = loc is not None and loc[0] == seg.id and loc[1] == rec.offset
                else:
                    keep = (loc is None or loc[_SEQ] < rec.seq) and self._shadowed.get(rec.key, 0) > 0
            if not keep:
                continue
            body = memoryview(os.pread(seg.fd, rec.length, rec.offset + HEADER))
            if rec.kind == FRAME and (len(body) != rec.length or frame_checksum(body) != rec.checksum):
                self._corrupt(rec.key, loc)
                continue
            dest, offset, _ = self._write(rec.kind, rec.key, body, rec.checksum, rec.seq)
            wrote.add(dest.id)
            with self._lock:
                if rec.kind == FRAME:
                    self._publish(rec.key, dest, offset, rec.length, rec.seq, (seg.id, rec.offset))
                else:
                    self._unpin_locked(dest)
        if self._group is not None:
            # the copies, and every put and tombstone that made a record here dead, are durable
            # before the originals go: else a host crash could bring an older frame back
            self._group.sync()
        elif self._fsync:  # each put was synced before it was published: the copies remain
            for seg_id in wrote:
                with self._lock:
                    dest = self._segments.get(seg_id)
                    if dest is not None:
                        dest.pins += 1
                if dest is not None:
                    try:
                        os.fdatasync(dest.fd)
                    finally:
                        self._unpin(dest)
        with self._lock:
            if (records[-1].offset + records[-1].size if records else 0) != seg.tail:
                seg.damaged = True  # unreadable past where the scan stopped: kept, never picked again
                self._facts["damaged_segments"] += 1
                return
            for rec in records:
                if rec.kind == FRAME:
                    self._unshadow(rec.key)  # every frame here is dead by now, and goes with the file
            del self._segments[seg.id]
            seg.retired = True
            self._facts["compactions"] += 1
            self._facts["compacted_bytes"] += seg.tail
            if seg.pins == 0:
                os.close(seg.fd)
        os.unlink(seg.path)
        if self._fsync:
            fsync_dir(self._seg_dir)
