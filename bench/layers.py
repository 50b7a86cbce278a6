"""Layer-wise gets: time to the first layer against time to the whole KV.

A consumer of ``get_kv_layers`` (``client_sdk.layers``) can start the model's
layer 0 at *first layer*; a consumer of ``get_kv`` starts at *get_kv*. Rows,
per KV size, for the remote HTTP path (a ``colocated=False`` client) and the
co-located shm path:

==========================  ==========================================================
row                         clock stops when
==========================  ==========================================================
``<medium> first layer``    ``get_kv_layers`` has yielded layer 0 ``[2, H, n, D]``
``<medium> all layers``     the same stream has yielded its last layer
``<medium> get_kv``         ``get_kv`` returned ``[L, 2, H, n, D]``
==========================  ==========================================================

The shm rows run twice: with handles the client remembers (a loop re-reading
one prefix: a layer is a copy) and with the handle cache cleared before each
sample (the first read of a prefix: a ``/v1/kv/handles`` request and a
checksum of every frame before layer 0).

The server is ``kvstore serve`` in a child process (as ``bench.service``);
KV is fp16 ``[32, 2, 8, T, 128]`` (T = 256: 32 MiB, T = 1024: 128 MiB).
Samples are interleaved across rows in an order rotated every round. Both
clients pin their medium (``plan=False``): the rows compare the two APIs
over one medium, not the planner's choice.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from bench.report import header, publish
from bench.serving import kvstore_serve

__all__ = ["run", "format_table"]


def _spec():
    from kvstore.spec import KVSpec

    return KVSpec("bench-layers", 32, 8, 128, "float16", 16, fingerprint="bench-1")


def _ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def measure(url: str, n_tokens: int, repeats: int) -> dict:
    from client_sdk import KVClient

    spec = _spec()
    kv = torch.randn(spec.kv_shape(n_tokens), generator=torch.Generator().manual_seed(0)).to(torch.float16)
    tokens = list(range(2_000_000 + n_tokens, 2_000_000 + 2 * n_tokens))
    clients = {"http": KVClient(url, namespace="bench", colocated=False, plan=False),
               "shm": KVClient(url, namespace="bench", colocated=True, plan=False)}
    clients["shm"].put_kv(spec, tokens, kv)
    times: dict[str, list[float]] = {}

    def stream(medium: str, fresh: bool = False) -> Callable[[], None]:
        c = clients[medium]
        name = f"{medium}{' new handles' if fresh else ''}"

        def once() -> None:
            if fresh:
                c.colocation.arena.handles.clear()  # type: ignore[union-attr]
            start = time.perf_counter()
            layers = c.get_kv_layers(spec, tokens)
            layer, _ = next(layers)
            first = time.perf_counter()
            for layer, _ in layers:
                pass
            end = time.perf_counter()
            assert layers.n_tokens == n_tokens and layer == spec.num_layers - 1 and layers.medium == medium
            times.setdefault(f"{name} first layer", []).append(first - start)
            times.setdefault(f"{name} all layers", []).append(end - start)
        return once

    def whole(medium: str, fresh: bool = False) -> Callable[[], None]:
        c = clients[medium]
        name = f"{medium}{' new handles' if fresh else ''} get_kv"

        def once() -> None:
            if fresh:
                c.colocation.arena.handles.clear()  # type: ignore[union-attr]
            start = time.perf_counter()
            _, n = c.get_kv(spec, tokens)
            times.setdefault(name, []).append(time.perf_counter() - start)
            assert n == n_tokens
        return once

    calls = [stream("http"), whole("http"), stream("shm"), whole("shm"), stream("shm", True), whole("shm", True)]
    for _ in range(2):  # warm-up: connections, pooled buffers, page faults
        for fn in calls:
            fn()
    times.clear()
    for r in range(repeats):
        for fn in calls[r % len(calls):] + calls[:r % len(calls)]:
            fn()
    got = clients["http"].get_kv_layers(spec, tokens).read_all()[0]
    assert torch.equal(got, kv), "layers read back over HTTP differ from what was stored"
    for c in clients.values():
        c.close()
    rows = {name: _ms(ts) for name, ts in sorted(times.items())}
    ratios = {f"{m} first layer / get_kv": rows[f"{m} first layer"]["median"] / rows[f"{m} get_kv"]["median"]
              for m in ("http", "shm", "shm new handles")}
    return {"tokens": n_tokens, "bytes": spec.bytes_per_token * n_tokens, "ms": rows, "ratios": ratios}


def run(*, quick: bool = False, repeats: int | None = None, tokens: tuple[int, ...] = (256, 1024),
        out_dir: str | Path | None = None, torch_threads: int = 1) -> dict:
    """Measure every row for each KV length in ``tokens``; print a table; write JSON; return the result.

    Args:
        quick: 256 tokens only, 3 samples.
        repeats: samples per row (default 9).
        torch_threads: torch intra-op threads in this (client) process; 0 keeps torch's default.
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)
    repeats = repeats or (3 if quick else 9)
    sizes = (256,) if quick else tokens
    with kvstore_serve("layers", KVSTORE_STAGING_BYTES="256MiB") as url:
        rows = [measure(url, n, repeats) for n in sizes]
    result = header("layers", repeats=repeats, client_torch_threads=torch.get_num_threads(),
                    unit="ms from the call to the row's event, median (min-max) over samples", rows=rows)
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    lines = [f"kvstore bench layers  ({result['repeats']} samples, ms: median (min-max))"]
    for row in result["rows"]:
        lines.append(f"\n{row['tokens']} tokens ({row['bytes'] / (1 << 20):.0f} MiB)")
        for name, t in row["ms"].items():
            lines.append(f"  {name:<38} {t['median']:8.2f}  ({t['min']:.2f}-{t['max']:.2f})")
        for name, ratio in row["ratios"].items():
            lines.append(f"  {name:<38} {ratio:8.2f}x")
    return "\n".join(lines)
