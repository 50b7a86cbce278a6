"""The device tier: frames in one preallocated torch tensor on a GPU, or on the CPU.

The pool is a single ``uint8`` tensor of ``arena_bytes`` allocated at start;
``ArenaTier`` carves frames out of it, so a put never allocates device memory.
On a machine without CUDA the same code runs with the pool on ``cpu`` and
``stats().details["device"]`` says ``cpu (no CUDA)``.

Traffic runs in three lanes, each a lock and (with CUDA) its own stream:

- *in* (host -> pool) and *out* (pool -> host) stage pageable host memory
  through two reused pinned halves. While the DMA engine copies one half, the
  CPU fills (or drains) the other; an event per half says when it is free
  again. Pinned caller buffers skip staging and are DMA'd directly.
- *local* (pool -> pool, pool -> another GPU tensor) carries compaction moves
  and ``get_tensor``.

Every copy synchronises its stream before returning, so a range is never
unpinned, reused or handed out while a DMA still touches it, and what ``get``
returns is already complete and the caller's own.

Errors: a malformed device (``"gpu"``, ``"meta"``) is ``InvalidInput``. A CUDA
device asked for where CUDA is absent, or a pool the device cannot hold, is
``TierUnavailable``: the configuration is sound, the backing is not there on
this host, just as for a Redis server that is down.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

import numpy as np
import torch

from kvstore.errors import InvalidInput, KVStoreError, StoreClosed, TierUnavailable
from kvstore.keys import BlockHash
from kvstore.memory.slab import Move
from kvstore.tier import Buffer
from tiers.arena import ALIGN, ArenaTier

__all__ = ["DeviceTier", "resolve_device", "DEFAULT_STAGING_BYTES"]

DEFAULT_STAGING_BYTES = 8 << 20
"""Pinned bytes per direction on CUDA: two 4 MiB halves, each DMA long enough
(~80 us at 50 GB/s) to hide the launch and event overhead between chunks."""

_MOVE_SCRATCH_BYTES = 4 << 20  # bounce buffer for compaction moves shorter than their distance

# torch.frombuffer warns once on read-only buffers; a put only ever reads from them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device a ``DeviceTier`` should use.

    Args:
        device: ``"cuda:N"``, ``"cuda"``, ``"cpu"``, a ``torch.device``, or
            ``None`` for ``cuda:0`` when CUDA is available and ``cpu`` otherwise.

    Returns:
        A device with an explicit index for CUDA.

    Raises:
        InvalidInput: not a device, or a kind other than cpu and cuda.
        TierUnavailable: a CUDA device on a host without CUDA, or past the last GPU.
    """
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInput(f"not a torch device: {device!r}") from exc
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise InvalidInput(f"the device tier runs on cpu or cuda, not {dev.type!r}")
    if not torch.cuda.is_available():
        raise TierUnavailable(f"{dev} asked for, but CUDA is not available (torch {torch.__version__})")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise TierUnavailable(f"{dev} asked for, but only {torch.cuda.device_count()} CUDA devices exist")
    return torch.device("cuda", index)


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidInput("the tensor must be contiguous")
    return tensor.detach().reshape(-1).view(torch.uint8)


def _chunks(total: int, step: int) -> Iterator[tuple[int, int, int]]:
    """``(i, start, stop)`` covering ``[0, total)`` in pieces of at most ``step``."""
    for i, start in enumerate(range(0, total, step)):
        yield i, start, min(start + step, total)


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``, through numpy when both live on the CPU.

    torch's CPU ``copy_`` fans out to OpenMP threads; on a small, busy machine
    a 1 MiB copy then measured 8 ms (0.13 GB/s) where numpy's memcpy takes 20 us.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=non_blocking)


