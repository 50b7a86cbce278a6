"""``put_kv(..., wait=False)``, its handle, ``flush()`` and ``close()``, against a real server.

The rules under test are ``client_sdk.pending``'s: the caller's tensor is free once the put
returns; puts land in the order queued; queued copies hold at most ``max_pending_bytes``; a
failure is the handle's, and is raised once more by the next ``put_kv`` or ``flush``; ``close``
waits for the puts and logs what no call raised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from client_sdk import AsyncKVClient, AsyncPutHandle, KVClient, PutFailed, PutHandle, QuotaExceeded
from client_sdk.aio_media import AsyncThrottled
from client_sdk.media import Throttled
from kvstore.errors import InvalidKV, InvalidSpec, NotDurable
from tests.conftest import make_kv, make_spec
from tests.server.conftest import BETA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG = make_spec(num_layers=32, head_dim=128)
"""32 KiB a token, 512 KiB a block: two blocks fill the beta tenant's 1 MiB quota."""


def _seq(i: int, n: int = 64) -> list[int]:
    return list(range(i * 10_000, i * 10_000 + n))


def _slow(latency_s: float):
    return lambda medium: Throttled(medium, latency_s=latency_s)


def _aslow(latency_s: float):
    return lambda medium: AsyncThrottled(medium, latency_s=latency_s)


CHILD = textwrap.dedent("""
    import sys, torch
    from client_sdk import KVClient
    from tests.conftest import make_spec
    url, out, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = make_spec(num_layers=32, head_dim=128)
    with KVClient(url, namespace="nowait") as c:
        for i in range(count):
            kv, n = c.get_kv(spec, list(range(i * 10_000, i * 10_000 + 70)))
            with open(f"{out}.{i}", "wb") as f:
                f.write(n.to_bytes(4, "little") + kv.contiguous().view(torch.uint8).numpy().tobytes())
""")


