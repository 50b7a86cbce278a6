"""Many clients on a full store: 1 and 8 client processes putting and getting at once.

Part of ``kvstore bench steady``: after the single-client rows, worker processes (one torch
thread each, started once) run against the bench's full store (top tier at its high watermark,
``KVSTORE_FULL_TOP_TIER=spill``) for the same wall-clock window, started at one instant:

- ``put``: fresh 1 MiB sequences (16 blocks of 64 KiB) in a loop;
- ``get``: the worker's own 1 MiB sequence, put once before the windows, in a loop.

Per row (op x medium x clients): aggregate ops/s (each worker's count over the time its ops
took, summed), p50 and p99 latency pooled over the workers. Ratios: 8 clients' aggregate over
one client's (issue 34's target >= 1.5x) and, for puts, p99 / p50 at 8 clients (<= 3x).

    python -m bench.steady_clients worker URL WORKER     one client process (what ``run_clients`` spawns)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from bench.serving import json_workers

__all__ = ["run_clients", "format_clients", "CLIENTS"]

CLIENTS = (1, 8)
MEDIA = ("co-located", "HTTP")
TOKENS = 256  # 1 MiB of the 64 KiB-block spec


def _sequence(worker: int, i: int) -> list[int]:
    return [500_000_000 + worker * 10_000_000 + i] + [11] * (TOKENS - 1)


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used; 0.0 without a pid or /proc."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_clients(url: str, *, window_s: float, clients: tuple[int, ...] = CLIENTS, server_pid: int | None = None) -> dict:
    """Rows of pooled throughput and latency for each op, medium and client count against ``url``;
    with ``server_pid``, the server's CPU time per op and the cores it kept busy (its own threads
    included: the scrubber, the mover, the re-encoder), what docs/design.md's scaling model uses."""
    rows = []
    argvs = [["-m", "bench.steady_clients", "worker", url, str(w)] for w in range(max(clients))]
    with json_workers(argvs, "a steady client") as workers:
        for op in ("put", "get"):
            for medium in MEDIA:
                for n in clients:
                    start_at = time.time() + 0.5
                    cpu0 = _cpu_s(server_pid)
                    for w in workers[:n]:
                        w.send(cmd=op, medium=medium, start_at=start_at, window_s=window_s)
                    latencies: list[float] = []
                    rate = 0.0
                    for w in workers[:n]:
                        got = w.reply()
                        latencies.extend(got["latencies"])
                        rate += len(got["latencies"]) / got["elapsed_s"]
                    cpu = _cpu_s(server_pid) - cpu0
                    latencies.sort()
                    rows.append({"op": op, "medium": medium, "clients": n, "ops": len(latencies),
                                 "ops_per_s": rate, "p50_ms": 1e3 * statistics.median(latencies),
                                 "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                                 **({"server_cpu_ms_per_op": 1e3 * cpu / len(latencies),
                                     "server_cores": cpu / window_s} if server_pid else {})})
    by = {(r["op"], r["medium"], r["clients"]): r for r in rows}
    lo, hi = min(clients), max(clients)
    ratios = {f"{op} {medium}": {"aggregate": by[op, medium, hi]["ops_per_s"] / by[op, medium, lo]["ops_per_s"],
                                 "p99 / p50": by[op, medium, hi]["p99_ms"] / by[op, medium, hi]["p50_ms"]}
              for op in ("put", "get") for medium in MEDIA}
    return {"window_s": window_s, "clients": list(clients), "rows": rows, "ratios": ratios}


def format_clients(result: dict) -> list[str]:
    lo, hi = min(result["clients"]), max(result["clients"])
    lines = ["", f"many clients on the full store: 1 MiB of 64 KiB blocks, {result['window_s']:g} s windows",
             f"{'op':<5}{'medium':<12}{'clients':>8}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'server CPU ms/op':>18}{'server cores':>14}"]
    for r in result["rows"]:
        lines.append(f"{r['op']:<5}{r['medium']:<12}{r['clients']:>8}{r['ops_per_s']:>9.0f}"
                     f"{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}{r.get('server_cpu_ms_per_op', 0):>18.2f}"
                     f"{r.get('server_cores', 0):>14.2f}")
    for name, ratio in result["ratios"].items():
        lines.append(f"{name}: {hi} clients / {lo} aggregate {ratio['aggregate']:.2f}x (target >= 1.5x); "
                     f"p99 / p50 at {hi} {ratio['p99 / p50']:.1f}x" + (" (target <= 3x)" if name.startswith("put") else ""))
    return lines


def _worker(url: str, worker: int) -> None:
    """Answer ``put`` and ``get`` commands with every op's latency in the window."""
    import torch

    from bench.steady_specs import block_spec
    from client_sdk import KVClient

    torch.set_num_threads(1)
    spec = block_spec("64 KiB")
    kv = torch.randn(spec.kv_shape(TOKENS), generator=torch.Generator().manual_seed(worker)).to(spec.torch_dtype)
    # One agent a worker, as an engine is one: two agent ids in one worker (a client per medium)
    # made its reads of its own sequence look like hand-offs, and the server learned to prefetch
    # every chain the worker put (thousands of promotions and demotions in a window).
    clients = {medium: KVClient(url, namespace="steady-clients", colocated=medium == "co-located", plan=False,
                                agent=f"steady-client-{worker}") for medium in MEDIA}
    mine = _sequence(worker, 0)
    clients["co-located"].put_kv(spec, mine, kv)
    for client in clients.values():
        client.get_kv(spec, mine)
    print(json.dumps({"ready": True}), flush=True)
    i = 1
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "close":
            break
        client = clients[cmd["medium"]]
        time.sleep(max(0.0, cmd["start_at"] - time.time()))
        start = t1 = time.perf_counter()
        end = start + cmd["window_s"]
        latencies = []
        while t1 < end:
            t0 = t1
            if cmd["cmd"] == "put":
                i += 1
                client.put_kv(spec, _sequence(worker, i), kv)
            else:
                client.get_kv(spec, mine)
            t1 = time.perf_counter()
            latencies.append(t1 - t0)
        print(json.dumps({"latencies": latencies, "elapsed_s": t1 - start}), flush=True)
    for client in clients.values():
        client.close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit("usage: python -m bench.steady_clients worker URL WORKER")
    _worker(sys.argv[2], int(sys.argv[3]))
