"""Group commit for a file tier: one ``syncfs`` makes every write made before it durable.

A file tier that syncs each write before the put returns pays a journal commit per block
(an ``fdatasync`` and a directory ``fsync``: 1-2 ms a 64 KiB block here, about 27 MB/s),
and a put into a full top tier waited for it. With a group commit the tier writes through
the page cache and returns; a thread of its own calls ``syncfs`` on the tier's file system
every ``interval_s`` while there are unsynced writes, and at once when someone waits
(``sync``): a durable put (``put_kv(durable=True)``) and a store closing. One call covers
every file and directory entry written before it, however many.

What a crash can cost: a ``kill -9`` of the server nothing (written pages belong to the
kernel); a host crash or power cut the writes of the last interval that nobody waited for.
A file cut short or left with zeros by such a crash fails its length or checksum check at
start or on read: it is a miss and goes to quarantine, never served.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from typing import Callable

__all__ = ["GroupCommit", "syncfs"]

log = logging.getLogger("kvstore.tiers")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syncfs = getattr(_libc, "syncfs", None)


def syncfs(fd: int) -> None:
    """Sync the file system holding ``fd`` (Linux ``syncfs``; ``sync`` where it is missing).

    Raises:
        OSError: the kernel reported a write-back error.
    """
    if _syncfs is None:
        os.sync()
        return
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


class GroupCommit:
    """Counts writes and syncs them in groups, from a thread of its own.

    Args:
        path: a directory on the file system to sync (the tier's data directory).
        interval_s: the longest an unsynced write waits for a sync nobody asked for.
        on_error: called with each failed sync's error (the tier counts it); the writes it
            covered stay unsynced and the next sync tries them again.

    Raises:
        OSError: ``path`` cannot be opened.
    """

    def __init__(self, path: str, interval_s: float, on_error: Callable[[OSError], None] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self.interval_s = interval_s
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._on_error = on_error
        self._cv = threading.Condition()
        self._written = 0
        """Writes counted so far (``wrote``)."""
        self._synced = 0
        """Of those, how many the last successful sync covered."""
        self._wanted = 0
        """The write count a waiter needs synced: the thread syncs at once while it is ahead."""
        self._error: OSError | None = None
        self._closed = False
        self.syncs = 0
        """Successful syncs so far."""
        self.sync_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="kvstore-group-commit", daemon=True)
        self._thread.start()

    @property
    def unsynced(self) -> int:
        """Writes not yet covered by a sync."""
        with self._cv:
            return self._written - self._synced

    def wrote(self) -> None:
        """Count one write, complete in the page cache (its name included)."""
        with self._cv:
            self._written += 1

    def sync(self, timeout_s: float | None = 60.0) -> None:
        """Return once every write counted before this call is synced.

        Raises:
            OSError: the sync that would cover them failed (EIO...), or none did in ``timeout_s``.
        """
        with self._cv:
            target = self._written
            if self._synced >= target:
                return
            self._wanted = max(self._wanted, target)
            self._error = None
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._synced >= target or self._error is not None or self._closed,
                                     timeout_s):
                raise OSError(f"no sync covered the tier's writes within {timeout_s} s")
            if self._synced < target:
                raise self._error or OSError("the tier closed before its writes were synced")

    def close(self) -> None:
        """Sync what is left, stop the thread, close the directory. Idempotent."""
        with self._cv:
            if self._closed:
                return
        try:
            self.sync()
        except OSError as exc:
            log.warning("kvstore: the last group commit failed at close (%s): writes since the last "
                        "sync may not survive a host crash", exc)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(10)
        os.close(self._fd)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._wanted > self._synced, self.interval_s)
                if self._closed:
                    return
                target = self._written
                if target <= self._synced:
                    continue
            start = time.perf_counter()
            try:
                syncfs(self._fd)
            except OSError as exc:
                if self._on_error is not None:
                    self._on_error(exc)
                with self._cv:
                    self._error = exc
                    self._cv.notify_all()
                    self._cv.wait(self.interval_s)  # a failing disk is not hammered
                continue
            with self._cv:
                self._synced = max(self._synced, target)
                self.syncs += 1
                self.sync_seconds += time.perf_counter() - start
                self._cv.notify_all()
