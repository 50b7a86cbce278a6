"""Learned hand-offs through the real server: the SDK names its agent (``x-kv-agent``), the
server sees a chain written by one agent read by another, and then holds each new put of that
namespace for the next agent; the planner policy's ``prefetch`` flag (a canary like any policy)
decides whether it may."""

from __future__ import annotations


import httpx
import pytest

from client_sdk import KVClient
from kvstore.errors import InvalidInput
from kvstore.keys import block_hashes
from tests.conftest import make_kv
from tests.conftest import wait_until as _until


def _prefetches(srv) -> list[dict]:
    return httpx.get(f"{srv.url}/admin/prefetches", timeout=10).json()["prefetches"]


@pytest.mark.parametrize("colocated", [True, False], ids=["shm", "http"])
def test_two_handoffs_teach_the_server_to_hold_the_next_put(server, spec, colocated):
    ctx = list(range(48))
    with KVClient(server.url, namespace="team", agent="planner", colocated=colocated) as planner, \
            KVClient(server.url, namespace="team", agent="coder", colocated=colocated) as coder:
        assert planner.agent == "planner"
        for i in range(2):
            toks = ctx + list(range(1000 * (i + 1), 1000 * (i + 1) + 16))
            planner.put_kv(spec, toks, make_kv(spec, len(toks), seed=i))
            kv, n = coder.get_kv(spec, toks)
            assert n == len(toks)
        _until(lambda: server.store.locality.handoffs.describe().get("team", {}).get("handoffs") == 2)
        nxt = ctx + list(range(5000, 5016))
        planner.put_kv(spec, nxt, make_kv(spec, len(nxt), seed=9))
        _until(lambda: any(p["trigger"] == "hand-off" for p in _prefetches(server)))
        record = [p for p in _prefetches(server) if p["trigger"] == "hand-off"][-1]
        assert record["namespace"] == "team" and record["held"] == 4 and "2 hand-offs" in record["reason"]
        logged = httpx.get(f"{server.url}/admin/decisions", params={"op": "prefetch"}, timeout=10).json()
        assert logged["decisions"][-1]["choice"] == "hand-off" and logged["decisions"][-1]["reason"]
        last = block_hashes(spec, nxt, "team")[-1]
        assert server.store.placement.retention(last)["owner"] == "_prefetch"
        assert server.store.explain(last)["retained"]["owner"] == "_prefetch"


def test_the_same_agent_reading_back_teaches_nothing(server, spec):
    with KVClient(server.url, namespace="solo", agent="me") as me:
        for i in range(3):
            toks = list(range(100 * i, 100 * i + 32))
            me.put_kv(spec, toks, make_kv(spec, 32))
            me.get_kv(spec, toks)
        assert "solo" not in server.store.locality.handoffs.describe()
        assert _prefetches(server) == []


def test_a_candidate_policy_without_prefetch_stops_it_and_rollback_restores_it(server, spec):
    ctx = list(range(32))
    with KVClient(server.url, namespace="team", agent="planner") as planner, \
            KVClient(server.url, namespace="team", agent="coder") as coder:
        for i in range(2):
            toks = ctx + list(range(1000 * (i + 1), 1000 * (i + 1) + 16))
            planner.put_kv(spec, toks, make_kv(spec, len(toks)))
            coder.get_kv(spec, toks)
        # co-located reads need no request: the server learns of them from the coder's report
        _until(lambda: server.store.locality.handoffs.describe().get("team", {}).get("handoffs") == 2)
        resp = httpx.post(f"{server.url}/admin/policy", json={
            "action": "candidate", "policy": {"version": 2, "prefetch": False}, "fraction": 1.0}, timeout=10)
        assert resp.status_code == 200, resp.text
        planner.put_kv(spec, ctx + list(range(7000, 7016)), make_kv(spec, 48))
        assert server.store.prefetcher.idle() and _prefetches(server) == []
        assert httpx.post(f"{server.url}/admin/policy", json={"action": "rollback"}, timeout=10).status_code == 200
        planner.put_kv(spec, ctx + list(range(8000, 8016)), make_kv(spec, 48))
        _until(lambda: len(_prefetches(server)) == 1)
        assert _prefetches(server)[0]["policy_version"] == 1


def test_bad_agent_names(server):
    with pytest.raises(InvalidInput, match="agent"):
        KVClient(server.url, agent="x" * 129)
    with pytest.raises(InvalidInput, match="agent"):
        KVClient(server.url, agent="tab\there")
    # the server ignores an unusable header instead of refusing the call
    resp = httpx.post(f"{server.url}/v1/lookup", headers={"x-kv-agent": "a" * 300},
                      json={"spec": {"model_id": "m", "fingerprint": "w", "num_layers": 1, "num_kv_heads": 1,
                                     "head_dim": 8, "dtype": "float16"}, "tokens": [1, 2]}, timeout=10)
    assert resp.status_code == 200, resp.text
