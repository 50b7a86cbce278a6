"""The memory request bodies hold while they arrive, under one cap.

A body used to be read into a buffer of its declared length, allocated (and
zeroed, so committed) up front: six connections that each declared a 1 GiB put
and sent 64 MiB of it grew ``kvstore serve`` by 6 GiB, so a few dozen clients
could take a 24 GiB machine down. Now two things hold:

- **Memory follows the bytes.** A fresh body buffer is anonymous memory that the
  kernel commits page by page as bytes are written (``lazy_buffer``); a declared
  length reserves address space, not memory.
- **The bytes have a cap.** ``InflightCap`` charges every body part to one
  ``InflightBudget`` as it is received and gives the charge back when the request
  ends. A part that would take the total past ``max_inflight_bytes`` waits up to
  ``inflight_wait_s`` for room, then the request gets 503 with ``Retry-After``
  and its connection is closed (its body is left unread).

A quarter of the cap is kept for small bodies (at most a sixteenth of the cap
each): uploads of large bodies, trickling or not, cannot take the memory that
ordinary puts and JSON calls need. A body stalled for good still holds its
charge until ``body_timeout_s`` ends it with 408 (``server.app``).

The budget lives on the event loop's thread only: no lock, and a waiter is an
``asyncio.Future`` woken when a charge is given back.

``BodyStream`` reads a body part by part, in order, straight into where each range belongs
(a block-major put's reserved slots: ``server.block_puts``), rather than whole into one buffer.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import deque
from typing import Any

from kvstore.errors import MalformedRequest, PayloadTooLarge, ServerBusy
from server.errors import send_error

__all__ = ["InflightBudget", "InflightCap", "BodyStream", "lazy_buffer", "default_inflight_bytes"]

SMALL_SHARE = 16
"""A body of at most cap / SMALL_SHARE bytes may use the reserved quarter."""
RESERVED_SHARE = 4
"""cap / RESERVED_SHARE is kept for small bodies."""


def default_inflight_bytes() -> int:
    """A quarter of the machine's memory, at least 1 GiB and at most 16 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return max(1 << 30, min(16 << 30, total // 4))


def lazy_buffer(nbytes: int) -> mmap.mmap:
    """A writable buffer of ``nbytes`` whose pages are committed as they are first written.

    ``bytearray(n)`` zeroes all n bytes at once, which commits them: a declared
    Content-Length would cost its whole size before one byte arrived.
    """
    # Private: shared anonymous memory is shmem, which lingers in accounting and /proc as such.
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class InflightBudget:
    """Bytes of request bodies in flight, at most ``cap``.

    Args:
        cap: the most bytes all bodies in flight hold together.
    """

    def __init__(self, cap: int) -> None:
        if cap <= 0:
            raise ValueError(f"cap must be > 0, got {cap}")
        self.cap = cap
        self.reserved = cap // RESERVED_SHARE
        self.small_max = cap // SMALL_SHARE
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def large_limit(self) -> int:
        """What large bodies may hold together (and so the largest one body may be)."""
        return self.cap - self.reserved

    def try_take(self, n: int, small: bool) -> bool:
        if self.used + n > (self.cap if small else self.large_limit):
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def take(self, n: int, small: bool, wait_s: float) -> bool:
        """Charge ``n`` bytes, waiting up to ``wait_s`` for room; False if none came."""
        if self.try_take(n, small):
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                self.refused += 1
                return False
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                # Not wait_for: on 3.11 it returns the result of a waiter woken in the same
                # loop turn as a cancel of this task and drops the cancel, so the body
                # deadline's cancel was lost and a trickling upload was never answered.
                await asyncio.wait((waiter,), timeout=left)
            finally:
                if not waiter.done():
                    waiter.cancel()
            if self.try_take(n, small):
                return True

    def give(self, n: int) -> None:
        self.used -= n
        while self._waiters:  # every waiter looks again: a small one may fit where a large one does not
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def stats(self) -> dict[str, int]:
        return {"cap_bytes": self.cap, "used_bytes": self.used, "peak_bytes": self.peak,
                "refused": self.refused}


