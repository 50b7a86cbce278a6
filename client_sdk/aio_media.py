"""The async client's media: HTTP over the loop's sockets, and the co-located path.

``AsyncHttpMedium`` owns an ``AsyncHttpTransport``; ``AsyncShmPath`` drives the
co-located flows of ``client_sdk.colocated`` (the ones ``KVClient`` drives
blocking) with awaited requests, and is the planner's ``shm`` medium.
``AsyncThrottled`` injects a slow link, as ``client_sdk.media.Throttled`` does.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence, TypeVar

import torch

from client_sdk import _common as c
from client_sdk.arena import Arena
from client_sdk import calls
from client_sdk.blockwise import Place, place_flow, place_from_tensor
from client_sdk.colocated import Colocation, adrive, blocks_exist_flow, cached_get, get_blocks_into_flow, get_flow
from client_sdk.colocated_puts import asking_for_slots, pooled_put_flow, put_blocks_flow, put_flow
from client_sdk.media import Throttled
from client_sdk.rest_media import shm_probe
from client_sdk.transport import AsyncHttpTransport
from kvstore.errors import ServiceError
from kvstore.keys import BlockHash
from kvstore.spec import KVSpec

__all__ = ["AsyncMedium", "AsyncHttpMedium", "AsyncShmPath", "AsyncThrottled", "off_loop"]

T = TypeVar("T")
THREAD_COPY_BYTES = 1 << 20  # copies larger than this leave the loop


async def off_loop(nbytes: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in a worker thread when it moves more than ``THREAD_COPY_BYTES``, else here."""
    if nbytes > THREAD_COPY_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class AsyncMedium(ABC):
    """One way the async client moves KV: ``get_kv``/``put_kv`` of a token prefix, and a probe."""

    name: str = "?"
    remote: bool = True
    puts: bool = True
    codecs: tuple = (None, "raw")

    @abstractmethod
    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]: ...

    @abstractmethod
    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int: ...

    @abstractmethod
    async def probe(self, nbytes: int) -> None:
        """Move ``nbytes`` of filler the way a get would (0: one empty round trip)."""

    def close(self) -> None:
        """Nothing to release by default: the client owns the sockets and the arena."""


class AsyncHttpMedium(AsyncMedium):
    """Raw KV over an ``AsyncHttpTransport``."""

    name = "http"

    def __init__(self, http: AsyncHttpTransport, pool: c.TensorPool | None = None) -> None:
        self.http = http
        self.pool = pool

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]:
        return await self.http.get_kv(spec, c.kv_parts(spec, toks, None), out, self.pool)

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        stored = await self.http.run(calls.put_kv_http(spec, toks, kv))
        self.http.stats.http_puts += 1
        self.http.stats.last_medium = "http"
        return stored

    async def probe(self, nbytes: int) -> None:
        await self.http.probe(nbytes)