@pytest.mark.parametrize("colocated", [None, False])
def test_another_process_reads_the_puts_bit_for_bit_after_flush(server, tmp_path, colocated):
    kvs = [make_kv(BIG, 70, seed=i) for i in range(3)]  # 2.2 MiB each; 70 tokens: 64 stored
    with KVClient(server.url, namespace="nowait", colocated=colocated) as c:
        handles = [c.put_kv(BIG, list(range(i * 10_000, i * 10_000 + 70)), kv, wait=False)
                   for i, kv in enumerate(kvs)]
        assert all(isinstance(h, PutHandle) and h.tokens == 64 for h in handles)
        assert c.flush() is True
        assert all(h.done() and h.result() == 64 for h in handles)
    res = subprocess.run([sys.executable, "-c", CHILD, server.url, str(tmp_path / "kv"), "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for i, kv in enumerate(kvs):
        got = (tmp_path / f"kv.{i}").read_bytes()
        assert int.from_bytes(got[:4], "little") == 64
        assert got[4:] == kv[:, :, :, :64].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("colocated", [None, False])
def test_the_caller_may_overwrite_its_tensor_once_put_returns(server, spec, colocated):
    kv = make_kv(spec, 64, seed=1)
    want = kv.clone()
    with KVClient(server.url, colocated=colocated, wrap_media=_slow(0.1)) as c:
        c.put_kv(spec, _seq(1), make_kv(spec, 64, seed=2), wait=False)  # holds the put thread 0.1 s
        h = c.put_kv(spec, _seq(2), kv, wait=False)
        kv.copy_(make_kv(spec, 64, seed=3))  # at once: the put of _seq(2) has not started
        assert not h.done()
        assert c.flush() and h.result() == 64
        got, n = c.get_kv(spec, _seq(2))
    assert n == 64 and torch.equal(got, want) and not torch.equal(got, kv)


def test_puts_land_in_the_order_queued(server, spec):
    """Two puts of the same tokens with different KV: the first stored wins (a block stored is
    not replaced), so each sequence holds its first put's KV only if the puts landed in order."""
    with KVClient(server.url, wrap_media=_slow(0.01)) as c:
        handles = []
        for i in range(6):
            handles.append(c.put_kv(spec, _seq(i), make_kv(spec, 64, seed=2 * i), wait=False))
            handles.append(c.put_kv(spec, _seq(i), make_kv(spec, 64, seed=2 * i + 1), wait=False))
        c.flush()
        assert [h.result() for h in handles] == [64] * 12
        for i in range(6):
            got, n = c.get_kv(spec, _seq(i))
            assert n == 64 and torch.equal(got, make_kv(spec, 64, seed=2 * i)), i


def test_queued_copies_stay_under_the_bound_and_a_larger_put_goes_alone(server, spec):
    size = 64 * spec.bytes_per_token
    bound = 2 * size + size // 2  # room for two puts' copies
    with KVClient(server.url, wrap_media=_slow(0.15), max_pending_bytes=bound) as c:
        handles = []
        for i in range(6):
            handles.append(c.put_kv(spec, _seq(i), make_kv(spec, 64, seed=i), wait=False))
            assert c.puts.pending_bytes <= bound
            if i >= 2:  # a third copy would not fit: put_kv waited for the put two back
                assert handles[i - 2].done(), i
        big = c.put_kv(spec, _seq(9, 192), make_kv(spec, 192), wait=False)  # 3 * size > bound
        assert all(h.done() for h in handles)  # it waited for every earlier put...
        assert c.puts.pending_bytes == 3 * size  # ...then went alone
        c.put_kv(spec, _seq(10), make_kv(spec, 64), wait=False)
        assert big.done()
        assert c.flush() and c.puts.pending_bytes == 0
        assert c.lookup(spec, _seq(9, 192)) == 192


def test_flush_waits_for_what_was_queued_and_reports_a_timeout(server, spec):
    with KVClient(server.url, wrap_media=_slow(0.25)) as c:
        h = c.put_kv(spec, _seq(1), make_kv(spec, 64), wait=False)
        assert c.flush(timeout_s=0.05) is False and not h.done()
        with pytest.raises(TimeoutError):
            h.result(timeout_s=0.01)
        assert c.flush() is True and h.done()


def test_bad_input_raises_at_once_and_queues_nothing(server, spec):
    kv = make_kv(spec, 64)
    with KVClient(server.url) as c:
        with pytest.raises(InvalidKV):
            c.put_kv(spec, _seq(1), kv[:, :, :, :10], wait=False)
        with pytest.raises(InvalidKV):
            c.put_kv(spec, _seq(1), kv.float(), wait=False)
        with pytest.raises(InvalidSpec):
            c.put_kv(spec.to_dict(), _seq(1), kv, wait=False)
        assert c.puts.state.queued == 0 and c.puts.pending_bytes == 0
        assert c.flush() is True


@pytest.mark.parametrize("colocated", [None, False])
def test_a_failed_put_surfaces_on_its_handle_then_once_on_the_next_call(auth_server, colocated):
    with KVClient(auth_server.url, token=BETA, namespace="beta", colocated=colocated, wrap_media=_slow(0.2)) as c:
        h = c.put_kv(BIG, _seq(1, 48), make_kv(BIG, 48), wait=False)  # 1.5 MiB > the 1 MiB quota
        for _ in range(2):  # the handle says so every time it is asked
            with pytest.raises(QuotaExceeded):
                h.result(timeout_s=30)
        assert isinstance(h.exception(), QuotaExceeded)
        # the next put_kv raises it once more, naming the put, instead of putting
        with pytest.raises(PutFailed, match=r"48 tokens .* namespace 'beta'") as failed:
            c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16))
        assert isinstance(failed.value.__cause__, QuotaExceeded)
        assert (failed.value.tokens, failed.value.namespace, failed.value.failed) == (48, "beta", 1)
        assert c.lookup(BIG, _seq(2, 16)) == 0
        assert c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16)) == 16  # said once: not again
        assert c.flush() is True

        # flush() is a next call too; two failures before it are one PutFailed (queued behind a
        # slow put, so that neither fails before the other is queued)
        c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16), wait=False)
        c.put_kv(BIG, _seq(3, 48), make_kv(BIG, 48), wait=False)
        c.put_kv(BIG, _seq(4, 48), make_kv(BIG, 48), wait=False)
        with pytest.raises(PutFailed, match="1 later put") as failed:
            c.flush()
        assert failed.value.failed == 2 and isinstance(failed.value.__cause__, QuotaExceeded)
        assert c.flush() is True
        assert c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16), wait=False).result() == 16


def test_a_durable_put_that_does_not_wait_is_checked_in_the_put_thread(server, spec):
    with KVClient(server.url) as c:  # shm and memory: volatile tiers
        h = c.put_kv(spec, _seq(1), make_kv(spec, 64), durable=True, wait=False)
        with pytest.raises(NotDurable):
            h.result(timeout_s=30)
        with pytest.raises(PutFailed) as failed:
            c.flush()
        assert isinstance(failed.value.__cause__, NotDurable)
        assert c.lookup(spec, _seq(1)) == 64  # stored all the same, as a waiting put's would be