class _Lane:
    """One direction of traffic: a lock, a stream (CUDA only) and optional staging halves.

    The lock makes the lane one copy at a time: the halves are shared, and one
    copy engine per direction is the bottleneck anyway.
    """

    def __init__(self, device: torch.device, staging_bytes: int = 0, *, pin: bool = False) -> None:
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        half = staging_bytes // 2
        self.halves = [torch.empty(half, dtype=torch.uint8, pin_memory=pin) for _ in range(2)] if half else []
        self.done = [torch.cuda.Event() if self.stream is not None else None for _ in self.halves]
        self.closed = False

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst`` (same length) and wait for it."""
        with self.lock, self._on_stream():
            self._check_open()
            if self._direct(src):
                _copy(dst, src, True)
            else:
                for i, start, stop in _chunks(len(src), len(self.halves[0])):
                    half = self.halves[i % 2][: stop - start]
                    self._wait(i % 2)  # the DMA that last read this half is over
                    _copy(half, src[start:stop])
                    _copy(dst[start:stop], half, True)
                    self._record(i % 2)
            self._sync()

    def download(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy device ``src`` into host ``dst`` (same length) and wait for it."""
        with self.lock, self._on_stream():
            self._check_open()
            if self._direct(dst):
                _copy(dst, src, True)
            else:
                pending = None
                for i, start, stop in _chunks(len(src), len(self.halves[0])):
                    # The half was drained one step ago, so the DMA may refill it now.
                    _copy(self.halves[i % 2][: stop - start], src[start:stop], True)
                    self._record(i % 2)
                    if pending is not None:
                        self._drain(dst, *pending)  # overlaps the DMA just queued
                    pending = (i % 2, start, stop)
                if pending is not None:
                    self._drain(dst, *pending)
            self._sync()

    def local(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy between device tensors after the caller's queued work on ``dst``; wait for it."""
        caller = torch.cuda.current_stream(dst.device) if dst.is_cuda and self.stream is not None else None
        with self.lock, self._on_stream():
            self._check_open()
            if caller is not None:
                self.stream.wait_stream(caller)  # the engine may still be reading ``dst``
            # Without a stream of ours (a cpu pool) a blocking copy is what makes this complete.
            _copy(dst, src, self.stream is not None)
            self._sync()

    def move(self, pool: torch.Tensor, scratch: torch.Tensor, moves: list[Move]) -> None:
        """Carry out compaction moves in order, overlap-safe."""
        with self.lock, self._on_stream():
            self._check_open()
            for m in moves:
                _move_one(pool, scratch, m)
            self._sync()

    def close(self) -> None:
        """Wait for the copy in flight, then drop the staging and stream."""
        with self.lock:
            self.closed = True
            self.halves, self.done, self.stream = [], [], None

    # -- helpers, lock held ------------------------------------------------------------

    def _on_stream(self) -> AbstractContextManager:
        # torch.cuda.stream(None) is a no-op too, but costs ~3 us per call on cpu.
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _direct(self, host: torch.Tensor) -> bool:
        # Staging a pinned buffer would only add a memcpy; DMA it where it is.
        return not self.halves or (self.stream is not None and host.is_pinned())

    def _drain(self, dst: torch.Tensor, which: int, start: int, stop: int) -> None:
        self._wait(which)
        _copy(dst[start:stop], self.halves[which][: stop - start])

    def _record(self, which: int) -> None:
        if self.done[which] is not None:
            self.done[which].record(self.stream)

    def _wait(self, which: int) -> None:
        if self.done[which] is not None:
            self.done[which].synchronize()  # returns at once for a never-recorded event

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosed("the device tier is closed")


def _move_one(pool: torch.Tensor, scratch: torch.Tensor, m: Move) -> None:
    """Copy ``m.size`` bytes from ``m.src`` down to ``m.dst`` in the same tensor.

    ``copy_`` between overlapping slices is undefined on CUDA (torch refuses it),
    so go forward in pieces that never overlap: a piece no longer than the
    distance goes directly, a longer one bounces through ``scratch``. Going
    forward is safe because what a piece writes ends below where the next
    piece reads (``dst < src``).
    """
    gap = m.src - m.dst
    step = gap if gap >= len(scratch) else len(scratch)
    for _, start, stop in _chunks(m.size, step):
        src = pool[m.src + start : m.src + stop]
        dst = pool[m.dst + start : m.dst + stop]
        if stop - start <= gap:
            dst.copy_(src, non_blocking=True)
        else:
            bounce = scratch[: stop - start]
            bounce.copy_(src, non_blocking=True)
            dst.copy_(bounce, non_blocking=True)


class DeviceTier(ArenaTier):
    """Frames in one preallocated tensor on a torch device.

    Args:
        capacity_bytes: frame bytes the tier admits.
        name: unique within a store.
        device: see ``resolve_device``; ``None`` picks ``cuda:0`` when present, else ``cpu``.
        max_entries: slot count (default: one per 4 KiB of capacity, see ``default_max_entries``).
        staging_bytes: pinned host memory per direction, used as two halves
            (default ``DEFAULT_STAGING_BYTES`` on CUDA and none on cpu, where
            staging would only add a memcpy); 0 turns staging off. An explicit
            value on cpu stages through unpinned halves, which tests use to
            exercise the chunked path without a GPU.

    Raises:
        InvalidInput: a bad capacity, slot count, staging size or device.
        TierUnavailable: CUDA asked for without CUDA, or the pool does not fit.
    """

    kind = "device"
    durable = False
    shared = False

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = "device",
        device: str | torch.device | None = None,
        max_entries: int | None = None,
        staging_bytes: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes, name=name, max_entries=max_entries)
        self.device = resolve_device(device)
        cuda = self.device.type == "cuda"
        if staging_bytes is None:
            staging_bytes = DEFAULT_STAGING_BYTES if cuda else 0
        staging = min(_check_staging(staging_bytes), 2 * self.arena_bytes)  # a half above any frame is waste
        self._pool: torch.Tensor | None = self._allocate(self.arena_bytes)
        self._scratch: torch.Tensor | None = self._allocate(min(_MOVE_SCRATCH_BYTES, self.arena_bytes))
        self._staging_note = ""
        try:
            self._in = _Lane(self.device, staging, pin=cuda)
            self._out = _Lane(self.device, staging, pin=cuda)
        except RuntimeError as exc:  # pinning can fail (RLIMIT_MEMLOCK, containers): copy unstaged
            self._staging_note = f"pinning failed: {exc}".splitlines()[0]
            self._in, self._out = _Lane(self.device), _Lane(self.device)
        self._local = _Lane(self.device)
        self._label = _device_label(self.device)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            # zero_() touches every page now, so early puts do not pay the faults.
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device).zero_()
            if self.device.type == "cuda":
                # zero_ ran on the current stream; the lanes' streams must not overtake it.
                torch.cuda.current_stream(self.device).synchronize()
            return tensor
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise TierUnavailable(
                f"tier {self.name!r}: {self.device} cannot hold a {nbytes}-byte pool", tier=self.name
            ) from exc

    # -- extra entry points --------------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer | torch.Tensor) -> None:
        """``Tier.put``; also takes a contiguous CPU tensor (a pinned one is DMA'd directly)."""
        super().put(key, _host_buffer(frame))

    def get_into(self, key: BlockHash, out: Buffer | torch.Tensor) -> int | None:
        """``Tier.get_into``; ``out`` may also be a contiguous tensor (a CUDA one: see ``get_tensor``).

        A pinned ``out`` is DMA'd into directly; a pageable one goes through staging.
        """
        if isinstance(out, torch.Tensor) and out.device.type != "cpu":
            return self.get_tensor(key, out)
        return super().get_into(key, _host_buffer(out))

    def get_tensor(self, key: BlockHash, out: torch.Tensor) -> int | None:
        """Copy the frame under ``key`` into the bytes of a contiguous tensor on any device.

        A serving engine keeps KV on the GPU: device to device, the frame never
        touches the host. The copy waits for work already queued on ``out``'s
        current stream and is complete when this returns.

        Returns:
            The frame's length, or ``None`` when absent.

        Raises:
            InvalidInput: ``out`` is not a contiguous tensor or is too short.
        """
        if not isinstance(out, torch.Tensor):
            raise InvalidInput(f"out must be a torch.Tensor, got {type(out).__name__}")
        flat = _byte_view(out)
        if flat.device.type == "cpu":
            return super().get_into(key, flat.numpy())
        if flat.device.type != "cuda":
            raise InvalidInput(f"out must live on cpu or cuda, not {flat.device}")
        slot = self._pin(key)
        if slot is None:
            return None
        try:
            if len(flat) < slot.length:
                raise InvalidInput(f"out holds {len(flat)} bytes, the frame needs {slot.length}")
            if slot.length:
                with self._device_errors():
                    self._local.local(flat[: slot.length], self._live_pool()[slot.offset : slot.offset + slot.length])
            return slot.length
        finally:
            with self._lock:
                self._unbusy(slot.offset)

    # -- ArenaTier's hooks -----------------------------------------------------------------

    def _copy_in(self, offset: int, frame: memoryview) -> None:
        if len(frame):
            src = torch.frombuffer(frame, dtype=torch.uint8)
            with self._device_errors():
                self._in.upload(self._live_pool()[offset : offset + len(frame)], src)

    def _copy_out(self, offset: int, length: int) -> Buffer:
        out = np.empty(length, np.uint8)  # the caller's own copy; np.empty skips bytearray's memset
        self._copy_out_into(offset, length, memoryview(out))
        return out

    def _copy_out_into(self, offset: int, length: int, out: memoryview) -> None:
        if out.readonly:
            raise InvalidInput("out is read-only")
        if length:
            dst = torch.frombuffer(out, dtype=torch.uint8, count=length)
            with self._device_errors():
                self._out.download(dst, self._live_pool()[offset : offset + length])

    def _move(self, moves: list[Move]) -> None:
        if moves:
            with self._device_errors():
                self._local.move(self._live_pool(), self._scratch, moves)

    def _details(self) -> dict[str, str]:
        halves = self._in.halves  # one read: close() may empty it from another thread
        details = {
            "device": self._label,
            "pinned_staging": "true" if halves and halves[0].is_pinned() else "false",
            "staging_bytes": str(sum(len(h) for h in halves)),
        }
        if self._staging_note:
            details["staging_note"] = self._staging_note
        return details

    def _close_arena(self) -> None:
        for lane in (self._in, self._out, self._local):
            lane.close()  # waits for a copy in flight on that lane
        self._pool = self._scratch = None

    @contextmanager
    def _device_errors(self) -> Iterator[None]:
        """Translate torch's failures (a CUDA error, a lost device) into ``TierUnavailable``."""
        try:
            yield
        except KVStoreError:
            raise  # StoreClosed is a RuntimeError too; it is already ours
        except RuntimeError as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TierUnavailable(f"tier {self.name!r} on {self.device}: {why}", tier=self.name) from exc

    def _live_pool(self) -> torch.Tensor:
        pool = self._pool  # one read: close() may drop it from another thread
        if pool is None:
            raise StoreClosed(f"tier {self.name!r} is closed")
        return pool


def _check_staging(nbytes: object) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 or 0 < nbytes < 2 * ALIGN:
        raise InvalidInput(f"staging_bytes must be 0 or an int >= {2 * ALIGN}, got {nbytes!r}")
    return nbytes


def _host_buffer(obj: Buffer | torch.Tensor) -> Buffer:
    """A buffer over a CPU tensor's bytes (no copy); other objects pass through."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise InvalidInput(f"expected host memory, got a tensor on {obj.device}")
        return _byte_view(obj).numpy()
    return obj


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu" if torch.cuda.is_available() else "cpu (no CUDA)"
