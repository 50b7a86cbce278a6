"""The Redis layout of kvstore frames, and zero-copy I/O to it: values sent from the caller's
memory, replies landed straight in the destination buffer.

Every kvstore node sharing a Redis keyspace writes frames the same way (``tiers.redis``:
a manifest ``<keyspace>:{<hex key>}`` naming the frame's chunks, the chunks beside it), and
the SDK's ``redis`` medium reads them directly; both read with ``read_frames`` here, so
the layout is defined once and neither side imports the other.

Why: redis-py with hiredis copies every value twice on the way out (``bytes(view)``, then
into one packed buffer) and, on the way in, hands a reply over through three copies (its
socket buffer, hiredis' buffer, a fresh bytes object) that the tier would then assemble
into a frame. Here a put's chunks go out as views of the caller's buffer (``ZeroCopy``)
and a get's chunks go once, from the kernel into the frame or the caller's ``out``
(``Wire``, ``Read``).

``Wire`` relies on redis-py's private ``Connection._sock``: it reads replies off the
connection's socket itself, so the caller must drop the connection (``disconnect()``)
whenever a read fails half way.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.connection import (Connection, Encoder, PythonRespSerializer, SSLConnection,
                              UnixDomainSocketConnection)
from redis.backoff import ExponentialBackoff
from redis.exceptions import InvalidResponse, RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from kvstore.errors import InvalidInput
from kvstore.keys import BlockHash, to_hex
from kvstore.tier import Buffer

__all__ = ["ZeroCopy", "CONNECTIONS", "Wire", "Read", "writable", "frame_of", "frame_key", "connect_options",
           "read_frames", "redact", "KEYSPACE", "READ_TRIES"]

KEYSPACE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")  # no ':', '{' or glob characters
READ_TRIES = 4  # transactions per read before a frame rewritten under us counts as a miss
_NOT_A_LOST_NODE = (redis.AuthenticationError, redis.exceptions.AuthorizationError,
                    redis.exceptions.MaxConnectionsError, redis.BusyLoadingError)
"""Connection errors that say the node is there: a fresh slot map would not help."""


def frame_of(manifest: bytes | None) -> tuple[int, int]:
    """(nchunks, length) of a manifest; (0, 0) for none."""
    if manifest is None:
        return 0, 0
    _, n, length = manifest.split(b":")
    return int(n), int(length)


def frame_key(keyspace: str, key: BlockHash) -> str:
    """The manifest's key of ``key``'s frame in ``keyspace`` (its chunks are ``<that>:<i>``)."""
    return f"kv:{keyspace}:{{{to_hex(key)}}}"


def connect_options(url: str, socket_timeout_s: float, connect_timeout_s: float) -> tuple[bool, str, dict[str, Any]]:
    """``(cluster, url, options)`` for redis-py's ``from_url`` of a ``redis://``, ``rediss://``,
    ``unix://`` or ``redis+cluster://`` URL: zero-copy connections, the timeouts, one quick retry.

    Raises:
        InvalidInput: another scheme.
    """
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme not in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        raise InvalidInput(f"not a redis:// or redis+cluster:// URL: {redact(str(url))!r}")
    options = dict(
        socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
        connection_class=CONNECTIONS[scheme.partition("+")[0]],
        # One quick retry lets a pooled connection that died with a restarted server
        # reconnect; none on timeouts, which would double a hung server's stall.
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1, supported_errors=(redis.ConnectionError,)),
    )
    return scheme.endswith("+cluster"), f"{scheme.partition('+')[0]}://{rest}", options


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = urlencode([(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)])
    return urlunsplit(parts._replace(netloc=netloc, query=query))


class ZeroCopy:
    """Connection mixin: values over 6000 bytes go out straight from the caller's buffer.

    With hiredis installed redis-py packs commands with it, which copies every value
    twice (``bytes(view)``, then into one buffer): 32 MiB puts ran at 1.4 GB/s, 2.5 without.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs["command_packer"] = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        super().__init__(**kwargs)


