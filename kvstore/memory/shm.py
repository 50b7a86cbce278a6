"""The shm arena's layout and its reader: what a co-located client needs.

``tiers/shm.py`` owns and writes the arena; this module holds the file layout
they share and ``ShmReader``, which attaches to an arena by name from any
process. It lives in ``kvstore`` so that ``client_sdk`` can read frames
straight out of a co-located server's memory without importing the tiers.

File layout (all integers little-endian, offsets from the file start)::

    0         header (u64s): magic, version, owner pid and start time, table and data
              geometry, the key index's place and size
    4096      slot table: rows of 64 bytes (u64s): gen, offset, length, key[32], verified gen
    index_at  key index: ``buckets`` u32s, each 0 (empty) or a slot row + 1
    data_at   the data region

The key index is an open-addressing hash table (linear probing) from a block key to
its slot row: a co-located reader finds a key's frame with no request to the server
(``ShmReader.look_up``). Only the owner writes it, under its lock; a reader trusts an
entry only after the row it names shows the key under an even generation that is the
same before and after it read the row, so a bucket that changes under it costs a miss
(the reader then asks the server), never another key's frame. Removal shifts later
entries back (no tombstones), so the table never needs a rebuild.

A slot's last word holds the generation at which the owner verified its frame's body
against its checksum: a reader may skip hashing a frame whose word equals the
generation it reads under (``docs/design.md``, "Verification").

A published slot has an even ``gen``; the owner makes it odd before the slot's
bytes may change and publishes a new even value when a frame is in place. A
reader copies only while ``gen`` equals its handle's before and after the
copy (a seqlock), so it gets the frame or a miss, never torn bytes. This relies
on x86-64's ordered stores and loads (TSO); a weakly ordered CPU would need
fences. A read lease is a shared open-file-description lock on the slot's row,
which the owner tests before it frees or moves the range.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import select
import struct
import threading
import time
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from kvstore.errors import InvalidInput, TierUnavailable
from kvstore.keys import BlockHash, check_key
from kvstore.memory import halves
from kvstore.tier import Buffer

__all__ = [
    "ShmReader", "SlotHandle", "SHM_DIR", "lock_row", "MAGIC", "HEADER", "TABLE_AT", "ROW", "ROW_WORDS",
    "GEN", "OFF", "LEN", "KEY", "VER", "start_ticks", "ShmSlotWriter", "key_home", "IndexHit", "MAX_PROBES",
]

SHM_DIR = "/dev/shm"
MAGIC = b"KVSHMv01"
HEADER = struct.Struct("<8sQQQQQQQQ")  # magic, version, pid, start ticks, rows, data_at, data_bytes,
#                                        index_at, buckets (0, 0 in a version-1 arena: no key index)
VERSION = 2
TABLE_AT = 4096
ROW = 64
ROW_WORDS = ROW // 8
GEN, OFF, LEN, KEY, VER = 0, 1, 2, 3, 7  # word indexes in a row; the key fills words 3..6
SMALL_LOOKUP = 48
"""Up to this many keys, ``look_up`` probes one key at a time with scalar loads: numpy's gathers
cost more than they save (a 2-core VM: 16 keys 17 against 32 us, 32 keys 34 against 42; 64 keys
70 against 61)."""
_KEY_WORDS = struct.Struct("<4Q")
MAX_PROBES = 64
"""Buckets a reader probes for one key before it gives up and asks the server. At a load factor
of at most one half (two buckets per slot row), a probe run this long is vanishingly rare."""


def key_home(key: bytes, mask: int) -> int:
    """The bucket a key's probe starts at: its first 8 bytes (a cryptographic hash: uniform)."""
    return int.from_bytes(key[:8], "little") & mask


class IndexHit(NamedTuple):
    """A key's frame as the shared key index shows it: where it is and whether it is verified.

    A tuple, its handle built when asked for: a get of many small blocks builds one a block (a
    frozen dataclass and its handle took 1 us each, a tuple 0.1)."""

    segment: str
    index: int
    offset: int
    length: int
    gen: int
    verified: bool
    """The owner hashed this publication's body and it matched (the reader need not)."""

    @property
    def handle(self) -> "SlotHandle":
        return SlotHandle(self.segment, self.index, self.offset, self.length, self.gen)


