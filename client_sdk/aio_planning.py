"""``AsyncKVClient``'s planner: ``client_sdk.planning``'s decisions, with probes and transfers awaited.

Its media are the async client's own paths, behind ``AsyncMedium``: ``shm``
(co-located arena slots) and ``http`` (raw KV over the loop's sockets), raw
codec only. Flight and direct Redis are the synchronous client's: their
libraries block, and a thread hop per transfer would cost what they save.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from client_sdk.media import Throttled
from client_sdk.planning import PlanCore
from client_sdk.rest_media import shm_probe
from kvstore.errors import ServiceError
from kvstore.errors import KVStoreError
from kvstore.planner import RECOMPUTE, Decision, Option
from kvstore.policy import Policy
from kvstore.spec import KVSpec

if TYPE_CHECKING:
    from client_sdk.aio import AsyncKVClient

log = logging.getLogger("kvstore.client")

__all__ = ["AsyncMedium", "AsyncHttpMedium", "AsyncShmMedium", "AsyncThrottled", "AsyncClientPlanner"]


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
    name = "http"

    def __init__(self, client: "AsyncKVClient") -> None:
        self.client = client

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]:
        return await self.client._get_http(spec, toks, out)

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        return await self.client._put_http(spec, toks, kv)

    async def probe(self, nbytes: int) -> None:
        await self.client._probe_http(nbytes)


class AsyncShmMedium(AsyncMedium):
    name = "shm"
    remote = False

    def __init__(self, client: "AsyncKVClient") -> None:
        self.client = client
        self._buf: memoryview | None = None

    async def get_kv(self, spec: KVSpec, toks: Any, out: Any = None) -> tuple[torch.Tensor, int]:
        return await self.client._get_shm(spec, toks, out)

    async def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        got = await self.client._put_shm(spec, toks, kv)
        return await self.client._put_http(spec, toks, kv) if got is None else got

    async def probe(self, nbytes: int) -> None:
        """``shm_probe``, off the loop when large, as the real copies are."""
        arena = await self.client._current_arena()  # mapped again if the server restarted
        if arena is None:
            raise ServiceError("the server no longer offers a shm arena this client can map")
        self._buf = await self.client._off_loop(nbytes, shm_probe, arena, self._buf, nbytes)


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
