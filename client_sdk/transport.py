"""The SDK's HTTP transports: the sockets, one retry policy, nothing about what is sent.

``HttpTransport`` (blocking; one keep-alive socket per thread) and
``AsyncHttpTransport`` (a bounded pool of sockets driven by the event loop's
``sock_*`` calls; httpx for ``https``) carry ``client_sdk.calls.Call``s, and
receive a get's raw KV straight into the result tensor (``kv_answer`` reads its
head, for layer streams too). Both retry under one ``RetryPolicy``: a dropped
connection is retried with jittered exponential backoff (every call is
idempotent: a put of stored blocks is a no-op); a timeout is not (the request
may be running). A KV put goes block-major (``KV_BLOCKS_MEDIA``, received straight into the
server's slots) to a server whose ``/v1/info`` lists it in ``put_media``, asked once per
transport, and token-major to any other. A plain socket is used rather than httpx
because httpx moves 0.7-0.85 GB/s where a socket moves 3 GB/s here
(``docs/design.md``, "Figures this design rests on").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk.channel import ChannelDown, CommitChannel
from client_sdk._http import AsyncConnection, BrokenConnection, Connection, Endpoint, Head, joined
from client_sdk.calls import Call
from kvstore.errors import ConnectionFailed, KVStoreError, MalformedRequest, RequestTimeout, ServiceError
from kvstore.spec import KVSpec
from kvstore.wire.errors import error_from
from kvstore.wire.rest import H_HINT, H_TOKENS, KV_BLOCKS_MEDIA, KV_MEDIA

__all__ = ["RetryPolicy", "HttpTransport", "AsyncHttpTransport", "kv_answer"]

T = TypeVar("T")

log = logging.getLogger("kvstore.client")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a transport retries a dropped connection.

    Args:
        retries: extra attempts after the first.
        backoff_s: the first retry's delay; it doubles each attempt, each drawn from
            [0.5, 1.5) of that (jitter: clients that lost one server do not return in step).
    """

    retries: int = 3
    backoff_s: float = 0.05

    def delay_s(self, attempt: int, where: str, failure: BrokenConnection) -> float:
        """The wait before retry ``attempt`` (1, 2, ...) after ``failure``.

        Raises:
            ConnectionFailed: ``attempt`` is past ``retries``.
        """
        if attempt > self.retries:
            raise ConnectionFailed(f"{where}: {failure} (after {self.retries} retries)") from failure
        return self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random())

    def after(self, attempt: int, where: str, failure: OSError, stats: c.ClientStats) -> float:
        """The wait before retry ``attempt`` after ``failure`` of an attempt, counted as a retry.

        Raises:
            ConnectionFailed: every attempt dropped. RequestTimeout: ``failure`` is no answer in
                time, never retried (the request may be running).
        """
        if not isinstance(failure, BrokenConnection):
            raise RequestTimeout(f"no answer from {where} in time") from failure
        delay = self.delay_s(attempt, where, failure)
        stats.retries += 1
        return delay

    def run(self, once: Callable[[], T], where: str, stats: c.ClientStats) -> T:
        """``once()`` until it does not drop the connection, at most ``retries`` + 1 times.

        Raises:
            ConnectionFailed: every attempt dropped. RequestTimeout: no answer in time (not retried).
        """
        attempt = 0
        while True:
            try:
                return once()
            except (BrokenConnection, TimeoutError) as exc:
                attempt += 1
                delay = self.after(attempt, where, exc, stats)
            time.sleep(delay)

    async def arun(self, once: Callable[[], Awaitable[T]], where: str, stats: c.ClientStats) -> T:
        """``run``, awaited."""
        attempt = 0
        while True:
            try:
                return await once()
            except (BrokenConnection, TimeoutError) as exc:
                attempt += 1
                delay = self.after(attempt, where, exc, stats)
            await asyncio.sleep(delay)


def _answer(call: Call[T], status: int, body: bytes) -> T:
    if status >= 400:
        if status == 404 and call.answers_missing:
            return call.missing
        raise error_from(status, body)
    return call.parse(body)


