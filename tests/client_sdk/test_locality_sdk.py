"""prefetch, retain, release, handoff and ``put_kv(..., handoff=)`` on both clients, against a real server."""

from __future__ import annotations

import asyncio
import json

import pytest

from client_sdk import AsyncKVClient, KVClient, QuotaExceeded, RetainQuotaExceeded
from kvstore.errors import Forbidden, InvalidInput
from kvstore.keys import block_hashes
from tests.conftest import make_kv
from tests.conftest import wait_until as _until
from tests.server.conftest import ACME, ADMIN, TOKENS, make_store

SHM_BYTES = 512 << 10


@pytest.fixture
def srv(serve_app):
    return serve_app(make_store(shm_bytes=SHM_BYTES), tokens=json.dumps(TOKENS), admin_token=ADMIN)


def _tiers(srv, spec, tokens, namespace="acme"):
    return [getattr(srv.store.entry(k), "tier", None) for k in block_hashes(spec, tokens, namespace)]


@pytest.mark.parametrize("colocated", [False, None], ids=["http", "colocated"])
def test_sync_client_prefetch_retain_release_handoff(srv, spec, colocated):
    tokens = list(range(64))
    with KVClient(srv.url, token=ACME, namespace="acme", colocated=colocated, retries=0) as c:
        assert c.put_kv(spec, tokens, make_kv(spec, 64)) == 64
        for key in block_hashes(spec, tokens, "acme"):
            srv.store.migrate(key, "memory")
        assert c.prefetch(spec, tokens + [1, 2, 3]) == 64
        _until(lambda: _tiers(srv, spec, tokens) == ["shm"] * 4)
        kept = c.retain(spec, tokens, 30, priority=5)
        assert kept["blocks"] == 4 and kept["priority"] == 5 and kept["owner"] == "acme"
        assert kept["quota_bytes"] == SHM_BYTES // 4
        assert c.release(spec, tokens) == 4
        assert c.release(spec, tokens) == 0
        assert c.handoff(spec, tokens) == {"tokens": 64, "blocks": 4, "held": 4, "shared": 0, "to": "here"}
        with pytest.raises(InvalidInput) as err:
            c.handoff(spec, tokens, to="node-b")
        assert err.value.field == "to" and "shared tier" in str(err.value)
        with pytest.raises(InvalidInput) as err:
            c.retain(spec, tokens, -1)
        assert err.value.field == "ttl_s"


def test_quota_exceeded_comes_back_as_its_own_class(srv, spec):
    tokens = list(range(20 * 16))  # 20 blocks: over a quarter of the 512 KiB arena
    with KVClient(srv.url, token=ACME, namespace="acme", colocated=False, retries=0) as c:
        c.put_kv(spec, tokens, make_kv(spec, len(tokens)))
        with pytest.raises(RetainQuotaExceeded) as err:
            c.retain(spec, tokens, 60)
    assert isinstance(err.value, QuotaExceeded) and err.value.status == 507
    assert err.value.quota_bytes == SHM_BYTES // 4 and err.value.retained_bytes == 0
    assert "KVSTORE_RETAIN_QUOTA_BYTES" in str(err.value)
    assert srv.store.placement.retained_bytes() == {}


def test_put_kv_with_a_handoff_places_the_blocks_after_the_put(srv, spec):
    tokens = list(range(48))
    with KVClient(srv.url, token=ACME, namespace="acme", retries=0) as c:
        assert c.put_kv(spec, tokens, make_kv(spec, 48), handoff="here") == 48
        assert all(srv.store.placement.retention(k)["owner"] == "acme" for k in block_hashes(spec, tokens, "acme"))
        with pytest.raises(InvalidInput, match="wait=True"):
            c.put_kv(spec, list(range(500, 548)), make_kv(spec, 48), handoff="here", wait=False)
        with pytest.raises(InvalidInput):  # the put is made first; the hand-off then says why it failed
            c.put_kv(spec, list(range(600, 648)), make_kv(spec, 48), handoff="node-b")
        c.flush()
        assert c.lookup(spec, list(range(500, 548))) == 0  # refused before anything was queued
        assert c.lookup(spec, list(range(600, 648))) == 48
        with pytest.raises(InvalidInput, match="handoff must be"):
            c.put_kv(spec, tokens, make_kv(spec, 48), handoff=3)


def test_another_tenants_namespace_is_forbidden_from_the_sdk(srv, spec):
    tokens = list(range(32))
    with KVClient(srv.url, token=ADMIN, namespace="beta", colocated=False) as admin:
        admin.put_kv(spec, tokens, make_kv(spec, 32))
    with KVClient(srv.url, token=ACME, namespace="beta", colocated=False, retries=0) as c:
        for call in (lambda: c.prefetch(spec, tokens), lambda: c.retain(spec, tokens, 10),
                     lambda: c.release(spec, tokens), lambda: c.handoff(spec, tokens)):
            with pytest.raises(Forbidden):
                call()
    assert srv.store.placement.retained_bytes() == {}


def test_async_client_has_the_same_calls(srv, spec):
    tokens = list(range(64))

    async def main():
        async with AsyncKVClient(srv.url, token=ACME, namespace="acme", colocated=False, retries=0) as c:
            assert await c.put_kv(spec, tokens, make_kv(spec, 64), handoff="here") == 64
            assert await c.prefetch(spec, tokens) == 64
            kept = await c.retain(spec, tokens, 20, priority=1)
            assert kept["blocks"] == 4 and kept["priority"] == 1
            assert await c.release(spec, tokens) == 4
            assert (await c.handoff(spec, tokens, ttl_s=15))["held"] == 4
            with pytest.raises(InvalidInput, match="wait=True"):
                await c.put_kv(spec, tokens, make_kv(spec, 64), handoff="here", wait=False)
            with pytest.raises(RetainQuotaExceeded):
                long = list(range(1000, 1000 + 20 * 16))
                await c.put_kv(spec, long, make_kv(spec, len(long)))
                await c.retain(spec, long, 60)

    asyncio.run(main())
    expires = srv.store.placement.retention(block_hashes(spec, tokens, "acme")[0])["expires_in_s"]
    assert 0 < expires <= 15
