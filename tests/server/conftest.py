"""Fixtures for the service tests: a store over real tiers, uvicorn in a thread, clients, redis-server."""

from __future__ import annotations

import json
from typing import Callable, Iterator

import pytest

from client_sdk import KVClient
from kvstore import KVStore
from server import ServerSettings, create_app
from tests.server.live import ThreadServer
from tests.tiers.redis_servers import RedisServer
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

ADMIN = "admin-token-0123456789"
ACME = "acme-token-0123456789"
BETA = "beta-token-0123456789"
TOKENS = {
    ACME: {"tenant": "acme", "namespaces": ["acme", "shared"]},
    BETA: {"tenant": "beta", "namespaces": ["beta", "shared"], "quota_bytes": "1MiB"},
}


def make_store(shm_bytes: int = 32 << 20, memory_bytes: int = 64 << 20, clock=None) -> KVStore:
    """shm on top (the co-located path needs it), memory below; placement runs only when asked.
    ``clock`` (a ``tests.conftest.FakeClock``) ages entries and heat with no sleep."""
    return KVStore([ShmTier(shm_bytes), MemoryTier(memory_bytes)], background=False, clock=clock)


@pytest.fixture
def serve_app(tmp_path) -> Iterator[Callable[..., ThreadServer]]:
    """Start ``create_app(store, settings)`` under uvicorn in a thread; stopped (store closed) after."""
    started: list[ThreadServer] = []

    def start(store: KVStore | None = None, **settings) -> ThreadServer:
        settings.setdefault("staging_bytes", "16MiB")
        settings.setdefault("audit_log", str(tmp_path / f"audit-{len(started)}.jsonl"))
        srv = ThreadServer(create_app(store or make_store(), ServerSettings(**settings))).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def server(serve_app) -> ThreadServer:
    """An open server (no auth) over a fresh store."""
    return serve_app()


@pytest.fixture
def auth_server(serve_app) -> ThreadServer:
    """A server with two tenants (acme, beta: 1 MiB quota) and an admin token."""
    return serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)


@pytest.fixture
def client(server) -> Iterator[KVClient]:
    c = KVClient(server.url, colocated=False, retries=0)
    yield c
    c.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    yield srv
    srv.stop()
