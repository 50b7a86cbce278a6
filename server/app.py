"""``create_app(store, settings)``: the FastAPI app over one store.

Pure-ASGI middlewares wrap the routes, outermost first: one times every request
for ``/metrics`` (by route template, so the series stay few); one refuses a body
over ``max_body_bytes`` with 413 from its Content-Length, before reading it; one
charges body bytes to the in-flight memory cap (``server.inflight``); one ends a
stalled or trickling body with 408; the innermost sends the hot data routes
(``HOT_ROUTES``) straight to their handlers. Routes count streamed bodies as
they read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.requests import Request

from kvstore.errors import BodyTimeout, PayloadTooLarge
from kvstore._version import __version__
from kvstore.errors import KVStoreError
from kvstore.engine.store import KVStore
from server import admin, blocks, connectors, dashboard, data, events, layers, locality, ops, planning, pooled
from server.commit_channel import start_channel
from server.config import ServerSettings
from server.errors import install_error_handlers, send_error, store_error, unexpected_error
from server.inflight import InflightCap
from server.service import Service

__all__ = ["create_app"]

log = logging.getLogger("kvstore.server")


class _Observe:
    """Latency histogram and request counter per route template."""

    def __init__(self, app: Any, svc: Service) -> None:
        self.app, self.svc = app, svc
        self._series: dict[tuple, tuple] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            key = (getattr(route, "path", None) or "unmatched", scope["method"], status[0])
            series = self._series.get(key)
            if series is None:  # labels() takes a lock and builds a tuple: once per key
                m = self.svc.metrics
                series = self._series[key] = (m.latency.labels(key[0], key[1]),
                                              m.requests.labels(key[0], key[1], str(key[2])))
            series[0].observe(time.perf_counter() - start)
            series[1].inc()


class _BodyLimit:
    """413 for a declared Content-Length over the limit, before any body is read."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                    return await send_error(send, PayloadTooLarge(
                        f"body of {int(value)} bytes is over the {self.limit}-byte limit", field="body"))
        await self.app(scope, receive, send)


class _Upload:
    """A request body being read: when it last moved, its deadline, whether its task waits on it."""

    __slots__ = ("task", "last", "deadline", "waiting", "stalled")

    def __init__(self, task: asyncio.Task, now: float, deadline: float) -> None:
        self.task, self.last, self.deadline = task, now, deadline
        self.waiting = self.stalled = False


class _BodyTimeout:
    """408 for a request body that stalls or trickles.

    Each part must arrive within ``idle_s`` of the last, and a body of declared length must
    be complete within ``idle_s`` plus its length at ``min_rate`` bytes a second. Without this a client
    that sends headers and then a byte now and then holds a connection, a handler and a pooled
    buffer for as long as it likes.

    One sweep, armed only while some body is being read, checks every ``idle_s / 4`` and
    cancels the task of a request stalled in ``receive``; that receive turns the cancellation
    into ``BodyTimeout``. A timer per receive cost 3.4 us each here: 1.7 ms on a 32 MiB put of
    500 receives. Once the body is complete, or a response has started, ``receive`` passes
    through: a response may wait on it for a disconnect.
    """

    def __init__(self, app: Any, idle_s: float, min_rate: int) -> None:
        self.app, self.idle_s, self.min_rate = app, idle_s, min_rate
        self._uploads: dict[int, _Upload] = {}
        self._sweep: asyncio.TimerHandle | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.idle_s:
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        now = loop.time()
        declared = next((int(v) for k, v in scope["headers"] if k == b"content-length" and v.isdigit()), None)
        up = _Upload(asyncio.current_task(), now,  # type: ignore[arg-type]
                     math.inf if declared is None else now + self.idle_s + declared / self.min_rate)
        self._uploads[id(up)] = up
        if self._sweep is None:
            self._sweep = loop.call_later(self.idle_s / 4, self._check, loop)

        async def timed_receive() -> dict:
            if id(up) not in self._uploads:
                return await receive()
            up.waiting = True
            try:
                message = await receive()
            except asyncio.CancelledError:
                if not up.stalled:
                    raise
                up.task.uncancel()
                raise self._stalled() from None
            finally:
                up.waiting = False
            if up.stalled:  # the cancel was swallowed below (it raced a part arriving): end the body here
                if up.task.cancelling():
                    up.task.uncancel()
                raise self._stalled()
            up.last = loop.time()
            if message["type"] != "http.request" or not message.get("more_body", False):
                self._uploads.pop(id(up), None)
            return message

        async def closing_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self._uploads.pop(id(up), None)  # answered: a later receive waits for a disconnect, untimed
                if up.stalled:  # the rest of the body is never read: the connection goes
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, timed_receive, closing_send)
        finally:
            self._uploads.pop(id(up), None)

    def _stalled(self) -> BodyTimeout:
        return BodyTimeout(f"the request body stalled: no part of it for {self.idle_s:g} s, or slower "
                           f"than {self.min_rate} bytes/s (KVSTORE_BODY_TIMEOUT_S, KVSTORE_BODY_MIN_RATE)")

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for up in self._uploads.values():
            if up.waiting and not up.stalled and (now - up.last >= self.idle_s or now >= up.deadline):
                up.stalled = True
                up.task.cancel()
        self._sweep = loop.call_later(self.idle_s / 4, self._check, loop) if self._uploads else None


