"""``client_sdk.EventFollower`` against a real server (uvicorn in a thread): its block set is the
index, and it survives what a stream meets in production (drops, lost events, restarts, tenants).

Streams are dropped the way a shutdown drops them: the app's notifier is stopped (every stream
ends, new ones get 503), and a fresh one takes over when the test says so.
"""

from __future__ import annotations

import json
import random
import time
from typing import Callable, Iterator

import pytest

from bench.serving import free_port
from client_sdk import EventFollower, KVClient
from kvstore import KVStore
from kvstore.errors import Forbidden
from kvstore.keys import block_hashes
from server import ServerSettings, create_app
from tests.conftest import make_kv, make_spec
from tests.conftest import wait_until
from tests.server.conftest import ACME, ADMIN, BETA, TOKENS, make_store
from tests.server.live import ThreadServer
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

SPEC = make_spec(model_id="follower")


def chain(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 20) for _ in range(blocks * SPEC.block_tokens)]


def put(url: str, tokens: list[int], ns: str = "default", token: str | None = None) -> None:
    with KVClient(url, token=token, namespace=ns, colocated=False, retries=0) as c:
        c.put_kv(SPEC, tokens, make_kv(SPEC, len(tokens)))


def entries(url: str, token: str | None = None, namespaces: set[str] | None = None) -> dict[bytes, str]:
    """``/admin/entries``, every page, as key -> tier (of ``namespaces`` only, if given)."""
    out: dict[bytes, str] = {}
    with KVClient(url, token=token, colocated=False, retries=0) as c:
        offset = 0
        while True:
            page = c.admin.entries(limit=1000, offset=offset)
            out.update({bytes.fromhex(e["key"]): e["tier"] for e in page["entries"]
                        if namespaces is None or e["namespace"] in namespaces})
            offset += len(page["entries"])
            if offset >= page["total"]:
                return out


def until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    wait_until(predicate, timeout_s, what, step_s=0.01)


def drop_streams(srv: ThreadServer) -> Callable[[], None]:
    """End every open event stream now (new ones get 503 meanwhile); returns the call that lets
    streams in again."""
    notifier = srv.svc.event_notifier
    notifier.stop()
    until(lambda: notifier.open == 0, what="the streams ending")

    def reopen() -> None:
        srv.svc.event_notifier = None  # the next stream makes a fresh one
    return reopen


@pytest.fixture
def start_server(tmp_path) -> Iterator[Callable[..., ThreadServer]]:
    """``start(store=None, port=None, **settings)``: a server on ``port`` (a restart reuses one)."""
    started: list[ThreadServer] = []

    def start(store: KVStore | None = None, port: int | None = None, **settings) -> ThreadServer:
        settings.setdefault("staging_bytes", "16MiB")
        settings.setdefault("audit_log", str(tmp_path / f"audit-{len(started)}.jsonl"))
        srv = ThreadServer(create_app(store or make_store(), ServerSettings(**settings)), port=port).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def test_follows_puts_moves_deletes_and_evictions_to_the_index(start_server):
    srv = start_server()
    convs = [chain(i, 3) for i in range(6)]
    put(srv.url, convs[0])  # before the follower: its snapshot has it
    seen: list[tuple[str, dict, float]] = []
    with EventFollower(srv.url, on_event=lambda *a: seen.append(a)) as f:
        assert f.resyncs == 1 and f.epoch and f.prefix(block_hashes(SPEC, convs[0], "default")) == 3
        for conv in convs[1:]:
            put(srv.url, conv)
        with KVClient(srv.url, colocated=False, retries=0) as c:
            assert c.delete(SPEC, convs[1]) == 3  # blocks
            c.admin.migrate(block_hashes(SPEC, convs[2], "default")[0], "memory")
            c.admin.evict(keys=block_hashes(SPEC, convs[3], "default")[1:])
        assert f.catch_up(10)
        assert f.snapshot_blocks() == entries(srv.url)
        assert f.kinds["stored"] == 15 and f.kinds["moved"] >= 1 and f.kinds["removed"] == 5
        assert f.prefix(block_hashes(SPEC, convs[3], "default")) == 1
        assert f.prefix(block_hashes(SPEC, convs[2] + chain(99, 1), "default")) == 3
        assert f.snapshot_blocks()[block_hashes(SPEC, convs[2], "default")[0]] == "memory"
        assert sum(f.kinds.values()) == len(seen) and all(isinstance(t, float) for *_, t in seen)
        assert seen[0][0] == "stored" and bytes.fromhex(seen[0][1]["key"]) in block_hashes(SPEC, convs[1], "default")
        assert f.seq == int(f.last_id.split(":")[1]) and f.resyncs == 1 and f.failures == 0
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2, "close wakes the blocked read"
    assert not f._thread.is_alive()


