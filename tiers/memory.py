"""The reference tier: frames in a dict, with capacity accounting.

It is what ``EmbeddedStore()`` uses by default and what the conformance suite
is first checked against. Frames are immutable once stored, so ``get`` hands
out the stored object itself (or a read-only view of it) with no copy.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Iterator

from kvstore.errors import InvalidInput, StoreClosed, TierFull
from kvstore.keys import BlockHash, check_key
from kvstore.tier import Buffer, FrameWriter, Tier, TierCounters, TierStats

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """A process-local tier bounded by ``capacity_bytes`` of frame data."""

    durable = False
    shared = False

    def __init__(self, capacity_bytes: int, *, name: str = "memory") -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInput(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._frames: dict[bytes, bytes | bytearray] = {}
        self._used = 0
        self._counters = TierCounters()
        self._lock = threading.Lock()
        self._closed = False

    def put(self, key: BlockHash, frame: Buffer) -> None:
        check_key(key)
        self._store(key, bytes(frame))

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        check_key(key)
        with self._lock:  # refuse early: do not encode a frame that cannot fit
            self._check_open()
            self._used_after(key, size)
        buf = bytearray(size)
        with memoryview(buf) as view:
            n = writer(view)
        if n < size:
            try:
                del buf[n:]
            except BufferError:  # the writer kept a view alive; trim by copying
                buf = bytearray(memoryview(buf)[:n])
        self._store(key, buf)
        return n

    def _store(self, key: bytes, data: bytes | bytearray) -> None:
        with self._lock:
            self._check_open()
            self._used = self._used_after(key, len(data))
            self._frames[key] = data
            self._counters.puts += 1

    def _used_after(self, key: bytes, size: int) -> int:
        """Bytes used once ``key`` holds ``size`` bytes; TierFull if over capacity. Lock held."""
        old = self._frames.get(key)
        used = self._used - (len(old) if old is not None else 0) + size
        if used > self.capacity_bytes:
            self._counters.errors += 1
            raise TierFull(
                f"tier {self.name!r}: a {size}-byte frame does not fit "
                f"({self._used} of {self.capacity_bytes} bytes used)",
                tier=self.name,
            )
        return used

    def get(self, key: BlockHash) -> Buffer | None:
        with self._lock:
            self._check_open()
            data = self._frames.get(key)
            self._counters.gets += 1
            if data is None:
                self._counters.misses += 1
                return None
            self._counters.hits += 1
        return data if isinstance(data, bytes) else memoryview(data).toreadonly()

    def delete(self, key: BlockHash) -> bool:
        with self._lock:
            self._check_open()
            data = self._frames.pop(key, None)
            if data is None:
                return False
            self._used -= len(data)
            self._counters.deletes += 1
            return True

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            self._check_open()
            return key in self._frames

    def keys(self) -> Iterator[BlockHash]:
        with self._lock:
            self._check_open()
            snapshot = list(self._frames)
        return iter(snapshot)  # type: ignore[arg-type]

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                kind="memory",
                entries=len(self._frames),
                used_bytes=self._used,
                capacity_bytes=self.capacity_bytes,
                durable=self.durable,
                shared=self.shared,
                counters=replace(self._counters),
                details={"backing": "process heap (dict of frames)"},
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._frames.clear()
            self._used = 0

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"tier {self.name!r} is closed")
