"""The vLLM connector's parts that need no vLLM: paged layouts, loads and saves against a real server,
the weights fingerprint, and the connector report route.

The paged caches live on ``$KVSTORE_TEST_DEVICE`` (default cpu): ``bench/gpu_check.py`` runs this
file on a lent GPU, so the layouts' copies between host and device are checked on CUDA too.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from client_sdk import KVClient
from kvstore.errors import ConnectionFailed
from kvstore.errors import InvalidKV, InvalidSpec
from kvstore.integrations import weights
from kvstore.integrations.vllm_layout import layout_for, runs
from kvstore.integrations.vllm_transfer import Counters, Load, LoadJob, Saver, SaveJob
from kvstore.integrations.weights import weights_fingerprint
from kvstore.spec import KVSpec
from tests.server.conftest import ACME, ADMIN, BETA

SPEC = KVSpec("paged", num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16,
              fingerprint="weights-1")
BS = SPEC.block_tokens
DEVICE = torch.device(os.environ.get("KVSTORE_TEST_DEVICE", "cpu"))


def cpu_caches(blocks: int = 12, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 2, BS, 16, generator=gen).to(DEVICE) for _ in range(SPEC.num_layers)]


def test_runs_groups_consecutive_block_ids():
    assert runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []


def test_the_cpu_layout_keeps_k_transposed_and_round_trips_exactly():
    caches = cpu_caches()
    layout = layout_for(caches, SPEC)
    assert layout.kind == "cpu"
    out = layout.gather([3, 4, 9], SPEC.empty_kv(3 * BS))
    block = caches[1][9, 0].cpu().reshape(-1)  # layer 1, block 9, head 0: K as [D, bs], then V as [bs, D]
    k_t, v = block[:8 * BS].view(8, BS), block[8 * BS:].view(BS, 8)
    assert torch.equal(out[1, 0, 0, 2 * BS:], k_t.t()) and torch.equal(out[1, 1, 0, 2 * BS:], v)
    target = [torch.zeros_like(c) for c in caches]
    copy = layout_for(target, SPEC)
    for layer in range(SPEC.num_layers):
        copy.write_layer(layer, out[layer], [7, 8, 0])
    for layer in range(SPEC.num_layers):
        for src, dst in ((3, 7), (4, 8), (9, 0)):
            assert torch.equal(target[layer][dst], caches[layer][src])
        assert not target[layer][5].any()  # nothing outside the named blocks


def test_the_flash_layout_round_trips():
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, 6, BS, 2, 8, generator=gen).to(DEVICE) for _ in range(SPEC.num_layers)]
    layout = layout_for(caches, SPEC)
    assert layout.kind == "nhd"
    out = layout.gather([5, 1], SPEC.empty_kv(2 * BS))
    assert torch.equal(out[2, 1, 1, :BS], caches[2][1, 5, :, 1].cpu())  # V of layer 2, head 1, block 5
    target = [torch.zeros_like(c) for c in caches]
    for layer in range(SPEC.num_layers):
        layout_for(target, SPEC).write_layer(layer, out[layer], [5, 1])
    assert all(torch.equal(t[:, [5, 1]], c[:, [5, 1]]) for t, c in zip(target, caches))


@pytest.mark.parametrize("caches, says", [
    ([torch.zeros(4, 2, BS, 16)] * 2, "2 attention layers"),
    ([torch.zeros(4, 2, BS, 16, dtype=torch.float16)] * 3, "float16"),
    ([torch.zeros(4, 2, 32, 16)] * 3, "no layout kvstore knows"),
    ([torch.zeros(4, 2, BS, 16)] * 2 + [torch.zeros(2, 4, BS, 2, 8)], "mix layouts"),
])
def test_layouts_that_do_not_fit_the_spec_are_refused(caches, says):
    with pytest.raises(InvalidKV, match=says):
        layout_for(caches, SPEC)


def stored(client: KVClient, tokens: list[int], caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    kv = layout_for(caches, SPEC).gather(block_ids, SPEC.empty_kv(len(block_ids) * BS))
    client.put_kv(SPEC, tokens, kv)
    return kv


@pytest.mark.parametrize("colocated, layerwise, threaded", [
    (False, None, True),  # HTTP: layer by layer on a thread (auto)
    (None, None, DEVICE.type != "cpu"),  # this host's shared memory into a CPU cache: at once (auto)
    (None, True, True), (False, False, False),
])
def test_a_load_fills_the_blocks_layer_by_layer(server, colocated, layerwise, threaded):
    client = KVClient(server.url, colocated=colocated, plan=False)
    tokens = list(range(4 * BS))
    source = cpu_caches(seed=2)
    stored(client, tokens, source, [0, 1, 2, 3])
    client.get_kv(SPEC, tokens)  # the medium is picked
    target = [torch.zeros_like(c) for c in source]
    counters = Counters()
    load = Load(client, SPEC, layout_for(target, SPEC), [LoadJob("r1", tokens, BS, [9, 10, 11])], counters,
                layerwise=layerwise)
    assert load.layerwise is threaded and client.stats.last_medium == ("http" if colocated is False else "shm")
    for layer in range(SPEC.num_layers):
        load.wait(layer)
    assert load.finish() == set()
    for layer in range(SPEC.num_layers):
        assert [torch.equal(target[layer][d], source[layer][s]) for s, d in ((1, 9), (2, 10), (3, 11))] == [True] * 3
        assert not target[layer][0].any()  # the locally computed block before ``start`` is not touched
    assert counters.snapshot()["loaded_tokens"] == 3 * BS and counters.snapshot()["load_errors"] == 0
    client.close()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="one-copy loads and saves are the CPU cache's path")
@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_a_co_located_load_copies_the_arena_straight_into_either_layout(server, kind):
    """One copy, arena -> paged blocks, exact for the CPU layout (K transposed) and FlashAttention's."""
    gen = torch.Generator().manual_seed(5)
    if kind == "cpu":
        source = cpu_caches(seed=5)
    else:
        source = [torch.randn(2, 12, BS, 2, 8, generator=gen) for _ in range(SPEC.num_layers)]
    tokens = list(range(4 * BS))
    with KVClient(server.url, plan=False) as client:
        client.put_kv(SPEC, tokens, layout_for(source, SPEC).gather([0, 1, 2, 3], SPEC.empty_kv(4 * BS)))
    with KVClient(server.url, plan=False) as client:
        target = [torch.zeros_like(c) for c in source]
        layout = layout_for(target, SPEC)
        assert layout.kind == kind
        counters = Counters()
        load = Load(client, SPEC, layout, [LoadJob("r1", tokens, BS, [9, 10, 11])], counters)
        assert load.one_copy and not load.layerwise
        assert load.finish() == set()
        pairs = ((1, 9), (2, 10), (3, 11))
        for t, s in zip(target, source):
            if kind == "cpu":
                assert all(torch.equal(t[d], s[src]) for src, d in pairs) and not t[0].any()
            else:
                assert all(torch.equal(t[:, d], s[:, src]) for src, d in pairs) and not t[:, 0].any()
        assert counters.snapshot()["loaded_tokens"] == 3 * BS and client.stats.http_gets == 0


