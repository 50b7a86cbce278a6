"""Cold frames re-encoded behind the put: a full store spills raw, a thread makes it int8 later.

Cold tiers (nvme, redis) hold int8 frames by default: half the bytes of fp16 on slow media. A put
into a full store spills its blocks one tier down on its own path (``KVSTORE_FULL_TOP_TIER=spill``),
and encoding them int8 there was most of that path's time (46% of a server's samples under eight
writers, where the disk's writes took 13%). So a put writes a block below the top tier raw, as
long as the frames owed a re-encode stay under ``backlog_bytes``, and ``Recoder`` re-encodes them
to their tier's codec in a background thread:

- A frame owed is read from its tier, checked to be the one its index entry names, re-encoded
  (``codec.transcode``), and written back over itself under the key's claim, only if the entry
  is still the one read: a put, delete or move of the key meanwhile wins and the debt is dropped.
  The index switches to the new frame with a ``moved`` event (reason ``recoded``, same tier),
  and placement counts its new size.
- A block int8 cannot hold (NaN or Inf) stays raw, as a demotion keeps it (``kept_raw``).
- The thread works only in the puts' gaps: it waits until no put has started or written a block
  for ``QUIET_S`` (``EngineCore.last_put_s``), and looks again between batches. At the bound a
  put encodes its spilled blocks itself again, so disk use and the debt stay bounded (raw is 2x
  int8 for fp16). Never flat out: under sustained puts, a raw write now and a read, re-encode,
  second write and compaction later is more work on the same cores than one int8 write now
  (a full store took sustained 32 MiB puts of 2 MiB blocks at 346-387 MB/s with the thread
  working flat out past half its bound, 495-576 MB/s waiting for gaps; stop 54), so once the
  debt is at its bound the puts pay as they go, and the debt waits for a gap.
- Debts are kept in memory only: a restart finds the raw frames in the recovered index and owes
  them again (``owe_recovered``).

The mover owes re-encodes too: while the debt has room, it demotes a raw block into such a tier
raw (``Recoder.spills_raw``, ``owe(demoted=True)``) instead of encoding int8 beside the puts.

Readers are unaffected: a frame is raw or int8 by its own header. A reader that looked up the
raw entry and then read the int8 frame finds its checksum not the one it expected and looks the
entry up again (``kvstore.engine.reads``), as after a move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.core import EngineCore
from kvstore.errors import FrameError, InvalidKV, TierError
from kvstore.keys import BlockHash

__all__ = ["Recoder", "RecodeStats", "QUIET_S"]

log = logging.getLogger("kvstore.engine.recode")

QUIET_S = 0.05
"""Seconds without a put before the thread re-encodes: a burst of puts runs alone on the CPU, the
thread catches up in the gap after it."""
BATCH = 64
"""Debts paid at a time: read, quantized together where they are small and of one shape, then
each written back under its own claim."""
BATCH_BYTES = 8 << 20
"""Raw bytes a batch takes on at most (it takes one debt, however large)."""
BATCH_BLOCK_BYTES = 256 << 10
"""Blocks of at most this many KV bytes are quantized in batches: a 64 KiB block encodes 3x faster
in a batch of 32 (1.0 against 0.3 GB/s here), a 2 MiB block a quarter slower (one pass over a
batch's float32 copy falls out of the cache where the one-block path works in L2-sized chunks)."""


@dataclass(slots=True)
class _Job:
    """One debt being paid: the frame read, decoded, and (once encoded) its new frame."""

    key: BlockHash
    entry: Any
    tier: Any
    want: Codec
    kv: Any
    meta: bytes
    new: Any = None


@dataclass(slots=True)
class RecodeStats:
    """What the re-encoder did since the store started (``StoreStats.recode``)."""

    backlog_bytes: int = 0
    """The bound on raw frame bytes owed a re-encode (KVSTORE_RECODE_BACKLOG_BYTES); 0: off, puts
    encode for a cold tier themselves."""
    pending_blocks: int = 0
    pending_bytes: int = 0
    """Raw frame bytes owed now."""
    spilled_raw_blocks: int = 0
    """Blocks puts wrote raw below the top tier, owed a re-encode."""
    demoted_raw_blocks: int = 0
    """Blocks the mover demoted raw into a tier that wants another codec, owed a re-encode."""
    recoded_blocks: int = 0
    recoded_bytes_saved: int = 0
    """Frame bytes the re-encodes saved (raw size minus new size)."""
    dropped: int = 0
    """Debts given up: the block was rewritten, moved up, deleted or evicted first."""
    kept_raw: int = 0
    """Blocks the tier's codec cannot hold (NaN or Inf for int8): they stay raw."""
    failed: int = 0
    """Re-encodes a tier failed (a read or a write); the block stays raw."""

    def to_dict(self) -> dict:
        return asdict(self)


class Recoder:
    """Owes and pays the re-encodes of raw frames below the top tier; one per store.

    Args:
        core: the store's engine core.
        backlog_bytes: the most raw frame bytes owed at once; 0 turns raw spilling off.
    """

    def __init__(self, core: EngineCore, *, backlog_bytes: int) -> None:
        self._core = core
        self._stats = RecodeStats(backlog_bytes=max(0, int(backlog_bytes)))
        self._pending: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self._cond = threading.Condition()
        self._last_owed = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the put's side ---------------------------------------------------------------------

    def spills_raw(self, tier: str, nbytes: int) -> bool:
        """Whether a put should write a ``nbytes`` raw frame into ``tier`` and owe its re-encode:
        a tier below the top one whose codec is not raw, with room in the debt's bound, and the
        thread running to pay it."""
        core = self._core
        if tier == core.tier_names[0] or core.codec_of(tier) is Codec.RAW or self._not_in_place(tier):
            return False
        with self._cond:
            return (self._thread is not None and not self._closed
                    and self._stats.pending_bytes + nbytes <= self._stats.backlog_bytes)

    def _not_in_place(self, tier: str) -> bool:
        """Not rewritten in place, so a put encodes for it itself: a shared tier's frames (other
        nodes read them against the checksums they hold), or a tier where an overwrite could take
        a durable frame with it in a host crash (``Tier.overwrite_keeps_durable``)."""
        shared = self._core.shared
        return (shared is not None and shared.name == tier) or not self._core.tier(tier).overwrite_keeps_durable

    def owe(self, key: BlockHash, nbytes: int, *, demoted: bool = False) -> None:
        """``key``'s frame was written raw where its tier wants another codec (by a put, or by a
        demotion: ``demoted``): re-encode it later."""
        with self._cond:
            if self._closed or self._thread is None:  # nobody would pay it (spills_raw said no)
                return
            self._owe(key, nbytes)
            if demoted:
                self._stats.demoted_raw_blocks += 1
            else:
                self._stats.spilled_raw_blocks += 1
            self._cond.notify()

    def _owe(self, key: BlockHash, nbytes: int) -> None:
        old = self._pending.pop(key, None)
        if old is not None:
            self._stats.pending_bytes -= old
        self._pending[key] = nbytes
        self._stats.pending_bytes += nbytes
        self._stats.pending_blocks = len(self._pending)
        self._last_owed = time.monotonic()

    def owe_recovered(self) -> int:
        """Owe the re-encodes of raw frames the start-up scan found in tiers that want another
        codec (a restart loses the debts in memory); how many, up to the bound."""
        core = self._core
        owed = 0
        with self._cond:
            for entry in core.snapshot():
                if (entry.codec is Codec.RAW and entry.tier != core.tier_names[0]
                        and core.codec_of(entry.tier) is not Codec.RAW and not self._not_in_place(entry.tier)):
                    if self._stats.pending_bytes + entry.size > self._stats.backlog_bytes:
                        break
                    self._owe(entry.key, entry.size)
                    owed += 1
            self._last_owed = 0.0  # nothing is putting: no reason to wait
            self._cond.notify()
        return owed

    # -- paying -----------------------------------------------------------------------------

    def recode(self, key: BlockHash) -> str:
        """Re-encode ``key``'s raw frame in its tier's codec, in place: ``recoded``, ``dropped``
        (no longer owed: rewritten, moved or gone), ``kept_raw``, ``failed`` or ``damaged``."""
        return self.recode_many([key])[0]

    def recode_many(self, keys: list[BlockHash]) -> list[str]:
        """``recode`` for each of ``keys``, small blocks of one shape quantized in one batched pass
        (``codec.encode_many``); each written back under its own claim."""
        jobs = [self._read(key) for key in keys]
        todo = [job for job in jobs if isinstance(job, _Job)]
        self._encode(todo)
        return [job if isinstance(job, str) else self._commit(job) for job in jobs]

    def _read(self, key: BlockHash) -> "_Job | str":
        """The raw frame owed, read and checked to be the one indexed; or the debt's outcome."""
        core = self._core
        entry = core.entry(key)
        if (entry is None or entry.codec is not Codec.RAW or entry.tier == core.tier_names[0]
                or self._not_in_place(entry.tier)):
            return "dropped"
        want = core.codec_of(entry.tier)
        if want is Codec.RAW:
            return "dropped"
        tier = core.tier(entry.tier)
        try:
            frame = tier.get(key)
        except TierError as exc:
            log.warning("re-encode of %s: tier %s failed a get (%s); it stays raw", key.hex(), tier.name, exc)
            return "failed"
        if frame is None:
            return "dropped"  # gone meanwhile; a reader drops the entry when it finds it so
        try:
            header = codec_mod.read_header(frame)
            if header.body_checksum != entry.checksum:
                return "dropped"  # rewritten since we looked the entry up
            kv = codec_mod.decode(frame, expect_checksum=entry.checksum)
            meta = codec_mod.frame_meta(frame)
        except FrameError as exc:
            log.warning("re-encode of %s: frame in %s is damaged (%s); dropped", key.hex(), tier.name, exc)
            core.drop(entry, corrupt=True)
            return "damaged"
        except InvalidKV:  # not KV the tier's codec takes (a frame of bytes): it stays as it is
            return "kept_raw"
        return _Job(key, entry, tier, want, kv, meta)

    @staticmethod
    def _encode(jobs: list["_Job"]) -> None:
        """Each job's new frame (or ``kept_raw``): small int8 blocks of one shape in batches."""
        groups: dict[tuple, list[_Job]] = {}
        for job in jobs:
            small = job.want is Codec.INT8 and job.kv.numel() * job.kv.element_size() <= BATCH_BLOCK_BYTES
            groups.setdefault((tuple(job.kv.shape), job.kv.dtype) if small else (id(job),), []).append(job)
        for group in groups.values():
            if len(group) > 1:
                try:
                    for job, frame in zip(group, codec_mod.encode_many([j.kv for j in group], [j.meta for j in group])):
                        job.new = frame
                    continue
                except InvalidKV:  # one of them cannot be int8: find which, one by one
                    pass
            for job in group:
                try:
                    job.new = codec_mod.encode(job.kv, job.want, meta=job.meta)
                except InvalidKV:  # int8 cannot hold this block (NaN, Inf): it stays raw
                    job.new = None

    def _commit(self, job: "_Job") -> str:
        """Under the key's claim, and only if its entry is still the one read: write the new frame
        over the raw one, switch the index, tell placement."""
        if job.new is None:
            return "kept_raw"
        core, key, entry, tier, new = self._core, job.key, job.entry, job.tier, job.new
        header = codec_mod.read_header(new)
        with core.claim(key):
            if core.entry(key) is not entry:  # rewritten, moved or deleted meanwhile: that wins
                return "dropped"
            try:
                tier.put(key, new)
            except TierError as exc:
                if not _landed(tier, key, header.body_checksum):  # full or failing: the raw frame stays
                    log.info("re-encode of %s: tier %s refused the write (%s); it stays raw", key.hex(), tier.name,
                             exc)
                    return "failed"
                # The write failed after it landed (a file renamed into place, then its directory's
                # sync failed): the tier serves the new frame, so the index must name it.
                log.warning("re-encode of %s: tier %s failed after the write landed (%s); indexed as written",
                            key.hex(), tier.name, exc)
            core.switch(replace(entry, size=len(new), codec=header.codec, checksum=header.body_checksum),
                        src=tier.name, reason="recoded")
            core.placement.resized(key, len(new))
        with self._cond:
            self._stats.recoded_bytes_saved += entry.size - len(new)
        return "recoded"

    def run_once(self, limit: int | None = None) -> int:
        """Pay debts, oldest first (at most ``limit``); how many were taken on."""
        done = 0
        while limit is None or done < limit:
            with self._cond:
                batch = self._take(BATCH if limit is None else min(BATCH, limit - done))
            if not batch:
                break
            self._pay(batch)
            done += len(batch)
        return done

    def _take(self, most: int) -> list[tuple[BlockHash, int]]:
        """Under the lock: up to ``most`` debts, oldest first, within ``BATCH_BYTES``."""
        batch: list[tuple[BlockHash, int]] = []
        nbytes = 0
        while self._pending and len(batch) < most and (not batch or nbytes < BATCH_BYTES):
            key, n = self._pending.popitem(last=False)
            batch.append((key, n))
            nbytes += n
        return batch

    def _pay(self, batch: list[tuple[BlockHash, int]]) -> None:
        try:
            outcomes = self.recode_many([key for key, _ in batch])
        except Exception:  # noqa: BLE001 - one batch's failure must not end the thread
            log.exception("re-encode of %d blocks failed", len(batch))
            outcomes = ["failed"] * len(batch)
        with self._cond:
            for (_, nbytes), outcome in zip(batch, outcomes):
                self._stats.pending_bytes -= nbytes  # owed again meanwhile: that newer debt counts its own
                if outcome == "recoded":
                    self._stats.recoded_blocks += 1
                elif outcome in ("dropped", "damaged"):
                    self._stats.dropped += 1
                elif outcome == "kept_raw":
                    self._stats.kept_raw += 1
                else:
                    self._stats.failed += 1
            self._stats.pending_blocks = len(self._pending)

    def idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until nothing is owed (tests and benches); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                if not self._pending and self._stats.pending_bytes == 0:
                    return True
                self._cond.wait(0.01)
        return False

    # -- the thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Run the thread (a store with ``background``), owing what recovery found raw; with a
        bound of 0, nothing runs."""
        if self._thread is None and self._stats.backlog_bytes > 0 and not self._closed:
            self._thread = threading.Thread(target=self._loop, name="kvstore-recoder", daemon=True)
            self._thread.start()
            self.owe_recovered()

    def _next(self) -> list[tuple[BlockHash, int]] | None:
        """The oldest debts (a batch), once it is time to pay them; None once closed."""
        with self._cond:
            while not self._closed:
                if self._pending:
                    wait = max(self._last_owed, self._core.last_put_s) + QUIET_S - time.monotonic()
                    if wait <= 0:
                        return self._take(BATCH)
                    self._cond.wait(wait)
                else:
                    self._cond.notify_all()  # idle() waiters
                    self._cond.wait()
            return None

    def _loop(self) -> None:
        while True:
            batch = self._next()
            if batch is None or self._core.closed:
                return
            self._pay(batch)
            with self._cond:
                self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (before the tiers close); the debts left stay raw until a restart."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def stats(self) -> RecodeStats:
        with self._cond:
            return replace(self._stats, pending_blocks=len(self._pending))


_HEAD_BYTES = 4096
"""A frame's header fits well inside this (as recovery reads it)."""


def _landed(tier, key: BlockHash, checksum: int) -> bool:
    """Whether ``tier`` holds, under ``key``, the frame whose body checksum is ``checksum``."""
    try:
        got = tier.head(key, _HEAD_BYTES)
        return got is not None and codec_mod.read_header(got[0], prefix=True).body_checksum == checksum
    except (TierError, FrameError):
        return False
