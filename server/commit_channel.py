"""The commit channel: a co-located client's pooled put over a Unix socket, without HTTP.

A co-located put writes its new blocks into pool slots itself, then makes one request that
publishes them (``/v1/kv/put-pooled``; ``/v1/blocks/put-pooled`` for frames by key, as SGLang's
and LMCache's backends put). Over HTTP that request crosses uvicorn, five middlewares
and the event loop, then hops to the I/O pool and back: four thread wake-ups, and most of a
1 MiB put's time here (docs/benchmarks.md, "The commit channel"). The channel carries the same
request (the same body, the same query, the same answer) over a Unix socket whose connections
each have a thread that runs the route's work (``server.pooled``) directly: the client
wakes the thread, the thread wakes the client.

What stays the route's: the bearer token (checked on every request, in constant time, by the
``Authenticator``), the namespace rule, the co-located check, every check of the body and query
and every typed error with its status and JSON body (``kvstore.wire.errors``), and the metrics
(the channel's requests count in the route's series). What is the channel's own:

- only ``ROUTES`` (anything else: 404, and the client uses HTTP for it);
- the socket is the server user's alone: a 0600 file in a 0700 directory
  (``$TMPDIR/kvstore-commit-<pid>-*``; one left by a server killed with ``-9``, whose process is
  gone and whose socket answers nothing, is removed at the next start);
- at most ``MAX_CONNECTIONS`` connections: one more is answered ``BUSY`` before anything of it
  is read, and closed (its client uses HTTP for a while); a connection idle for
  ``IDLE_TIMEOUT_S`` is closed;
- a request begun must arrive whole within ``body_timeout_s`` plus its length at
  ``body_min_rate``, as an HTTP body must;
- at shutdown a request being answered is answered (reads end, writes do not), for up to
  ``graceful_timeout_s``; the store closes after.

Its bodies are bounded (a pooled put's head and tokens, at most ``max_tokens_per_request``) but
not charged to the in-flight memory cap: at most ``MAX_CONNECTIONS`` of them, from processes of
the server's own user.

The frames are ``kvstore.wire.channel``'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable
from urllib.parse import parse_qsl, urlsplit

from kvstore.errors import KVStoreError, MalformedRequest, PayloadTooLarge, RouteNotFound
from kvstore.wire.channel import ANSWER, BUSY, HEAD_FIELDS, MAX_HEAD_BYTES, REQUEST, recv_exact
from kvstore.wire.errors import error_body, status_for
from kvstore.wire.rest import KV_PREFIX_BYTES, MAX_HEADER_BYTES
from server import pooled
from server.requests import agent_name, check_namespace, colocated_only
from server.service import Service

__all__ = ["CommitChannel", "ROUTES", "MAX_CONNECTIONS", "start_channel", "remove_stale"]

log = logging.getLogger("kvstore.server")

MAX_CONNECTIONS = 64
"""Connections served at once: a thread each. One past it is answered ``BUSY`` and closed (its
client puts over HTTP for a while, ``client_sdk.channel.RETRY_AFTER_S``)."""
IDLE_TIMEOUT_S = 30.0
"""An idle connection is closed after this long (a client keeps a few; it connects again)."""
ACCEPT_RETRY_S = 0.05
"""The pause after a failed accept (no descriptors left, say) before the next."""
SOCKET_NAME = "commit.sock"
INTERNAL_ERROR = json.dumps({"error": {"type": "ServiceError", "message": "internal server error"}}).encode()
"""The body of a 500, as the HTTP routes' last-resort handler answers it (the traceback goes to the log)."""
_PREFIX = "kvstore-commit-"


ROUTES: dict[tuple[str, str], Callable[..., dict]] = {("POST", "/v1/kv/put-pooled"): pooled.put_pooled,
                                                     ("POST", "/v1/blocks/put-pooled"): pooled.put_pooled_blocks}