def _put_media(answer: Any) -> frozenset[str]:
    """The put bodies a server takes, from its ``/v1/info`` answer (``put_media``; a server from
    before block-major bodies lists none, and takes ``KV_MEDIA``)."""
    listed = answer.get("put_media") if isinstance(answer, dict) else None
    if not isinstance(listed, list):
        return frozenset({KV_MEDIA})
    return frozenset(m for m in listed if isinstance(m, str)) | {KV_MEDIA}


def _refused_media(exc: KVStoreError, sent: Call[Any]) -> bool:
    """Whether a block-major put was refused for its content type: the server answering now takes
    only token-major bodies (restarted as an older version since this transport asked)."""
    return sent.content_type == KV_BLOCKS_MEDIA and isinstance(exc, MalformedRequest) and exc.field == "content-type"


def _check_kv_head(spec: KVSpec, n: int, length: int | None, what: str = "get_kv") -> None:
    if n < 0 or length != spec.bytes_per_token * n:
        raise ServiceError(f"{what} answer of {length} bytes for {n} tokens does not match the spec")


def kv_answer(spec: KVSpec, head: Head, out: Any, pool: c.TensorPool | None, conn: Connection | AsyncConnection,
              what: str = "get_kv", stats: c.ClientStats | None = None) -> tuple[torch.Tensor, int]:
    """Where a raw KV answer (``/v1/kv/get``, ``/v1/kv/get-layers``) lands, and its tokens, from its head;
    its ``X-KV-Hint``, if any, is warned of (``c.warn_hint``) when ``stats`` is given.

    Raises:
        ServiceError: the head's length does not fit the spec; ``conn`` is closed then (the
            body is still on the wire). InvalidInput: ``out`` cannot hold it (likewise).
    """
    n = int(head.headers.get(H_TOKENS, "-1"))
    if stats is not None:
        c.warn_hint(stats, spec, head.headers.get(H_HINT))
    try:
        _check_kv_head(spec, n, head.length, what)
        return c.result_tensor(spec, n, out, pool), n
    except KVStoreError:
        conn.close()
        raise


class _Transport:
    """What both transports are: one server, the headers every request carries, one retry policy.

    Args:
        url: ``http(s)://host:port``.
        token, namespace: sent with every request (``Authorization``, ``x-kv-namespace``).
        timeout_s, connect_timeout_s: per-request read timeout and TCP connect timeout.
        retry: the retry policy.
        stats: where retries and HTTP transfers are counted.
        agent: sent with every request (``x-kv-agent``).
    """

    def __init__(self, url: str, token: str | None, namespace: str, *, timeout_s: float | None,
                 connect_timeout_s: float, retry: RetryPolicy, stats: c.ClientStats,
                 agent: str | None = None) -> None:
        self.url = url
        self.endpoint = Endpoint.parse(url)
        self.token = token
        self.namespace = namespace
        self.agent = agent
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry
        self.stats = stats
        self.put_media: frozenset[str] | None = None
        """The KV put bodies the server takes (``/v1/info``'s ``put_media``), asked on the first put
        (a ``c.KVPutBody``); None until then."""
        self._headers = {ct: c.headers_for(token, namespace, ct, agent) for ct in (None, KV_MEDIA, KV_BLOCKS_MEDIA)}

    def headers(self, content_type: str | None = None) -> dict[str, str]:
        got = self._headers.get(content_type)
        return got if got is not None else c.headers_for(self.token, self.namespace, content_type, self.agent)

    def _as_taken(self, call: Call[T], media: frozenset[str]) -> Call[T]:
        """``call`` with its body in the layout the server takes: a KV put goes block-major where
        ``media`` lists it."""
        body = call.parts
        if isinstance(body, c.KVPutBody) and KV_BLOCKS_MEDIA in media:
            return dataclasses.replace(call, parts=body.blocks(self.namespace), content_type=KV_BLOCKS_MEDIA)
        return call


