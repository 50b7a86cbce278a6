"""``kvstore bench codec``: codec throughput, size and error against memcpy.

Every row is measured in one run, interleaved (memcpy, raw, int8, int8+lz4,
then again), and reported as the median over repeats with min and max, plus
the ratio to the same-run memcpy. GB/s are of raw KV bytes (10^9 bytes/s).
Frames are encoded into and decoded from reused buffers, as the store does.
Where the native int8 kernel is built (``kvstore.int8.NATIVE``), an ``int8 (torch)`` row times
the torch path on the same frames beside it, so one run shows what the kernel buys.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench.report import header, publish
from kvstore import codec as codec_mod
from kvstore import int8 as int8_mod
from kvstore.codec import Codec

__all__ = ["run", "SHAPES"]

# [layers, 2, kv heads, tokens, head_dim] of a 7B-class GQA model (32 layers, 8 KV heads, 128 dims).
SHAPES = {
    "32MiB": (32, 2, 8, 256, 128),
    "1MiB": (32, 2, 8, 8, 128),
}
QUICK_SHAPES = {
    "1MiB": (32, 2, 8, 8, 128),
    "64KiB": (8, 2, 2, 16, 64),
}


@dataclass
class _Case:
    data: str
    size: str
    kv: torch.Tensor


def _timer(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}


@contextlib.contextmanager
def _torch_int8():
    """The torch quantizer for the call, as where the kernel did not build."""
    was, int8_mod.NATIVE = int8_mod.NATIVE, False
    try:
        yield
    finally:
        int8_mod.NATIVE = was


def _measure(case: _Case, repeats: int) -> dict:
    kv = case.kv
    nbytes = kv.numel() * kv.element_size()
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    out = torch.empty_like(kv)
    bufs = {c: bytearray(codec_mod.frame_size(kv.shape, kv.dtype, c)) for c in Codec}
    frames = {c: memoryview(bufs[c])[: codec_mod.encode_into(kv, bufs[c], c)] for c in Codec}
    ops: dict[str, Callable[[], object]] = {"memcpy": lambda: np.copyto(dst, src)}
    for c in Codec:
        ops[f"{c.value} encode"] = lambda c=c: codec_mod.encode_into(kv, bufs[c], c)
        ops[f"{c.value} decode"] = lambda c=c: codec_mod.decode(frames[c], out=out)
    native = int8_mod.NATIVE
    if native:
        torch_buf = bytearray(len(bufs[Codec.INT8]))

        def torch_encode() -> None:
            with _torch_int8():
                codec_mod.encode_into(kv, torch_buf, Codec.INT8)

        def torch_decode() -> None:
            with _torch_int8():
                codec_mod.decode(frames[Codec.INT8], out=out)

        ops["int8 (torch) encode"], ops["int8 (torch) decode"] = torch_encode, torch_decode
    for fn in ops.values():  # warm-up: page in buffers, size the codec scratch
        fn()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():  # interleaved, so drift hits every row alike
            times[name].append(_timer(fn))
    rates = {name: _summary(nbytes, ts) for name, ts in times.items()}
    memcpy = rates["memcpy"]["median"]
    row: dict = {
        "data": case.data,
        "size": case.size,
        "shape": list(kv.shape),
        "dtype": str(kv.dtype).removeprefix("torch."),
        "raw_bytes": nbytes,
        "memcpy_gbps": rates["memcpy"],
        "int8_kernel": "native" if native else "torch",
        "codecs": {},
    }
    if native:
        row["int8_torch"] = {"encode_gbps": rates["int8 (torch) encode"], "decode_gbps": rates["int8 (torch) decode"],
                             "same_frame": bytes(torch_buf) == bytes(frames[Codec.INT8])}
    ref = kv.float()
    for c in Codec:
        frame = frames[c]
        header = codec_mod.read_header(frame)
        decoded = codec_mod.decode(frame).float()
        enc, dec = rates[f"{c.value} encode"], rates[f"{c.value} decode"]
        row["codecs"][c.value] = {
            "encode_gbps": enc,
            "decode_gbps": dec,
            "encode_vs_memcpy": enc["median"] / memcpy,
            "decode_vs_memcpy": dec["median"] / memcpy,
            "size_ratio": len(frame) / nbytes,
            "lz4_applied": header.lz4,
            "rel_error": float((decoded - ref).norm() / ref.norm()),
            "rel_error_k": float((decoded[:, 0] - ref[:, 0]).norm() / ref[:, 0].norm()),
            "rel_error_v": float((decoded[:, 1] - ref[:, 1]).norm() / ref[:, 1].norm()),
        }
    return row


def _cases(quick: bool, real: bool) -> tuple[list[_Case], list[str]]:
    notes: list[str] = []
    gen = torch.Generator().manual_seed(0)
    cases = [
        _Case("random-normal", name, torch.randn(shape, generator=gen).to(torch.float16))
        for name, shape in (QUICK_SHAPES if quick else SHAPES).items()
    ]
    if real:
        from bench.realkv import minilm_kv, unavailable

        reason = unavailable()
        if reason:
            notes.append(f"real-model rows skipped: {reason}")
        else:
            kv = minilm_kv(max_tokens=64 if quick else 512)
            mib = kv.numel() * kv.element_size() / 2**20
            cases.append(_Case("minilm-real", f"{mib:.1f}MiB", kv))
    return cases, notes


def run(*, quick: bool = False, real: bool = True, repeats: int | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the codec benchmark; print a table; write JSON; return the result.

    Args:
        quick: small shapes and few repeats (for smoke tests).
        real: include KV from the real MiniLM model when it is installed.
        repeats: timed repeats per row (default 3 quick, 15 full).
        out_dir: where the JSON goes (default ``bench/results``).
    """
    repeats = repeats or (3 if quick else 15)
    cases, notes = _cases(quick, real)
    rows = [_measure(case, repeats) for case in cases]
    result = header("codec", repeats=repeats, unit="GB/s of raw KV bytes (1e9 B/s), median over repeats",
                    rows=rows, notes=notes)
    result["machine"].update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    head = f"{'data':14} {'size':>7} {'codec':9} {'enc GB/s':>9} {'dec GB/s':>9} {'memcpy':>7} {'enc/mc':>7} {'dec/mc':>7} {'size':>6} {'lz4':>4} {'rel err':>8}"
    lines = [f"kvstore bench codec  (torch {result['machine']['torch']}, {result['machine']['torch_threads']} threads, "
             f"{result['repeats']} repeats, median)", head, "-" * len(head)]
    for row in result["rows"]:
        for name, c in row["codecs"].items():
            lines.append(
                f"{row['data']:14} {row['size']:>7} {name:9} {c['encode_gbps']['median']:9.2f} {c['decode_gbps']['median']:9.2f} "
                f"{row['memcpy_gbps']['median']:7.2f} {c['encode_vs_memcpy']:7.2f} {c['decode_vs_memcpy']:7.2f} "
                f"{c['size_ratio']:6.3f} {'yes' if c['lz4_applied'] else 'no':>4} {c['rel_error']:8.5f}"
            )
        if "int8_torch" in row:  # the same int8 frames by the torch path, for comparison
            t, mc = row["int8_torch"], row["memcpy_gbps"]["median"]
            enc, dec = t["encode_gbps"]["median"], t["decode_gbps"]["median"]
            lines.append(f"{row['data']:14} {row['size']:>7} {'(torch)':9} {enc:9.2f} {dec:9.2f} {mc:7.2f} "
                         f"{enc / mc:7.2f} {dec / mc:7.2f}   same frame: {'yes' if t['same_frame'] else 'NO'}")
    lines.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(lines)