def test_a_short_or_failed_load_names_the_blocks_vllm_must_recompute(server, client):
    tokens = list(range(4 * BS))
    source = cpu_caches(seed=3)
    stored(client, tokens[:2 * BS], source, [0, 1])  # the store holds 2 of the 4 blocks promised
    target = [torch.zeros_like(c) for c in source]
    counters = Counters()
    load = Load(client, SPEC, layout_for(target, SPEC), [LoadJob("short", tokens, 0, [4, 5, 6, 7])], counters)
    assert load.finish() == {6, 7} and not load.one_copy
    assert torch.equal(target[0][5], source[0][1])
    with KVClient(server.url, plan=False) as near:  # co-located: the one-copy path says the same
        target = [torch.zeros_like(c) for c in source]
        load = Load(near, SPEC, layout_for(target, SPEC), [LoadJob("short", tokens, 0, [4, 5, 6, 7])], counters)
        assert load.finish() == {6, 7} and load.one_copy is (DEVICE.type == "cpu")
        assert torch.equal(target[2][5], source[2][1])
    down = KVClient("http://127.0.0.1:9", retries=0, connect_timeout_s=0.5)
    load = Load(down, SPEC, layout_for(target, SPEC), [LoadJob("down", tokens, 0, [1, 2])], counters)
    for layer in range(SPEC.num_layers):  # never leaves the forward pass waiting
        load.wait(layer)
    assert load.finish() == {1, 2}
    assert counters.snapshot()["load_errors"] == 1 and counters.snapshot()["failed_blocks"] == 6
    # no tokens to load from (the connector's guard when vLLM asks for more than the lookup found)
    load = Load(client, SPEC, layout_for(target, SPEC), [LoadJob("none", [], 0, [3, 4])], counters)
    assert load.finish() == {3, 4}


