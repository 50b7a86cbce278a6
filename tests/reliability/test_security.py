"""Security at the service: tokens never reach a log, and tenants see nothing of each other.

``kvstore serve`` runs with a tokens file, an admin token, debug logging and its audit log;
every kind of request is made with good, wrong and misplaced tokens. Then neither the
server's output nor the audit log holds any token, and tenant B's every route finds nothing
of tenant A's blocks stored under the very same tokens and spec.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import httpx
import pytest
import torch

from bench.reliability_kit.load_worker import SPECS, expected_kv
from bench.reliability_kit.serve_process import ServeProcess
from client_sdk import Forbidden, KVClient, Unauthorized

SPEC = SPECS[0]
TOKENS = list(range(3_000, 3_064))


@pytest.fixture
def secured(tmp_path: Path):
    a, b, admin = (secrets.token_urlsafe(24) for _ in range(3))
    grants = {a: {"tenant": "a", "namespaces": ["a"]}, b: {"tenant": "b", "namespaces": ["b"]}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_TOKENS=json.dumps(grants),
               KVSTORE_ADMIN_TOKEN=admin, KVSTORE_LOG_LEVEL="debug", KVSTORE_HOST="127.0.0.1")
    server = ServeProcess(env).start()
    try:
        yield server, a, b, admin
    finally:
        server.stop()


def test_no_token_reaches_a_log(secured, tmp_path):
    server, a, b, admin = secured
    wrong = secrets.token_urlsafe(24)
    with KVClient(server.url, token=a, namespace="a", plan=False) as client:
        client.put_kv(SPEC, TOKENS, expected_kv(0, TOKENS))
        assert client.get_kv(SPEC, TOKENS)[1] == len(TOKENS)
        with pytest.raises(Forbidden):
            client.admin.stats()
    with KVClient(server.url, token=wrong, namespace="a", plan=False) as client, pytest.raises(Unauthorized):
        client.lookup(SPEC, TOKENS)
    with KVClient(server.url, token=admin, plan=False) as client:
        client.admin.evict(namespace="a", dry_run=True)
        client.admin.audit()
    # a token where none belongs: in the path, the query and another header
    for url in (f"{server.url}/v1/{wrong}", f"{server.url}/healthz?token={wrong}"):
        httpx.get(url, headers={"X-Api-Key": wrong}, timeout=10)
    server.stop()
    audit = (tmp_path / "data" / "audit.jsonl").read_text()
    assert '"evict"' in audit  # the admin's dry run is there: the audit log was written and is read here
    assert "kvstore" in server.log()  # and so is the server's own output
    logged = server.log() + audit
    for token in (a, b, admin, wrong):
        assert token not in logged, "a token reached a log"


def test_tenant_b_finds_nothing_of_tenant_a(secured):
    server, a, b, _ = secured
    with KVClient(server.url, token=a, namespace="a", plan=False) as tenant_a:
        tenant_a.put_kv(SPEC, TOKENS, expected_kv(0, TOKENS))
        keys = [blk["key"] for blk in tenant_a.lookup_blocks(SPEC, TOKENS)["blocks"]]
    with KVClient(server.url, token=b, namespace="b", plan=False) as tenant_b:
        assert tenant_b.lookup(SPEC, TOKENS) == 0
        assert tenant_b.get_kv(SPEC, TOKENS)[1] == 0
        assert tenant_b.lookup_blocks(SPEC, TOKENS)["blocks"] == []
        # its own keys for the same tokens are others: nothing to probe, by time or otherwise
        assert not {blk["key"] for blk in tenant_b.lookup_blocks(SPEC, TOKENS)["blocks"]} & set(keys)
        assert all(tenant_b.get_block(bytes.fromhex(k)) is None for k in keys)  # A's keys, asked directly
        assert tenant_b.delete(SPEC, TOKENS) == 0
        assert tenant_b.evict_mine(prefix={"spec": SPEC.to_dict(), "tokens": TOKENS})["removed_blocks"] == 0
        with pytest.raises(Forbidden):
            tenant_b.admin.pin(spec=SPEC, tokens=TOKENS)
    with pytest.raises(Forbidden), KVClient(server.url, token=b, namespace="a", plan=False) as sneaky:
        sneaky.lookup(SPEC, TOKENS)  # A's namespace is not granted to B
    with KVClient(server.url, token=a, namespace="a", plan=False) as tenant_a:  # and A's blocks are intact
        kv, n = tenant_a.get_kv(SPEC, TOKENS)
        assert n == len(TOKENS) and torch.equal(kv, expected_kv(0, TOKENS))


def test_every_known_token_is_compared_in_constant_time_whatever_matches(monkeypatch):
    """No early exit: the first, the last and no token cost the same ``compare_digest`` calls."""
    import hmac

    from server import auth
    from server.config import ServerSettings

    tokens = [secrets.token_urlsafe(24) for _ in range(5)]
    settings = ServerSettings(tokens=json.dumps({t: {"tenant": f"t{i}", "namespaces": [f"t{i}"]} for i, t in enumerate(tokens)}),
                              admin_token=secrets.token_urlsafe(24))
    authenticator = auth.Authenticator(settings)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for presented in (tokens[0], tokens[-1], secrets.token_urlsafe(24)):
        calls.clear()
        try:
            authenticator.authenticate(f"Bearer {presented}")
        except Unauthorized:
            pass
        assert len(calls) == len(tokens) + 1  # every tenant token and the admin token, every time
