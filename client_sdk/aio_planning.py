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
from typing import Any, Awaitable, Callable

import torch

from client_sdk.aio_media import AsyncMedium
from client_sdk.planning import PlanCore
from kvstore.errors import KVStoreError
from kvstore.planner import RECOMPUTE, Decision, Option
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

    async def _explore(self, op: str, options: list[Option], policy: Policy) -> None:
        """Probe every option whose estimate for ``op`` is missing or older than ``explore_after_s``."""
        async with self._probing:
            for option in self._stale(op, options, policy):
                medium = self.media[option.medium]
                try:
                    rtt = []
                    for _ in range(3):  # the least of three: the first may pay for a connect
                        t0 = time.perf_counter()
                        await medium.probe(0)
                        rtt.append(time.perf_counter() - t0)
                    wire, took = self._probe_wire(option, policy), 0.0
                    if wire:
                        t0 = time.perf_counter()
                        await medium.probe(wire)
                        took = time.perf_counter() - t0
                    self._probed(op, option, policy, min(rtt), wire, took)
                except KVStoreError as exc:
                    self._probe_failed(option, policy, exc)

    async def _usable(self, op: str, policy: Policy) -> list[Option]:
        up = self._up(op, policy)
        await self._explore(op, up, policy)
        return self._still_up(up)

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any, slo_s: float | None) -> tuple[torch.Tensor, int]:
        return await self._run(
            "get", lambda policy, options: self._decide_get(spec, toks, out, slo_s, policy, options),
            lambda medium, option: medium.get_kv(spec, toks, out),
            lambda d, policy, option, got, took: self._finish_get(d, policy, option, spec, got[1], took),
            lambda: (spec.empty_kv(0), 0))

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor, slo_s: float | None) -> int:
        return await self._run(
            "put", lambda policy, options: self._decide_put(spec, toks, slo_s, policy, options),
            lambda medium, option: medium.put_kv(spec, toks, kv),
            lambda d, policy, option, got, took: self._finish_put(d, policy, spec, got, took))

    async def _run(self, op: str, decide: Callable[[Policy, list[Option]], Decision],
                   move: Callable[[AsyncMedium, Option], Awaitable[Any]],
                   done: Callable[[Decision, Policy, Option, Any, float], None],
                   recomputed: Callable[[], Any] | None = None) -> Any:
        """``ClientPlanner._run``, awaited."""
        for attempt in range(2):
            policy = await self.policy()
            d = decide(policy, await self._usable(op, policy))
            if d.choice == RECOMPUTE:
                assert recomputed is not None
                return recomputed()
            option = d.option
            assert option is not None
            t0 = time.perf_counter()
            try:
                with self._in_flight(option, d.nbytes):
                    got = await move(self.media[option.medium], option)
            except KVStoreError as exc:
                self._failed(d, policy, option, t0, exc, retry=attempt == 0)
                continue
            except BaseException as exc:  # cancelled, or a bug: recorded, and raised as it is
                self._abandoned(d, policy, t0, exc)
                raise
            done(d, policy, option, got, time.perf_counter() - t0)
            return got
        raise AssertionError("unreachable: the second failure raises")
