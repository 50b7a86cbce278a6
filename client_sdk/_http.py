"""A minimal HTTP/1.1 client for large bodies: send from the caller's memory, receive into it.

httpx reads a 32 MiB body at 0.73-0.85 GB/s here, a third of curl; a socket
that ``recv_into``s a preallocated buffer reaches 3.1 GB/s
(``docs/design.md``, "Figures this design rests on"). This module is that socket with just enough
HTTP: one keep-alive connection, Content-Length or chunked answers, no
redirects, no proxies. Bodies go out as a list of buffers (``sendall`` of each
view, no concatenation) and come back into a buffer the caller owns.

``Connection`` is blocking; ``AsyncConnection`` is the same protocol on the
event loop's ``sock_*`` calls (plain TCP only: asyncio cannot ``recv_into`` a
TLS socket, so the async client uses httpx for ``https``).

A body part may also be ``Strided``: rows of an array that lie apart in memory, sent in C order
by ``writev`` with no copy (a block-major put of token-major KV: ``client_sdk._common``).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import select
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np

__all__ = ["Endpoint", "Head", "Connection", "AsyncConnection", "BrokenConnection", "Strided", "joined"]

_HEAD_LIMIT = 64 * 1024
_RECV = 256 * 1024


class BrokenConnection(ConnectionError):
    """The connection failed before a whole answer arrived; the request may be retried."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    tls: bool
    base_path: str

    @classmethod
    def parse(cls, url: str) -> "Endpoint":
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http://host[:port] or https://host[:port], got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.hostname, port, parts.scheme == "https", parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


@dataclass(slots=True)
class Head:
    """Status line and headers of an answer (names lower-cased)."""

    status: int
    headers: dict[str, str]

    @property
    def length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


