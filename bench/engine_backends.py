"""``kvstore bench engines``: kvstore as a storage backend of SGLang's HiCache and LMCache's MP server.

SGLang: one batch of 128 pages (32 MiB; the controller's ``STORAGE_BATCH_SIZE``) through our
backend's zero-copy calls (``batch_set_v1`` / ``batch_get_v1``) against SGLang's built-in
``file`` backend on this host's temp disk, and a plain ``memmove`` of the same page runs (the
floor: one copy). ``get`` is what the controller does to prefetch a batch: its hit query
(``batch_exists``), then the get, for freshly stored pages (kvstore hashes a frame the first
time a client reads it); ``get again`` does it once more. LMCache: store and retrieve
through a stock ``lmcache server`` with our adapter, its ``mock`` L2 and its ``fs`` L2, in the
same run (``bench/lmcache_mp.py``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.engines import engine_python, ensure
from bench.report import header, publish
from bench.serving import kvstore_server

__all__ = ["run", "markdown", "TARGETS"]

TARGETS = {"get_vs_file": 1.5, "get_vs_memcpy": 0.5, "set_vs_file": 1.0}
"""Issue 33's SGLang targets (worst layout); LMCache's are ``LMCACHE_TARGETS``, against its ``mock`` adapter."""
LMCACHE_TARGETS = {"lookup": 0.8, "l2_store": 0.9}
"""kvstore's L2 adapter against LMCache's in-memory ``mock``: its time over ours, at least."""
"""The issue's: a co-located get at least 2x SGLang's file backend and half a plain copy."""


def run(*, quick: bool = False, repeats: int | None = None, out_dir: str | Path | None = None,
        docs: str | Path | None = None, install: bool = True) -> dict:
    """Measure; print the table; write JSON (and render ``docs``); return the result.

    Raises:
        RuntimeError: an engine venv is missing (and ``install`` is off), or a process did not start.
    """
    repeats = repeats or (3 if quick else 9)
    started = time.monotonic()
    python = engine_python("sglang") or (ensure("sglang", log=lambda m: print(m, file=sys.stderr))
                                         if install else None)
    if python is None:
        raise RuntimeError("no SGLang venv: python -m bench.engines ensure sglang")
    from bench.sglang_hicache import bench_backends

    work = Path(os.path.abspath(".")) / f".kvstore-bench-engines-{os.getpid()}"
    try:
        with kvstore_server("engines", KVSTORE_SHM_BYTES="1GiB", KVSTORE_STAGING_BYTES="256MiB") as (url, _proc):
            sglang = bench_backends(python, url, work / "sglang.log", repeat=repeats)
            lmcache = _lmcache(url, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = header("engines", quick=quick, repeats=repeats, sglang=sglang, lmcache=lmcache,
                    ratios=_ratios(sglang), targets=TARGETS, elapsed_s=time.monotonic() - started)
    result["machine"]["cpus"] = os.cpu_count()
    result["met"] = {k: result["ratios"][k] >= target for k, target in TARGETS.items()}
    publish(result, format_table, out_dir)
    if docs is not None:
        from bench.page import replace_section

        replace_section(Path(docs), markdown(result), name="engines")
        print(f"rendered {docs}")
    return result


def _lmcache(url: str, repeats: int, work: Path) -> Any:
    """LMCache's rows, or why there are none (its venv missing: the SGLang rows still stand)."""
    try:
        from bench.lmcache_mp import bench_l2
    except ImportError as exc:
        return {"skipped": f"bench.lmcache_mp: {exc}"}
    from bench.peers import lmcache_python

    python = lmcache_python()
    if python is None:
        return {"skipped": "no .venv-lmcache (kvstore bench all --with-lmcache makes one)"}
    return bench_l2(python, url, work / "lmcache", repeats=repeats)


def _ratios(rows: list[dict]) -> dict[str, float]:
    """Worst layout's ratios: a target holds only if it holds in every layout."""
    by = {(r["layout"], r["backend"]): r for r in rows}
    layouts = sorted({r["layout"] for r in rows})
    out: dict[str, float] = {}
    for name, ours, theirs in (("get_vs_file", "get_s", "get_s"), ("get_again_vs_file", "get_repeat_s", "get_s"),
                               ("set_vs_file", "set_s", "set_s")):
        out[name] = min(by[(lay, "file")][theirs] / by[(lay, "kvstore")][ours] for lay in layouts)
    out["get_vs_memcpy"] = min(by[(lay, "kvstore")]["memcpy_s"] / by[(lay, "kvstore")]["get_s"] for lay in layouts)
    out["get_again_vs_memcpy"] = min(by[(lay, "kvstore")]["memcpy_s"] / by[(lay, "kvstore")]["get_repeat_s"]
                                     for lay in layouts)
    return out


