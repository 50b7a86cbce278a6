"""A wrapper that makes any tier as slow as a CXL link (or any slower medium).

``LatencyTier(inner)`` adds a fixed latency to every operation and caps the
bytes that data operations move at a bandwidth, then delegates to ``inner``.
It is how tests and benchmarks model CXL memory on a machine without it, and
a slow disk or network hop with other numbers. A wrapper, not a flag on each
tier, so one implementation serves every tier (zarr's ``LatencyStore`` idea).

The model, per operation that touches stored data:

- The bytes moved (a put's frame, a get's result, 0 for a miss) occupy one
  shared link for ``nbytes / bandwidth``. The link is shared by all threads, so
  the cap holds for aggregate throughput, not just per caller: a transfer
  starts when the previous one has left the link.
- The latency is added after the transfer, and after the inner operation has
  really finished (whichever is later); outstanding requests overlap, as loads
  to CXL memory do, so latency is not serialised.
- A batch (``put_many`` ...) pays the latency once, like pipelined loads, and
  all its bytes at the bandwidth.
- ``stats`` and ``close`` are control-plane calls and are not delayed.

Waiting. ``time.sleep`` overshoots by ~70 µs here (timer slack plus wake-up;
measured: median 69-77 µs for 10 µs-1 ms sleeps), which would swamp a 90 ns
latency and inflate short transfers several-fold. So a wait sleeps until
``SPIN_NS`` before its deadline and busy-waits the rest on
``perf_counter_ns``: delays under ``SPIN_NS`` are pure spins (accurate to a
microsecond or so, at the price of a core), longer ones cost one sleep.
Python's own call overhead (~1 µs) is already larger than the default
latency, so per-op latency here is a floor, not a precise figure.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from kvstore.errors import InvalidInput
from kvstore.keys import BlockHash
from kvstore.tier import Buffer, FrameWriter, Tier, TierStats

__all__ = ["LatencyTier", "CXL_ADDED_LATENCY_NS", "CXL_BANDWIDTH_GBPS"]

# Published CXL figures (defaults of LatencyTier):
# - Added latency: Pond (Li et al., "Pond: CXL-Based Memory Pooling Systems for
#   Cloud Platforms", ASPLOS'23, Microsoft) puts CXL memory at 70-90 ns over
#   local DRAM for a directly attached (switchless) device, about a NUMA hop.
#   We take the upper end. Real expander cards measure worse: 2-5x local DRAM
#   latency (arXiv 2405.14209, "Exploring and Evaluating Real-world CXL"), i.e.
#   +100-400 ns; pass latency_ns to model those. Sun et al., "Demystifying CXL
#   Memory with Genuine CXL-Ready Systems and Devices" (MICRO'23) measure three
#   such devices on Sapphire Rapids; we did not take a number from it.
# - Bandwidth: Micron CZ120 (CXL 2.0 Type 3, PCIe 5.0 x8): "up to 36 GB/s",
#   Micron's MLC figure at a 2:1 read:write mix on one module (Micron launch,
#   Aug 2023, as reported by Tom's Hardware). That is above one core's memcpy
#   here (~12-14 GB/s for 32 MiB), so the default cap rarely binds on this
#   machine; the latency and the shared link still apply.
CXL_ADDED_LATENCY_NS = 90
CXL_BANDWIDTH_GBPS = 36.0
"""Gigabytes (1e9 bytes) per second, not gigabits: the name is the issue's."""

SPIN_NS = 200_000
"""Busy-wait the last 200 µs of a delay: sleep overshoot is ~70 µs median, 100-180 µs p100."""

T = TypeVar("T")


def _nbytes(frame: Buffer | None) -> int:
    return 0 if frame is None else memoryview(frame).nbytes


def _wait_until(deadline_ns: int) -> None:
    remaining = deadline_ns - time.perf_counter_ns()
    if remaining > SPIN_NS:
        time.sleep((remaining - SPIN_NS) / 1e9)
    while time.perf_counter_ns() < deadline_ns:
        pass


