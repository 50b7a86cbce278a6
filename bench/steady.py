"""The steady state: puts into a full store against puts into an empty one, the same run.

A cache is full after its first minutes. This bench runs ``kvstore serve`` processes over the
same tiers (``shm`` over ``nvme``, the nvme tier as by default: the log layout under a 0.1 s group
commit): one whose top tier is kept empty (each sample's blocks
are deleted again, untimed) and one whose top tier was filled to its high watermark with cold
blocks before the first sample and stays full (each sample's puts must find room). Rows:

==================================  ===========================================================
row                                 what is timed
==================================  ===========================================================
``<size> <block> <medium> empty``   a burst of fresh puts (``put_kv`` of new tokens, waited
                                    for) into the empty store: bytes / seconds of the burst
``<size> <block> <medium> full``    the same burst into the full store
``full / empty``                    the ratio of the two throughputs (target >= 0.8)
==================================  ===========================================================

Sizes: 1 MiB puts of 64 KiB blocks (16 blocks of a small model: 8 layers, 2 KV heads, head_dim
64, fp16, 16-token blocks) and 32 MiB puts of 2 MiB blocks (an 8B model's 16-token block: 32
layers, 8 KV heads, head_dim 128, fp16). Media: co-located (shared memory) and HTTP. Samples
are interleaved (every row once per round, order rotated each round); the figure is the
median. While one store is sampled the other two servers are stopped (SIGSTOP), so that a full
store's background work (re-encoder, compaction, mover) is charged to its own puts, not to its
neighbour's. After the runs the bench reads where the full store's last burst landed (its blocks'
tiers) and how many blocks placement demoted, so a ratio comes with its cause. Then 1 and 8
client processes put and get at once on the full store (``bench/steady_clients.py``). A scale row
(``bench/steady_scale.py``) puts into a full top tier of 1M blocks against one of 10k, in process,
and 4 writer threads put into a full embedded store against 1 (``bench/steady_writers.py``);
a spill table (``bench/steady_spill.py``) writes 64 KiB frames to the nvme tier's two layouts
until durable against one sequential file write of the same bytes, and an idle default server's
anonymous memory is read fresh and after a spill into its cxl arena (``bench/steady_idle.py``).
The servers' nvme layout is ``KVSTORE_NVME_LAYOUT`` from the bench's environment (default
``log``, the server's default for a new data dir).

    kvstore bench steady [--quick] [--repeats N] [--out DIR]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import torch

from bench.report import header, publish
from bench.serving import kvstore_server
from bench.steady_clients import format_clients, run_clients
from bench.steady_idle import format_idle, run_idle
from bench.steady_specs import block_spec
from bench.steady_scale import format_scale, run_arena_scale, run_scale
from bench.steady_writers import format_writers, run_writers
from bench.steady_spill import format_spill, run_spill

__all__ = ["run", "format_table", "SIZES"]

TOP_BYTES = 256 << 20
"""The top tier of both stores: the full one is filled to its high watermark first."""
SIZES = (("1 MiB", "64 KiB", 256, 16), ("32 MiB", "2 MiB", 256, 4))
"""(put size, block size, tokens per put, puts per burst)."""


def _admin(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as r:
        return json.loads(r.read())


def _top(url: str) -> dict:
    return _admin(url, "/admin/tiers")["tiers"][0]


def _moves(url: str) -> dict[str, float]:
    """``kvstore_moves_total`` by reason, from ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvstore_moves_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class _Fresh:
    """Token sequences no earlier put used: a first token of their own."""

    def __init__(self, start: int) -> None:
        self.n = start

    def __call__(self, tokens: int) -> list[int]:
        self.n += 1
        return [self.n] + [7] * (tokens - 1)


def fill(url: str, fresh: _Fresh) -> int:
    """Put cold 32 MiB sequences co-located until one more would cross the top tier's high watermark;
    the bytes put."""
    from client_sdk import KVClient

    spec = block_spec("2 MiB")
    kv = torch.randn(spec.kv_shape(256), generator=torch.Generator().manual_seed(0)).to(spec.torch_dtype)
    put, size = 0, spec.bytes_per_token * 256
    with KVClient(url, namespace="fill", colocated=True, plan=False) as c:
        while True:
            top = _top(url)
            if top["used_bytes"] + size > top["high_watermark_frac"] * top["capacity_bytes"]:
                return put  # the next put would cross the high watermark: the tier is as full as puts make it
            c.put_kv(spec, fresh(256), kv)
            put += size


