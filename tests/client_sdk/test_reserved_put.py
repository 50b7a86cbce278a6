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

    url, when, path = sys.argv[1], sys.argv[2], sys.argv[3]
    real = arena.Arena.write_reserved

    def dying(self, blocks, spec, kv):  # the fault: this process is killed while it holds slots
        print(len(blocks), flush=True)
        if when == "after-copy":  # every frame whole, the put's request never sent
            real(self, blocks, spec, kv)
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
        c.lookup(spec, [1])  # maps the arena
        c.colocation.arena.pooled_puts = path == "pooled"  # else a reservation, then a commit
        c.put_kv(spec, list(range(9_000, 9_064)), make_kv(spec, 64))
"""


@pytest.mark.parametrize("path", ["pooled", "reserved"])
@pytest.mark.parametrize("when", ["before-copy", "mid-copy", "after-copy"])
def test_a_writer_killed_while_holding_slots_leaves_no_block_and_no_slot(server, spec, when, path):
    """Killed before its copy, during it, or after it but before the request that would publish
    it: a pooled put's slots (its pool) or a reservation's are reclaimed, nothing shows."""
    before = _details(server)["arena_free_bytes"]
    got = _run(_DYING_WRITER, server.url, when, path)
    assert got.returncode == -signal.SIGKILL and got.stdout.split() == ["4"], got.stderr[-2000:]
    res = server.store.reservations
    deadline = time.monotonic() + 10  # the reaper looks every 0.5 s; a dead writer's slots go at once
    while (res.open_count() or res.pools.lent_bytes() or not res.reaped) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert res.open_count() == 0 and res.pools.lent_bytes() == 0 and res.reaped == 1
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


def _requests_by_route(url: str) -> dict[str, float]:
    """The server's own count of the requests it answered, by route (``/metrics`` reads left out)."""
    import re

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvstore_requests_total{") and 'route="/metrics"' not in line:
            route = re.search(r'route="([^"]*)"', line).group(1)
            out[route] = out.get(route, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_colocated_put_makes_one_request_once_its_pool_is_lent(server, spec):
    with KVClient(server.url, plan=False) as c:
        kv = make_kv(spec, 64)
        assert c.put_kv(spec, list(range(20_000, 20_064)), kv) == 64  # the first asks for a pool too
        for i in range(1, 6):
            before = _requests_by_route(server.url)
            toks = list(range(20_000 + 1000 * i, 20_064 + 1000 * i))
            assert c.put_kv(spec, toks, make_kv(spec, 64, seed=i)) == 64
            after = _requests_by_route(server.url)
            made = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
            assert made == {"/v1/kv/put-pooled": 1}, made
            got, n = c.get_kv(spec, toks)
            assert n == 64 and torch.equal(got, make_kv(spec, 64, seed=i))
        before = _requests_by_route(server.url)  # a put of stored blocks: still one request, nothing written
        assert c.put_kv(spec, list(range(20_000, 20_064)), kv) == 64
        assert sum(_requests_by_route(server.url).values()) - sum(before.values()) == 1
        assert c.stats.shm_puts == 7 and c.stats.http_puts == 0
        assert server.store.reservations.pools.lent_bytes() > 0
    assert server.store.reservations.pools.lent_bytes() == 0  # closing the client gave its pool back
    assert _details(server)["reserved_bytes"] == "0"


def test_a_writer_that_moves_to_another_spec_is_lent_slots_for_it(server, spec):
    """The pool's cap counts every slot size: the idle slots of the spec a writer left go back, in
    the grant request for the new one's, instead of holding the pool at its cap for good."""
    big, other = make_spec(num_layers=32, head_dim=128), make_spec(num_layers=8, head_dim=128)
    with KVClient(server.url, plan=False) as c:
        assert c.put_kv(big, list(range(50_000, 50_112)), make_kv(big, 112)) == 112  # 7 blocks: the cap
        before = _requests_by_route(server.url)
        assert c.put_kv(other, list(range(51_000, 51_064)), make_kv(other, 64)) == 64
        after = _requests_by_route(server.url)
        made = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
        assert made == {"/v1/kv/pool": 2, "/v1/kv/put-pooled": 1}, made  # short, then with the big slots back
        sizes = {ps.size for pool in server.store.reservations.pools._pools.values() for ps in pool.slots.values()}
        assert len(sizes) == 1  # only the new spec's slots are lent now
        before = _requests_by_route(server.url)
        assert c.put_kv(other, list(range(52_000, 52_064)), make_kv(other, 64, seed=2)) == 64
        assert sum(_requests_by_route(server.url).values()) - sum(before.values()) == 1
        got, n = c.get_kv(other, list(range(52_000, 52_064)))
        assert n == 64 and torch.equal(got, make_kv(other, 64, seed=2))
        assert c.stats.http_puts == 0


def _pooled_body(spec, tokens, writes) -> bytes:
    from client_sdk._common import kv_parts, tokens_of

    extra = ',"writes":' + json.dumps(writes) if writes is not None else ""
    return b"".join(bytes(p) for p in kv_parts(spec, tokens_of(tokens), None, extra=extra))


def test_bad_pooled_puts_are_4xx_naming_the_field_and_store_nothing(server, spec):
    from client_sdk._common import kv_parts, tokens_of
    from kvstore.engine.pools import SLOT_SLACK

    size = server.store.reservations.pools.slot_bytes(spec) + 64
    tokens = list(range(30_000, 30_032))
    q = f"pid={os.getpid()}&pool=t1&count=2&slot_bytes={size}"
    h = {"content-type": KV_MEDIA}
    with httpx.Client(base_url=server.url, timeout=10) as http:
        r = http.post(f"/v1/kv/pool?{q}", content=_pooled_body(spec, [], None), headers=h)
        assert r.status_code == 200 and len(r.json()["slots"]) == 2, r.text
        slot = r.json()["slots"][0]
        cases = [
            (q.replace(f"slot_bytes={size}", f"slot_bytes={size + SLOT_SLACK}"), [], "slot_bytes"),
            (q.replace(f"slot_bytes={size}", "slot_bytes=12"), [], "slot_bytes"),
            (q.replace("pool=t1", "pool=../x"), [], "pool"),
            (q.replace("count=2", "count=99999"), [], "count"),
            (q.replace(f"pid={os.getpid()}", "pid=x"), [], "pid"),
            (q, "nope", "header.writes"),
            (q, [[0, slot["offset"]]], "header.writes"),
            (q, [[0, slot["offset"], -1]], "header.writes"),
            (q, [[0, 1, 2], [1, 2, 3], [2, 3, 4]], "header.writes"),  # more writes than blocks
        ]
        for query, writes, field in cases:
            r = http.post(f"/v1/kv/put-pooled?{query}", content=_pooled_body(spec, tokens, writes), headers=h)
            assert r.status_code in (400, 422) and r.json()["error"].get("field") == field, (field, r.text)
        for returning in ("nope", [-1], [True]):
            body = b"".join(bytes(p) for p in kv_parts(spec, tokens_of([]), None,
                                                         extra=',"returning":' + json.dumps(returning)))
            r = http.post(f"/v1/kv/pool?{q}", content=body, headers=h)
            assert r.status_code in (400, 422) and r.json()["error"].get("field") == "header.returning", r.text
        r = http.post(f"/v1/blocks/put-pooled?{q}", json={"blocks": [], "returning": "nope"})
        assert r.status_code in (400, 422) and r.json()["error"].get("field") == "returning", r.text
        r = http.post(f"/v1/kv/put-pooled?{q}", content=_pooled_body(spec, tokens, [[0, slot["offset"], 1]]),
                      headers=h)
        assert r.status_code == 422 and r.json()["error"]["type"] == "CorruptFrame"  # the slot holds no frame
        r = http.post(f"/v1/kv/put-pooled?{q}", content=_pooled_body(spec, tokens, [[0, 64, 1]]), headers=h)
        assert r.status_code == 403  # not a slot of this pool
        assert server.store.lookup(spec, tokens) == 0
        assert http.delete(f"/v1/kv/pool?pid={os.getpid()}&pool=t1").json() == {"released": 2}
    assert server.store.reservations.pools.lent_bytes() == 0 and _details(server)["reserved_bytes"] == "0"


def test_a_full_top_tier_sends_puts_straight_to_staging_with_one_request(serve_app, spec, monkeypatch):
    """A full store places new blocks one tier down: asking for top-tier slots on every put would
    cost two requests that come back empty. After one "no room", puts go through staging (one
    request) for ``NO_ROOM_RETRY_S``, then ask again, and take slots once there is room."""
    from client_sdk import colocated_puts

    later = [0.0]  # seconds the client's clock is ahead of the real one
    monkeypatch.setattr(colocated_puts, "time", type("T", (), {"monotonic": staticmethod(
        lambda: time.monotonic() + later[0])}))
    srv = serve_app(make_store(shm_bytes=1 << 20))
    top = srv.store.placement.tiers[0]
    n = 0
    while srv.store.placement.usage()[top.name] < top.high_watermark_frac * top.capacity_bytes - (16 << 10):
        srv.store.put_kv(spec, list(range(900_000 + n * 64, 900_064 + n * 64)), make_kv(spec, 64, seed=n))
        n += 1  # the top tier fills to its high watermark: new blocks go one tier down from here
    with KVClient(srv.url, plan=False) as c:
        seqs = [list(range(40_000 + 1000 * i, 40_064 + 1000 * i)) for i in range(5)]
        assert c.put_kv(spec, seqs[0], make_kv(spec, 64, seed=0)) == 64  # asks, hears "no room", stages
        for i in range(1, 4):
            before = _requests_by_route(srv.url)
            assert c.put_kv(spec, seqs[i], make_kv(spec, 64, seed=i)) == 64
            after = _requests_by_route(srv.url)
            made = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
            assert made == {"/v1/kv/put-staged/{lease_id}": 1}, made
        assert {e.tier for s in seqs[:4] for e in srv.store.entries() if e.key in set(_keys(spec, s))} == {"memory"}
        srv.store.delete_blocks([e.key for e in srv.store.entries() if e.tier == top.name])  # room again
        later[0] += colocated_puts.NO_ROOM_RETRY_S
        assert c.put_kv(spec, seqs[4], make_kv(spec, 64, seed=4)) == 64
        assert {e.tier for e in srv.store.entries() if e.key in set(_keys(spec, seqs[4]))} == {top.name}
        for i, s in enumerate(seqs):
            got, n_got = c.get_kv(spec, s)
            assert n_got == 64 and torch.equal(got, make_kv(spec, 64, seed=i))
        assert c.stats.shm_puts == 5 and c.stats.http_puts == 0


def _keys(spec, tokens) -> list[bytes]:
    from kvstore.keys import block_hashes

    return block_hashes(spec, tokens, "default")


def test_a_pooled_put_whose_copy_fails_keeps_its_pool_slots(server, spec, monkeypatch):
    """A fault in the copy into pool slots (the kv cannot be encoded): the put raises, sends
    nothing, and the slots it took are the pool's again, for the next put."""
    from client_sdk import arena as arena_mod
    from kvstore.errors import InvalidKV

    with KVClient(server.url, plan=False) as c:
        assert c.put_kv(spec, list(range(12_000, 12_064)), make_kv(spec, 64)) == 64  # the pool is granted
        pool = c.colocation.arena.pool
        free, lent = len(pool), server.store.reservations.pools.lent_bytes()
        assert free >= 4

        def failing(self, blocks, spec, kv):  # the fault
            raise InvalidKV("injected: the copy failed")
        with monkeypatch.context() as m:
            m.setattr(arena_mod.Arena, "write_reserved", failing)
            with pytest.raises(InvalidKV, match="injected"):
                c.put_kv(spec, list(range(13_000, 13_064)), make_kv(spec, 64, seed=1))
        assert len(pool) == free and server.store.reservations.pools.lent_bytes() == lent  # nothing lost
        kv = make_kv(spec, 64, seed=1)
        assert c.put_kv(spec, list(range(13_000, 13_064)), kv) == 64 and c.stats.last_medium == "shm"
        assert len(pool) == free  # the put used 4 of them and was lent 4 back
        got, n = c.get_kv(spec, list(range(13_000, 13_064)))
        assert n == 64 and torch.equal(got, kv)


def test_a_pooled_put_the_server_refuses_keeps_its_pool_slots(server, spec, monkeypatch):
    """Checksums that are not the frames' (a writer's bug): the server refuses the put with
    CorruptFrame and puts the slots back in the pool, and so does the client."""
    from client_sdk import arena as arena_mod
    from kvstore.errors import CorruptFrame

    with KVClient(server.url, plan=False) as c:
        assert c.put_kv(spec, list(range(14_000, 14_064)), make_kv(spec, 64)) == 64
        pool = c.colocation.arena.pool
        free, lent = len(pool), server.store.reservations.pools.lent_bytes()
        real = arena_mod.Arena.write_reserved

        def lying(self, blocks, spec, kv):  # the fault: every checksum off by one
            return [(k + 1) % (1 << 64) for k in real(self, blocks, spec, kv)]
        with monkeypatch.context() as m:
            m.setattr(arena_mod.Arena, "write_reserved", lying)
            with pytest.raises(CorruptFrame):
                c.put_kv(spec, list(range(15_000, 15_064)), make_kv(spec, 64, seed=2))
        assert len(pool) == free and server.store.reservations.pools.lent_bytes() == lent
        assert c.lookup(spec, list(range(15_000, 15_064))) == 0
        kv = make_kv(spec, 64, seed=2)
        assert c.put_kv(spec, list(range(15_000, 15_064)), kv) == 64 and len(pool) == free
        got, n = c.get_kv(spec, list(range(15_000, 15_064)))
        assert n == 64 and torch.equal(got, kv)
