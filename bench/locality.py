"""``kvstore bench agents``: the multi-agent locality targets, measured in one run.

Three parts, each its own module with its own private servers (so one part's tiers and
churn never colour another's figures):

- ``ttft`` (``bench.locality_ttft``): a consumer's TTFT after a hand-off, its prefix sunk to
  NVMe or to Redis, with and without a prefetch, against a prefix already in shm; and a
  consumer on a second node over one Redis after a hand-off;
- ``events`` (``bench.locality_events``): snapshot + events against ``/admin/entries`` after
  a mixed workload, put-to-event latency, and puts beside a subscriber that stopped reading;
- ``retain`` (``bench.locality_retain``): retained conversations' top-tier hit ratio while
  other tenants fill the tier three times over, and what the others lose.

Every row carries its target and whether it was met; the router target lives in
``tests/test_router_example.py`` (``examples/router.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

from bench.report import header, publish

__all__ = ["PARTS", "run", "format_table"]

PARTS = {"ttft": "bench.locality_ttft", "events": "bench.locality_events", "retain": "bench.locality_retain"}


def run(quick: bool = False, *, parts: Sequence[str] = tuple(PARTS), out_dir: str | Path | None = "bench/results",
        seed: int = 0) -> dict:
    """Run ``parts`` in order; print each part's table and one summary, and write the JSON.

    Raises:
        ValueError: an unknown part.
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; parts are {sorted(PARTS)}")
    results = {}
    for part in parts:
        mod = importlib.import_module(PARTS[part])
        got = mod.run(quick, seed=seed)
        print(mod.format_table(got), flush=True)
        print()
        results[part] = got
    result = header("agents", quick=quick, parts=results)
    if out_dir is not None:
        publish(result, format_table, out_dir)
    return result


def _targets(got: dict) -> list[dict]:
    """A part's target rows (the context rows, ``met`` None, are left out); the TTFT part names
    each case's target."""
    rows = [r for r in got.get("rows", []) if r.get("met") is not None]
    rows += [{"name": f"{c['case']}: TTFT after a prefetch", "target": c["target"], "met": c["met"]}
             for c in got.get("cases", [])]
    return rows


def format_table(result: dict) -> str:
    lines = ["kvstore bench agents: every target", f"{'part':8} {'measure':48} {'target':40} met"]
    rows = [(part, row) for part, got in result["parts"].items() for row in _targets(got)]
    for part, row in rows:
        lines.append(f"{part:8} {row['name'][:48]:48} {str(row['target'])[:40]:40} {'yes' if row['met'] else 'NO'}")
    lines.append(f"{sum(bool(r['met']) for _, r in rows)} of {len(rows)} targets met "
                 "(the router's >= 95% is tests/test_router_example.py's)")
    return "\n".join(lines)