@contextlib.contextmanager
def _alone(pids: dict[str, int], store: str) -> Iterator[None]:
    """The other stores' servers stopped (SIGSTOP) while ``store`` is sampled, continued after.

    The three servers share two cores: a full store's background work (its re-encoder, its log's
    compaction, its mover) would otherwise run during its neighbour's sample and be charged to
    it. Stopped, each store is timed as if alone, with its own background work included: that
    runs in its own samples and in the gaps between rounds."""
    others = [pid for name, pid in pids.items() if name != store]
    try:
        for pid in others:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in others:
            with contextlib.suppress(ProcessLookupError):  # one gone: the others still continue
                os.kill(pid, signal.SIGCONT)


def measure(urls: dict[str, str], repeats: int, fresh: _Fresh, pids: dict[str, int] | None = None) -> dict:
    """Interleaved samples of every row on every store; ``pids`` (store -> server pid) stops
    the other stores' servers during each sample (see ``_alone``)."""
    from client_sdk import KVClient

    stores = list(urls)
    clients = {(store, medium): KVClient(url, namespace="steady", colocated=medium == "co-located", plan=False)
               for store, url in urls.items() for medium in ("co-located", "HTTP")}
    kvs = {block: torch.randn(block_spec(block).kv_shape(tokens), generator=torch.Generator().manual_seed(1))
           .to(block_spec(block).torch_dtype) for _, block, tokens, _ in SIZES}
    times: dict[str, list[float]] = {}
    last: dict[str, list[int]] = {}

    def sample(size: str, block: str, tokens: int, burst: int, medium: str, store: str) -> Callable[[], None]:
        spec, kv, client = block_spec(block), kvs[block], clients[(store, medium)]
        name = f"{size} {block} {medium} {store}"

        def once() -> None:
            seqs = [fresh(tokens) for _ in range(burst)]
            with _alone(pids, store) if pids else contextlib.nullcontext():
                start = time.perf_counter()
                for toks in seqs:
                    client.put_kv(spec, toks, kv)
                times.setdefault(name, []).append(time.perf_counter() - start)
            last[name] = seqs[-1]
            if store == "empty":  # untimed: the empty store keeps its room
                for toks in seqs:
                    client.delete(spec, toks)
        return once

    calls = [sample(size, block, tokens, burst, medium, store) for size, block, tokens, burst in SIZES
             for medium in ("co-located", "HTTP") for store in stores]
    for fn in calls:  # warm-up: arenas mapped, pools lent, pages faulted
        fn()
    times.clear()
    for r in range(repeats):
        for fn in calls[r % len(calls):] + calls[:r % len(calls)]:
            fn()
    rows = []
    for size, block, tokens, burst in SIZES:
        spec = block_spec(block)
        nbytes = spec.bytes_per_token * tokens * burst
        for medium in ("co-located", "HTTP"):
            row: dict = {"size": size, "block": block, "medium": medium, "burst_puts": burst}
            for store in stores:
                name = f"{size} {block} {medium} {store}"
                med = statistics.median(times[name])
                row[store] = {"ms_per_put": med * 1e3 / burst, "mb_s": nbytes / med / 1e6,
                              "min_ms_per_put": min(times[name]) * 1e3 / burst,
                              "max_ms_per_put": max(times[name]) * 1e3 / burst}
            for store in stores[1:]:
                row[f"{store} / empty"] = row[store]["mb_s"] / row["empty"]["mb_s"]
                with KVClient(urls[store], namespace="steady", colocated=False, plan=False) as c:
                    tiers = [b["tier"] for b in c.lookup_blocks(spec, last[f"{size} {block} {medium} {store}"])["blocks"]]
                row[f"{store}: last burst"] = {t: tiers.count(t) for t in sorted(set(tiers))}
            rows.append(row)
    for c in clients.values():
        c.close()
    return {"rows": rows}


