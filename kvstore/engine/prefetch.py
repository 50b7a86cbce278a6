"""Prefetch and hand-off: bring a prefix to the top tier before its reader asks.

Two parts, both owned by the store (``KVStore.prefetch``, ``KVStore.handoff``):

- ``Prefetcher``: a background thread that carries out prefetch jobs. A job walks a
  chain's keys in order; a block this store's index lacks but the shared tier holds
  (another node stored it) is adopted first; every block below the top tier is moved up
  through the mover (``promoted: prefetched ...``, so ``explain`` shows why). A job may
  also *hold* its blocks there for a while (a soft retention owned by ``PREFETCH_OWNER``,
  bounded to ``hold_frac`` of the top tier), so that churn does not push them out again
  before the reader comes; the reader's first access ends the hold. Every job is a decision
  in ``log()``: what triggered it, why, from which tiers, and what it moved.
- ``HandoffLearner``: learns, per namespace, that blocks one agent writes are read by
  another agent soon after (a hand-off), from the puts and reads the server reports with
  the caller's agent id. Once a namespace has shown ``min_handoffs`` within ``window_s``,
  ``pattern`` gives the median gap, and the store holds each new put of that namespace in
  the top tier for about twice that gap (when the planner's policy lets it: the canary can
  roll it back like any policy).

The queue is bounded: past ``max_jobs`` waiting, the oldest job is dropped and counted.
A prefetch is a hint; losing one costs a slower read, never data.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvstore.engine.core import EngineCore
from kvstore.errors import RetainQuotaExceeded, TierError
from kvstore.keys import BlockHash
from kvstore.engine.placement import PREFETCH_OWNER, MoveOrder

__all__ = ["Prefetcher", "HandoffLearner", "PREFETCH_OWNER", "Job"]

log = logging.getLogger("kvstore.engine.prefetch")


@dataclass(slots=True)
class Job:
    """One prefetch: bring ``keys`` (a chain, in order) to the top tier."""

    keys: list[BlockHash]
    namespace: str
    spec_fp: str
    trigger: str
    """requested (a caller asked), hand-off (learned), retain (a retention below the top)."""
    reason: str
    hold_s: float = 0.0
    policy_version: int | None = None
    block_tokens: int = 0
    queued_s: float = field(default_factory=time.monotonic)


RETRY_PAUSES_S = (0.02, 0.05, 0.1, 0.2, 0.4)
"""Pauses before a job tries its refused moves again (0.77 s in all): a move into the top tier is
refused while no free range fits, which passes as reads end and compaction or the mover make room.
A hand-off demo run under load once had 1 of 32 prefetched blocks refused and never tried again."""


HELD_REMEMBERED = 4096
"""Holds remembered so that a newer one can end them; past it, the oldest only ends by its first read
or its expiry, as every hold does."""


class Prefetcher:
    """Carries out prefetch jobs in one background thread.

    Args:
        core: the store's engine core.
        execute: the mover's ``execute`` (a move under the key's claim; ``force_room=True``: room made
            whatever placement counts free).
        hold_frac: at most this share of the top tier is held for prefetches at once; a newer
            hold ends the oldest ones when it needs their room.
        max_jobs: jobs waiting at most; past it the oldest is dropped.
    """

    def __init__(self, core: EngineCore, execute: Callable[..., bool], *, hold_frac: float = 0.25,
                 max_jobs: int = 1024, log_size: int = 1000) -> None:
        self._core = core
        self._execute = execute
        self._hold_bytes = int(core.tiers[0].capacity_bytes * hold_frac)
        self._jobs: deque[Job] = deque()
        self._held: deque[tuple[int, list[BlockHash]]] = deque()
        """Each hold placed, oldest first: its number and keys (ones read or expired since end harmlessly)."""
        self._hold_of: dict[BlockHash, int] = {}
        """The number of the latest hold of each key in ``_held``: a key held again belongs to that one."""
        self._holds = 0
        self._held_lock = threading.Lock()
        self._max_jobs = max_jobs
        self._cond = threading.Condition()
        self._log: deque[dict[str, Any]] = deque(maxlen=log_size)
        self._seq = 0
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self.counters = Counter()

    def submit(self, job: Job) -> None:
        """Queue ``job``; returns at once."""
        with self._cond:
            if self._stop:
                return
            if len(self._jobs) >= self._max_jobs:
                self._jobs.popleft()
                self.counters["dropped"] += 1
            self._jobs.append(job)
            self.counters["queued"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvstore-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no job is queued or running (tests and benches); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)

    def log(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest prefetch decisions, newest last."""
        with self._cond:
            return list(self._log)[-limit:]

    def _hold(self, keys: list[BlockHash], hold_s: float) -> int:
        """Hold ``keys`` for ``hold_s``. Past the hold budget, the oldest holds give way first (the
        newest hint is the likeliest to be read next); then as many leading keys as fit (a prefix
        without its head serves nothing). How many are held."""
        placement = self._core.placement
        while True:
            try:
                held = placement.retain(keys, hold_s, owner=PREFETCH_OWNER, quota_bytes=self._hold_bytes)[0]
            except RetainQuotaExceeded as exc:
                oldest = self._forget_oldest()
                if oldest is None:  # none left to give way: hold what fits
                    room = exc.quota_bytes - exc.retained_bytes
                    break
                # An unheld promoted block is the coldest in a full top tier: the next put's room (or
                # the drain, once its residency has passed) sends it straight back down, so a prefetch
                # the budget could not hold would be two wasted moves and a reader who finds it below.
                self.counters["holds_displaced"] += placement.unretain(oldest, owner=PREFETCH_OWNER)
                continue
            self._remember(keys)
            return held
        fit: list[BlockHash] = []
        for key in keys:
            entry = self._core.entry(key)
            if entry is None or entry.size > room:
                break
            room -= entry.size
            fit.append(key)
        self.counters["holds_cut"] += 1
        if not fit:
            return 0
        try:
            held = placement.retain(fit, hold_s, owner=PREFETCH_OWNER, quota_bytes=self._hold_bytes)[0]
        except RetainQuotaExceeded:  # another job took the room meanwhile
            return 0
        self._remember(fit)
        return held

    def _remember(self, keys: list[BlockHash]) -> None:
        """``keys`` were just held: the newest hold, and the one each of them belongs to now."""
        with self._held_lock:
            self._holds += 1
            self._held.append((self._holds, keys))
            for key in keys:
                self._hold_of[key] = self._holds
            while len(self._held) > HELD_REMEMBERED:  # the oldest then ends by its read or expiry
                self._pop_oldest()

    def _forget_oldest(self) -> list[BlockHash] | None:
        """The keys of the oldest hold remembered that no later hold took over (maybe none); None
        when no hold is remembered."""
        with self._held_lock:
            return self._pop_oldest() if self._held else None

    def _pop_oldest(self) -> list[BlockHash]:
        number, keys = self._held.popleft()
        mine = [key for key in keys if self._hold_of.get(key) == number]
        for key in mine:
            del self._hold_of[key]
        return mine

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._jobs or self._stop)
                if self._stop:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                self.run(job)
            except Exception:  # a prefetch is a hint: a bug here must not stop the next one
                log.exception("prefetch failed")
            if self._core.closed:
                return

    def run(self, job: Job) -> dict[str, Any]:
        """Carry out ``job`` now (in the caller's thread); returns its decision record."""
        core = self._core
        top = core.tiers[0].name
        started = time.monotonic()
        sources: Counter = Counter()
        frames: dict[BlockHash, Any] = {}
        found = core.current_prefix(job.keys, job.namespace, job.spec_fp, adopted=frames)
        have = [e.key for e in found]
        sources.update(e.tier for e in found)
        adopted = len(frames)
        held = self._hold(have, job.hold_s) if job.hold_s > 0 and have else 0
        moved = retried = 0
        # Leased while the job runs: a block it promoted must not be the room the next one makes
        # (a full top tier of hotter blocks would otherwise see the prefix push itself out).
        leased = [key for key in have if core.placement.lease(key)]
        try:
            pending = have
            for pause in (0.0, *RETRY_PAUSES_S):
                if not pending:
                    break
                if pause:  # a refusal is often passing: ranges being read, a compaction, the mover
                    time.sleep(pause)
                    retried += len(pending)
                left = []
                for key in pending:
                    outcome = self._promote(key, top, job, force=bool(pause))
                    moved += outcome == "moved"
                    if outcome == "refused":
                        left.append(key)
                pending = left
        finally:
            for key in leased:
                core.placement.release(key)
        failed = len(pending)
        self.counters["jobs"] += 1
        self.counters["blocks_moved"] += moved
        record = {"time_s": time.time(), "op": "prefetch", "trigger": job.trigger, "namespace": job.namespace,
                  "blocks": len(have), "tokens": len(have) * job.block_tokens, "from": dict(sources),
                  "to": top, "adopted": adopted, "moved": moved, "failed": failed, "retried": retried,
                  "held": held, "hold_s": job.hold_s, "reason": job.reason,
                  "policy_version": job.policy_version, "wait_s": started - job.queued_s,
                  "took_s": time.monotonic() - started}
        with self._cond:
            self._seq += 1
            record["seq"] = self._seq
            self._log.append(record)
        return record

    def _promote(self, key: BlockHash, top: str, job: Job, *, force: bool = False) -> str:
        """Move ``key`` to ``top``: ``moved``, ``refused``, or ``done`` (there already, or gone).

        ``force``: make room for it whatever placement counts free (a retry): the arena may have no
        free range that fits although placement's books have the bytes (slots lent to co-located
        writers, ranges being read), and then nothing else makes room, as a put's forced try knows.
        """
        entry = self._core.entry(key)
        if entry is None or entry.tier == top:
            return "done"
        order = MoveOrder(key, entry.tier, top, entry.size, f"promoted: prefetched ({job.trigger}): {job.reason}")
        try:
            if force:
                self.counters["moves_forced"] += 1
            return "moved" if self._execute(order, force_room=force) else "refused"
        except TierError as exc:
            log.warning("prefetch of %s failed: %s", key.hex(), exc)
            return "refused"


