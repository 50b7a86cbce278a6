"""What every benchmark does at the end: print its table, write its JSON; tables several share."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["header", "publish", "latency_table"]


def header(bench: str, **extra: object) -> dict:
    """The fields every result starts with: which bench, when, on what machine."""
    return {"bench": bench, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
            **extra}


def publish(result: dict, format_table: Callable[[dict], str], out_dir: str | Path | None) -> Path:
    """Print ``result`` as a table and write it to ``<out_dir>/<bench>-<time>.json``.

    Returns:
        The JSON's path (also stored in ``result["path"]``).
    """
    print(format_table(result))
    target = Path(out_dir or "bench/results")
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"{result['bench']}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    result["path"] = str(path)
    return path


def latency_table(sizes: Sequence[dict], rows: Sequence[str], limit_of: Mapping[str, str]) -> list[str]:
    """Markdown lines: each of ``rows``' p50 and p99 time at each size, and each as a multiple of
    its limit's time (lower is better, unlike the GB/s ratios).

    The limit's time is the size over its median GB/s, the figure the ratios use, not the p50
    of its single copies: a small copy repeated in a loop runs from cache, and that p50 flatters it.

    Args:
        sizes: ``bench all``'s per-size results; a row's figures need ``p50_ms`` and ``p99_ms``
            (``bench.sampling.summary`` with the operations' times).
        limit_of: each row's limit (``bench.rows.LIMIT_OF``).

    Returns:
        The table with its heading, or no lines when no size has any of ``rows``.
    """
    lines = []
    for s in sizes:
        for name in rows:
            g, limit = s["gbps"].get(name, {}), s["gbps"].get(limit_of.get(name, ""))
            if "p99_ms" not in g:
                continue
            times = [f"{g[p]:.3f}" for p in ("p50_ms", "p99_ms")]
            multiples = ["", ""]
            if limit is not None:
                limit_ms = 1e3 * s["bytes"] / (1e9 * limit["median"])
                what = limit_of[name].removeprefix("limit ")
                multiples = [f"{g[p] / limit_ms:.2f}x {what}" for p in ("p50_ms", "p99_ms")]
            lines.append(f"| {name} | {s['size']} | {g['ops']} | {' | '.join(times)} | {' | '.join(multiples)} |")
    if not lines:
        return []
    return ["### Latency: time of one operation (p99: the slowest when under 100 operations)", "",
            "| row | size | operations | p50 ms | p99 ms | p50 / limit's time | p99 / limit's time |",
            "|---|---|---|---|---|---|---|", *lines, ""]
