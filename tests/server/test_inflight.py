"""The in-flight body cap (``server.inflight``): the budget's rules, its settings, and the 413/503 it answers.

The flood of 1 GiB uploads against a real ``kvstore serve`` is in
``tests/reliability/test_inflight_memory.py``.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import torch

from client_sdk import KVClient, ServerBusy
from kvstore.errors import BodyTimeout, InvalidInput
from kvstore.wire.errors import error_from
from server import ServerSettings
from server.inflight import InflightBudget, default_inflight_bytes, lazy_buffer
from tests.conftest import make_kv, make_spec

MiB = 1 << 20


def test_large_bodies_leave_the_reserved_quarter_to_small_ones():
    b = InflightBudget(64 * MiB)  # large ones share 48 MiB; a small one is at most 4 MiB
    assert (b.large_limit, b.small_max) == (48 * MiB, 4 * MiB)
    assert b.try_take(48 * MiB, small=False)
    assert not b.try_take(1, small=False)
    assert b.try_take(16 * MiB, small=True)  # the reserve is the small ones'
    assert not b.try_take(1, small=True)
    b.give(16 * MiB)
    b.give(48 * MiB)
    assert b.used == 0 and b.peak == 64 * MiB


def test_a_waiting_part_gets_room_when_it_is_given_back_and_is_refused_when_none_comes():
    async def scenario() -> tuple[bool, bool, int]:
        b = InflightBudget(8 * MiB)
        assert b.try_take(6 * MiB, small=False)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, b.give, 6 * MiB)
        got = await b.take(2 * MiB, small=False, wait_s=5)
        assert b.try_take(4 * MiB, small=False)  # 6 MiB held: the large share is full
        refused = await b.take(1 * MiB, small=False, wait_s=0.05)
        return got, refused, b.refused

    assert asyncio.run(scenario()) == (True, False, 1)


def test_a_cancel_in_the_same_turn_as_the_wake_up_still_cancels_the_waiting_part():
    # The body deadline cancels a part waiting for room; a give() in the same loop turn woke
    # it. asyncio.wait_for on 3.11 returned the woken result and dropped the cancel: the part
    # was charged, and the upload it belonged to was never answered.
    async def scenario() -> tuple[str, int]:
        b = InflightBudget(8 * MiB)
        assert b.try_take(6 * MiB, small=False)
        waiting = asyncio.ensure_future(b.take(1 * MiB, small=False, wait_s=30))
        await asyncio.sleep(0)  # it waits for room now
        b.give(6 * MiB)  # wakes it ...
        waiting.cancel()  # ... and the deadline cancels it, before it runs again
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled", b.used
        return "charged", b.used

    assert asyncio.run(scenario()) == ("cancelled", 0)


def test_a_body_deadline_whose_cancel_is_swallowed_below_still_answers_408():
    # Any layer under the deadline (a receive, another middleware) may swallow the cancel it
    # sends and hand back a part: the upload must end there, not trickle on unanswered.
    from server.app import _BodyTimeout

    async def scenario() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        parts = 0

        async def receive() -> dict:
            nonlocal parts
            parts += 1
            if parts == 1:
                return {"type": "http.request", "body": b"x", "more_body": True}
            part = loop.create_future()
            try:
                await part
            except asyncio.CancelledError:  # the injected fault: swallow the first, as wait_for did
                if parts > 2:
                    raise
            return {"type": "http.request", "body": b"y", "more_body": True}

        async def app(scope: dict, receive_: object, send: object) -> str:
            while True:
                await receive_()  # type: ignore[operator]

        outcome = "unanswered"

        async def wrapped(scope: dict, receive_: object, send: object) -> None:
            nonlocal outcome
            try:
                await app(scope, receive_, send)
            except BodyTimeout as exc:
                outcome = f"408: {exc}"

        mw = _BodyTimeout(wrapped, idle_s=0.2, min_rate=1 << 30)
        scope = {"type": "http", "headers": [(b"content-length", b"1000")]}
        await asyncio.wait_for(mw(scope, receive, None), 5)
        return outcome.split(":")[0], parts

    assert asyncio.run(scenario()) == ("408", 2)


def test_a_fresh_body_buffer_commits_no_memory_until_written():
    buf = lazy_buffer(1 << 30)
    assert len(buf) == 1 << 30
    view = memoryview(buf)
    view[:4] = b"abcd"
    view[-4:] = b"wxyz"
    assert bytes(view[:4]) == b"abcd" and bytes(view[-4:]) == b"wxyz"
    view.release()


@pytest.mark.parametrize("raw", ["nope", "-1", "512KiB"])
def test_bad_caps_are_refused_naming_the_variable(raw):
    with pytest.raises(InvalidInput, match="KVSTORE_MAX_INFLIGHT_BYTES|max_inflight_bytes"):
        ServerSettings.from_env({"KVSTORE_MAX_INFLIGHT_BYTES": raw})


def test_the_default_cap_follows_the_machine():
    assert ServerSettings.from_env({}).max_inflight_bytes == default_inflight_bytes()
    assert ServerSettings.from_env({"KVSTORE_MAX_INFLIGHT_BYTES": "0"}).max_inflight_bytes == default_inflight_bytes()
    assert ServerSettings.from_env({"KVSTORE_MAX_INFLIGHT_BYTES": "3GiB"}).max_inflight_bytes == 3 << 30
    assert (1 << 30) <= default_inflight_bytes() <= (16 << 30)
    with pytest.raises(InvalidInput, match="inflight_wait_s"):
        ServerSettings.from_env({"KVSTORE_INFLIGHT_WAIT_S": "-1"})


def test_a_body_no_cap_could_hold_gets_413_and_a_fitting_one_is_stored(serve_app):
    srv = serve_app(max_inflight_bytes="8MiB")  # large bodies may hold 6 MiB together
    spec = make_spec()
    with httpx.Client(base_url=srv.url, timeout=10) as http:
        r = http.put("/v1/blocks/" + "ab" * 32, content=bytes(7 * MiB))
        assert r.status_code == 413 and "KVSTORE_MAX_INFLIGHT_BYTES" in r.json()["error"]["message"]
    with KVClient(srv.url, colocated=False, plan=False) as client:
        tokens = list(range(64))
        kv = make_kv(spec, 64)
        assert client.put_kv(spec, tokens, kv) == 64
        got, n = client.get_kv(spec, tokens)
        assert n == 64 and torch.equal(got, kv)


def test_a_body_that_finds_no_room_gets_503_with_retry_after(serve_app):
    srv = serve_app(max_inflight_bytes="8MiB", inflight_wait_s=0.2)
    held = socket.create_connection(("127.0.0.1", srv.port))
    try:  # one upload holds 5 of the 6 MiB large bodies share, and stays open
        held.sendall(b"PUT /v1/blocks/" + b"cd" * 32 + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 6000000\r\n\r\n"
                     + bytes(5 * MiB))
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            deadline = 50
            while deadline:  # until the server has received the held part
                r = http.put("/v1/blocks/" + "ef" * 32, content=bytes(2 * MiB))
                if r.status_code == 503:
                    break
                deadline -= 1
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
            assert isinstance(error_from(503, r.content), ServerBusy)  # the SDK's typed error
            assert http.get("/healthz").status_code == 200  # small calls still go
            assert srv.svc.inflight.stats()["refused"] >= 1
    finally:
        held.close()

