"""Blocks by key for another system's cache (SGLang's pages, LMCache's chunks): exists, reads into the
caller's memory, writes in place, pins, each co-located (shared memory) and remote (HTTP)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from client_sdk import KVClient
from kvstore import codec
from kvstore.errors import InvalidInput
from kvstore.keys import block_hashes, block_meta, name_fingerprint, named_key
from tests.server.conftest import ACME, BETA, TOKENS

NS = "acme"
FP = name_fingerprint("test", "pages")


def keys(n: int, ns: str = NS) -> list[bytes]:
    return [named_key(ns, "test", f"page-{i}") for i in range(n)]


def payloads(n: int, size: int = 4096) -> list[bytes]:
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            .numpy().tobytes() for i in range(n)]


def put(client: KVClient, ks: list[bytes], data: list[bytes], ns: str = NS, **kw) -> int:
    metas = [block_meta(ns, FP, i) for i in range(len(ks))]
    at = [codec.raw_payload_offset(1, len(m)) for m in metas]

    def writer(i: int, view: memoryview) -> int:
        view[at[i]:at[i] + len(data[i])] = data[i]
        return codec.seal_raw(view, "uint8", (len(data[i]),), metas[i])
    return client.put_blocks_with(ks, [a + len(d) for a, d in zip(at, data)], writer, **kw)


def get(client: KVClient, ks: list[bytes]) -> tuple[list[bool], dict[int, bytes]]:
    got: dict[int, bytes] = {}

    def sink(i: int, header, payload: memoryview) -> None:
        assert header.dtype == "uint8"
        got[i] = bytes(payload)
    return client.get_blocks_into(ks, sink), got


@pytest.fixture
def tenant_server(serve_app):
    return serve_app(tokens=json.dumps(TOKENS))


@pytest.mark.parametrize("colocated", [True, False])
def test_blocks_written_in_place_read_back_identical(tenant_server, colocated):
    ks, data = keys(6), payloads(6)
    with KVClient(tenant_server.url, token=ACME, namespace=NS, colocated=colocated) as c:
        assert c.blocks_exist(ks) == [False] * 6
        assert put(c, ks[:4], data[:4], make_room=True) == 4
        assert c.blocks_exist(ks) == [True] * 4 + [False] * 2
        found, got = get(c, ks)
        assert found == [True] * 4 + [False] * 2 and [got[i] for i in range(4)] == data[:4]
        found, got = get(c, ks[:4])  # a repeat read (co-located: copied, not hashed again)
        assert found == [True] * 4 and [got[i] for i in range(4)] == data[:4]
        if colocated:
            assert c.stats.shm_puts == 1 and c.stats.shm_frames_verified == 4 and c.stats.shm_frames_copied == 4
        else:
            assert c.stats.shm_puts == 0 and c.stats.shm_gets == 0


def test_another_namespaces_blocks_are_invisible(tenant_server):
    ks, data = keys(3), payloads(3)
    with KVClient(tenant_server.url, token=ACME, namespace=NS) as acme, \
            KVClient(tenant_server.url, token=ACME, namespace="shared") as shared:
        put(acme, ks, data)
        assert shared.blocks_exist(ks) == [False] * 3
        assert get(shared, ks)[0] == [False] * 3
        assert shared.pin_blocks(ks, 60) == 0


def test_a_frame_naming_another_namespace_is_refused(tenant_server):
    ks, data = keys(1), payloads(1)
    with KVClient(tenant_server.url, token=BETA, namespace="beta") as beta:
        with pytest.raises(InvalidInput, match="namespace"):
            put(beta, ks, data, ns=NS)  # beta writing a frame that claims acme's namespace
    with KVClient(tenant_server.url, token=ACME, namespace=NS) as acme:
        assert acme.blocks_exist(ks) == [False]


def test_put_staged_checks_its_body(tenant_server):
    headers = {"authorization": f"Bearer {ACME}", "x-kv-namespace": NS}
    url = f"{tenant_server.url}/v1/blocks/put-staged/nope"
    bad = [({"blocks": "x"}, 422), ({"blocks": [{"key": "00", "offset": 0, "length": 1}]}, 422),
           ({"blocks": [{"key": "00" * 32, "offset": -1, "length": 1}]}, 400),
           ({"blocks": [], "make_room": "yes"}, 422),
           ({"blocks": [{"key": "00" * 32, "offset": 0, "length": 8}]}, 403)]  # no such lease
    for body, status in bad:
        resp = httpx.post(url, json=body, headers=headers)
        assert resp.status_code == status, (body, resp.text)
    assert httpx.get(f"{tenant_server.url}/healthz").status_code == 200


def test_pins_hold_blocks_through_an_eviction_and_are_bounded(serve_app):
    srv = serve_app()
    ks, data = keys(3), payloads(3)
    with KVClient(srv.url, namespace=NS) as c:
        put(c, ks, data)
        assert c.pin_blocks(ks[:2], 60) == 2
        c.admin.evict(namespace=NS)
        assert c.blocks_exist(ks) == [True, True, False]
        assert c.unpin_blocks(ks[:2]) == 2
        c.admin.evict(namespace=NS)
        assert c.blocks_exist(ks) == [False] * 3
        for ttl in (0, -1, 3601, "60", True):
            with pytest.raises(InvalidInput, match="ttl_s"):
                c.pin_blocks(ks, ttl)


def test_a_remembered_slot_that_changed_is_asked_for_again(serve_app):
    """A repeat read copies from remembered slots without asking the server; once the block
    is replaced (its slot freed, the range reused), the remembered slot reads as changed and
    the client asks again: the new bytes, never the old ones."""
    srv = serve_app()
    ks, old, new = keys(4), payloads(4), payloads(8)[4:]
    with KVClient(srv.url, namespace=NS) as c:
        put(c, ks, old)
        assert get(c, ks)[1] == dict(enumerate(old))
        copied = c.stats.shm_frames_copied
        assert get(c, ks)[1] == dict(enumerate(old)) and c.stats.shm_frames_copied == copied + 4
        assert c.blocks_exist(ks) == [True] * 4  # answered from the remembered slots
        assert c.delete_blocks(ks) == 4
        assert c.blocks_exist(ks) == [False] * 4  # their slots changed: asked again
        put(c, ks, new)
        found, got = get(c, ks)
        assert found == [True] * 4 and got == dict(enumerate(new))
        get(c, ks)
        get(c, ks)  # two reads the server does not see
        c.close()  # sends the pending access report
    with KVClient(srv.url, namespace=NS) as c:
        hits = [c.admin.explain(k)["hits"] for k in ks]
    # three reads of the new blocks, none asked of the server (the first found them in the arena's
    # key index), all reported; plus the old blocks' two reads, reported by key after the blocks
    # were replaced: reports name keys, not generations
    assert hits == [5] * 4


def test_the_async_client_checks_pins_and_puts_with_room(serve_app):
    import asyncio

    from client_sdk import AsyncKVClient

    srv = serve_app()
    ks, data = keys(3), payloads(3)
    with KVClient(srv.url, namespace=NS, colocated=False) as c:
        put(c, ks, data, make_room=True)  # remote: the batch put, with ?make_room=true

    async def main() -> None:
        async with AsyncKVClient(srv.url, namespace=NS) as a:
            assert await a.blocks_exist(ks + keys(4)[3:]) == [True, True, True, False]
            assert await a.pin_blocks(ks[:1], 30) == 1
            assert await a.unpin_blocks(ks[:1]) == 1
            frames = await a.get_blocks(ks)
            assert await a.delete_blocks(ks) == 3
            assert await a.put_blocks(list(zip(ks, frames)), make_room=True) == 3

    asyncio.run(main())
    with KVClient(srv.url, namespace=NS) as c:
        assert get(c, ks)[1] == dict(enumerate(data))


def test_a_damaged_block_read_over_http_is_dropped(serve_app):
    """The batch get verifies what it serves: a damaged frame is a miss and leaves the index, so
    the owner's next put stores it again (before, every reader refused it in turn)."""
    srv = serve_app()
    ks, data = keys(2), payloads(2)
    with KVClient(srv.url, namespace=NS, colocated=False) as c:
        put(c, ks, data)
        shm = next(t for t in srv.store.tiers if t.name == "shm")
        handle = shm.handle(ks[1])
        shm._data[handle.offset + handle.length // 2] ^= 0xFF  # fault: a payload byte flips in memory
        found, got = get(c, ks)
        assert found == [True, False] and got == {0: data[0]}
        assert c.blocks_exist(ks) == [True, False]
        put(c, ks, data)
        assert get(c, ks)[1] == dict(enumerate(data))


def test_a_colocated_backend_put_makes_one_request_into_its_pool(tenant_server):
    """Pages go straight into pool slots and ``/v1/blocks/put-pooled`` publishes them by key: one
    request a put once the pool is lent (no staging copy); refused frames store nothing and leave
    the pool usable."""
    from tests.client_sdk.test_reserved_put import _requests_by_route

    ks, data = keys(12), payloads(12)
    with KVClient(tenant_server.url, token=ACME, namespace=NS) as c:
        assert put(c, ks[:4], data[:4]) == 4  # the first asks for slots too
        for i in (4, 8):
            before = _requests_by_route(tenant_server.url)
            assert put(c, ks[i:i + 4], data[i:i + 4]) == 4
            after = _requests_by_route(tenant_server.url)
            made = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
            assert made == {"/v1/blocks/put-pooled": 1}, made
        found, got = get(c, ks)
        assert found == [True] * 12 and [got[i] for i in range(12)] == data
        assert c.stats.shm_puts == 3 and c.stats.http_puts == 0
        other = keys(2, "beta")
        with pytest.raises(InvalidInput, match="namespace"):  # a frame naming another tenant's namespace
            put(c, other, payloads(2), ns="beta")
        assert c.blocks_exist(other) == [False, False]
        more = keys(14)[12:]
        before = _requests_by_route(tenant_server.url)
        assert put(c, more, payloads(2)) == 2  # the refused put's slots went back to the pool
        assert sum(_requests_by_route(tenant_server.url).values()) - sum(before.values()) == 1
    assert tenant_server.store.reservations.pools.lent_bytes() == 0  # closing gave the pool back


def test_bad_pooled_block_puts_are_4xx_naming_the_field(tenant_server):
    import os

    q = f"pid={os.getpid()}&pool=b1&count=1&slot_bytes=8192"
    h = {"authorization": f"Bearer {ACME}", "x-kv-namespace": NS}
    with httpx.Client(base_url=tenant_server.url, timeout=10, headers=h) as http:
        r = http.post(f"/v1/blocks/put-pooled?{q}", json={"blocks": []})
        assert r.status_code == 200 and len(r.json()["slots"]) == 1, r.text
        slot = r.json()["slots"][0]
        k = keys(1)[0].hex()
        cases = [
            (q.replace("slot_bytes=8192", "slot_bytes=12"), {"blocks": []}, "slot_bytes"),
            (q.replace("count=1", "count=99999"), {"blocks": []}, "count"),
            (q.replace("pool=b1", "pool=a/b"), {"blocks": []}, "pool"),
            (q, {"blocks": "x"}, "blocks"),
            (q, {"blocks": [{"key": k, "offset": -1, "checksum": 0}]}, "blocks[0]"),
            (q, {"blocks": [{"key": "zz", "offset": slot["offset"], "checksum": 0}]}, "blocks[0].key"),
        ]
        for query, body, field in cases:
            r = http.post(f"/v1/blocks/put-pooled?{query}", json=body)
            assert r.status_code in (400, 422) and r.json()["error"].get("field") == field, (field, r.text)
        r = http.post(f"/v1/blocks/put-pooled?{q}", json={"blocks": [{"key": k, "offset": slot["offset"],
                                                                           "checksum": 1}]})
        assert r.status_code == 422 and r.json()["error"]["type"] == "CorruptFrame"  # the slot holds no frame
        r = http.post(f"/v1/blocks/put-pooled?{q}", json={"blocks": [{"key": k, "offset": 64, "checksum": 1}]})
        assert r.status_code == 403  # not a slot of this pool
        assert http.delete(f"/v1/kv/pool?pid={os.getpid()}&pool=b1").json() == {"released": 1}
    assert tenant_server.store.frames.current_entry(keys(1)[0], NS) is None


def test_engine_names_are_checked_scoped_to_the_namespace_and_kept_on_the_entry(tenant_server):
    """``POST /v1/blocks/names``: bad bodies are 4xx naming the field; another tenant's blocks are
    skipped; a named block keeps its engine name across a rewrite of the same key."""
    from tests.conftest import make_kv, make_spec

    spec = make_spec()
    toks = list(range(2 * spec.block_tokens))
    ks = [k.hex() for k in block_hashes(spec, toks, NS)]
    with KVClient(tenant_server.url, token=ACME, namespace=NS, colocated=False) as c:
        assert c.put_kv(spec, toks, make_kv(spec, len(toks))) == len(toks)
    h = {"authorization": f"Bearer {ACME}", "x-kv-namespace": NS}
    with httpx.Client(base_url=tenant_server.url, timeout=10, headers=h) as http:
        ok = {"key": ks[0], "engine_hash": "ab" * 32}
        cases = [
            ({"blocks": []}, "blocks"),
            ({"blocks": ["x"]}, "blocks[0]"),
            ({"blocks": [{"key": "zz", "engine_hash": "ab"}]}, "blocks[0].key"),
            ({"blocks": [{"key": ks[0], "engine_hash": "xyz"}]}, "blocks[0].engine_hash"),
            ({"blocks": [{"key": ks[0], "engine_hash": -1}]}, "blocks[0].engine_hash"),
            ({"blocks": [{"key": ks[0], "engine_hash": 1 << 64}]}, "blocks[0].engine_hash"),
            ({"blocks": [ok], "parent": True}, "parent"),
            ({"blocks": [ok, {"key": ks[1], "engine_hash": 7}], "tokens": [1, 2, 3]}, "tokens"),
            ({"blocks": [ok], "tokens": "abc"}, "tokens"),
        ]
        for body, field in cases:
            r = http.post("/v1/blocks/names", json=body)
            assert r.status_code in (400, 413, 422) and r.json()["error"].get("field") == field, (field, r.text)
        r = http.post("/v1/blocks/names", json={"blocks": [ok, {"key": ks[1], "engine_hash": 7}]})
        assert r.json() == {"named": 2, "requested": 2}
        r = http.post("/v1/blocks/names", headers={"authorization": f"Bearer {BETA}", "x-kv-namespace": "beta"},
                      json={"blocks": [{"key": ks[0], "engine_hash": "cd" * 32}]})
        assert r.json() == {"named": 0, "requested": 1}  # acme's block, seen from beta: as if absent
    entry = tenant_server.store.core.entry(bytes.fromhex(ks[0]))
    assert entry.engine_hash == bytes.fromhex("ab" * 32)
    assert tenant_server.store.core.entry(bytes.fromhex(ks[1])).engine_hash == 7
    with KVClient(tenant_server.url, token=ACME, namespace=NS, colocated=False) as c:
        c.delete_blocks([bytes.fromhex(ks[1])])
        c.put_kv(spec, toks, make_kv(spec, len(toks), 1))  # block 1 anew: unnamed; block 0 stays
    assert tenant_server.store.core.entry(bytes.fromhex(ks[1])).engine_hash is None
    assert tenant_server.store.core.entry(bytes.fromhex(ks[0])).engine_hash == bytes.fromhex("ab" * 32)