def run(*, quick: bool = False, repeats: int | None = None, out_dir: str | Path | None = None,
        torch_threads: int = 1) -> dict:
    """Fill one store, then time bursts of puts into it and into an empty one; print; write JSON.

    Args:
        quick: 3 samples a row.
        repeats: samples a row (default 7).
        torch_threads: torch intra-op threads in this (client) process; 0 keeps torch's default.
    """
    if torch_threads:
        torch.set_num_threads(torch_threads)
    repeats = repeats or (3 if quick else 7)
    # the nvme tier as by default (named, so that a bench environment's own setting does not leak in)
    env = dict(KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES=str(TOP_BYTES), KVSTORE_NVME_BYTES=str(16 << 30),
               KVSTORE_NVME_SYNC_INTERVAL_S="0.1", KVSTORE_NVME_LAYOUT=os.environ.get("KVSTORE_NVME_LAYOUT", "log"))
    # first, on a quiet machine: after the servers, raw writes measured 385-490 MB/s against
    # 1,460-1,550 alone (same machine, same minute), and the ratios meant nothing
    spill = run_spill(quick=quick)
    idle = run_idle()  # a default server of its own, alone too
    fresh = _Fresh(10_000_000)
    with kvstore_server("steady-empty", **env) as (empty, empty_proc), \
            kvstore_server("steady-full", **env) as (full, full_proc), \
            kvstore_server("steady-evict", **env, KVSTORE_FULL_TOP_TIER="evict") as (evict, evict_proc):
        urls = {"empty": empty, "full": full, "full evict": evict}
        pids = {"empty": empty_proc.pid, "full": full_proc.pid, "full evict": evict_proc.pid}
        filled = {}
        for store in ("full", "full evict"):
            t0 = time.perf_counter()
            filled[store] = (fill(urls[store], fresh), time.perf_counter() - t0)
        before = {store: _moves(urls[store]) for store in filled}
        result = measure(urls, repeats, fresh, pids)
        result["clients"] = run_clients(full, window_s=2.0 if quick else 5.0, server_pid=full_proc.pid)
        result["full stores"] = {
            store: {"filled_mib": filled[store][0] / (1 << 20), "fill_s": filled[store][1],
                    "top_tier_used_mib": _top(urls[store])["used_bytes"] / (1 << 20),
                    "moves during the samples": {k: v - before[store].get(k, 0.0)
                                                 for k, v in _moves(urls[store]).items()
                                                 if v != before[store].get(k, 0.0)}}
            for store in filled}
    result["scale"] = run_scale(quick=quick)
    result["arena_scale"] = run_arena_scale(quick=quick)
    result["writers"] = run_writers(quick=quick)
    result["spill"] = spill
    result["idle"] = idle
    result["nvme_layout"] = env["KVSTORE_NVME_LAYOUT"]
    out = header("steady", repeats=repeats, client_torch_threads=torch.get_num_threads(),
                 unit="MB/s of a burst of puts, median over samples", top_tier_bytes=TOP_BYTES, **result)
    out["machine"]["cpus"] = os.cpu_count()
    publish(out, format_table, out_dir)
    return out


def format_table(result: dict) -> str:
    lines = [f"kvstore bench steady  ({result['repeats']} samples a row; shm {result['top_tier_bytes'] >> 20} MiB "
             f"over nvme ({result.get('nvme_layout', 'log')} layout); MB/s of a burst of puts, median; "
             f"full: KVSTORE_FULL_TOP_TIER=spill (default), full evict: =evict)",
             f"{'put':<8}{'block':<8}{'medium':<12}{'empty':>8}{'full':>8}{'evict':>8}{'full/empty':>11}"
             f"{'evict/empty':>12}   where the full stores' last burst landed (spill | evict)"]
    for row in result["rows"]:
        lines.append(f"{row['size']:<8}{row['block']:<8}{row['medium']:<12}{row['empty']['mb_s']:>8.0f}"
                     f"{row['full']['mb_s']:>8.0f}{row['full evict']['mb_s']:>8.0f}{row['full / empty']:>10.2f}x"
                     f"{row['full evict / empty']:>11.2f}x   {row['full: last burst']} | "
                     f"{row['full evict: last burst']}")
    for store, fs in result["full stores"].items():
        lines.append(f"{store}: filled {fs['filled_mib']:.0f} MiB in {fs['fill_s']:.1f} s; top tier now "
                     f"{fs['top_tier_used_mib']:.0f} MiB; moves during the samples: "
                     f"{fs['moves during the samples'] or 'none'}")
    if "clients" in result:
        lines += format_clients(result["clients"])
    if "scale" in result:
        lines += format_scale(result["scale"], result.get("arena_scale"))
    if "writers" in result:
        lines += format_writers(result["writers"])
    if "spill" in result:
        lines += format_spill(result["spill"])
    if "idle" in result:
        lines += format_idle(result["idle"])
    return "\n".join(lines)
