"""What this machine can do at most, measured in the same run as the paths that use it.

============  ===============================================================
row           one operation
============  ===============================================================
memcpy        ``np.copyto`` into a reused buffer (the co-located paths' limit)
memcpy x2     the same copy in two halves on two threads, as kvstore's large
              copies run (``kvstore.memory.halves``; one thread below its
              16 MiB floor or with ``KVSTORE_COPY_THREADS=1``)
shm out       a copy out of a pre-faulted ``/dev/shm`` segment into a reused
              buffer (what a co-located get does at best)
tcp get/put   n bytes over a loopback TCP connection to a child process,
              received with ``recv_into`` a reused buffer / sent and acked
              (the remote paths' limit: no HTTP, no framing)
file put/get  one file rewritten in place + fsync / a read of it after its
              pages are dropped from the page cache (the NVMe tier's limit; the
              tier writes with O_DIRECT, which can beat it)
============  ===============================================================

    python -m bench.limits tcp HOST PORT     the TCP peer (what ``Limits`` spawns)
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from multiprocessing import shared_memory

import numpy as np

from bench.sampling import Row, timed
from kvstore.memory import halves

__all__ = ["Limits"]

_HEAD = struct.Struct("!cQ")


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError("the TCP peer closed the connection")
        view = view[n:]


class Limits:
    """The limit rows at one size; ``close`` releases the segment, the file and the TCP peer."""

    def __init__(self, nbytes: int, workdir: str) -> None:
        self.nbytes = nbytes
        rng = np.random.default_rng(2)
        # Real bytes to copy: an untouched np.empty maps the shared zero page, and copying
        # from it runs from cache at an unreal speed.
        self.src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.empty(nbytes, np.uint8)
        self.dst.fill(0)
        self._path = os.path.join(workdir, f"limit-{nbytes}.bin")
        self._tcp, self._peer = self._tcp_peer()
        self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self._shm_view = np.frombuffer(self._shm.buf, np.uint8, nbytes)
        np.copyto(self._shm_view, self.src)

    def _tcp_peer(self) -> tuple[socket.socket, subprocess.Popen]:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            listener.settimeout(30)
            peer = subprocess.Popen([sys.executable, "-m", "bench.limits", "tcp", "127.0.0.1",
                                     str(listener.getsockname()[1])])
            try:
                conn, _ = listener.accept()
            except OSError:
                peer.kill()
                peer.wait()
                raise
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, peer

    def rows(self) -> dict[str, Row]:
        n = self.nbytes
        dst, src = self.dst, self.src
        buf = memoryview(dst)
        ack = bytearray(1)

        def tcp_get() -> None:
            self._tcp.sendall(_HEAD.pack(b"G", n))
            _recv_exactly(self._tcp, buf)

        def tcp_put() -> None:
            self._tcp.sendall(_HEAD.pack(b"P", n))
            self._tcp.sendall(memoryview(src))
            _recv_exactly(self._tcp, memoryview(ack))

        def file_put() -> None:
            # Rewritten in place, as the NVMe tier rewrites its files: no truncation, so the
            # file system need not allocate the blocks again each time.
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                if os.pwrite(fd, memoryview(src), 0) != n:
                    raise OSError(f"short write to {self._path}")
                os.fsync(fd)
            finally:
                os.close(fd)

        def file_get() -> float:
            fd = os.open(self._path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: outside the clock
                start = time.perf_counter()
                got = os.preadv(fd, [buf], 0)
                took = time.perf_counter() - start
            finally:
                os.close(fd)
            if got != n:
                raise OSError(f"short read from {self._path}: {got} of {n} bytes")
            return took

        file_put()
        return {
            "limit memcpy": Row(n, timed(lambda: np.copyto(dst, src))),
            "limit memcpy x2": Row(n, timed(lambda: halves.copyto(dst, src))),
            "limit shm out": Row(n, timed(lambda: np.copyto(dst, self._shm_view))),
            "limit tcp get": Row(n, timed(tcp_get)),
            "limit tcp put": Row(n, timed(tcp_put)),
            "limit file put": Row(n, timed(file_put)),
            "limit file get": Row(n, file_get),
        }

    def close(self) -> None:
        self._tcp.close()
        try:
            self._peer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._peer.kill()
            self._peer.wait()
        self._shm_view = None  # the segment's buffer can only close with no view left on it
        self._shm.close()
        self._shm.unlink()
        if os.path.exists(self._path):
            os.unlink(self._path)


def _tcp_serve(host: str, port: int) -> None:
    """Answer ``G n`` with n bytes and ``P n`` (then n bytes) with one byte, until closed."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1)
    head = bytearray(_HEAD.size)
    with sock:
        while True:
            try:
                _recv_exactly(sock, memoryview(head))
            except ConnectionError:
                return
            op, n = _HEAD.unpack(head)
            if len(buf) < n:
                buf = bytearray(os.urandom(n))
            if op == b"G":
                sock.sendall(memoryview(buf)[:n])
            else:
                _recv_exactly(sock, memoryview(buf)[:n])
                sock.sendall(b"k")


if __name__ == "__main__":
    _tcp_serve(sys.argv[2], int(sys.argv[3]))