def test_close_stores_the_puts_still_queued(server, spec):
    c = KVClient(server.url, wrap_media=_slow(0.2))
    handles = [c.put_kv(spec, _seq(i), make_kv(spec, 64, seed=i), wait=False) for i in range(3)]
    assert not handles[-1].done()
    c.close()
    assert all(h.result(timeout_s=0) == 64 for h in handles)
    with KVClient(server.url) as other:
        for i in range(3):
            got, n = other.get_kv(spec, _seq(i))
            assert n == 64 and torch.equal(got, make_kv(spec, 64, seed=i))


def test_close_logs_a_failure_no_call_raised_and_does_not_raise(auth_server, caplog):
    c = KVClient(auth_server.url, token=BETA, namespace="beta")
    h = c.put_kv(BIG, _seq(1, 48), make_kv(BIG, 48), wait=False)
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        c.close()
    assert isinstance(h.exception(timeout_s=0), QuotaExceeded)
    assert "unreported put failures" in caplog.text and "QuotaExceeded" in caplog.text


# -- the async client ------------------------------------------------------------------------------


@pytest.mark.parametrize("colocated", [None, False])
def test_async_put_without_waiting(server, colocated):
    async def main() -> None:
        async with AsyncKVClient(server.url, colocated=colocated, wrap_media=_aslow(0.1)) as c:
            first = await c.put_kv(BIG, _seq(1), make_kv(BIG, 64, seed=1), wait=False)  # 2 MiB: copied off the loop
            kv = make_kv(BIG, 64, seed=2)
            want = kv.clone()
            h = await c.put_kv(BIG, _seq(2), kv, wait=False)
            kv.zero_()
            again = await c.put_kv(BIG, _seq(2), make_kv(BIG, 64, seed=3), wait=False)  # the first put wins
            assert isinstance(h, AsyncPutHandle) and not h.done()
            assert await c.flush() is True
            assert await first == await h == await again.result() == 64
            got, n = await c.get_kv(BIG, _seq(2))
            assert n == 64 and torch.equal(got, want)
            with pytest.raises(InvalidKV):
                await c.put_kv(BIG, _seq(3), want[:, :, :, :10], wait=False)
            assert c.puts.state.queued == 3 and c.puts.pending_bytes == 0

    asyncio.run(main())


def test_async_backpressure_and_close(server, spec):
    size = 64 * spec.bytes_per_token

    async def main() -> None:
        c = AsyncKVClient(server.url, wrap_media=_aslow(0.15), max_pending_bytes=2 * size)
        handles = []
        for i in range(5):
            handles.append(await c.put_kv(spec, _seq(i), make_kv(spec, 64, seed=i), wait=False))
            assert c.puts.pending_bytes <= 2 * size
            if i >= 2:
                assert handles[i - 2].done(), i
        assert not handles[-1].done()
        await c.aclose()  # waits for the queued puts
        assert all(h.done() for h in handles)
        async with AsyncKVClient(server.url) as other:
            assert [await other.lookup(spec, _seq(i)) for i in range(5)] == [64] * 5

    asyncio.run(main())


def test_async_failures_surface_on_the_handle_then_once(auth_server):
    async def main() -> None:
        async with AsyncKVClient(auth_server.url, token=BETA, namespace="beta") as c:
            h = await c.put_kv(BIG, _seq(1, 48), make_kv(BIG, 48), wait=False)
            with pytest.raises(QuotaExceeded):
                await h
            assert isinstance(await h.exception(), QuotaExceeded)
            with pytest.raises(PutFailed) as failed:
                await c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16), wait=False)
            assert isinstance(failed.value.__cause__, QuotaExceeded) and c.puts.state.queued == 1
            assert await c.flush() is True
            await c.put_kv(BIG, _seq(3, 48), make_kv(BIG, 48), wait=False)
            with pytest.raises(PutFailed):
                await c.flush()
            assert await c.put_kv(BIG, _seq(2, 16), make_kv(BIG, 16)) == 16

    asyncio.run(main())


def test_a_timed_out_wait_leaves_the_put_running(server, spec):
    async def main() -> None:
        async with AsyncKVClient(server.url, wrap_media=_aslow(0.25)) as c:
            h = await c.put_kv(spec, _seq(1), make_kv(spec, 64), wait=False)
            with pytest.raises(TimeoutError):
                await h.result(timeout_s=0.05)
            assert await c.flush(timeout_s=0.05) is False and not h.done()
            assert await h == 64

    asyncio.run(main())
