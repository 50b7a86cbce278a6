"""``kvstore bench tiers``: each tier's put and get GB/s next to its raw baseline.

Every tier is measured against what a user would otherwise do with the same
backing, in the same run, interleaved sample by sample so drift hits both:

==========  =====================================================  =======
tier        raw baseline                                           target
==========  =====================================================  =======
memory      memcpy into a reused buffer (numpy ``copyto``)         (none)
device      the same (on CPU); ``bench/gpu_check.py`` times CUDA   (none)
shm         memcpy into a reused buffer                            >= 0.7x
cxl         memcpy into a reused buffer                            (none)
redis       redis-py ``SET``/``GET`` of one value, one connection  >= 1.0x
nvme        write+fsync of one file / cold read of one file        >= 0.8x
==========  =====================================================  =======

Frames are opaque random bytes (tiers never look inside). Puts overwrite
one of two keys; gets copy into a reused buffer (``get_into``), as the store
does. Redis runs as a private ``redis-server`` on a free port unless
``--redis-url`` names one; nvme writes under ``--dir``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from bench.report import header, publish
from kvstore.tier import Tier

__all__ = ["run", "SIZES", "format_table"]

MiB = 1 << 20
SIZES = {"32MiB": 32 * MiB, "1MiB": 1 * MiB}
QUICK_SIZES = {"1MiB": 1 * MiB, "64KiB": 64 * 1024}
TARGETS = {"shm": 0.7, "redis": 1.0, "nvme": 0.8}
ALL_TIERS = ("memory", "device", "shm", "cxl", "redis", "nvme")


@dataclass
class _Baseline:
    name: str
    put: Callable[[memoryview], object]
    get: Callable[[memoryview], object]
    close: Callable[[], None] = lambda: None


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway ``redis-server`` without persistence; yields its URL."""
    port = _free_port()
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-redis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _memcpy_baseline(nbytes: int) -> _Baseline:
    dst = np.empty(nbytes, np.uint8)
    # Real bytes to copy out: an untouched np.empty maps the shared zero page, and
    # copying from it runs from cache at an unreal speed.
    out = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)

    def put(frame: memoryview) -> None:
        np.copyto(dst, np.frombuffer(frame, np.uint8))

    def get(buf: memoryview) -> None:
        np.copyto(np.frombuffer(buf, np.uint8), out)

    return _Baseline("memcpy", put, get)


def _redis_baseline(url: str) -> _Baseline:
    import redis

    client = redis.Redis.from_url(url)
    name = f"kvstore-bench-raw-{os.getpid()}"
    return _Baseline("redis-py SET/GET", lambda f: client.set(name, f), lambda _: client.get(name),
                     lambda: (client.delete(name), client.close()))


def _file_baseline(directory: str) -> _Baseline:
    path = os.path.join(directory, "raw-baseline.bin")

    def put(frame: memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, frame)
            os.fsync(fd)
            # The tier writes with O_DIRECT, so its files are not in the page cache when read;
            # dropping ours keeps the read baseline a cold read too.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def get(buf: memoryview) -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)

    return _Baseline("file write+fsync / read", put, get)


def _make_tier(kind: str, capacity: int, ctx: dict) -> tuple[Tier, _Baseline]:
    nbytes = ctx["nbytes"]
    if kind == "memory":
        from tiers.memory import MemoryTier

        return MemoryTier(capacity), _memcpy_baseline(nbytes)
    if kind == "device":
        from tiers.device import DeviceTier

        return DeviceTier(capacity), _memcpy_baseline(nbytes)
    if kind == "shm":
        from tiers.shm import ShmTier

        return ShmTier(capacity, name="bench"), _memcpy_baseline(nbytes)
    if kind == "cxl":
        from tiers.cxl import CXLTier

        return CXLTier(capacity, name="bench"), _memcpy_baseline(nbytes)
    if kind == "redis":
        from tiers.redis import RedisTier

        url = ctx["redis_url"]()
        return RedisTier(url, capacity, keyspace=f"bench-{os.getpid()}"), _redis_baseline(url)
    if kind == "nvme":
        from tiers.nvme import NVMeTier

        # A fresh directory per row: a tier re-indexes what an earlier row left behind.
        return NVMeTier(tempfile.mkdtemp(prefix="tier-", dir=ctx["dir"]), capacity), _file_baseline(ctx["dir"])
    raise ValueError(f"unknown tier {kind!r}")


