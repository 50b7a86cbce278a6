"""Prefetch, retention and hand-off over REST (``server.locality``), against a real uvicorn.

Tenants: acme and beta as in ``conftest.TOKENS``; gamma's token (in a tokens file) carries its
own ``retain_quota_bytes``. The top tier is a 512 KiB shm arena, so the default retention quota
(a quarter of it) is 128 KiB: 15 blocks of this spec.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kvstore import KVStore
from kvstore.keys import block_hashes
from tests.conftest import make_kv
from tests.conftest import wait_until as _until
from tests.server.conftest import ACME, ADMIN, BETA, TOKENS, make_store
from tiers.memory import MemoryTier
from tiers.redis import RedisTier
from tiers.shm import ShmTier

GAMMA = "gamma-token-0123456789"
SHM_BYTES = 512 << 10


def _auth(token: str | None, namespace: str) -> dict[str, str]:
    return {"x-kv-namespace": namespace, **({"authorization": f"Bearer {token}"} if token else {})}


def _body(spec, tokens, **fields) -> dict:
    return {"spec": spec.to_dict(), "tokens": list(tokens), **fields}


@pytest.fixture
def srv(serve_app, tmp_path):
    tokens = {**TOKENS, GAMMA: {"tenant": "gamma", "namespaces": ["gamma"], "retain_quota_bytes": "16KiB"}}
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(tokens))
    return serve_app(make_store(shm_bytes=SHM_BYTES), tokens_file=str(path), admin_token=ADMIN,
                     handoff_ttl_s=45, retain_max_ttl_s=600)


def _put(srv, spec, tokens, token=ACME, namespace="acme", seed=0):
    from client_sdk import KVClient

    with KVClient(srv.url, token=token, namespace=namespace, colocated=False, retries=0) as c:
        return c.put_kv(spec, tokens, make_kv(spec, len(tokens), seed=seed))


def _post(srv, route, body, token=ACME, namespace="acme", **kw):
    return httpx.post(f"{srv.url}/v1/kv/{route}", json=body, headers=_auth(token, namespace), timeout=10, **kw)


def _tiers(srv, spec, tokens, namespace="acme") -> list[str | None]:
    return [getattr(srv.store.entry(k), "tier", None) for k in block_hashes(spec, tokens, namespace)]


def test_prefetch_answers_at_once_and_brings_the_prefix_to_the_top_tier(srv, spec):
    tokens = list(range(64))
    _put(srv, spec, tokens)
    for key in block_hashes(spec, tokens, "acme"):
        assert srv.store.migrate(key, "memory")
    assert _tiers(srv, spec, tokens) == ["memory"] * 4
    resp = _post(srv, "prefetch", _body(spec, tokens + [7] * 40))  # a longer request: the stored prefix only
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"tokens": 64, "block_tokens": 16}
    _until(lambda: _tiers(srv, spec, tokens) == ["shm"] * 4)
    decisions = httpx.get(f"{srv.url}/admin/prefetches", params={"namespace": "acme"},
                          headers=_auth(ADMIN, "acme")).json()["prefetches"]
    last = decisions[-1]
    assert last["op"] == "prefetch" and last["trigger"] == "requested" and last["blocks"] == 4
    assert last["from"] == {"memory": 4} and last["to"] == "shm" and last["reason"]
    # nothing stored: nothing to bring, and it says so
    assert _post(srv, "prefetch", _body(spec, list(range(900, 964)))).json()["tokens"] == 0


def test_retain_holds_a_conversation_in_the_top_tier_under_churn(srv, spec):
    tokens = list(range(64))
    _put(srv, spec, tokens)
    resp = _post(srv, "retain", _body(spec, tokens, ttl_s=120, priority=3))
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["tokens"] == 64 and got["blocks"] == 4 and got["priority"] == 3 and got["owner"] == "acme"
    assert got["quota_bytes"] == SHM_BYTES // 4 and got["retained_bytes"] == got["bytes"] > 0
    # another tenant fills the top tier three times over
    for i in range(48):
        _put(srv, spec, list(range(10_000 + 100 * i, 10_000 + 100 * i + 64)), token=ADMIN, namespace="churn", seed=i)
    assert {e.tier for e in srv.store.entries() if e.namespace == "churn"} == {"shm", "memory"}
    assert _tiers(srv, spec, tokens) == ["shm"] * 4
    # ... and the retention shows in explain and in the entries
    key = block_hashes(spec, tokens, "acme")[0].hex()
    admin = _auth(ADMIN, "acme")
    explained = httpx.get(f"{srv.url}/admin/explain/{key}", headers=admin).json()["retained"]
    assert explained["owner"] == "acme" and explained["priority"] == 3 and 0 < explained["expires_in_s"] <= 120
    rows = httpx.get(f"{srv.url}/admin/entries", params={"namespace": "acme"}, headers=admin).json()["entries"]
    assert len(rows) == 4 and all(r["retained"]["owner"] == "acme" for r in rows)
    churn = httpx.get(f"{srv.url}/admin/entries", params={"namespace": "churn", "limit": 5}, headers=admin).json()
    assert all(r["retained"] is None for r in churn["entries"])
    summary = httpx.get(f"{srv.url}/admin/prefetches", headers=admin).json()
    assert summary["retained_bytes"] == {"acme": got["bytes"]}


def test_release_ends_only_the_callers_retention(srv, spec):
    tokens = list(range(48))
    _put(srv, spec, tokens, namespace="shared")
    assert _post(srv, "retain", _body(spec, tokens, ttl_s=60), namespace="shared").status_code == 200
    # beta shares the namespace but not acme's retention
    assert _post(srv, "release", _body(spec, tokens), token=BETA, namespace="shared").json() == {"blocks": 0}
    assert srv.store.placement.retained_bytes().get("acme", 0) > 0
    assert _post(srv, "release", _body(spec, tokens), namespace="shared").json() == {"blocks": 3}
    assert all(srv.store.placement.retention(k) is None for k in block_hashes(spec, tokens, "shared"))
    assert srv.store.placement.retained_bytes().get("acme", 0) == 0


def test_retain_past_the_quota_is_507_naming_it_and_retains_nothing_new(srv, spec):
    tokens = list(range(20 * 16))  # 20 blocks: over a quarter of the 512 KiB arena
    _put(srv, spec, tokens)
    resp = _post(srv, "retain", _body(spec, tokens, ttl_s=60))
    assert resp.status_code == 507, resp.text
    err = resp.json()["error"]
    assert err["type"] == "RetainQuotaExceeded" and err["quota_bytes"] == SHM_BYTES // 4
    assert "KVSTORE_RETAIN_QUOTA_BYTES" in err["message"] and str(SHM_BYTES // 4) in err["message"]
    assert srv.store.placement.retained_bytes().get("acme", 0) == 0
    # within the quota it works, and the quota counts what is held
    assert _post(srv, "retain", _body(spec, tokens[:10 * 16], ttl_s=60)).status_code == 200
    again = _post(srv, "retain", _body(spec, tokens, ttl_s=60)).json()["error"]
    assert again["retained_bytes"] == srv.store.placement.retained_bytes()["acme"] > 0


def test_a_tokens_file_override_sets_the_tenants_own_quota(srv, spec):
    tokens = list(range(64))  # 4 blocks, ~33 KiB: within the server's quota, over gamma's 16 KiB
    _put(srv, spec, tokens, token=GAMMA, namespace="gamma")
    resp = _post(srv, "retain", _body(spec, tokens, ttl_s=30), token=GAMMA, namespace="gamma")
    assert resp.status_code == 507 and resp.json()["error"]["quota_bytes"] == 16 << 10
    ok = _post(srv, "retain", _body(spec, tokens[:16], ttl_s=30), token=GAMMA, namespace="gamma").json()
    assert ok["blocks"] == 1 and ok["quota_bytes"] == 16 << 10 and ok["owner"] == "gamma"


@pytest.mark.parametrize("ttl, field, words", [
    (-1, "ttl_s", "(0, 600]"), (0, "ttl_s", "(0, 600]"), (1e308, "ttl_s", "KVSTORE_RETAIN_MAX_TTL_S"),
    (601, "ttl_s", "KVSTORE_RETAIN_MAX_TTL_S"), ("30", "ttl_s", "must be"), (True, "ttl_s", "must be"),
    (None, "ttl_s", "required"),
])
def test_bad_ttls_are_422_naming_the_field(srv, spec, ttl, field, words):
    tokens = list(range(32))
    _put(srv, spec, tokens)
    body = _body(spec, tokens) if ttl is None else _body(spec, tokens, ttl_s=ttl)
    resp = _post(srv, "retain", body)
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert err["field"] == field and words in err["message"], err
    assert srv.store.placement.retained_bytes().get("acme", 0) == 0


def test_nan_and_infinite_ttls_and_bad_priorities_are_422(srv, spec):
    tokens = list(range(32))
    _put(srv, spec, tokens)
    headers = {**_auth(ACME, "acme"), "content-type": "application/json"}
    base = json.dumps(_body(spec, tokens))[:-1]
    for raw in ("NaN", "Infinity", "-Infinity"):  # Python's JSON reads these; the route must not take them
        resp = httpx.post(f"{srv.url}/v1/kv/retain", content=f'{base}, "ttl_s": {raw}}}', headers=headers)
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "ttl_s", (raw, resp.text)
    for priority in (-1, 10, 1.5, "high"):
        resp = _post(srv, "retain", _body(spec, tokens, ttl_s=10, priority=priority))
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "priority", resp.text
    resp = _post(srv, "handoff", _body(spec, tokens, ttl_s=-5))
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "ttl_s"
    assert srv.store.placement.retained_bytes().get("acme", 0) == 0


def test_another_tenants_namespace_is_403_and_nothing_is_retained_or_prefetched(srv, spec):
    tokens = list(range(64))
    _put(srv, spec, tokens, token=BETA, namespace="beta")
    keys = block_hashes(spec, tokens, "beta")
    srv.store.migrate(keys[0], "memory")
    before = len(srv.store.prefetcher.log(1000))
    for route, extra in (("prefetch", {}), ("retain", {"ttl_s": 60}), ("release", {}), ("handoff", {})):
        resp = _post(srv, route, _body(spec, tokens, **extra), token=ACME, namespace="beta")
        assert resp.status_code == 403 and resp.json()["error"]["type"] == "Forbidden", (route, resp.text)
    assert srv.store.placement.retained_bytes() == {}
    assert all(srv.store.placement.retention(k) is None for k in keys)
    assert len(srv.store.prefetcher.log(1000)) == before and srv.store.entry(keys[0]).tier == "memory"
    # in its own namespace the same tokens name other keys: nothing of beta's is reached
    assert _post(srv, "retain", _body(spec, tokens, ttl_s=60)).json()["blocks"] == 0
    assert _post(srv, "prefetch", _body(spec, tokens)).json()["tokens"] == 0


def test_handoff_here_holds_for_the_servers_default_and_elsewhere_needs_a_shared_tier(srv, spec):
    tokens = list(range(64))
    _put(srv, spec, tokens)
    got = _post(srv, "handoff", _body(spec, tokens)).json()
    assert got == {"tokens": 64, "blocks": 4, "held": 4, "shared": 0, "to": "here"}
    held = srv.store.placement.retention(block_hashes(spec, tokens, "acme")[0])
    assert held["owner"] == "acme" and 40 < held["expires_in_s"] <= 45  # KVSTORE_HANDOFF_TTL_S=45 here
    resp = _post(srv, "handoff", _body(spec, tokens, to="node-b"))
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert err["field"] == "to" and "shared tier" in err["message"]
    assert _post(srv, "handoff", _body(spec, tokens, to="")).status_code == 422


def test_kv_bodies_carry_the_fields_in_the_query(srv, spec):
    """The SDK's form: a KV body without KV, as a lookup sends, with ttl_s/priority/to in the query."""
    from client_sdk import _common as c

    tokens = list(range(48))
    _put(srv, spec, tokens)
    body = b"".join(bytes(p) for p in c.kv_parts(spec, c.tokens_of(tokens), None))
    headers = {**_auth(ACME, "acme"), "content-type": "application/x-kvstore-kv"}
    ok = httpx.post(f"{srv.url}/v1/kv/retain?ttl_s=30&priority=2", content=body, headers=headers)
    assert ok.status_code == 200 and ok.json()["blocks"] == 3 and ok.json()["priority"] == 2, ok.text
    for query, field in (("ttl_s=soon", "ttl_s"), ("ttl_s=nan", "ttl_s"), ("ttl_s=5&priority=x", "priority")):
        bad = httpx.post(f"{srv.url}/v1/kv/retain?{query}", content=body, headers=headers)
        assert bad.status_code == 422 and bad.json()["error"]["field"] == field, (query, bad.text)


