"""Reused buffers: the two ways kvstore keeps memory it has paid page faults for.

A fresh buffer faults its pages in on first touch, at a fraction of copy speed
(2-7.5 GB/s here, under 1 GB/s on a busy VM; ``docs/design.md``), so every hot
path reuses memory instead. Two kinds, by who holds a buffer:

- ``Scratch``: one buffer per thread, grown to the largest request and lent for
  the length of a call (the codec's work area, the store's frame buffer, a
  tier's staging). No lock; never outlives the call that asked.
- ``BufferPool``: buffers handed out and given back later, maybe by another
  thread, bounded by ``keep_bytes`` of idle memory: a server's request bodies,
  and the SDK's results (``client_sdk._common.TensorPool`` lends its buffers as
  tensors and takes each back when the last tensor viewing it is gone).
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


class BufferPool(Generic[B]):
    """Buffers lent out and given back, with at most ``keep_bytes`` of idle ones kept.

    ``acquire`` hands out the smallest idle buffer that fits (a fresh one if none does);
    ``release`` takes one back and, over ``keep_bytes``, drops idle ones until it is not.
    A buffer's size is ``len(buffer)``: bytes for a ``bytearray`` or a 1-D uint8 array.

    Args:
        keep_bytes: the most idle bytes kept for reuse.
        alloc: makes a buffer of at least n bytes (default ``bytearray``, at least a page).
        max_slack: a buffer fits a request of n bytes only up to ``2 * n + max_slack`` bytes
            (None: any buffer at least n fits), so a small result does not pin a big buffer.
        drop_smallest: over ``keep_bytes``, drop the smallest idle buffers first (they fault
            least when made again); by default the largest go first (they hold the most memory).
    """

    def __init__(self, keep_bytes: int = 512 << 20, *, alloc: Callable[[int], B] | None = None,
                 max_slack: int | None = None, drop_smallest: bool = False) -> None:
        self.keep_bytes = keep_bytes
        self._alloc = alloc if alloc is not None else _page_bytearray
        self._max_slack = max_slack
        self._drop_smallest = drop_smallest
        self._free: list[B] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> B:
        top = None if self._max_slack is None else 2 * nbytes + self._max_slack
        with self._lock:
            best = -1
            for i, b in enumerate(self._free):  # by index: list.remove would compare arrays element-wise
                n = len(b)
                if nbytes <= n and (top is None or n <= top) and (best < 0 or n < len(self._free[best])):
                    best = i
            if best >= 0:
                return self._free.pop(best)
        return self._alloc(nbytes)

    def release(self, buf: B) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len)
            while self._free and sum(map(len, self._free)) > self.keep_bytes:
                self._free.pop(0 if self._drop_smallest else -1)


def _page_bytearray(nbytes: int) -> bytearray:
    return bytearray(max(nbytes, 4096))
