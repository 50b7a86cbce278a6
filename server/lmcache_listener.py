"""The ``lm://`` listener: LMCache's remote connector uses kvstore as it would its own server.

``kvstore serve --lmcache-port P`` runs it beside uvicorn: one accept thread and a
thread per connection. LMCache keeps one long-lived connection per worker and sends
one request at a time on it; its own server is built the same way, and store calls
block anyway. A connection's requests are served in order, and a PUT is stored before
the next request is read, so an EXIST right after a PUT sees it (the PUT itself has
no answer in this protocol).

A PUT's payload is received straight into its frame's place in the tier's memory
(``KVStore.frames.put_with``), and a GET answer is sent straight from there
(``Tier.read_with``), where the tier is an arena in host memory (shm, cxl): no
per-request allocation and no staging copy.

Bad input closes that connection, with the reason logged and counted in
``kvstore_lmcache_closed_connections_total{reason}``: a short read, a length over
the limit, a payload whose length does not match its shape and dtype, an unknown
command, format or dtype, a malformed key, or a request that stalls or trickles
(each request must arrive, and each answer be taken, within ``io_timeout_s`` plus its
length at ``MIN_RATE``). The listener and every other connection go on; nothing is
stored from a request that did not arrive whole. An idle connection between requests
may stay open as long as the client likes: LMCache's does.

The protocol has no authentication. The listener serves one namespace, and binds
loopback unless told otherwise: bind it where only the LMCache workers can reach it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from kvstore.errors import TierError
from server.config import ServerSettings, is_loopback
from kvstore.wire.lmcache import (CLIENT_META, FAIL, SUCCESS, BadRequest, Command, Request, parse_key,
                                     parse_request, payload_length, server_meta)
from server.lmcache_store import LMCacheChunks
from server.service import Service

__all__ = ["LMCacheListener", "ShortRead", "start_lmcache"]

log = logging.getLogger("kvstore.lmcache")

_ACCEPT_POLL_S = 0.25
"""How often the accept loop looks whether it should stop."""
_SEND_PIECE_BYTES = 4 << 20
"""Answers go out in pieces this big, so a reader that stalls is caught by the deadline."""
MIN_RATE = 1 << 20
"""Bytes a second a request or an answer must average past ``io_timeout_s`` (as REST's bodies)."""


class ShortRead(BadRequest):
    """The peer closed the connection, or stalled, before a whole request arrived."""

    def __init__(self, message: str) -> None:
        super().__init__("short read", message)


class _Deadline:
    """Until when one request may take to arrive, or one answer to be taken."""

    __slots__ = ("at", "timeout_s")

    def __init__(self, timeout_s: float | None, nbytes: int) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s + nbytes / MIN_RATE

    def left(self) -> float | None:
        """Seconds left (None: no limit); raises TimeoutError once none is."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left


class LMCacheListener:
    """LMCache's ``lm://`` protocol over ``svc``'s store, on its own port.

    Args:
        svc: the service (store, buffer pool, metrics).
        host, port: where to listen; port 0 takes a free one (``self.port`` says which).
        namespace: where the chunks live.
        max_payload_bytes: a PUT of more is refused (the connection is closed).
        io_timeout_s: how long a request that has started may stall, or an answer wait to be
            taken, before the connection is closed; 0 for no limit.
        max_connections: connections beyond this are closed at once.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, svc: Service, host: str, port: int, namespace: str, *, max_payload_bytes: int,
                 io_timeout_s: float = 30.0, max_connections: int = 256) -> None:
        self.svc = svc
        self.chunks = LMCacheChunks(svc.store, namespace, svc.buffers)
        self.max_payload_bytes = max_payload_bytes
        self.io_timeout_s = io_timeout_s or None
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._sock.settimeout(_ACCEPT_POLL_S)
        self.host, self.port = self._sock.getsockname()[:2]
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._accepter = threading.Thread(target=self._accept, name=f"lmcache-accept-{self.port}", daemon=True)
        self._accepter.start()

    # -- lifecycle -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set():
                    return
                log.exception("lm:// listener: accept failed")
                continue
            with self._lock:
                if len(self._conns) >= self.max_connections:
                    log.warning("lm:// %s: refused, %d connections already open", peer, len(self._conns))
                    self.svc.metrics.lmcache_closed.labels("too many connections").inc()
                    conn.close()
                    continue
                thread = threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                                          name=f"lmcache-conn-{peer[1]}")
                self._conns[conn] = thread
            thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, end every connection, and wait for their threads: ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        self._closing.set()
        self._accepter.join(timeout_s)
        self._sock.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading or sending
            except OSError:
                pass
        for thread in conns.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = sum(t.is_alive() for t in conns.values())
        if alive:
            log.warning("lm:// listener: %d connection threads still busy after %.0f s", alive, timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"host": self.host, "port": self.port, "namespace": self.chunks.namespace,
                    "connections": len(self._conns)}

    # -- one connection ---------------------------------------------------------------------------

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        metrics = self.svc.metrics
        metrics.lmcache_connections.inc()
        head = bytearray(CLIENT_META.size)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._closing.is_set():
                if not _recv_exact(conn, memoryview(head), None, first=True, timeout_s=self.io_timeout_s):
                    return  # closed between requests: the normal end
                self._handle(conn, parse_request(head))
        except BadRequest as exc:
            log.warning("lm:// %s: closing the connection: %s", peer, exc)
            metrics.lmcache_closed.labels(exc.reason).inc()
        except TimeoutError:  # an answer the client did not take in time
            log.warning("lm:// %s: closing the connection: the client took no answer for %s s",
                        peer, self.io_timeout_s)
            metrics.lmcache_closed.labels("stalled reader").inc()
        except OSError as exc:  # reset: the client is gone
            if not self._closing.is_set():
                log.info("lm:// %s: connection ended: %s", peer, exc)
        except Exception:  # noqa: BLE001 - one connection's bug must not take the listener down
            log.exception("lm:// %s: unexpected error; closing the connection", peer)
            metrics.lmcache_closed.labels("internal error").inc()
        finally:
            metrics.lmcache_connections.dec()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _handle(self, conn: socket.socket, req: Request) -> None:
        metrics = self.svc.metrics.lmcache_requests
        if req.command is Command.PUT:
            self._put(conn, req)
        elif req.command is Command.GET:
            sent = self.chunks.get(parse_key(req.key), lambda data: self._send(conn, data))
            if not sent:
                self._send(conn, server_meta(FAIL))
            metrics.labels("GET", "hit" if sent else "miss").inc()
        elif req.command is Command.EXIST:
            found = self.chunks.exists(parse_key(req.key))
            self._send(conn, server_meta(SUCCESS if found else FAIL))
            metrics.labels("EXIST", "hit" if found else "miss").inc()
        elif req.command is Command.LIST:
            body = "\n".join(self.chunks.list_keys()).encode()
            self._send(conn, server_meta(SUCCESS, len(body)))
            self._send(conn, body)
            metrics.labels("LIST", "ok").inc()
        else:  # HEALTH
            self._send(conn, server_meta(SUCCESS))
            metrics.labels("HEALTH", "ok").inc()

    def _put(self, conn: socket.socket, req: Request) -> None:
        key = parse_key(req.key)
        if req.length > self.max_payload_bytes:
            raise BadRequest("too large", f"PUT of {req.length} bytes is over the {self.max_payload_bytes}-byte limit")
        want = payload_length(req.fmt, req.dtype, req.shape)
        if want is not None and want != req.length:
            raise BadRequest("length mismatch", f"PUT of {req.length} bytes, but shape {list(req.shape)} of dtype "
                                                f"code {req.dtype} takes {want}")
        deadline = _Deadline(self.io_timeout_s, req.length)

        def receive(view: memoryview) -> None:
            _recv_exact(conn, view, deadline, first=False, timeout_s=self.io_timeout_s)

        try:  # a short read (BadRequest) closes the connection; a TierError comes with the payload read off
            self.chunks.put(key, req, receive)
        except TierError as exc:  # no answer to carry it in: a later EXIST says 400
            log.warning("lm:// PUT %s not stored: %s: %s", key.canonical(), type(exc).__name__, exc)
            self.svc.metrics.lmcache_requests.labels("PUT", "failed").inc()
            return
        self.svc.metrics.transfer.labels("in", "lmcache").inc(req.length)
        self.svc.metrics.lmcache_requests.labels("PUT", "stored").inc()

    def _send(self, conn: socket.socket, data: memoryview | bytes) -> None:
        """Send ``data`` whole within ``io_timeout_s`` plus its length at ``MIN_RATE`` (TimeoutError
        otherwise). A 36-byte meta goes in one call: LMCache's connector reads it with one ``recv``."""
        deadline = _Deadline(self.io_timeout_s, len(data))
        view = memoryview(data).cast("B")
        for at in range(0, len(view), _SEND_PIECE_BYTES):
            conn.settimeout(deadline.left())
            conn.sendall(view[at : at + _SEND_PIECE_BYTES])


