"""Arrow Flight against the SDK's HTTP path, 32 MiB batches of many blocks, in one run.

================  ============================================================
row               what one sample does
================  ============================================================
flight frames     ``FlightMedium.get_frames`` / ``put_frames`` of a batch
http frames       ``KVClient.get_blocks`` / ``put_blocks`` (``/v1/blocks/*``)
flight kv         ``FlightMedium.get_kv`` / ``put_kv``: frames, decoded or
                  encoded in this process
http kv           ``KVClient.get_kv`` / ``put_kv`` over HTTP: raw KV received
                  straight into the result; the server encodes on a put
================  ============================================================

Figures are GB/s of frame bytes (KV rows: of KV bytes), median and min-max
over samples, with the same-run ratios flight / http. Samples are interleaved
across rows in an order rotated every round, each right after an untimed call
of the same row, so drift and a busy neighbour hit every row alike (this
machine has two cores and is shared: a figure moves 2-3x between runs, the
ratios much less). Puts write fresh keys (the same frames under random keys,
or fresh token ids) and delete them outside the clock.

The server is ``kvstore serve`` in a child process with ``KVSTORE_FLIGHT_PORT``;
``measure`` also runs against any server that offers Flight (``kvstore bench
planner`` calls it). KV is fp16 ``[32, 2, 8, T, 128]``, 128 KiB a token: a
32 MiB batch is 256 tokens, 16 blocks of 16 tokens (2 MiB frames) by default.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bench.report import header, publish
from bench.sampling import timed
from bench.service import rate_of  # the service bench's GB/s summary
from bench.serving import free_port, kvstore_serve

__all__ = ["measure", "run", "format_table"]

MiB = 1 << 20


def measure(url: str, flight_port: int, *, repeats: int = 9, block_tokens: int = 16, batch_tokens: int = 256,
            token: str | None = None, namespace: str = "bench-flight") -> dict:
    """Time every row against a running server; returns rates, ratios and the batch shape.

    Args:
        url: the REST url; Flight is on the same host at ``flight_port``.
        repeats: timed samples a row.
        block_tokens: tokens a block (a frame is ``block_tokens`` x 128 KiB).
        batch_tokens: tokens a batch (256: 32 MiB).
    """
    from client_sdk import KVClient
    from client_sdk.flight import FlightMedium
    from client_sdk.media import encode_blocks
    from kvstore.spec import KVSpec

    spec = KVSpec("bench-flight", 32, 8, 128, "float16", block_tokens, fingerprint="bench-1")
    kv = torch.randn(spec.kv_shape(batch_tokens), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    fixed = list(range(1_000_000, 1_000_000 + batch_tokens))
    http = KVClient(url, token=token, namespace=namespace, colocated=False, retries=0, plan=False)
    fli = FlightMedium(url, flight_port, token=token, namespace=namespace)
    items = encode_blocks(spec, fixed, kv, namespace)
    keys = [k for k, _ in items]
    frame_bytes = sum(len(f) for _, f in items)
    kv_bytes = spec.bytes_per_token * batch_tokens
    http.put_blocks(items)
    counter = [0]

    def fresh_tokens() -> list[int]:
        counter[0] += 1
        return [counter[0] * 65_536 + i for i in range(batch_tokens)]

    def put_frames(put: Callable) -> Callable[[], float]:
        def once() -> float:
            fresh = [(os.urandom(32), f) for _, f in items]
            start = time.perf_counter()
            stored = put(fresh)
            took = time.perf_counter() - start
            assert stored == len(fresh), stored
            http.delete_blocks([k for k, _ in fresh])
            return took
        return once

    def put_kv(put: Callable) -> Callable[[], float]:
        def once() -> float:
            toks = fresh_tokens()
            start = time.perf_counter()
            stored = put(spec, toks, kv)
            took = time.perf_counter() - start
            assert stored == batch_tokens, stored
            http.delete(spec, toks)
            return took
        return once

    rows: dict[str, tuple[int, Callable[[], float]]] = {
        "get flight frames": (frame_bytes, timed(lambda: fli.get_frames(keys))),
        "get http frames": (frame_bytes, timed(lambda: http.get_blocks(keys))),
        "get flight kv": (kv_bytes, timed(lambda: fli.get_kv(spec, fixed))),
        "get http kv": (kv_bytes, timed(lambda: http.get_kv(spec, fixed))),
        "put flight frames": (frame_bytes, put_frames(fli.put_frames)),
        "put http frames": (frame_bytes, put_frames(http.put_blocks)),
        "put flight kv": (kv_bytes, put_kv(fli.put_kv)),
        "put http kv": (kv_bytes, put_kv(http.put_kv)),
    }
    try:
        got = fli.get_frames(keys)
        assert [bytes(g) for g in got] == [bytes(f) for _, f in items], "Flight returned other frames"
        times: dict[str, list[float]] = {name: [] for name in rows}
        order = list(rows.items())
        for r in range(repeats):
            for name, (_, fn) in order[r % len(order):] + order[:r % len(order)]:
                fn()  # the sample follows the same call, as in a loop
                times[name].append(fn())
    finally:
        http.delete_blocks(keys)
        fli.close()
        http.close()
    rates = {name: rate_of(rows[name][0], ts) for name, ts in times.items()}
    med = {name: r["median"] for name, r in rates.items()}
    ratios = {f"{op} flight / http {what}": med[f"{op} flight {what}"] / med[f"{op} http {what}"]
              for op in ("get", "put") for what in ("frames", "kv")}
    return {"block_tokens": block_tokens, "batch_tokens": batch_tokens, "frame_bytes": frame_bytes,
            "blocks": len(items), "gbps": rates, "ratios": ratios}


def run(*, quick: bool = False, repeats: int | None = None, out_dir: str | Path | None = None,
        block_tokens: int = 16, torch_threads: int = 1) -> dict:
    """Start ``kvstore serve`` with Flight, measure, print a table, write JSON; return the result.

    Args:
        torch_threads: torch intra-op threads in this (client) process, 0 keeps torch's default.
            The flight kv rows encode and decode here, and torch's thread team stalls on a busy
            two-core machine (a put of 2-token blocks took 1 s instead of 40 ms).
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)
    repeats = repeats or (3 if quick else 9)
    flight_port = free_port()
    with kvstore_serve("flight", KVSTORE_FLIGHT_PORT=str(flight_port)) as url:
        row = measure(url, flight_port, repeats=repeats, block_tokens=block_tokens)
    result = header("flight", repeats=repeats, client_torch_threads=torch.get_num_threads(),
                    unit="GB/s (1e9 B/s), median over samples (min-max)", **row)
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    lines = [f"kvstore bench flight  ({result['repeats']} samples, {result['blocks']} blocks of "
             f"{result['block_tokens']} tokens, {result['frame_bytes'] / MiB:.1f} MiB of frames a batch)"]
    for name, g in result["gbps"].items():
        lines.append(f"  {name:<20} {g['median']:6.2f}  ({g['min']:.2f}-{g['max']:.2f})")
    for name, ratio in result["ratios"].items():
        lines.append(f"  {name:<28} {ratio:5.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    run(quick="--quick" in sys.argv, out_dir=os.environ.get("KVSTORE_BENCH_OUT"))
