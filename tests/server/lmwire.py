"""A minimal lm:// client for tests: raw sockets and ``struct``, independent of the server's code.

The layouts are LMCache 0.5.6's (see ``kvstore/wire/lmcache.py``'s docstring): a
186-byte request meta ``<9i150s`` (command, length, fmt, dtype, location, shape[4],
space-padded key) and a 36-byte answer meta ``<9i`` (code, length, fmt, dtype, shape[4],
location). Written apart from the server's module so that a test of the wire format does
not share the code it tests.
"""

from __future__ import annotations

import socket
import struct

PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
KV_2LTD, BINARY = 1, 4
BF16, FP16, UINT8 = 3, 2, 6


def connect(port: int, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def meta(command: int, key: str | bytes, length: int = 0, fmt: int = KV_2LTD, dtype: int = FP16,
         shape: tuple[int, ...] = (0, 0, 0, 0)) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    dims = (list(shape) + [0, 0, 0, 0])[:4]
    return struct.pack("<9i150s", command, length, fmt, dtype, 0, *dims, raw.ljust(150))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def answer(sock: socket.socket) -> tuple[int, ...]:
    """(code, length, fmt, dtype, s0, s1, s2, s3, location)."""
    return struct.unpack("<9i", recv_exact(sock, 36))


def put(sock: socket.socket, key: str, payload: bytes, fmt: int = KV_2LTD, dtype: int = BF16,
        shape: tuple[int, ...] | None = None) -> None:
    sock.sendall(meta(PUT, key, len(payload), fmt, dtype, shape or (len(payload) // 2,)))
    sock.sendall(payload)


def exists(sock: socket.socket, key: str) -> bool:
    sock.sendall(meta(EXIST, key))
    return answer(sock)[0] == 200


def get(sock: socket.socket, key: str) -> tuple[tuple[int, ...], bytes | None]:
    """(the answer meta, the payload or None on a miss)."""
    sock.sendall(meta(GET, key))
    head = answer(sock)
    if head[0] != 200:
        return head, None
    return head, recv_exact(sock, head[1])


def list_keys(sock: socket.socket) -> list[str]:
    sock.sendall(meta(LIST, "x@1@0@0@half"))
    head = answer(sock)
    body = recv_exact(sock, head[1]).decode()
    return body.split("\n") if body else []


def health(sock: socket.socket) -> int:
    sock.sendall(meta(HEALTH, "x@1@0@0@half"))
    return answer(sock)[0]


def is_closed(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset within ``timeout_s``)."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
