"""An idle default server's anonymous memory, fresh and after a spill (``kvstore bench steady``).

Issue 34's row: an idle default server holds <= 300 MiB of anonymous memory. A default
``kvstore serve`` (no ``KVSTORE_*`` setting but its data directory: shm 1 GiB over a THP cxl
arena of 1 GiB over nvme) is read from ``/proc/<pid>/status`` (``RssAnon``) three times: idle
after start; after a co-located client put ``SPILL_BYTES`` (32 MiB puts, so the puts fill shm
and spill into cxl, whose pages are anonymous) and deleted it all; and once the store's trimmer
(``kvstore.engine.trim``) has run in the quiet that follows (its cxl tier's ``free_released``
counts the trims), or ``WAIT_S`` passed.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time

import httpx
import torch

from bench.paths import spec_for
from bench.serving import child, free_port

__all__ = ["run_idle", "format_idle", "TARGET_MIB", "SPILL_BYTES"]

MiB = 1 << 20
SPILL_BYTES = 1536 * MiB
TARGET_MIB = 300
WAIT_S = 60.0


def _anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")


def _trims(url: str) -> int:
    for tier in httpx.get(f"{url}/admin/tiers", timeout=10).json()["tiers"]:
        match = re.search(r"of (\d+) idle trims", tier.get("details", {}).get("free_released", ""))
        if tier["name"] == "cxl" and match:
            return int(match.group(1))
    return 0


def run_idle(settle_s: float = 5.0) -> dict:
    """The three readings, MiB, and how long the trim took to come (None: it did not, within WAIT_S)."""
    work = tempfile.mkdtemp(prefix=".kvstore-bench-idle-", dir=".")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["KVSTORE_DATA_DIR"] = os.path.join(work, "data")
    port = free_port()
    try:
        with child([sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port)], port, env) as proc:
            return _measure(proc.pid, f"http://127.0.0.1:{port}", settle_s)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(pid: int, url: str, settle_s: float) -> dict:
    from client_sdk import KVClient

    time.sleep(settle_s)  # start-up's allocations settle
    fresh = _anon_mib(pid)
    spec, tokens = spec_for(32 * MiB)
    kv = torch.randn(spec.kv_shape(tokens), generator=torch.Generator().manual_seed(9)).half()
    seqs = [[i * 1_000_000 + j for j in range(tokens)] for i in range(SPILL_BYTES // (32 * MiB))]
    with KVClient(url, namespace="bench-idle", plan=False) as client:
        for toks in seqs:
            client.put_kv(spec, toks, kv)
        spilled = _anon_mib(pid)
        for toks in seqs:
            client.delete(spec, toks)
    trims, t0 = _trims(url), time.monotonic()
    while _trims(url) == trims and time.monotonic() - t0 < WAIT_S:
        time.sleep(0.5)
    waited = time.monotonic() - t0
    return {"fresh_mib": fresh, "after_spill_mib": spilled, "idle_after_spill_mib": _anon_mib(pid),
            "trim_after_s": waited if waited < WAIT_S else None, "spill_bytes": SPILL_BYTES, "target_mib": TARGET_MIB}


def format_idle(idle: dict) -> list[str]:
    came = f"{idle['trim_after_s']:.0f} s after the deletes" if idle["trim_after_s"] is not None else "no trim came"
    return [f"idle default server, anonymous RSS (target <= {idle['target_mib']} MiB): fresh {idle['fresh_mib']:.0f} MiB; "
            f"holding {idle['spill_bytes'] >> 20} MiB put {idle['after_spill_mib']:.0f} MiB; all deleted, idle "
            f"{idle['idle_after_spill_mib']:.0f} MiB ({came})"]


if __name__ == "__main__":
    print("\n".join(format_idle(run_idle())))
