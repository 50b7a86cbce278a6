"""Puts that return before they land: ``put_kv(..., wait=False)``, its handle, and ``flush()``.

A put with ``wait=False`` checks its input as a waiting put does, copies the bytes the put
needs (the KV of every full block) into the client's result pool (``_common.TensorPool``:
memory whose pages were faulted in once, so the copy runs at memcpy speed; a fresh buffer
faults its pages at a fraction of that), and returns a handle. The caller may overwrite its
tensor at once. One worker per client, a thread for ``KVClient`` and a task for
``AsyncKVClient``, runs the ordinary put of each copy, one at a time, so the puts land in the
order they were queued; each is visible once its handle is done.

The rules (``docs/operations.md``, "Puts that do not wait"):

- Memory: the queued copies hold at most ``max_pending_bytes``. Past it, ``put_kv(wait=False)``
  waits until earlier puts finish; nothing is dropped. A put larger than the bound goes alone.
- Failures: a failed put's error is its handle's (``result()`` raises it, every time). The
  client raises it once more, as ``PutFailed`` with the error as its cause, from the first
  ``put_kv`` (either mode; that put is then not made) or ``flush()`` that starts after the failure
  was recorded. One ``PutFailed`` reports every failure recorded by then. ``close()`` waits for
  the queued puts and logs a failure not yet raised; it never raises one.
- Order: puts with ``wait=False`` land in the order they were queued. A waiting put runs at
  once on the caller's thread, beside the queue; ``flush()`` first orders it after them.

``Outstanding`` is what both workers count (bytes, puts, failures) and it does no waiting;
``PutQueue`` waits on it with a thread's lock, ``AsyncPutQueue`` on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator

import numpy as np
import torch

from client_sdk._common import TensorPool
from client_sdk.aio_media import off_loop
from kvstore.codec import int_view
from kvstore.errors import InvalidInput, PutFailed, StoreClosed
from kvstore.memory import halves
from kvstore.spec import KVSpec

__all__ = ["PutHandle", "AsyncPutHandle", "PutQueue", "AsyncPutQueue", "Outstanding", "snapshot",
           "MAX_PENDING_BYTES"]

log = logging.getLogger("kvstore.client")

MAX_PENDING_BYTES = 1 << 30
"""Default bound on the bytes queued puts hold (1 GiB): a burst of 32 MiB puts runs 32 deep."""


def snapshot(pool: TensorPool, spec: KVSpec, kv: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` of ``kv``, copied into pooled memory (one strided copy; from a GPU,
    one device-to-host copy). Its buffer goes back to the pool when the put lets go of it."""
    out, ints = pool.tensor_and_ints(spec.kv_shape(n_tokens), spec.torch_dtype)
    src = kv.detach()[:, :, :, :n_tokens]
    if ints is not None and src.device.type == "cpu":
        # numpy, not torch's copy_: torch splits the work over its threads and waits for the
        # slowest, spinning: with the other core busy (the server, our put thread), a 1 MiB copy_
        # took 3 ms here instead of 0.1. ``halves`` splits only copies of 16 MiB and more, and its
        # caller sleeps while it waits, which frees its core for the helper's half.
        halves.copyto(ints, int_view(src))
    else:
        out.copy_(src)
    return out


@dataclass(slots=True)
class _Job:
    """One queued put: the copy it sends, and the handle it settles."""

    spec: KVSpec
    toks: np.ndarray
    kv: torch.Tensor | None
    """The snapshot; dropped as soon as the put returns, so its buffer is back in the pool
    before its bytes count as free."""
    durable: bool
    nbytes: int
    handle: "PutHandle | AsyncPutHandle"


