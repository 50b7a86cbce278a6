"""The co-located path: slot handles read straight from the shm arena, puts through staging."""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
import torch

from client_sdk import Forbidden, KVClient, ServiceError
from client_sdk.arena import Arena
from kvstore.keys import block_hashes
from tests.conftest import make_kv, make_spec
from tests.server.conftest import ACME, TOKENS, make_store
from tests.server.test_ops import _metric


def test_the_shm_path_is_used_on_the_same_host(server, spec):
    tokens = list(range(100))
    kv = make_kv(spec, 100)
    with KVClient(server.url, plan=False) as c:
        assert c.put_kv(spec, tokens, kv) == 96
        got, n = c.get_kv(spec, tokens)
        assert n == 96 and torch.equal(got, kv[:, :, :, :96])
        assert c.stats.shm_puts == 1 and c.stats.shm_gets == 1 and c.stats.http_gets == 0
        assert c.stats.last_medium == "shm" and c.stats.shm_blocks_fetched_over_http == 0
        assert c.stats.shm_cached_gets == 1  # found in the arena's shared key index: no request
    with KVClient(server.url, plan=False) as c:  # the first closed: its read was reported
        text = c.metrics()
    assert _metric(text, "kvstore_colocated_ops_total", op="get") == 1
    assert _metric(text, "kvstore_colocated_ops_total", op="put") == 1
    # the full blocks' bytes: a reserved put writes those alone into the arena
    assert _metric(text, "kvstore_transfer_bytes_total", direction="in", medium="shm") == kv[:, :, :, :96].numel() * 2
    stats = server.store.stats()
    assert stats.counters.get_calls == 1 and stats.counters.tokens_hit == 96  # counted like get_kv
    assert server.store.entry(block_hashes(spec, tokens)[0]).hits == 1


def test_the_http_path_when_told_the_server_is_remote(server, spec):
    tokens = list(range(64))
    with KVClient(server.url, colocated=False) as c:
        c.put_kv(spec, tokens, make_kv(spec, 64))
        c.get_kv(spec, tokens)
        assert c.stats.http_puts == 1 and c.stats.http_gets == 1 and c.stats.shm_gets == c.stats.shm_puts == 0
        text = c.metrics()
    with pytest.raises(AssertionError):
        _metric(text, "kvstore_colocated_ops_total", op="get")


def test_blocks_outside_the_arena_come_over_http(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        keys = block_hashes(spec, tokens)
        assert server.store.migrate(keys[1], "memory")
        got, n = c.get_kv(spec, tokens)
        assert n == 64 and torch.equal(got, kv)
        assert c.stats.shm_gets == 1 and c.stats.shm_blocks_fetched_over_http == 1


def test_a_slot_recycled_under_the_reader_is_caught_by_its_generation(server, spec, monkeypatch):
    tokens = list(range(48))
    kv = make_kv(spec, 48)
    keys = block_hashes(spec, tokens)
    real = Arena.fill_from_handles

    def move_first(self, blocks, out, bt, stats=None, dst=None, done=None):  # fault: placement moves a block after it was found
        server.store.migrate(keys[0], "memory")
        server.store.migrate(keys[0], "shm")
        return real(self, blocks, out, bt, stats, dst, done)

    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        monkeypatch.setattr(Arena, "fill_from_handles", move_first)
        got, n = c.get_kv(spec, tokens)
    assert n == 48 and torch.equal(got, kv)
    assert c.stats.shm_blocks_fetched_over_http == 1


def test_a_block_deleted_under_the_reader_shortens_the_prefix(server, spec, monkeypatch):
    tokens = list(range(48))
    keys = block_hashes(spec, tokens)
    real = Arena.fill_from_handles

    def delete_middle(self, blocks, out, bt, stats=None, dst=None, done=None):
        server.store.delete_blocks([keys[1]])
        return real(self, blocks, out, bt, stats, dst, done)

    kv = make_kv(spec, 48)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        monkeypatch.setattr(Arena, "fill_from_handles", delete_middle)
        got, n = c.get_kv(spec, tokens)
    assert n == 16 and torch.equal(got, kv[:, :, :, :16])


def test_an_expired_staging_lease_is_renewed(serve_app, spec):
    server = serve_app(reserved_puts=False)  # puts go through staging
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, list(range(32)), make_kv(spec, 32))
        (lease,) = c.colocation.arena.leases
        assert server.svc.staging.release(lease["lease"], "anonymous")  # fault: it expired server-side
        kv = make_kv(spec, 32, seed=3)
        assert c.put_kv(spec, list(range(100, 132)), kv) == 32
        (renewed,) = c.colocation.arena.leases
        assert renewed["lease"] != lease["lease"] and c.stats.shm_puts == 2
        assert torch.equal(c.get_kv(spec, list(range(100, 132)))[0], kv)