class AsyncShmPath(AsyncMedium):
    """An async client's co-located path and ``shm`` medium: ``client_sdk.rest_media.ShmPath``'s
    twin, driving the same flows (``client_sdk.colocated``) with awaited requests; copies over
    1 MiB run in a worker thread so the loop stays responsive. Puts it cannot carry go to
    ``fallback`` (the HTTP medium).
    """

    name = "shm"
    remote = False

    def __init__(self, http: AsyncHttpTransport, colocation: Colocation, pool: c.TensorPool,
                 report: Callable[[], None], fallback: AsyncMedium) -> None:
        self.http = http
        self.colocation = colocation
        self.pool = pool
        self.out_views = c.OutViews()
        self.stats = http.stats
        self.namespace = http.namespace
        self.report = report
        self.fallback = fallback
        self._lock = asyncio.Lock()
        self._buf: memoryview | None = None

    async def arena(self) -> Arena | None:
        """``ShmPath.arena``, awaited."""
        colo = self.colocation
        if colo.undecided:
            async with self._lock:
                if colo.undecided:
                    await self.run(colo.pick_flow())
        arena = colo.current()
        if arena is not None and arena.accesses.on_pending is None:
            # reads added to an empty log (maybe in a copy's worker thread) are reported once of
            # age, even when no later read asks: a timer on this loop
            loop, log_ = asyncio.get_running_loop(), arena.accesses
            arena.accesses.on_pending = lambda: loop.call_soon_threadsafe(loop.call_later, log_.max_age_s,
                                                                          self.report)
        return arena

    async def run(self, flow: Any) -> Any:
        return await adrive(flow, self.http.run, off_loop)

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]:
        arena = await self.arena()
        if arena is None:  # the server restarted without an arena this client can map: HTTP
            return await self.http.get_kv(spec, c.kv_parts(spec, toks, None), out, self.pool)
        got = await off_loop(spec.bytes_per_token * len(toks), cached_get, arena, spec, toks, out, self.pool,
                             self.out_views, self.namespace, self.stats)
        if got is not None:  # every block's slot was known here (remembered, or indexed): no request
            if arena.accesses.due():
                self.report()
            return got
        return await self.run(get_flow(self.colocation, arena, spec, toks, out, self.pool, self.stats))

    async def get_kv_blocks(self, spec: KVSpec, toks: Any, first: int, place: Place) -> int:
        """``ShmPath.get_kv_blocks``, awaited (``place`` runs off the loop for a large prefix)."""
        arena = await self.arena()
        got = None if arena is None else await self.run(place_flow(self.colocation, arena, spec, toks, first, place,
                                                                   self.namespace, self.stats, self.report))
        if got is None:
            kv, got = await self.get_kv(spec, toks, None)
            await off_loop(kv.nbytes, place_from_tensor, kv[:, :, :, first * spec.block_tokens:got], spec, first,
                           place)
        return got

    async def lookup(self, spec: KVSpec, toks: Any) -> int | None:
        """``ShmPath.lookup``, awaited (the probe itself runs on the loop: a few numpy gathers)."""
        arena = await self.arena()
        blocks = None if arena is None else arena.blocks_for(spec, toks, self.namespace)
        return None if blocks is None else len(blocks) * spec.block_tokens

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        """``ShmPath.put_kv``, awaited."""
        arena = await self.arena()
        got = None if arena is None or not kv.shape[3] else await self.run(
            put_flow(self.colocation, arena, spec, toks, kv, self.stats, self.namespace))
        return await self.fallback.put_kv(spec, toks, kv) if got is None else got

    async def put_kv_blocks(self, spec: KVSpec, toks: Any, fill: c.BlockFill) -> int | None:
        """``ShmPath.put_kv_blocks``, awaited."""
        arena = await self.arena()
        if arena is None or not arena.pooled_puts or not spec.full_blocks(len(toks)) or not asking_for_slots(arena):
            return None
        return await self.run(pooled_put_flow(self.colocation, arena, spec, toks, fill, self.stats, self.namespace))

    async def blocks_exist(self, keys: Sequence[BlockHash], ask_server: bool = True) -> list[bool]:
        return await self.run(blocks_exist_flow(self.colocation, await self.arena(), keys, self.namespace,
                                                ask_server))

    async def get_blocks_into(self, keys: list[BlockHash], sink: c.BlockSink) -> list[bool]:
        return await self.run(get_blocks_into_flow(self.colocation, await self.arena(), keys, sink, self.namespace,
                                                   self.stats, self.report))

    async def put_blocks_with(self, keys: list[BlockHash], offsets: list[int], writer: c.BlockWriter,
                              make_room: bool) -> int:
        return await self.run(put_blocks_flow(self.colocation, await self.arena(), keys, offsets, writer, make_room,
                                              self.stats))

    async def probe(self, nbytes: int) -> None:
        """``shm_probe``, off the loop when large, as the real copies are."""
        arena = await self.arena()  # mapped again if the server restarted
        if arena is None:
            raise ServiceError("the server no longer offers a shm arena this client can map")
        self._buf = await off_loop(nbytes, shm_probe, arena, self._buf, nbytes)


class AsyncThrottled(AsyncMedium):
    """An async medium behind an injected link (``client_sdk.media.Throttled``'s twin): extra
    latency per call and a bandwidth cap, waited with ``asyncio.sleep``."""

    def __init__(self, inner: AsyncMedium, *, latency_s: float = 0.0, bandwidth_Bps: float | None = None) -> None:
        self.inner = inner
        self.name, self.remote, self.puts, self.codecs = inner.name, inner.remote, inner.puts, inner.codecs
        self.latency_s = latency_s
        self.bandwidth_Bps = bandwidth_Bps

    left_s = Throttled.left_s

    async def _hold(self, started: float, nbytes: int) -> None:
        left = self.left_s(started, nbytes)
        if left > 0:
            await asyncio.sleep(left)

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]:
        t0 = time.perf_counter()
        kv, n = await self.inner.get_kv(spec, toks, out)
        await self._hold(t0, n * spec.bytes_per_token)
        return kv, n

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = await self.inner.put_kv(spec, toks, kv)
        await self._hold(t0, n * spec.bytes_per_token)
        return n

    async def probe(self, nbytes: int) -> None:
        t0 = time.perf_counter()
        await self.inner.probe(nbytes)
        await self._hold(t0, nbytes)

    def close(self) -> None:
        self.inner.close()
