"""examples/router.py against two real ``kvstore serve`` processes: it routes by their KV events."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from tests.conftest import make_kv, make_spec
from tests.conftest import wait_until

_PATH = Path(__file__).resolve().parents[1] / "examples" / "router.py"
_spec = importlib.util.spec_from_file_location("router_example", _PATH)
router_example = importlib.util.module_from_spec(_spec)
sys.modules["router_example"] = router_example  # dataclasses look their module up by name
_spec.loader.exec_module(router_example)

NS = "chat"
CONV_TOKENS = 160  # 10 blocks of 16


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    procs = [ServeProcess(small_env(root / f"node{i}")).start() for i in range(2)]
    clients = [KVClient(p.url, namespace=NS) for p in procs]
    yield procs, clients
    for c in clients:
        c.close()
    for p in procs:
        p.stop()


def _until(predicate, timeout_s: float = 15.0, what: str = "the condition"):
    return wait_until(predicate, timeout_s, what)


def test_routes_to_the_longest_prefix_and_follows_deletes(nodes):
    procs, (a, b) = nodes
    spec = make_spec()
    rng = random.Random(24)
    convs = [[rng.randrange(50_000) for _ in range(CONV_TOKENS)] for _ in range(40)]
    kv, kv64 = make_kv(spec, CONV_TOKENS), make_kv(spec, 64)
    # kind 0: only on A; 1: only on B; 2: 64 tokens on A, all on B; 3: on neither
    for i, conv in enumerate(convs):
        if i % 4 in (0, 2):
            a.put_kv(spec, conv[:64] if i % 4 == 2 else conv, kv64 if i % 4 == 2 else kv)
        if i % 4 in (1, 2):
            b.put_kv(spec, conv, kv)

    with router_example.Router([procs[0].url, procs[1].url]) as router:
        assert router.catch_up()
        right, tied_to = 0, set()
        for j in range(120):
            conv = convs[j % len(convs)]
            tokens = conv[:rng.randrange(16, CONV_TOKENS + 1)] + [rng.randrange(50_000) for _ in range(rng.randrange(40))]
            route = router.route(spec, tokens, NS)
            router.done(route)
            truth = {procs[0].url: a.lookup(spec, tokens), procs[1].url: b.lookup(spec, tokens)}
            right += truth[route.node] == max(truth.values())
            assert route.tokens_by_node == truth  # the view is exact once caught up
            if max(truth.values()) == 0:
                tied_to.add(route.node)
        assert right / 120 >= 0.95
        assert tied_to == {procs[0].url, procs[1].url}, "requests no node holds are spread over both"

        # A delete on B: its longer copy is gone, so the request goes to A's shorter one.
        conv = convs[2]
        assert router.route(spec, conv, NS).node == procs[1].url
        assert b.delete(spec, conv) == 10
        moved = _until(lambda: (r := router.route(spec, conv, NS)).node == procs[0].url and r,
                       what="routing the deleted conversation away from B")
        assert moved.tokens_by_node == {procs[0].url: 64, procs[1].url: 0}


def test_a_restarted_node_is_resynchronised(nodes, tmp_path):
    procs, (a, _) = nodes
    spec = make_spec(model_id="router-restart")
    conv = list(range(1000, 1000 + CONV_TOKENS))
    with router_example.Router([procs[0].url, procs[1].url]) as router:
        a.put_kv(spec, conv, make_kv(spec, CONV_TOKENS))
        _until(lambda: router.route(spec, conv, NS).tokens_by_node[procs[0].url] == CONV_TOKENS,
               what="the put's events reaching the router")
        view = router.nodes[0]
        epoch = view.last_id.split(":")[0]
        procs[0].stop()  # a new process: a new event epoch, so the router's resume id is stale
        procs[0] = ServeProcess(procs[0].env, port=procs[0].port).start()
        _until(lambda: view.last_id and view.last_id.split(":")[0] != epoch, what="the router's resync")
        assert router.catch_up()
        truth = KVClient(procs[0].url, namespace=NS).lookup(spec, conv)  # what recovery kept
        assert router.route(spec, conv, NS).tokens_by_node[procs[0].url] == truth
        assert view.resyncs >= 2
