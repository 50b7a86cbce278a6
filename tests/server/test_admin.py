"""Every /admin route over HTTP, dry-run eviction and the audit log."""

from __future__ import annotations

import json

import httpx
import pytest

from client_sdk import KVClient
from kvstore.errors import BlockNotFound, InvalidInput
from kvstore.keys import block_hashes
from tests.conftest import FakeClock, make_kv, make_spec
from tests.server.conftest import ACME, ADMIN, TOKENS, make_store


@pytest.fixture
def admin_env(serve_app, tmp_path):
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN, audit_log=str(tmp_path / "audit.jsonl"))
    admin = KVClient(srv.url, token=ADMIN, namespace="acme", colocated=False)
    acme = KVClient(srv.url, token=ACME, namespace="acme", colocated=False)
    yield srv, admin, acme
    admin.close()
    acme.close()


def test_dry_run_eviction_removes_nothing_and_is_audited(admin_env, spec, tmp_path):
    srv, admin, acme = admin_env
    tokens = list(range(64))
    acme.put_kv(spec, tokens, make_kv(spec, 64))
    dry = admin.admin.evict(namespace="acme", dry_run=True)
    assert dry["dry_run"] is True and dry["blocks"] == 4 and dry["removed_blocks"] == 0
    assert dry["bytes"] == sum(e.size for e in srv.store.entries())
    assert sorted(dry["keys"]) == sorted(k.hex() for k in block_hashes(spec, tokens, "acme"))
    assert dry["by_tier"] == {"shm": {"blocks": 4, "bytes": dry["bytes"]}}
    assert acme.lookup(spec, tokens) == 64
    done = admin.admin.evict(namespace="acme")
    assert done["removed_blocks"] == 4 and done["removed_bytes"] == dry["bytes"]
    assert acme.lookup(spec, tokens) == 0
    audit = admin.admin.audit()
    assert audit["total"] == 2
    last, first = audit["records"]
    assert first["who"] == "admin" and first["action"] == "evict" and first["dry_run"] is True
    assert first["blocks"] == 4 and first["bytes"] == dry["bytes"] and first["query"] == {"namespace": "acme"}
    assert last["dry_run"] is False and last["removed_blocks"] == 4 and last["id"] == done["audit_id"]
    lines = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [first["id"], last["id"]]  # on disk too


def test_evict_by_keys_prefix_fingerprint_and_tier(admin_env, spec):
    srv, admin, acme = admin_env
    other = make_spec(model_id="other-model")
    a, b = list(range(48)), list(range(1000, 1032))
    acme.put_kv(spec, a, make_kv(spec, 48))
    acme.put_kv(other, b, make_kv(other, 32))
    keys = block_hashes(spec, a, "acme")
    assert admin.admin.evict(keys=[keys[2]])["removed_blocks"] == 1
    assert acme.lookup(spec, a) == 32
    prefix = admin.admin.evict(prefix={"spec": spec, "tokens": a[:16], "namespace": "acme"})
    assert prefix["removed_blocks"] == 1 and acme.lookup(spec, a) == 0
    assert admin.admin.evict(fingerprint=other.fingerprint(), dry_run=True)["blocks"] == 2
    assert admin.admin.evict(fingerprint=spec.fingerprint())["removed_blocks"] == 1  # the block left of a
    assert admin.admin.evict(tier="memory")["blocks"] == 0
    assert admin.admin.evict(tier="shm")["removed_blocks"] == 2
    assert srv.store.entries() == []


def test_evict_older_than_and_down_to_a_watermark(serve_app, spec, tmp_path):
    clock = FakeClock()
    srv = serve_app(make_store(clock=clock), tokens=json.dumps(TOKENS), admin_token=ADMIN,
                    audit_log=str(tmp_path / "audit.jsonl"))
    admin = KVClient(srv.url, token=ADMIN, namespace="acme", colocated=False)
    acme = KVClient(srv.url, token=ACME, namespace="acme", colocated=False)
    old, new = list(range(32)), list(range(500, 532))
    acme.put_kv(spec, old, make_kv(spec, 32))
    clock.advance(0.4)  # the server's store ages by this clock: no sleep
    acme.put_kv(spec, new, make_kv(spec, 32))
    sel = admin.admin.evict(older_than_s=0.3, dry_run=True)
    assert sorted(sel["keys"]) == sorted(k.hex() for k in block_hashes(spec, old, "acme"))
    for _ in range(5):  # make `old` hot: the watermark takes the coldest first
        acme.get_kv(spec, old)
    shm = next(t for t in admin.admin.tiers() if t["name"] == "shm")
    size = srv.store.entries()[0].size
    frac = (shm["used_bytes"] - 2 * size) / shm["capacity_bytes"]
    done = admin.admin.evict(watermark={"tier": "shm", "frac": frac})
    assert done["removed_blocks"] == 2
    assert sorted(done["keys"]) == sorted(k.hex() for k in block_hashes(spec, new, "acme"))
    assert acme.lookup(spec, old) == 32 and acme.lookup(spec, new) == 0
    admin.close()
    acme.close()


