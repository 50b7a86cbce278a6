"""The nvme tier's log-structured layout: frames appended to large segment files.

    <data_dir>/.lock                   flock'd by the one tier that has the directory open
    <data_dir>/segments/<id>.open      the segment being appended to (at most a few)
    <data_dir>/segments/<id>.seg       a sealed segment: synced, never appended to again

Why: the file layout (``tiers.nvme``) pays a file create, a rename and a directory entry per
block, and, syncing each put, a journal commit: about 27 MB/s at 64 KiB blocks here. An
append is one ``pwritev`` into the page cache; one sync covers many blocks (the group
commit of ``tiers.group_commit``, or an ``fdatasync`` of one file when each put is synced).

Records (``tiers.nvme_log_format``) carry a sequence number; at start the index (key ->
segment, offset, length, seq) is rebuilt from the segments, the highest seq of each key
winning, tombstones included. Sealed segments are read header by header; an ``.open`` one
(the tier stopped while writing it) has every frame hashed, is cut at the first record that
fails (a torn append: dropped, never served) and sealed. Appends are made one at a time
under the append lock, so a segment never has a hole before an acknowledged record.

Every read checks the record's header (key, seq, length) and the frame's xxh3; a frame that
fails is a miss, is counted, and gets a tombstone so a restart does not bring it back.

A compactor thread (``tiers.nvme_log_compact``) seals full segments and rewrites the ones at
least ``compact_dead_fraction`` dead. A put and a delete of one key may race: a tombstone
written while puts of its key are in flight raises the seq those may publish at, so memory
never keeps a frame the segments would not.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Iterator

from kvstore.errors import InvalidInput, StoreClosed, TierFull, TierIOError
from kvstore.keys import BlockHash, check_key
from kvstore.tier import Buffer, FrameWriter, Tier, TierCounters, TierStats, writable_bytes
from tiers.group_commit import GroupCommit
from tiers.nvme_file import NO_SPACE, byte_view, check_size, fill_staged, fsync_dir, staging_pool
from tiers.nvme_log_format import (
    FRAME, HEADER, TOMBSTONE, encode_header, frame_checksum, parse_header, record_size,
)
from tiers.nvme_log_compact import Compaction
from tiers.nvme_log_segments import Segment, load_segments, lock_dir, pwrite_all

__all__ = ["LogTier"]

_PAD = bytes(8)
_SEQ, _LEN = 3, 2  # fields of an index entry (segment id, offset, length, seq)


class LogTier(Compaction, Tier):
    """A durable tier of segment files, bounded by ``capacity_bytes`` of live frames.

    ``shared`` is False: the index lives in this process, the directory is locked to one tier.
    """

    durable = True
    shared = False

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = "nvme",
        fsync: bool = True,
        sync_interval_s: float = 0.0,
        segment_bytes: int = 64 << 20,
        compact_dead_fraction: float = 0.5,
        compact_interval_s: float = 1.0,
        verify_on_start: bool = False,
    ) -> None:
        """Open (or create) ``data_dir`` and rebuild the index from its segments.

        Args:
            data_dir: the tier's directory; created if missing.
            capacity_bytes: budget of live frame bytes (headers, padding and dead records excluded).
            name: the tier's name in the store.
            fsync: make puts durable (each synced, or by the group commit); without it ``durable``
                is False.
            sync_interval_s: > 0: group commit (puts return unsynced, synced within this many
                seconds or by ``sync()``); 0: each put is synced (``fdatasync``) before it returns.
            segment_bytes: a segment is sealed once the next record would pass this size.
            compact_dead_fraction: a sealed segment this dead (0-1] is rewritten by the compactor.
            compact_interval_s: how often the compactor thread looks (0: no thread; ``compact()``).
            verify_on_start: hash every frame of sealed segments too during the start-up scan.

        Raises:
            InvalidInput: a setting out of range.
            TierUnavailable: another tier holds the directory.
            TierIOError: the directory cannot be created, locked or scanned.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInput(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 4096:
            raise InvalidInput(f"segment_bytes must be an int >= 4096, got {segment_bytes!r}")
        if not 0 < compact_dead_fraction <= 1:
            raise InvalidInput(f"compact_dead_fraction must be in (0, 1], got {compact_dead_fraction!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.durable = fsync
        self.data_dir = os.path.abspath(os.fspath(data_dir))
        self._seg_dir = os.path.join(self.data_dir, "segments")
        self._fsync = fsync
        self._sync_each = fsync and not sync_interval_s > 0
        self._segment_bytes = segment_bytes
        self._dead_fraction = compact_dead_fraction
        self._verify_on_start = verify_on_start
        self._index: dict[bytes, tuple[int, int, int, int]] = {}  # key -> (segment id, offset, length, seq)
        self._segments: dict[int, Segment] = {}
        self._shadowed: dict[bytes, int] = {}
        """Per key, its dead frame records still on disk: a tombstone of the key must outlive them."""
        self._inflight: dict[bytes, int] = {}
        """Per key, puts appended or appending and not yet published."""
        self._floor: dict[bytes, int] = {}
        """Per key with puts in flight: the lowest seq one may publish (a tombstone written meanwhile
        outranks the lower ones on disk, so in memory they are dead on arrival too)."""
        self._compacting = threading.Lock()  # one compaction at a time (the thread, or a caller)
        self._used = 0
        self._pending = 0
        self._counters = TierCounters()
        self._facts = {"torn_bytes_dropped": 0, "corrupt_frames": 0, "compactions": 0, "compacted_bytes": 0,
                       "damaged_segments": 0}
        self._lock = threading.Lock()  # the index, the segments' accounting
        self._append = threading.Lock()  # the active segment's tail and the seq: one append at a time
        self._staging = staging_pool()  # put_with's frames, one reused buffer a thread
        self._closed = False
        self._wake = threading.Condition(self._lock)
        self._lock_fd = lock_dir(self.data_dir, self._seg_dir, name)
        try:
            started = time.perf_counter()
            self._seq = self._load() + 1
            self._scan_ms = (time.perf_counter() - started) * 1e3
            self._active = self._new_segment()
            self._group = GroupCommit(self.data_dir, sync_interval_s, self._sync_failed) \
                if fsync and not self._sync_each else None
        except BaseException:
            self._close_fds()
            os.close(self._lock_fd)
            raise
        self._compactor = None
        if compact_interval_s > 0:
            self._compactor = threading.Thread(target=self._compact_loop, args=(compact_interval_s,),
                                               name=f"kvstore-{name}-compactor", daemon=True)
            self._compactor.start()

    # -- the contract -----------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer) -> None:
        """Append ``frame`` under ``key`` (see ``Tier.put``).

        Raises:
            InvalidKey, InvalidInput: a bad key or frame. TierFull: over capacity or out of disk
            space; nothing changed. TierIOError: the OS failed the write or its sync.
            StoreClosed: the tier is closed.
        """
        key = check_key(key)
        view = byte_view(frame)
        checksum = frame_checksum(view)  # outside every lock: the one pass over the bytes
        self._reserve(key, len(view))
        self._append_frame(key, view, checksum, len(view))

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        """Let ``writer`` fill a buffer of ``size`` bytes, then append what it wrote.

        Capacity is held before ``writer`` runs, so a full tier refuses with nothing spent:
        a caller receiving the frame off a socket can still make room and try again.

        Returns:
            The stored frame's length.

        Raises:
            As ``put``; InvalidInput when ``writer`` reports more than ``size`` bytes.
        """
        key = check_key(key)
        check_size(size)
        self._reserve(key, size)
        try:
            staged, n = fill_staged(self._staging, 0, size, writer)
            view = staged[:n]
            checksum = frame_checksum(view)
        except BaseException:
            with self._lock:
                self._pending -= size
                self._landed(key)
            raise
        self._append_frame(key, view, checksum, size)  # releases what _reserve held, however it ends
        return n

    def _reserve(self, key: bytes, size: int) -> None:
        """Hold ``size`` bytes of capacity for a put of ``key`` on its way; TierFull if they do not fit."""
        with self._lock:
            self._check_open()
            if self._used - self._length(key) + self._pending + size > self.capacity_bytes:
                self._counters.errors += 1
                raise TierFull(f"tier {self.name!r}: a {size}-byte frame does not fit ({self._used} of "
                               f"{self.capacity_bytes} bytes used, {self._pending} reserved)", tier=self.name)
            self._pending += size
            self._inflight[key] = self._inflight.get(key, 0) + 1

    def _append_frame(self, key: bytes, view: memoryview, checksum: int, held: int) -> None:
        """Append ``view`` for ``key`` and publish it, releasing the ``held`` bytes ``_reserve`` took."""
        try:
            seg, offset, seq = self._write(FRAME, key, view, checksum, None)
        except BaseException:
            with self._lock:
                self._pending -= held
                self._landed(key)
            raise
        with self._lock:
            self._pending -= held
            self._publish(key, seg, offset, len(view), seq, None)
            self._landed(key)
            self._counters.puts += 1

    def get(self, key: BlockHash) -> Buffer | None:
        """The frame under ``key`` as a new bytearray; None when absent or failing its checks."""
        return self._read(check_key(key), None)

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        """Read the frame straight into ``out`` (verified there); its length, or None when absent."""
        got = self._read(check_key(key), writable_bytes(out))
        return None if got is None else len(got)

    def head(self, key: BlockHash, nbytes: int) -> tuple[Buffer, int] | None:
        """The frame's first ``nbytes`` and its length, reading only those (no checksum)."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            loc = self._index.get(key)
            if loc is None:
                return None
            seg = self._pin(loc[0])
        try:
            return os.pread(seg.fd, min(nbytes, loc[_LEN]), loc[1] + HEADER), loc[_LEN]
        except OSError as exc:
            raise TierIOError(f"tier {self.name!r}: reading {seg.path} failed: {exc}", tier=self.name) from exc
        finally:
            self._unpin(seg)

    def delete(self, key: BlockHash) -> bool:
        """Remove ``key``: a tombstone appended, the index entry dropped. True when something was removed."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            if key not in self._index:
                return False
        seg, offset, seq = self._write(TOMBSTONE, key, memoryview(b""), frame_checksum(b""), None)
        with self._lock:
            self._unpin_locked(seg)
            self._raise_floor(key, seq)
            loc = self._index.get(key)
            if loc is None or loc[_SEQ] > seq:  # deleted, or put again, meanwhile
                return False
            self._forget(key, loc)
            self._counters.deletes += 1
        return True

    def contains(self, key: BlockHash) -> bool:
        key = check_key(key)
        with self._lock:
            self._check_open()
            return key in self._index

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            self._check_open()
            snapshot = list(self._index)
        return iter(snapshot)  # type: ignore[arg-type]

    def stats(self) -> TierStats:
        with self._lock:
            disk = sum(s.tail for s in self._segments.values())
            live = sum(s.live for s in self._segments.values())
            return TierStats(
                name=self.name, kind="nvme", entries=len(self._index), used_bytes=self._used,
                capacity_bytes=self.capacity_bytes, durable=self.durable, shared=self.shared,
                counters=replace(self._counters),
                details={
                    "backing": f"segments under {self._seg_dir}",
                    "layout": "log",
                    "fsync": ("off (not durable)" if not self._fsync else "each put" if self._group is None
                              else f"group commit every {self._group.interval_s:g} s ({self._group.syncs} syncs)"),
                    "segments": str(len(self._segments)),
                    "segment_bytes": str(self._segment_bytes),
                    "disk_bytes": str(disk),
                    "dead_bytes": str(disk - live),
                    "startup_scan": "full checksums" if self._verify_on_start else "headers (open segments hashed)",
                    "startup_scan_ms": f"{self._scan_ms:.1f}",
                    **{k: str(v) for k, v in self._facts.items()},
                },
            )

    def sync(self) -> None:
        """Return once every put acknowledged so far is synced (at once when each put is).

        Raises:
            TierIOError: the sync failed (the writes stay stored, not yet durable).
        """
        if self._group is not None:
            try:
                self._group.sync()
            except OSError as exc:
                raise TierIOError(f"tier {self.name!r}: syncing its writes failed: {exc}", tier=self.name) from exc

    def close(self) -> None:
        """Stop the compactor, sync, close the segments and release the directory lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        if self._compactor is not None:
            self._compactor.join(30)
        if self._group is not None:
            self._group.close()
        with self._append, self._lock:
            self._index.clear()
            self._used = 0
            self._staging = staging_pool()  # drop this thread's staging buffer
            self._close_fds()
            os.close(self._lock_fd)

    # -- writing ----------------------------------------------------------------

    def _write(self, kind: int, key: bytes, body: memoryview, checksum: int,
               seq: int | None) -> tuple[Segment, int, int]:
        """Append one record; returns (segment, offset, seq) with the segment pinned and counted as
        being written until ``_publish`` (or ``_unpin_locked``) lets it go."""
        size = record_size(len(body))
        with self._append:
            self._check_open()
            seg = self._active
            if seg.tail and seg.tail + size > self._segment_bytes:
                seg = self._roll()
            offset = seg.tail
            if seq is None:
                seq, self._seq = self._seq, self._seq + 1
            parts = [encode_header(kind, seq, key, len(body), checksum), body, _PAD[: size - HEADER - len(body)]]
            try:
                pwrite_all(seg.fd, parts, offset)
            except OSError as exc:
                self._abandon(seg, offset)
                raise self._os_error(exc, f"appending to {seg.path}") from exc
            seg.tail = offset + size
            with self._lock:
                seg.pins += 1
                seg.writing += 1
        if self._sync_each:
            try:
                os.fdatasync(seg.fd)
            except OSError as exc:  # not published; a restart may find it, as after a kill mid-put
                with self._append:
                    if seg is self._active:  # later records must not sit behind what may be lost
                        self._roll()
                with self._lock:
                    self._unpin_locked(seg)
                    if kind == FRAME:
                        self._shadow(key)  # on disk, dead: a tombstone of the key must outlive it
                raise self._os_error(exc, f"syncing {seg.path}") from exc
        elif self._group is not None:
            self._group.wrote()
        return seg, offset, seq

    def _publish(self, key: bytes, seg: Segment, offset: int, length: int, seq: int,
                 moved_from: tuple[int, int] | None) -> None:
        """Point the index at a written record unless a newer one of the key got there first. Lock held."""
        self._unpin_locked(seg)
        loc = self._index.get(key)
        if moved_from is not None:  # a compacted copy replaces exactly the record it copied
            if loc is None or loc[:2] != moved_from:
                self._shadow(key)  # the copy is dead on arrival
                return
            self._segments[loc[0]].live -= record_size(length)
            self._shadow(key)  # the original, dead now, until its segment goes
            self._index[key] = (seg.id, offset, length, seq)
            seg.live += record_size(length)
            return
        if seq < self._floor.get(key, -1) or (loc is not None and loc[_SEQ] > seq):
            self._shadow(key)  # a later put or a tombstone of this key got there first: dead on arrival
            return
        if loc is not None:
            self._forget(key, loc)
        self._index[key] = (seg.id, offset, length, seq)
        seg.live += record_size(length)
        self._used += length

    def _forget(self, key: bytes, loc: tuple[int, int, int, int]) -> None:
        """Drop ``key``'s index entry ``loc`` (its record becomes dead space). Lock held."""
        del self._index[key]
        self._segments[loc[0]].live -= record_size(loc[_LEN])
        self._used -= loc[_LEN]
        self._shadow(key)

    def _shadow(self, key: bytes) -> None:
        self._shadowed[key] = self._shadowed.get(key, 0) + 1

    def _unshadow(self, key: bytes) -> None:
        left = self._shadowed.get(key, 0) - 1
        if left > 0:
            self._shadowed[key] = left
        else:
            self._shadowed.pop(key, None)

    def _raise_floor(self, key: bytes, seq: int) -> None:
        """A tombstone of ``key`` at ``seq`` is on disk: puts of it in flight below ``seq`` are dead. Lock held."""
        if key in self._inflight:
            self._floor[key] = max(self._floor.get(key, -1), seq)

    def _landed(self, key: bytes) -> None:
        """One put of ``key`` published or failed. Lock held."""
        left = self._inflight[key] - 1
        if left:
            self._inflight[key] = left
        else:
            del self._inflight[key]
            self._floor.pop(key, None)

    def _roll(self) -> Segment:
        """Start a new active segment; the old one is sealed by the compactor. Append lock held."""
        old = self._active
        self._active = self._new_segment()
        with self._lock:
            old.full = True
            self._wake.notify_all()
        return self._active

    def _new_segment(self) -> Segment:
        with self._lock:  # the compactor may be removing a segment meanwhile
            seg_id = max(self._segments, default=0) + 1
        path = os.path.join(self._seg_dir, f"{seg_id:016x}.open")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            if self._fsync:
                fsync_dir(self._seg_dir)  # the name must outlive a crash before its records do
        except OSError as exc:
            raise self._os_error(exc, f"creating {path}") from exc
        seg = Segment(seg_id, fd, path)
        with self._lock:
            self._segments[seg_id] = seg
        return seg

    def _abandon(self, seg: Segment, offset: int) -> None:
        """A failed append: cut the segment back to ``offset``, or move on to a new one. Append lock held."""
        try:
            os.ftruncate(seg.fd, offset)
        except OSError:
            if seg is self._active:
                self._roll()

    # -- reading ----------------------------------------------------------------

    def _read(self, key: bytes, out: memoryview | None) -> Buffer | None:
        with self._lock:
            self._check_open()
            self._counters.gets += 1
            loc = self._index.get(key)
            if loc is None:
                self._counters.misses += 1
                return None
            seg = self._pin(loc[0])
        length = loc[_LEN]
        if out is None:
            data = bytearray(length)
            view = memoryview(data)
        else:
            if len(out) < length:
                self._unpin(seg)
                raise InvalidInput(f"out holds {len(out)} bytes, the frame needs {length}")
            view = data = out[:length]
        head = bytearray(HEADER)
        try:
            got = os.preadv(seg.fd, [head, view], loc[1])
        except OSError as exc:
            with self._lock:
                self._counters.errors += 1
            raise TierIOError(f"tier {self.name!r}: reading {seg.path} failed: {exc}", tier=self.name) from exc
        finally:
            self._unpin(seg)
        rec = parse_header(head, loc[1])
        if (got != HEADER + length or rec is None or rec.kind != FRAME or rec.key != key or rec.seq != loc[_SEQ]
                or rec.length != length or frame_checksum(view) != rec.checksum):
            self._corrupt(key, loc)
            return None
        with self._lock:
            self._counters.hits += 1
        return data

    def _corrupt(self, key: bytes, loc: tuple[int, int, int, int] | None) -> None:
        """A record failed its checks: a miss now, and a tombstone so a restart does not serve it."""
        with self._lock:
            self._counters.misses += 1
            if loc is None or self._index.get(key) != loc:
                return  # replaced meanwhile
            self._forget(key, loc)
            self._raise_floor(key, loc[_SEQ])
            self._facts["corrupt_frames"] += 1
        try:  # the damaged record's own seq: it outranks exactly what that record did, no more
            seg, _, _ = self._write(TOMBSTONE, key, memoryview(b""), frame_checksum(b""), loc[_SEQ])
            with self._lock:
                self._unpin_locked(seg)
        except (TierIOError, TierFull, StoreClosed):
            pass  # the scan or the next read finds the damage again: still never served

    def _pin(self, seg_id: int) -> Segment:
        seg = self._segments[seg_id]
        seg.pins += 1
        return seg

    def _unpin(self, seg: Segment) -> None:
        with self._lock:
            seg.pins -= 1
            if seg.retired and seg.pins == 0:
                os.close(seg.fd)

    def _unpin_locked(self, seg: Segment) -> None:
        seg.writing -= 1
        seg.pins -= 1
        if seg.retired and seg.pins == 0:
            os.close(seg.fd)

    # -- start-up ---------------------------------------------------------------

    def _load(self) -> int:
        """Rebuild the index from the segments; the highest seq found (0 when empty)."""
        try:
            found = load_segments(self._seg_dir, verify_all=self._verify_on_start, fsync=self._fsync)
        except TierIOError as exc:
            raise TierIOError(f"tier {self.name!r}: {exc}", tier=self.name) from exc
        self._segments, self._index, self._shadowed = found.segments, found.index, found.shadowed
        self._used = sum(loc[_LEN] for loc in self._index.values())
        self._facts["torn_bytes_dropped"] = found.torn_bytes
        return found.top_seq

    # -- helpers ----------------------------------------------------------------

    def _length(self, key: bytes) -> int:
        loc = self._index.get(key)
        return 0 if loc is None else loc[_LEN]

    def _close_fds(self) -> None:
        for seg in self._segments.values():
            seg.retired = True
            if seg.pins == 0:
                os.close(seg.fd)
        self._segments.clear()

    def _sync_failed(self, exc: OSError) -> None:
        with self._lock:
            self._counters.errors += 1

    def _os_error(self, exc: OSError, what: str) -> TierFull | TierIOError:
        with self._lock:
            self._counters.errors += 1
        cls = TierFull if exc.errno in NO_SPACE else TierIOError
        return cls(f"tier {self.name!r}: {what} failed: {exc}", tier=self.name)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"tier {self.name!r} is closed")
