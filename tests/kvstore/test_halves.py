"""``kvstore.memory.halves``: large copies in two halves, the second on a helper thread. The
result is the same bytes in the same order as one thread's; both halves have ended when a call
returns or raises; a busy or absent helper never blocks a caller; a fork leaves a usable one."""

from __future__ import annotations

import mmap
import os
import select
import signal
import threading
import weakref

import numpy as np
import pytest

from kvstore.errors import InvalidInput
from kvstore.memory import halves

BIG = halves.SPLIT_MIN_BYTES


@pytest.fixture(autouse=True)
def two_threads():
    before = halves.copy_threads()
    halves.set_copy_threads(2)
    yield
    halves.set_copy_threads(before)


def _parts(threads: list[str]):
    def part(lo: int, hi: int) -> list[int]:
        threads.append(threading.current_thread().name)
        return list(range(lo, hi))
    return part


def test_a_large_run_splits_in_order_across_two_threads():
    threads: list[str] = []
    assert halves.run_halves(9, BIG, _parts(threads)) == list(range(9))
    assert sorted(threads) == sorted([threading.current_thread().name, "kvstore-copy-half"])


@pytest.mark.parametrize("n, nbytes, threads_on", [(9, BIG - 1, 2), (1, BIG, 2), (9, BIG, 1)])
def test_a_small_run_one_item_or_one_copy_thread_stays_on_the_caller(n, nbytes, threads_on):
    halves.set_copy_threads(threads_on)
    threads: list[str] = []
    assert halves.run_halves(n, nbytes, _parts(threads)) == list(range(n))
    assert threads == [threading.current_thread().name]


@pytest.mark.parametrize("failing", ["caller", "helper"])
def test_an_error_in_either_half_is_raised_once_both_halves_ended(failing):
    ended: list[int] = []
    started = threading.Barrier(2, timeout=10)

    def part(lo: int, hi: int) -> list[int]:
        on_helper = threading.current_thread().name == "kvstore-copy-half"
        started.wait()  # both halves run at once
        if on_helper == (failing == "helper"):
            raise OSError(f"half [{lo}, {hi}) failed")
        threading.Event().wait(0.05)  # the other half ends after the failure
        ended.append(lo)
        return []
    with pytest.raises(OSError, match="failed"):
        halves.run_halves(4, BIG, part)
    assert len(ended) == 1  # the half that did not fail had ended before the call raised


def test_a_caller_finding_the_helper_busy_does_the_whole_run_itself():
    release, inside = threading.Event(), threading.Event()
    held: list[int] = []

    def slow(lo: int, hi: int) -> list[int]:
        if threading.current_thread().name == "kvstore-copy-half":
            inside.set()
            assert release.wait(10)
        return list(range(lo, hi))
    other = threading.Thread(target=lambda: held.extend(halves.run_halves(4, BIG, slow)))
    other.start()
    try:
        assert inside.wait(10)
        threads: list[str] = []
        assert halves.run_halves(6, BIG, _parts(threads)) == list(range(6))
        assert threads == [threading.current_thread().name]
    finally:
        release.set()
        other.join(10)
    assert held == list(range(4))


def test_a_run_started_on_the_helper_does_not_wait_for_itself():
    def outer(lo: int, hi: int) -> list[list[int]]:
        return [halves.run_halves(4, BIG, _parts([]))]
    got = halves.run_halves(2, BIG, outer)
    assert got == [list(range(4)), list(range(4))]


def test_the_helper_keeps_nothing_of_a_copy_once_it_returned():
    """A mapping copied into can close right after (the staging lease's, an arena's), and the
    arrays of a finished copy are freed: the helper holds no reference to its last job."""
    src = np.ones(BIG, np.uint8)
    gone = weakref.ref(src)
    mapped = mmap.mmap(-1, BIG)
    dst = np.frombuffer(mapped, np.uint8)
    halves.copyto(dst, src)
    assert dst.all()
    del dst, src
    mapped.close()  # BufferError while anything still exports the mapping
    assert gone() is None


class _Interrupt(BaseException):
    pass


def test_an_interrupt_while_waiting_for_the_helper_is_raised_once_its_half_ended():
    ended = threading.Event()

    def part(lo: int, hi: int) -> list[int]:
        if threading.current_thread().name == "kvstore-copy-half":
            threading.Event().wait(0.3)  # still writing when the interrupt comes
            ended.set()
        return []

    def interrupt(*_):
        raise _Interrupt()
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(_Interrupt):
            halves.run_halves(4, BIG, part)
        assert ended.is_set()  # the caller unwound only after the helper's half had ended
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    threads: list[str] = []
    halves.run_halves(4, BIG, _parts(threads))
    assert "kvstore-copy-half" in threads  # the helper is free for the next copy


def test_arrays_that_may_overlap_are_copied_on_one_thread_as_numpy_does():
    base = np.arange(BIG // 4 + 1024, dtype=np.int32)
    want = base.copy()
    want[1024:] = base[:-1024].copy()
    halves.copyto(base[1024:], base[:-1024])
    assert np.array_equal(base, want)


def test_copyto_copies_a_strided_view_as_numpy_does():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 1 << 15, (32, 2, 8, 256, 128), dtype=np.int16)  # 32 MiB, token-major
    want = np.ascontiguousarray(src[:, :, :, 16:48])
    dst = np.zeros_like(want)
    halves.copyto(dst, src[:, :, :, 16:48])
    assert np.array_equal(dst, want)
    flat_src = rng.integers(0, 255, BIG + 3, dtype=np.uint8)
    flat = np.zeros_like(flat_src)
    halves.copyto(flat, flat_src)
    assert np.array_equal(flat, flat_src)


def test_copyto_of_a_first_axis_of_one_splits_along_the_next():
    src = np.arange(BIG // 2, dtype=np.int32).reshape(1, 1, 64, -1)
    dst = np.zeros_like(src)
    halves.copyto(dst, src)
    assert np.array_equal(dst, src)


def test_copyto_broadcasts_as_numpy_does():
    dst = np.zeros((BIG // 8, 2), np.int32)
    halves.copyto(dst, np.array([7, 9], np.int32))
    assert (dst[:, 0] == 7).all() and (dst[:, 1] == 9).all()


def test_a_forked_child_copies_with_a_helper_of_its_own():
    halves.copyto(np.zeros(BIG, np.uint8), np.ones(BIG, np.uint8))  # the parent's helper runs
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy must not wait on the parent's helper thread
        try:
            dst = np.zeros(BIG, np.uint8)
            halves.copyto(dst, np.ones(BIG, np.uint8))
            threads: list[str] = []
            halves.run_halves(4, BIG, _parts(threads))
            os.write(w, b"ok" if dst.all() and "kvstore-copy-half" in threads else b"no")
        finally:
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        got = os.read(r, 2) if ready else b"hung"
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert got == b"ok"


@pytest.mark.parametrize("bad", ["3", "two", "0"])
def test_a_bad_copy_thread_count_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv(halves.ENV, bad)
    monkeypatch.setattr(halves, "_threads", None)
    with pytest.raises(InvalidInput, match=halves.ENV):
        halves.copy_threads()
    with pytest.raises(InvalidInput, match="1 or 2"):
        halves.set_copy_threads(int(bad) if bad.isdigit() else 5)


def test_the_environment_sets_one_copy_thread(monkeypatch):
    monkeypatch.setenv(halves.ENV, "1")
    monkeypatch.setattr(halves, "_threads", None)
    assert halves.copy_threads() == 1
    threads: list[str] = []
    halves.run_halves(4, BIG, _parts(threads))
    assert threads == [threading.current_thread().name]