def test_handoff_to_another_node_writes_through_and_its_prefetch_fills_its_own_arena(serve_app, redis_server, spec):
    def node() -> KVStore:  # write-back: nothing reaches Redis unless a hand-off sends it
        return KVStore([ShmTier(4 << 20), MemoryTier(8 << 20), RedisTier(redis_server.url, 64 << 20, keyspace="ho")],
                       background=False, write_policy="write_back")

    a, b = serve_app(node()), serve_app(node())
    tokens = list(range(64))
    _put(a, spec, tokens, token=None, namespace="team")
    assert _post(b, "prefetch", _body(spec, tokens), token=None, namespace="team").json()["tokens"] == 0
    got = _post(a, "handoff", _body(spec, tokens, to="node-b"), token=None, namespace="team").json()
    assert got["shared"] == 4 and got["held"] == 0
    assert _post(b, "prefetch", _body(spec, tokens), token=None, namespace="team").json()["tokens"] == 64
    _until(lambda: _tiers(b, spec, tokens, "team") == ["shm"] * 4)


def test_the_dashboard_shows_retentions_and_prefetches(srv, spec):
    """The entries table's retained column, explain's retention and the prefetch panel, in headless Chromium."""
    from tests.server.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, _browser_or_skip

    sync_playwright, expect = _browser_or_skip()
    tokens = list(range(64))
    _put(srv, spec, tokens)
    srv.store.migrate(block_hashes(spec, tokens, "acme")[0], "memory")
    assert _post(srv, "prefetch", _body(spec, tokens)).json()["tokens"] == 64
    assert _post(srv, "retain", _body(spec, tokens, ttl_s=300, priority=4)).status_code == 200
    srv.store.prefetcher.idle(10)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(srv.url + "/admin/ui")
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#token", ADMIN)
            page.click("#login-button")
            row = page.locator("#entries tbody tr").first
            expect(row.locator("td.retained")).to_contain_text("acme · p4 · ")
            expect(page.locator("#prefetches tbody tr[data-trigger='requested']").first).to_contain_text("memory: 1")
            expect(page.locator("#retained-summary")).to_contain_text("acme")
            row.click()
            page.wait_for_selector("#explain:not([hidden])")
            expect(page.locator("#explain-facts")).to_contain_text("by acme · p4")
            assert errors == []
        finally:
            browser.close()
