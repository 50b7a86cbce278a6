"""Pinned host shared memory: one POSIX arena that co-located processes read.

The arena is a single ``/dev/shm`` file, sized once, preallocated and mapped
with ``MAP_POPULATE``. A segment per put would cost a create, a truncate and
fresh page faults every time: about 1 GB/s here, against 13 GB/s for copying
into an arena that already exists (``../shared/BASELINES.md``).

File layout (all integers little-endian u64, offsets from the file start)::

    0        header: magic, version, owner pid and start time, table and data geometry
    4096     slot table: max_entries rows of 64 bytes: gen, offset, length, key[32], pad
    data_at  the data region that ``SlabAllocator`` carves (``ArenaTier``)

Readers in other processes (``ShmReader``) never take the writer's lock. They
use the slot's generation as a seqlock: a published slot has an even ``gen``;
the owner makes it odd before the slot's bytes may change and publishes a new
even value when a frame is in place, so a generation is never reused. A reader
copies only while ``gen`` equals its handle's before and after the copy, so it
gets the frame or a miss, never torn bytes. This relies on x86-64's ordered
stores and loads (TSO); a weakly ordered CPU would need fences here.

For a zero-copy view a reader takes a *read lease*: an open-file-description
lock (``F_OFD_SETLK``, shared) on the slot's table row. The owner tests for that
lock before it frees or moves a range, and keeps leased ranges retired until
the lease goes. The kernel drops the lock when the reader dies, so a crashed
reader cannot pin memory forever.

No segment outlives its store: ``close`` unlinks it, a finalizer does at
interpreter exit, and after ``kill -9`` the next ``ShmTier`` to start removes
segments whose owner (pid and start time, from the header) is gone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kvstore.errors import InvalidInput, TierFull, TierIOError, TierUnavailable
from kvstore.keys import BlockHash, check_key
from kvstore.pool import Move
from kvstore.tier import Buffer, FrameWriter
from tiers.arena import ArenaTier, Slot

__all__ = ["ShmTier", "ShmReader", "SlotHandle", "cleanup_stale", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_MAGIC = b"KVSHMv01"
_HEADER = struct.Struct("<8sQQQQQQ")  # magic, version, pid, start ticks, rows, data_at, data_bytes
_TABLE_AT = 4096
_ROW = 64
_ROW_WORDS = _ROW // 8
_GEN, _OFF, _LEN, _KEY = 0, 1, 2, 3  # word indexes in a row; the key fills words 3..6
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FLOCK = struct.Struct("hhxxxxqqi4x")  # struct flock on x86-64 Linux: type, whence, start, len, pid


@dataclass(frozen=True, slots=True)
class SlotHandle:
    """What a reader in another process needs to copy one frame out."""

    segment: str
    index: int
    offset: int
    """From the start of the data region."""
    length: int
    gen: int

    def to_dict(self) -> dict[str, int | str]:
        return {"segment": self.segment, "index": self.index, "offset": self.offset,
                "length": self.length, "gen": self.gen}

    @classmethod
    def from_dict(cls, data: dict) -> "SlotHandle":
        try:
            fields = {k: data[k] for k in ("segment", "index", "offset", "length", "gen")}
        except (KeyError, TypeError) as exc:
            raise InvalidInput(f"a slot handle needs segment, index, offset, length and gen: {exc}") from exc
        for k in ("index", "offset", "length", "gen"):
            if isinstance(fields[k], bool) or not isinstance(fields[k], int) or fields[k] < 0:
                raise InvalidInput(f"slot handle field {k!r} must be a non-negative int, got {fields[k]!r}")
        if not isinstance(fields["segment"], str):
            raise InvalidInput("slot handle field 'segment' must be a string")
        return cls(**fields)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone.

    pid alone is not an identity: pids are reused, start times are not.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, counted after "(comm)"


def _lock_row(fd: int, kind: int, index: int, *, test: bool = False) -> bool:
    """Set (or, with ``test``, probe) an OFD lock on slot table row ``index``.

    Returns:
        For a probe, whether a conflicting lock exists; otherwise True.
    """
    arg = _FLOCK.pack(kind, os.SEEK_SET, _TABLE_AT + index * _ROW, _ROW, 0)
    if test:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
    return True


def cleanup_stale(prefix: str = "kvstore", shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink arenas named ``<prefix>.<tier>.<pid>.<nonce>`` whose owner is gone.

    Returns:
        The names removed.
    """
    pattern = re.compile(rf"{re.escape(prefix)}\.[A-Za-z0-9_-]+\.(\d+)\.[0-9a-f]{{8}}")
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if not match:
            continue
        path = os.path.join(shm_dir, name)
        pid = int(match.group(1))
        try:
            with open(path, "rb") as f:
                raw = f.read(_HEADER.size)
        except OSError:
            continue
        owner_ticks = _HEADER.unpack(raw)[3] if len(raw) == _HEADER.size and raw[:8] == _MAGIC else None
        ticks = _start_ticks(pid)
        if ticks is None or (owner_ticks is not None and ticks != owner_ticks):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(name)
    return removed


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _pin_with_cuda(address: int, size: int) -> bool:
    """Page-lock the arena for DMA when CUDA is present (``cudaHostRegister``)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        return int(torch.cuda.cudart().cudaHostRegister(address, size, 0)) == 0
    except Exception:  # pinning is an optimisation; an arena that is not pinned still works
        return False


class ShmTier(ArenaTier):
    """Frames in one named shared-memory arena that ``ShmReader`` can attach to.

    Args:
        capacity_bytes: frame bytes the tier admits.
        name: tier name, also part of the segment name.
        max_entries: slot table rows (default: one per 4 KiB of capacity).
        prefix: segment name prefix; ``cleanup_stale`` looks for it.
        shm_dir: where POSIX shared memory lives.

    Raises:
        TierFull: ``/dev/shm`` cannot hold the arena.
        TierIOError: the segment cannot be created.
    """

    kind = "shm"
    durable = False
    shared = True

    def __init__(self, capacity_bytes: int, *, name: str = "shm", max_entries: int | None = None,
                 prefix: str = "kvstore", shm_dir: str = SHM_DIR) -> None:
        super().__init__(capacity_bytes, name=name, max_entries=max_entries)
        if not _NAME.fullmatch(name) or not _NAME.fullmatch(prefix):
            raise InvalidInput(f"shm tier name and prefix must match {_NAME.pattern}, got {name!r}, {prefix!r}")
        self.stale_removed = cleanup_stale(prefix, shm_dir)
        self.segment = f"{prefix}.{name}.{os.getpid()}.{secrets.token_hex(4)}"
        self.path = os.path.join(shm_dir, self.segment)
        data_at = -(-(_TABLE_AT + self.max_entries * _ROW) // 4096) * 4096
        self._map, self._fd = self._create(data_at + self.arena_bytes)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        self._rows = np.frombuffer(self._map, np.uint64, self.max_entries * _ROW_WORDS, _TABLE_AT)
        self._rows = self._rows.reshape(self.max_entries, _ROW_WORDS)
        self._rows[:, _GEN] = 1  # odd: empty
        # Scalar access through a memoryview: a numpy element read or write costs ~1 us, this ~0.1.
        self._words = memoryview(self._map)[_TABLE_AT:_TABLE_AT + self.max_entries * _ROW].cast("Q")
        self._table = memoryview(self._map)[_TABLE_AT:_TABLE_AT + self.max_entries * _ROW]
        self._data = np.frombuffer(self._map, np.uint8, self.arena_bytes, data_at)
        self._view = memoryview(self._data)
        self._map[:_HEADER.size] = _HEADER.pack(_MAGIC, 1, os.getpid(), _start_ticks(os.getpid()) or 0,
                                                self.max_entries, data_at, self.arena_bytes)
        self.pinned = _pin_with_cuda(self._data.ctypes.data, self.arena_bytes)

    def _create(self, size: int) -> tuple[mmap.mmap, int]:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TierIOError(f"tier {self.name!r}: cannot create {self.path}: {exc}", tier=self.name) from exc
        try:
            os.posix_fallocate(fd, 0, size)  # reserve tmpfs pages now: ENOSPC here, not as SIGBUS later
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), fd
        except OSError as exc:
            os.close(fd)
            _unlink_quietly(self.path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise TierFull(f"tier {self.name!r}: {self.path} cannot hold {size} bytes: {exc}",
                               tier=self.name) from exc
            raise TierIOError(f"tier {self.name!r}: cannot map {self.path}: {exc}", tier=self.name) from exc

    # -- handles for co-located readers ------------------------------------------------

    def handle(self, key: BlockHash) -> SlotHandle | None:
        """Where ``key``'s frame is now, for an ``ShmReader``; None when absent."""
        check_key(key)
        with self._lock:
            self._check_open()
            slot = self._slots.get(key)
            if slot is None:
                return None
            gen = self._words[slot.index * _ROW_WORDS + _GEN]
            return SlotHandle(self.segment, slot.index, slot.offset, slot.length, gen)

    # -- ArenaTier hooks ---------------------------------------------------------------

    def _copy_in(self, offset: int, frame: memoryview) -> None:
        self._view[offset:offset + len(frame)] = frame

    def _copy_out(self, offset: int, length: int) -> Buffer:
        return self._view[offset:offset + length].tobytes()

    def _copy_out_into(self, offset: int, length: int, out: memoryview) -> None:
        out[:length] = self._view[offset:offset + length]

    def _fill(self, offset: int, size: int, writer: FrameWriter) -> int:
        with self._view[offset:offset + size] as view:  # the encoder writes into the arena itself
            return writer(view)

    def _move(self, moves: list[Move]) -> None:
        for m in moves:  # numpy copies overlapping ranges as if through a temporary
            self._data[m.dst:m.dst + m.size] = self._data[m.src:m.src + m.size]

    def _publish(self, key: bytes, slot: Slot) -> None:
        words, at = self._words, slot.index * _ROW_WORDS
        if words[at + _GEN] % 2 == 0:
            words[at + _GEN] += 1
        words[at + _OFF], words[at + _LEN] = slot.offset, slot.length
        self._table[slot.index * _ROW + _KEY * 8:slot.index * _ROW + _KEY * 8 + 32] = key
        words[at + _GEN] += 1  # even: readers may copy

    def _unpublish(self, slot: Slot) -> None:
        at = slot.index * _ROW_WORDS + _GEN
        if self._words[at] % 2 == 0:
            self._words[at] += 1  # odd before the bytes can change

    def _pinned_elsewhere(self, slot: Slot) -> bool:
        return _lock_row(self._fd, fcntl.F_WRLCK, slot.index, test=True)

    def _reserve(self, key: bytes, size: int) -> Slot:
        if self._retired:
            self._reclaim()  # leases held by other processes end without telling us
        return super()._reserve(key, size)

    def _details(self) -> dict[str, str]:
        return {"segment": self.path, "pinned": str(self.pinned).lower(),
                "stale_removed": str(len(self.stale_removed))}

    def _close_arena(self) -> None:
        self._finalizer()  # unlink first: the name goes even if a view keeps the mapping alive
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._data.ctypes.data)
        self._view.release()
        self._words.release()
        self._table.release()
        self._rows = self._data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps later
            self._map.close()
        os.close(self._fd)


