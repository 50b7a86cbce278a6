"""The async client plans too: shm or HTTP per transfer, or recompute; records reach the server."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from client_sdk import AsyncKVClient
from client_sdk.aio_media import AsyncThrottled
from kvstore.errors import ConnectionFailed
from kvstore.spec import KVSpec
from tests.server.conftest import ADMIN, TOKENS

SPEC = KVSpec("aio-planner-test", fingerprint="rev-1", num_layers=4, num_kv_heads=2, head_dim=32, dtype="float16",
              block_tokens=16)
TOKS = np.arange(512, dtype=np.uint32)  # 512 tokens: 512 KiB of KV


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(SPEC.kv_shape(512), generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def _slow(bandwidth_Bps: float):
    return lambda m: AsyncThrottled(m, latency_s=0.0005, bandwidth_Bps=bandwidth_Bps)


def test_colocated_async_client_plans_over_shm_and_reports_its_decisions(serve_app):
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)
    acme = next(t for t, g in TOKENS.items() if g["tenant"] == "acme")
    kv = _kv(1)

    async def main() -> list[dict]:
        async with AsyncKVClient(srv.url, token=acme, namespace="acme") as client:
            assert await client.put_kv(SPEC, TOKS, kv) == 512
            for _ in range(3):
                got, n = await client.get_kv(SPEC, TOKS)
                assert n == 512 and torch.equal(got, kv)
            d = client.last_decision
            assert d.locality == "colocated" and {c.option for c in d.candidates} >= {"shm", "http"}
            assert d.choice == "shm", d.reason  # a 512 KiB copy out of the arena beats a socket
            return client.decisions()

    local = asyncio.run(main())
    assert [d["op"] for d in local] == ["put", "get", "get", "get"]
    assert all(d["predicted_s"] is not None and d["actual_s"] > 0 for d in local)
    rows = httpx.get(srv.url + "/admin/decisions", headers={"Authorization": f"Bearer {ADMIN}"}).json()["decisions"]
    assert len(rows) == 4 and {r["namespace"] for r in rows} == {"acme"}  # sent by aclose at the latest
    assert all(r["actual_s"] > 0 and r["candidates"] for r in rows)


def test_async_recompute_under_an_injected_bandwidth_cap_and_fetch_otherwise(server):
    kv = _kv(2)

    async def main() -> None:
        async with AsyncKVClient(server.url, colocated=False, plan=False) as plain:
            await plain.put_kv(SPEC, TOKS, kv)
        # 512 KiB at 2 MB/s is ~0.26 s, against 0.05 s of prefill at 10k tokens/s.
        async with AsyncKVClient(server.url, colocated=False, wrap_media=_slow(2e6)) as slow:
            slow.set_prefill_rate(SPEC, 10_000.0)
            got, n = await slow.get_kv(SPEC, TOKS)
            d = slow.last_decision
            assert n == 0 and got.shape[3] == 0
            assert d.choice == "recompute" and "recompute 512 tokens" in d.reason
            assert next(c for c in d.candidates if c.option == "recompute").predicted_s == pytest.approx(0.0512)
        async with AsyncKVClient(server.url, colocated=False, wrap_media=_slow(2e9)) as fast:
            fast.set_prefill_rate(SPEC, 10_000.0)
            got, n = await fast.get_kv(SPEC, TOKS)
            assert n == 512 and torch.equal(got, kv)
            assert fast.last_decision.choice == "http" and fast.last_decision.locality == "remote"

    asyncio.run(main())


def test_async_failing_medium_is_set_aside_and_the_transfer_retried_over_http(server):
    kv = _kv(3)

    # HTTP behind 50 ms of injected latency: shm is the planner's choice until it fails, however
    # busy the machine (CI once saw a plain HTTP put measured faster than the shm one, under load)
    slow_http = lambda m: AsyncThrottled(m, latency_s=0.05) if m.name == "http" else m  # noqa: E731

    async def main() -> None:
        async with AsyncKVClient(server.url, wrap_media=slow_http) as client:
            await client.put_kv(SPEC, TOKS, kv)
            planner = await client._planned()
            assert client.last_decision.choice == "shm"

            async def broken(*args, **kwargs):
                raise ConnectionFailed("injected: the arena is gone")

            planner.media["shm"].get_kv = broken  # a fault, injected
            for _ in range(3):
                got, n = await client.get_kv(SPEC, TOKS)
                assert n == 512 and torch.equal(got, kv)
            assert "shm" in planner._down
            gets = [d for d in client.decisions() if d["op"] == "get"]
            assert len([d for d in gets if d["error"]]) == 1  # tried once, then set aside
            assert [d["choice"] for d in gets[1:]] == ["http"] * 3

    asyncio.run(main())


def test_async_plan_false_keeps_the_fixed_medium(server):
    kv = _kv(4)

    async def main() -> None:
        async with AsyncKVClient(server.url, plan=False) as client:
            await client.put_kv(SPEC, TOKS, kv)
            got, n = await client.get_kv(SPEC, TOKS)
            assert n == 512 and torch.equal(got, kv)
            assert client.stats.last_medium == "shm" and client.last_decision is None and client.decisions() == []

    asyncio.run(main())


def test_concurrent_async_gets_wait_for_each_other_on_a_shared_link(server):
    kv = _kv(5)

    async def main() -> None:
        async with AsyncKVClient(server.url, colocated=False, plan=False) as plain:
            await plain.put_kv(SPEC, TOKS, kv)
        async with AsyncKVClient(server.url, colocated=False, wrap_media=_slow(1e9)) as client:
            await client.get_kv(SPEC, TOKS)  # the planner is built and the link probed
            results = await asyncio.gather(*(client.get_kv(SPEC, TOKS) for _ in range(3)))
            assert all(n == 512 and torch.equal(got, kv) for got, n in results)
            gets = client.decisions()[-3:]
            queued = [next(c for c in d["candidates"] if c["option"] == "http")["queued_bytes"] for d in gets]
            # Each decides before the transfers ahead of it have finished: 0, then one, then two gets queued.
            assert queued == [0, 512 << 10, 1024 << 10]
            waits = [next(c for c in d["candidates"] if c["option"] == "http")["wait_s"] for d in gets]
            assert waits[0] == 0 and waits[1] > 0 and waits[2] == pytest.approx(2 * waits[1])  # each one queued slows it

    asyncio.run(main())


def test_a_cancelled_transfer_still_finishes_its_record(server):
    kv = _kv(6)

    async def main() -> None:
        async with AsyncKVClient(server.url, colocated=False, plan=False) as plain:
            await plain.put_kv(SPEC, TOKS, kv)
        async with AsyncKVClient(server.url, colocated=False, wrap_media=_slow(1e9)) as client:
            await client.get_kv(SPEC, TOKS)
            client._planner.media["http"].latency_s = 5.0  # a link that hangs, injected
            task = asyncio.create_task(client.get_kv(SPEC, TOKS))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            last = client.decisions()[-1]
            assert last["actual_s"] >= 0.2 and "CancelledError" in last["error"] and last["actual_bytes"] == 0
            client._planner.media["http"].latency_s = 0.0005
            got, n = await client.get_kv(SPEC, TOKS)  # the client goes on
            assert n == 512 and torch.equal(got, kv)

    asyncio.run(main())