def _rates(nbytes: int, inner: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes * inner / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def _measure(kind: str, size_name: str, nbytes: int, repeats: int, ctx: dict) -> dict:
    frame = memoryview(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    out = memoryview(bytearray(nbytes))
    tier, base = _make_tier(kind, 4 * nbytes + MiB, {**ctx, "nbytes": nbytes})
    inner = max(1, (8 * MiB) // nbytes)  # several small ops per sample: the clock's noise stays small
    ops = {
        "tier put": lambda i: tier.put(_key(i % 2), frame),
        "tier get": lambda i: tier.get_into(_key(i % 2), out),
        "raw put": lambda i: base.put(frame),
        "raw get": lambda i: base.get(out),
    }
    try:
        for i in range(2):  # warm-up: both keys exist, pages are in, connections are open
            for name, fn in ops.items():
                fn(i)
        times: dict[str, list[float]] = {name: [] for name in ops}
        for r in range(repeats):
            for name, fn in ops.items():
                start = time.perf_counter()
                for i in range(inner):
                    fn(r + i)
                times[name].append(time.perf_counter() - start)
        if bytes(tier.get(_key(0))) != bytes(frame):
            raise AssertionError(f"{kind}: the frame read back differs from the one written")
        details = tier.stats().details
    finally:
        tier.close()
        base.close()
    rates = {name: _rates(nbytes, inner, ts) for name, ts in times.items()}
    put_ratio = rates["tier put"]["median"] / rates["raw put"]["median"]
    get_ratio = rates["tier get"]["median"] / rates["raw get"]["median"]
    target = TARGETS.get(kind)
    return {
        "tier": kind, "size": size_name, "bytes": nbytes, "baseline": base.name,
        "put_gbps": rates["tier put"], "get_gbps": rates["tier get"],
        "raw_put_gbps": rates["raw put"], "raw_get_gbps": rates["raw get"],
        "put_ratio": put_ratio, "get_ratio": get_ratio, "target": target,
        "meets_target": None if target is None else bool(put_ratio >= target and get_ratio >= target),
        "details": details,
    }


def run(*, tiers: tuple[str, ...] = ALL_TIERS, quick: bool = False, repeats: int | None = None,
        redis_url: str | None = None, directory: str | None = None, out_dir: str | Path | None = None) -> dict:
    """Measure every named tier at each size; print a table; write JSON; return the result.

    Args:
        tiers: which tiers to run.
        quick: small frames and three repeats (a smoke run).
        repeats: timed samples per row (default 3 quick, 11 full).
        redis_url: an existing Redis to use; default a private redis-server.
        directory: where the nvme tier and its baseline write (default a temp dir under the cwd).
        out_dir: where the JSON goes (default ``bench/results``).
    """
    repeats = repeats or (3 if quick else 11)
    sizes = QUICK_SIZES if quick else SIZES
    rows, notes = [], []
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix=".kvstore-bench-", dir=directory or ".")
        stack.callback(shutil.rmtree, workdir, True)
        urls: list[str] = [redis_url] if redis_url else []

        def redis_url_once() -> str:
            if not urls:
                urls.append(stack.enter_context(private_redis()))
            return urls[0]

        ctx = {"dir": workdir, "redis_url": redis_url_once}
        for kind in tiers:
            for size_name, nbytes in sizes.items():
                try:
                    rows.append(_measure(kind, size_name, nbytes, repeats, ctx))
                except (ImportError, RuntimeError, OSError) as exc:
                    notes.append(f"{kind} {size_name} skipped: {type(exc).__name__}: {exc}")
                    break
    result = header("tiers", repeats=repeats, rows=rows, notes=notes,
                    unit="GB/s (1e9 B/s), median over samples; ratio = tier / same-run raw baseline")
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    head = (f"{'tier':7} {'size':>6} {'put':>7} {'raw put':>8} {'ratio':>6} {'get':>7} {'raw get':>8} "
            f"{'ratio':>6} {'target':>7}  baseline")
    lines = [f"kvstore bench tiers  ({result['repeats']} samples, median GB/s)", head, "-" * len(head)]
    for r in result["rows"]:
        target = "-" if r["target"] is None else f">={r['target']:.1f}" + (" ok" if r["meets_target"] else " NO")
        lines.append(
            f"{r['tier']:7} {r['size']:>6} {r['put_gbps']['median']:7.2f} {r['raw_put_gbps']['median']:8.2f} "
            f"{r['put_ratio']:6.2f} {r['get_gbps']['median']:7.2f} {r['raw_get_gbps']['median']:8.2f} "
            f"{r['get_ratio']:6.2f} {target:>7}  {r['baseline']}"
        )
    lines.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(lines)
