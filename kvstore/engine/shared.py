"""The shared tier: where several kvstore nodes meet (Redis, Redis Cluster).

A tier with ``shared_writers = True`` is written by other stores too, so a
miss in this store's index may still be a hit there. This module is the
store's view of that tier:

- **Adoption.** ``lookup`` counts blocks the shared tier holds past the end of
  the local prefix; ``get_kv`` reads them, checks their metadata (namespace and
  spec fingerprint, besides the key, which already folds both in) and indexes
  them locally. This is how a block put through node A is served by node B.
- **Write policy** (as SGLang HiCache offers):
  ``write_through`` copies every put to the shared tier at once (the default
  when one is configured: other nodes see it immediately); ``write_back``
  copies an entry only when placement demotes it there; ``selective`` copies
  an entry once it has been read ``selective_hits`` times.
- **Replicas.** The copy in the shared tier is not this store's to delete when
  the local one moves: promotion out of the shared tier copies, and demotion
  into it switches to the copy already there. Only an explicit delete removes
  it, since a delete means "this block is gone" for everyone.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore
from kvstore.errors import FrameError, InvalidInput, InvalidKV, TierError
from kvstore.engine.index import IndexEntry
from kvstore.engine.recovery import entry_from_frame
from kvstore.tier import Tier

if TYPE_CHECKING:
    import torch

__all__ = ["WritePolicy", "Replica", "SharedTier", "WRITE_POLICIES"]

log = logging.getLogger("kvstore.engine.shared")

WRITE_POLICIES = ("write_through", "write_back", "selective")


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """When a block reaches the shared tier."""

    mode: str = "write_through"
    selective_hits: int = 2
    """For ``selective``: reads after which a block is copied."""

    def __post_init__(self) -> None:
        if self.mode not in WRITE_POLICIES:
            raise InvalidInput(f"write policy must be one of {', '.join(WRITE_POLICIES)}, got {self.mode!r}")
        if self.selective_hits < 1:
            raise InvalidInput(f"selective_hits must be at least 1, got {self.selective_hits}")


@dataclass(frozen=True, slots=True)
class Replica:
    """A block's copy in the shared tier, which may use another codec than the local one."""

    size: int
    codec: Codec
    checksum: int