def _check_model(latency_ns: float, bandwidth_gbps: float) -> None:
    for label, value in (("latency_ns", latency_ns), ("bandwidth_gbps", bandwidth_gbps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{label} must be a number, got {value!r}")
    if not 0 <= latency_ns < math.inf:
        raise InvalidInput(f"latency_ns must be finite and >= 0, got {latency_ns!r}")
    if not bandwidth_gbps > 0:  # also refuses NaN
        raise InvalidInput(f"bandwidth_gbps must be > 0, got {bandwidth_gbps!r}")


class _Link:
    """One shared link: a fixed latency and a bandwidth cap, across threads."""

    def __init__(self, latency_ns: float, bandwidth_gbps: float) -> None:
        self.latency_ns = latency_ns
        self.bandwidth_gbps = bandwidth_gbps
        self._ns_per_byte = 1.0 / bandwidth_gbps  # 1 GB/s moves one byte per ns
        self._lock = threading.Lock()
        self._free_at_ns = 0  # when the last reserved transfer leaves the link
        self.delayed_ns = 0
        """Total time callers spent waiting on the model (not in the inner tier)."""

    def settle(self, started_ns: int, nbytes: int) -> None:
        """Hold the caller until an op that began at ``started_ns`` and moved ``nbytes`` may end."""
        with self._lock:
            begin = max(started_ns, self._free_at_ns)
            self._free_at_ns = begin + int(nbytes * self._ns_per_byte)
            transfer_end = self._free_at_ns
        now = time.perf_counter_ns()
        deadline = max(transfer_end, now) + int(self.latency_ns)
        _wait_until(deadline)
        with self._lock:
            self.delayed_ns += time.perf_counter_ns() - now

    def describe(self) -> str:
        return f"+{self.latency_ns:g} ns per op, {self.bandwidth_gbps:g} GB/s shared link"


class LatencyTier(Tier):
    """Wraps ``inner`` and slows it to a latency and a bandwidth.

    Args:
        inner: any tier; its name, capacity, durability and sharing show through.
        latency_ns: added to every data-plane call (default: CXL, Pond's 90 ns).
        bandwidth_gbps: cap on bytes moved, in GB/s (1e9 bytes/s) (default:
            CXL, Micron CZ120's 36 GB/s); ``float("inf")`` for no cap.

    Raises:
        InvalidInput: ``latency_ns`` is negative or ``bandwidth_gbps`` is not positive.
    """

    def __init__(self, inner: Tier, *, latency_ns: float = CXL_ADDED_LATENCY_NS,
                 bandwidth_gbps: float = CXL_BANDWIDTH_GBPS) -> None:
        if not isinstance(inner, Tier):
            raise InvalidInput(f"inner must be a Tier, got {type(inner).__name__}")
        _check_model(latency_ns, bandwidth_gbps)
        self.inner = inner
        self._link = _Link(latency_ns, float(bandwidth_gbps))

    # The inner tier's identity shows through; capacity and flags never change after start.
    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def capacity_bytes(self) -> int:  # type: ignore[override]
        return self.inner.capacity_bytes

    @property
    def durable(self) -> bool:  # type: ignore[override]
        return self.inner.durable

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return self.inner.shared

    def _paced(self, op: Callable[[], T], moved: Callable[[T], int] = lambda _: 0) -> T:
        """Run ``op``, then wait out the model; a failed op still pays its latency."""
        started = time.perf_counter_ns()
        nbytes = 0
        try:
            result = op()
            nbytes = moved(result)
            return result
        finally:
            self._link.settle(started, nbytes)

    # -- the Tier contract, paced --------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer) -> None:
        self._paced(lambda: self.inner.put(key, frame), lambda _: _nbytes(frame))

    def get(self, key: BlockHash) -> Buffer | None:
        return self._paced(lambda: self.inner.get(key), _nbytes)

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        return self._paced(lambda: self.inner.get_into(key, out), lambda n: n or 0)

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        return self._paced(lambda: self.inner.put_with(key, size, writer), lambda n: n)

    def delete(self, key: BlockHash) -> bool:
        return self._paced(lambda: self.inner.delete(key))

    def contains(self, key: BlockHash) -> bool:
        return self._paced(lambda: self.inner.contains(key))

    def keys(self) -> Iterator[BlockHash]:
        return self._paced(lambda: self.inner.keys())

    # -- batches: one latency, all the bytes -----------------------------------------

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> None:
        batch = list(items)
        self._paced(lambda: self.inner.put_many(batch), lambda _: sum(_nbytes(f) for _, f in batch))

    def get_many(self, keys: Sequence[BlockHash]) -> list[Buffer | None]:
        return self._paced(lambda: self.inner.get_many(keys), lambda got: sum(map(_nbytes, got)))

    def delete_many(self, keys: Iterable[BlockHash]) -> int:
        return self._paced(lambda: self.inner.delete_many(keys))

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        return self._paced(lambda: self.inner.contains_many(keys))

    # -- control plane: not delayed --------------------------------------------------

    def stats(self) -> TierStats:
        stats = self.inner.stats()
        details = dict(stats.details)
        details.update({
            "latency_model": self._link.describe(),
            "latency_ns": f"{self._link.latency_ns:g}",
            "bandwidth_gbps": f"{self._link.bandwidth_gbps:g}",
            "injected_delay_s": f"{self._link.delayed_ns / 1e9:.6f}",
        })
        return replace(stats, details=details)

    def release_free(self) -> int:
        return self.inner.release_free()  # memory, not a transfer: not paced

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"<LatencyTier {self._link.describe()} over {self.inner!r}>"
