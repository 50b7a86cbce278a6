"""A KV-aware router: send each request to the kvstore node that holds its longest stored prefix.

The router never asks a node what it holds at request time. Block keys are content addressed
(``kvstore.keys.block_hashes(spec, tokens, namespace)`` gives the key every node stores a block
under), so the router only needs each node's block set, and it keeps that current from the
node's KV events (``client_sdk.EventFollower`` does the following):

1. ``GET /v1/events/snapshot``: the node's blocks and the event id the copy is valid at;
2. ``GET /v1/events`` (Server-Sent Events) from that id (``Last-Event-ID``): ``stored`` and
   ``moved`` set a block's tier, ``removed`` drops it, ``cleared`` empties the set;
3. a ``lost`` marker (the router fell too far behind, or the node restarted) means: take a
   new snapshot and resume from it. A dropped connection resumes from the last id seen.

A request goes to the node with the most leading blocks of its prefix; ties (including "no
node has any") go to the node with the fewest requests in flight, then round robin.

    python examples/router.py                  # starts two private nodes and runs a short demo
    python examples/router.py URL [URL ...]    # follows running nodes, printing their block counts

``Router`` is what a test or a real router uses::

    with Router(["http://10.0.0.1:8470", "http://10.0.0.2:8470"]) as router:
        route = router.route(spec, tokens, namespace="chat")
        send_to(route.node)
        router.done(route)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from client_sdk.events import EventFollower, sse_messages  # noqa: E402
from kvstore.keys import block_hashes  # noqa: E402
from kvstore.spec import KVSpec  # noqa: E402

__all__ = ["NodeView", "Route", "Router", "sse_messages", "main"]

NodeView = EventFollower
"""One node's block set, followed from its events (``client_sdk.EventFollower``)."""


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and what every node holds of its prefix."""

    node: str
    """The chosen node's URL."""
    tokens: int
    """Tokens of the prefix stored on the chosen node."""
    tokens_by_node: dict[str, int]


class Router:
    """Routes requests to the node holding their longest stored prefix.

    Args:
        urls: the nodes' base URLs.
        token: the bearer token for every node's events (see ``client_sdk.EventFollower``).
    """

    def __init__(self, urls: Sequence[str], token: str | None = None) -> None:
        if not urls:
            raise ValueError("a router needs at least one node")
        self.nodes = [EventFollower(u, token) for u in urls]
        self._lock = threading.Lock()
        self._in_flight = {n.url: 0 for n in self.nodes}
        self._next = 0  # the round-robin cursor

    def start(self, timeout_s: float = 30.0) -> "Router":
        """Start following every node; returns once each has a snapshot.

        Raises:
            TimeoutError: a node gave no snapshot within ``timeout_s``.
        """
        for node in self.nodes:
            node.start(timeout_s=0)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if not node.wait_synced(max(0.0, deadline - time.monotonic())):
                self.close()
                raise TimeoutError(f"{node.url} gave no events snapshot within {timeout_s:g} s"
                                   f" (last error: {node.last_error!r})")
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> "Router":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def route(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> Route:
        """The node for a request: the longest stored prefix wins; ties go to the node with the
        fewest requests in flight (``done`` ends one), then round robin."""
        keys = block_hashes(spec, tokens, namespace)
        held = [node.prefix(keys) for node in self.nodes]
        best = max(held)
        with self._lock:
            tied = [i for i, n in enumerate(held) if n == best]
            least = min(self._in_flight[self.nodes[i].url] for i in tied)
            tied = [i for i in tied if self._in_flight[self.nodes[i].url] == least]
            pick = min(tied, key=lambda i: (i - self._next) % len(self.nodes))
            self._next = (pick + 1) % len(self.nodes)
            url = self.nodes[pick].url
            self._in_flight[url] += 1
        return Route(url, best * spec.block_tokens,
                     {node.url: n * spec.block_tokens for node, n in zip(self.nodes, held)})

    def done(self, route: Route) -> None:
        """The request ``route`` sent has finished."""
        with self._lock:
            self._in_flight[route.node] = max(0, self._in_flight[route.node] - 1)

    def catch_up(self, timeout_s: float = 10.0) -> bool:
        """Every node's view has applied what its node emitted until now (tests, demos)."""
        return all(node.catch_up(timeout_s) for node in self.nodes)


# -- the demo -------------------------------------------------------------------------------------


def _demo(urls: Sequence[str]) -> None:
    import torch

    from client_sdk import KVClient

    spec = KVSpec(model_id="router-demo", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16",
                  block_tokens=16, fingerprint="demo-weights-1")
    gen = torch.Generator().manual_seed(0)
    convs = {name: torch.randint(0, 32_000, (256,), generator=gen).tolist()
             for name in ("alpha", "beta", "gamma")}
    clients = [KVClient(u, namespace="chat") for u in urls]
    # alpha lives on the first node, beta on the second (and a shorter part of it on the first).
    clients[0].put_kv(spec, convs["alpha"], torch.zeros(spec.kv_shape(256), dtype=spec.torch_dtype))
    clients[1].put_kv(spec, convs["beta"], torch.zeros(spec.kv_shape(256), dtype=spec.torch_dtype))
    clients[0].put_kv(spec, convs["beta"][:64], torch.zeros(spec.kv_shape(64), dtype=spec.torch_dtype))
    with Router(urls) as router:
        router.catch_up()
        print(f"{'request':<28} {'routed to':<26} prefix tokens by node")
        for label, name, extra in (("alpha + 32 new tokens", "alpha", 32), ("beta + 16 new tokens", "beta", 16),
                                   ("gamma (stored nowhere)", "gamma", 0), ("gamma again", "gamma", 0)):
            tokens = convs[name] + list(range(extra))
            r = router.route(spec, tokens, "chat")
            router.done(r)
            print(f"{label:<28} {r.node:<26} {list(r.tokens_by_node.values())}")
        clients[1].delete(spec, convs["beta"])
        router.catch_up()
        r = router.route(spec, convs["beta"], "chat")
        print(f"{'beta after a delete on 2':<28} {r.node:<26} {list(r.tokens_by_node.values())}")
    for client in clients:
        client.close()


def _watch(urls: Sequence[str]) -> None:
    with Router(urls) as router:
        shown = None
        while True:
            now = [(n.url, len(n.blocks), n.resyncs) for n in router.nodes]
            if now != shown:
                print("  ".join(f"{url}: {blocks} blocks ({resyncs} snapshots)" for url, blocks, resyncs in now))
                shown = now
            time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="*", help="running nodes to follow (none: start two and run a demo)")
    args = parser.parse_args(argv)
    if args.urls:
        with contextlib.suppress(KeyboardInterrupt):
            _watch(args.urls)
        return 0
    import tempfile

    from bench.reliability_kit.serve_process import serving, small_env

    with tempfile.TemporaryDirectory() as tmp, \
            serving(small_env(Path(tmp) / "node1")) as one, serving(small_env(Path(tmp) / "node2")) as two:
        _demo([one.url, two.url])
    return 0


if __name__ == "__main__":
    sys.exit(main())