HOT_ROUTES = (("POST", "/v1/lookup"), ("POST", "/v1/kv/get"), ("POST", "/v1/kv/put"), ("POST", "/v1/kv/handles"),
              ("POST", "/v1/kv/reserve"), ("POST", "/v1/kv/commit"), ("POST", "/v1/kv/put-pooled"))
"""Routes ``_Direct`` dispatches itself: exact paths, handlers that take only the request."""


class _Direct:
    """The hot data routes, without FastAPI's router and dependency resolver.

    Matching a path against every route and solving an empty dependency list
    cost ~60 us a request here, a third of a lookup's time in the server (the
    handlers already read auth and the body themselves). A request for one of
    ``routes`` goes straight to its handler; errors get the same handlers, so
    the same status and body, as on the routed path; everything else passes on.
    """

    def __init__(self, app: Any, routes: dict[tuple[str, str], APIRoute]) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = self.routes.get((scope.get("method"), scope.get("path"))) if scope["type"] == "http" else None
        if route is None:
            return await self.app(scope, receive, send)
        scope["route"] = route  # for _Observe's series, as the router would set it
        request = Request(scope, receive, send)
        try:
            response = await route.endpoint(request)
        except KVStoreError as exc:
            response = await store_error(request, exc)
        except Exception as exc:  # noqa: BLE001 - the same 500 as the routed path's last-resort handler
            response = await unexpected_error(request, exc)
        await response(scope, receive, send)


def create_app(store: KVStore, settings: ServerSettings | None = None, *, close_store: bool = True) -> FastAPI:
    """The service over ``store``.

    Args:
        store: the engine; the app closes it at shutdown when ``close_store``.
        settings: service settings (``ServerSettings.from_env()`` when None).
        close_store: close the store in the app's shutdown (after in-flight requests end).
    """
    settings = settings or ServerSettings.from_env()
    svc = Service(store, settings, close_store=close_store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        svc.history.start(asyncio.get_running_loop())
        svc.closers.append(svc.history.stop)
        if settings.flight_port is not None:
            from server.flight import start_flight  # pyarrow loads only when Flight is asked for

            side = start_flight(svc, settings)
            svc.closers.append(lambda: side.close(settings.graceful_timeout_s))
            svc.offers["flight"] = {"port": side.port}
            log.info("kvstore: Arrow Flight on port %d", side.port)
        if settings.lmcache_port is not None:
            from server.lmcache_listener import start_lmcache

            svc.lmcache = lm = start_lmcache(svc, settings)
            svc.closers.append(lambda: lm.close(settings.graceful_timeout_s))
        channel = start_channel(svc)
        if channel is not None:
            svc.commit_socket, svc.commit_channel = channel.path, channel
            svc.closers.append(lambda: channel.close(settings.graceful_timeout_s))
        stop_events = events.start(svc, settings)
        if stop_events is not None:
            svc.closers.append(stop_events)
        yield
        log.info("kvstore: shutting down; closing the store (flushes durable tiers, releases shm)")
        svc.close()

    app = FastAPI(title="kvstore", version=__version__, lifespan=lifespan,
                  description="KV-cache store: /v1 data, /admin operators, /healthz, /readyz, /metrics.")
    app.state.svc = svc
    store.policy_for = planning.prefetch_policy(svc)
    install_error_handlers(app)
    app.include_router(data.router)
    app.include_router(pooled.router)
    app.include_router(blocks.router)
    app.include_router(admin.router)
    app.include_router(dashboard.router)
    app.include_router(ops.router)
    app.include_router(planning.router)
    app.include_router(layers.router)
    app.include_router(connectors.router)
    app.include_router(events.router)
    app.include_router(locality.router)
    hot = {(m, r.path): r for r in (*data.router.routes, *pooled.router.routes) if isinstance(r, APIRoute)
           for m in r.methods if (m, r.path) in HOT_ROUTES}
    if len(hot) != len(HOT_ROUTES):
        raise RuntimeError(f"hot routes missing from the app: {sorted(set(HOT_ROUTES) - set(hot))}")
    app.add_middleware(_Direct, routes=hot)
    app.add_middleware(_BodyTimeout, idle_s=settings.body_timeout_s, min_rate=settings.body_min_rate)
    app.add_middleware(InflightCap, budget=svc.inflight, wait_s=settings.inflight_wait_s)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(_Observe, svc=svc)  # added last: outermost
    return app
