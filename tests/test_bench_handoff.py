"""Agent B of ``bench.handoff`` against a real ``kvstore serve``: it answers, fails loudly, exits cleanly."""

from __future__ import annotations

import time

import pytest

from bench.handoff import AgentB, digest
from bench.paths import spec_for
from bench.serving import kvstore_serve

NBYTES = 64 << 10
NAMESPACE = "bench-handoff"
WARM, FRESH = 1_000_000, 2_000_000


@pytest.fixture(scope="module")
def stored():
    import torch

    from client_sdk import KVClient

    spec, tokens = spec_for(NBYTES)
    kv = torch.randn(spec.kv_shape(tokens), generator=torch.Generator().manual_seed(0)).half()
    with kvstore_serve("handoff", KVSTORE_TIERS="shm") as url, \
            KVClient(url, namespace=NAMESPACE, plan=False) as client:
        client.put_kv(spec, range(WARM, WARM + tokens), kv)
        yield url, client, spec, tokens, kv


def test_agent_b_gets_what_a_just_put_once(stored) -> None:
    url, client, spec, tokens, kv = stored
    agent = AgentB(url, spec, tokens, namespace=NAMESPACE, warm_base=WARM)
    try:
        start = time.perf_counter()
        client.put_kv(spec, range(FRESH, FRESH + tokens), kv)
        end, hashed = agent.get(FRESH, check=True)
        assert start < end < time.perf_counter()  # one clock for both processes
        assert hashed == digest(kv)
        client.put_kv(spec, range(FRESH + 1000, FRESH + 1000 + tokens), kv)
        assert agent.get(FRESH + 1000)[1] is None  # no digest unless asked
        with pytest.raises(RuntimeError, match="served from remembered slots"):
            agent.get(FRESH)  # a second get of a sequence is no hand-off: B remembers its slots
    finally:
        agent.close()
        for first in (FRESH, FRESH + 1000):
            client.delete(spec, range(first, first + tokens))
    assert agent.proc.returncode == 1


def test_agent_b_answers_and_exits_cleanly(stored) -> None:
    url, _, spec, tokens, _ = stored
    agent = AgentB(url, spec, tokens, namespace=NAMESPACE, warm_base=WARM)
    sent = time.perf_counter()
    there, back = agent.ping()
    assert sent < there < back
    agent.close()
    assert agent.proc.returncode == 0


def test_a_failure_in_agent_b_surfaces_and_ends_it(stored) -> None:
    url, _, spec, tokens, _ = stored
    agent = AgentB(url, spec, tokens, namespace=NAMESPACE, warm_base=WARM)
    with pytest.raises(RuntimeError, match=r"agent B \(get\): AssertionError: .* returned 0 of"):
        agent.get(FRESH + 100_000)  # never put: a miss is an error, not a time
    agent.close()  # the failure was raised once; closing does not raise it again
    assert agent.proc.returncode not in (None, 0)


def test_agent_b_that_cannot_start_says_why(stored) -> None:
    url, _, spec, tokens, _ = stored
    with pytest.raises(RuntimeError, match=r"agent B \(start\): .*not stored"):
        AgentB(url, spec, tokens, namespace=NAMESPACE, warm_base=WARM + 500_000)
