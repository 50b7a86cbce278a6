"""``AsyncKVClient``'s planner: ``client_sdk.planning``'s decisions, with probes and transfers awaited.

Its media are the async client's own paths (``client_sdk.aio_media``): ``shm``
(co-located arena slots) and ``http`` (raw KV over the loop's sockets), raw
codec only. Flight and direct Redis are the synchronous client's: their
libraries block, and a thread hop per transfer would cost what they save.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Generator

import torch

from client_sdk.aio_media import AsyncMedium
from client_sdk.colocated import Steps
from client_sdk.planning import PlanCore
from kvstore.errors import KVStoreError
from kvstore.policy import Policy
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["AsyncClientPlanner"]


class AsyncClientPlanner(PlanCore):
    """The planner as one ``AsyncKVClient`` uses it. Build it with ``await AsyncClientPlanner.create(...)``.

    Args:
        media: the async client's media, by name.
        fetch_policies: awaits the server's ``PolicySet`` JSON (None: keep the defaults).
        Others: as ``PlanCore``'s.
    """

    def __init__(self, media: dict[str, AsyncMedium], *,
                 fetch_policies: Callable[[], Awaitable[Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(media, **kwargs)
        self.fetch_policies = fetch_policies
        self._probing = asyncio.Lock()

    @classmethod
    async def create(cls, media: dict[str, AsyncMedium], **kwargs: Any) -> "AsyncClientPlanner":
        self = cls(media, **kwargs)
        await self._refresh(force=True)
        await asyncio.to_thread(self._calibrate_codecs)  # where int8 is offered, torch set-up: off the loop
        return self

    async def policy(self) -> Policy:
        await self._refresh()
        return self.policies.for_key(self.routing_key)

    async def _refresh(self, force: bool = False) -> None:
        if self.fetch_policies is None or not self._refresh_due(force):
            return
        try:
            data = await self.fetch_policies()
        except (KVStoreError, ValueError, TypeError) as exc:  # keep the last good policies
            log.debug("policy refresh failed: %s", exc)
            return
        self._apply_policies(data)

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any, slo_s: float | None) -> tuple[torch.Tensor, int]:
        return await self._drive(self._transfer(
            "get", lambda policy, options: self._decide_get(spec, toks, out, slo_s, policy, options),
            lambda medium, option: medium.get_kv(spec, toks, out),
            lambda d, policy, option, got, took: self._finish_get(d, policy, option, spec, got[1], took),
            lambda: (spec.empty_kv(0), 0)))

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor, slo_s: float | None) -> int:
        return await self._drive(self._transfer(
            "put", lambda policy, options: self._decide_put(spec, toks, slo_s, policy, options),
            lambda medium, option: medium.put_kv(spec, toks, kv),
            lambda d, policy, option, got, took: self._finish_put(d, policy, spec, got, took)))

    @staticmethod
    async def _timed(probe: Callable[[int], Awaitable[None]], nbytes: int) -> float:
        t0 = time.perf_counter()
        await probe(nbytes)
        return time.perf_counter() - t0

    @staticmethod
    async def _drive(transfer: Generator[Callable[[], Awaitable[Any]], Any, Any]) -> Any:
        """``ClientPlanner._drive``, each step awaited."""
        steps = Steps(transfer)
        for step in steps:
            try:
                steps.answer = await step()
            except BaseException as exc:  # cancelled too: the transfer records it, then raises it
                steps.error = exc
        return steps.result
