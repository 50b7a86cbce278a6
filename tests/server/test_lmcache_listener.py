"""The lm:// listener over a real uvicorn app and real tiers, driven over raw sockets.

LMCache's own client drives it in ``test_lmcache_client.py``; here a client written in
the test (``lmwire``) checks the wire format, the mapping into the store, and that bad
input closes only the connection it came on.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from kvstore import KVStore
from kvstore.keys import name_fingerprint, named_key
from tests.server import lmwire as lm
from tests.server.conftest import ADMIN, TOKENS
from tiers.memory import MemoryTier
from tiers.nvme import NVMeTier
from tiers.nvme_log import LogTier
from tiers.shm import ShmTier

MiB = 1 << 20
AUTH = {"authorization": f"Bearer {ADMIN}"}


def chunk(n: int, seed: int) -> bytes:
    """``n`` bytes (a multiple of 256) that are a function of ``seed``."""
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(256)) * (n // 256)


@pytest.fixture
def lmserver(serve_app):
    """An app with the listener on a free port, shm (8 MiB) over memory, admin token."""

    def start(store: KVStore | None = None, **settings):
        settings.setdefault("lmcache_port", 0)
        settings.setdefault("body_timeout_s", 2.0)
        srv = serve_app(store or KVStore([ShmTier(8 * MiB), MemoryTier(64 * MiB)], background=False),
                        tokens=json.dumps(TOKENS), admin_token=ADMIN, **settings)
        srv.lm_port = srv.svc.lmcache.port
        return srv

    return start


def test_put_get_exist_list_health_round_trip(lmserver):
    srv = lmserver()
    sock = lm.connect(srv.lm_port)
    data = chunk(2 * 4 * 16 * 64 * 2, 1)  # [2, 4, 16, 64] bf16
    lm.put(sock, "llama@1@0@abc@bfloat16", data, lm.KV_2LTD, lm.BF16, (2, 4, 16, 64))
    assert lm.exists(sock, "llama@1@0@abc@bfloat16")
    head, got = lm.get(sock, "llama@1@0@abc@bfloat16")
    assert head == (200, len(data), lm.KV_2LTD, lm.BF16, 2, 4, 16, 64, 0) and got == data
    # LMCache compares the hash as a number: these name the same chunk.
    assert lm.get(sock, "llama@1@0@0ABC@bfloat16")[1] == data
    assert not lm.exists(sock, "llama@1@0@abd@bfloat16")
    assert not lm.exists(sock, "llama@1@1@abc@bfloat16")  # another worker's shard
    assert lm.get(sock, "llama@1@0@abd@bfloat16") == ((400, 0, 1, 2, 0, 0, 0, 0, 0), None)
    # A binary chunk (compressed bytes): the shape does not describe it, and it comes back as sent.
    blob = b"\x00\xff" * 999 + b"z"
    lm.put(sock, "llama@1@0@-5@half@lmcache.tag.user%alice", blob, lm.BINARY, lm.UINT8, (len(blob), 0, 0, 0))
    head, got = lm.get(sock, "llama@1@0@-5@half@lmcache.tag.user%alice")
    assert head[:4] == (200, len(blob), lm.BINARY, lm.UINT8) and head[4:8] == (len(blob), 0, 0, 0) and got == blob
    # An overwrite replaces the chunk; a zero-length chunk is a chunk.
    lm.put(sock, "llama@1@0@abc@bfloat16", data[::-1], lm.KV_2LTD, lm.BF16, (2, 4, 16, 64))
    assert lm.get(sock, "llama@1@0@abc@bfloat16")[1] == data[::-1]
    lm.put(sock, "llama@1@0@e@half", b"", lm.KV_2LTD, lm.FP16, (0, 0, 0, 0))
    assert lm.get(sock, "llama@1@0@e@half") == ((200, 0, 1, 2, 0, 0, 0, 0, 0), b"")
    assert sorted(lm.list_keys(sock)) == ["llama@1@0@-5@half@lmcache.tag.user%alice", "llama@1@0@abc@bfloat16",
                                          "llama@1@0@e@half"]
    assert lm.health(sock) == 200
    sock.close()


def test_chunks_are_entries_like_any_other(lmserver):
    srv = lmserver()
    sock = lm.connect(srv.lm_port)
    data = chunk(4096, 2)
    lm.put(sock, "m@2@1@ff@half", data, lm.KV_2LTD, lm.FP16, (2, 1, 16, 64))
    assert lm.exists(sock, "m@2@1@ff@half")
    key = named_key("lmcache", "lmcache", "m@2@1@ff@half")
    entry = srv.store.entry(key)
    assert entry.namespace == "lmcache" and entry.tier == "shm" and entry.raw_bytes == len(data)
    assert entry.spec_fp == name_fingerprint("lmcache", "m@2@1@half")
    info = httpx.get(f"{srv.url}/admin/explain/{key.hex()}", headers=AUTH).json()
    assert info["namespace"] == "lmcache" and info["codec"] == "raw"
    listed = httpx.get(f"{srv.url}/admin/entries", params={"namespace": "lmcache"}, headers=AUTH).json()
    assert listed["total"] == 1
    # Reads count as accesses (heat); placement moves the chunk, and it comes back the same.
    before = srv.store.entry(key).hits
    assert lm.get(sock, "m@2@1@ff@half")[1] == data
    deadline = time.monotonic() + 5  # counted once the answer is sent, which the client may see first
    while srv.store.entry(key).hits != before + 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert srv.store.entry(key).hits == before + 1
    assert srv.store.stats().reads_by_tier == {}  # heat, but not the per-tier split of get_kv's tokens
    assert lm.list_keys(sock) == ["m@2@1@ff@half"] and srv.store.entry(key).hits == before + 1  # LIST reads no chunk
    moved = httpx.post(f"{srv.url}/admin/migrate", json={"key": key.hex(), "tier": "memory"}, headers=AUTH).json()
    assert moved["moved"] is True
    assert lm.get(sock, "m@2@1@ff@half")[1] == data
    # Pins hold it; eviction by fingerprint (one model's shard) takes it.
    httpx.post(f"{srv.url}/admin/pin", json={"keys": [key.hex()]}, headers=AUTH).raise_for_status()
    fp = name_fingerprint("lmcache", "m@2@1@half")
    ev = httpx.post(f"{srv.url}/admin/evict", json={"fingerprint": fp}, headers=AUTH).json()
    assert ev["removed_blocks"] == 0 and ev["skipped_pinned"] == 1
    ev = httpx.post(f"{srv.url}/admin/evict", json={"fingerprint": fp, "include_pinned": True}, headers=AUTH).json()
    assert ev["removed_blocks"] == 1
    assert not lm.exists(sock, "m@2@1@ff@half")
    assert lm.list_keys(sock) == []
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'kvstore_lmcache_requests_total{command="PUT",result="stored"} 1.0' in metrics
    assert 'kvstore_lmcache_requests_total{command="GET",result="hit"} 2.0' in metrics
    assert 'kvstore_transfer_bytes_total{direction="in",medium="lmcache"} 4096.0' in metrics
    stats = httpx.get(f"{srv.url}/admin/stats", headers=AUTH).json()["service"]["lmcache"]
    assert stats["port"] == srv.lm_port and stats["namespace"] == "lmcache" and stats["connections"] == 1
    sock.close()


@pytest.mark.parametrize("layout", [NVMeTier, LogTier])
def test_demotion_into_an_int8_tier_keeps_chunks_exact_and_the_last_tier_evicts(lmserver, tmp_path, layout):
    """nvme holds int8 frames by default; a chunk is opaque bytes, never quantized. Both nvme
    layouts: a full log must refuse a chunk before its bytes are read off the socket, or
    they are spent and room can no longer be made for them (a chunk lost, in CI once)."""
    store = KVStore([ShmTier(3 * MiB), layout(str(tmp_path / "nvme"), 8 * MiB)], background=False)
    srv = lmserver(store)
    sock = lm.connect(srv.lm_port)
    chunks = {f"m@1@0@{i:x}@bfloat16": chunk(MiB, i) for i in range(12)}  # 12 MiB into 11 MiB of tiers
    for name, data in chunks.items():
        lm.put(sock, name, data, lm.KV_2LTD, lm.BF16, (2, 4, 64, 1024))
        assert lm.exists(sock, name)
    assert store.stats().counters.blocks_evicted > 0  # the last tier made room: no put failed
    # Chunks that stayed on nvme and are read often move up, in exchange for colder ones.
    tier_of = {n: getattr(store.entry(named_key("lmcache", "lmcache", n)), "tier", None) for n in chunks}
    hot = [n for n, t in tier_of.items() if t == "nvme"][-2:]
    for _ in range(4):
        for name in hot:
            assert lm.get(sock, name)[1] == chunks[name]
    store.run_placement()
    stats = store.stats()
    assert stats.counters.blocks_promoted > 0 and stats.counters.blocks_demoted > 0
    assert {store.entry(named_key("lmcache", "lmcache", n)).tier for n in hot} == {"shm"}
    on_nvme = [e for e in store.entries() if e.tier == "nvme"]
    assert on_nvme and all(e.codec.value == "raw" for e in on_nvme)
    kept = [n for n in chunks if lm.exists(sock, n)]
    assert 0 < len(kept) < len(chunks) and kept[-1] == "m@1@0@b@bfloat16"  # the newest stays, the oldest went
    for name in kept:
        assert lm.get(sock, name)[1] == chunks[name], name
    sock.close()


def test_a_durable_tier_serves_the_chunks_after_a_restart(serve_app, tmp_path):
    data = {f"m@1@0@{i}@half": chunk(64 * 1024, i) for i in range(3)}
    srv = serve_app(KVStore([NVMeTier(str(tmp_path / "nvme"), 64 * MiB)], background=False), lmcache_port=0)
    sock = lm.connect(srv.svc.lmcache.port)
    for name, payload in data.items():
        lm.put(sock, name, payload, lm.KV_2LTD, lm.FP16, (2, 1, 256, 64))
    assert lm.health(sock) == 200  # the puts before it are stored
    sock.close()
    srv.stop()
    again = serve_app(KVStore([NVMeTier(str(tmp_path / "nvme"), 64 * MiB)], background=False), lmcache_port=0)
    sock = lm.connect(again.svc.lmcache.port)
    for name, payload in data.items():
        head, got = lm.get(sock, name)
        assert got == payload and head[2:8] == (lm.KV_2LTD, lm.FP16, 2, 1, 256, 64)
    assert sorted(lm.list_keys(sock)) == sorted(data)  # names read back from the frames
    sock.close()


BAD = [
    ("unknown command", lambda: lm.meta(9, "m@1@0@1@half")),
    ("unknown format", lambda: lm.meta(lm.EXIST, "m@1@0@1@half", fmt=99)),
    ("unknown dtype", lambda: lm.meta(lm.EXIST, "m@1@0@1@half", dtype=42)),
    ("negative field", lambda: lm.meta(lm.PUT, "m@1@0@1@half", length=-1)),
    ("malformed key", lambda: lm.meta(lm.GET, "not-a-key")),
    ("malformed key", lambda: lm.meta(lm.EXIST, "m@1@0@xyz@half")),
    ("malformed key", lambda: lm.meta(lm.EXIST, "m@1@0@1@bf16")),
    ("malformed key", lambda: lm.meta(lm.EXIST, b"m@1@0@1@half\xff\xfe")),
    ("too large", lambda: lm.meta(lm.PUT, "m@1@0@1@half", length=2**31 - 1, dtype=lm.UINT8, fmt=lm.BINARY,
                                  shape=(2**31 - 1, 0, 0, 0))),
    ("length mismatch", lambda: lm.meta(lm.PUT, "m@1@0@1@half", length=100, dtype=lm.FP16, shape=(2, 1, 16, 64))),
    ("short read", lambda: lm.meta(lm.EXIST, "m@1@0@1@half")[:100]),
]


@pytest.mark.parametrize("reason,request_bytes", BAD, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD)])
def test_bad_input_closes_that_connection_only(lmserver, caplog, reason, request_bytes):
    srv = lmserver(max_body_bytes=64 * MiB)
    bystander = lm.connect(srv.lm_port)
    lm.put(bystander, "m@1@0@1@half", chunk(4096, 3), lm.KV_2LTD, lm.FP16, (2, 1, 16, 64))
    bad = lm.connect(srv.lm_port)
    with caplog.at_level(logging.WARNING, logger="kvstore.lmcache"):
        bad.sendall(request_bytes())
        if reason == "short read":
            bad.shutdown(socket.SHUT_WR)  # the peer goes away part-way
        assert lm.is_closed(bad), reason
        deadline = time.monotonic() + 5
        while not any("closing the connection" in r.message for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert any("closing the connection" in r.message for r in caplog.records), caplog.text
    bad.close()
    # The listener and the other connection go on; nothing was stored from the bad request.
    assert lm.get(bystander, "m@1@0@1@half")[1] == chunk(4096, 3)
    fresh = lm.connect(srv.lm_port)
    assert lm.health(fresh) == 200 and lm.list_keys(fresh) == ["m@1@0@1@half"]
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert f'kvstore_lmcache_closed_connections_total{{reason="{reason}"}} 1.0' in metrics
    fresh.close()
    bystander.close()


def test_a_payload_cut_short_or_stalled_stores_nothing(lmserver):
    srv = lmserver(body_timeout_s=0.5)
    cut = lm.connect(srv.lm_port)
    cut.sendall(lm.meta(lm.PUT, "m@1@0@c@half", 8192, lm.KV_2LTD, lm.FP16, (2, 1, 32, 64)))
    cut.sendall(b"x" * 5000)
    cut.shutdown(socket.SHUT_WR)
    assert lm.is_closed(cut)
    stalled = lm.connect(srv.lm_port)
    stalled.sendall(lm.meta(lm.PUT, "m@1@0@d@half", 8192, lm.KV_2LTD, lm.FP16, (2, 1, 32, 64)) + b"y" * 100)
    started = time.monotonic()
    assert lm.is_closed(stalled, timeout_s=10)  # closed by the server's io timeout, not ours
    assert 0.4 < time.monotonic() - started < 5
    idle = lm.connect(srv.lm_port)  # an idle connection between requests is fine for as long as it likes
    time.sleep(1.0)
    assert lm.health(idle) == 200
    assert not lm.exists(idle, "m@1@0@c@half") and not lm.exists(idle, "m@1@0@d@half")
    assert srv.store.entries() == []
    for s in (cut, stalled, idle):
        s.close()


def test_a_put_no_tier_can_take_is_read_off_and_the_connection_stays_in_step(lmserver):
    srv = lmserver(KVStore([ShmTier(1 * MiB), MemoryTier(1 * MiB)], background=False))
    sock = lm.connect(srv.lm_port)
    lm.put(sock, "m@1@0@b1@half", chunk(4 * MiB, 1), lm.BINARY, lm.UINT8, (4 * MiB, 0, 0, 0))  # bigger than any tier
    assert not lm.exists(sock, "m@1@0@b1@half")
    lm.put(sock, "m@1@0@b2@half", chunk(4096, 2), lm.BINARY, lm.UINT8, (4096, 0, 0, 0))
    assert lm.get(sock, "m@1@0@b2@half")[1] == chunk(4096, 2)
    assert 'kvstore_lmcache_requests_total{command="PUT",result="failed"} 1.0' in httpx.get(f"{srv.url}/metrics").text
    sock.close()


def test_a_damaged_chunk_is_a_miss_and_the_connection_stays(lmserver):
    """LMCache never reconnects: a chunk found damaged is answered as a miss, not a closed connection."""
    srv = lmserver()
    sock = lm.connect(srv.lm_port)
    data = chunk(3 * MiB, 4)
    lm.put(sock, "m@1@0@dd@half", data, lm.BINARY, lm.UINT8, (len(data), 0, 0, 0))
    assert lm.exists(sock, "m@1@0@dd@half")
    shm = srv.store.tiers[0]
    slot = shm._slots[named_key("lmcache", "lmcache", "m@1@0@dd@half")]
    shm._view[slot.offset + slot.length - 10] ^= 0xFF  # a bit flip near the end of the payload
    assert lm.get(sock, "m@1@0@dd@half") == ((400, 0, 1, 2, 0, 0, 0, 0, 0), None)  # never the bytes
    assert not lm.exists(sock, "m@1@0@dd@half")  # dropped
    assert srv.store.stats().counters.corrupt_blocks == 1
    assert lm.health(sock) == 200
    sock.close()


def test_a_header_whose_payload_never_comes_evicts_nothing(lmserver):
    """Room is made only once the bytes are in hand: a bare PUT header on a full store takes nothing."""
    srv = lmserver(KVStore([ShmTier(3 * MiB), MemoryTier(3 * MiB)], background=False), body_timeout_s=0.5)
    sock = lm.connect(srv.lm_port)
    for i in range(3):
        lm.put(sock, f"m@1@0@{i}@half", chunk(MiB, i), lm.BINARY, lm.UINT8, (MiB, 0, 0, 0))
    assert all(lm.exists(sock, f"m@1@0@{i}@half") for i in range(3))
    held = {e.key for e in srv.store.entries()}
    liar = lm.connect(srv.lm_port)
    liar.sendall(lm.meta(lm.PUT, "m@1@0@b16@half", 2 * MiB, lm.BINARY, lm.UINT8, (2 * MiB, 0, 0, 0)))
    assert lm.is_closed(liar)  # the body never came: closed at the deadline
    assert {e.key for e in srv.store.entries()} == held and srv.store.stats().counters.blocks_evicted == 0
    # The same put made whole does make room, by evicting the coldest.
    lm.put(sock, "m@1@0@b16@half", chunk(2 * MiB, 9), lm.BINARY, lm.UINT8, (2 * MiB, 0, 0, 0))
    assert lm.get(sock, "m@1@0@b16@half")[1] == chunk(2 * MiB, 9)
    assert srv.store.stats().counters.blocks_evicted > 0
    sock.close()
    liar.close()


def test_a_trickled_payload_is_cut_off_at_the_deadline(lmserver):
    srv = lmserver(body_timeout_s=0.5)
    sock = lm.connect(srv.lm_port)
    sock.sendall(lm.meta(lm.PUT, "m@1@0@7@half", 2 * MiB, lm.BINARY, lm.UINT8, (2 * MiB, 0, 0, 0)))
    started = time.monotonic()
    closed = False
    while time.monotonic() - started < 10 and not closed:  # a byte every 0.2 s: never idle for 0.5 s
        try:
            sock.sendall(b"x")
        except OSError:
            closed = True
        time.sleep(0.2)
        closed = closed or lm.is_closed(sock, timeout_s=0.01)
    assert closed and time.monotonic() - started < 5  # 0.5 s + 2 MiB at 1 MiB/s, not forever
    assert srv.store.entries() == []
    sock.close()


def test_an_overwrite_cut_short_never_leaves_the_index_pointing_at_nothing(lmserver):
    """A full arena frees the old frame to make room for its replacement; if the replacement's bytes
    never come, the key is gone (a miss), never a 200 from EXIST and a 400 from GET."""
    srv = lmserver(KVStore([ShmTier(4 * MiB)], background=False))
    sock = lm.connect(srv.lm_port)
    lm.put(sock, "m@1@0@0f@half", chunk(3 * MiB, 1), lm.BINARY, lm.UINT8, (3 * MiB, 0, 0, 0))
    assert lm.exists(sock, "m@1@0@0f@half")
    cut = lm.connect(srv.lm_port)
    cut.sendall(lm.meta(lm.PUT, "m@1@0@0f@half", 3 * MiB, lm.BINARY, lm.UINT8, (3 * MiB, 0, 0, 0)) + b"z" * 1000)
    cut.shutdown(socket.SHUT_WR)
    assert lm.is_closed(cut)
    exists = lm.exists(sock, "m@1@0@0f@half")
    head, got = lm.get(sock, "m@1@0@0f@half")
    assert (exists, head[0], got) == (False, 400, None)  # gone from the tier and the index alike
    assert srv.store.entries() == [] and srv.store.stats().counters.stale_blocks == 1  # dropped by the failed put
    sock.close()
    cut.close()


def test_listener_settings_and_its_end(serve_app):
    from server import ServerSettings

    with pytest.raises(ValueError, match="lmcache_port"):
        ServerSettings(lmcache_port=70000)
    with pytest.raises(ValueError, match="lmcache_port"):
        ServerSettings(port=9000, lmcache_port=9000)
    with pytest.raises(ValueError, match="lmcache_namespace"):
        ServerSettings(lmcache_port=0, lmcache_namespace="bad/ns")
    assert ServerSettings.from_env({"KVSTORE_LMCACHE_PORT": "0"}).lmcache_port == 0
    srv = serve_app(lmcache_port=0, lmcache_namespace="agents")
    port = srv.svc.lmcache.port
    sock = lm.connect(port)
    lm.put(sock, "m@1@0@1@half", chunk(4096, 5), lm.KV_2LTD, lm.FP16, (2, 1, 16, 64))
    assert lm.exists(sock, "m@1@0@1@half")
    assert srv.store.entries()[0].namespace == "agents"
    srv.stop()  # a clean stop closes the connection and frees the port
    assert lm.is_closed(sock)
    with pytest.raises(OSError):
        lm.connect(port, timeout_s=2)