class ShmReader:
    """Attaches to a ``ShmTier``'s arena by segment name from any process.

    Args:
        segment: ``ShmTier.segment`` (a name, not a path).
        shm_dir: where POSIX shared memory lives.

    Raises:
        TierUnavailable: no such segment, or it is not a kvstore arena.
    """

    def __init__(self, segment: str, shm_dir: str = SHM_DIR) -> None:
        if not isinstance(segment, str) or "/" in segment or segment in ("", ".", ".."):
            raise InvalidInput(f"segment must be a plain name, got {segment!r}")
        self.segment = segment
        try:
            self._fd = os.open(os.path.join(shm_dir, segment), os.O_RDONLY)
        except OSError as exc:
            raise TierUnavailable(f"shm segment {segment!r} cannot be opened: {exc}", tier="shm") from exc
        try:
            self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
            magic, _, _, _, rows, data_at, data_bytes = _HEADER.unpack(self._map[:_HEADER.size])
            if magic != _MAGIC or data_at + data_bytes > len(self._map):
                raise TierUnavailable(f"{segment!r} is not a kvstore arena", tier="shm")
        except (OSError, ValueError, struct.error) as exc:
            os.close(self._fd)
            raise TierUnavailable(f"shm segment {segment!r} cannot be mapped: {exc}", tier="shm") from exc
        self._rows = np.frombuffer(self._map, np.uint64, rows * _ROW_WORDS, _TABLE_AT).reshape(rows, _ROW_WORDS)
        self._words = memoryview(self._map)[_TABLE_AT:_TABLE_AT + rows * _ROW].cast("Q")
        self._view = memoryview(self._map)[data_at:data_at + data_bytes]
        self._leases: dict[int, int] = {}  # row -> leases held by this reader
        self._lock = threading.Lock()

    def find(self, key: BlockHash) -> SlotHandle | None:
        """Scan the slot table for ``key``; the owner's ``handle`` is faster."""
        want = np.frombuffer(check_key(key), np.uint64)
        rows = np.flatnonzero((self._rows[:, _KEY:_KEY + 4] == want).all(axis=1))
        for index in rows:
            gen, off, length = (int(v) for v in self._rows[index, :3])
            if gen % 2 == 0 and np.array_equal(self._rows[index, _KEY:_KEY + 4], want):
                return SlotHandle(self.segment, int(index), off, length, gen)
        return None

    def read(self, handle: SlotHandle, out: Buffer | None = None) -> bytes | int | None:
        """Copy the frame out: bytes, or its length when copied into ``out``; None if stale."""
        self._check(handle)
        gen_at = handle.index * _ROW_WORDS + _GEN
        if self._words[gen_at] != handle.gen:
            return None
        src = self._view[handle.offset:handle.offset + handle.length]
        if out is None:
            data = src.tobytes()
        else:
            dst = memoryview(out).cast("B")
            if len(dst) < handle.length:
                raise InvalidInput(f"out holds {len(dst)} bytes, the frame needs {handle.length}")
            dst[:handle.length] = src
            data = handle.length
        # The owner makes gen odd before the bytes may change, so an unchanged gen means an untorn copy.
        return data if self._words[gen_at] == handle.gen else None

    @contextlib.contextmanager
    def lease(self, handle: SlotHandle) -> Iterator[memoryview | None]:
        """A read-only view of the frame that stays valid inside the block; None if stale."""
        self._check(handle)
        with self._lock:
            if not self._leases.get(handle.index):
                _lock_row(self._fd, fcntl.F_RDLCK, handle.index)
            self._leases[handle.index] = self._leases.get(handle.index, 0) + 1
        try:
            # Checked after the lock: from here on the owner sees the lease before reusing the range.
            valid = self._words[handle.index * _ROW_WORDS + _GEN] == handle.gen
            with self._view[handle.offset:handle.offset + handle.length] as view:
                yield view if valid else None
        finally:
            with self._lock:
                self._leases[handle.index] -= 1
                if not self._leases[handle.index]:
                    del self._leases[handle.index]
                    _lock_row(self._fd, fcntl.F_UNLCK, handle.index)

    def _check(self, handle: SlotHandle) -> None:
        if handle.segment != self.segment:
            raise InvalidInput(f"handle is for segment {handle.segment!r}, this reader is {self.segment!r}")
        if handle.index >= len(self._rows) or handle.offset + handle.length > len(self._view):
            raise InvalidInput(f"handle {handle} lies outside the arena")

    def close(self) -> None:
        """Drop the mapping; leases still held are released by the kernel."""
        self._view.release()
        self._words.release()
        self._rows = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)

    def __enter__(self) -> "ShmReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