_new_hit = tuple.__new__
"""``IndexHit``'s constructor without its Python-level ``__new__`` (0.4 us a hit, a look-up's
largest part): ``_new_hit(IndexHit, fields)`` for the six fields in order."""

FLOCK = struct.Struct("hhxxxxqqi4x")  # struct flock on x86-64 Linux: type, whence, start, len, pid


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone.

    pid alone is not an identity: pids are reused, start times are not.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, counted after "(comm)"



def _open_arena(segment: str, shm_dir: str, *, writable: bool) -> tuple[int, mmap.mmap, int, int, int, int, int]:
    """Open and map a ``ShmTier``'s segment by name: (fd, mapping, rows, data_at, data_bytes,
    index_at, buckets); the last two are 0 in an arena with no key index.

    Raises:
        InvalidInput: not a plain name. TierUnavailable: no such segment, or not a kvstore arena.
    """
    if not isinstance(segment, str) or "/" in segment or segment in ("", ".", ".."):
        raise InvalidInput(f"segment must be a plain name, got {segment!r}")
    try:
        fd = os.open(os.path.join(shm_dir, segment), os.O_RDWR if writable else os.O_RDONLY)
    except OSError as exc:
        raise TierUnavailable(f"shm segment {segment!r} cannot be opened: {exc}", tier="shm") from exc
    try:
        if writable:
            mapping = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        else:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        magic, version, _, _, rows, data_at, data_bytes, index_at, buckets = HEADER.unpack(mapping[:HEADER.size])
        if magic != MAGIC or data_at + data_bytes > len(mapping):
            raise TierUnavailable(f"{segment!r} is not a kvstore arena", tier="shm")
        if version < 2 or buckets & (buckets - 1) or index_at + 4 * buckets > data_at:
            index_at = buckets = 0  # an older arena, or an index that does not fit: look keys up by request
    except (OSError, ValueError, struct.error) as exc:
        os.close(fd)
        raise TierUnavailable(f"shm segment {segment!r} cannot be mapped: {exc}", tier="shm") from exc
    return fd, mapping, rows, data_at, data_bytes, index_at, buckets


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+; older kernels answer EINVAL
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate_behind(mapping: mmap.mmap, start: int, length: int, *, write: bool) -> threading.Thread:
    """Fault in this process's page tables for ``mapping[start:start + length]`` on a thread.

    The server maps its arena populated; a client's own mapping of it starts empty, and each
    4 KiB page it first touches is a minor fault: 32 MiB of puts into pool slots paid 8,192
    of them (29 ms against 22 ms once populated, 128 frames of 256 KiB by key). One
    ``madvise(MADV_POPULATE_*)`` over the range does them in the kernel in one pass, off the
    caller's path (the call drops the GIL); a page touched before it gets there faults as
    before. Nothing is allocated: the pages are the server's. Where the kernel lacks the
    advice, nothing happens. Used for a writer's mapping only: a reader's populate of a
    whole arena (1 GiB: tens of ms of kernel work) slowed a fresh client's first get that
    ran beside it (13.6 to 46.9 ms), and a reader touches far fewer pages than it maps.
    """
    def run() -> None:
        try:
            base = np.frombuffer(mapping, np.uint8, length, start)  # an export: the mapping stays while it runs
        except (ValueError, BufferError):  # closed already
            return
        try:
            _LIBC.madvise(base.ctypes.data & ~(mmap.PAGESIZE - 1),
                          length + (base.ctypes.data & (mmap.PAGESIZE - 1)),
                          _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
        finally:
            del base
    thread = threading.Thread(target=run, name="kvstore-shm-populate", daemon=True)
    thread.start()
    return thread


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


def lock_row(fd: int, kind: int, index: int, *, test: bool = False) -> bool:
    """Set (or, with ``test``, probe) an OFD lock on slot table row ``index``.

    Returns:
        For a probe, whether a conflicting lock exists; otherwise True.
    """
    arg = FLOCK.pack(kind, os.SEEK_SET, TABLE_AT + index * ROW, ROW, 0)
    if test:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
        return FLOCK.unpack(got)[0] != fcntl.F_UNLCK
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
    return True


class _OwnerWatch:
    """Whether an arena's owner process lives, asked on every index read: a pidfd polled with no
    wait (about a microsecond), where the kernel has pidfds; else its start time, read from
    ``/proc`` at most every ``RECHECK_S``."""

    RECHECK_S = 0.05

    def __init__(self, pid: int, ticks: int) -> None:
        self._pid, self._ticks = pid, ticks
        self._poll: select.poll | None = None
        self._fd: int | None = None
        self._dead = start_ticks(pid) != ticks or ticks == 0  # gone, or its pid reused already
        self._checked = time.monotonic()
        if not self._dead:
            try:
                self._fd = os.pidfd_open(pid)
                self._poll = select.poll()
                self._poll.register(self._fd, select.POLLIN)
            except (AttributeError, OSError):  # no pidfds here: the /proc check
                self._fd = None
            if start_ticks(pid) != ticks:  # the pid's owner exited before the pidfd was opened
                self._dead = True

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._poll is not None:
            self._dead = bool(self._poll.poll(0))  # a pidfd turns readable when its process exits
        elif time.monotonic() - self._checked >= self.RECHECK_S:
            self._checked = time.monotonic()
            self._dead = start_ticks(self._pid) != self._ticks
        return not self._dead

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._poll = None


class ShmReader:
    """Attaches to a ``ShmTier``'s arena by segment name from any process.

    Args:
        segment: ``ShmTier.segment`` (a name, not a path).
        shm_dir: where POSIX shared memory lives.

    Raises:
        TierUnavailable: no such segment, or it is not a kvstore arena.
    """

    def __init__(self, segment: str, shm_dir: str = SHM_DIR) -> None:
        self.segment = segment
        self._fd, self._map, rows, data_at, data_bytes, index_at, buckets = _open_arena(segment, shm_dir,
                                                                                       writable=False)
        _, _, self.owner_pid, self.owner_ticks = HEADER.unpack(self._map[:HEADER.size])[:4]
        self._owner = _OwnerWatch(self.owner_pid, self.owner_ticks)
        self._rows = np.frombuffer(self._map, np.uint64, rows * ROW_WORDS, TABLE_AT).reshape(rows, ROW_WORDS)
        self._buckets = np.frombuffer(self._map, np.uint32, buckets, index_at) if buckets else None
        self._bucket_words = memoryview(self._map)[index_at:index_at + 4 * buckets].cast("I") if buckets else None
        self.indexed = buckets > 0
        """The arena publishes a key index (``look_up`` answers); else every key is asked of the server."""
        self._words = memoryview(self._map)[TABLE_AT:TABLE_AT + rows * ROW].cast("Q")
        self._view = memoryview(self._map)[data_at:data_at + data_bytes]
        self._leases: dict[int, int] = {}  # row -> leases held by this reader
        self._lock = threading.Lock()

    def find(self, key: BlockHash) -> SlotHandle | None:
        """Scan the slot table for ``key``; the owner's ``handle`` is faster."""
        want = np.frombuffer(check_key(key), np.uint64)
        rows = np.flatnonzero((self._rows[:, KEY:KEY + 4] == want).all(axis=1))
        for index in rows:
            gen, off, length = (int(v) for v in self._rows[index, :3])
            if gen % 2 == 0 and np.array_equal(self._rows[index, KEY:KEY + 4], want):
                return SlotHandle(self.segment, int(index), off, length, gen)
        return None

    def owner_alive(self) -> bool:
        """Whether the server that owns this arena still runs. A server killed outright leaves its
        arena mapped here with every slot still published: answering from it would serve blocks
        the store no longer holds (deleted since, or never known to a restarted server)."""
        return self._owner.alive()

    def look_up(self, keys: Sequence[bytes]) -> list[IndexHit | None]:
        """Each key's frame as the shared key index shows it now, or None: not in this arena (or
        its entry changed while it was read, or the arena has no index; ask the server).

        All keys probe together, a numpy gather per probe step. A hit is a row that showed the
        key under one even generation before and after the read of its fields (the seqlock):
        the handle is that publication's; a later copy still checks the generation.
        """
        buckets = self._buckets
        n = len(keys)
        if buckets is None or not n:
            return [None] * n
        if n <= SMALL_LOOKUP:
            return self._look_up_few(keys)
        want = np.frombuffer(b"".join(keys), np.uint64).reshape(n, 4)
        mask = len(buckets) - 1
        pos = want[:, 0] & np.uint64(mask)
        todo = np.arange(n)
        rows_of = np.full(n, -1, np.int64)
        for _ in range(MAX_PROBES):
            entry = buckets[pos[todo]].astype(np.int64)
            filled = entry != 0
            row = entry - 1
            cand = todo[filled]
            crow = row[filled]
            match = (self._rows[crow, KEY:KEY + 4] == want[cand]).all(axis=1)
            rows_of[cand[match]] = crow[match]
            # an empty bucket ends a key's probe (absent); a filled one that is another key's: next bucket
            todo = cand[~match]
            if not len(todo):
                break
            pos[todo] = (pos[todo] + np.uint64(1)) & np.uint64(mask)
        found = np.flatnonzero(rows_of >= 0)
        out: list[IndexHit | None] = [None] * n
        if not len(found):
            return out
        rows = rows_of[found]
        gen0 = self._rows[rows, GEN].copy()
        fields = self._rows[rows, :].copy()  # offset, length, key and verified gen as they stand
        gen1 = self._rows[rows, GEN]
        ok = (gen0 == gen1) & (gen0 % 2 == 0) & (fields[:, GEN] == gen0)
        ok &= (fields[:, KEY:KEY + 4] == want[found]).all(axis=1)
        limit = len(self._view)
        for i, row, f, good in zip(found.tolist(), rows.tolist(), fields.tolist(), ok.tolist()):
            if good and f[OFF] + f[LEN] <= limit:
                out[i] = _new_hit(IndexHit, (self.segment, row, f[OFF], f[LEN], f[GEN], f[VER] == f[GEN]))
        return out

    def _look_up_few(self, keys: Sequence[bytes]) -> list[IndexHit | None]:
        """``look_up`` with scalar loads, a key at a time (numpy's per-call cost dominates a few keys)."""
        words, buckets, segment, limit = self._words, self._bucket_words, self.segment, len(self._view)
        mask = len(buckets) - 1
        unpack = _KEY_WORDS.unpack
        out: list[IndexHit | None] = []
        for key in keys:
            k0, k1, k2, k3 = unpack(key)
            pos = k0 & mask
            hit = None
            for _ in range(MAX_PROBES):
                entry = buckets[pos]
                if entry == 0:
                    break
                at = (entry - 1) * ROW_WORDS
                if words[at + KEY] == k0 and words[at + KEY + 1] == k1 and words[at + KEY + 2] == k2 \
                        and words[at + KEY + 3] == k3:
                    gen = words[at + GEN]
                    off, length, ver = words[at + OFF], words[at + LEN], words[at + VER]
                    same = words[at + KEY] == k0 and words[at + KEY + 3] == k3  # still this key's row
                    if not (gen % 2 or words[at + GEN] != gen or not same or off + length > limit):
                        hit = _new_hit(IndexHit, (segment, entry - 1, off, length, gen, ver == gen))
                    break  # else changing under us: ask the server
                pos = (pos + 1) & mask
            out.append(hit)
        return out

    def verified(self, handle: SlotHandle) -> bool:
        """Whether the owner verified the handle's publication (its generation stands, and is the
        one the owner verified at)."""
        at = handle.index * ROW_WORDS
        return self._words[at + VER] == handle.gen and self._words[at + GEN] == handle.gen

    def read(self, handle: SlotHandle, out: Buffer | None = None) -> bytes | int | None:
        """Copy the frame out: bytes, or its length when copied into ``out``; None if stale."""
        self._check(handle)
        gen_at = handle.index * ROW_WORDS + GEN
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

    def frame_array(self, handle: SlotHandle, start: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only numpy view of ``shape`` items at byte ``start`` of the handle's frame.

        The bytes under it belong to the owner: read them only through
        ``copy_current`` (or inside a ``lease``), which notice a reused range.

        Raises:
            InvalidInput: the handle or the range lies outside the arena or the frame.
        """
        self._check(handle)
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        if start < 0 or start + count * dtype.itemsize > handle.length:
            raise InvalidInput(f"{count} items of {dtype} at byte {start} overrun the {handle.length}-byte frame")
        return np.frombuffer(self._view, dtype, count, handle.offset + start).reshape(shape)

    def spaced_arrays(self, start: int, stride: int, count: int, dtype: np.dtype,
                      shape: tuple[int, ...]) -> np.ndarray:
        """``count`` read-only arrays of ``shape`` items as one ``[count, *shape]`` view: the first at
        data-region byte ``start``, each next ``stride`` bytes on (negative: lower). The payloads of
        a run of equally spaced frames, copied out in one ``np.copyto`` instead of one a frame.

        The bytes belong to the owner, as ``frame_array``'s do: copy them only under the seqlock
        (``holds`` of every slot before and after).

        Raises:
            InvalidInput: a count under one, a stride that is not a whole number of items, or an
                array outside the arena.
        """
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if count < 1 or stride % dtype.itemsize:
            raise InvalidInput(f"{count} arrays {stride} bytes apart of {dtype} items")
        low = start + min(0, stride * (count - 1))
        high = start + max(0, stride * (count - 1)) + nbytes
        if low < 0 or high > len(self._view):
            raise InvalidInput(f"arrays at bytes [{low}, {high}) overrun the {len(self._view)}-byte arena")
        inner = tuple(math.prod(shape[i + 1:]) * dtype.itemsize for i in range(len(shape)))
        # read-only: the mapping is
        return np.ndarray((count, *shape), dtype, self._view, start, (stride, *inner))

    def heads(self, offsets: Sequence[int], length: int) -> list[bytes]:
        """The first ``length`` bytes at each data-region offset in ``offsets`` (fewer where the
        arena ends): many frames' headers read in one call. Read as ``frame_view``'s bytes are,
        under the seqlock: the caller checks each slot's generation after (``holds``).

        Raises:
            InvalidInput: an offset outside the arena.
        """
        if offsets and (min(offsets) < 0 or max(offsets) >= len(self._view)):
            raise InvalidInput(f"frame offsets {min(offsets)}..{max(offsets)} outside the {len(self._view)}-byte arena")
        view = self._view
        return [bytes(view[at:at + length]) for at in offsets]

    def copy_current(self, index: int, gen: int, dst: np.ndarray, src: np.ndarray) -> bool:
        """Copy ``src`` (a ``frame_array`` of slot ``index``) into ``dst`` under the seqlock.

        True when the slot held generation ``gen`` before and after the copy, so
        ``dst`` holds that publication's bytes; False (``dst`` holds garbage) when
        the owner changed the slot. A copy needs no lease: the arena stays
        mapped, and the generation check catches a range that was reused.
        """
        at = index * ROW_WORDS + GEN
        if self._words[at] != gen:
            return False
        halves.copyto(dst, src)
        return self._words[at] == gen

    def current(self, handle: SlotHandle) -> bool:
        """Whether the slot still holds the handle's generation (the seqlock's check)."""
        return self._words[handle.index * ROW_WORDS + GEN] == handle.gen

    def holds_verified(self, index: int, gen: int) -> bool:
        """``verified`` of a slot by index and generation (no handle to build: a batch's check)."""
        at = index * ROW_WORDS
        return self._words[at + VER] == gen and self._words[at + GEN] == gen

    def holds(self, index: int, gen: int) -> bool:
        """``current`` of a slot by index and generation (no handle to build: a batch's check)."""
        return self._words[index * ROW_WORDS + GEN] == gen

    def generation(self, index: int) -> int:
        """The generation word of slot ``index`` as it stands (one load from the table)."""
        return int(self._words[index * ROW_WORDS + GEN])

    def mapping(self) -> memoryview:
        """The whole data region, as mapped (the planner's probe copies out of it)."""
        return self._view

    def frame_view(self, handle: SlotHandle) -> memoryview:
        """The handle's frame range, read only under the seqlock: ``current`` before and after a
        copy out of it; between the two, the owner may have reused the range (then the copy is
        garbage and ``current`` says so)."""
        self._check(handle)
        return self._view[handle.offset:handle.offset + handle.length]

    @contextlib.contextmanager
    def lease(self, handle: SlotHandle) -> Iterator[memoryview | None]:
        """A read-only view of the frame that stays valid inside the block; None if stale."""
        self._check(handle)
        with self._lock:
            if not self._leases.get(handle.index):
                lock_row(self._fd, fcntl.F_RDLCK, handle.index)
            self._leases[handle.index] = self._leases.get(handle.index, 0) + 1
        try:
            # Checked after the lock: from here on the owner sees the lease before reusing the range.
            valid = self._words[handle.index * ROW_WORDS + GEN] == handle.gen
            with self._view[handle.offset:handle.offset + handle.length] as view:
                yield view if valid else None
        finally:
            with self._lock:
                self._leases[handle.index] -= 1
                if not self._leases[handle.index]:
                    del self._leases[handle.index]
                    lock_row(self._fd, fcntl.F_UNLCK, handle.index)

    def _check(self, handle: SlotHandle) -> None:
        if handle.segment != self.segment:
            raise InvalidInput(f"handle is for segment {handle.segment!r}, this reader is {self.segment!r}")
        if handle.index >= len(self._rows) or handle.offset + handle.length > len(self._view):
            raise InvalidInput(f"handle {handle} lies outside the arena")

    def close(self) -> None:
        """Drop the mapping; leases still held are released by the kernel."""
        with contextlib.suppress(BufferError):  # a payload view still alive: GC unmaps later
            self._view.release()
        self._words.release()
        if self._bucket_words is not None:
            self._bucket_words.release()
        self._rows = self._buckets = self._bucket_words = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)
        self._owner.close()

    def __enter__(self) -> "ShmReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmSlotWriter:
    """A writable mapping of a ``ShmTier``'s data region, for slots the server reserved for this writer.

    A co-located client writes a put's frames straight into the slots the server
    handed it (``POST /v1/kv/reserve``) and then commits them: the bytes cross no
    socket and no staging copy. Only a reserved slot may be written; the server
    keeps a reserved range out of compaction and reuse until it is committed or
    aborted. The segment is ``0600``: only processes of the server's user get here.

    Raises:
        TierUnavailable: no such segment, or it is not a kvstore arena.
    """

    def __init__(self, segment: str, shm_dir: str = SHM_DIR) -> None:
        self.segment = segment
        fd, self._map, _, data_at, data_bytes, _, _ = _open_arena(segment, shm_dir, writable=True)
        os.close(fd)  # the mapping stays; no locks are taken through it
        self._view = memoryview(self._map)[data_at:data_at + data_bytes]
        populate_behind(self._map, data_at, data_bytes, write=True)

    def slot(self, offset: int, length: int) -> memoryview:
        """The reserved range's bytes (a view: keep it no longer than the write)."""
        if not 0 <= offset <= offset + length <= len(self._view):
            raise InvalidInput(f"slot [{offset}, {offset + length}) is outside the arena's {len(self._view)} bytes")
        return self._view[offset:offset + length]

    def close(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):  # a view still held: the GC unmaps later
            self._map.close()