def _request_head(ep: Endpoint, method: str, path: str, headers: Mapping[str, str], length: int | None) -> bytes:
    lines = [f"{method} {ep.base_path}{path} HTTP/1.1", f"Host: {ep.host_header}", "Accept-Encoding: identity"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(raw: bytes) -> Head:
    lines = raw.decode("latin-1").split("\r\n")
    try:
        _, status, *_ = lines[0].split(" ", 2)
        code = int(status)
    except ValueError as exc:
        raise BrokenConnection(f"not an HTTP status line: {lines[0][:80]!r}") from exc
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return Head(code, headers)


_COALESCE_BYTES = 64 * 1024


class Strided:
    """A body part: the rows of a 3-D uint8 array, in C order, where each row (the last axis) is
    contiguous but rows lie apart in memory. It goes out by ``writev``, a batch of rows a call,
    with no copy and no Python object per row: a block-major put of a token-major KV is 512 rows
    of 4 KiB a 2 MiB block, and a memoryview each (GC churn included) cost more than the send.

    Args:
        array: the rows, e.g. ``kv.reshape(rows, blocks, run).transpose(1, 0, 2)``; kept alive
            (it holds the memory) while the part is sent.
        heads: (optional) a C-contiguous 2-D uint8 array with a row per outer index of ``array``,
            sent before that index's rows (a block-major body's block labels); kept alive too.

    Raises:
        ValueError: not a 3-D uint8 array whose rows are contiguous; ``heads`` of another shape.
    """

    __slots__ = ("array", "heads", "iov", "nbytes")

    def __init__(self, array: np.ndarray, heads: np.ndarray | None = None) -> None:
        if array.ndim != 3 or array.dtype != np.uint8 or array.strides[2] != 1:
            raise ValueError("Strided takes a 3-D uint8 array whose rows (the last axis) are contiguous")
        outer, inner, run = array.shape
        if heads is not None and (heads.ndim != 2 or heads.dtype != np.uint8 or len(heads) != outer
                                  or not heads.flags.c_contiguous):
            raise ValueError(f"Strided heads: a C-contiguous uint8 array of {outer} rows")
        self.array, self.heads = array, heads
        addr = (array.ctypes.data + np.arange(outer, dtype=np.uint64)[:, None] * np.uint64(array.strides[0])
                + np.arange(inner, dtype=np.uint64)[None, :] * np.uint64(array.strides[1]))
        lead = 0 if heads is None else 1
        iov = np.empty((outer, inner + lead, 2), np.uint64)
        iov[:, lead:, 0] = addr
        iov[:, lead:, 1] = run
        if heads is not None:
            iov[:, 0, 0] = heads.ctypes.data + np.arange(outer, dtype=np.uint64) * np.uint64(heads.strides[0])
            iov[:, 0, 1] = heads.shape[1]
        self.iov = iov.reshape(-1, 2)
        """``struct iovec`` of every row in send order: address, length."""
        self.nbytes = outer * inner * run + (0 if heads is None else heads.size)

    def __len__(self) -> int:
        return self.nbytes

    def chunks(self) -> list[bytes]:
        """The bytes in send order, one copy an outer row: where ``writev`` cannot go (TLS)."""
        if self.heads is None:
            return [np.ascontiguousarray(block).tobytes() for block in self.array]
        return [head.tobytes() + np.ascontiguousarray(block).tobytes() for head, block in zip(self.heads, self.array)]


def joined(parts: Sequence[Any]) -> bytes:
    """A body's parts as one bytes object (httpx's path)."""
    return b"".join(c for p in parts for c in (p.chunks() if isinstance(p, Strided) else [memoryview(p).cast("B")]))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.writev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_LIBC.writev.restype = ctypes.c_ssize_t
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


class _Rows:
    """Where a ``Strided`` part's send stands: the rows left, the first one maybe cut."""

    def __init__(self, part: Strided) -> None:
        self.part = part  # holds the memory the iovecs point into
        self.iov = part.iov.copy()  # cut as bytes go: the part can be sent again
        self.at = 0

    def write(self, fd: int) -> int | None:
        """One ``writev`` of the next rows: bytes sent, None when the socket would block.

        Raises:
            OSError: the socket failed.
        """
        count = min(len(self.iov) - self.at, _IOV_MAX)
        sent = _LIBC.writev(fd, self.iov[self.at:].ctypes.data, count)
        if sent < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return None
            raise OSError(err, os.strerror(err))
        ends = np.cumsum(self.iov[self.at:self.at + count, 1])
        whole = int(np.searchsorted(ends, sent, side="right"))  # rows sent whole
        if whole < count:
            cut = sent - (int(ends[whole - 1]) if whole else 0)
            self.iov[self.at + whole, 0] += np.uint64(cut)
            self.iov[self.at + whole, 1] -= np.uint64(cut)
        self.at += whole
        return sent

    @property
    def done(self) -> bool:
        return self.at >= len(self.iov)


def _views(parts: Sequence[Any]) -> list[Any]:
    views = [p if isinstance(p, Strided) else memoryview(p).cast("B") for p in parts]
    return [v for v in views if len(v)]


def _writes(head: bytes, views: list[Any]) -> list[Any]:
    """What to send: the head and the small parts joined (one segment for a small
    request, not one per part), then each large part from the caller's memory."""
    first = [head]
    i = 0
    while i < len(views) and len(views[i]) < _COALESCE_BYTES and not isinstance(views[i], Strided):
        first.append(views[i])
        i += 1
    return [b"".join(first), *views[i:]]


class _Wire:
    """What both connections keep and decide without touching the socket: the endpoint and
    timeouts, the bytes read past an answer's head, the head of the answer being read, and
    when to hang up."""

    def __init__(self, ep: Endpoint, connect_timeout_s: float, timeout_s: float | None) -> None:
        self.ep = ep
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # bytes read past the head
        self._head: Head | None = None
        self.used = False
        """Whether a request already went over this socket (a reused socket may have been closed by the peer)."""

    def _take_head(self) -> Head | None:
        """The answer head at the front of the bytes read (skipping ``100 Continue``), the rest
        left for the body; None while more bytes are needed.

        Raises:
            BrokenConnection: the head runs over 64 KiB.
        """
        while True:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _HEAD_LIMIT:
                    raise BrokenConnection("answer head over 64 KiB")
                return None
            self._buf = buf[end + 4:]
            head = _parse_head(bytes(buf[:end]))
            if head.status != 100:
                return head

    def _buffered_into(self, out: memoryview) -> int:
        """Copy the body bytes that came with the head into ``out``; how many."""
        n = min(len(self._buf), len(out))
        out[:n] = self._buf[:n]
        del self._buf[:n]
        return n

    @staticmethod
    def _filled(n: int, got: int) -> int:
        """Body bytes in after a receive of ``got`` (0: the peer hung up)."""
        if not got:
            raise BrokenConnection("connection closed mid-body")
        return n + got

    def _lost(self, exc: OSError) -> BrokenConnection:
        """Hang up after a failed read: where the rest of the body starts is not known any more."""
        self.close()
        return BrokenConnection(f"reading the body: {exc}")

    def _done(self) -> None:
        if self._head is not None and not self._head.keep_alive:
            self.close()
        self._head = None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
        self._buf = bytearray()


class Connection(_Wire):
    """One blocking keep-alive connection; not thread-safe (the client keeps one per thread)."""

    def __init__(self, ep: Endpoint, *, connect_timeout_s: float, timeout_s: float | None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(ep, connect_timeout_s, timeout_s)
        self._ssl = ssl_context or (ssl.create_default_context() if ep.tls else None)

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.ep.host, self.ep.port), timeout=self.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_hostname=self.ep.host)
        sock.settimeout(self.timeout_s)
        self.used = False
        return sock

    def request(self, method: str, path: str, headers: Mapping[str, str], parts: Sequence[Any] = ()) -> Head:
        """Send one request and read the answer's head.

        Raises:
            BrokenConnection: the socket failed or closed before the head arrived.
            TimeoutError: no answer within the timeout.
        """
        views = _views(parts)
        length = sum(map(len, views)) if views or method in ("POST", "PUT") else None
        try:
            if self._sock is None:
                self._sock = self._connect()
            self.used = True
            for data in _writes(_request_head(self.ep, method, path, headers, length), views):
                if isinstance(data, Strided):
                    self._send_rows(data)
                else:
                    self._sock.sendall(data)
            self._head = self._read_head()
            return self._head
        except TimeoutError:
            self.close()
            raise
        except (OSError, BrokenConnection) as exc:
            self.close()
            raise BrokenConnection(f"{method} {path}: {exc}") from exc

    def _send_rows(self, part: Strided) -> None:
        """``sendall`` of a ``Strided`` part: ``writev`` where the socket is plain, under the
        socket's timeout (a timed socket's descriptor is non-blocking: wait until writable)."""
        sock = self._sock
        assert sock is not None
        if isinstance(sock, ssl.SSLSocket):  # TLS encrypts in user space: no writev
            for chunk in part.chunks():
                sock.sendall(chunk)
            return
        rows, fd, timeout = _Rows(part), sock.fileno(), sock.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        while not rows.done:
            if rows.write(fd) is not None:
                deadline = None if timeout is None else time.monotonic() + timeout  # a timeout is per send
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poller.poll(None if left is None else left * 1000):
                raise TimeoutError("timed out sending the body")

    def _read_head(self) -> Head:
        self._buf = bytearray()
        while (head := self._take_head()) is None:
            chunk = self._sock.recv(_RECV)  # type: ignore[union-attr]
            if not chunk:
                raise BrokenConnection("connection closed before an answer")
            self._buf += chunk
        return head

    def read_into(self, out: memoryview) -> None:
        """Read exactly ``len(out)`` body bytes into ``out`` (Content-Length answers)."""
        n = self._buffered_into(out)
        try:
            while n < len(out):
                n = self._filled(n, self._sock.recv_into(out[n:]))  # type: ignore[union-attr]
        except OSError as exc:
            raise self._lost(exc) from exc
        self._done()

    def read_body(self) -> bytes:
        """The whole body as bytes (Content-Length, chunked, or until close)."""
        head = self._head
        assert head is not None
        try:
            if head.chunked:
                body = self._read_chunked()
            elif head.length is not None:
                out = bytearray(head.length)
                self.read_into(memoryview(out))
                return bytes(out)
            else:
                body = bytes(self._buf) + self._read_to_close()
                self.close()
                return body
        except OSError as exc:
            raise self._lost(exc) from exc
        self._done()
        return body

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self._line()
            size = int(line.split(b";")[0], 16)
            if size == 0:
                while self._line():  # trailers
                    pass
                return bytes(out)
            while len(self._buf) < size + 2:
                self._more()
            out += self._buf[:size]
            del self._buf[:size + 2]

    def _line(self) -> bytes:
        while (i := self._buf.find(b"\r\n")) < 0:
            self._more()
        line = bytes(self._buf[:i])
        del self._buf[:i + 2]
        return line

    def _more(self) -> None:
        chunk = self._sock.recv(_RECV)  # type: ignore[union-attr]
        if not chunk:
            raise BrokenConnection("connection closed mid-body")
        self._buf += chunk

    def _read_to_close(self) -> bytes:
        chunks = []
        while chunk := self._sock.recv(_RECV):  # type: ignore[union-attr]
            chunks.append(chunk)
        return b"".join(chunks)


