"""The ``lm://`` listener: LMCache's remote connector uses kvstore as it would its own server.

``kvstore serve --lmcache-port P`` runs it beside uvicorn: one accept thread and a
thread per connection. LMCache keeps one long-lived connection per worker and sends
one request at a time on it; its own server is built the same way, and store calls
block anyway. A connection's requests are served in order, and a PUT is stored before
the next request is read, so an EXIST right after a PUT sees it (the PUT itself has
no answer in this protocol).

A PUT's payload is received straight into its frame's place in the tier's memory
(``KVStore.put_frame_with``), and a GET answer is sent straight from there
(``Tier.read_with``), where the tier is an arena in host memory (shm, cxl): no
per-request allocation and no staging copy.

Bad input closes that connection, with the reason logged and counted in
``kvstore_lmcache_closed_connections_total{reason}``: a short read, a length over
the limit, a payload whose length does not match its shape and dtype, an unknown
command, format or dtype, a malformed key, or a request that stalls mid-way past
``io_timeout_s``. The listener and every other connection go on; nothing is stored
from a request that did not arrive whole. An idle connection between requests may
stay open as long as the client likes: LMCache's does.

The protocol has no authentication. The listener serves one namespace and nothing
else; bind it where only the LMCache workers can reach it.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from kvstore.errors import FrameError, KVStoreError
from server.lmcache_protocol import (CLIENT_META, FAIL, SUCCESS, BadRequest, Command, Request, parse_key,
                                     parse_request, payload_length, server_meta)
from server.config import ServerSettings, is_loopback
from server.lmcache_store import LMCacheChunks
from server.service import Service

__all__ = ["LMCacheListener", "ShortRead", "start_lmcache"]

log = logging.getLogger("kvstore.lmcache")

_ACCEPT_POLL_S = 0.25
"""How often the accept loop looks whether it should stop."""
_DRAIN_BYTES = 4 << 20
"""Buffer for reading off a payload that could not be stored."""


class ShortRead(BadRequest):
    """The peer closed the connection, or stalled, before a whole request arrived."""

    def __init__(self, message: str) -> None:
        super().__init__("short read", message)


class LMCacheListener:
    """LMCache's ``lm://`` protocol over ``svc``'s store, on its own port.

    Args:
        svc: the service (store, buffer pool, metrics).
        host, port: where to listen; port 0 takes a free one (``self.port`` says which).
        namespace: where the chunks live.
        max_payload_bytes: a PUT of more is refused (the connection is closed).
        io_timeout_s: a request that has started must arrive, and an answer be taken, within this.
        max_connections: connections beyond this are closed at once.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, svc: Service, host: str, port: int, namespace: str, *, max_payload_bytes: int,
                 io_timeout_s: float = 30.0, max_connections: int = 256) -> None:
        self.svc = svc
        self.chunks = LMCacheChunks(svc.store, namespace)
        self.max_payload_bytes = max_payload_bytes
        self.io_timeout_s = io_timeout_s or None
        self.max_connections = max_connections
        self._sock = socket.create_server((host, port), backlog=128)
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
        """Stop accepting, end every connection, and wait for their threads (up to ``timeout_s``)."""
        self._closing.set()
        self._accepter.join(timeout_s)
        self._sock.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading the next request
            except OSError:
                pass
        for thread in conns.values():
            thread.join(timeout_s)

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
                conn.settimeout(None)  # between requests: as long as the client likes
                if not _recv_exact(conn, memoryview(head), first=True, timeout_s=self.io_timeout_s):
                    return  # closed between requests: the normal end
                self._handle(conn, parse_request(head))
        except BadRequest as exc:
            log.warning("lm:// %s: closing the connection: %s", peer, exc)
            metrics.lmcache_closed.labels(exc.reason).inc()
        except FrameError as exc:  # a GET found its chunk damaged part-way: the client must not get it whole
            log.warning("lm:// %s: closing the connection mid-answer: %s", peer, exc)
            metrics.lmcache_closed.labels("damaged chunk").inc()
        except OSError as exc:  # reset, or a stalled send: the client is gone or not reading
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
        conn.settimeout(self.io_timeout_s)
        if req.command is Command.PUT:
            self._put(conn, req)
        elif req.command is Command.GET:
            found = self.chunks.get(parse_key(req.key), conn.sendall)
            if found:
                metrics.labels("GET", "hit").inc()
            else:
                conn.sendall(server_meta(FAIL))
                metrics.labels("GET", "miss").inc()
        elif req.command is Command.EXIST:
            found = self.chunks.exists(parse_key(req.key))
            conn.sendall(server_meta(SUCCESS if found else FAIL))
            metrics.labels("EXIST", "hit" if found else "miss").inc()
        elif req.command is Command.LIST:
            body = "\n".join(self.chunks.list_keys()).encode()
            conn.sendall(server_meta(SUCCESS, len(body)))
            conn.sendall(body)
            metrics.labels("LIST", "ok").inc()
        else:  # HEALTH
            conn.sendall(server_meta(SUCCESS))
            metrics.labels("HEALTH", "ok").inc()

    def _put(self, conn: socket.socket, req: Request) -> None:
        key = parse_key(req.key)
        if req.length > self.max_payload_bytes:
            raise BadRequest("too large", f"PUT of {req.length} bytes is over the {self.max_payload_bytes}-byte limit")
        want = payload_length(req.fmt, req.dtype, req.shape)
        if want is not None and want != req.length:
            raise BadRequest("length mismatch", f"PUT of {req.length} bytes, but shape {list(req.shape)} of dtype "
                                                f"code {req.dtype} takes {want}")
        received: list[bool] = []

        def receive(view: memoryview) -> None:
            _recv_exact(conn, view, first=False, timeout_s=self.io_timeout_s)
            received.append(True)

        try:
            self.chunks.put(key, req, receive)
        except BadRequest:
            raise  # a short read: the connection goes
        except KVStoreError as exc:  # no answer to carry it in: a later EXIST says 400
            if not received:  # refused before the payload was read: read it off, to stay in step
                self._drain(conn, req.length)
            log.warning("lm:// PUT %s not stored: %s: %s", key.canonical(), type(exc).__name__, exc)
            self.svc.metrics.lmcache_requests.labels("PUT", "failed").inc()
            return
        self.svc.metrics.transfer.labels("in", "lmcache").inc(req.length)
        self.svc.metrics.lmcache_requests.labels("PUT", "stored").inc()

    def _drain(self, conn: socket.socket, n: int) -> None:
        buf = self.svc.buffers.acquire(min(n, _DRAIN_BYTES))
        try:
            view = memoryview(buf)
            while n > 0:
                k = min(n, len(view))
                _recv_exact(conn, view[:k], first=False, timeout_s=self.io_timeout_s)
                n -= k
        finally:
            self.svc.buffers.release(buf)


