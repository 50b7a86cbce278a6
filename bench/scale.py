"""Scale: ``get_kv`` from 1, 4 and 16 client processes at once, and the server's memory as it fills.

Throughput: worker processes (started once, each with its clients warmed up)
get one stored sequence in a loop for the same wall-clock window, which starts
at one instant in all of them. Figures pool the gets: GB/s and gets/s (each
worker's count over the time its gets took), p50 and p99 latency. Media:
``colocated`` (a client that, after its first get, serves repeats from the slot
handles it remembers: the server sees only its access reports), ``colocated
asking`` (remembers none, so every get asks the server for handles and verifies
the frames) and ``http``. One window a row.

Memory: a fresh ``kvstore serve`` on the shm tier alone, filled by co-located
puts to each level; its resident set from ``/proc/<pid>/status`` at each
(``VmRSS``, split into anonymous, file and shared-memory pages). Stored KV
sits in the shm arena, which the server maps pre-faulted (``MAP_POPULATE``) at
its configured size, so ``RssShmem`` is the arena from the start and stays
flat; what grows with the data is ``RssAnon``, the server's own heap.

    python -m bench.scale worker URL NBYTES     one client process (what ``throughput`` spawns)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable

from bench.serving import json_workers

__all__ = ["throughput", "memory"]

MiB = 1 << 20
NAMESPACE = "bench-scale"
REPLY_TIMEOUT_S = 300.0
"""A worker's start (16 of them importing torch on two cores) or window answers well within this."""


def _fixed(tokens: int) -> list[int]:
    return list(range(2_000_000, 2_000_000 + tokens))


# -- throughput ------------------------------------------------------------------------------


def throughput(url: str, nbytes: int, *, clients: tuple[int, ...], duration_s: float,
               media: tuple[str, ...] = ("colocated", "colocated asking", "http"),
               tick: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Pooled ``get_kv`` throughput and latency for each client count and medium."""
    from bench.paths import spec_for
    from client_sdk import KVClient

    spec, tokens = spec_for(nbytes)
    import torch

    kv = torch.randn(spec.kv_shape(tokens), generator=torch.Generator().manual_seed(5)).half()
    rows = []
    with KVClient(url, namespace=NAMESPACE, colocated=False, plan=False) as putter:
        putter.put_kv(spec, _fixed(tokens), kv)
        tick(f"starting {max(clients)} client processes")
        argvs = [["-m", "bench.scale", "worker", url, str(nbytes)]] * max(clients)
        with json_workers(argvs, "a scale worker", REPLY_TIMEOUT_S) as workers:
            for medium in media:
                for n in clients:
                    start_at = time.time() + 0.5
                    for w in workers[:n]:
                        w.send(cmd="run", medium=medium, start_at=start_at, duration_s=duration_s)
                    latencies: list[float] = []
                    rate = 0.0  # gets/s, each worker's over the time its gets took
                    for w in workers[:n]:
                        got = w.reply()
                        latencies.extend(got["latencies"])
                        rate += len(got["latencies"]) / got["elapsed_s"]
                    latencies.sort()
                    rows.append({
                        "medium": medium, "clients": n, "gets": len(latencies),
                        "gbps": rate * nbytes / 1e9, "gets_per_s": rate,
                        "p50_ms": 1e3 * statistics.median(latencies),
                        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                    })
                    tick(f"{medium} x{n}: {rows[-1]['gets_per_s']:.0f} gets/s")
        putter.delete(spec, _fixed(tokens))
    return {"bytes": nbytes, "duration_s": duration_s, "rows": rows}


def _worker(url: str, nbytes: int) -> None:
    """Answer ``run`` commands with the latency of every get in the window."""
    import torch

    from bench.paths import remember_no_handles, spec_for
    from client_sdk import KVClient

    torch.set_num_threads(1)
    spec, tokens = spec_for(nbytes)
    clients = {"colocated": KVClient(url, namespace=NAMESPACE, plan=False),
               "colocated asking": KVClient(url, namespace=NAMESPACE, plan=False),
               "http": KVClient(url, namespace=NAMESPACE, colocated=False, plan=False)}
    fixed = _fixed(tokens)
    for client in clients.values():
        for _ in range(3):
            client.get_kv(spec, fixed)
    remember_no_handles(clients["colocated asking"])  # every get asks the server
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "close":
            break
        client = clients[cmd["medium"]]
        time.sleep(max(0.0, cmd["start_at"] - time.time()))
        start = t1 = time.perf_counter()
        end = start + cmd["duration_s"]
        latencies = []
        while t1 < end:
            t0 = t1
            _, n = client.get_kv(spec, fixed)
            t1 = time.perf_counter()
            latencies.append(t1 - t0)
            if n != tokens:
                raise AssertionError(f"get returned {n} of {tokens} tokens")
        # the last get ends after the window: the rate is over the time the gets took
        print(json.dumps({"latencies": latencies, "elapsed_s": t1 - start}), flush=True)
    for client in clients.values():
        client.close()


# -- memory ----------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    """The resident-set lines of ``/proc/<pid>/status``, bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                fields[name] = int(value.split()[0]) * 1024
    return fields


def memory(levels: tuple[int, ...], *, chunk: int = 32 * MiB,
           tick: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The server's resident set at each stored level (bytes of KV put)."""
    import torch

    from bench.paths import spec_for
    from bench.serving import kvstore_server
    from client_sdk import KVClient

    chunk = min(chunk, max(levels) or chunk)
    spec, tokens = spec_for(chunk)
    kv = torch.randn(spec.kv_shape(tokens), generator=torch.Generator().manual_seed(6)).half()
    arena = max(levels) + max(levels) // 8 + 64 * MiB
    rows = []
    with kvstore_server("memory", KVSTORE_TIERS="shm", KVSTORE_SHM_BYTES=str(arena)) as (url, proc), \
            KVClient(url, namespace=NAMESPACE, plan=False) as client:
        stored, seq = 0, 0
        for level in sorted(levels):
            while stored + chunk <= level:
                seq += 1
                n = client.put_kv(spec, [seq * 1_000_000 + i for i in range(tokens)], kv)
                if n != tokens:
                    raise AssertionError(f"put stored {n} of {tokens} tokens")
                stored += chunk
            time.sleep(0.2)  # the server's write-behind and stats settle
            rss = _status(proc.pid)
            rows.append({"stored_bytes": stored, **{k.lower(): v for k, v in rss.items()},
                         "overhead_bytes": rss["VmRSS"] - rss.get("RssShmem", 0)})
            tick(f"{stored / MiB:.0f} MiB stored: RSS {rss['VmRSS'] / MiB:.0f} MiB")
    return {"arena_bytes": arena, "chunk_bytes": chunk, "rows": rows}


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m bench.scale worker URL NBYTES")
    _worker(sys.argv[2], int(sys.argv[3]))