def start_lmcache(svc: Service, settings: ServerSettings) -> LMCacheListener:
    """The listener of ``settings.lmcache_port`` over ``svc``, started.

    It binds ``lmcache_host``, loopback when that is not set: the protocol has no
    authentication, so reaching it from other hosts is a choice to make, not a default.

    Raises:
        OSError: the port cannot be bound.
    """
    assert settings.lmcache_port is not None
    lm = LMCacheListener(svc, settings.lmcache_host or "127.0.0.1", settings.lmcache_port,
                         settings.lmcache_namespace, max_payload_bytes=settings.max_body_bytes,
                         io_timeout_s=settings.body_timeout_s)
    if not is_loopback(lm.host):
        log.warning("kvstore: the lm:// listener on %s:%d has no authentication (LMCache's protocol has none): "
                    "whoever reaches it reads and writes namespace %r, and can make room there by evicting "
                    "other entries", lm.host, lm.port, settings.lmcache_namespace)
    log.info("kvstore: LMCache lm:// listener on %s:%d, namespace %r", lm.host, lm.port, settings.lmcache_namespace)
    return lm


def _recv_exact(conn: socket.socket, view: memoryview, deadline: _Deadline | None, *, first: bool,
                timeout_s: float | None) -> bool:
    """Fill ``view`` from ``conn`` by ``deadline``. With ``first`` (a request's first bytes) the
    wait for its first byte has no limit, the rest ``timeout_s``; False when the peer closed
    before that first byte: a normal end between requests.

    Raises:
        ShortRead: the peer closed, stalled, or trickled past the deadline, part-way.
    """
    got, n = 0, len(view)
    if first:
        conn.settimeout(None)  # between requests: as long as the client likes
    while got < n:
        try:
            if deadline is not None:
                conn.settimeout(deadline.left())
            k = conn.recv_into(view[got:], n - got)
        except TimeoutError:
            raise ShortRead(f"short read: {got} of {n} bytes by the deadline ({timeout_s} s, then "
                            f"{MIN_RATE >> 20} MiB/s)") from None
        if k == 0:
            if first and got == 0:
                return False
            raise ShortRead(f"short read: the peer closed after {got} of {n} bytes")
        if got == 0 and first:
            deadline = _Deadline(timeout_s, n)  # a request has begun: the rest must follow
        got += k
    return True