def test_a_dropped_stream_resumes_from_its_last_id(start_server):
    srv = start_server()
    with EventFollower(srv.url) as f:
        put(srv.url, chain(10, 2))
        assert f.catch_up()
        reopen = drop_streams(srv)
        put(srv.url, chain(11, 3))  # while no stream is open: the resume must bring these
        reopen()
        assert f.catch_up()
        assert f.snapshot_blocks() == entries(srv.url) and len(f.blocks) == 5
        assert f.streams >= 2 and f.resyncs == 1 and f.kinds["lost"] == 0


def test_lost_events_mean_a_new_snapshot(start_server):
    srv = start_server(KVStore([ShmTier(8 << 20), MemoryTier(8 << 20)], background=False, event_capacity=16))
    with EventFollower(srv.url) as f:
        put(srv.url, chain(20, 2))
        assert f.catch_up()
        reopen = drop_streams(srv)
        put(srv.url, chain(21, 20))  # 20 events while away: more than the ring of 16 keeps
        reopen()
        until(lambda: f.resyncs == 2, what="the resync after lost")
        assert f.catch_up()
        assert f.kinds["lost"] == 1 and f.snapshot_blocks() == entries(srv.url) and len(f.blocks) == 22


@pytest.mark.parametrize("same_epoch", [False, True], ids=["new-epoch", "same-epoch-id-from-the-future"])
def test_a_restarted_server_means_a_new_snapshot(start_server, same_epoch):
    first = start_server()
    with EventFollower(first.url) as f:
        put(first.url, chain(30, 3))
        assert f.catch_up()
        old_epoch = f.epoch
        drop_streams(first)  # as SIGTERM does, so that the stop does not wait on the stream
        first.stop()
        store = make_store()
        if same_epoch:  # the old id then reads as one from this run's future: a 400
            store.events.epoch = old_epoch
        second = start_server(store, port=first.port)
        put(second.url, chain(31, 2))
        until(lambda: f.resyncs == 2, what="the resync after the restart")
        assert f.catch_up()
        assert f.snapshot_blocks() == entries(second.url) and len(f.blocks) == 2
        assert (f.epoch == old_epoch) == same_epoch and f.kinds["lost"] == (0 if same_epoch else 1)
        assert f.failures >= 1  # the old server refused or was gone for a while


def test_tenants_follow_only_their_namespaces(start_server):
    srv = start_server(tokens=json.dumps(TOKENS), admin_token=ADMIN)
    put(srv.url, chain(40, 1), ns="shared", token=ACME)  # in every snapshot that may see it
    with EventFollower(srv.url, ACME) as acme, EventFollower(srv.url, ACME, ["shared"]) as shared, \
            EventFollower(srv.url, ADMIN) as everyone:
        put(srv.url, chain(41, 2), ns="acme", token=ACME)
        put(srv.url, chain(42, 4), ns="shared", token=ACME)
        put(srv.url, chain(43, 3), ns="beta", token=BETA)  # last: acme's followers see no event of it
        for f in (acme, shared, everyone):
            assert f.catch_up(), f.url
        assert acme.seq < everyone.seq
        assert acme.snapshot_blocks() == entries(srv.url, ADMIN, {"acme", "shared"}) and len(acme.blocks) == 7
        assert shared.snapshot_blocks() == entries(srv.url, ADMIN, {"shared"}) and len(shared.blocks) == 5
        assert everyone.snapshot_blocks() == entries(srv.url, ADMIN) and len(everyone.blocks) == 10
    not_hers = EventFollower(srv.url, BETA, ["acme"])
    with pytest.raises(TimeoutError, match="Forbidden"):
        not_hers.start(timeout_s=0.5)
    assert not_hers.failures >= 1 and isinstance(not_hers.last_error, Forbidden)


def test_an_unreachable_server_is_retried_until_it_is_up(start_server):
    port = free_port()
    f = EventFollower(f"http://127.0.0.1:{port}").start(timeout_s=0)
    try:
        until(lambda: f.failures >= 2, what="two failed rounds")
        assert not f.wait_synced(0) and f.seq == 0 and f.epoch is None
        srv = start_server(port=port)
        put(srv.url, chain(50, 2))
        assert f.wait_synced(10) and f.catch_up()
        assert f.snapshot_blocks() == entries(srv.url) and len(f.blocks) == 2
    finally:
        f.close()
    with pytest.raises(TimeoutError, match="no events snapshot"):
        EventFollower(f"http://127.0.0.1:{free_port()}").start(timeout_s=0.2)
