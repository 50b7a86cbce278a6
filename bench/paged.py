"""vLLM's paged cache and the co-located arena: the connector's loads and saves, one copy or two.

``kvstore.integrations.vllm_transfer`` moves whole blocks between kvstore and vLLM's per-layer
caches (the CPU layout, K transposed per block). Rows, per prompt length, on the geometry of
``kvstore bench vllm``'s model (8 layers, 2 KV heads, head_dim 64, fp32, 128-token blocks):

======================  ===================================================================
row                     what is timed
======================  ===================================================================
``load one copy``       ``Load`` of the prompt's blocks: arena -> vLLM's blocks
                        (``KVClient.get_kv_blocks``; the key index answers, no request)
``load two copies``     the same through the layer stream: arena -> a result tensor ->
                        vLLM's blocks (the path before, and still a GPU cache's)
``save one copy``       a ``Saver`` job of a new prompt, submitted and waited for: vLLM's
                        blocks -> pool slots (``KVClient.put_kv_blocks``, one request)
``save two copies``     gather into a buffer, then ``put_kv`` (encode into slots)
``memcpy``              one-thread ``np.copyto`` of the same bytes, for scale
======================  ===================================================================

Loads run against a warm client (its arena mapped), samples interleaved, order rotated
every round; each save stores blocks no earlier sample stored (a first token of its own),
deleted again after the clock stops, so saves land in a store with room (a full one is
``bench steady``'s).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from bench.report import header, publish
from bench.serving import kvstore_serve

__all__ = ["run", "format_table"]

BLOCK = 128


def _spec(tag: str):
    from kvstore.spec import KVSpec

    return KVSpec("bench-paged", num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32",
                  block_tokens=BLOCK, fingerprint=f"bench-paged-{tag}")


def _ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms)}


def measure(url: str, n_tokens: int, repeats: int) -> dict:
    from client_sdk import KVClient
    from kvstore.integrations import vllm_transfer as vt
    from kvstore.integrations.vllm_layout import layout_for

    spec = _spec(str(n_tokens))
    nb = n_tokens // BLOCK
    gen = torch.Generator().manual_seed(n_tokens)
    caches = [torch.randn(2 * nb, 2, BLOCK, 2 * spec.head_dim, generator=gen) for _ in range(spec.num_layers)]
    source, target = layout_for(caches, spec), [torch.zeros_like(c) for c in caches]
    into = layout_for(target, spec)
    ids = list(range(nb, 2 * nb))
    client = KVClient(url, namespace="bench", colocated=True, plan=False)
    tokens = list(range(n_tokens))
    client.put_kv(spec, tokens, source.gather(list(range(nb)), spec.empty_kv(n_tokens)))
    savers = {True: vt.Saver(client, spec, source, vt.Counters()),
              False: vt.Saver(client, spec, source, vt.Counters(), one_copy=False)}
    times: dict[str, list[float]] = {}
    fresh = iter(range(10_000_000, 20_000_000))
    src = np.empty(n_tokens * spec.bytes_per_token // 4, np.int32)
    dst = np.empty_like(src)

    def timed(name: str, fn: Callable[[bool], object], one_copy: bool) -> Callable[[], None]:
        def once() -> None:
            start = time.perf_counter()
            saved = fn(one_copy)
            times.setdefault(name, []).append(time.perf_counter() - start)
            if saved is not None:  # untimed: the top tier keeps its room (a full store is bench steady's)
                client.delete(spec, saved)
        return once

    def load(one_copy: bool) -> None:
        done = vt.Load(client, spec, into, [vt.LoadJob("r", tokens, 0, ids)], vt.Counters(), layerwise=False,
                       one_copy=None if one_copy else False)
        assert done.finish() == set() and done.one_copy is one_copy

    def save(one_copy: bool) -> list[int]:
        toks = [next(fresh)] + tokens[1:]
        saver = savers[one_copy]
        saver.submit(vt.SaveJob("s", toks, list(range(nb))))
        assert saver.wait_for("s", 60)
        return toks

    def memcpy() -> None:
        start = time.perf_counter()
        np.copyto(dst, src)
        times.setdefault("memcpy", []).append(time.perf_counter() - start)

    calls = [timed("load one copy", load, True), timed("load two copies", load, False),
             timed("save one copy", save, True), timed("save two copies", save, False), memcpy]
    for fn in calls:  # warm-up: the arena mapped, the pool lent, pages faulted
        fn()
    times.clear()
    for r in range(repeats):
        for fn in calls[r % len(calls):] + calls[:r % len(calls)]:
            fn()
    assert all(torch.equal(target[layer][ids[i]], caches[layer][i]) for layer in range(spec.num_layers)
               for i in range(nb)), "a loaded block differs from the stored one"
    for saver in savers.values():
        saver.close()
    assert all(s.counters.snapshot()["save_errors"] == 0 for s in savers.values())
    client.close()
    rows = {name: _ms(ts) for name, ts in sorted(times.items())}
    med = {name: row["median"] for name, row in rows.items()}
    ratios = {"load two copies / one copy": med["load two copies"] / med["load one copy"],
              "save two copies / one copy": med["save two copies"] / med["save one copy"],
              "memcpy / load one copy": med["memcpy"] / med["load one copy"]}
    return {"tokens": n_tokens, "bytes": spec.bytes_per_token * n_tokens, "ms": rows, "ratios": ratios}


def run(*, quick: bool = False, repeats: int | None = None, tokens: tuple[int, ...] = (1024, 2048, 4096),
        out_dir: str | Path | None = None, torch_threads: int = 1) -> dict:
    """Measure every row for each prompt length in ``tokens``; print a table; write JSON; return it.

    Args:
        quick: 1k tokens only, 3 samples.
        repeats: samples per row (default 15).
        torch_threads: torch intra-op threads in this (client) process; 0 keeps torch's default.
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)
    repeats = repeats or (3 if quick else 15)
    sizes = (1024,) if quick else tokens
    with kvstore_serve("paged") as url:
        rows = [measure(url, n, repeats) for n in sizes]
    result = header("paged", repeats=repeats, client_torch_threads=torch.get_num_threads(),
                    unit="ms per call, median (min-max) over samples", rows=rows)
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    return result


def format_table(result: dict) -> str:
    lines = [f"kvstore bench paged  ({result['repeats']} samples, ms: median (min-max))"]
    for row in result["rows"]:
        lines.append(f"\n{row['tokens']} tokens ({row['bytes'] / (1 << 20):.0f} MiB)")
        for name, t in row["ms"].items():
            lines.append(f"  {name:<30} {t['median']:8.2f}  ({t['min']:.2f}-{t['max']:.2f})")
        for name, ratio in row["ratios"].items():
            lines.append(f"  {name:<30} {ratio:8.2f}x")
    return "\n".join(lines)