"""The requests the channel serves, by (method, path), as ``kvstore.wire.channel.PATHS`` lists
them: each a function of ``(svc, principal, namespace, body, query, agent)`` that returns the
JSON answer."""


class CommitChannel:
    """The listening socket, its acceptor thread and a thread per connection.

    Args:
        svc: the service whose store the requests reach.
        directory: where the socket goes (a new 0700 directory under the temp dir by default).
    """

    def __init__(self, svc: Service, directory: str | None = None) -> None:
        self.svc = svc
        self.dir = directory or tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self.dir, SOCKET_NAME)
        self.timeout_s = svc.settings.body_timeout_s or None
        self.min_rate = max(1, svc.settings.body_min_rate)
        self.max_body = min(svc.settings.max_body_bytes,
                            KV_PREFIX_BYTES + MAX_HEADER_BYTES + 4 * svc.settings.max_tokens_per_request)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            os.chmod(self.path, 0o600)  # the directory (0700) already keeps others out
            self._listener.listen(MAX_CONNECTIONS)
        except OSError:
            self._listener.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._series: dict[tuple[str, str, int], tuple[Any, Any, Any]] = {}
        self._acceptor = threading.Thread(target=self._accept, name="kvstore-commit-channel", daemon=True)
        self._acceptor.start()

    # -- connections ------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn = _accept_one(self._listener)
            except OSError as exc:
                if self._closed:
                    return
                # out of descriptors, say: the connections waiting are served once it passes
                log.warning("kvstore: the commit channel could not accept a connection: %s", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    t = None
                else:
                    t = self._conns[conn] = threading.Thread(target=self._serve, args=(conn,),
                                                             name="kvstore-commit-conn", daemon=True)
            if t is None:
                self._refuse(conn)
                continue
            try:
                t.start()
            except RuntimeError:  # no thread to be had: the client sends it another way
                with self._lock:
                    self._conns.pop(conn, None)
                self._refuse(conn)

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._conns)

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        """``BUSY``, before anything of a request is read, then close: the client knows its request
        did not run and sends it over HTTP."""
        with contextlib.suppress(OSError):
            conn.sendall(ANSWER.pack(BUSY, 0))
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                conn.settimeout(IDLE_TIMEOUT_S)  # an idle connection waits this long for its next request
                try:
                    first = conn.recv(REQUEST.size)
                except TimeoutError:
                    return  # idle: the client finds it closed at its next send, and connects again
                if not first:
                    return
                # a request begun arrives whole within body_timeout_s, plus its length at body_min_rate
                deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
                fixed = first + recv_exact(conn, REQUEST.size - len(first), deadline)
                head_len, body_len = REQUEST.unpack(fixed)
                if head_len > MAX_HEAD_BYTES or body_len > self.max_body:
                    # the rest is left unread: answer and close
                    self._send(conn, *self._error(PayloadTooLarge(
                        f"a commit channel request of {head_len} + {body_len} bytes is over its "
                        f"{MAX_HEAD_BYTES} + {self.max_body}-byte limit", field="body")))
                    return
                if deadline is not None:
                    deadline += (head_len + body_len) / self.min_rate
                head = recv_exact(conn, head_len, deadline)
                body = recv_exact(conn, body_len, deadline)
                with self.svc.store.scrubber.answering():  # its frames verified once it has its answer
                    self._send(conn, *self._answer(head, body))
        except OSError:
            return  # the client went, or stalled past its deadline: its connection goes
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    @staticmethod
    def _send(conn: socket.socket, status: int, answer: bytes) -> None:
        conn.sendall(ANSWER.pack(status, len(answer)) + answer)

    # -- requests -----------------------------------------------------------------------------

    def _answer(self, raw_head: bytes, body: bytes) -> tuple[int, bytes]:
        start = time.perf_counter()
        route, method = "unmatched", "?"
        try:
            try:
                head = json.loads(raw_head)
            except ValueError:
                head = None
            if not isinstance(head, dict) or not all(isinstance(head.get(k), (str, type(None))) for k in HEAD_FIELDS):
                raise MalformedRequest("a commit channel request head is a JSON object of strings: method, "
                                       "path, authorization, namespace, agent", field="head")
            url = urlsplit(head.get("path") or "")
            fn = ROUTES.get((head.get("method"), url.path))
            if fn is None:
                raise RouteNotFound(f"the commit channel serves {sorted(p for _, p in ROUTES)}, not "
                                    f"{head.get('method')} {url.path!r}"[:512], status=404)
            route, method = url.path, head["method"]  # labels only from what matched: the series stay few
            svc = self.svc
            p = svc.auth.authenticate(head.get("authorization"))
            colocated_only(svc)
            ns = check_namespace(p, head.get("namespace") or "default")
            svc.tally.flush()  # as the I/O pool does first: the loop's counted reads come before
            status, answer = 200, fn(svc, p, ns, body, dict(parse_qsl(url.query)), agent_name(head.get("agent")))
            out = json.dumps(answer).encode()
        except KVStoreError as exc:
            status, out = self._error(exc)
        except Exception:  # noqa: BLE001 - the same 500 as the HTTP routes' last resort
            log.exception("kvstore: commit channel request failed")
            status, out = 500, INTERNAL_ERROR
        self._observe(route, method, status, time.perf_counter() - start)
        return status, out

    def _error(self, exc: KVStoreError) -> tuple[int, bytes]:
        status = status_for(exc)
        if status in (401, 403):
            self.svc.metrics.auth_failures.labels(str(status)).inc()
        return status, json.dumps(error_body(exc)).encode()

    def _observe(self, route: str, method: str, status: int, took_s: float) -> None:
        key = (route, method, status)
        series = self._series.get(key)
        if series is None:
            m = self.svc.metrics
            series = self._series[key] = (m.latency.labels(route, method), m.requests.labels(route, method, str(status)),
                                          m.channel.labels(str(status)))
        series[0].observe(took_s)
        series[1].inc()
        series[2].inc()

    # -- lifetime -----------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, end every connection, and wait up to ``timeout_s`` for requests being
        answered (the store closes after this); remove the socket and its directory."""
        with self._lock:
            self._closed = True
            conns = dict(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:  # wakes a thread waiting for its next request; one mid-request still answers
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + timeout_s
        for t in (self._acceptor, *conns.values()):
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.dir, ignore_errors=True)




def remove_stale(tmp: str | None = None) -> int:
    """Remove channel directories under ``tmp`` (the temp dir) left by servers that are gone
    (killed with ``-9``): this user's, named for a process that no longer runs. How many."""
    tmp = tmp or tempfile.gettempdir()
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            if not name.startswith(_PREFIX):
                continue
            pid = name[len(_PREFIX):].split("-", 1)[0]
            path = os.path.join(tmp, name)
            with contextlib.suppress(OSError):
                if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or _alive(int(pid)):
                    continue
                if _answers(os.path.join(path, SOCKET_NAME)):  # a live server in another pid namespace
                    continue
                shutil.rmtree(path)
                removed += 1
    return removed


def _accept_one(listener: socket.socket) -> socket.socket:
    """The next connection (a seam: tests inject accept failures here)."""
    return listener.accept()[0]


def _answers(path: str) -> bool:
    """Whether a server listens on the socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_channel(svc: Service) -> CommitChannel | None:
    """The channel, when this server offers the co-located path and the channel is on
    (``KVSTORE_COMMIT_CHANNEL``); None otherwise, or when the socket cannot be made (logged:
    clients put over HTTP)."""
    if not svc.settings.commit_channel or svc.staging is None or svc.shm is None:
        return None
    remove_stale()
    try:
        return CommitChannel(svc)
    except OSError as exc:
        log.warning("kvstore: no commit channel (%s): co-located puts commit over HTTP", exc)
        return None
