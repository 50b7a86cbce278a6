"""Large copies split in two halves, one on the calling thread and one on a helper thread.

Why: one thread's copy on these machines runs at a fraction of what the memory can take (on a
2-core AMD EPYC VM, two threads copy 32 MiB 1.25-1.4x faster than one), and the copies a
co-located get or put makes are strided besides (a block of a token-major KV is 4 KiB runs
64 KiB apart), which one thread copies at 0.63-0.8x of a flat copy. numpy's ``copyto`` and
xxhash's hash of a large buffer both let the GIL go, so two halves run on two cores. Measured
in ``docs/benchmarks.md`` ("Stop 49: large copies on two threads").

One helper thread per process, started at the first large copy and gone at a fork (a child
starts its own). A caller that finds the helper busy (another thread of the process is
using it) does the whole copy itself rather than wait: the helper never holds anyone up.

``KVSTORE_COPY_THREADS``: ``2`` (the default, where the process may run on two CPUs or more)
or ``1`` (every copy on the calling thread). ``set_copy_threads`` sets it in code.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, TypeVar

import numpy as np

from kvstore.errors import InvalidInput

__all__ = ["SPLIT_MIN_BYTES", "copyto", "run_halves", "copy_threads", "set_copy_threads"]

T = TypeVar("T")

SPLIT_MIN_BYTES = 16 << 20
"""Copies of fewer bytes stay on one thread. Waking the helper and waiting for it costs about
80 us on a 2-core AMD EPYC VM, and a copy that fits the caches gains little from a second core:
there, cache-hot, two threads took 2.6x one's time for 2 MiB, 1.7x for 4 MiB, 0.95x for 8 MiB,
0.81x for 16 MiB and 0.70x for 32 MiB (stop 49, ``docs/benchmarks.md``)."""

ENV = "KVSTORE_COPY_THREADS"


def _threads_from_env() -> int | None:
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return None
    if raw.strip() not in ("1", "2"):
        raise InvalidInput(f"{ENV}: 1 or 2 copy threads, got {raw!r}")
    return int(raw)


def _default_threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return 2 if cpus >= 2 else 1


class _Helper:
    """The helper thread: runs one job at a time; ``try_start`` hands it a job only when idle."""

    def __init__(self) -> None:
        self._idle = threading.Lock()  # held by the caller whose job the helper runs
        self._ready = threading.Condition(threading.Lock())
        self._job: Callable[[], Any] | None = None
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="kvstore-copy-half", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while self._job is None:
                    self._ready.wait()
                job, self._job = self._job, None
            try:
                self._result, self._error = job(), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                self._result, self._error = None, exc
            # the job's closure holds the caller's arrays (views of an arena, a user's tensor):
            # kept here, they would pin them, and a mapping under them could not close
            job = None
            self._done.set()

    def try_start(self, job: Callable[[], Any]) -> bool:
        """Start ``job`` on the helper when it is idle (then ``finish`` must follow); False when busy.
        The helper itself always finds it busy (its job's caller holds ``_idle``): a copy started
        from a job runs on the helper alone, never waiting on itself."""
        if not self._idle.acquire(blocking=False):
            return False
        self._done.clear()
        with self._ready:
            self._job = job
            self._ready.notify()
        return True

    def finish(self) -> Any:
        """Wait for the job ``try_start`` started; its result, or raise its error. An interrupt
        while waiting (Ctrl-C, a signal handler that raises) is raised only once the job has
        ended: the caller's buffers are not written after it unwinds, and the helper is free."""
        interrupted: BaseException | None = None
        while True:
            try:
                self._done.wait()
                break
            except BaseException as exc:  # noqa: BLE001 - raised below, once the job has ended
                interrupted = interrupted or exc
        result, error = self._result, self._error
        self._result = self._error = None
        self._idle.release()
        if interrupted is not None:
            raise interrupted
        if error is not None:
            raise error
        return result


_lock = threading.Lock()
_helper: _Helper | None = None
_threads: int | None = None


def _reset_after_fork() -> None:
    global _helper, _lock
    _helper = None  # the parent's thread is not in the child
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def copy_threads() -> int:
    """How many threads a large copy uses: ``set_copy_threads``'s, else ``KVSTORE_COPY_THREADS``,
    else 2 where this process may run on two CPUs or more.

    Raises:
        InvalidInput: ``KVSTORE_COPY_THREADS`` is neither 1 nor 2.
    """
    global _threads
    if _threads is None:
        _threads = _threads_from_env() or _default_threads()
    return _threads


def set_copy_threads(n: int) -> None:
    """Use ``n`` threads (1 or 2) for large copies from now on.

    Raises:
        InvalidInput: ``n`` is neither 1 nor 2.
    """
    global _threads
    if n not in (1, 2) or isinstance(n, bool):
        raise InvalidInput(f"copy threads: 1 or 2, got {n!r}")
    _threads = n


def _the_helper() -> _Helper:
    global _helper
    helper = _helper
    if helper is None:
        with _lock:
            if _helper is None:
                _helper = _Helper()
            helper = _helper
    return helper


def run_halves(n: int, nbytes: int, part: Callable[[int, int], list[T]]) -> list[T]:
    """``part(0, n)``, or ``part(0, h) + part(h, n)`` with the second half on the helper thread
    when ``nbytes`` (what the whole moves) is at least ``SPLIT_MIN_BYTES``, ``n`` is at least 2,
    two copy threads are on and the helper is idle. Both halves have ended when this returns or
    raises (an error of either half is raised, the calling thread's first).

    ``part`` must be safe to run on two threads at once over disjoint ranges.
    """
    if n < 2 or nbytes < SPLIT_MIN_BYTES or copy_threads() < 2:
        return part(0, n)
    helper = _the_helper()
    h = n // 2
    if not helper.try_start(lambda: part(h, n)):
        return part(0, n)
    try:
        first = part(0, h)
    except BaseException:
        try:
            helper.finish()
        except BaseException:  # noqa: BLE001 - the calling thread's error is the one raised
            pass
        raise
    return first + helper.finish()


def copyto(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` of arrays of one shape, split along the first axis that has two
    or more entries when large (``run_halves``). Arrays that may overlap are copied on one
    thread, as numpy copies them (two halves of an overlapping copy would race)."""
    if dst.nbytes < SPLIT_MIN_BYTES or copy_threads() < 2:
        np.copyto(dst, src)
        return
    axis = next((a for a, size in enumerate(dst.shape) if size > 1), None)
    if axis is None or dst.shape != src.shape or np.may_share_memory(dst, src):
        np.copyto(dst, src)
        return
    cut = [slice(None)] * axis

    def part(lo: int, hi: int) -> list[None]:
        at = (*cut, slice(lo, hi))
        np.copyto(dst[at], src[at])
        return []

    run_halves(dst.shape[axis], dst.nbytes, part)
