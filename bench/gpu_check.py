"""``python bench/gpu_check.py``: the device tier on a real GPU, in one short run.

1. Prints torch, CUDA and device facts.
2. Times host<->device copies through ``DeviceTier`` for 32 MiB and 1 MiB frames
   against raw ``copy_`` in the same run (interleaved, medians after warm-up),
   with pageable and pinned host buffers, and prints one table.
3. Runs ``tests/tiers/test_device.py`` and ``tests/server/test_vllm_transfer.py``
   in a child pytest with ``KVSTORE_TEST_DEVICE`` set to the device, so the
   conformance suite, the pool checks and the vLLM connector's paged layouts
   (FlashAttention's and the CPU one, loads and saves against a live server)
   run on CUDA. vLLM itself is not installed there (the lent machine reaches no
   registry): the connector's engine-facing half is tested on CPU vLLM in CI.
4. Writes JSON to ``--out`` after every phase, so a run cut short keeps what it got.

Exit codes: 0 all passed; 1 the tests failed or a timed copy was not
bit-exact; 2 no CUDA here (pass ``--allow-cpu`` to run everything on cpu).
GB/s are 10^9 bytes per second of frame bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script, bench/ is on the path but the repo root is not

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvstore.errors import KVStoreError  # noqa: E402
from tiers.device import DeviceTier, resolve_device  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 2
SIZES = {"32MiB": 32 << 20, "1MiB": 1 << 20}
TEST_FILES = ("tests/tiers/test_device.py", "tests/server/test_vllm_transfer.py")


def environment(device: torch.device | None) -> dict:
    """Torch, CUDA and device facts worth keeping next to the figures (``None``: no device)."""
    env = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device) if device is not None else "none (no CUDA)",
        "torch_threads": torch.get_num_threads(),
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            device_count=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host(n: int, *, pinned: bool) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, pin_memory=pinned)


def _cases(device: torch.device, tiers: dict[str, DeviceTier], nbytes: int) -> list[dict]:
    """Rows for one frame size: what each variant does once (it must be complete on return)."""
    cuda = device.type == "cuda"
    data = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8))
    dev = data.to(device, copy=True)
    dev_out = torch.empty_like(dev)
    page_in, page_out = data.clone(), _host(nbytes, pinned=False)
    pin_in, pin_out = (_host(nbytes, pinned=True) if cuda else None), (_host(nbytes, pinned=True) if cuda else None)
    if pin_in is not None:
        pin_in.copy_(data)
    k = nbytes.to_bytes(8, "little") * 4
    for tier in tiers.values():
        tier.put(k, data)

    def raw(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
        return lambda: (dst.copy_(src, non_blocking=True), _sync(device))

    def put(name: str, src: torch.Tensor) -> Callable[[], object]:
        return lambda: tiers[name].put(k, src)

    def get_into(name: str, out: torch.Tensor) -> Callable[[], object]:
        return lambda: tiers[name].get_into(k, out)

    def got_bytes(name: str) -> bool:
        return np.array_equal(np.asarray(tiers[name].get(k)), data.numpy())

    def stores(name: str, src: torch.Tensor) -> Callable[[], bool]:
        def check() -> bool:  # over zeros just stored, so stale bytes from earlier puts cannot pass
            tiers[name].put(k, torch.zeros_like(src))
            _sync(device)
            tiers[name].put(k, src)
            return got_bytes(name)

        return check

    def fills(out: torch.Tensor, *fns: Callable[[], object]) -> Callable[[], bool]:
        # Run each tier op alone into a cleared buffer: after the timed loop the
        # buffer holds whatever variant ran last, which may be the raw copy.
        def check() -> bool:
            ok = True
            for fn in fns:
                out.zero_()
                fn()
                ok = ok and torch.equal(out.cpu(), data)
            return ok

        return check

    pageable_put = dict(direction="put h2d", host="pageable", tier=put("tier", page_in), raw=raw(dev_out, page_in),
                        unstaged=put("unstaged", page_in), check=lambda: stores("tier", page_in)() and stores("unstaged", page_in)())
    pageable_get = dict(direction="get_into d2h", host="pageable", tier=get_into("tier", page_out),
                        raw=raw(page_out, dev), unstaged=get_into("unstaged", page_out),
                        check=fills(page_out, get_into("tier", page_out), get_into("unstaged", page_out)))
    pinned_put = dict(direction="put h2d", host="pinned", tier=put("tier", pin_in), raw=raw(dev_out, pin_in),
                      check=stores("tier", pin_in))
    pinned_get = dict(direction="get_into d2h", host="pinned", tier=get_into("tier", pin_out), raw=raw(pin_out, dev),
                      check=fills(pin_out, get_into("tier", pin_out)))
    new_buffer = dict(direction="get d2h (new buffer)", host="pageable", tier=lambda: tiers["tier"].get(k),
                      raw=lambda: (dev.to("cpu", copy=True), _sync(device)), check=lambda: got_bytes("tier"))
    to_device = lambda: tiers["tier"].get_tensor(k, dev_out)  # noqa: E731
    on_device = dict(direction="get_tensor d2d", host="-", tier=to_device, raw=raw(dev_out, dev),
                     check=fills(dev_out, to_device))
    pinned = [pinned_put, pinned_get] if cuda else []  # pinned memory needs CUDA
    return [pageable_put, *pinned[:1], pageable_get, *pinned[1:], new_buffer, on_device]


def _rates(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


def measure(device: torch.device, repeats: int, warmup: int = 3) -> tuple[list[dict], dict[str, str]]:
    """Time every row, variants interleaved so drift hits them alike.

    Returns:
        The table rows, and the measured tier's ``stats().details``.
    """
    capacity = 4 * max(SIZES.values())  # room for a replacing put next to the old frame
    tiers = {
        "tier": DeviceTier(capacity, name="tier", device=device),
        "unstaged": DeviceTier(capacity, name="unstaged", device=device, staging_bytes=0),
    }
    details = tiers["tier"].stats().details
    out = []
    try:
        for size, nbytes in SIZES.items():
            for case in _cases(device, tiers, nbytes):
                variants = {v: case[v] for v in ("tier", "raw", "unstaged") if v in case}
                times: dict[str, list[float]] = {v: [] for v in variants}
                for i in range(warmup + repeats):
                    for v, fn in variants.items():
                        start = time.perf_counter()
                        fn()
                        if i >= warmup:
                            times[v].append(time.perf_counter() - start)
                rates = {v: _rates(nbytes, ts) for v, ts in times.items()}
                out.append({
                    "size": size, "bytes": nbytes, "direction": case["direction"], "host": case["host"],
                    "tier_gbps": rates["tier"], "raw_gbps": rates["raw"],
                    "unstaged_gbps": rates.get("unstaged"),
                    "ratio": rates["tier"]["median"] / rates["raw"]["median"],
                    "bit_exact": bool(case["check"]()),
                })
    finally:
        for tier in tiers.values():
            tier.close()
    return out, details


def format_table(rows: list[dict], details: dict[str, str], env: dict, repeats: int) -> str:
    """One line per size x direction: tier and raw GB/s (medians) and their ratio."""
    head = (f"{'size':>6} {'direction':22} {'host':8} {'tier GB/s':>10} {'raw copy_':>10} "
            f"{'tier/raw':>8} {'unstaged':>9} {'exact':>5}")
    title = (f"DeviceTier vs raw copy_ on {details.get('device', env['device'])}, torch {env['torch']}, "
             f"median of {repeats}; staging {details.get('staging_bytes', '?')} B, "
             f"pinned staging {details.get('pinned_staging', '?')}")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        unstaged = f"{r['unstaged_gbps']['median']:9.2f}" if r["unstaged_gbps"] else f"{'-':>9}"
        lines.append(
            f"{r['size']:>6} {r['direction']:22} {r['host']:8} {r['tier_gbps']['median']:10.2f} "
            f"{r['raw_gbps']['median']:10.2f} {r['ratio']:8.2f} {unstaged} {'yes' if r['bit_exact'] else 'NO':>5}"
        )
    lines.append("unstaged = the same tier with staging_bytes=0 (pageable copies straight through torch)")
    return "\n".join(lines)


def run_tests(device: torch.device, timeout_s: int) -> dict:
    """Run the device tier's test file in a child pytest on ``device``; never raises."""
    env = dict(os.environ, KVSTORE_TEST_DEVICE=str(device))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *TEST_FILES]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, output = None, out + f"\n(pytest killed after {timeout_s} s)"
    lines = output.strip().splitlines()
    return {
        "command": " ".join(cmd), "device": str(device), "returncode": rc, "passed": rc == 0,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": lines[-1] if lines else "", "tail": lines[-40:],
    }


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))


