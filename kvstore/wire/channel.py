"""The commit channel's frames: a co-located client's pooled puts over a Unix socket.

The server end is ``server.commit_channel``, the client end ``client_sdk.channel``. A request
is one HTTP request of ``PATHS`` without HTTP: ``REQUEST`` (head length, body length), the
head as JSON (``head``: method, path with its query, and the ``Authorization``,
``X-KV-Namespace`` and ``X-KV-Agent`` headers' values), then the body as that route takes it.
The answer is ``ANSWER`` (status, length), then the body the route answers with: its JSON, or
the error body of ``kvstore.wire.errors`` for a status of 400 or more.
"""

from __future__ import annotations

import json
import socket
import struct
import time

__all__ = ["REQUEST", "ANSWER", "BUSY", "MAX_HEAD_BYTES", "PATHS", "HEAD_FIELDS", "head", "recv_exact"]

REQUEST = struct.Struct("<II")
ANSWER = struct.Struct("<HI")
BUSY = 1
"""An answer's status when the server is at its connection limit: it read nothing of the
request, and closes the connection (the client sends it another way)."""
MAX_HEAD_BYTES = 16 << 10
"""A request head's most bytes: a path with its query and three short header values."""
PATHS = frozenset({"/v1/kv/put-pooled", "/v1/blocks/put-pooled"})
"""The routes the channel serves (``POST``)."""
HEAD_FIELDS = ("method", "path", "authorization", "namespace", "agent")
"""A head's members: each a string, or null for a header not sent."""


def head(method: str, path: str, authorization: str | None, namespace: str | None, agent: str | None) -> bytes:
    """A request's head, encoded."""
    return json.dumps({"method": method, "path": path, "authorization": authorization, "namespace": namespace,
                       "agent": agent}, separators=(",", ":")).encode()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """The next ``n`` bytes from ``sock``: by ``deadline`` (``time.monotonic()``) when given,
    else as the socket's timeout allows each read.

    Raises:
        ConnectionResetError: the other end closed first. TimeoutError: past ``deadline``, or the
            socket's timeout. OSError: the socket's.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - got} of {n} bytes had not come by the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError(f"the commit channel closed with {n - got} of {n} bytes to come")
        got += k
    return bytes(buf)