def test_a_full_staging_area_falls_back_to_http(serve_app):
    srv = serve_app(staging_bytes="1MiB", reserved_puts=False)
    spec = make_spec(num_layers=32, head_dim=128)  # 512 KiB a block
    with KVClient(srv.url, plan=False) as c:
        kv = make_kv(spec, 48)
        assert c.put_kv(spec, list(range(48)), kv) == 48
        assert c.stats.http_puts == 1 and c.stats.shm_puts == 0
        assert torch.equal(c.get_kv(spec, list(range(48)))[0], kv)
        assert c.stats.shm_gets == 1


def test_colocated_true_without_an_offer_is_an_error(serve_app, spec):
    srv = serve_app(make_store(), colocated=False)
    info = httpx.get(f"{srv.url}/v1/info").json()
    assert info["colocated"] is None
    with KVClient(srv.url, colocated=True) as c, pytest.raises(ServiceError, match="offers no shm path"):
        c.get_kv(spec, list(range(16)))
    with KVClient(srv.url, plan=False) as c:  # auto: HTTP
        c.put_kv(spec, list(range(16)), make_kv(spec, 16))
        assert c.stats.http_puts == 1
    resp = httpx.post(f"{srv.url}/v1/kv/handles", json={"spec": spec.to_dict(), "tokens": [1]})
    assert resp.status_code == 404


def test_handles_respect_tenants(serve_app, spec):
    srv = serve_app(tokens=json.dumps(TOKENS))
    with KVClient(srv.url, token=ACME, namespace="acme") as acme:
        acme.put_kv(spec, list(range(32)), make_kv(spec, 32))
        assert acme.stats.shm_puts == 1
    with KVClient(srv.url, token=ACME, namespace="beta") as wrong, pytest.raises(Forbidden):
        wrong.get_kv(spec, list(range(32)))
    resp = httpx.post(f"{srv.url}/v1/kv/handles", json={"spec": spec.to_dict(), "tokens": list(range(32))},
                      headers={"authorization": "Bearer nope-nope-nope"})
    assert resp.status_code == 401


def test_segments_are_unlinked_at_shutdown(serve_app):
    srv = serve_app()
    svc = srv.svc
    paths = [os.path.join("/dev/shm", svc.shm.segment), svc.staging.path]
    assert all(os.path.exists(p) for p in paths)
    srv.stop()
    assert not any(os.path.exists(p) for p in paths)