def _gbs(row: dict, key: str) -> str:
    return f"{row['bytes'] / row[key] / 1e9:.2f} GB/s ({row[key] * 1e3:.1f} ms)"


def format_table(result: dict) -> str:
    return markdown(result)


def markdown(result: dict) -> str:
    lines = [f"Run {result['when']}{' (--quick)' if result['quick'] else ''}: {result['repeats']} rounds, medians, "
             f"{result['elapsed_s']:.0f} s, {result['machine']['cpus']} CPUs.", "",
             "**SGLang HiCache** (sglang 0.5.23 on CPU, its controller's batch of 128 pages of 16 tokens x 8 layers "
             "x 4 KV heads x 128, bf16: 32 MiB):", "",
             "A get is the controller's prefetch of one batch: `batch_exists`, then `batch_get_v1` (ours) or "
             "`batch_get` (file's).", "",
             "| layout | backend | set | get (first read) | get again | memcpy of the pages |", "|---|---|---|---|---|---|"]
    for r in result["sglang"]:
        mem = _gbs(r, "memcpy_s") if r["backend"] == "kvstore" else ""
        lines.append(f"| {r['layout']} | {r['backend']} | {_gbs(r, 'set_s')} | {_gbs(r, 'get_s')} | "
                     f"{_gbs(r, 'get_repeat_s')} | {mem} |")
    ra, t, met = result["ratios"], result["targets"], result["met"]

    def judged(name: str) -> str:
        return (f"**{ra[name]:.2f}x** (target >= {t[name]}x, {'met' if met[name] else 'missed'})" if name in t
                else f"{ra[name]:.2f}x")
    lines += ["", f"Ratios (worst layout): get first read / file {judged('get_vs_file')}; get again / file "
              f"{judged('get_again_vs_file')}; set / file {judged('set_vs_file')}; get first read / memcpy "
              f"{judged('get_vs_memcpy')}; get again / memcpy {judged('get_again_vs_memcpy')}."]
    lm = result["lmcache"]
    lines += ["", "**LMCache MP server** (lmcache 0.5.6, `--l2-store-policy skip_l1`):", ""]
    if isinstance(lm, dict) and "skipped" in lm:
        lines.append(f"not run: {lm['skipped']}")
    else:
        lines.append(_lmcache_table(lm))
    return "\n".join(lines)


def _lmcache_table(lm: dict) -> str:
    mib = lm["chunk_bytes"] * lm["chunks"] / (1 << 20)
    out = [f"{lm['chunks']} chunks of {lm['chunk_bytes'] // 1024} KiB ({mib:.0f} MiB), medians of {lm['repeats']}. "
           "Retrieve is L1 to the engine's buffers, the same path for every adapter: a control.", "",
           "| L2 adapter | store into L2 | lookup (L2 lock + load into L1) | retrieve | hit tokens, bytes identical |",
           "|---|---|---|---|---|"]
    for r in lm["rows"]:
        out.append(f"| {r['adapter']} | {r['l2_store_s'] * 1e3:.0f} ms ({r['l2_store_gbps']:.2f} GB/s) | "
                   f"{r['lookup_s'] * 1e3:.0f} ms ({r['lookup_gbps']:.2f} GB/s) | {r['retrieve_s'] * 1e3:.0f} ms | "
                   f"{r['hit_tokens']}, {'yes' if r['identical'] else 'NO'} |")
    by = {r["adapter"]: r for r in lm["rows"]}
    if "kvstore" in by and "mock" in by:
        judged = []
        for what, target in LMCACHE_TARGETS.items():
            ratio = by["mock"][f"{what}_s"] / by["kvstore"][f"{what}_s"]
            judged.append(f"{what.replace('l2_', '')} **{ratio:.2f}x** (target >= {target}x, "
                          f"{'met' if ratio >= target else 'missed'})")
        out += ["", "kvstore / mock, as mock's time over kvstore's: " + "; ".join(judged) + "."]
    return "\n".join(out)
