"""``kvstore bench lmcache``: LMCache's own client against LMCache's server and against kvstore's.

One run, one LMCache driver (``bench/lmcache_driver.py`` in ``.venv-lmcache``), the same
``RemoteBackend`` over ``lm://`` an engine uses, pointed at two servers:

- ``lmcache server``: ``python -m lmcache.v1.server 127.0.0.1 PORT cpu``, LMCache's own;
- ``kvstore lm://``: ``kvstore serve --lmcache-port PORT`` on its embedded default tiers
  (shm, cxl, nvme; 512 MiB of shm here), the chunks in namespace ``lmcache``.

Rows are 32 MiB bf16 chunks ``[2, 32, 256, 1024]`` (KV_2LTD). A put is timed until the
server holds the chunk (the driver follows each PUT, which has no answer, with an EXIST
on the same connection); a get copies into one reused tensor, as an engine does. Both
servers' rows, and a loopback TCP limit to a child process (``recv_into`` a reused
buffer; send and an ack), are sampled interleaved, the order shuffled each round, after
two warm-up rounds; medians and min-max, GiB/s. Targets: kvstore's get at least 1.0x
LMCache's server's, its put at least 2x.

    kvstore bench lmcache [--quick] [--repeats N] [--with-lmcache] [--docs docs/benchmarks.md]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import peers
from bench.limits import Limits
from bench.report import header, publish
from bench.sampling import Row, interleave
from bench.serving import free_port, kvstore_server

__all__ = ["run", "TARGETS"]

GiB = 1 << 30
TARGETS = {"get": 1.0, "put": 2.0}
"""kvstore lm:// over LMCache's server, same run, medians."""
ROWS = ("kvstore lm:// put", "kvstore lm:// get", "lmcache server put", "lmcache server get",
        "limit tcp put", "limit tcp get")


def run(*, quick: bool = False, repeats: int | None = None, lmcache: str = "auto", out_dir: str | Path | None = None,
        docs: str | Path | None = None) -> dict:
    """Measure; print the table; write JSON (and render ``docs``); return the result.

    Args:
        lmcache: ``"with"`` installs LMCache into ``.venv-lmcache`` when it is missing.

    Raises:
        RuntimeError: LMCache is not installed (and ``lmcache`` is not ``"with"``), or a
            server did not start or answer.
    """
    repeats = repeats or (5 if quick else 21)
    python = peers.lmcache_python()
    if python is None:
        if lmcache != "with":
            raise RuntimeError("no .venv-lmcache with lmcache==0.5.6: run with --with-lmcache (about a minute)")
        python = peers.install_lmcache(log=lambda m: print(m, file=sys.stderr))
    started = time.monotonic()
    say = lambda what: print(f"[{time.monotonic() - started:6.1f}s] {what}", file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix=".kvstore-bench-lmcache-", dir="."))
    lm_port = free_port()
    try:
        with kvstore_server("lmcache", KVSTORE_LMCACHE_PORT=str(lm_port)) as (url, _proc):
            say(f"kvstore serve at {url}, lm:// on {lm_port}; LMCache's server and driver from {python}")
            driver = peers.LMCacheDriver(python, work / "lmcache-driver.log")
            limits = Limits(peers.LMCACHE_CHUNK_BYTES, str(work))
            try:
                setup = {"shape": list(peers.LMCACHE_CHUNK), "dtype": "bfloat16",
                         "torch_threads": torch.get_num_threads()}
                driver.call(cmd="setup", backend="kvstore", lm_url=f"lm://127.0.0.1:{lm_port}", **setup)
                driver.call(cmd="setup", backend="lm", **setup)
                for backend in ("kvstore", "lm"):
                    if not driver.call(cmd="verify", backend=backend)["equal"]:
                        raise RuntimeError(f"{backend}: the chunk read back differs from the one written")
                n = peers.LMCACHE_CHUNK_BYTES

                def op(backend: str, which: str):
                    return lambda: float(driver.call(cmd="sample", backend=backend, op=which)["seconds"])

                rows = {f"{name} {which}": Row(n, op(backend, which))
                        for backend, name in (("kvstore", "kvstore lm://"), ("lm", "lmcache server"))
                        for which in ("put", "get")}
                rows.update({k: v for k, v in limits.rows().items() if k.startswith("limit tcp")})
                say(f"{repeats} rounds of {len(rows)} rows, 32 MiB each")
                samples = interleave(rows, repeats, tick=lambda r: say(f"round {r + 1}/{repeats}"))
            finally:
                limits.close()
                driver.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {name: _gib(per_byte) for name, per_byte in samples.items()}
    ratios = {op: figures[f"kvstore lm:// {op}"]["median"] / figures[f"lmcache server {op}"]["median"]
              for op in ("put", "get")}
    result = header("lmcache", quick=quick, repeats=repeats, chunk=list(peers.LMCACHE_CHUNK), chunk_bytes=n,
                    rows=figures, ratios=ratios, targets=TARGETS,
                    met={op: ratios[op] >= TARGETS[op] for op in TARGETS},
                    vs_tcp={op: figures[f"kvstore lm:// {op}"]["median"] / figures[f"limit tcp {op}"]["median"]
                            for op in ("put", "get")},
                    elapsed_s=time.monotonic() - started)
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    if docs is not None:
        from bench.page import replace_section

        replace_section(Path(docs), markdown(result), name="lmcache")
        print(f"rendered {docs}")
    return result


def _gib(per_byte: list[float]) -> dict:
    """Median and min-max GiB/s, and every sample's (in the order taken)."""
    rates = [1 / (s * GiB) for s in per_byte]
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "samples": rates}


def _lines(result: dict) -> list[tuple[str, str]]:
    rows = result["rows"]
    return [(name, f"{rows[name]['median']:.2f} ({rows[name]['min']:.2f}-{rows[name]['max']:.2f})") for name in ROWS]


def markdown(result: dict) -> str:
    lines = [f"Run {result['when']}{' (--quick)' if result['quick'] else ''}: {result['repeats']} samples a row, "
             f"{result['elapsed_s']:.0f} s, {result['machine']['cpus']} CPUs. 32 MiB bf16 chunks, GiB/s, "
             "median (min-max).", "", "| row | GiB/s |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in _lines(result)]
    lines += ["", "| kvstore lm:// / LMCache's server | same run | target | met |", "|---|---|---|---|"]
    for op in ("put", "get"):
        lines.append(f"| {op} | {result['ratios'][op]:.2f}x | >= {TARGETS[op]:.1f}x | "
                     f"{'yes' if result['met'][op] else 'no'} |")
    lines += ["", f"kvstore lm:// against the loopback TCP limit: put {result['vs_tcp']['put']:.2f}x, "
                  f"get {result['vs_tcp']['get']:.2f}x."]
    return "\n".join(lines)


def format_table(result: dict) -> str:
    lines = [f"kvstore bench lmcache{' (--quick)' if result['quick'] else ''}: GiB/s, 32 MiB chunks"]
    lines += [f"  {a:<20} {b}" for a, b in _lines(result)]
    for op in ("put", "get"):
        lines.append(f"  kvstore / LMCache {op}: {result['ratios'][op]:.2f}x (target {TARGETS[op]:.1f}x: "
                     f"{'met' if result['met'][op] else 'missed'})")
    return "\n".join(lines)