@pytest.mark.parametrize("colocated", [False, None])
def test_a_save_puts_the_whole_prefix_then_only_the_missing_tail(server, colocated):
    """Over HTTP; and co-located, where vLLM's blocks go straight into the server's slots."""
    client = KVClient(server.url, colocated=colocated, plan=False)
    tokens = list(range(5 * BS))
    caches = cpu_caches(seed=4)
    counters = Counters()
    saver = Saver(client, SPEC, layout_for(caches, SPEC), counters)
    try:
        saver.submit(SaveJob("a", tokens[:2 * BS], [6, 2]))
        assert saver.wait_for("a", 10) and saver.pending("a") == 0
        # the first two blocks are stored: the tail only, and the stored blocks are not even read
        # (ids past the cache's end stand for them: reading one fails the save), as a chunked
        # prefill's saves, each planned from token 0, must not copy the whole prefix again
        saver.submit(SaveJob("a", tokens, [10_000, 10_001, 7, 8, 3]))
        saver.submit(SaveJob("b", tokens, [10_000, 10_001, 10_002, 10_003, 10_004]))  # all stored: nothing read
        assert saver.wait_for("a", 10) and saver.wait_for("b", 10)
    finally:
        saver.close()
    kv, n = client.get_kv(SPEC, tokens)
    assert n == 5 * BS
    assert torch.equal(kv, layout_for(caches, SPEC).gather([6, 2, 7, 8, 3], SPEC.empty_kv(5 * BS)))
    snap = counters.snapshot()
    assert snap["saves"] == 3 and snap["saved_tokens"] == 5 * BS and snap["save_errors"] == 0
    if colocated is None and DEVICE.type == "cpu":  # both puts of new blocks went into slots
        assert client.stats.shm_puts == 2 and client.stats.http_puts == 0
    client.close()


@pytest.mark.parametrize("colocated", [False, None])
def test_saved_blocks_are_named_by_vllms_hashes_when_the_server_publishes_events(server, colocated):
    """``name_blocks`` None asks ``/v1/info`` (this server publishes no KV events: nothing named);
    True names what each save stored, its first new block's parent included, on every path."""
    from kvstore.keys import block_hashes

    tokens = list(range(5 * BS))
    hashes = [bytes([0xD0 + i]) * 32 for i in range(5)]
    keys = block_hashes(SPEC, tokens, "default")
    with KVClient(server.url, colocated=colocated, plan=False) as client:
        asked = Saver(client, SPEC, layout_for(cpu_caches(), SPEC), Counters())
        try:
            asked.submit(SaveJob("a", tokens[:BS], [6], hashes=hashes[:1]))
            assert asked.wait_for("a", 10)
        finally:
            asked.close()
        assert asked.name_blocks is False and server.store.core.entry(keys[0]).engine_hash is None
        saver = Saver(client, SPEC, layout_for(cpu_caches(), SPEC), Counters(), name_blocks=True)
        try:
            saver.submit(SaveJob("a", tokens[:2 * BS], [6, 2], hashes=hashes[:2]))  # block 0 stored: 1 named, parent 0
            saver.submit(SaveJob("a", tokens, [6, 2, 7, 8, 3], hashes=hashes))  # the tail: 2-4, parent 1
            assert saver.wait_for("a", 10)
        finally:
            saver.close()
    assert [server.store.core.entry(k).engine_hash for k in keys] == [None, *hashes[1:]]
    named = [e for e in server.store.events.read(0, 10_000)[0] if e.reason == "named"]
    assert [(e.engine_hash, e.engine_parent) for e in named] == list(zip(hashes[1:], hashes[:-1]))


def test_a_failed_save_is_counted_and_releases_its_blocks():
    down = KVClient("http://127.0.0.1:9", retries=0, connect_timeout_s=0.5)
    counters = Counters()
    saver = Saver(down, SPEC, layout_for(cpu_caches(), SPEC), counters)
    saver.submit(SaveJob("x", list(range(BS)), [0]))
    assert saver.wait_for("x", 10)
    saver.close()
    assert counters.snapshot()["save_errors"] == 1 and counters.snapshot()["saves"] == 0
    with pytest.raises(ConnectionFailed):
        down.lookup(SPEC, list(range(BS)))


