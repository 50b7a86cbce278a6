"""``kvstore bench reliability``: the reliability suite's scenarios at full size, as one table.

The scenarios are the ones ``tests/reliability/`` asserts on (``bench/reliability_kit/``, shipped
so that an installed kvstore runs them too), run with real processes, a real ``kvstore serve``,
real files and shared memory:

- crash: four clients put with ``durable=True`` while the server is ``kill -9``ed; every
  acknowledged put is read back after the restart (20 cycles; 3 with ``--quick``); then the same
  while the log tier's compactor rewrites the acknowledged frames, and while placement demotes
  them from shm to nvme (``scenarios.CRASHES``: 10 cycles each; 2);
- fuzz: damaged frames to both block-put routes (2,000 cases each; 200);
- load: 16 client processes of mixed operations, every get checked (100,000 ops; 2,400);
- memory: put/delete churn through the embedded store (1,000,000 cycles; 20,000).

Its work files (data directories, the servers' logs) go in a temp dir under the current
directory, as the other benches' do, and are removed after.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.reliability_kit.scenarios import CRASHES, WORKERS, churn, fuzz_blocks, run_crashes, run_load
from bench.report import header, publish

__all__ = ["run", "format_table"]

FULL = {"cycles": 20, "moving_cycles": 10, "fuzz": 2000, "ops_per_worker": 6250, "churn": 1_000_000}
QUICK = {"cycles": 3, "moving_cycles": 2, "fuzz": 200, "ops_per_worker": 150, "churn": 20_000}
MOVING = ("compaction", "demotion")
"""The crash scenarios in which the server moves acknowledged data as it dies."""


def run(*, quick: bool = False, out_dir: str | Path | None = None, docs: str | Path | None = None) -> dict:
    """Run every scenario; print the table; write JSON (and render ``docs``); return the result.

    Raises:
        RuntimeError: a scenario could not start.
        AssertionError: a scenario broke a promise on the way (a client acknowledged nothing, a
            temp file among the data after a restart).
    """
    sizes = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix=".kvstore-bench-reliability-", dir="."))
    started = time.monotonic()
    try:
        say = lambda what: print(f"[{time.monotonic() - started:6.1f}s] {what}", file=sys.stderr, flush=True)  # noqa: E731
        say(f"crash: {sizes['cycles']} kill -9 cycles")
        crash = run_crashes(work / "crash", cycles=sizes["cycles"], seed=1)
        moving = {}
        for name in MOVING:
            say(f"crash under {name}: {sizes['moving_cycles']} kill -9 cycles")
            moving[name] = run_crashes(work / name, cycles=sizes["moving_cycles"], seed=1, **CRASHES[name])
        say(f"fuzz: {2 * sizes['fuzz']} damaged frames")
        fuzz = fuzz_blocks(work / "fuzz", sizes["fuzz"], seed=1)
        say(f"load: {WORKERS} clients x {sizes['ops_per_worker']} ops")
        load = run_load(work / "load", sizes["ops_per_worker"], seed=1)
        say(f"memory: {sizes['churn']:,} put/delete cycles")
        memory = churn(work / "memory", sizes["churn"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warm, *later = memory["rss"]
    result = header("reliability", quick=quick, sizes=sizes, crash=crash, crash_moving=moving, fuzz=fuzz, load=load,
                    memory=memory, rss_drift=max(later) / warm - 1 if later else 0.0, elapsed_s=time.monotonic() - started)
    result["machine"]["cpus"] = os.cpu_count()
    publish(result, format_table, out_dir)
    if docs is not None:
        from bench.page import replace_section

        replace_section(Path(docs), markdown_table(result))
        print(f"rendered {docs}")
    return result


def rows(result: dict) -> list[tuple[str, str, str]]:
    """(figure, value, what it must be) for the table."""
    c, f, lo, m = result["crash"], result["fuzz"], result["load"], result["memory"]
    p99 = ", ".join(f"{op} {ms:.1f}" for op, ms in sorted(lo["p99_ms"].items()))
    return [
        ("crash cycles survived (kill -9 of the server)", f"{c['cycles']}", ""),
        ("acknowledged durable puts", f"{c['acknowledged']:,}", ""),
        ("acknowledged puts read back (all cycles so far, each cycle)", f"{c['checked']:,}", ""),
        ("lost", f"{c['lost']}", "0"),
        ("torn or foreign served", f"{c['torn_served']}", "0"),
        ("in-flight puts found after a kill (each a whole prefix)", f"{c['in_flight_found']}", ""),
        *_moving_rows(result.get("crash_moving", {})),
        ("fuzz cases run (damaged frames, two routes)", f"{f['cases']:,}", ""),
        ("5xx seen", f"{f['5xx']}", "0"),
        ("damaged frames stored", f"{f['stored']}", "0"),
        ("concurrent ops verified (16 processes)", f"{lo['ops']:,}", ""),
        ("tokens checked bit for bit", f"{lo['verified_tokens']:,}", ""),
        ("mismatches", f"{lo['mismatches']}", "0"),
        ("errors", ", ".join(f"{k} {v}" for k, v in lo["errors"].items()) or "none", "none"),
        ("placement moves during the load", f"{lo['moves']:,}" + (" (the log's bound)" if lo["moves"] >= 10_000 else ""), ""),
        ("p99 latency under load, ms", p99, ""),
        ("put/delete cycles (mixed block sizes)", f"{m['cycles']:,}", ""),
        ("RSS drift after warm-up", f"{100 * result['rss_drift']:+.2f}%", "within ±10%"),
        ("shm arena fragmentation at the end", f"{m['fragmentation']:.2f}", ""),
    ]


def _moving_rows(moving: dict) -> list[tuple[str, str, str]]:
    out = []
    for name, c in moving.items():
        watched = next((k for k in ("compactions", "demotions") if k in c), None)
        done = f", {c[watched]:,} {watched}" if watched else ""
        out += [(f"crash under {name}: cycles, acknowledged, read back", f"{c['cycles']}, {c['acknowledged']:,}, "
                 f"{c['checked']:,}{done}", ""),
                (f"crash under {name}: lost, torn or foreign served", f"{c['lost']}, {c['torn_served']}", "0, 0")]
    return out


def markdown_table(result: dict) -> str:
    when = f"Run {result['when']}{' (--quick)' if result['quick'] else ''}, {result['elapsed_s']:.0f} s, " \
           f"{result['machine']['cpus']} CPUs."
    lines = [when, "", "| figure | value | must be |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows(result)]
    return "\n".join(lines)


def format_table(result: dict) -> str:
    width = max(len(a) for a, _, _ in rows(result))
    lines = [f"kvstore bench reliability{' (--quick)' if result['quick'] else ''}"]
    lines += [f"  {a:<{width}}  {b}" + (f"   (must be {c})" if c else "") for a, b, c in rows(result)]
    return "\n".join(lines)
