"""The two block shapes of ``kvstore bench steady``: a small model's 64 KiB block and an 8B model's 2 MiB one.

Their own module: ``bench.steady`` and its client processes (``bench.steady_clients``) both use them.
"""

from __future__ import annotations

__all__ = ["block_spec"]


def block_spec(block: str):
    from kvstore.spec import KVSpec

    if block == "64 KiB":
        return KVSpec("bench-steady-small", num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16",
                      block_tokens=16, fingerprint="bench-steady-small")
    return KVSpec("bench-steady-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16",
                  block_tokens=16, fingerprint="bench-steady-8b")