CONNECTIONS = {scheme: type(f"ZeroCopy{base.__name__}", (ZeroCopy, base), {}) for scheme, base in
               (("redis", Connection), ("rediss", SSLConnection), ("unix", UnixDomainSocketConnection))}


def writable(out: Buffer) -> memoryview:
    """``out`` as one writable byte view. Raises: InvalidInput if it cannot be one."""
    try:
        view = memoryview(out).cast("B")
    except TypeError as exc:  # not a buffer, or not contiguous
        raise InvalidInput(f"out must be one contiguous writable buffer: {exc}") from exc
    if view.readonly:
        raise InvalidInput("out is read-only")
    return view


class Wire:
    """RESP replies read straight off a redis-py connection's socket, for reads only.

    With hiredis, redis-py hands a reply over through three copies (its socket buffer,
    hiredis' buffer, a bytes object) and the tier would add a fourth to assemble chunks;
    here a chunk goes once, from the kernel into its frame. This reads the connection's
    private ``_sock``; the caller (``RedisTier._fetch``) sends through the public API and
    drops the connection whenever a read fails half way.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf, self.scratch = sock, bytearray(), bytearray(16384)

    def line(self) -> bytes:
        """The next header line (b"+QUEUED", b"*3", b"$1048576"); an error reply raises."""
        while (end := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[:end + 2]
        if line[:1] == b"-":
            raise ResponseError(line[1:].decode(errors="replace"))
        return line

    def size(self) -> int | None:
        """The length in the next bulk string's header; None for nil (RESP2 or RESP3)."""
        line = self.line()
        if line in (b"_", b"$-1"):
            return None
        if line[:1] != b"$":
            raise InvalidResponse(f"expected a bulk string, got {line[:40]!r}")
        return int(line[1:])

    def bulk(self) -> bytes | None:
        size = self.size()
        if size is None:
            return None
        data = bytearray(size)
        self.body(memoryview(data))
        return bytes(data)

    def body(self, view: memoryview) -> None:
        """Read a bulk string's payload into ``view`` (exactly its size), then its CRLF."""
        with memoryview(self.buf) as held:
            take = min(len(held), len(view))
            view[:take] = held[:take]
        del self.buf[:take]
        while take < len(view):
            take += self._recv(lambda: self.sock.recv_into(view[take:]))
        while len(self.buf) < 2:
            self._fill()
        del self.buf[:2]

    def skip(self, size: int) -> None:
        self.body(memoryview(bytearray(size)))

    def _fill(self) -> None:
        n = self._recv(lambda: self.sock.recv_into(self.scratch))
        self.buf += memoryview(self.scratch)[:n]

    @staticmethod
    def _recv(call: Any) -> int:
        try:
            n = call()
        except socket.timeout as exc:
            raise redis.TimeoutError(f"Timeout reading from Redis: {exc}") from exc
        except OSError as exc:
            raise redis.ConnectionError(f"Error reading from Redis: {exc}") from exc
        if not n:
            raise redis.ConnectionError("Redis closed the connection")
        return n