def test_counters_hand_out_deltas():
    c = Counters()
    c.add(lookups=2, looked_up_tokens=10)
    assert c.delta() == {"lookups": 2, "looked_up_tokens": 10}
    assert c.delta() == {}
    c.add(lookups=1)
    assert c.delta() == {"lookups": 1} and c.snapshot()["lookups"] == 3


# -- the weights fingerprint -----------------------------------------------------------------


def test_the_weights_fingerprint_follows_content_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"rope_theta": 10000}')
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "tokenizer.json").write_text("{}")
    first = weights_fingerprint(model)
    assert first.startswith("w-") and len(first) == 34 and weights_fingerprint(model) == first
    hashed = []
    real = weights._file_digest
    monkeypatch.setattr(weights, "_file_digest", lambda p: hashed.append(p.name) or real(p))
    (model / "tokenizer.json").write_text('{"changed": 1}')  # not part of the KV
    assert weights_fingerprint(model) == first and hashed == []  # cached by inode, size and mtime
    with open(model / "model.safetensors", "r+b") as f:  # same size, one byte: a fine-tune's new values
        f.seek(100)
        f.write(b"\x02")
    changed = weights_fingerprint(model)
    assert changed != first and hashed == ["model.safetensors"]
    (model / "config.json").write_text('{"rope_theta": 500000}')
    assert weights_fingerprint(model) not in (first, changed)


def test_the_weights_fingerprint_refuses_what_it_cannot_name(tmp_path):
    with pytest.raises(InvalidSpec, match="no model directory"):
        weights_fingerprint(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidSpec, match="no weights file"):
        weights_fingerprint(tmp_path)


# -- connector reports -----------------------------------------------------------------------


def test_connector_reports_show_in_metrics_and_admin_by_namespace(auth_server):
    with KVClient(auth_server.url, token=ACME, namespace="acme") as acme, \
            KVClient(auth_server.url, token=BETA, namespace="beta") as beta:
        # a scheduler counts what it was asked and offered, the workers what they loaded and saved
        acme.report_connector("vllm", "engine-1/scheduler", {"looked_up_tokens": 1024, "offered_tokens": 640})
        acme.report_connector("vllm", "engine-1/worker", {"loaded_tokens": 384, "saved_tokens": 512})
        acme.report_connector("vllm", "engine-2/worker", {"loaded_tokens": 128, "load_seconds": 0.25})
        acme.report_connector("vllm", "engine-1/worker", {"loaded_tokens": 512, "saved_tokens": 640})  # cumulative
        beta.report_connector("vllm", "engine-9/scheduler", {"looked_up_tokens": 99})
    with KVClient(auth_server.url, token=ADMIN) as admin:
        rows = {(r["namespace"], r["engine"]): r for r in admin.admin.connectors()}
        text = admin.metrics()
    acme_row = rows[("acme", "vllm")]
    assert (acme_row["looked_up_tokens"], acme_row["offered_tokens"], acme_row["loaded_tokens"],
            acme_row["saved_tokens"], acme_row["instances"]) == (1024, 640, 640, 640, 3)
    assert acme_row["hit_ratio"] == 640 / 1024  # loaded over looked up, across the row's instances
    assert rows[("beta", "vllm")]["looked_up_tokens"] == 99 and rows[("beta", "vllm")]["hit_ratio"] == 0
    for name, value in (("looked_up_tokens", 1024), ("offered_tokens", 640), ("loaded_tokens", 640),
                        ("saved_tokens", 640)):
        assert f'kvstore_connector_{name}_total{{engine="vllm",namespace="acme"}} {value:.1f}' in text
    assert "# HELP kvstore_connector_looked_up_tokens_total Prompt tokens the engines asked" in text


def test_a_connector_from_before_the_split_still_reports_its_other_counters(server):
    """``hit_tokens`` and ``miss_tokens`` counted what the store held, whether or not the engine took it:
    a server takes a report that carries them and keeps the rest."""
    with KVClient(server.url) as old:
        old.report_connector("vllm", "engine-0/scheduler", {"lookups": 3, "hit_tokens": 384, "miss_tokens": 128})
        old.report_connector("vllm", "engine-0/worker", {"loaded_tokens": 256, "saved_tokens": 128})
    row = server.svc.connectors.summary()[0]
    assert (row["lookups"], row["loaded_tokens"], row["saved_tokens"]) == (3, 256, 128)
    assert "hit_tokens" not in row and "miss_tokens" not in row
    assert row["hit_ratio"] is None  # nothing counted as looked up: no ratio rather than a made-up one