class InflightCap:
    """ASGI middleware: charge each request body part to ``budget`` as it arrives.

    A body whose declared length is over what large bodies may hold together could
    never be received: 413 at once. One that finds no room within ``wait_s`` gets
    ``ServerBusy`` from ``receive`` (503 through the app's error handler), with
    ``Retry-After`` and ``Connection: close`` added here.
    """

    def __init__(self, app: Any, budget: InflightBudget, wait_s: float) -> None:
        self.app, self.budget, self.wait_s = app, budget, wait_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        budget = self.budget
        declared = next((int(v) for k, v in scope["headers"] if k == b"content-length" and v.isdigit()), None)
        small = declared is not None and declared <= budget.small_max
        if declared is not None and not small and declared > budget.large_limit:
            return await send_error(send, PayloadTooLarge(
                f"body of {declared} bytes is over the {budget.large_limit} bytes that bodies in flight may "
                f"hold (three quarters of KVSTORE_MAX_INFLIGHT_BYTES={budget.cap})", field="body"))
        held = 0
        refused = False

        async def charged_receive() -> dict:
            nonlocal held, refused
            message = await receive()
            n = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if n and not (budget.try_take(n, small) or await budget.take(n, small, self.wait_s)):
                refused = True
                raise ServerBusy(f"request bodies in flight hold the server's {budget.cap}-byte cap "
                                 f"(KVSTORE_MAX_INFLIGHT_BYTES); nothing was stored: retry later")
            held += n
            return message

        async def closing_send(message: dict) -> None:
            if refused and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close"),
                                                  (b"retry-after", b"%d" % round(ServerBusy.retry_after_s))]}
            await send(message)

        try:
            await self.app(scope, charged_receive, closing_send)
        finally:
            budget.give(held)


class BodyStream:
    """A request body read in order, each range copied straight to where it goes.

    The parts the ASGI server hands over (``receive``, charged by ``InflightCap`` as they
    arrive) are split at the ranges asked for: ``read`` a small range as bytes,
    ``read_into`` a buffer, ``skip`` one; ``end`` checks that nothing follows.

    Args:
        request: the request whose body to read (not read yet).
        limit: the most bytes a body may hold (``max_body_bytes``).

    Raises (every read):
        MalformedRequest: (400, ``body``) the body ends, or its client goes, before the range.
        PayloadTooLarge: (413, ``body``) past ``limit``.
        BodyTimeout, ServerBusy: as the middlewares raise them from ``receive``.
    """

    def __init__(self, request: Any, limit: int) -> None:
        self._receive = request.receive  # the ASGI receive itself: Starlette's stream() is one more generator a part
        self._more = True
        self._part = memoryview(b"")
        self.received = 0
        """Body bytes taken off the stream so far (read, copied or skipped)."""
        self.expected: int | None = None
        """How long the body must be, once its head says: named when it ends short."""
        self._limit = limit

    async def _next(self) -> memoryview:
        """The rest of the current part, or the next one; empty at the body's end."""
        while not self._part and self._more:
            message = await self._receive()
            if message["type"] != "http.request":  # http.disconnect
                raise MalformedRequest(f"body: the client went away after {self.received} bytes"
                                       f"{self._of()}", field="body")
            part = message.get("body", b"")
            self._more = message.get("more_body", False)
            if self.received + len(part) > self._limit:
                raise PayloadTooLarge(f"body is over the {self._limit}-byte limit", field="body")
            self._part = memoryview(part)
        return self._part

    def _of(self) -> str:
        return "" if self.expected is None else f" of the {self.expected} its header describes"

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` (a writable byte view) with the body's next ``len(out)`` bytes."""
        at, want = 0, len(out)
        while at < want:
            part = await self._next()
            if not part:
                raise MalformedRequest(f"body: ended after {self.received} bytes{self._of()}", field="body")
            n = min(len(part), want - at)
            out[at:at + n] = part[:n]
            self._part = part[n:]
            self.received += n
            at += n

    async def read(self, n: int) -> bytes:
        """The body's next ``n`` bytes (a small range: a head)."""
        out = bytearray(n)
        await self.read_into(memoryview(out))
        return bytes(out)

    async def skip(self, n: int) -> None:
        """Take the body's next ``n`` bytes and drop them."""
        left = n
        while left:
            part = await self._next()
            if not part:
                raise MalformedRequest(f"body: ended after {self.received} bytes{self._of()}", field="body")
            k = min(len(part), left)
            self._part = part[k:]
            self.received += k
            left -= k

    async def end(self) -> None:
        """Check that the body holds nothing more.

        Raises:
            MalformedRequest: (400, ``body``) bytes follow the last range the head describes.
        """
        part = await self._next()
        if part:
            raise MalformedRequest(f"body: longer than the {self.received} bytes its header describes",
                                   field="body")
