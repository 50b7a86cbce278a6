"""Reused buffers: the two ways kvstore keeps memory it has paid page faults for.

A fresh buffer faults its pages in on first touch, at a fraction of copy speed
(2-7.5 GB/s here, under 1 GB/s on a busy VM; ``docs/design.md``), so every hot
path reuses memory instead. Two kinds, by who holds a buffer:

- ``Scratch``: one buffer per thread, grown to the largest request and lent for
  the length of a call (the codec's work area, the store's frame buffer, a
  tier's staging). No lock; never outlives the call that asked.
- ``BufferPool``: buffers handed out and given back later, maybe by another
  thread (a server's request bodies, the SDK's results), bounded by
  ``keep_bytes`` of idle memory.
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

__all__ = ["Scratch", "BufferPool"]

B = TypeVar("B")


class Scratch(Generic[B]):
    """A per-thread buffer that grows to the largest size asked so far.

    Args:
        alloc: makes a buffer of at least n units (bytes, or elements of a tensor).
        size_of: a buffer's size in those units.
        round_to: sizes are rounded up to a multiple of this (page alignment for O_DIRECT).
        max_kept: a request over this is served a fresh buffer that is not kept
            (None: keep whatever was asked).
        grow: the factor a buffer grows by at least, so a slowly growing size does not
            reallocate every call.
    """

    def __init__(self, alloc: Callable[[int], B], size_of: Callable[[B], int], *, round_to: int = 1,
                 max_kept: int | None = None, grow: float = 1.0) -> None:
        self._alloc, self._size_of = alloc, size_of
        self._round_to, self._max_kept, self._grow = round_to, max_kept, grow
        self._local = threading.local()

    def get(self, n: int) -> B:
        """This thread's buffer of at least ``n`` units (valid until this thread asks again)."""
        buf = getattr(self._local, "buf", None)
        if buf is not None and self._size_of(buf) >= n:
            return buf
        size = -(-n // self._round_to) * self._round_to
        if buf is not None:
            size = max(size, int(self._size_of(buf) * self._grow))
        fresh = self._alloc(size)
        if self._max_kept is None or size <= self._max_kept:
            self._local.buf = fresh
        return fresh

    def drop(self) -> None:
        """Let go of this thread's buffer (a closing tier frees its memory)."""
        self._local.buf = None


class BufferPool:
    """Byte buffers lent out and given back, with at most ``keep_bytes`` of idle ones kept.

    ``acquire`` hands out the smallest idle buffer that fits (a fresh one if none does);
    ``release`` takes one back and, over ``keep_bytes``, drops the largest idle ones first.

    Args:
        keep_bytes: the most idle bytes kept for reuse.
    """

    def __init__(self, keep_bytes: int = 512 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> bytearray:
        with self._lock:
            fits = [b for b in self._free if len(b) >= nbytes]
            if fits:
                best = min(fits, key=len)
                self._free.remove(best)
                return best
        return bytearray(max(nbytes, 4096))

    def release(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len)
            while self._free and sum(map(len, self._free)) > self.keep_bytes:
                self._free.pop()  # drop the largest first