@pytest.mark.parametrize("body, field", [
    ({"engine": "vLLM!", "instance": "i", "counters": {}}, "engine"),
    ({"engine": "vllm", "instance": "has space", "counters": {}}, "instance"),
    ({"engine": "vllm", "instance": "i", "counters": {"rm -rf": 1}}, "counters"),
    ({"engine": "vllm", "instance": "i", "counters": {"looked_up_tokens": -1}}, "counters.looked_up_tokens"),
    ({"engine": "vllm", "instance": "i", "counters": {"offered_tokens": True}}, "counters.offered_tokens"),
    # a retired name is still checked before it is dropped
    ({"engine": "vllm", "instance": "i", "counters": {"hit_tokens": -1}}, "counters.hit_tokens"),
    ({"engine": "vllm", "instance": "i", "counters": []}, "counters"),
])
def test_bad_reports_get_422_naming_the_field(server, body, field):
    resp = httpx.post(f"{server.url}/v1/connectors/report", json=body)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == field
    assert server.svc.connectors.summary() == []


def test_a_report_needs_a_token_granting_the_namespace(auth_server):
    body = {"engine": "vllm", "instance": "i", "counters": {"looked_up_tokens": 1}}
    assert httpx.post(f"{auth_server.url}/v1/connectors/report", json=body).status_code == 401
    resp = httpx.post(f"{auth_server.url}/v1/connectors/report", json=body,
                      headers={"authorization": f"Bearer {ACME}", "x-kv-namespace": "beta"})
    assert resp.status_code == 403
    assert auth_server.svc.connectors.summary() == []


def test_the_board_is_bounded_and_forgets_silent_instances():
    from server.connector_board import ConnectorBoard

    now = [0.0]
    board = ConnectorBoard(clock=lambda: now[0])
    for i in range(1100):
        board.report("ns", "vllm", f"i{i}", {"lookups": 1})
    assert board.summary()[0]["instances"] == 1024 and board.summary()[0]["lookups"] == 1024
    now[0] = 3601.0
    board.report("ns", "vllm", "fresh", {"lookups": 5})
    assert board.summary() == [{**board.summary()[0], "instances": 1, "lookups": 5}]


class _GatedClient:
    """A client whose lookups wait for a gate and are counted; puts are recorded."""

    namespace = "default"

    def __init__(self, fail: bool = False) -> None:
        import threading

        self.gate = threading.Event()
        self.fail = fail
        self.lookups = 0
        self.puts: list[int] = []

    def lookup(self, spec, tokens) -> int:
        self.lookups += 1
        self.gate.wait(10)
        if self.fail:
            raise ConnectionFailed("down")
        return 0

    def put_kv(self, spec, tokens, kv) -> int:
        self.puts.append(len(tokens))
        return len(tokens)


def test_a_preempted_requests_queued_saves_are_dropped_unread():
    client = _GatedClient()
    saver = Saver(client, SPEC, layout_for(cpu_caches(), SPEC), Counters())
    try:
        saver.submit(SaveJob("a", list(range(BS)), [0]))  # running: its lookup waits at the gate
        saver.submit(SaveJob("b", list(range(2 * BS)), [1, 2]))
        saver.submit(SaveJob("b", list(range(3 * BS)), [1, 2, 3]))
        assert saver.drop("b") == 2 and saver.pending("b") == 0 and saver.wait_for("b", 0)
        client.gate.set()
        assert saver.wait_for("a", 10)
    finally:
        saver.close()
    assert client.puts == [BS]  # b's blocks were never read


def test_saves_queued_behind_a_failure_are_dropped_not_each_timed_out():
    client = _GatedClient(fail=True)
    counters = Counters()
    saver = Saver(client, SPEC, layout_for(cpu_caches(), SPEC), counters)
    try:
        for i in range(3):
            saver.submit(SaveJob(f"r{i}", list(range(BS)), [i]))
        client.gate.set()
        assert all(saver.wait_for(f"r{i}", 10) for i in range(3))
    finally:
        saver.close()
    assert client.lookups == 1 and counters.snapshot()["save_errors"] == 3
