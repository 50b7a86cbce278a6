"""The file tier: one safetensors file per frame under a data directory.

    <data_dir>/.lock                        flock'd by the one tier that has the directory open
    <data_dir>/ab/<key hex>.safetensors     a frame; ab = the key's first two hex digits
    <data_dir>/ab/.<key hex>.<pid>.<n>.tmp  a put in progress
    <data_dir>/quarantine/                  crash leftovers and files that failed a check

One level of 256 directories, made at the first open: a second level (ab/cd)
would make every put into a new leaf pay a mkdir and a parent fsync (a journal
commit: 0.2-10 ms here, as much as the put), and hashed directories (ext4 htree,
xfs) hold thousands of files each without slowing down.

A file is plain safetensors: a u64 header length, a JSON header padded with
spaces so the data starts at byte 4096 (the O_DIRECT unit), one U8 tensor
"frame". ``__metadata__`` holds the format tag, key hex, frame length and an
xxh3-64 of the frame, plus codec, dtype, shape and spec fingerprint when the
bytes parse as a KVSF frame (codec "opaque" when not; the tier never needs them).

A put writes a temp file next to the final one, syncs it, renames it and syncs
the directory: a crash leaves the old file, the new one, or a temp file that is
never served. Every get checks the header (format, key, lengths) and the
checksum; a file that fails is a miss, is moved to quarantine/ and is counted.

Start-up rebuilds the index (key -> length) from each file's header and length,
not its checksum: hashing every byte would cost minutes per terabyte, a torn
file already shows as a wrong length, and bit rot is caught by the first read.
``verify_on_start=True`` hashes too.

With ``sync_interval_s`` (the server's default: ``KVSTORE_NVME_SYNC_INTERVAL_S``) a put is not
synced before it returns: it is written through the page cache and renamed into place, and a
group commit (``tiers.group_commit``) syncs the file system behind it within the interval, or
at once for ``sync()`` (a durable put's check waits for it). Without it, each put is synced:

Writes use O_DIRECT from a reused page-aligned buffer: a 32 MiB write+sync took
15-18 ms that way on the reference VM, and 16-95 ms through the page cache (it
swings with other writers' dirty pages); at 1 MiB and below they cost the same. Reads
stay buffered, which measured faster (31.6 against 40 ms cold for 32 MiB). A file
system that refuses O_DIRECT (EINVAL) switches the tier to buffered writes.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator

from kvstore.errors import InvalidInput, StoreClosed, TierFull, TierIOError, TierUnavailable
from kvstore.keys import BlockHash, check_key
from kvstore.tier import Buffer, FrameWriter, Tier, TierCounters, TierStats, writable_bytes
from tiers.nvme_file import (
    check_size,
    fill_staged,
    DATA_OFFSET,
    FORMAT,
    NO_SPACE,
    Corrupt,
    staging_pool,
    byte_view,
    file_header,
    fsync_dir,
    load,
    read_prefix,
    unlink_quietly,
    write_all,
    write_direct,
)
from tiers.group_commit import GroupCommit
from tiers.nvme_spares import Spares

__all__ = ["NVMeTier", "FORMAT"]

_SUFFIX, _TMP_SUFFIX = ".safetensors", ".tmp"
_NAME = re.compile(r"^([0-9a-f]{64})\.safetensors$")
_FANOUT = tuple(f"{i:02x}" for i in range(256))


class NVMeTier(Tier):
    """A durable tier of files on a local file system, bounded by ``capacity_bytes`` of frames.

    ``shared`` is False: other processes could read the files, but what is
    stored and the capacity accounting live in this process's index, and the
    data directory is locked to one tier at a time.
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
        direct_io: bool = True,
        verify_on_start: bool = False,
        spare_files: int = 64,
        sync_interval_s: float = 0.0,
    ) -> None:
        """Open (or create) ``data_dir`` and rebuild the index from its files.

        Args:
            data_dir: the directory that holds the tier's files; created if missing.
            capacity_bytes: budget of frame bytes (headers and file-system overhead excluded).
                Files found at start count even beyond it; puts then raise TierFull.
            name: the tier's name in the store.
            fsync: sync files and directories before a put returns. Without it
                the tier is not durable (``durable`` is False).
            direct_io: write with ``O_DIRECT`` (falls back when the file system refuses).
            verify_on_start: hash every file during the start-up scan, not only its header.
            spare_files: how many replaced or deleted files to keep for reuse (0: none).
            sync_interval_s: > 0: group commit (puts return unsynced, synced within this many
                seconds or by ``sync()``); 0: each put is synced before it returns.

        Raises:
            InvalidInput: capacity_bytes is not a positive int.
            TierUnavailable: another tier holds the directory.
            TierIOError: the directory cannot be created, locked or scanned.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInput(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.durable = fsync
        self.data_dir = os.path.abspath(os.fspath(data_dir))
        self._fsync = fsync
        self._sync_each = fsync and not sync_interval_s > 0
        self.overwrite_keeps_durable = self._sync_each or not fsync  # no promise to keep, without fsync
        """Sync every write before the put returns (else a group commit covers it, or none: not durable)."""
        self._direct = direct_io and self._sync_each and hasattr(os, "O_DIRECT")
        self._direct_note = "on" if self._direct else "off"
        self._verify_on_start = verify_on_start
        self._index: dict[bytes, int] = {}  # key -> frame length
        self._used = 0
        self._pending = 0  # bytes reserved by puts still writing
        self._counters = TierCounters()
        self._quarantined = {"temp": 0, "corrupt": 0, "missing": 0}
        self._pool = staging_pool()
        self._tmp_ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._qdir = os.path.join(self.data_dir, "quarantine")
        self._rdir = os.path.join(self.data_dir, ".recycle")
        self._spares = Spares(self._rdir, spare_files)
        self._lock_fd = self._lock_dir()
        try:
            started = time.perf_counter()
            self._spares.empty()
            self._scan()
            self._scan_ms = (time.perf_counter() - started) * 1e3
            self._group = GroupCommit(self.data_dir, sync_interval_s, self._sync_failed) \
                if fsync and not self._sync_each else None
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- the contract -----------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer) -> None:
        """Store ``frame`` durably under ``key`` (see ``Tier.put``).

        Raises:
            InvalidKey: ``key`` is not 32 bytes. InvalidInput: ``frame`` is not bytes-like.
            TierFull: over capacity, or the file system is out of space; nothing changed.
            TierIOError: the OS reported an I/O error; no partial file is ever served.
            StoreClosed: the tier is closed.
        """
        key = check_key(key)
        view = byte_view(frame)
        with self._reserving(key, len(view)):
            if not self._direct:  # buffered: write straight from the caller's memory
                self._persist(key, view, None)
                return
            # O_DIRECT needs page-aligned memory: one copy into this thread's staging buffer
            staged = memoryview(self._pool.get(DATA_OFFSET + len(view)))
            staged[DATA_OFFSET : DATA_OFFSET + len(view)] = view
            self._persist(key, staged[DATA_OFFSET : DATA_OFFSET + len(view)], staged)

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        """Let ``writer`` fill the staging buffer in place, then store it (no copy).

        Returns:
            The stored frame's length.

        Raises:
            As ``put``; InvalidInput when ``writer`` reports more than ``size`` bytes.
        """
        key = check_key(key)
        check_size(size)
        with self._reserving(key, size):  # refuse early: do not encode a frame that cannot fit
            staged, n = fill_staged(self._pool, DATA_OFFSET, size, writer)
            self._persist(key, staged[DATA_OFFSET : DATA_OFFSET + n], staged)
        return n

    def get(self, key: BlockHash) -> Buffer | None:
        """The frame under ``key`` as a new bytearray, or None when absent or failing its checks.

        Raises:
            TierIOError: the OS reported an I/O error while reading.
            StoreClosed: the tier is closed.
        """
        return self._read(check_key(key), None)

    def head(self, key: BlockHash, nbytes: int) -> tuple[Buffer, int] | None:
        """The frame's first ``nbytes`` and its length, reading only those (no checksum: see ``Tier.head``)."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            if key not in self._index:
                return None
        path = self._path(key.hex())
        try:
            return read_prefix(path, key.hex(), nbytes)
        except FileNotFoundError:
            return None
        except Corrupt as bad:
            self._miss(key, path, bad)
            return None
        except OSError as exc:
            raise TierIOError(f"tier {self.name!r}: reading {path} failed: {exc}", tier=self.name) from exc

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        """Read the frame straight into ``out`` (verified there); its length, or None when absent."""
        got = self._read(check_key(key), writable_bytes(out))
        return None if got is None else len(got)

    def _read(self, key: bytes, out: memoryview | None) -> Buffer | None:
        with self._lock:
            self._check_open()
            self._counters.gets += 1
            if key not in self._index:
                self._counters.misses += 1
                return None
        path = self._path(key.hex())
        try:
            _, data = load(path, key.hex(), body=True, out=out)
        except FileNotFoundError:  # deleted meanwhile (by us: a miss; by someone else: drop it)
            self._miss(key, path, None)
            return None
        except Corrupt as bad:
            self._miss(key, path, bad)
            return None
        except OSError as exc:
            with self._lock:
                self._counters.errors += 1
            raise TierIOError(f"tier {self.name!r}: reading {path} failed: {exc}", tier=self.name) from exc
        with self._lock:
            self._counters.hits += 1
        return data

    def delete(self, key: BlockHash) -> bool:
        """Remove ``key``'s file; True when something was removed.

        Raises:
            TierIOError: the OS refused to unlink the file. StoreClosed: the tier is closed.
        """
        key = check_key(key)
        path = self._path(key.hex())
        with self._lock:
            self._check_open()
            if key not in self._index:
                return False
            try:
                if not self._spares.keep(path, link=False):
                    os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._counters.errors += 1
                raise TierIOError(f"tier {self.name!r}: deleting {path} failed: {exc}", tier=self.name) from exc
            self._used -= self._index.pop(key)
            self._counters.deletes += 1
        self._sync_dir(os.path.dirname(path))
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
            return TierStats(
                name=self.name,
                kind="nvme",
                entries=len(self._index),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                durable=self.durable,
                shared=self.shared,
                counters=replace(self._counters),
                details={
                    "backing": f"files under {self.data_dir}",
                    "layout": "ab/<key hex>.safetensors",
                    "direct_io": self._direct_note,
                    "fsync": ("off (not durable)" if not self._fsync else "each put" if self._group is None
                              else f"group commit every {self._group.interval_s:g} s ({self._group.syncs} syncs)"),
                    "startup_scan": "full checksums" if self._verify_on_start else "headers and lengths",
                    "startup_scan_ms": f"{self._scan_ms:.1f}",
                    "quarantined_temp_files": str(self._quarantined["temp"]),
                    "quarantined_corrupt_files": str(self._quarantined["corrupt"]),
                    "missing_files": str(self._quarantined["missing"]),
                    "spare_files": str(self._spares.count),
                    "spare_files_reused": str(self._spares.reused),
                },
            )

    def sync(self) -> None:
        """Return once every put acknowledged so far is synced (a group commit; at once without one).

        Raises:
            TierIOError: the sync failed (the writes stay stored, not yet durable).
        """
        if self._group is not None:
            try:
                self._group.sync()
            except OSError as exc:
                raise TierIOError(f"tier {self.name!r}: syncing its writes failed: {exc}", tier=self.name) from exc

    def _sync_failed(self, exc: OSError) -> None:
        with self._lock:
            self._counters.errors += 1

    def close(self) -> None:
        """Sync, forget the index and release the directory lock. Idempotent; files stay on disk."""
        if self._group is not None:
            self._group.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._used = 0
            self._pool = staging_pool()  # drop this thread's staging buffer
            os.close(self._lock_fd)

    # -- writing ----------------------------------------------------------------

    @contextmanager
    def _reserving(self, key: bytes, size: int) -> Iterator[None]:
        """Hold ``size`` bytes of capacity while a put writes outside the lock."""
        with self._lock:
            self._check_open()
            self._check_fits(key, size, self._pending)
            self._pending += size
        try:
            yield
        finally:
            with self._lock:
                self._pending -= size

    def _check_fits(self, key: bytes, size: int, reserved: int) -> None:
        """TierFull unless ``key`` can hold ``size`` bytes next to ``reserved`` in-flight ones. Lock held."""
        if self._used - self._index.get(key, 0) + reserved + size > self.capacity_bytes:
            self._counters.errors += 1
            raise TierFull(
                f"tier {self.name!r}: a {size}-byte frame does not fit "
                f"({self._used} of {self.capacity_bytes} bytes used, {reserved} reserved)",
                tier=self.name,
            )

    def _persist(self, key: bytes, frame: memoryview, staged: memoryview | None) -> None:
        """Write ``frame`` to a temp file, then publish it under the key's name."""
        key_hex = key.hex()
        header = file_header(key_hex, frame)
        leaf = os.path.dirname(self._path(key_hex))
        tmp = self._spares.rewrite(header, frame, sync=self._sync_each)
        if tmp is None:
            tmp = os.path.join(leaf, f".{key_hex}.{os.getpid()}.{next(self._tmp_ids)}{_TMP_SUFFIX}")
            try:
                self._write_temp(tmp, header, frame, staged)
            except OSError as exc:
                raise self._os_error(exc, f"writing {tmp}") from exc
        try:
            with self._lock:  # rename and index change together: the index always matches the names
                try:
                    self._check_open()
                    self._check_fits(key, len(frame), 0)  # the index may have moved while we wrote
                    final = self._path(key_hex)
                    spare = self._spares.keep(final, link=True) if key in self._index else None
                    try:
                        os.replace(tmp, final)  # the old file lives on as the spare
                    except BaseException:
                        if spare is not None:  # it is still the live file: never rewrite it in place
                            self._spares.drop(spare)
                        raise
                except BaseException:
                    unlink_quietly(tmp)
                    raise
                self._used += len(frame) - self._index.get(key, 0)
                self._index[key] = len(frame)
                self._counters.puts += 1
                if self._group is not None:
                    self._group.wrote()
        except OSError as exc:
            raise self._os_error(exc, f"renaming {tmp}") from exc
        # The new file is published and complete; a failure here only means its
        # name may not survive a power cut, so the index keeps it and we say so.
        self._sync_dir(leaf)

    def _write_temp(self, tmp: str, header: bytes, frame: memoryview, staged: memoryview | None) -> None:
        """Create ``tmp`` holding header + frame, synced; removed again on any failure."""
        direct = self._direct and staged is not None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        fd = -1
        try:
            fd = os.open(tmp, flags, 0o644)
            if direct:
                write_direct(fd, header, len(frame), staged)  # type: ignore[arg-type]
            else:
                write_all(fd, [memoryview(header), frame])
            if self._sync_each:
                os.fdatasync(fd)  # data and length; the name is synced with the directory
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
                fd = -1
            unlink_quietly(tmp)
            if direct and exc.errno == errno.EINVAL:  # the file system refuses O_DIRECT
                self._direct, self._direct_note = False, f"off (refused by the file system: {exc.strerror})"
                self._write_temp(tmp, header, frame, None)
                return
            raise
        finally:
            if fd >= 0:
                os.close(fd)

    def _sync_dir(self, path: str) -> None:
        if not self._sync_each:
            return
        try:
            fsync_dir(path)
        except OSError as exc:
            with self._lock:
                self._counters.errors += 1
            raise TierIOError(f"tier {self.name!r}: syncing {path} failed: {exc}", tier=self.name) from exc

    def _os_error(self, exc: OSError, what: str) -> TierFull | TierIOError:
        """Translate an OS failure: out of space is TierFull, anything else TierIOError."""
        with self._lock:
            self._counters.errors += 1
        cls = TierFull if exc.errno in NO_SPACE else TierIOError
        return cls(f"tier {self.name!r}: {what} failed: {exc}", tier=self.name)

    # -- reading, scanning, quarantine ------------------------------------------

    def _miss(self, key: bytes, path: str, bad: Corrupt | None) -> None:
        """Count a miss for a key the index had; quarantine or forget its file."""
        with self._lock:
            self._counters.misses += 1
            if key not in self._index:
                return  # deleted meanwhile
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self._quarantined["missing"] += 1  # removed behind our back
                self._used -= self._index.pop(key)
                return
            except OSError:
                return
            if bad is not None and bad.ident == (st.st_dev, st.st_ino):  # not a newer file
                self._used -= self._index.pop(key)
                self._quarantine(path, "corrupt")

    def _scan(self) -> None:
        """Rebuild the index from the tree; quarantine temp files and files that fail checks."""
        for leaf, name in self._walk():
            path = os.path.join(leaf, name)
            if name.endswith(_TMP_SUFFIX):
                self._quarantine(path, "temp")
                continue
            match = _NAME.match(name)
            if match is None:
                continue  # not ours: left alone
            key_hex = match.group(1)
            try:
                if self._path(key_hex) != path:
                    raise Corrupt("file is in the wrong directory for its key")
                header, _ = load(path, key_hex, body=self._verify_on_start)
            except Corrupt:
                self._quarantine(path, "corrupt")
                continue
            except OSError as exc:
                raise TierIOError(f"tier {self.name!r}: scanning {path} failed: {exc}", tier=self.name) from exc
            self._index[bytes.fromhex(key_hex)] = header.frame_len
            self._used += header.frame_len

    def _walk(self) -> Iterator[tuple[str, str]]:
        """Yield (fan-out dir, file name) for every file in the fan-out."""
        for leaf in _FANOUT:
            with os.scandir(os.path.join(self.data_dir, leaf)) as it:
                names = [e.name for e in it if e.is_file(follow_symlinks=False)]
            for name in names:
                yield os.path.join(self.data_dir, leaf), name

    def _quarantine(self, path: str, reason: str) -> None:
        """Move ``path`` out of the tree so it is never served; count it."""
        self._quarantined[reason] += 1
        dest = os.path.join(self._qdir, f"{time.time_ns()}-{next(self._tmp_ids)}-{reason}-{os.path.basename(path)}")
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            pass
        except OSError:
            unlink_quietly(path)  # cannot move it: removing it still keeps it from being served

    def _lock_dir(self) -> int:
        """Take the directory's lock (one index per directory), then make the tree."""
        fd = -1
        try:
            os.makedirs(self.data_dir, exist_ok=True)
            fd = os.open(os.path.join(self.data_dir, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            missing = [d for d in (*_FANOUT, "quarantine", ".recycle")
                       if not os.path.isdir(os.path.join(self.data_dir, d))]
            for d in missing:
                os.makedirs(os.path.join(self.data_dir, d), exist_ok=True)
            if missing and self._fsync:  # the new names must be durable before a file in them is
                fsync_dir(self.data_dir)
            return fd
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise TierUnavailable(f"tier {self.name!r}: {self.data_dir} is in use by another tier "
                                      "(its index lives there)", tier=self.name) from exc
            raise TierIOError(f"tier {self.name!r}: cannot open {self.data_dir}: {exc}", tier=self.name) from exc

    def _path(self, key_hex: str) -> str:
        return os.path.join(self.data_dir, key_hex[:2], key_hex + _SUFFIX)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"tier {self.name!r} is closed")


# -- file format ---------------------------------------------------------------
