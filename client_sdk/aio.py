"""``AsyncKVClient``: ``KVClient``'s API as coroutines, for agents on an event loop.

The same shell as ``KVClient`` over async parts: the same requests
(``client_sdk.calls``, the simple calls written once in ``client_sdk.surface``),
an ``AsyncHttpTransport`` under the same retry policy, and the same co-located
flows (``client_sdk.colocated``) driven with awaited requests, copies over 1 MiB
in a worker thread. The planner picks shm or HTTP per transfer, or answers
"recompute" (``client_sdk.aio_planning``); with ``plan=False``, shm when
co-located, else HTTP. Puts that do not wait queue in ``client_sdk.pending``
(a task sends them; the copy of one over 1 MiB is made off the loop).
``tests/client_sdk/test_surface.py`` checks that both clients have the same
public methods with the same arguments.

Layer streams (``get_kv_layers``) are ``client_sdk.layers``' flows too: over
HTTP each layer is received by the loop's socket calls, over shm each is copied
out of the arena (in a worker thread when over 1 MiB).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk._common import BlockFill, BlockSink, BlockWriter
from client_sdk.blockwise import Place
from client_sdk.aio_media import AsyncHttpMedium, AsyncMedium, AsyncShmPath
from client_sdk.aio_planning import AsyncClientPlanner
from client_sdk.calls import put_layout
from client_sdk.colocated_puts import filled_kv
from client_sdk.layers import AsyncLayerStream, aget_kv_layers
from client_sdk.pending import MAX_PENDING_BYTES, AsyncPutHandle, AsyncPutQueue
from client_sdk.shell import ClientShell
from client_sdk.transport import AsyncHttpTransport
from kvstore.errors import InvalidInput, KVStoreError
from kvstore.keys import BlockHash, check_key
from kvstore.planner import Planner
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["AsyncKVClient", "AsyncLayerStream"]


class AsyncKVClient(ClientShell):
    """The asynchronous client. Arguments as ``KVClient``'s; ``max_connections`` bounds the socket pool.

    ``plan`` (default on) lets the transfer planner pick shm or HTTP per transfer, or answer
    "recompute" (``client_sdk.aio_planning``); ``wrap_media`` wraps each of its media (tests and
    benchmarks inject a slow link with ``AsyncThrottled``). ``inproc`` and ``redis_url`` are
    accepted for ``KVClient``'s signature only: the in-process and direct-Redis media block, and
    a thread hop per transfer would cost what they save.
    """

    def __init__(self, url: str, token: str | None = None, namespace: str = "default", *,
                 timeout_s: float | None = 60.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05, colocated: bool | None = None,
                 buffer_pool_bytes: int = 512 << 20, plan: bool = True, inproc: Any = None,
                 redis_url: str | None = None, wrap_media: Callable[[AsyncMedium], AsyncMedium] | None = None,
                 slo_s: float | None = None, max_pending_bytes: int = MAX_PENDING_BYTES,
                 agent: str | None = None,
                 max_connections: int = 8) -> None:
        super().__init__(AsyncHttpTransport, url, token, namespace, timeout_s=timeout_s,
                         connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s,
                         colocated=colocated, buffer_pool_bytes=buffer_pool_bytes, plan=plan, slo_s=slo_s,
                         redis_url=redis_url, agent=agent, max_connections=max_connections)
        self._http_medium = AsyncHttpMedium(self.http, self.pool)
        self.shm = AsyncShmPath(self.http, self.colocation, self.pool, self._report_soon, self._http_medium)
        self._wrap_media = wrap_media
        self._decider = Planner()
        """The planner's estimates and log: built now, so a prefill rate can be set before any transfer."""
        self._planner: AsyncClientPlanner | None = None
        self._plan_lock = asyncio.Lock()
        self._reporting: asyncio.Task | None = None
        """The access (and decision) report in flight, if any."""
        self._report_wanted = False
        self._closing = False
        self.puts = AsyncPutQueue(self._put, self.pool, self.namespace, max_pending_bytes)

    # -- data API ------------------------------------------------------------------------------

    async def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, durable: bool = False,
                     wait: bool = True, handoff: str | None = None) -> int | AsyncPutHandle:
        """As ``KVClient.put_kv``; with ``wait=False``, an ``AsyncPutHandle`` (``await handle``)."""
        spec, toks, kv = self._put_input(spec, tokens, kv, wait, handoff)
        if not wait:
            return await self.puts.submit(spec, toks, kv, durable)
        stored = await self._put(spec, toks, kv, durable)
        if handoff is not None:
            await self.handoff(spec, toks, to=handoff)
        return stored

    async def _put(self, spec: KVSpec, toks: Any, kv: torch.Tensor, durable: bool) -> int:
        if self.plan:
            stored = await (await self._planned()).put_kv(spec, toks, kv, self.slo_s)
        else:
            stored = await self.shm.put_kv(spec, toks, kv)
        if durable:
            c.check_durable(stored, await self._run(calls.lookup_blocks(spec, toks, sync=True)))
        return stored

    async def get_kv(self, spec: KVSpec, tokens: Any, *, out: Any = None,
                     slo_s: float | None = None) -> tuple[torch.Tensor, int]:
        """As ``KVClient.get_kv``: with planning on, ``n`` is 0 when recomputing is predicted faster."""
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        if self.plan:
            return await (await self._planned()).get_kv(spec, toks, out, self.slo_s if slo_s is None else slo_s)
        return await self.shm.get_kv(spec, toks, out)

    async def get_kv_layers(self, spec: KVSpec, tokens: Any) -> AsyncLayerStream:
        """As ``KVClient.get_kv_layers``: ``async for layer, kv_layer in await client.get_kv_layers(...)``."""
        return await aget_kv_layers(self.shm, c.check_spec(spec), tokens)

    async def reads_arena(self) -> bool:
        """As ``KVClient.reads_arena``."""
        return await self.shm.arena() is not None

    async def put_kv_blocks(self, spec: KVSpec, tokens: Any, fill: BlockFill) -> int:
        """As ``KVClient.put_kv_blocks``."""
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        got = await self.shm.put_kv_blocks(spec, toks, fill)
        if got is None:
            got = await self.put_kv(spec, toks, filled_kv(spec, toks, fill))
        return int(got)

    async def get_kv_blocks(self, spec: KVSpec, tokens: Any, place: Place, *, first: int = 0) -> int:
        """As ``KVClient.get_kv_blocks``."""
        spec = c.check_spec(spec)
        if first < 0:
            raise InvalidInput(f"get_kv_blocks: first={first} is negative")
        return await self.shm.get_kv_blocks(spec, c.tokens_of(tokens), first, place)

    async def lookup(self, spec: KVSpec, tokens: Any) -> Any:
        """As ``KVClient.lookup``."""
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        here = await self.shm.lookup(spec, toks)
        return here if here is not None else await super().lookup(spec, toks)

    # -- blocks by key: the co-located paths ------------------------------------------------------

    async def blocks_exist(self, keys: Sequence[BlockHash], *, ask_server: bool = True) -> list[bool]:
        """As ``KVClient.blocks_exist``."""
        return await self.shm.blocks_exist(keys, ask_server)

    async def get_blocks_into(self, keys: Sequence[BlockHash], sink: BlockSink) -> list[bool]:
        """As ``KVClient.get_blocks_into`` (``sink`` runs on the loop, or in a worker thread for
        large blocks: it must only copy)."""
        return await self.shm.get_blocks_into([check_key(k) for k in keys], sink)

    async def put_blocks_with(self, keys: Sequence[BlockHash], sizes: Sequence[int], writer: BlockWriter, *,
                              make_room: bool = False) -> int:
        """As ``KVClient.put_blocks_with``."""
        keys, offsets = put_layout(keys, sizes)
        return await self.shm.put_blocks_with(keys, offsets, writer, make_room) if keys else 0

    # -- the planner -----------------------------------------------------------------------------

    def set_prefill_rate(self, spec: KVSpec, tokens_per_s: float) -> None:
        """The caller's prefill speed for ``spec``: the planner answers "recompute" when that is faster."""
        self._decider.model.set_prefill_rate(c.check_spec(spec).fingerprint(), tokens_per_s)

    def decisions(self, limit: int = 100) -> list[dict]:
        """This client's newest decision records, oldest first."""
        return [d.to_dict() for d in self._decider.log.records(limit)]

    async def media(self) -> dict[str, AsyncMedium]:
        """The media the planner chooses among, by name (built on first use)."""
        return (await self._planned()).media

    async def _planned(self) -> AsyncClientPlanner:
        if self._planner is None:
            async with self._plan_lock:
                if self._planner is None:
                    self._planner = await self._build_planner()
        return self._planner

    async def _build_planner(self) -> AsyncClientPlanner:
        colocated = await self.shm.arena() is not None
        built: dict[str, AsyncMedium] = {}
        if colocated:
            built["shm"] = self.shm
        built["http"] = self._http_medium
        if self._wrap_media is not None:
            built = {k: self._wrap_media(m) for k, m in built.items()}
        return await AsyncClientPlanner.create(
            built, fetch_policies=lambda: self.http.run(calls.policy()), routing_key=self.namespace,
            locality="colocated" if colocated else "remote", planner=self._decider, report=self._report_soon)

    # -- reports and lifecycle ---------------------------------------------------------------------

    def _report_soon(self) -> None:
        """Send pending access and decision reports in a task of their own: no transfer waits on it.

        One task at a time; what is asked for while it runs goes in its next round. Nothing
        starts once the client is closing (``aclose`` sends what is left itself).
        """
        if self._closing:
            return
        self._report_wanted = True
        if self._reporting is None or self._reporting.done():
            self._reporting = asyncio.get_running_loop().create_task(self._report_rounds())

    async def _report_rounds(self) -> None:
        try:
            while self._report_wanted and not self._closing:
                self._report_wanted = False
                await self._reports()
        except Exception:  # noqa: BLE001 - reports are advisory: logged, never left for the loop to find
            log.debug("a report failed", exc_info=True)

    async def _reports(self) -> None:
        """``KVClient._reports``, awaited."""
        arena = self.colocation.arena
        while arena is not None and (report := arena.accesses.drain()) is not None:
            try:
                await self.http.run(calls.touch(report))
            except (KVStoreError, ValueError) as exc:
                log.debug("access report dropped: %s", exc)
        while records := self._decider.log.drain(256):
            try:
                await self.http.run(calls.decisions([d.to_dict() for d in records]))
            except (KVStoreError, ValueError) as exc:
                log.debug("decision report dropped: %s", exc)
                break

    async def flush(self, timeout_s: float | None = None) -> bool:
        """As ``KVClient.flush``."""
        return await self.puts.flush(timeout_s)

    async def wait_reports(self, timeout_s: float | None = None) -> bool:
        """Wait until no access report is queued or in flight; False if ``timeout_s`` passed first."""
        task = self._reporting
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        return bool(done)

    async def aclose(self) -> None:
        """As ``KVClient.close``: the queued puts first."""
        await self.puts.aclose()
        self._closing = True
        if self._reporting is not None:  # finished, failed or cancelled: closing the rest matters more
            await asyncio.gather(self._reporting, return_exceptions=True)
        try:
            await self._reports()
        except Exception:  # noqa: BLE001 - as above
            log.debug("the last report failed", exc_info=True)
        if self._planner is not None:
            self._planner.close()
        await self.shm.run(self.colocation.close_flow())
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncKVClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

