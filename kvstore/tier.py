"""The Tier contract: where frames live.

A tier stores opaque frames under 32-byte keys. It never looks inside a frame
(that is the codec's job) and never decides what to keep (that is placement's).
Seven abstract methods and four attributes make a tier; batched forms,
``put_with`` and ``read_with`` have defaults that a tier overrides when its backing can
do better (pipelines, in-place writes into an arena).

Rules every tier keeps (``tests/tiers/conformance.py`` checks them):

- ``get`` of an absent key is ``None``; failure is a ``TierError`` subclass.
- ``put`` of an existing key replaces it and its capacity accounting.
- A buffer returned by ``get`` stays unchanged after later puts and deletes:
  the tier hands out a copy or an immutable object.
- ``put`` that would overflow ``capacity_bytes`` raises ``TierFull`` and
  changes nothing; tiers do not evict on their own.
- Tiers guard only their own memory; they are safe to call from many threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from kvstore.errors import InvalidInput
from kvstore.keys import BlockHash

__all__ = ["Tier", "TierStats", "TierCounters", "Buffer", "FrameWriter", "writable_bytes"]

Buffer = Any
"""Any contiguous bytes-like object (bytes, bytearray, memoryview, numpy array)."""

FrameWriter = Callable[[memoryview], int]
"""Fills a writable view and returns how many bytes it used."""

T = TypeVar("T")


def writable_bytes(out: Buffer) -> memoryview:
    """``out`` as a flat writable byte view.

    Raises:
        InvalidInput: ``out`` is read-only or not one contiguous buffer.
    """
    try:
        view = memoryview(out)
    except TypeError as exc:
        raise InvalidInput(f"out must be a writable buffer, got {type(out).__name__}") from exc
    if view.readonly:
        raise InvalidInput("out is read-only")
    if not view.contiguous:
        raise InvalidInput("out must be one contiguous buffer")
    return view.cast("B")


@dataclass(slots=True)
class TierCounters:
    """Operation counters a tier bumps under its own lock."""

    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    deletes: int = 0
    errors: int = 0


@dataclass(slots=True)
class TierStats:
    """A snapshot of one tier, as ``stats()`` returns it."""

    name: str
    kind: str
    """The module that implements it: memory, device, shm, cxl, redis, nvme."""
    entries: int
    used_bytes: int
    capacity_bytes: int
    durable: bool
    shared: bool
    counters: TierCounters = field(default_factory=TierCounters)
    details: dict[str, str] = field(default_factory=dict)
    """Backing facts worth showing an operator, e.g. ``device: cpu (no CUDA)``."""

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["free_bytes"] = self.free_bytes
        return data


class Tier(ABC):
    """Stores frames under block keys. Subclasses set the four attributes."""

    name: str
    """Unique within a store; index entries name their tier by it."""
    capacity_bytes: int
    durable: bool
    """An acknowledged put survives a crash of this process (and of the host, for nvme)."""
    shared: bool
    """Other processes or hosts can see what this tier holds."""
    shared_writers: bool = False
    """Other stores write here too (Redis): a miss in one store's index may be a hit here."""
    overwrite_keeps_durable: bool = True
    """A ``put`` over a key whose frame was durable leaves a durable frame of the key (the old or
    the new) whatever crash comes. False where a host crash can take both (the file layout under
    a group commit renames an unsynced file over the old one): the re-encoder does not rewrite
    frames in place there (``kvstore.engine.recode``)."""

    @abstractmethod
    def put(self, key: BlockHash, frame: Buffer) -> None:
        """Store a copy of ``frame`` under ``key``, replacing any older frame.

        Raises:
            TierFull: it does not fit; nothing changed.
            TierUnavailable, TierIOError: the backing failed.
        """

    @abstractmethod
    def get(self, key: BlockHash) -> Buffer | None:
        """The frame under ``key``, or ``None`` when absent."""

    @abstractmethod
    def delete(self, key: BlockHash) -> bool:
        """Remove ``key``; ``True`` when something was removed."""

    @abstractmethod
    def contains(self, key: BlockHash) -> bool:
        """Whether ``key`` is stored, without counting a hit or a miss."""

    @abstractmethod
    def keys(self) -> Iterator[BlockHash]:
        """Every stored key, in no particular order (a snapshot)."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of occupancy and counters."""

    def close(self) -> None:
        """Release the backing. Idempotent; later calls raise ``StoreClosed``."""

    def sync(self) -> None:
        """Return once every put this tier acknowledged survives what ``durable`` promises. A
        tier that syncs in groups (nvme's group commit) waits for the group; one that makes
        each put durable before it returns, or promises nothing, has nothing to do.

        Raises:
            TierIOError: the sync failed; what was put stays stored, not yet durable.
        """

    # -- defaults built on the core ---------------------------------------------

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        """Store a frame that ``writer`` produces in place.

        ``writer`` gets a writable view of ``size`` bytes and returns how many it
        used. Arena tiers override this to hand out their own memory, so an
        encoder writes straight into the slot with no staging copy.

        A tier that knows its capacity refuses a frame that cannot fit before
        ``writer`` runs (TierFull, ``writer`` not called): a caller receiving the
        frame off a socket can then make room and try again, its bytes unspent.
        This default runs ``writer`` first; a tier whose capacity is only known at
        the write (Redis, shared with other stores) keeps it and says so.

        Returns:
            The stored frame's length.
        """
        buf = bytearray(size)
        n = writer(memoryview(buf))
        self.put(key, memoryview(buf)[:n])
        return n

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        """Copy the frame under ``key`` into the writable buffer ``out``.

        Arena tiers override this to copy once, straight into a buffer the
        caller reuses, instead of allocating a fresh one per get.

        Returns:
            The frame's length, or ``None`` when absent.

        Raises:
            InvalidInput: ``out`` is shorter than the frame.
        """
        frame = self.get(key)
        if frame is None:
            return None
        src = memoryview(frame).cast("B")
        dst = writable_bytes(out)
        if len(dst) < len(src):
            raise InvalidInput(f"out holds {len(dst)} bytes, the frame needs {len(src)}")
        dst[: len(src)] = src
        return len(src)

    def read_with(self, key: BlockHash, reader: Callable[[memoryview], T]) -> T | None:
        """``reader(frame)`` for the frame under ``key``; None (and no call) when absent.

        The view is valid only during the call and must not be kept. Arena tiers in
        host memory lend the slot itself, held busy so it is neither freed nor moved
        until the call returns: a server can verify a frame and send it with no copy.
        """
        frame = self.get(key)
        return None if frame is None else reader(memoryview(frame).cast("B"))

    def release_free(self) -> int:
        """Hand back to the kernel the memory this tier holds for no frame (an arena's free ranges,
        where the arena is this process's own anonymous memory), so an idle server shrinks; the
        next write there takes fresh pages. Returns the bytes released. Default: none."""
        return 0

    @property
    def lends_frames(self) -> bool:
        """Whether ``read_with`` lends the stored bytes themselves (no copy), so a reader may decode
        straight out of the tier; otherwise it is handed a fresh copy per read."""
        return False

    def read_vouched(self, key: BlockHash, reader: Callable[[memoryview, int, bool], T]) -> T | None:
        """``read_with``, where ``reader(view, stamp, vouched)`` also learns the frame's publication
        stamp and whether a reader ``vouch``ed for its bytes at that stamp, so the store can skip
        hashing a frame again (``docs/design.md``, "Verified once"). This default never vouches:
        only arenas whose slots this process alone writes (``tiers.arena``) keep stamps.
        """
        return self.read_with(key, lambda view: reader(view, 0, False))

    def vouch(self, key: BlockHash, stamp: int) -> None:
        """Note that ``key``'s bytes published at ``stamp`` were checked (a no-op here)."""

    def head(self, key: BlockHash, nbytes: int) -> tuple[Buffer, int] | None:
        """The first ``nbytes`` of ``key``'s frame and the frame's full length; None when absent.

        For reading a frame's header and metadata (re-indexing at start) without
        the whole frame. Not checksummed: a damaged body shows on the first real
        read. Tiers that can read a prefix (nvme) override this.
        """
        frame = self.get(key)
        if frame is None:
            return None
        view = memoryview(frame).cast("B")
        return view[:nbytes], len(view)

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> None:
        for key, frame in items:
            self.put(key, frame)

    def get_many(self, keys: Sequence[BlockHash]) -> list[Buffer | None]:
        return [self.get(key) for key in keys]

    def delete_many(self, keys: Iterable[BlockHash]) -> int:
        return sum(1 for key in keys if self.delete(key))

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def __len__(self) -> int:
        return self.stats().entries

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} capacity={self.capacity_bytes}>"

