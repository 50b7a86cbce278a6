"""Co-located puts into reserved slots, end to end: real uvicorn, real shm, other processes.

A client writes each frame straight into a top-tier slot the server reserved, then commits
(``kvstore.engine.reserved``). Here: the bytes read back bit for bit in another process, a client
killed between reserve and commit or in the middle of its copy leaves no block and no slot
behind, a commit for a slot it was not given is refused, and a server that takes no
reserved puts is put to through staging as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch

from client_sdk import KVClient
from kvstore.wire.rest import KV_MEDIA
from tests.conftest import make_kv, make_spec
from tests.server.conftest import make_store
from tiers.memory import MemoryTier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _details(server) -> dict:
    return server.store.tiers[0].stats().details


def test_a_reserved_put_reads_back_bit_exact_in_another_process(server, spec):
    tokens, kv = list(range(7_000, 7_100)), make_kv(spec, 100, seed=3)
    with KVClient(server.url, plan=False) as c:
        assert c.put_kv(spec, tokens, kv) == 96
        assert c.stats.last_medium == "shm" and c.stats.shm_puts == 1
    assert server.svc.staging.stats()["leases"] == 0  # no staging: the frames went into the slots
    assert server.store.reservations.open_count() == 0
    got = _run("""
        import sys, torch
        from client_sdk import KVClient
        from tests.conftest import make_kv, make_spec
        spec = make_spec()
        with KVClient(sys.argv[1], plan=False) as c:
            kv, n = c.get_kv(spec, list(range(7_000, 7_100)))
        print(n, bool(torch.equal(kv, make_kv(spec, 100, seed=3)[:, :, :, :96])), c.stats.last_medium)
    """, server.url)
    assert got.stdout.split() == ["96", "True", "shm"], got.stderr[-2000:]


_DYING_WRITER = """
    import os, signal, sys
    import client_sdk.arena as arena
    from client_sdk import KVClient
    from kvstore.memory.shm import ShmSlotWriter
    from tests.conftest import make_kv, make_spec

    url, when = sys.argv[1], sys.argv[2]
    real = arena.Arena.write_reserved

    def dying(self, blocks, spec, kv):  # the fault: this process is killed while it holds slots
        print(len(blocks), flush=True)
        if when == "mid-copy":
            real(self, blocks[:1], spec, kv)  # one frame whole,
            b = blocks[1]
            writer = ShmSlotWriter(self.segment)
            with writer.slot(b["offset"], b["length"]) as view:
                view[: b["length"] // 2] = b"\\x7f" * (b["length"] // 2)  # the next half written
        os.kill(os.getpid(), signal.SIGKILL)

    arena.Arena.write_reserved = dying
    spec = make_spec()
    with KVClient(url, plan=False) as c:
        c.put_kv(spec, list(range(9_000, 9_064)), make_kv(spec, 64))
"""


@pytest.mark.parametrize("when", ["before-copy", "mid-copy"])
def test_a_writer_killed_while_holding_slots_leaves_no_block_and_no_slot(server, spec, when):
    before = _details(server)["arena_free_bytes"]
    got = _run(_DYING_WRITER, server.url, when)
    assert got.returncode == -signal.SIGKILL and got.stdout.split() == ["4"], got.stderr[-2000:]
    deadline = time.monotonic() + 10  # the reaper looks every 0.5 s; a dead writer's slots go at once
    while server.store.reservations.open_count() and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert server.store.reservations.open_count() == 0 and server.store.reservations.reaped == 1
    assert _details(server)["arena_free_bytes"] == before and _details(server)["reserved_bytes"] == "0"
    with KVClient(server.url, plan=False) as c:
        assert c.lookup(spec, list(range(9_000, 9_064))) == 0
        kv = make_kv(spec, 64)  # and the same put from a live client goes through whole
        assert c.put_kv(spec, list(range(9_000, 9_064)), kv) == 64
        got_kv, n = c.get_kv(spec, list(range(9_000, 9_064)))
        assert n == 64 and torch.equal(got_kv, kv)


def _reserve(http: httpx.Client, spec, tokens) -> dict:
    from client_sdk._common import kv_parts, tokens_of

    body = b"".join(bytes(p) for p in kv_parts(spec, tokens_of(tokens), None, with_kv=False))
    r = http.post(f"/v1/kv/reserve?pid={os.getpid()}", content=body, headers={"content-type": KV_MEDIA})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_commit_of_slots_never_written_or_not_given_is_refused(server, spec):
    tokens = list(range(11_000, 11_064))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        res = _reserve(http, spec, tokens)
        assert len(res["blocks"]) == 4 and res["segment"] == server.store.tiers[0].segment
        r = http.post("/v1/kv/commit", json={"reservation": res["reservation"], "checksums": [1, 2, 3, 4]})
        assert r.status_code == 422 and r.json()["error"]["type"] == "CorruptFrame"  # slots hold no frames
        r = http.post("/v1/kv/commit", json={"reservation": "not-one-of-ours", "checksums": []})
        assert r.status_code == 403
        r = http.post("/v1/kv/commit", json={"reservation": res["reservation"], "checksums": "x"})
        assert r.status_code in (403, 422)
        res = _reserve(http, spec, tokens)
        assert http.delete(f"/v1/kv/reserve/{res['reservation']}").status_code == 200
        assert http.delete(f"/v1/kv/reserve/{res['reservation']}").status_code == 403
        r = http.post("/v1/kv/reserve?pid=notanumber", content=b"", headers={"content-type": KV_MEDIA})
        assert r.status_code in (400, 422)
    assert server.store.reservations.open_count() == 0 and _details(server)["reserved_bytes"] == "0"


def test_another_tenant_cannot_commit_a_reservation(auth_server, spec):
    from tests.server.conftest import ACME, BETA

    with httpx.Client(base_url=auth_server.url, timeout=10, headers={"authorization": f"Bearer {ACME}",
                                                                      "x-kv-namespace": "shared"}) as acme:
        res = _reserve(acme, spec, list(range(12_000, 12_032)))
    with httpx.Client(base_url=auth_server.url, timeout=10, headers={"authorization": f"Bearer {BETA}",
                                                                      "x-kv-namespace": "shared"}) as beta:
        r = beta.post("/v1/kv/commit", json={"reservation": res["reservation"], "checksums": [0, 0]})
        assert r.status_code == 403
        assert beta.delete(f"/v1/kv/reserve/{res['reservation']}").status_code == 403


def test_concurrent_writers_of_one_prefix(server, spec):
    tokens, kv = list(range(13_000, 13_128)), make_kv(spec, 128, seed=5)
    code = """
        import sys
        from client_sdk import KVClient
        from tests.conftest import make_kv, make_spec
        spec = make_spec()
        with KVClient(sys.argv[1], plan=False) as c:
            print(c.put_kv(spec, list(range(13_000, 13_128)), make_kv(spec, 128, seed=5)), c.stats.last_medium)
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), server.url], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(o[0].split() == ["128", "shm"] for o in outs), outs
    with KVClient(server.url, plan=False) as c:
        got, n = c.get_kv(spec, tokens)
    assert n == 128 and torch.equal(got, kv)
    assert server.store.tiers[0].stats().entries == 8 and _details(server)["reserved_bytes"] == "0"


