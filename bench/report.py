"""What every benchmark does at the end: print its table, write its JSON."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

__all__ = ["header", "publish"]


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
