"""Python function calls per SDK ``put_kv`` and ``get_kv``: the per-call work on the hot path.

A client co-located with a ``kvstore serve`` (the shm path) stores and reads a 1 MiB
sequence (8 tokens of 32 layers, 8 KV heads, head_dim 128, fp16) under ``cProfile``;
the figure is the profiler's total calls divided by the operations, in the client
process only (the server is another process). Each put stores a sequence not stored
before; each get reads the sequence its put stored. With the planner on (``plan=True``,
the default) and off. A count does not depend on the machine's speed, so figures from
two commits compare directly: a refactor should not make them grow.

    python -m bench.calls [--ops N]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats

import torch

from bench.serving import kvstore_serve

__all__ = ["run"]


def _calls(fn, ops: int) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(ops):
        fn(i)
    prof.disable()
    return pstats.Stats(prof).total_calls / ops


def run(ops: int = 50) -> dict[str, dict[str, float]]:
    """``{"planner on"|"planner off": {"put_kv": calls, "get_kv": calls}}``, per operation."""
    from client_sdk import KVClient
    from kvstore.spec import KVSpec

    spec = KVSpec("bench-calls", 32, 8, 128, "float16", 8, fingerprint="bench-1")
    kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, 8, spec.head_dim).to(torch.float16)
    out: dict[str, dict[str, float]] = {}
    with kvstore_serve("calls") as url:
        for plan, base in ((True, 1_000_000), (False, 2_000_000)):
            with KVClient(url, plan=plan) as client:
                def put(i: int, base: int = base) -> None:
                    client.put_kv(spec, list(range(base + 8 * i, base + 8 * i + 8)), kv)

                def get(i: int, base: int = base) -> None:
                    assert client.get_kv(spec, list(range(base + 8 * i, base + 8 * i + 8)))[1] == 8

                for i in range(ops, ops + 20):  # warm up: arena mapped, planner estimates settled
                    put(i)
                    get(i)
                out["planner on" if plan else "planner off"] = {"put_kv": round(_calls(put, ops), 1),
                                                                "get_kv": round(_calls(get, ops), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=50, help="profiled puts and gets per row (default 50)")
    print(json.dumps(run(parser.parse_args().ops), indent=1))


if __name__ == "__main__":
    main()