class Outstanding:
    """What one client's queued puts hold: bytes, counts, and failures the client has not raised.

    No lock of its own: ``PutQueue`` calls it under its lock, ``AsyncPutQueue`` on its loop.

    Args:
        max_pending_bytes: the most bytes of copies held at once (see the module's rules).
        namespace: the client's, named in ``PutFailed``.
    """

    def __init__(self, max_pending_bytes: int, namespace: str) -> None:
        if max_pending_bytes <= 0:
            raise InvalidInput(f"max_pending_bytes must be positive, got {max_pending_bytes}")
        self.max_pending_bytes = max_pending_bytes
        self.namespace = namespace
        self.pending_bytes = 0
        """Bytes of copies being made or queued or in flight."""
        self.queued = 0
        """Puts queued so far; a flush waits until ``finished`` reaches the count it saw."""
        self.finished = 0
        self.failures: list[tuple[int, str, BaseException]] = []
        """(tokens, model id, error) of each failed put the client has not raised yet."""

    def admits(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` may be made now: it fits, or nothing else is held."""
        return self.pending_bytes == 0 or self.pending_bytes + nbytes <= self.max_pending_bytes

    def reserve(self, nbytes: int) -> None:
        self.pending_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.pending_bytes -= nbytes

    def finish(self, job: _Job, error: BaseException | None) -> None:
        self.finished += 1
        self.release(job.nbytes)
        if error is not None:
            self.failures.append((job.handle.tokens, job.spec.model_id, error))

    def take_failure(self) -> PutFailed | None:
        """One ``PutFailed`` for every failure not raised yet (the first is its cause); None if none."""
        if not self.failures:
            return None
        failures, self.failures = self.failures, []
        tokens, model_id, cause = failures[0]
        more = f"; {len(failures) - 1} later put(s) with wait=False failed too" if len(failures) > 1 else ""
        err = PutFailed(f"a put_kv(wait=False) of {tokens} tokens of {model_id!r} in namespace {self.namespace!r} "
                        f"failed: {type(cause).__name__}: {cause}{more}",
                        tokens=tokens, namespace=self.namespace, failed=len(failures))
        err.__cause__ = cause  # as ``raise err from cause`` would
        err.__suppress_context__ = True
        return err

    def log_failures(self) -> None:
        """Log, at close, the failures no call raised."""
        failure = self.take_failure()
        if failure is not None:
            log.warning("closing with unreported put failures: %s", failure)


def _job_of(spec: KVSpec, toks: np.ndarray) -> tuple[int, int]:
    """(tokens, bytes) a put sends: its full blocks only, as the server stores nothing else."""
    n = spec.full_blocks(len(toks)) * spec.block_tokens
    return n, n * spec.bytes_per_token


def _forget_locals(exc: BaseException) -> BaseException:
    """Clear the locals of the frames ``exc``'s tracebacks hold (kept: file and line), so a failed
    put kept on its handle does not keep its copy, megabytes, from going back to the pool."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    return exc


class PutHandle:
    """A put queued by ``KVClient.put_kv(..., wait=False)``; its blocks are visible once it is done.

    Attributes:
        tokens: the tokens the put sends (its full blocks).
        nbytes: the bytes its copy holds.
    """

    __slots__ = ("tokens", "nbytes", "_future")

    def __init__(self, tokens: int, nbytes: int) -> None:
        self.tokens = tokens
        self.nbytes = nbytes
        self._future: Future[int] = Future()

    def done(self) -> bool:
        """Whether the put finished, stored or failed."""
        return self._future.done()

    def result(self, timeout_s: float | None = None) -> int:
        """The tokens the put covered, as ``put_kv`` returns them.

        Raises:
            The put's own error (``TierFull``, ``QuotaExceeded``, ``NotDurable``...), every call.
            TimeoutError: the put did not finish within ``timeout_s`` (it goes on).
        """
        return self._future.result(timeout_s)

    def exception(self, timeout_s: float | None = None) -> BaseException | None:
        """The put's error, or None when it stored; TimeoutError as ``result``."""
        return self._future.exception(timeout_s)

    def _settle(self, stored: int | None, error: BaseException | None) -> None:
        if error is None:
            self._future.set_result(stored)  # type: ignore[arg-type]
        else:
            self._future.set_exception(error)

    def __repr__(self) -> str:
        return f"<PutHandle {self.tokens} tokens {'done' if self.done() else 'pending'}>"


class PutQueue:
    """``KVClient``'s queued puts and the thread that sends them, one at a time, in order.

    Args:
        put: the client's waiting put, ``put(spec, toks, kv, durable) -> tokens``.
        pool: where copies are made (the client's result pool).
        namespace: the client's, named in ``PutFailed``.
        max_pending_bytes: the bound on the bytes of queued copies.
    """

    def __init__(self, put: Callable[[KVSpec, np.ndarray, torch.Tensor, bool], int], pool: TensorPool,
                 namespace: str, max_pending_bytes: int) -> None:
        self.state = Outstanding(max_pending_bytes, namespace)
        self._put = put
        self._pool = pool
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        return self.state.pending_bytes

    def raise_failed(self) -> None:
        """Raise ``PutFailed`` if a queued put failed since the client last raised one."""
        if self.state.failures:  # read unlocked: a failure recorded meanwhile is the next call's
            with self._cv:
                failure = self.state.take_failure()
            if failure is not None:
                raise failure

    def submit(self, spec: KVSpec, toks: np.ndarray, kv: torch.Tensor, durable: bool) -> PutHandle:
        """Copy the put's bytes aside (waiting for room first) and queue it; input already checked."""
        n, nbytes = _job_of(spec, toks)
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self.state.admits(nbytes))
            if self._closed:
                raise StoreClosed("put_kv(wait=False) on a closed client")
            self.state.reserve(nbytes)
        try:
            job = _Job(spec, toks[:n].copy(), snapshot(self._pool, spec, kv, n), durable, nbytes, PutHandle(n, nbytes))
        except BaseException:
            self._release(nbytes)
            raise
        with self._cv:
            if self._closed:  # closed while copying: close() did not wait for this one
                self.state.release(nbytes)
                self._cv.notify_all()
                raise StoreClosed("put_kv(wait=False) on a closed client")
            self._jobs.append(job)
            self.state.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvstore-put", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return job.handle  # type: ignore[return-value]

    def _release(self, nbytes: int) -> None:
        with self._cv:
            self.state.release(nbytes)
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            stored, error = None, None
            try:
                stored = self._put(job.spec, job.toks, job.kv, job.durable)  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001 - the put's error is its handle's; the thread goes on
                error = _forget_locals(exc)
            job.kv = None
            with self._cv:  # one step: a caller who saw the handle fail finds the failure counted too
                self.state.finish(job, error)
                job.handle._settle(stored, error)
                self._cv.notify_all()
            del job

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the puts queued before this call; see ``KVClient.flush``."""
        with self._cv:
            target = self.state.queued
            done = self._cv.wait_for(lambda: self.state.finished >= target, timeout_s)
            failure = self.state.take_failure()
        if failure is not None:
            raise failure
        return done

    def close(self) -> None:
        """Wait for every queued put, stop the thread, log failures never raised. Never raises them."""
        with self._cv:
            self._closed = True  # the thread stops once the queue is empty; new puts are refused
            self._cv.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._cv:
            self.state.log_failures()


class AsyncPutHandle:
    """A put queued by ``AsyncKVClient.put_kv(..., wait=False)``: ``await handle`` is its result.

    As ``PutHandle``, with ``result`` and ``exception`` awaited. Waiting with a timeout, or
    being cancelled while waiting, leaves the put running.
    """

    __slots__ = ("tokens", "nbytes", "_future")

    def __init__(self, tokens: int, nbytes: int) -> None:
        self.tokens = tokens
        self.nbytes = nbytes
        self._future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def done(self) -> bool:
        return self._future.done()

    async def result(self, timeout_s: float | None = None) -> int:
        """As ``PutHandle.result``."""
        return await asyncio.wait_for(asyncio.shield(self._future), timeout_s)

    async def exception(self, timeout_s: float | None = None) -> BaseException | None:
        """As ``PutHandle.exception``."""
        done, _ = await asyncio.wait({self._future}, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"the put of {self.tokens} tokens did not finish within {timeout_s} s")
        return self._future.exception()

    def __await__(self) -> Generator[Any, None, int]:
        return self.result().__await__()

    def _settle(self, stored: int | None, error: BaseException | None) -> None:
        if error is None:
            self._future.set_result(stored)  # type: ignore[arg-type]
        else:
            self._future.set_exception(error)
            self._future.exception()  # retrieved: the client reports it, the loop need not warn

    def __repr__(self) -> str:
        return f"<AsyncPutHandle {self.tokens} tokens {'done' if self.done() else 'pending'}>"


class AsyncPutQueue:
    """``AsyncKVClient``'s queued puts and the task that sends them, one at a time, in order.

    Everything runs on the client's event loop, so there is no lock: a change wakes every
    waiter (``_changed``), and each checks what it waits for again. Copies over 1 MiB are made
    in a worker thread (``aio_media.off_loop``): the loop goes on meanwhile, and the caller's
    ``await`` returns once the copy is made.

    Args: as ``PutQueue``'s, with ``put`` a coroutine function.
    """

    def __init__(self, put: Callable[[KVSpec, np.ndarray, torch.Tensor, bool], Awaitable[int]], pool: TensorPool,
                 namespace: str, max_pending_bytes: int) -> None:
        self.state = Outstanding(max_pending_bytes, namespace)
        self._put = put
        self._pool = pool
        self._jobs: deque[_Job] = deque()
        self._worker: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        return self.state.pending_bytes

    def raise_failed(self) -> None:
        """As ``PutQueue.raise_failed``."""
        failure = self.state.take_failure()
        if failure is not None:
            raise failure

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    async def submit(self, spec: KVSpec, toks: np.ndarray, kv: torch.Tensor, durable: bool) -> AsyncPutHandle:
        """As ``PutQueue.submit``."""
        n, nbytes = _job_of(spec, toks)
        await self._until(lambda: self._closed or self.state.admits(nbytes))
        if self._closed:
            raise StoreClosed("put_kv(wait=False) on a closed client")
        self.state.reserve(nbytes)
        try:
            copy = await off_loop(nbytes, snapshot, self._pool, spec, kv, n)
            if self._closed:
                raise StoreClosed("put_kv(wait=False) on a closed client")
        except BaseException:  # cancelled or closed while copying: the bytes are free again
            self.state.release(nbytes)
            self._notify()
            raise
        job = _Job(spec, toks[:n].copy(), copy, durable, nbytes, AsyncPutHandle(n, nbytes))
        self._jobs.append(job)
        self.state.queued += 1
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        return job.handle  # type: ignore[return-value]

    async def _drain(self) -> None:
        """Send the queued puts until none is left (the next submit starts a new task).

        Cancelled (the loop shutting down), it fails the put it held and every one queued
        behind it with ``StoreClosed``, so nothing waits on them, then stops.
        """
        cancelled: asyncio.CancelledError | None = None
        stopped: BaseException | None = None
        while self._jobs:
            job = self._jobs.popleft()
            stored, error = None, stopped
            if cancelled is None:
                try:
                    stored = await self._put(job.spec, job.toks, job.kv, job.durable)  # type: ignore[arg-type]
                except asyncio.CancelledError as exc:
                    cancelled = exc
                    error = stopped = StoreClosed("the client's put task was cancelled before this put finished")
                except BaseException as exc:  # noqa: BLE001 - the put's error is its handle's
                    error = _forget_locals(exc)
            job.kv = None
            self.state.finish(job, error)
            job.handle._settle(stored, error)
            self._notify()
            del job
        self._worker = None
        if cancelled is not None:
            raise cancelled

    async def flush(self, timeout_s: float | None = None) -> bool:
        """As ``PutQueue.flush``."""
        target = self.state.queued
        done = True
        try:
            async with asyncio.timeout(timeout_s):
                await self._until(lambda: self.state.finished >= target)
        except TimeoutError:
            done = False
        self.raise_failed()
        return done

    async def aclose(self) -> None:
        """As ``PutQueue.close``."""
        self._closed = True
        self._notify()
        await self._until(lambda: self.state.pending_bytes == 0 and not self._jobs)
        self.state.log_failures()
