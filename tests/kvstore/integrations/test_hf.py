"""Resume generation from stored KV: a random Llama's prefix KV is put by one process and fetched
by another; the next-token logits match a full recompute (raw) and greedy decoding mostly agrees (int8)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

from client_sdk import KVClient  # noqa: E402
from kvstore import KVStore  # noqa: E402
from kvstore.errors import InvalidKV  # noqa: E402
from kvstore.errors import InvalidSpec  # noqa: E402
from kvstore.integrations.hf import (  # noqa: E402
    cache_from_kv, cache_kwargs, kv_from_cache, measure_prefill_rate, out_cache, spec_for)
from kvstore.planner import RECOMPUTE, Option, Planner  # noqa: E402
from kvstore.policy import Policy  # noqa: E402
from server import ServerSettings, create_app  # noqa: E402
from tests.server.live import ThreadServer  # noqa: E402
from tiers.memory import MemoryTier  # noqa: E402
from tiers.shm import ShmTier  # noqa: E402

PREFIX = 128


def build():
    """A random Llama (seeded: every process builds the same weights), its weights digest, a prompt."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    prompt = torch.randint(0, 512, (1, 129), generator=torch.Generator().manual_seed(1))
    return model, digest.hexdigest(), prompt


PUT = textwrap.dedent("""
    import json, sys, torch
    from client_sdk import KVClient
    from kvstore.integrations.hf import kv_from_cache, out_cache, spec_for
    from tests.kvstore.integrations.test_hf import build
    model, digest, prompt = build()
    spec = spec_for(model, fingerprint=digest[:16])
    with torch.no_grad():
        kv = kv_from_cache(out_cache(model(prompt[:, :128], use_cache=True)), spec)
    stored = []
    for url in sys.argv[1:]:
        with KVClient(url, namespace="agents") as c:
            stored.append(c.put_kv(spec, prompt[0, :128], kv))
    print(json.dumps({"digest": digest, "stored": stored}))
""")


@pytest.fixture(scope="module")
def servers():
    raw = ThreadServer(create_app(KVStore([ShmTier(64 << 20), MemoryTier(64 << 20)], background=False),
                                  ServerSettings(staging_bytes="32MiB"))).start()
    int8 = ThreadServer(create_app(KVStore([MemoryTier(64 << 20)], codec="int8", background=False),
                                   ServerSettings(colocated=False))).start()
    yield raw, int8
    raw.stop()
    int8.stop()


