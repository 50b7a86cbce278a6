"""Shared-memory staging for co-located puts.

A co-located client leases a range of this arena once, writes each put's KV
bytes into it, and commits with one small request; the server then encodes
straight from the arena into the store's top tier. Large payloads never cross
the socket. (A client that could encode into the tier's own slots would save
the second copy; that needs a reserve/commit API on ``ShmTier``.)

The segment is created ``0600``, so only processes of the server's user can map
it: co-location is for clients in the server's trust domain. It is unlinked on
close, at interpreter exit, and, after a ``kill -9``, by the next ``ShmTier`` to
start (the name follows ``tiers.shm.cleanup_stale``'s pattern).

A lease lasts ``ttl_s`` after its last use; an expired lease that is not being
committed goes back to the allocator, so a client that died frees its range.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

from kvstore.errors import Forbidden
from kvstore.errors import InvalidInput, TierFull, TierIOError
from kvstore.memory.slab import SlabAllocator
from kvstore.memory.shm import SHM_DIR

__all__ = ["StagingArena", "Lease"]


@dataclass(slots=True)
class Lease:
    id: str
    owner: str
    offset: int
    length: int
    expires_s: float
    busy: int = 0

    def to_dict(self, segment: str) -> dict:
        return {"lease": self.id, "segment": segment, "offset": self.offset, "length": self.length}


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class StagingArena:
    """One preallocated ``/dev/shm`` segment carved into leased ranges.

    Raises:
        TierFull: ``/dev/shm`` cannot hold it.
        TierIOError: it cannot be created.
    """

    def __init__(self, nbytes: int, *, prefix: str = "kvstore", ttl_s: float = 60.0, shm_dir: str = SHM_DIR) -> None:
        self.nbytes = nbytes
        self.ttl_s = ttl_s
        self.segment = f"{prefix}.staging.{os.getpid()}.{secrets.token_hex(4)}"
        self.path = os.path.join(shm_dir, self.segment)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise TierIOError(f"staging: cannot create {self.path}: {exc}", tier="staging") from exc
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError as exc:
            self._finalizer()
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise TierFull(f"staging: {self.path} cannot hold {nbytes} bytes: {exc}", tier="staging") from exc
            raise TierIOError(f"staging: cannot map {self.path}: {exc}", tier="staging") from exc
        finally:
            os.close(fd)
        self._alloc = SlabAllocator(nbytes, align=64)
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def lease(self, nbytes: int, owner: str) -> Lease:
        """A range of at least ``nbytes`` for ``owner``.

        Raises:
            InvalidInput: ``nbytes`` is not positive.
            TierFull: no range that large is free now (the client falls back to HTTP).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidInput(f"nbytes: must be a positive int, got {nbytes!r}", field="nbytes")
        with self._lock:
            self._expire(time.monotonic())
            offset = self._alloc.alloc(nbytes)
            if offset is None:
                raise TierFull(f"staging: no free range of {nbytes} bytes (arena {self.nbytes})", tier="staging")
            lease = Lease(secrets.token_hex(16), owner, offset, nbytes, time.monotonic() + self.ttl_s)
            self._leases[lease.id] = lease
            return lease

    @contextlib.contextmanager
    def use(self, lease_id: str, owner: str, nbytes: int) -> Iterator[memoryview]:
        """The first ``nbytes`` of a lease, held against expiry while inside the block.

        Raises:
            Forbidden: no such lease for this owner (expired, released, or someone else's).
            InvalidInput: ``nbytes`` is more than the lease holds.
        """
        with self._lock:
            lease = self._leases.get(lease_id) if isinstance(lease_id, str) else None
            if lease is None or lease.owner != owner:
                raise Forbidden("staging lease: unknown or expired; lease again")
            if nbytes > lease.length:
                raise InvalidInput(f"staging lease holds {lease.length} bytes, the body needs {nbytes}")
            lease.busy += 1
        try:
            # not released explicitly: a tensor over it may outlive the block until GC
            yield memoryview(self._map)[lease.offset:lease.offset + nbytes]
        finally:
            with self._lock:
                lease.busy -= 1
                lease.expires_s = time.monotonic() + self.ttl_s

    def release(self, lease_id: str, owner: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner != owner or lease.busy:
                return False
            del self._leases[lease_id]
            self._alloc.free(lease.offset)
            return True

    def _expire(self, now: float) -> None:
        for lease in [l for l in self._leases.values() if l.expires_s < now and not l.busy]:
            del self._leases[lease.id]
            self._alloc.free(lease.offset)

    def stats(self) -> dict:
        with self._lock:
            return {"segment": self.segment, "bytes": self.nbytes, "leases": len(self._leases),
                    "leased_bytes": sum(l.length for l in self._leases.values())}

    def close(self) -> None:
        self._finalizer()
        with contextlib.suppress(BufferError):
            self._map.close()