def start_lmcache(svc: Service, settings: ServerSettings) -> LMCacheListener:
    """The listener of ``settings.lmcache_port`` over ``svc``, started.

    It binds ``lmcache_host``, else REST's host, but loopback whenever auth is off (``serve``'s rule).

    Raises:
        OSError: the port cannot be bound.
    """
    assert settings.lmcache_port is not None
    host = settings.lmcache_host or (settings.host if settings.auth_enabled or is_loopback(settings.host)
                                     else "127.0.0.1")
    lm = LMCacheListener(svc, host, settings.lmcache_port, settings.lmcache_namespace,
                         max_payload_bytes=settings.max_body_bytes, io_timeout_s=settings.body_timeout_s)
    if not is_loopback(lm.host):
        log.warning("kvstore: the lm:// listener on %s:%d has no authentication (LMCache's protocol has none): "
                    "whoever reaches it reads and writes namespace %r", lm.host, lm.port, settings.lmcache_namespace)
    log.info("kvstore: LMCache lm:// listener on %s:%d, namespace %r", lm.host, lm.port, settings.lmcache_namespace)
    return lm


def _recv_exact(conn: socket.socket, view: memoryview, *, first: bool, timeout_s: float | None) -> bool:
    """Fill ``view`` from ``conn``. False when the peer closed before the first byte of a
    request (``first``): a normal end between requests.

    Raises:
        ShortRead: the peer closed, or stalled past ``timeout_s``, part-way.
    """
    got, n = 0, len(view)
    while got < n:
        try:
            k = conn.recv_into(view[got:], n - got)
        except TimeoutError:
            raise ShortRead(f"short read: {got} of {n} bytes, then nothing for {timeout_s:g} s") from None
        if k == 0:
            if first and got == 0:
                return False
            raise ShortRead(f"short read: the peer closed after {got} of {n} bytes")
        if got == 0 and first:
            conn.settimeout(timeout_s)  # a request has begun: the rest must follow
        got += k
    return True

