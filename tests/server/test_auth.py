"""Bearer tokens, tenants and namespaces, quotas, and the loopback rule without tokens."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from client_sdk import Forbidden, KVClient, QuotaExceeded, Unauthorized
from kvstore.errors import InvalidInput
from kvstore.keys import block_hashes
from server.config import ServerSettings, load_tokens
from server.serve import effective_host
from tests.conftest import make_kv, make_spec
from tests.server.conftest import ACME, ADMIN, BETA


def test_missing_or_unknown_token_is_401(auth_server, spec):
    resp = httpx.post(f"{auth_server.url}/v1/lookup", json={"spec": spec.to_dict(), "tokens": [1]})
    assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith("Bearer")
    assert resp.json()["error"]["type"] == "Unauthorized"
    for header in ("Bearer " + ACME[:-1], "Bearer " + ACME + "x", "Basic " + ACME, "Bearer"):
        r = httpx.get(f"{auth_server.url}/v1/info", headers={"authorization": header})
        assert r.status_code == 401, header
    with KVClient(auth_server.url, token="not-a-real-token", colocated=False) as c, pytest.raises(Unauthorized):
        c.lookup(spec, list(range(16)))
    with KVClient(auth_server.url, colocated=False) as c, pytest.raises(Unauthorized):
        c.put_kv(spec, list(range(16)), make_kv(spec, 16))


def test_tenant_token_is_403_on_admin_and_the_admin_token_is_not(auth_server):
    with KVClient(auth_server.url, token=ACME, namespace="acme") as c:
        for call in (c.admin.stats, c.admin.tiers, lambda: c.admin.evict(tier="shm", dry_run=True), c.admin.audit):
            with pytest.raises(Forbidden, match="admin"):
                call()
    resp = httpx.get(f"{auth_server.url}/admin/stats", headers={"authorization": f"Bearer {BETA}"})
    assert resp.status_code == 403 and resp.json()["error"]["type"] == "Forbidden"
    with KVClient(auth_server.url, token=ADMIN) as admin:
        assert admin.admin.stats()["blocks"] == 0


def test_a_namespace_not_granted_is_403(auth_server, spec):
    with KVClient(auth_server.url, token=ACME, namespace="beta", colocated=False) as c:
        with pytest.raises(Forbidden, match="'beta' is not granted to tenant 'acme'"):
            c.lookup(spec, list(range(16)))
        with pytest.raises(Forbidden):
            c.put_kv(spec, list(range(16)), make_kv(spec, 16))


def test_no_cross_tenant_visibility_with_the_same_tokens_and_spec(auth_server, spec):
    tokens = list(range(64))
    kv = make_kv(spec, 64)
    acme = KVClient(auth_server.url, token=ACME, namespace="acme", colocated=False)
    beta = KVClient(auth_server.url, token=BETA, namespace="beta", colocated=False)
    assert acme.put_kv(spec, tokens, kv) == 64
    assert acme.lookup(spec, tokens) == 64
    # beta, same tokens and spec, its own namespace: nothing
    assert beta.lookup(spec, tokens) == 0
    assert beta.get_kv(spec, tokens)[1] == 0
    # nor by acme's block keys, which beta could only have learned out of band
    keys = block_hashes(spec, tokens, "acme")
    assert beta.get_block(keys[0]) is None
    head = httpx.head(f"{auth_server.url}/v1/blocks/{keys[0].hex()}",
                      headers={"authorization": f"Bearer {BETA}", "x-kv-namespace": "beta"})
    assert head.status_code == 404
    assert beta.delete_block(keys[0]) is False
    assert beta.delete_blocks(keys) == 0
    evicted = beta.evict_mine(keys=[k.hex() for k in keys])
    assert evicted["blocks"] == 0 and evicted["removed_blocks"] == 0
    assert beta.evict_mine(tier="shm")["blocks"] == 0
    assert acme.lookup(spec, tokens) == 64  # untouched
    # a namespace both are granted is shared on purpose
    shared_a = KVClient(auth_server.url, token=ACME, namespace="shared", colocated=False)
    shared_b = KVClient(auth_server.url, token=BETA, namespace="shared", colocated=False)
    shared_a.put_kv(spec, tokens[:16], kv[:, :, :, :16])
    assert shared_b.lookup(spec, tokens) == 16
    for c in (acme, beta, shared_a, shared_b):
        c.close()


def test_tenant_eviction_reaches_only_its_namespace(auth_server, spec):
    tokens = list(range(32))
    with KVClient(auth_server.url, token=ACME, namespace="acme", colocated=False) as acme, \
            KVClient(auth_server.url, token=BETA, namespace="beta", colocated=False) as beta:
        acme.put_kv(spec, tokens, make_kv(spec, 32))
        beta.put_kv(spec, tokens, make_kv(spec, 32, seed=1))
        dry = acme.evict_mine(tier="shm", dry_run=True)
        assert dry["blocks"] == 2 and acme.lookup(spec, tokens) == 32
        with pytest.raises(Exception, match="namespace"):
            acme.evict_mine(namespace="beta")
        done = acme.evict_mine(tier="shm")
        assert done["removed_blocks"] == 2 and acme.lookup(spec, tokens) == 0
        assert beta.lookup(spec, tokens) == 32


def test_quota_over_limit_is_507(auth_server):
    spec = make_spec(num_layers=32, head_dim=128)  # 32 KiB a token: 512 KiB a block
    with KVClient(auth_server.url, token=BETA, namespace="beta", colocated=False) as beta:
        assert beta.put_kv(spec, list(range(16)), make_kv(spec, 16)) == 16
        with pytest.raises(QuotaExceeded, match="quota"):
            beta.put_kv(spec, list(range(100, 148)), make_kv(spec, 48))
        resp = httpx.post(f"{auth_server.url}/v1/kv/put", content=b"",
                          headers={"authorization": f"Bearer {BETA}", "x-kv-namespace": "beta"})
        assert resp.status_code == 400  # still serving
        assert beta.put_kv(spec, list(range(16)), make_kv(spec, 16)) == 16  # re-put: no new bytes
    with KVClient(auth_server.url, token=ACME, namespace="acme", colocated=False) as acme:
        assert acme.put_kv(spec, list(range(100, 148)), make_kv(spec, 48)) == 48  # no quota


def test_admin_token_may_use_any_namespace(auth_server, spec):
    with KVClient(auth_server.url, token=ADMIN, namespace="acme", colocated=False) as admin:
        admin.put_kv(spec, list(range(16)), make_kv(spec, 16))
    with KVClient(auth_server.url, token=ACME, namespace="acme", colocated=False) as acme:
        assert acme.lookup(spec, list(range(16))) == 16


def test_without_tokens_the_server_binds_loopback_and_says_so():
    err = io.StringIO()
    assert effective_host(ServerSettings(host="0.0.0.0"), err) == "127.0.0.1"
    assert "no tokens configured" in err.getvalue() and "0.0.0.0" in err.getvalue()
    err = io.StringIO()
    assert effective_host(ServerSettings(host="127.0.0.1"), err) == "127.0.0.1"
    assert "loopback only" in err.getvalue()
    err = io.StringIO()
    assert effective_host(ServerSettings(host="0.0.0.0", admin_token=ADMIN), err) == "0.0.0.0"
    assert err.getvalue() == ""


def test_tokens_file_is_validated(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({ACME: {"tenant": "acme", "namespaces": ["acme"]}}))
    settings = ServerSettings(tokens_file=str(path))
    assert settings.grants[ACME].namespaces == frozenset({"acme"}) and settings.auth_enabled
    with pytest.raises(InvalidInput, match="namespaces"):
        load_tokens({ACME: {"tenant": "acme", "namespaces": []}}, "t")
    with pytest.raises(InvalidInput, match="namespace must be"):
        load_tokens({ACME: {"tenant": "acme", "namespaces": ["bad name"]}}, "t")
    with pytest.raises(InvalidInput, match="at least 8"):
        load_tokens({"short": {"tenant": "x", "namespaces": ["x"]}}, "t")
    with pytest.raises(InvalidInput, match="unknown grant field"):
        load_tokens({ACME: {"tenant": "acme", "namespaces": ["a"], "role": "root"}}, "t")
    path.write_text("{not json")
    with pytest.raises(InvalidInput, match="not JSON"):
        ServerSettings(tokens_file=str(path))
    with pytest.raises(InvalidInput, match="must differ"):
        ServerSettings(tokens=json.dumps({ADMIN: {"tenant": "a", "namespaces": ["a"]}}), admin_token=ADMIN)
