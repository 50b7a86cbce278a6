"""Pinned host shared memory: one POSIX arena that co-located processes read.

The arena is a single ``/dev/shm`` file, sized once, preallocated and mapped
with ``MAP_POPULATE``. A segment per put would cost a create, a truncate and
fresh page faults every time: about 1 GB/s here, against 13 GB/s for copying
into an arena that already exists (``docs/design.md``, "Figures this design rests on").

The file layout and ``ShmReader`` live in ``kvstore/memory/shm.py``, so that a
co-located client reads frames without importing the tiers.

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
import weakref
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from kvstore.errors import InvalidInput, TierFull, TierIOError
from kvstore.keys import BlockHash, check_key
from kvstore.memory.slab import Move
from kvstore.tier import Buffer, FrameWriter
from kvstore.memory.shm import (
    GEN,
    HEADER,
    KEY,
    LEN,
    MAGIC,
    OFF,
    ROW,
    ROW_WORDS,
    TABLE_AT,
    SHM_DIR,
    VER,
    VERSION,
    key_home,
    ShmReader,
    SlotHandle,
    lock_row,
    start_ticks,
)
from tiers.arena import ArenaTier, Slot

__all__ = ["ShmTier", "ShmReader", "SlotHandle", "cleanup_stale", "SHM_DIR"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
                raw = f.read(HEADER.size)
        except OSError:
            continue
        owner_ticks = HEADER.unpack(raw)[3] if len(raw) == HEADER.size and raw[:8] == MAGIC else None
        ticks = start_ticks(pid)
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
        index_at = -(-(TABLE_AT + self.max_entries * ROW) // 4096) * 4096
        # The key index: two buckets per slot row at least, a power of two (a mask, not a modulo)
        buckets = 1 << (2 * self.max_entries - 1).bit_length()
        data_at = -(-(index_at + 4 * buckets) // 4096) * 4096
        self._map, self._fd = self._create(data_at + self.arena_bytes)
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        self._rows = np.frombuffer(self._map, np.uint64, self.max_entries * ROW_WORDS, TABLE_AT)
        self._rows = self._rows.reshape(self.max_entries, ROW_WORDS)
        self._rows[:, GEN] = 1  # odd: empty
        # Scalar access through a memoryview: a numpy element read or write costs ~1 us, this ~0.1.
        self._words = memoryview(self._map)[TABLE_AT:TABLE_AT + self.max_entries * ROW].cast("Q")
        self._table = memoryview(self._map)[TABLE_AT:TABLE_AT + self.max_entries * ROW]
        self._buckets = memoryview(self._map)[index_at:index_at + 4 * buckets].cast("I")
        self._mask = buckets - 1
        self._data = np.frombuffer(self._map, np.uint8, self.arena_bytes, data_at)
        self._view = memoryview(self._data)
        self._map[:HEADER.size] = HEADER.pack(MAGIC, VERSION, os.getpid(), start_ticks(os.getpid()) or 0,
                                                self.max_entries, data_at, self.arena_bytes, index_at, buckets)
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
            gen = self._words[slot.index * ROW_WORDS + GEN]
            return SlotHandle(self.segment, slot.index, slot.offset, slot.length, gen)

    def reserved_view(self, slot: Slot) -> memoryview:
        return self._view[slot.offset:slot.offset + slot.length]

    # -- ArenaTier hooks ---------------------------------------------------------------

    def _copy_in(self, offset: int, frame: memoryview) -> None:
        self._view[offset:offset + len(frame)] = frame

    def _copy_out(self, offset: int, length: int) -> Buffer:
        return self._view[offset:offset + length].tobytes()

    def _copy_out_into(self, offset: int, length: int, out: memoryview) -> None:
        out[:length] = self._view[offset:offset + length]

    @contextmanager
    def _lent(self, offset: int, length: int) -> Iterator[memoryview]:
        with self._view[offset:offset + length] as view:  # the slot itself, busy while lent
            yield view

    def _fill(self, offset: int, size: int, writer: FrameWriter) -> int:
        with self._view[offset:offset + size] as view:  # the encoder writes into the arena itself
            return writer(view)

    def _move(self, moves: list[Move]) -> None:
        for m in moves:  # numpy copies overlapping ranges as if through a temporary
            self._data[m.dst:m.dst + m.size] = self._data[m.src:m.src + m.size]

    def _publish(self, key: bytes, slot: Slot) -> None:
        words, at = self._words, slot.index * ROW_WORDS
        if words[at + GEN] % 2 == 0:
            words[at + GEN] += 1
        words[at + OFF], words[at + LEN] = slot.offset, slot.length
        self._table[slot.index * ROW + KEY * 8:slot.index * ROW + KEY * 8 + 32] = key
        words[at + GEN] += 1  # even: readers may copy
        self._index_add(key, slot.index)

    def _unpublish(self, slot: Slot) -> None:
        at = slot.index * ROW_WORDS + GEN
        if self._words[at] % 2 == 0:
            self._words[at] += 1  # odd before the bytes can change

    def _vouched(self, slot: Slot) -> None:
        at = slot.index * ROW_WORDS
        gen = self._words[at + GEN]
        if gen % 2 == 0:
            self._words[at + VER] = gen  # readers in other processes skip the hash at this generation

    # -- the shared key index (kvstore/memory/shm.py): key -> slot row, for readers in other processes --

    def _index_add(self, key: bytes, row: int) -> None:
        """Enter ``key`` -> ``row`` (a no-op when there: compaction publishes a slot again). Lock held."""
        buckets, mask, entry = self._buckets, self._mask, row + 1
        pos = key_home(key, mask)
        while True:
            got = buckets[pos]
            if got == entry:
                return
            if got == 0:
                buckets[pos] = entry  # one aligned 4-byte store: a reader sees it whole or not at all
                return
            pos = (pos + 1) & mask

    def _index_remove(self, row: int) -> None:
        """Take ``row``'s entry out, shifting later entries of its probe run back so no probe
        ends early (no tombstones). A reader probing meanwhile may miss a key that moved
        (then it asks the server); it never sees another key's row as this one's. Lock held."""
        buckets, mask, words, entry = self._buckets, self._mask, self._words, row + 1
        key_at = row * ROW_WORDS + KEY
        pos = words[key_at] & mask  # the row still holds its key: it is reused only once freed
        while buckets[pos] != entry:
            if buckets[pos] == 0:
                return  # not entered (a reservation never published), or removed already
            pos = (pos + 1) & mask
        hole = pos
        while True:
            pos = (pos + 1) & mask
            got = buckets[pos]
            if got == 0:
                break
            home = words[(got - 1) * ROW_WORDS + KEY] & mask
            # the entry at pos may fill the hole unless its home lies cyclically in (hole, pos]
            if (hole < home <= pos) if hole < pos else (home > hole or home <= pos):
                continue
            buckets[hole] = got  # briefly in two buckets: harmless to a reader
            hole = pos
        buckets[hole] = 0

    def _pinned_elsewhere(self, slot: Slot) -> bool:
        if self._closed:  # the lock file is closed (its fd may be another file's now): nothing to ask
            return False
        return lock_row(self._fd, fcntl.F_WRLCK, slot.index, test=True)

    def _release(self, slot: Slot) -> None:
        if not self._closed:
            self._index_remove(slot.index)  # the key left the map: before its row can be reused
        super()._release(slot)

    def _reserve(self, key: bytes, size: int, *, lasting: bool = False) -> Slot:
        if self._retired:
            self._reclaim()  # leases held by other processes end without telling us
        return super()._reserve(key, size, lasting=lasting)

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
        self._buckets.release()
        self._rows = self._data = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps later
            self._map.close()
        os.close(self._fd)
