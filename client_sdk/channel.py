"""A co-located client's end of the server's commit channel (``server.commit_channel``).

The blocking transport (``HttpTransport``) sends the calls the channel serves
(``kvstore.wire.channel.PATHS``: a pooled put's one request, by tokens or by key) over it once the client has mapped
the server's arena and learnt the socket from ``/v1/info``; every other call, and every call of
the async client, goes over HTTP. A call takes an idle socket (at most ``IDLE_SOCKETS`` are
kept) or opens one, and gives it back after its answer: threads that come and go share a few
connections, and a socket is only ever in one call's hands.

When the channel cannot carry a call, ``ChannelDown`` says so and the transport sends the call
over HTTP instead:

- nothing of it reached the server (no socket: a restarted server; a refused connection; the
  server answered ``busy`` at its connection limit, before reading anything): the channel is
  ``down`` for ``RETRY_AFTER_S``, and HTTP carries its calls meanwhile;
- a socket kept idle that the server closed (its idle timeout): the request fails to send on a
  Unix socket, so it is sent again on a new connection first;
- the connection closed after the request went and before its answer (the server died
  mid-call): the request may have run. HTTP resends it, as the HTTP transport resends over a
  dropped connection; a pooled put whose slots were already published is refused there
  (``Forbidden``), and the put flow forgets its pool and puts another way. The slots that lost
  answer lent stay lent to this process under the pool's name (within the pool's cap) until it
  exits: handing the pool back instead could free slots another thread of this client is
  writing into.

A call the server answered with an error raises that typed error, as over HTTP; a call with no
answer within the transport's timeout raises ``RequestTimeout`` and is not resent (it may be
running).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, TypeVar

from client_sdk.calls import Call
from kvstore.errors import RequestTimeout
from kvstore.wire.channel import ANSWER, BUSY, PATHS, REQUEST, head, recv_exact
from kvstore.wire.errors import error_from

__all__ = ["CommitChannel", "ChannelDown", "IDLE_SOCKETS", "RETRY_AFTER_S"]

T = TypeVar("T")

IDLE_SOCKETS = 4
"""Idle connections a client keeps for its next calls; more are closed as they come back."""
RETRY_AFTER_S = 5.0
"""How long a channel that refused a call (or could not be reached) leaves its calls to HTTP."""


class ChannelDown(ConnectionError):
    """The channel could not carry a call: send it over HTTP."""


class CommitChannel:
    """Calls of ``PATHS`` over the server's Unix socket at ``path``.

    Args:
        path: the socket (``/v1/info``'s ``colocated.commit_socket``).
        token, namespace, agent: sent with every call, as the HTTP transport sends them.
        timeout_s: how long a call waits for its answer (None: as long as it takes).
        connect_timeout_s: how long a connection may take.
    """

    def __init__(self, path: str, token: str | None, namespace: str, agent: str | None,
                 timeout_s: float | None, connect_timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._fields = (f"Bearer {token}" if token else None, namespace, agent or None)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._closed = False
        self.failures = 0
        """Calls it could not carry (the transport logs the first at info, the rest at debug)."""

    @property
    def up(self) -> bool:
        """Whether calls go over the channel now (not closed, and not within ``RETRY_AFTER_S``
        of a refusal)."""
        return not self._closed and time.monotonic() >= self._down_until

    @staticmethod
    def serves(call: Call[Any]) -> bool:
        return call.method == "POST" and call.path.split("?", 1)[0] in PATHS

    def run(self, call: Call[T]) -> T:
        """Send ``call`` and read its answer.

        Raises:
            ChannelDown: the channel could not carry it (send it over HTTP).
            RequestTimeout: no answer in ``timeout_s``.
            the typed error of an error answer.
        """
        h = head(call.method, call.path, *self._fields)
        body = b"".join(call.parts)  # a pooled put's head and tokens: small
        request = REQUEST.pack(len(h), len(body)) + h + body
        sock, reused = self._take()
        try:
            try:
                sock.sendall(request)
            except OSError:
                if not reused:
                    raise
                sock.close()  # the server closed it while idle (a Unix socket fails the send): nothing went
                sock = self._connect()
                sock.sendall(request)
            status, length = ANSWER.unpack(recv_exact(sock, ANSWER.size))
            answer = recv_exact(sock, length)
        except TimeoutError as exc:
            sock.close()
            raise RequestTimeout(f"no answer from the commit channel {self.path} in {self.timeout_s} s") from exc
        except ChannelDown:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            self._down_until = time.monotonic() + RETRY_AFTER_S
            raise ChannelDown(f"the commit channel {self.path}: {exc}") from exc
        if status == BUSY:  # at its connection limit: it read nothing, and closes this one
            sock.close()
            self._down_until = time.monotonic() + RETRY_AFTER_S
            raise ChannelDown(f"the commit channel {self.path} is at its connection limit")
        self._give_back(sock)
        if status >= 400:
            raise error_from(status, answer)
        return call.parse(answer)

    def _take(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            self._down_until = time.monotonic() + RETRY_AFTER_S
            raise ChannelDown(f"the commit channel {self.path}: {exc}") from exc
        sock.settimeout(self.timeout_s)
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < IDLE_SOCKETS:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close the idle sockets; a call under way closes its own when it ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
