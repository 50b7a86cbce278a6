"""Verification off the reader's path: frames in lent arenas hashed by a background thread.

Readers of the arena tiers that lend their frames (``Tier.lends_frames``: shm, cxl) skip
hashing a frame's body when its slot is vouched for at its current publication
(``docs/design.md``, "Verified once"). ``Scrubber`` is the one thread that does that hashing
ahead of them, and again later, with two duties:

- verify-behind (first): every frame published into such a tier (a put, a frame put, the
  commit of a slot a co-located writer filled, a promotion) is hashed whole soon
  after, and when it is sound and is the frame its index entry names, vouched for at that
  publication's stamp, so co-located readers in other processes trust it without hashing it.
- scrub: every block of those tiers, vouched for or not, is hashed again, cycle after cycle, at
  no more than ``bytes_per_s``, so damage at rest (a bit flip, a stray write into the arena) is
  found within about one cycle (arena bytes / rate) rather than never.

A frame that fails either is dropped as corrupt (``EngineCore.drop``: a ``removed`` event with
reason ``corrupt``, counted in ``corrupt_blocks``), so readers then miss instead of getting
wrong bytes. Neither duty is a read: no heat, no hit counts, no ``reads_by_tier``.

Why the event log and not a hook in ``publish``: every path that puts a frame in a tier already
emits a ``stored`` or ``moved`` event, under the key's claim and after the change, and a cursor
into the ring costs the put path nothing. A verifier more than the ring's capacity behind loses
some publishes (``publishes_missed``); their first reader hashes them, and so does the next cycle.
A tier's compaction moves frames with no event (the index does not change): the scrub's next pass
vouches for them again, as it vouches for any sound frame it hashes.

Pacing is a token bucket that holds one block: each block scrubbed moves the next start
``cost / rate`` seconds on, so the bytes scrubbed over any interval are at most rate x interval
plus one block. The wait is on a condition that a publish (verify first) and ``close`` cut short;
a request that publishes holds its wake-up until it is done (``Scrubber.answering``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from kvstore import codec as codec_mod
from kvstore.config import SCRUB_BYTES_PER_S
from kvstore.engine.core import EngineCore
from kvstore.engine.events import MOVED, STORED
from kvstore.errors import FrameError, InvalidInput, StoreClosed, TierError
from kvstore.keys import BlockHash

__all__ = ["Scrubber", "ScrubStats", "BLOCK_COST_BYTES", "MIN_CYCLE_S"]

log = logging.getLogger("kvstore.engine.scrub")

BLOCK_COST_BYTES = 1 << 20
"""The least a scrubbed block is charged against the rate, bytes. Besides its hash, a block costs
~35 us of Python (the index look-up, the tier's pin) and its paced wait more: ~170 us in all
here, what hashing 1 MiB costs. With no floor, 8 KiB blocks at 256 MiB/s took 13% of a core;
charged 1 MiB each (at most rate / 1 MiB blocks a second), 4%, as 2 MiB blocks do."""
MIN_CYCLE_S = 0.25
"""Seconds at least between the starts of two scrub cycles: an empty arena costs nothing to walk,
so without a floor the thread would spin over it."""
VERIFY_BATCH = 1024
"""Events read from the log at a time (the ring's ``read`` limit)."""
ERROR_BACKOFF_S = 1.0
"""Seconds the thread waits after an unexpected failure before it carries on."""


@dataclass(slots=True)
class ScrubStats:
    """What the verifier and the scrubber did since the store started (``StoreStats.scrub``)."""

    rate_bytes_per_s: int = 0
    """The scrub's rate; 0: no scrubbing (verify-behind still runs)."""
    verified_blocks: int = 0
    """Frames hashed after their publish (verify-behind): vouched for, or dropped if damaged."""
    verified_bytes: int = 0
    scrubbed_blocks: int = 0
    scrubbed_bytes: int = 0
    """Frame bytes the scrubber took on, counted as each block starts (what the rate bounds)."""
    damaged_found: int = 0
    """Frames either duty found damaged and dropped (``corrupt_blocks`` counts them with the readers')."""
    cycles: int = 0
    """Scrub cycles completed: every block of the lent arenas, as they were when it began."""
    last_cycle_s: float = 0.0
    """How long the last completed cycle took, seconds: about how late damage at rest is found."""
    publishes_missed: int = 0
    """Publishes the verifier lost by falling a whole event ring behind (their readers hash them)."""


class Scrubber:
    """The background verifier and scrubber of one store: one thread, owned here.

    Args:
        core: the store's engine core (index, tiers, event log).
        bytes_per_s: the scrub's rate, bytes per second; 0 turns scrubbing off.
        clock: monotonic seconds, for pacing and cycle lengths.

    Raises:
        InvalidInput: ``bytes_per_s`` is not a non-negative int.
    """

    def __init__(self, core: EngineCore, *, bytes_per_s: int = SCRUB_BYTES_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, int) or bytes_per_s < 0:
            raise InvalidInput(f"scrub_bytes_per_s must be a non-negative int, got {bytes_per_s!r}",
                               field="scrub_bytes_per_s")
        self._core = core
        self._clock = clock
        # Only tiers that lend their own bytes keep vouched-for slots; the others hash every read.
        self._tiers = frozenset(t.name for t in core.tiers if t.lends_frames)
        self._stats = ScrubStats(rate_bytes_per_s=bytes_per_s)
        self._cond = threading.Condition()
        self._seen = 0  # the last event handled: verify-behind's cursor into the log
        self._woken = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._unhook: Callable[[], None] | None = None
        self._cycle: Iterator[tuple[str, BlockHash]] = iter(())
        self._cycle_began: float | None = None
        self._next_at = 0.0  # the clock reading before which no block is scrubbed (the bucket)
        self._answering = threading.local()  # per thread: its ``answering`` depth, and a held wake-up

    @property
    def bytes_per_s(self) -> int:
        return self._stats.rate_bytes_per_s

    @property
    def running(self) -> bool:
        """Whether the thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """Start the thread (once; a no-op when no tier lends its frames, or after ``close``)."""
        with self._cond:
            if self._closed or self._thread is not None or not self._tiers:
                return
            self._unhook = self._core.events.add_hook(self._published)
            self._thread = threading.Thread(target=self._run, name="kvstore-scrub", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (it ends within the block it is hashing). Before the tiers close."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread, unhook = self._thread, self._unhook
        if unhook is not None:
            unhook()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def caught_up(self, timeout_s: float = 10.0) -> bool:
        """Wait until every publish so far has been verified (tests and benches); False on timeout,
        or at once when the thread is not running."""
        target = self._core.events.last_seq
        with self._cond:
            if self._thread is None or self._closed:
                return self._seen >= target
            return self._cond.wait_for(lambda: self._seen >= target or self._closed, timeout_s) \
                and self._seen >= target

    def wait_cycles(self, n: int, timeout_s: float = 10.0) -> bool:
        """Wait until ``n`` scrub cycles have completed (tests and benches); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._stats.cycles >= n or self._closed, timeout_s) \
                and self._stats.cycles >= n

    def stats(self) -> dict[str, Any]:
        """A copy of ``ScrubStats`` as a dict."""
        with self._cond:
            return asdict(self._stats)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Hold the verifier's wake-up for what this thread publishes until the block ends, so a
        publishing request finishes before the verifier starts on its frames: the commit channel
        holds it until its answer is sent, the HTTP routes until their handler returns (the
        event loop then sends the answer). A block that publishes more than a quarter of the
        event ring wakes it anyway, so its publishes are not lost off the ring's end.

        Why: woken at the publish, the verifier hashed the request's frames beside the rest of
        the request, on the other core and through the same cache (python-xxhash lets the GIL go
        for large buffers, so it is not the GIL): a co-located 32 MiB put's commit took 2.3-2.6
        ms with it woken at the publish against 1.4-1.7 ms with it woken after the answer. With
        its hash replaced by a sleep as long (no CPU, no GIL) the commit took 1.5 ms, so the
        hash's use of the machine is what cost. Readers lose little: the verifier starts as the
        writer gets its answer, and the frames it has not reached yet are hashed by their first
        reader, as before.
        """
        local = self._answering
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth
            if not depth and getattr(local, "held", False):
                local.held = False
                self._wake()

    # -- the thread -------------------------------------------------------------------------

    def _published(self, seq: int) -> None:
        """The event log's hook, on the emitting thread: wake the verifier, or hold the wake-up
        until the request on this thread is done (``answering``). O(1), never raises."""
        local = self._answering
        if getattr(local, "depth", 0) and seq - self._seen < self._core.events.capacity // 4:
            local.held = True
            return
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            if not self._woken:  # one wake-up per pass, however many puts a batch brings
                self._woken = True
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                self._woken = False  # a publish from here on wakes the wait below
            delay: float | None = None
            try:
                self._verify_published()
                if self.bytes_per_s:
                    delay = self._next_at - self._clock()
                    if delay <= 0:
                        self._scrub_next()
                        continue
            except Exception:  # noqa: BLE001 - a failed pass must not end the thread
                log.exception("kvstore: the background verifier failed; carrying on")
                delay = ERROR_BACKOFF_S
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._woken, delay)

    def _verify_published(self) -> None:
        """Verify-behind: hash the frames published into lent arenas since the last pass."""
        events = self._core.events
        while not self._closed and self._seen < events.last_seq:
            batch, lost = events.read(self._seen, VERIFY_BATCH)
            for ev in batch:
                if self._closed:
                    return
                if ev.kind in (STORED, MOVED) and ev.tier in self._tiers:
                    self._check(ev.key, ev.tier, again=False)
            with self._cond:
                if lost:
                    self._stats.publishes_missed += batch[0].seq - self._seen - 1
                self._seen = batch[-1].seq
                self._cond.notify_all()

    def _scrub_next(self) -> None:
        """Scrub the cycle's next block (its bucket's wait is over), or begin the next cycle."""
        for tier_name, key in self._cycle:
            entry = self._core.entry(key)
            if entry is None or entry.tier != tier_name:
                continue  # gone or moved since the cycle began: its new home's cycle has it
            with self._cond:  # the clock reading and the count together: stats() sees them as one
                now = self._clock()
                self._stats.scrubbed_blocks += 1
                self._stats.scrubbed_bytes += entry.size
                self._next_at = now + max(entry.size, BLOCK_COST_BYTES) / self.bytes_per_s
            self._check(key, tier_name, again=True)
            return
        now = self._clock()
        if self._cycle_began is not None:
            with self._cond:
                self._stats.cycles += 1
                self._stats.last_cycle_s = now - self._cycle_began
                self._cond.notify_all()
            if now - self._cycle_began < MIN_CYCLE_S:
                self._next_at = self._cycle_began + MIN_CYCLE_S
                self._cycle_began = None
                return
        # The cycle is the blocks as they are now; blocks published later are verified behind.
        blocks = [(t.name, key) for t in self._core.tiers if t.name in self._tiers for key in t.keys()]
        self._cycle, self._cycle_began = iter(blocks), now

    def _check(self, key: BlockHash, tier_name: str, *, again: bool) -> None:
        """Hash ``key``'s frame in ``tier_name`` whole: vouch for it when it is sound and is the
        frame its entry names, drop it as corrupt when not. ``again``: hash it even when its slot
        is vouched for already (the scrub); verify-behind leaves a slot a reader checked."""
        core = self._core
        entry = core.entry(key)
        if entry is None or entry.tier != tier_name:
            return  # moved or gone since: a move's own event brings it back here
        tier = core.tier(tier_name)
        damage: list[str] = []

        def hashed(view: memoryview, stamp: int, vouched: bool) -> int:
            if vouched and not again:
                return 0
            try:
                header = codec_mod.verify(view)
            except FrameError as exc:
                damage.append(str(exc))
                return len(view)
            if header.body_checksum != entry.checksum:  # sound, but not the frame the index names
                damage.append(f"body checksum {header.body_checksum:#x}, the index says {entry.checksum:#x}")
            elif stamp:
                tier.vouch(key, stamp)  # a no-op if the slot was published again meanwhile
            return len(view)

        try:
            nbytes = tier.read_vouched(key, hashed)
        except (TierError, StoreClosed) as exc:
            log.debug("verifying %s in tier %s: the tier failed (%s); left to its readers", key.hex(), tier_name, exc)
            return
        if not again and nbytes:
            with self._cond:
                self._stats.verified_blocks += 1
                self._stats.verified_bytes += nbytes
        if damage:
            self._drop(entry, tier_name, damage[0])

    def _drop(self, entry: Any, tier_name: str, why: str) -> None:
        # A put of the key may have written its tier and not yet re-indexed it, so a frame that is
        # not the entry's may be the next one's: once the claim is ours, that put is done.
        with self._core.claim(entry.key):
            current = self._core.entry(entry.key) is entry
        if not current:
            return
        log.warning("block %s in tier %s is damaged (%s); dropped", entry.key.hex(), tier_name, why)
        self._core.drop(entry, corrupt=True)
        with self._cond:
            self._stats.damaged_found += 1