@pytest.fixture(scope="module")
def written(servers):
    """A child process builds the model, prefills 128 tokens and puts the KV to both servers."""
    root = str(pathlib.Path(__file__).resolve().parents[3])  # the checkout
    res = subprocess.run([sys.executable, "-c", PUT, servers[0].url, servers[1].url], capture_output=True,
                         text=True, timeout=300, cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _greedy(model, cache, first: torch.Tensor, steps: int) -> list[int]:
    out, token = [], first
    with torch.no_grad():
        for _ in range(steps):
            logits = model(token, **cache_kwargs(model, cache)).logits[0, -1]
            token = logits.argmax().view(1, 1)
            out.append(int(token))
    return out


def test_resume_from_raw_kv_matches_a_full_recompute(servers, written):
    model, digest, prompt = build()
    assert written == {"digest": digest, "stored": [PREFIX, PREFIX]}
    spec = spec_for(model, fingerprint=digest[:16])
    with KVClient(servers[0].url, namespace="agents", plan=False) as c:  # the shm path itself, not a plan
        kv, n = c.get_kv(spec, prompt[0])  # the whole prompt: the stored prefix comes back
        assert c.stats.last_medium == "shm"
    assert n == PREFIX
    with torch.no_grad():
        full = model(prompt).logits[0, -1]
        resumed = model(prompt[:, n:], **cache_kwargs(model, cache_from_kv(kv, model.config))).logits[0, -1]
    assert (full - resumed).abs().max().item() <= 1e-4
    with KVClient(servers[0].url, namespace="agents", colocated=False) as remote:
        kv_http, _ = remote.get_kv(spec, prompt[0])
    assert torch.equal(kv_http, kv)


def test_resume_from_int8_kv_decodes_nearly_the_same_tokens(servers, written):
    model, digest, prompt = build()
    spec = spec_for(model, fingerprint=digest[:16])
    with KVClient(servers[1].url, namespace="agents") as c:
        kv, n = c.get_kv(spec, prompt[0])
    assert n == PREFIX
    with torch.no_grad():
        exact = kv_from_cache(out_cache(model(prompt[:, :PREFIX], use_cache=True)))
    err = ((kv - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.02  # it really is int8, and close
    first = prompt[:, PREFIX:]
    reference = _greedy(model, cache_from_kv(exact, model.config), first, 16)
    resumed = _greedy(model, cache_from_kv(kv, model.config), first, 16)
    assert sum(a == b for a, b in zip(reference, resumed)) >= 15, (reference, resumed)


def test_cache_conversion_checks_its_input():
    model, digest, prompt = build()
    spec = spec_for(model, fingerprint="x")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (4, 2, 64, "float32")
    with torch.no_grad():
        cache = out_cache(model(prompt[:, :16].repeat(2, 1), use_cache=True))
    with pytest.raises(InvalidKV, match="batch=1"):
        kv_from_cache(cache)
    with pytest.raises(InvalidKV, match="num_layers, 2"):
        cache_from_kv(torch.zeros(4, 3, 2, 16, 64))
    legacy = tuple((torch.zeros(1, 2, 5, 64), torch.ones(1, 2, 5, 64)) for _ in range(4))
    kv = kv_from_cache(legacy, spec)
    assert kv.shape == (4, 2, 2, 5, 64) and kv[:, 1].eq(1).all() and kv[:, 0].eq(0).all()
    assert hashlib.sha256(kv.numpy().tobytes()).hexdigest() == hashlib.sha256(
        kv_from_cache(cache_from_kv(kv)).numpy().tobytes()).hexdigest()


def test_measured_prefill_rate_feeds_the_planners_recompute_cost():
    model, digest, _ = build()
    rate = measure_prefill_rate(model, 64, repeats=1)
    assert 0 < rate < float("inf")
    spec = spec_for(model, fingerprint=digest[:16])
    planner = Planner()
    planner.model.set_prefill_rate(spec.fingerprint(), rate)
    assert planner.model.recompute_s(spec.fingerprint(), 64) == pytest.approx(64 / rate)
    # A fetch predicted slower than that prefill is answered "recompute".
    policy = Policy(media=("http",), explore_after_s=86400.0)
    planner.model.observe("get", "http", 0, 0.001, policy)
    planner.model.observe("get", "http", 1 << 20, 1000 * 64 / rate, policy)
    d = planner.decide("get", [Option("http")], nbytes=1 << 20, tokens=64,
                       policy=policy, fingerprint=spec.fingerprint())
    assert d.choice == RECOMPUTE
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidSpec, match="tokens"):
            measure_prefill_rate(model, bad)


class _Paced(torch.nn.Module):
    """A "model" whose forward takes at least 20 ms: the rate it measures is bounded above."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"vocab_size": 100})()
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import time

        self.calls += 1
        time.sleep(0.02)
        return ids


def test_prefill_rate_is_tokens_over_the_best_timed_run():
    paced = _Paced()
    rate = measure_prefill_rate(paced, 200, repeats=3)
    assert paced.calls == 4  # one untimed, three timed
    assert 200 / 0.2 < rate <= 200 / 0.02  # at most 200 tokens per 20 ms; sleep overshoots far less than 10x
    bare = _Paced()
    del bare.w
    with pytest.raises(InvalidSpec, match="no parameters"):
        measure_prefill_rate(bare, 8)