class SharedTier:
    """The store's handle on its shared tier: adoption, write policy, replicas."""

    def __init__(self, core: EngineCore, tier: Tier, policy: WritePolicy) -> None:
        self._core = core
        self.tier = tier
        self.name = tier.name
        self.policy = policy
        self._replicas: dict[bytes, Replica] = {}
        self._lock = threading.Lock()
        self.bytes_written = 0
        """Bytes of copies this store made (write-through, selective); demotions are ``bytes_demoted``."""
        self.bytes_demoted = 0
        self.blocks_adopted = 0

    # -- replicas ------------------------------------------------------------------

    def replica(self, key: bytes) -> Replica | None:
        with self._lock:
            return self._replicas.get(key)

    def remember(self, key: bytes, replica: Replica) -> None:
        with self._lock:
            self._replicas[key] = replica

    def forget(self, key: bytes) -> Replica | None:
        with self._lock:
            return self._replicas.pop(key, None)

    def delete(self, key: bytes) -> None:
        """An explicit delete: the shared copy goes too."""
        if self.forget(key) is not None:
            try:
                self.tier.delete(key)
            except TierError as exc:
                log.warning("shared tier %s failed to delete %s: %s", self.name, key.hex(), exc)

    # -- write policy ----------------------------------------------------------------

    def after_put(self, entry: IndexEntry, block: "torch.Tensor", meta: bytes) -> None:
        """Copy a block just written elsewhere, under ``write_through``."""
        if self.policy.mode == "write_through" and entry.tier != self.name:
            self._copy(entry.key, block, meta)

    def after_hits(self, entries: Sequence[IndexEntry]) -> list[IndexEntry]:
        """Entries that ``selective`` wants copied now (read often enough, not yet shared)."""
        if self.policy.mode != "selective":
            return []
        with self._lock:
            return [e for e in entries if e.hits >= self.policy.selective_hits
                    and e.tier != self.name and e.key not in self._replicas]

    def replicate(self, entry: IndexEntry) -> bool:
        """Copy ``entry``'s frame from its tier to the shared tier (selective policy)."""
        try:
            frame = self._core.tier(entry.tier).get(entry.key)
            if frame is None:
                return False
            kv = codec_mod.decode(frame, expect_checksum=entry.checksum)
            return self._copy(entry.key, kv, codec_mod.frame_meta(frame))
        except (FrameError, InvalidKV, TierError) as exc:
            log.warning("replicating %s failed: %s", entry.key.hex(), exc)
            return False

    def _copy(self, key: bytes, block: "torch.Tensor", meta: bytes) -> bool:
        codec = self._core.codec_of(self.name)
        headers: list[codec_mod.FrameHeader] = []

        def writer(view: memoryview, codec: Codec) -> int:
            n = codec_mod.encode_into(block, view, codec, meta=meta)
            headers.append(codec_mod.read_header(view[:n]))
            return n

        def put(codec: Codec) -> int:
            # put_with: the encoder writes into the tier's reused buffer, no frame allocated per put
            size = codec_mod.frame_size(block.shape, block.dtype, codec, meta_len=len(meta))
            return self.tier.put_with(key, size, lambda view: writer(view, codec))

        try:
            try:
                n = put(codec)
            except InvalidKV:  # int8 cannot hold this block: share it raw
                n = put(Codec.RAW)
        except TierError as exc:  # the shared tier is a copy: losing it degrades, never fails, a put
            self._core.count(tier_errors=1)
            log.warning("write-through of %s to %s failed: %s", key.hex(), self.name, exc)
            return False
        self.remember(key, Replica(n, headers[-1].codec, headers[-1].body_checksum))
        with self._lock:
            self.bytes_written += n
        return True

    # -- adoption ----------------------------------------------------------------------

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the shared tier holds."""
        if not keys:
            return 0
        try:
            present = self.tier.contains_many(list(keys))
        except TierError as exc:
            log.warning("shared tier %s failed a lookup (%s); counted as misses", self.name, exc)
            return 0
        n = 0
        for hit in present:
            if not hit:
                break
            n += 1
        return n

    def adopt(self, key: bytes, namespace: str, spec_fp: str) -> tuple[IndexEntry, Any] | None:
        """Index a block another node stored; returns the entry and the frame just read."""
        try:
            frame = self.tier.get(key)
        except TierError as exc:
            log.warning("shared tier %s failed a get (%s); served as a miss", self.name, exc)
            return None
        if frame is None:
            return None
        try:
            entry = entry_from_frame(key, self.name, frame, self._core.clock())
        except FrameError as exc:
            log.warning("shared block %s is unreadable (%s); served as a miss", key.hex(), exc)
            return None
        if entry.namespace != namespace or entry.spec_fp != spec_fp:
            return None  # cannot happen short of a hash collision; never serve it
        core = self._core
        with core.claim(key):
            current = core.entry(key)
            if current is not None:
                return current, None
            core.publish(entry, reason="adopted")
        self.remember(key, Replica(entry.size, entry.codec, entry.checksum))
        with self._lock:
            self.blocks_adopted += 1
        return entry, frame

    def demoted(self, nbytes: int) -> None:
        """Placement copied ``nbytes`` down into the shared tier."""
        with self._lock:
            self.bytes_demoted += nbytes

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"tier": self.name, "write_policy": self.policy.mode, "replicas": len(self._replicas),
                    "bytes_written": self.bytes_written, "bytes_demoted": self.bytes_demoted,
                    "blocks_adopted": self.blocks_adopted}


def find_shared(tiers: Sequence[Tier]) -> Tier | None:
    """The first tier other stores write to (``shared_writers``), if any."""
    for tier in tiers:
        if getattr(tier, "shared_writers", False):
            return tier
    return None