class AsyncConnection(_Wire):
    """The same protocol on the event loop (plain TCP); one request at a time."""

    def __init__(self, ep: Endpoint, *, connect_timeout_s: float, timeout_s: float | None) -> None:
        if ep.tls:
            raise ValueError("AsyncConnection is plain TCP; use httpx for https")
        super().__init__(ep, connect_timeout_s, timeout_s)
        self.lock = asyncio.Lock()

    async def _connect(self) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.ep.host, self.ep.port, type=socket.SOCK_STREAM)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, addr), self.connect_timeout_s)
        except BaseException:
            sock.close()
            raise
        self.used = False
        return sock

    async def request(self, method: str, path: str, headers: Mapping[str, str], parts: Sequence[Any] = ()) -> Head:
        views = _views(parts)
        length = sum(map(len, views)) if views or method in ("POST", "PUT") else None
        loop = asyncio.get_running_loop()
        try:
            if self._sock is None:
                self._sock = await self._connect()
            self.used = True
            for data in _writes(_request_head(self.ep, method, path, headers, length), views):
                if isinstance(data, Strided):
                    await self._send_rows(loop, data)
                else:
                    await loop.sock_sendall(self._sock, data)
            self._head = await asyncio.wait_for(self._read_head(), self.timeout_s)
            return self._head
        except asyncio.TimeoutError:
            self.close()
            raise TimeoutError(f"{method} {path}: no answer within {self.timeout_s} s") from None
        except (OSError, BrokenConnection) as exc:
            self.close()
            raise BrokenConnection(f"{method} {path}: {exc}") from exc

    async def _send_rows(self, loop: asyncio.AbstractEventLoop, part: Strided) -> None:
        """``sock_sendall`` of a ``Strided`` part: ``writev`` until done, waiting on the loop
        whenever the socket is full."""
        rows, fd = _Rows(part), self._sock.fileno()  # type: ignore[union-attr]
        while not rows.done:
            if rows.write(fd) is not None:
                continue
            ready = loop.create_future()
            loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_writer(fd)

    async def _read_head(self) -> Head:
        loop = asyncio.get_running_loop()
        self._buf = bytearray()
        while (head := self._take_head()) is None:
            chunk = await loop.sock_recv(self._sock, _RECV)  # type: ignore[arg-type]
            if not chunk:
                raise BrokenConnection("connection closed before an answer")
            self._buf += chunk
        return head

    async def read_into(self, out: memoryview) -> None:
        loop = asyncio.get_running_loop()
        n = self._buffered_into(out)
        try:
            while n < len(out):
                n = self._filled(n, await loop.sock_recv_into(self._sock, out[n:]))  # type: ignore[arg-type]
        except OSError as exc:
            raise self._lost(exc) from exc
        self._done()

    async def read_body(self) -> bytes:
        head = self._head
        assert head is not None
        if head.length is None:
            raise BrokenConnection("the server sent no Content-Length")  # our server always does
        out = bytearray(head.length)
        await self.read_into(memoryview(out))
        return bytes(out)