def test_concurrent_puts_from_one_client_never_share_a_staging_range(serve_app):
    import asyncio
    import threading

    from client_sdk import AsyncKVClient

    server = serve_app(reserved_puts=False)  # puts go through staging
    spec = make_spec(num_layers=8, head_dim=64)  # 64 KiB a block
    seqs = [list(range(i * 1000, i * 1000 + 64)) for i in range(8)]
    kvs = [make_kv(spec, 64, seed=i) for i in range(8)]
    with KVClient(server.url, namespace="threads", plan=False) as c:
        threads = [threading.Thread(target=c.put_kv, args=(spec, s, k)) for s, k in zip(seqs, kvs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c.stats.shm_puts == 8 and len(c.colocation.arena.leases) >= 1
        for s, k in zip(seqs, kvs):
            assert torch.equal(c.get_kv(spec, s)[0], k)

    async def main() -> None:
        async with AsyncKVClient(server.url, namespace="tasks", plan=False) as a:
            await asyncio.gather(*(a.put_kv(spec, s, k) for s, k in zip(seqs, kvs)))
            assert a.stats.shm_puts == 8 and len(a.colocation.arena.leases) > 1  # each put in flight had its own
            for s, k in zip(seqs, kvs):
                assert torch.equal((await a.get_kv(spec, s))[0], k)

    asyncio.run(main())


def test_a_repeated_get_uses_remembered_handles_and_reports_its_reads(server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    keys = block_hashes(spec, tokens)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        for _ in range(3):
            got, n = c.get_kv(spec, tokens + [1, 2])
            assert n == 64 and torch.equal(got, kv)
        assert c.stats.shm_gets == 3 and c.stats.shm_cached_gets == 3  # none asked the server (shared index)
        assert server.store.stats().counters.get_calls == 0  # not reported yet
        with pytest.raises(AssertionError):  # no sample yet: no get reached the server
            _metric(c.metrics(), "kvstore_colocated_ops_total", op="get")
    # close() reported them: counted as gets, and as reads of each block (placement's heat)
    counters = server.store.stats().counters
    assert counters.get_calls == 3 and counters.tokens_hit == 3 * 64 and counters.tokens_requested == 3 * 64
    assert server.store.entry(keys[0]).hits == 3 and server.store.explain(keys[3])["accesses"] == 4  # put + 3
    with KVClient(server.url, plan=False) as c:
        assert _metric(c.metrics(), "kvstore_colocated_ops_total", op="get") == 3


def test_reports_go_out_in_batches_while_the_client_runs(server, spec):
    tokens = list(range(16))
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, make_kv(spec, 16))
        c.colocation.arena.accesses.max_keys = 4
        for _ in range(4):  # none asks the server; the 4 fill a report
            c.get_kv(spec, tokens)
        assert c.stats.shm_cached_gets == 4
        assert c.wait_reports(10)  # reports go out from a thread: a get never waits on one
        assert server.store.stats().counters.get_calls == 4
        c.get_kv(spec, tokens)
        assert c.wait_reports(10)
        assert server.store.stats().counters.get_calls == 4  # 1 pending: under max_keys and max_age_s
    assert server.store.stats().counters.get_calls == 5  # close() sent it
    assert server.store.entry(block_hashes(spec, tokens)[0]).hits == 5  # 4 + 1 reads sent as one key each, counted


@pytest.mark.parametrize("change", ["delete", "move"])
def test_a_remembered_handle_gone_stale_is_never_read(server, spec, change):
    """Delete or move a block after the client remembered its handle: the generation check
    turns the cached read into a miss, and the server's answer is what the client returns."""
    tokens = list(range(48))
    kv = make_kv(spec, 48)
    keys = block_hashes(spec, tokens)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        c.get_kv(spec, tokens)
        assert len(c.colocation.arena.handles) == 3 and c.stats.shm_cached_gets == 1
        if change == "delete":
            server.store.delete_blocks([keys[1]])
            got, n = c.get_kv(spec, tokens)
            assert n == 16 and torch.equal(got, kv[:, :, :, :16])
            # block 1 is in neither the remembered slots nor the index: the server was asked
            assert c.stats.shm_cached_gets == 1
        else:
            for key in keys:  # out and back: every block in a new slot, the old slots reusable
                assert server.store.migrate(key, "memory") and server.store.migrate(key, "shm")
            c.put_kv(spec, list(range(1000, 1048)), make_kv(spec, 48, seed=9))  # reuse the freed ranges
            got, n = c.get_kv(spec, tokens)
            assert n == 48 and torch.equal(got, kv)  # the stale slots were not read: the index named the new ones
            assert c.stats.shm_cached_gets == 2
        # After the delete only block 0 is in the arena: a get of all 48 tokens must still ask,
        # since the server may hold block 1 again by now (a lower tier)
        before = c.stats.shm_cached_gets
        c.get_kv(spec, tokens[:16] if change == "delete" else tokens)
        assert c.stats.shm_cached_gets == before + 1


@pytest.fixture
def stored64(server, spec):
    """A client, after it put 64 tokens: (client, tokens, kv)."""
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        yield c, tokens, kv


def test_a_handle_is_verified_on_its_first_read_and_copied_after(server, spec, stored64):
    c, tokens, kv = stored64
    out = torch.empty(spec.bytes_per_token * 64, dtype=torch.uint8)
    for _ in range(3):
        got, n = c.get_kv(spec, tokens, out=out)
        assert n == 64 and torch.equal(got, kv)
    assert c.stats.shm_frames_verified == 4 and c.stats.shm_frames_copied == 8
    keys = block_hashes(spec, tokens)
    server.store.migrate(keys[2], "memory")  # the slot's generation changes: re-asked, re-verified
    server.store.migrate(keys[2], "shm")
    got, n = c.get_kv(spec, tokens)
    assert n == 64 and torch.equal(got, kv)
    assert c.stats.shm_frames_verified > 4


def test_out_buffers_may_change_between_gets(spec, stored64):
    c, tokens, kv = stored64
    a = torch.empty(spec.bytes_per_token * 64, dtype=torch.uint8)
    b = torch.empty(spec.bytes_per_token * 64, dtype=torch.uint8)
    for out, toks, n_want in ((a, tokens, 64), (b, tokens, 64), (a, tokens[:32], 32), (a, tokens, 64)):
        got, n = c.get_kv(spec, toks, out=out)
        assert n == n_want and torch.equal(got, kv[:, :, :, :n_want])
        assert got.data_ptr() == out.data_ptr()  # a view of the caller's buffer, not a copy
    got.transpose_(0, 1)  # the caller reshapes the returned view in place: the next get is not fooled
    got, n = c.get_kv(spec, tokens, out=a)
    assert n == 64 and torch.equal(got, kv) and c.stats.shm_cached_gets == 5  # none asked the server


def test_a_frame_damaged_before_its_first_read_is_refused(server, spec):
    tokens = list(range(32))
    kv = make_kv(spec, 32)
    with KVClient(server.url, plan=False) as c:
        c.put_kv(spec, tokens, kv)
        shm = next(t for t in server.store.tiers if t.name == "shm")
        handle = shm.handle(block_hashes(spec, tokens)[1])
        # fault: a payload byte flips in the arena after the server encoded and published the frame
        shm._data[handle.offset + handle.length - 1] ^= 0xFF
        got, n = c.get_kv(spec, tokens)
        assert c.stats.shm_frames_verified >= 1 and c.stats.shm_frames_copied == 0  # block 1 failed its check
        assert n == 16 and torch.equal(got, kv[:, :, :, :16])  # and the server refused it over HTTP too


def test_touch_counts_only_the_callers_namespace_and_checks_its_input(serve_app, spec):
    srv = serve_app(tokens=json.dumps(TOKENS))
    tokens = list(range(32))
    with KVClient(srv.url, token=ACME, namespace="acme") as acme:
        acme.put_kv(spec, tokens, make_kv(spec, 32))
    acme_keys = [k.hex() for k in block_hashes(spec, tokens, "acme")]
    headers = {"authorization": f"Bearer {ACME}", "x-kv-namespace": "shared"}
    report = {"keys": acme_keys, "gets": 1, "tokens_requested": 32, "tokens_hit": 32}
    resp = httpx.post(f"{srv.url}/v1/kv/touch", json=report, headers=headers)
    assert resp.status_code == 200 and resp.json() == {"touched": 0}  # acme's blocks, but not in "shared"
    assert srv.store.entry(block_hashes(spec, tokens, "acme")[0]).hits == 0
    headers["x-kv-namespace"] = "acme"
    assert httpx.post(f"{srv.url}/v1/kv/touch", json=report, headers=headers).json() == {"touched": 2}
    counted = {**report, "counts": [5, 1]}
    assert httpx.post(f"{srv.url}/v1/kv/touch", json=counted, headers=headers).json() == {"touched": 2}
    assert srv.store.entry(block_hashes(spec, tokens, "acme")[0]).hits == 1 + 5
    assert srv.store.entry(block_hashes(spec, tokens, "acme")[1]).hits == 1 + 1
    for bad, field in (({**report, "gets": -1}, "gets"), ({**report, "tokens_hit": 64}, "tokens_hit"),
                       ({**report, "keys": ["zz"]}, "keys"), ({"keys": []}, "gets"),
                       ({**report, "counts": [1]}, "counts"), ({**report, "counts": [0, 1]}, "counts"),
                       ({**report, "counts": [1, True]}, "counts"), ({**report, "counts": "2"}, "counts")):
        resp = httpx.post(f"{srv.url}/v1/kv/touch", json=bad, headers=headers)
        assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
    resp = httpx.post(f"{srv.url}/v1/kv/touch", json=report)
    assert resp.status_code == 401


def test_the_async_client_remembers_handles_too(server, spec):
    import asyncio

    from client_sdk import AsyncKVClient

    tokens = list(range(32))
    kv = make_kv(spec, 32)

    async def main() -> AsyncKVClient:
        async with AsyncKVClient(server.url, plan=False) as c:
            await c.put_kv(spec, tokens, kv)
            for _ in range(2):
                got, n = await c.get_kv(spec, tokens)
                assert n == 32 and torch.equal(got, kv)
            return c

    c = asyncio.run(main())
    assert c.stats.shm_gets == 2 and c.stats.shm_cached_gets == 2  # the shared key index: no request
    assert server.store.stats().counters.get_calls == 2  # aclose reported them


@pytest.mark.parametrize("plan", [False, True])
def test_a_client_outlives_a_server_restart_without_writing_into_the_old_arena(tmp_path, spec, plan):
    """A restarted server has new shm segments: a client that kept the old ones mapped wrote its
    staged puts where the new server never looks, and the server stored whatever its own staging
    held (found by the vLLM connector's restart test). Now the segment names are checked: that put
    goes over HTTP, and the next call maps the new arena. Both clients, planner on and off."""
    import asyncio

    from client_sdk import AsyncKVClient
    from bench.reliability_kit.serve_process import ServeProcess, small_env
    from bench.serving import free_port

    env, port = small_env(tmp_path / "data"), free_port()

    async def scenario() -> None:
        first = ServeProcess(env, port=port).start()
        c, a = KVClient(first.url, plan=plan), AsyncKVClient(first.url, plan=plan)
        second = None
        try:
            before = make_kv(spec, 64, seed=1)
            assert c.put_kv(spec, list(range(64)), before) == 64 and c.stats.last_medium == "shm"
            assert await a.put_kv(spec, list(range(500, 564)), before) == 64 and a.stats.last_medium == "shm"
            first.kill()
            second = ServeProcess(env, port=port).start()
            sync_tokens, async_tokens, kv = list(range(100, 164)), list(range(300, 364)), make_kv(spec, 64, seed=2)
            assert c.put_kv(spec, sync_tokens, kv) == 64
            assert await a.put_kv(spec, async_tokens, kv) == 64
            with KVClient(second.url, colocated=False) as fresh:
                for toks in (sync_tokens, async_tokens):
                    got, n = fresh.get_kv(spec, toks)
                    assert n == 64 and torch.equal(got, kv)  # what was put, not the new staging's bytes
            got, n = c.get_kv(spec, sync_tokens)
            assert n == 64 and torch.equal(got, kv) and c.stats.last_medium == "shm"  # the new arena, mapped
            got, n = await a.get_kv(spec, async_tokens)
            assert n == 64 and torch.equal(got, kv) and a.stats.last_medium == "shm"
            again = make_kv(spec, 64, seed=3)
            assert c.put_kv(spec, list(range(200, 264)), again) == 64 and c.stats.last_medium == "shm"
            got, n = c.get_kv(spec, list(range(200, 264)))
            assert n == 64 and torch.equal(got, again)
        finally:
            c.close()
            await a.aclose()
            first.kill()
            if second is not None:
                second.stop()

    asyncio.run(scenario())


def _requests_served(url: str) -> float:
    """Requests the server answered, by its own count (``kvstore_requests_total``), but the
    ``/metrics`` reads this very count takes."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvstore_requests_total{") and 'route="/metrics"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_first_read_of_stored_blocks_makes_no_request(server, spec, how):
    """A co-located client finds blocks another client put through the arena's shared key index:
    its lookup, existence check, first get and first block read make no request at all (counted
    by the server), and the reads still reach the server's counters once reported."""
    import asyncio

    from client_sdk import AsyncKVClient

    tokens = list(range(64))
    kv = make_kv(spec, 64)
    keys = block_hashes(spec, tokens)
    with KVClient(server.url, plan=False) as writer:
        assert writer.put_kv(spec, tokens, kv) == 64
    got: dict[int, bytes] = {}

    def sink(i, header, payload):
        got[i] = bytes(payload)

    if how == "sync":
        with KVClient(server.url, plan=False) as c:
            assert c.lookup(spec, list(range(1000, 1016))) == 0  # not stored: the server answers (and maps the arena)
            before = _requests_served(server.url)
            assert c.lookup(spec, tokens) == 64
            assert c.blocks_exist(keys) == [True] * 4
            out, n = c.get_kv(spec, tokens)
            assert n == 64 and torch.equal(out, kv)
            assert c.get_blocks_into(keys, sink) == [True] * 4
            assert _requests_served(server.url) == before
            stats = c.stats
    else:
        async def main() -> Any:
            async with AsyncKVClient(server.url, plan=False) as c:
                assert await c.lookup(spec, list(range(1000, 1016))) == 0
                before = _requests_served(server.url)
                assert await c.lookup(spec, tokens) == 64
                assert await c.blocks_exist(keys) == [True] * 4
                out, n = await c.get_kv(spec, tokens)
                assert n == 64 and torch.equal(out, kv)
                assert await c.get_blocks_into(keys, sink) == [True] * 4
                assert _requests_served(server.url) == before
                return c.stats

        stats = asyncio.run(main())
    assert stats.shm_cached_gets == 1 and stats.http_gets == 0
    assert len(got) == 4 and all(len(b) == spec.bytes_per_token * 16 for b in got.values())
    counters = server.store.stats().counters
    # closing reported them: the get (64 tokens) and the block read (by key: no tokens of its own)
    assert counters.get_calls == 2 and counters.tokens_hit == 64
    assert server.store.entry(keys[0]).hits == 2  # the get and the block read, as placement's heat


def test_a_killed_servers_arena_answers_nothing(tmp_path, spec):
    """A server killed outright leaves its arena mapped in the client with every slot still
    published. Reads that need no request must not go on answering from it: the client sees
    the owner gone (its pidfd) and asks the server, which is not there."""
    from bench.reliability_kit.serve_process import ServeProcess, small_env
    from client_sdk import ConnectionFailed

    srv = ServeProcess(small_env(tmp_path)).start()
    tokens = list(range(64))
    keys = block_hashes(spec, tokens)
    try:
        with KVClient(srv.url, plan=False, timeout_s=2, retries=0) as c:
            c.put_kv(spec, tokens, make_kv(spec, 64))
            assert c.lookup(spec, tokens) == 64 and c.blocks_exist(keys) == [True] * 4
            assert c.get_kv(spec, tokens)[1] == 64
            srv.kill()
            for call in (lambda: c.lookup(spec, tokens), lambda: c.blocks_exist(keys),
                         lambda: c.get_kv(spec, tokens)):
                with pytest.raises(ConnectionFailed):
                    call()
    finally:
        srv.stop()


def _mapped(segment: str) -> bool:
    """Whether this process maps the shm segment ``segment`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return any(f"/{segment}" in line for line in maps)


def test_a_long_lived_client_unmaps_a_restarted_servers_old_arena(tmp_path, spec):
    """An engine's client outlives a server restart: the old arena (the old server's memory, its
    segments unlinked) is unmapped once nothing reads it, not at the client's close; a layer
    stream that was reading it keeps it mapped, and reads true bytes, until it is done."""
    import gc

    from bench.reliability_kit.serve_process import ServeProcess, small_env
    from bench.serving import free_port

    env, port = small_env(tmp_path / "data"), free_port()
    first = ServeProcess(env, port=port).start()
    second = None
    c = KVClient(first.url, plan=False)
    try:
        kv = make_kv(spec, 64, seed=4)
        assert c.put_kv(spec, list(range(64)), kv) == 64
        old = c.colocation.arena
        segments = (old.segment, old.staging_segment)
        stream = c.get_kv_layers(spec, list(range(64)))  # layer 0 placed; the rest read the old arena
        del old
        assert all(_mapped(s) for s in segments)
        first.kill()
        second = ServeProcess(env, port=port).start()
        assert c.put_kv(spec, list(range(100, 164)), kv) == 64  # sees the new segments: the old arena retires
        got, n = c.get_kv(spec, list(range(100, 164)))
        assert n == 64 and torch.equal(got, kv) and c.colocation.arena.segment not in segments
        gc.collect()
        assert _mapped(segments[0])  # the stream still reads it
        for layer, kv_layer in stream:
            assert torch.equal(kv_layer, kv[layer])
        del stream, kv_layer
        assert not any(_mapped(s) for s in segments)  # unmapped with the stream's end, the client still open
        got, n = c.get_kv(spec, list(range(100, 164)))
        assert n == 64
    finally:
        c.close()
        first.kill()
        if second is not None:
            second.stop()