@dataclass(slots=True)
class Read:
    """One frame on its way out: the manifest seen and where its chunks land."""

    mkey: str
    out: memoryview | None = None  # the caller's buffer (get_into); else one is allocated
    manifest: bytes | None = None
    frame: bytearray | None = None
    filled: int = 0  # bytes landed
    got: int = 0  # chunks landed
    done: bool = False
    bad: bool = False  # a chunk missing or misshapen: a miss, never wrong bytes

    def land(self, wire: Wire, span: range) -> None:
        """Take one EXEC's replies: the manifest, then the chunks in ``span``."""
        manifest = wire.bulk()
        if self.got and manifest != self.manifest:  # rewritten between two reads: start over
            self.got = self.filled = 0
            self.frame, span_ok = None, False
        else:
            span_ok = True
        self.manifest = manifest
        nchunks, length = frame_of(manifest)
        dest = self._dest(length) if span_ok and manifest is not None else None
        for i in span:
            size = wire.size()
            if dest is None or i >= nchunks or size is None or self.filled + size > length:
                if size:
                    wire.skip(size)
                self.bad |= dest is not None and i < nchunks
                continue
            wire.body(dest[self.filled:self.filled + size])
            self.filled, self.got = self.filled + size, self.got + 1
        self.done = manifest is None or self.bad or self.got >= nchunks
        self.bad |= self.done and manifest is not None and self.filled != length

    def _dest(self, length: int) -> memoryview:
        if self.out is not None:
            if len(self.out) < length:
                raise InvalidInput(f"out holds {len(self.out)} bytes, the frame needs {length}")
            return self.out
        if self.frame is None or len(self.frame) != length:
            self.frame = bytearray(length)
        return memoryview(self.frame)

    def result(self) -> bytearray | int | None:
        """The frame (or, for get_into, its length); None for a miss."""
        if not self.done or self.bad or self.manifest is None:
            return None
        if self.out is not None:
            return self.filled
        return self.frame if self.frame is not None else bytearray()


def read_frames(r: Any, reads: list[Read], first: int, cluster: bool) -> None:
    """Land each frame: one round trip per node and try, each frame in its own MULTI.

    Args:
        r: a redis-py client (``Redis``, or ``RedisCluster`` when ``cluster``).
        first: chunks to ask for when a frame's manifest is not known yet.

    A read not done after ``READ_TRIES`` saw a new version on every try: a miss this time.

    Raises:
        redis-py errors (the caller translates them).
    """
    for attempt in range(READ_TRIES):
        todo = [read for read in reads if not read.done]
        if not todo:
            break
        try:
            for pool, group in _pools(r, todo, cluster).items():
                _fetch(pool, group, first)
        except (ResponseError, redis.ConnectionError) as exc:
            moved = str(exc).startswith(("MOVED", "ASK"))
            # A lost master (refused connection): its replica serves its slots once the cluster
            # has failed over, so ask again on a fresh map and a finished failover is latency.
            # Not a refusal on its merits (auth, no connections left, still loading).
            lost = isinstance(exc, redis.ConnectionError) and not isinstance(exc, _NOT_A_LOST_NODE)
            if not cluster or not (moved or lost):
                raise
            with contextlib.suppress(RedisError, RedisClusterException):
                r.nodes_manager.initialize()  # a slot moved, or a master failed over
            if lost and attempt == READ_TRIES - 1:
                raise


def _pools(r: Any, reads: list[Read], cluster: bool) -> dict[Any, list[Read]]:
    if not cluster:
        return {r.connection_pool: reads}
    pools: dict[Any, list[Read]] = {}
    for read in reads:
        node = r.get_redis_connection(r.get_node_from_key(read.mkey))
        pools.setdefault(node.connection_pool, []).append(read)
    return pools


def _fetch(pool: Any, reads: list[Read], first: int) -> None:
    """Send MULTI, GET manifest, GET chunks, EXEC per frame; land the replies."""
    spans = [range(read.got, frame_of(read.manifest)[0] if read.manifest else first) for read in reads]
    commands: list[tuple[str, ...]] = []
    for read, span in zip(reads, spans):
        commands += [("MULTI",), ("GET", read.mkey), *(("GET", f"{read.mkey}:{i}") for i in span), ("EXEC",)]
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        wire = Wire(conn._sock)  # noqa: SLF001 - redis-py's socket: see this module's docstring
        for read, span in zip(reads, spans):
            for _ in range(len(span) + 3):  # +OK, +QUEUED per GET, the EXEC array header
                wire.line()
            read.land(wire, span)
        if wire.buf:
            raise InvalidResponse("bytes after the last reply")
    except BaseException:
        conn.disconnect()  # replies may be half read: this connection is done
        raise
    finally:
        pool.release(conn)
