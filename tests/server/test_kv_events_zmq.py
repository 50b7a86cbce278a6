"""KV events in vLLM's wire format: a real ``kvstore serve`` publishing on ZMQ, a real SUB socket,
and vLLM's own decoder (``KVEventBatch``) run in the vLLM venv.

The vLLM part skips where the venv is missing, unless ``KVSTORE_REQUIRE_VLLM=1`` (set by
``.ci/run``) makes that a failure; everything else needs only pyzmq and msgpack.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import zmq

from bench.engines import engine_env, engine_python
from bench.reliability_kit.serve_process import ServeProcess, small_env
from bench.serving import free_port
from client_sdk import KVClient
from kvstore.errors import InvalidInput
from kvstore.engine.events import CLEARED, MOVED, REMOVED, STORED, Event, EventLog
from kvstore.keys import block_hashes
from server.kv_events_zmq import KVEventsPublisher, vllm_events
from tests.conftest import make_kv, make_spec, require_venv

SPEC = make_spec()
BT = SPEC.block_tokens
MEDIA = {"shm": "CPU", "cxl": "CPU", "nvme": "STORAGE"}


def chain(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 20) for _ in range(blocks * BT)]


def toks_bytes(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def until(timeout_s: float) -> Iterator[None]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        yield
    raise AssertionError(f"not within {timeout_s} s")


# -- the mapping, in-process ----------------------------------------------------------------------


def test_a_chain_is_one_block_stored_and_moves_between_media_are_removed_then_stored():
    k = [bytes([i]) * 32 for i in range(4)]
    t = chain(1, 3)
    evs = [Event(i + 1, STORED, 0.0, key=k[i], tier="shm", parent=k[i - 1] if i else None, spec_fp="f",
                 tokens=toks_bytes(t[i * BT:(i + 1) * BT])) for i in range(3)]
    evs += [Event(4, MOVED, 0.0, key=k[0], tier="cxl", src="shm", spec_fp="f"),  # CPU to CPU: nothing
            Event(5, MOVED, 0.0, key=k[1], tier="nvme", src="cxl", spec_fp="f"),
            Event(6, REMOVED, 0.0, key=k[2], tier="shm"), Event(7, REMOVED, 0.0, key=k[3], tier="shm"),
            Event(8, CLEARED, 0.0), Event(9, MOVED, 0.0, key=k[3], tier="nvme", src="shm", spec_fp="g")]
    sizes: dict[str, int] = {}
    assert vllm_events(evs, MEDIA, sizes) == [
        {"type": "BlockStored", "block_hashes": k[:3], "parent_block_hash": None, "token_ids": t, "block_size": BT,
         "lora_id": None, "medium": "CPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [k[1]], "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [k[1]], "parent_block_hash": None, "token_ids": [], "block_size": BT,
         "lora_id": None, "medium": "STORAGE", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [k[2], k[3]], "medium": "CPU"},
        {"type": "AllBlocksCleared"},
        {"type": "BlockRemoved", "block_hashes": [k[3]], "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [k[3]], "parent_block_hash": None, "token_ids": [], "block_size": 0,
         "lora_id": None, "medium": "STORAGE", "lora_name": None}]  # spec g never seen with tokens: size unknown
    assert sizes == {"f": BT}


def test_blocks_an_engine_named_are_stored_under_its_names_and_removed_by_both():
    k = [bytes([i]) * 32 for i in range(3)]
    v = [bytes([0xA0 + i]) * 32 for i in range(3)]  # the engine's names (vLLM's block hashes)
    t = chain(2, 3)
    evs = [Event(i + 1, STORED, 0.0, key=k[i], tier="shm", parent=k[i - 1] if i else None, spec_fp="f",
                 tokens=toks_bytes(t[i * BT:(i + 1) * BT])) for i in range(3)]
    evs += [Event(4 + i, STORED, 0.0, key=k[i], tier="shm", spec_fp="f", reason="named", engine_hash=v[i],
                  engine_parent=v[i - 1] if i else 7, tokens=toks_bytes(t[i * BT:(i + 1) * BT])) for i in range(3)]
    evs += [Event(7, MOVED, 0.0, key=k[2], tier="nvme", src="shm", spec_fp="f", engine_hash=v[2]),
            Event(8, REMOVED, 0.0, key=k[0], tier="shm", engine_hash=v[0]),
            Event(9, REMOVED, 0.0, key=k[1], tier="shm")]
    out = vllm_events(evs, MEDIA, {})
    assert out[1] == {"type": "BlockStored", "block_hashes": v, "parent_block_hash": 7, "token_ids": t,
                      "block_size": BT, "lora_id": None, "medium": "CPU", "lora_name": None, "kvstore_keys": k}
    assert out[0]["block_hashes"] == k and "kvstore_keys" not in out[0]  # the put, under our keys, as before
    assert out[2:] == [
        {"type": "BlockRemoved", "block_hashes": [k[2], v[2]], "medium": "CPU"},
        {"type": "BlockStored", "block_hashes": [k[2]], "parent_block_hash": None, "token_ids": [], "block_size": BT,
         "lora_id": None, "medium": "STORAGE", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [v[2]], "parent_block_hash": None, "token_ids": [], "block_size": BT,
         "lora_id": None, "medium": "STORAGE", "lora_name": None, "kvstore_keys": [k[2]]},
        {"type": "BlockRemoved", "block_hashes": [k[0], v[0], k[1]], "medium": "CPU"}]


def test_a_publisher_behind_the_ring_counts_what_it_lost_and_replays_what_it_sent():
    log = EventLog(16)
    for i in range(40):
        log.emit(STORED, key=bytes([i]) * 32, tier="shm", spec_fp="f")
    lost: list[int] = []
    port, replay_port = free_port(), free_port()
    pub = KVEventsPublisher(log, MEDIA, f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                            topic="kv", on_lost=lost.append)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for _ in until(5):
            if pub.published:
                break
            time.sleep(0.01)
        assert lost == [24]  # events 1..24 fell out of the ring of 16 before it started
        with pytest.raises(InvalidInput, match="KVSTORE_KV_EVENTS_ENDPOINT"):
            KVEventsPublisher(log, MEDIA, f"tcp://127.0.0.1:{port}")  # the port is taken
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            empty, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        hashes = [h for _, _, (_, events) in got for e in events for h in e["block_hashes"]]
        assert [(t, s) for t, s, _ in got] == [(b"kv", i) for i in range(len(got))]
        assert hashes == [bytes([i]) * 32 for i in range(24, 40)]
    finally:
        dealer.close(linger=0)
        ctx.term()
        pub.close()


# -- a real server ----------------------------------------------------------------------------------


class Subscriber:
    """A SUB socket on the server's PUB endpoint, and a DEALER on its replay endpoint."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.live: list[tuple[int, bytes]] = []

    def drain(self, quiet_s: float = 0.3) -> None:
        """Receive until nothing comes for ``quiet_s``."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.live.append((int.from_bytes(seq, "big"), payload))

    def replay(self, start: int = 0) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(5000), "no replay answer"
                _, _, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def medium_map(batches: list[tuple[int, bytes]]) -> dict[bytes, str]:
    """Block hash -> medium, rebuilt from the batches in order, as a router would."""
    where: dict[bytes, str] = {}
    for _, payload in batches:
        _, events = msgpack.unpackb(payload)
        for e in events:
            if e["type"] == "BlockStored":
                where.update(dict.fromkeys(e["block_hashes"], e["medium"]))
            elif e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    assert where.pop(h, None) == e["medium"], "removed from a medium it was not in"
            else:
                where.clear()
    return where


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Iterator[dict]:
    """A server over shm (1 MiB) and nvme (1 MiB) publishing its events; a workload of puts, reads,
    deletes, moves and evictions; the batches received live and replayed, and those after SIGTERM."""
    data = tmp_path_factory.mktemp("zmq")
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = ServeProcess(small_env(data, KVSTORE_TIERS="shm,nvme", KVSTORE_SHM_BYTES="1MiB", KVSTORE_NVME_BYTES="1MiB",
                                  KVSTORE_KV_EVENTS_ENDPOINT=endpoint, KVSTORE_KV_EVENTS_REPLAY_ENDPOINT=replay)).start()
    sub = Subscriber(endpoint, replay)
    try:
        with KVClient(proc.url, namespace="z", retries=0) as c:
            for i, _ in enumerate(until(10)):  # a SUB socket joins a moment after it connects: probe till one comes
                c.put_kv(SPEC, chain(-i - 1, 1), make_kv(SPEC, BT))
                if sub.sub.poll(100):
                    break
            first = chain(1, 4)
            c.put_kv(SPEC, first, make_kv(SPEC, 4 * BT))
            names = [bytes([0xB0 + i]) * 32 for i in range(3)]  # an engine's names for blocks 1-3
            assert c.name_blocks(SPEC, first, names, first=1, parent=1234) == 3
            assert c.name_blocks(SPEC, chain(99, 2), names[:2]) == 0  # not stored: skipped
            c.delete(SPEC, first)
            for i in range(6):  # past shm and nvme together: moves down and evictions
                c.put_kv(SPEC, chain(10 + i, 64), make_kv(SPEC, 64 * BT, i))
            for _ in range(3):  # the last chain, in nvme, read until it is promoted
                c.get_kv(SPEC, chain(15, 64))
            for _ in until(20):  # placement runs in the background: compare at a quiet moment
                sub.drain()
                before = {bytes.fromhex(e["key"]): MEDIA[e["tier"]]
                          for e in c.admin.entries(limit=10_000)["entries"]}
                batches = sub.replay()
                sub.drain()
                if medium_map(batches) == before and batches[-1][0] == sub.live[-1][0]:
                    break
        live, replayed = list(sub.live), batches
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == -signal.SIGTERM
        sub.live.clear()
        sub.drain(quiet_s=1.0)
        yield {"first": first, "names": names, "live": live, "replayed": replayed, "index": before, "after_stop": list(sub.live)}
    finally:
        sub.close()
        proc.stop()


def test_every_change_reaches_the_router_in_order_and_rebuilds_the_index(published):
    live, replayed = published["live"], published["replayed"]
    assert [s for s, _ in replayed] == list(range(len(replayed)))  # numbered from 0, none missing
    assert live == replayed[live[0][0]:]  # what came live is what replay keeps, byte for byte
    assert medium_map(replayed) == published["index"] and len(published["index"]) > 100
    media = {m for _, p in replayed for e in msgpack.unpackb(p)[1] for m in [e.get("medium")]}
    assert media >= {"CPU", "STORAGE"}


def test_a_put_is_one_block_stored_with_its_tokens_and_a_delete_one_removed(published):
    first = published["first"]
    keys = block_hashes(SPEC, first, "z")
    events = [e for _, p in published["replayed"] for e in msgpack.unpackb(p)[1]]
    stored = [e for e in events if e["type"] == "BlockStored" and e["block_hashes"][0] in keys]
    # One event per batch the chain's blocks fell in (one, unless a batch's window closed between them).
    assert [h for e in stored for h in e["block_hashes"]] == keys
    assert [t for e in stored for t in e["token_ids"]] == first
    assert [e["parent_block_hash"] for e in stored] == [None] + [e["block_hashes"][-1] for e in stored[:-1]]
    assert all(e["block_size"] == BT and e["medium"] == "CPU" and e["lora_id"] is None and e["lora_name"] is None
               for e in stored)
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"] if h in keys]
    assert sorted(removed) == sorted(keys)


def test_named_blocks_are_stored_under_the_engines_names_beside_our_keys(published):
    first, names = published["first"], published["names"]
    keys = block_hashes(SPEC, first, "z")
    events = [e for _, p in published["replayed"] for e in msgpack.unpackb(p)[1]]
    named = [e for e in events if e["type"] == "BlockStored" and "kvstore_keys" in e]
    assert [h for e in named for h in e["block_hashes"]] == names
    assert [k for e in named for k in e["kvstore_keys"]] == keys[1:]
    assert [t for e in named for t in e["token_ids"]] == first[BT:]
    assert named[0]["parent_block_hash"] == 1234 and named[0]["medium"] == "CPU"
    removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert removed >= set(names) | set(keys)  # the delete names each block both ways


def test_moves_across_media_are_removed_then_stored(published):
    events = [e for _, p in published["replayed"] for e in msgpack.unpackb(p)[1]]
    down = [i for i, e in enumerate(events) if e["type"] == "BlockStored" and e["medium"] == "STORAGE"
            and not e["token_ids"]]  # no tokens: a move, not a put
    assert down
    for i in down:
        before = events[i - 1]
        assert before["type"] == "BlockRemoved" and before["medium"] == "CPU" \
            and before["block_hashes"][-1] == events[i]["block_hashes"][0]
        assert events[i]["block_size"] == BT  # learned from the blocks' puts


def test_shutdown_publishes_all_blocks_cleared(published):
    after = [e for _, p in published["after_stop"] for e in msgpack.unpackb(p)[1]]
    assert after and after[-1] == {"type": "AllBlocksCleared"}


DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
out = []
for payload in json.load(open(sys.argv[1])):
    batch = decoder.decode(bytes.fromhex(payload))
    out.append([{f: (v.hex() if isinstance(v, bytes) else [x.hex() for x in v] if f == "block_hashes" else v)
                 for f, v in [("type", type(e).__name__), *msgspec.structs.asdict(e).items()]}
                for e in batch.events])
print(json.dumps(out))
"""


def test_vllms_own_decoder_parses_every_message(published, tmp_path):
    python = require_venv(engine_python("vllm"), "no vLLM venv matching bench/locks/vllm-cpu.txt "
                          "(python -m bench.engines ensure vllm makes one)", "KVSTORE_REQUIRE_VLLM")
    payloads = [p for _, p in published["replayed"] + published["after_stop"]]
    path = Path(tmp_path) / "payloads.json"
    path.write_text(json.dumps([p.hex() for p in payloads]))
    done = subprocess.run([str(python), "-c", DECODE, str(path)], capture_output=True, text=True, timeout=120,
                          env=engine_env())
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(decoded) == len(payloads)
    for batch, payload in zip(decoded, payloads):
        ours = msgpack.unpackb(payload)[1]
        assert [e["type"] for e in batch] == [e["type"] for e in ours]
        for theirs, mine in zip(batch, ours):
            for field, value in mine.items():
                if field == "kvstore_keys":  # ours, beside vLLM's fields: its decoder skips it
                    assert field not in theirs
                    continue
                if field == "block_hashes":
                    value = [h.hex() for h in value]
                elif isinstance(value, bytes):
                    value = value.hex()
                assert theirs[field] == value, (field, theirs, mine)