def test_pins_protect_from_eviction_and_show_everywhere(admin_env, spec):
    srv, admin, acme = admin_env
    tokens = list(range(32))
    acme.put_kv(spec, tokens, make_kv(spec, 32))
    keys = block_hashes(spec, tokens, "acme")
    assert admin.admin.pin(spec=spec, tokens=tokens, namespace="acme", ttl_s=60) == {"pinned": 2, "requested": 2}
    assert admin.admin.explain(keys[0])["pinned"] is True
    ev = admin.admin.evict(namespace="acme")
    assert ev["removed_blocks"] == 0 and ev["skipped_pinned"] == 2
    assert admin.admin.unpin([keys[1]]) == {"unpinned": 1, "requested": 1}
    assert admin.admin.evict(namespace="acme")["removed_blocks"] == 1
    assert admin.admin.evict(namespace="acme", include_pinned=True)["removed_blocks"] == 1
    actions = [r["action"] for r in admin.admin.audit()["records"]]
    assert actions == ["evict", "evict", "unpin", "evict", "pin"]


def test_migrate_explain_moves_and_errors(admin_env, spec):
    srv, admin, acme = admin_env
    tokens = list(range(16))
    kv = make_kv(spec, 16)
    acme.put_kv(spec, tokens, kv)
    key = block_hashes(spec, tokens, "acme")[0]
    moved = admin.admin.migrate(key, "memory")
    assert moved == {"moved": True, "tier": "memory", "from": "shm"}
    info = admin.admin.explain(key)
    assert info["tier"] == "memory" and info["namespace"] == "acme" and info["moves"][-1]["dst"] == "memory"
    assert admin.admin.moves()["moves"][-1]["key"] == key.hex()
    got, n = acme.get_kv(spec, tokens)
    assert n == 16 and got.equal(kv)
    with pytest.raises(InvalidInput, match="tier") as err:
        admin.admin.migrate(key, "tape")
    assert err.value.field == "tier"
    with pytest.raises(BlockNotFound):
        admin.admin.migrate("ab" * 32, "shm")
    with pytest.raises(BlockNotFound):
        admin.admin.explain("cd" * 32)
    audit = admin.admin.audit(action="migrate")["records"]
    assert audit[0]["src"] == "shm" and audit[0]["dst"] == "memory" and audit[0]["bytes"] > 0


def test_stats_tiers_and_entries(admin_env, spec):
    srv, admin, acme = admin_env
    acme.put_kv(spec, list(range(64)), make_kv(spec, 64))
    big = make_spec(head_dim=32)
    acme.put_kv(big, list(range(16)), make_kv(big, 16))
    for _ in range(3):
        acme.get_kv(spec, list(range(16)))
    stats = admin.admin.stats()
    assert stats["blocks"] == 5 and stats["counters"]["put_calls"] == 2 and stats["service"]["auth"] is True
    assert [t["name"] for t in stats["tiers"]] == ["shm", "memory"]
    tiers = admin.admin.tiers()
    assert tiers[0]["entries"] == 5 and tiers[0]["state"] == "ok" and tiers[0]["placement_bytes"] > 0
    # Reads by tier: one figure (the store's reads_by_tier) on every tier of both routes; the
    # tier's own counters only under backend_counters.
    assert stats["reads_by_tier"] == {"shm": 3}  # three gets of one block each
    for listing in (stats["tiers"], tiers):
        assert {t["name"]: t["reads"] for t in listing} == {"shm": 3, "memory": 0}
        assert all("counters" not in t and set(t["backend_counters"]) ==
                   {"puts", "gets", "hits", "misses", "deletes", "errors"} for t in listing)
    assert tiers[0]["backend_counters"]["puts"] == 5 and tiers[0]["backend_counters"]["hits"] >= 3
    by_size = admin.admin.entries(sort="size", order="desc", limit=2)
    assert by_size["total"] == 5 and len(by_size["entries"]) == 2
    assert by_size["entries"][0]["size"] > by_size["entries"][1]["size"]
    page2 = admin.admin.entries(sort="size", order="desc", limit=2, offset=2)["entries"]
    assert {e["key"] for e in page2}.isdisjoint({e["key"] for e in by_size["entries"]})
    hot = admin.admin.entries(sort="heat", limit=1)["entries"][0]
    assert hot["key"] == block_hashes(spec, list(range(16)), "acme")[0].hex() and hot["hits"] == 3
    newest = admin.admin.entries(sort="age", order="asc", limit=1)["entries"][0]
    assert newest["spec_fingerprint"] == big.fingerprint()
    assert admin.admin.entries(tier="memory")["total"] == 0
    auth = {"authorization": f"Bearer {ADMIN}"}
    resp = httpx.get(f"{srv.url}/admin/entries", params={"sort": "colour"}, headers=auth)
    assert resp.status_code == 422 and resp.json()["error"]["message"].startswith("sort:")
    resp = httpx.get(f"{srv.url}/admin/entries", params={"limit": 0}, headers=auth)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "limit"


def test_bad_eviction_requests_are_4xx(admin_env):
    srv, admin, _ = admin_env
    h = {"authorization": f"Bearer {ADMIN}"}
    cases = [
        ({}, 422, "at least one selector"),
        ({"tier": "tape"}, 422, "tier"),
        ({"keys": ["xyz"]}, 422, "keys"),
        ({"watermark": {"frac": 0.5}}, 422, "watermark"),
        ({"watermark": {"tier": "shm", "frac": 2}}, 422, "watermark.frac"),
        ({"older_than_s": -1}, 422, "older_than_s"),
        ({"tier": "shm", "colour": "red"}, 400, "unknown field"),
        ({"tier": 5}, 422, "tier"),
    ]
    for body, status, words in cases:
        resp = httpx.post(f"{srv.url}/admin/evict", json=body, headers=h)
        assert resp.status_code == status, (body, resp.text)
        assert words in resp.json()["error"]["message"], (body, resp.text)
    assert httpx.get(f"{srv.url}/healthz").status_code == 200
