"""The rows of ``kvstore bench all`` and what each is held to: the physical limit and the peers.

Both the run (``bench.all``) and its page (``bench.page``) read them, so they live apart
from either.
"""

__all__ = ["LIMIT_OF", "PEER_OF", "LATENCY_ROWS"]

LIMIT_OF = {
    "colocated put": "limit memcpy", "colocated get": "limit memcpy", "colocated get out=": "limit memcpy",
    "colocated get, asking": "limit memcpy", "colocated get, asking, 64 KiB blocks": "limit memcpy",
    "colocated put, nowait": "limit memcpy", "handoff": "limit memcpy",
    "http put": "limit tcp put", "http get": "limit tcp get", "http get out=": "limit tcp get",
    "flight put": "limit tcp put", "flight get": "limit tcp get", "flight get out=": "limit tcp get",
    "redis tier put": "limit tcp put", "redis tier get": "limit tcp get",
    "nvme tier put": "limit file put", "nvme tier get": "limit file get",
}
"""Each kvstore row and the physical limit it is a ratio to."""

PEER_OF = {
    "redis tier put": ("redis-py put", "lmcache redis put"), "redis tier get": ("redis-py get", "lmcache redis get"),
    "colocated put": ("lmcache local_cpu put", "pickle put"), "colocated get": ("pickle get",),
    "colocated get out=": ("lmcache local_cpu get",),
    "http put": ("lmcache lm:// put", "pickle put"), "http get": ("lmcache lm:// get", "pickle get"),
    "http get out=": ("lmcache lm:// get",),
    "flight put": ("lmcache lm:// put", "pickle put"), "flight get": ("lmcache lm:// get", "pickle get"),
    "flight get out=": ("lmcache lm:// get",),
}
"""Each kvstore row and the peers it is a ratio to (where they ran). LMCache's gets copy into
one output tensor reused across gets (``bench/lmcache_driver.py``), so their like is ``get out=``;
the fresh-tensor rows are held to them too, and to the pickle service, which makes a new tensor."""

LATENCY_ROWS = ("handoff",)
"""Rows whose tail matters as much as their median (an agent waits on each one): the tables
show their p50 and p99 time, and each as a multiple of their limit's p50 time."""