class HttpTransport(_Transport):
    """Blocking HTTP to one server: a keep-alive socket per thread (safe to share between threads).

    Arguments as ``_Transport``'s.
    """

    def __init__(self, url: str, token: str | None, namespace: str, *, timeout_s: float | None,
                 connect_timeout_s: float, retry: RetryPolicy, stats: c.ClientStats,
                 agent: str | None = None) -> None:
        super().__init__(url, token, namespace, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                         retry=retry, stats=stats, agent=agent)
        self._local = threading.local()
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self.channel: CommitChannel | None = None
        """The server's commit channel, for the calls it serves; None: every call over HTTP."""

    def use_channel(self, path: str | None) -> None:
        """Send the calls the server's commit channel at ``path`` serves over it from now on (None:
        over HTTP); the co-located path sets it once it has mapped the server's arena."""
        old = self.channel
        if old is not None and old.path == path:
            return
        self.channel = None if path is None else CommitChannel(path, self.token, self.namespace, self.agent,
                                                               self.timeout_s, self.connect_timeout_s)
        if old is not None:
            old.close()

    def conn(self) -> Connection:
        """This thread's connection (opened on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = Connection(self.endpoint, connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def run(self, call: Call[T]) -> T:
        """Send ``call`` (retried on a dropped connection) and read its answer; a KV put's body in
        the layout the server takes.

        Raises:
            the typed error of an error answer; ConnectionFailed, RequestTimeout.
        """
        channel = self.channel
        if channel is not None and channel.up and channel.serves(call):
            try:
                return channel.run(call)
            except ChannelDown as exc:  # a restart, the server's connection limit: this call over HTTP
                channel.failures += 1  # said once a channel; a socket this host cannot reach retries every few s
                log.log(logging.INFO if channel.failures == 1 else logging.DEBUG,
                        "kvstore: %s; this call goes over HTTP", exc)
        if not isinstance(call.parts, c.KVPutBody):
            return self._send(call)
        if self.put_media is None:
            self.put_media = _put_media(self._send(calls.info()))
        sent = self._as_taken(call, self.put_media)
        try:
            return self._send(sent)
        except KVStoreError as exc:
            if not _refused_media(exc, sent):
                raise
            self.put_media = frozenset({KV_MEDIA})
            return self._send(call)

    def _send(self, call: Call[T]) -> T:
        headers = self._headers.get(call.content_type) or self.headers(call.content_type)

        def once() -> T:
            conn = self.conn()
            head = conn.request(call.method, call.path, headers, call.parts)
            body = conn.read_body()
            if head.status < 400:
                return call.parse(body)
            return _answer(call, head.status, body)
        return self.retry.run(once, self.url, self.stats)

    def get_kv(self, spec: KVSpec, parts: Sequence[Any], out: Any, pool: c.TensorPool | None) -> tuple[torch.Tensor, int]:
        """``POST /v1/kv/get``: the KV of the longest stored prefix, received straight into the result."""
        def once() -> tuple[torch.Tensor, int]:
            conn = self.conn()
            head = conn.request("POST", "/v1/kv/get", self.headers(KV_MEDIA), parts)
            if head.status != 200:
                raise error_from(head.status, conn.read_body())
            kv, n = kv_answer(spec, head, out, pool, conn, stats=self.stats)
            if n:
                conn.read_into(c.byte_view(kv))
            else:
                conn.read_body()
            return kv, n
        kv, n = self.retry.run(once, self.url, self.stats)
        self.stats.http_gets += 1
        self.stats.last_medium = "http"
        return kv, n

    def probe(self, nbytes: int) -> None:
        """``GET /v1/probe``: ``nbytes`` of filler received into a reused buffer."""
        def once() -> None:
            conn = self.conn()
            head = conn.request("GET", f"/v1/probe?bytes={int(nbytes)}", self.headers())
            if head.status != 200:
                raise error_from(head.status, conn.read_body())
            if head.length:
                buf = getattr(self._local, "probe_buf", None)
                if buf is None or len(buf) < head.length:
                    buf = self._local.probe_buf = bytearray(head.length)
                conn.read_into(memoryview(buf)[:head.length])
            else:
                conn.read_body()
        self.retry.run(once, self.url, self.stats)

    def close(self) -> None:
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self.use_channel(None)


class AsyncHttpTransport(_Transport):
    """HTTP to one server from an event loop: at most ``max_connections`` sockets, reused.

    Plain ``http`` runs on the loop's own socket calls (no thread, no copy of a body);
    ``https`` goes through httpx, which buffers each body whole (the loop's ``sock_*``
    calls do not speak TLS). Arguments as ``HttpTransport``'s.
    """

    def __init__(self, url: str, token: str | None, namespace: str, *, timeout_s: float | None,
                 connect_timeout_s: float, retry: RetryPolicy, stats: c.ClientStats, max_connections: int,
                 agent: str | None = None) -> None:
        super().__init__(url, token, namespace, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                         retry=retry, stats=stats, agent=agent)
        self._idle: list[AsyncConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._httpx: Any = None

    async def _with_conn(self, use: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        async with self._slots:
            conn = self._idle.pop() if self._idle else AsyncConnection(
                self.endpoint, connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s)
            try:
                result = await use(conn)
            except BaseException:
                conn.close()
                raise
            self._idle.append(conn)
            return result

    async def _tls(self, method: str, path: str, parts: Sequence[Any], content_type: str | None) -> tuple[int, Any]:
        """One request through httpx (``https``); a dropped connection reads as ``BrokenConnection``."""
        import httpx  # only https needs it

        if self._httpx is None:
            self._httpx = httpx.AsyncClient(base_url=self.url,
                                            timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s))
        body = joined(parts) if parts else None
        try:
            resp = await self._httpx.request(method, path, content=body, headers=self.headers(content_type))
        except httpx.TimeoutException as exc:
            raise TimeoutError(str(exc)) from exc
        except httpx.TransportError as exc:
            raise BrokenConnection(str(exc)) from exc
        return resp.status_code, resp

    async def run(self, call: Call[T]) -> T:
        """``HttpTransport.run``, awaited."""
        if not isinstance(call.parts, c.KVPutBody):
            return await self._send(call)
        if self.put_media is None:
            self.put_media = _put_media(await self._send(calls.info()))
        sent = self._as_taken(call, self.put_media)
        try:
            return await self._send(sent)
        except KVStoreError as exc:
            if not _refused_media(exc, sent):
                raise
            self.put_media = frozenset({KV_MEDIA})
            return await self._send(call)

    async def _send(self, call: Call[T]) -> T:
        if self.endpoint.tls:
            async def tls_once() -> T:
                status, resp = await self._tls(call.method, call.path, call.parts, call.content_type)
                return _answer(call, status, resp.content)
            return await self.retry.arun(tls_once, self.url, self.stats)

        async def use(conn: AsyncConnection) -> T:
            head = await conn.request(call.method, call.path, self.headers(call.content_type), call.parts)
            return _answer(call, head.status, await conn.read_body())
        return await self.retry.arun(lambda: self._with_conn(use), self.url, self.stats)

    async def get_kv(self, spec: KVSpec, parts: Sequence[Any], out: Any, pool: c.TensorPool | None, *,
                     path: str = "/v1/kv/get", what: str = "get_kv") -> tuple[torch.Tensor, int]:
        """``HttpTransport.get_kv``, awaited. ``path``: another route with the same answer (a layer
        stream over https, whose body httpx buffers whole anyway); ``what`` names it in errors."""
        if self.endpoint.tls:
            async def tls_once() -> tuple[torch.Tensor, int]:
                status, resp = await self._tls("POST", path, parts, KV_MEDIA)
                if status != 200:
                    raise error_from(status, resp.content)
                n = int(resp.headers.get(H_TOKENS, "-1"))
                c.warn_hint(self.stats, spec, resp.headers.get(H_HINT))
                _check_kv_head(spec, n, len(resp.content), what)
                kv = c.result_tensor(spec, n, out, pool)
                c.byte_view(kv)[:] = resp.content
                return kv, n
            kv, n = await self.retry.arun(tls_once, self.url, self.stats)
        else:
            async def use(conn: AsyncConnection) -> tuple[torch.Tensor, int]:
                head = await conn.request("POST", path, self.headers(KV_MEDIA), parts)
                if head.status != 200:
                    raise error_from(head.status, await conn.read_body())
                kv, n = kv_answer(spec, head, out, pool, conn, what, self.stats)
                if n:
                    await conn.read_into(c.byte_view(kv))
                else:
                    await conn.read_body()
                return kv, n
            kv, n = await self.retry.arun(lambda: self._with_conn(use), self.url, self.stats)
        self.stats.http_gets += 1
        self.stats.last_medium = "http"
        return kv, n

    async def probe(self, nbytes: int) -> None:
        """``GET /v1/probe``: ``nbytes`` of filler, read and dropped."""
        await self.run(Call("GET", f"/v1/probe?bytes={int(nbytes)}", parse=lambda body: None))

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._httpx is not None:
            await self._httpx.aclose()
