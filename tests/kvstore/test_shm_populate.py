"""``populate_behind``: a client's mapping of the server's arena faulted in off the caller's path."""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvstore.memory.shm import populate_behind


def _rss_kib(mapping: mmap.mmap) -> int:
    """This process's resident KiB in the mapping's range (``/proc/self/smaps``)."""
    start = np.frombuffer(mapping, np.uint8).ctypes.data
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("mapping not in /proc/self/smaps")


def test_a_writers_mapping_is_faulted_in_behind(tmp_path):
    path = f"/dev/shm/kvstore-test-populate-{os.getpid()}"
    size = 8 << 20
    with open(path, "wb") as f:  # the server's pages exist (a populated arena): only the mapping is new
        f.write(b"\1" * size)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            cold = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
            warm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        populate_behind(warm, 4096, size - 4096, write=True).join(timeout=10)
        assert _rss_kib(cold) < 64
        assert _rss_kib(warm) >= (size - 4096) // 1024  # every page of the range, with no touch from here
        warm[4096:4100] = b"abcd"  # still the same shared pages, writable
        assert cold[4096:4100] == b"abcd"
        cold.close()
        warm.close()  # the populate let go of it
    finally:
        os.unlink(path)