@dataclass(slots=True)
class _Gaps:
    times: deque = field(default_factory=lambda: deque(maxlen=64))
    gaps: deque = field(default_factory=lambda: deque(maxlen=64))


class HandoffLearner:
    """Learns hand-offs per namespace: a block written by one agent, read by another soon after.

    Args:
        window_s: a read this long after the write, or longer, is not a hand-off; and only
            hand-offs seen within this long count toward a pattern.
        min_handoffs: hand-offs within ``window_s`` that make a pattern.
        remember: puts remembered at most (the oldest are forgotten first).
    """

    def __init__(self, *, window_s: float = 600.0, min_handoffs: int = 2, remember: int = 8192,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.min_handoffs = min_handoffs
        self._remember = remember
        self._clock = clock
        self._puts: OrderedDict[BlockHash, tuple[str, float, str]] = OrderedDict()
        self._seen: dict[str, _Gaps] = {}
        self._lock = threading.Lock()

    def wrote(self, keys: Sequence[BlockHash], namespace: str, agent: str) -> None:
        """``agent`` stored ``keys`` (a chain): its deepest block stands for the chain."""
        if not keys:
            return
        now = self._clock()
        with self._lock:
            self._puts[keys[-1]] = (agent, now, namespace)
            self._puts.move_to_end(keys[-1])
            while len(self._puts) > self._remember:
                self._puts.popitem(last=False)

    def read(self, keys: Sequence[Any], namespace: str, agent: str,
             key: Callable[[Any], BlockHash] | None = None) -> float | None:
        """``agent`` read the prefix ``keys`` (block keys, or items ``key`` maps to them: the
        caller's own list, with no copy on the get path); the gap in seconds when this read
        completes a hand-off (a chain another agent wrote, read within ``window_s``), else None."""
        if not keys:
            return None
        now = self._clock()
        with self._lock:
            for item in reversed(keys):  # the deepest chain written that this read covers
                k = item if key is None else key(item)
                put = self._puts.get(k)
                if put is None:
                    continue
                writer, at, ns = put
                if writer == agent or ns != namespace:
                    return None
                del self._puts[k]  # one hand-off per put
                gap = now - at
                if gap >= self.window_s:
                    return None
                seen = self._seen.setdefault(namespace, _Gaps())
                seen.times.append(now)
                seen.gaps.append(gap)
                return gap
        return None

    def pattern(self, namespace: str) -> tuple[int, float] | None:
        """(hand-offs within ``window_s``, their median gap) once they make a pattern, else None."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(namespace)
            if seen is None:
                return None
            recent = [g for t, g in zip(seen.times, seen.gaps) if now - t < self.window_s]
        if len(recent) < self.min_handoffs:
            return None
        return len(recent), statistics.median(recent)

    def describe(self) -> dict[str, Any]:
        """Per namespace: hand-offs seen within the window and their median gap."""
        with self._lock:
            names = list(self._seen)
        out = {}
        for ns in names:
            got = self.pattern(ns)
            if got is not None:
                out[ns] = {"handoffs": got[0], "median_gap_s": got[1]}
        return out