def _pick_device(args: argparse.Namespace) -> torch.device | None:
    """The device to check, or ``None`` without CUDA (and without ``--allow-cpu``).

    Raises:
        KVStoreError: ``--device`` names no device here.
    """
    if torch.cuda.is_available():
        return resolve_device(args.device)
    return torch.device("cpu") if args.allow_cpu else None


def main(argv: list[str] | None = None) -> int:
    """Run the check; return the exit code (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/gpu_check.json")
    parser.add_argument("--device", default="cuda:0", help="CUDA device to check (default cuda:0)")
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run everything on cpu")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per row, after 3 warm-ups")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds for the child pytest")
    parser.add_argument("--skip-tests", action="store_true", help="time copies only")
    args = parser.parse_args(argv)

    try:
        device = _pick_device(args)
    except KVStoreError as exc:
        print(f"--device {args.device!r}: {exc}")
        return EXIT_FAILED
    env = environment(device)
    print("\n".join(f"{k:18} {v}" for k, v in env.items()), flush=True)
    result: dict = {"bench": "gpu_check", "environment": env, "status": "running"}
    if device is None:
        print(f"\nNo CUDA here (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}): "
              "nothing checked. Pass --allow-cpu to run the same checks on cpu.")
        _write(args.out, dict(result, status="no-cuda"))
        return EXIT_NO_CUDA

    try:
        rows, details = measure(device, args.repeats)
    except Exception as exc:  # one shot on a lent GPU: record the failure, still run the tests
        rows, details = [], {}
        result["bench_error"] = f"{type(exc).__name__}: {exc}"
        print(f"\ntiming failed: {result['bench_error']}", flush=True)
    result.update(repeats=args.repeats, unit="GB/s (1e9 B/s), median over repeats", tier_details=details, rows=rows)
    _write(args.out, result)
    if rows:
        print("\n" + format_table(rows, details, env, args.repeats), flush=True)

    tests = None if args.skip_tests else run_tests(device, args.test_timeout)
    if tests is not None:
        print(f"\n{tests['command']}  (KVSTORE_TEST_DEVICE={device}, {tests['seconds']} s)")
        print("\n".join(tests["tail"][-15:]))
    exact = bool(rows) and all(r["bit_exact"] for r in rows)
    ok = exact and (tests is None or tests["passed"])
    result.update(tests=tests, status="ok" if ok else "failed")
    _write(args.out, result)
    print(f"\n{'OK' if ok else 'FAILED'}: tests {'skipped' if tests is None else tests['summary']!r}; "
          f"copies bit-exact: {exact}; wrote {args.out}")
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