def test_a_store_without_reserved_puts_is_put_to_through_staging(serve_app, spec):
    from kvstore import KVStore
    from tiers.shm import ShmTier

    srv = serve_app(KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False, codec="int8"))
    with httpx.Client(base_url=srv.url) as http:
        assert http.get("/v1/info").json()["colocated"]["reserved_puts"] is False
    tokens, kv = list(range(64)), make_kv(spec, 64)
    with KVClient(srv.url, plan=False) as c:
        assert c.put_kv(spec, tokens, kv) == 64 and c.stats.last_medium == "shm"
        assert c.get_kv(spec, tokens)[1] == 64
        assert srv.svc.staging.stats()["leases"] == 1  # the client's lease, handed back at close


def test_no_room_in_the_top_tier_falls_back_to_staging(serve_app, spec):
    srv = serve_app(make_store(shm_bytes=1 << 20))  # room for 64 tiny blocks at most
    tokens, kv = list(range(4096)), make_kv(spec, 4096)
    with KVClient(srv.url, plan=False) as c:
        assert c.put_kv(spec, tokens, kv) == 4096
        got, n = c.get_kv(spec, tokens)
        assert n == 4096 and torch.equal(got, kv)
    assert srv.store.reservations.open_count() == 0
    assert json.loads(json.dumps(_details(srv)))["reserved_bytes"] == "0"


def test_the_async_client_puts_through_reserved_slots_too(server):
    import asyncio

    from client_sdk import AsyncKVClient

    spec = make_spec(num_layers=8, head_dim=64)  # 64 KiB a block: the copies go off the loop
    seqs = [list(range(20_000 + i * 1000, 20_000 + i * 1000 + 64)) for i in range(6)]
    kvs = [make_kv(spec, 64, seed=i) for i in range(6)]

    async def main() -> None:
        async with AsyncKVClient(server.url, namespace="async", plan=False) as a:
            assert await asyncio.gather(*(a.put_kv(spec, s, k) for s, k in zip(seqs, kvs))) == [64] * 6
            assert a.stats.last_medium == "shm" and a.stats.shm_puts == 6
            for s, k in zip(seqs, kvs):
                got, n = await a.get_kv(spec, s)
                assert n == 64 and torch.equal(got, k)

    asyncio.run(main())
    assert server.svc.staging.stats()["leases"] == 0  # every put went into reserved slots
    assert server.store.reservations.open_count() == 0 and _details(server)["reserved_bytes"] == "0"
