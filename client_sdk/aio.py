"""``AsyncKVClient``: ``KVClient``'s API as coroutines, for agents on an event loop.

Same wire as ``KVClient``: shm when co-located, raw bytes over a pool of
plain-TCP connections driven by the loop's ``sock_*`` calls (httpx streams
instead for ``https``). The planner picks between them per transfer, or
answers "recompute" (``client_sdk.aio_planning``); with ``plan=False``, shm
when co-located, else HTTP. Copies in and out of the shm arena run in a
worker thread so the loop stays responsive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import httpx
import torch

from client_sdk import _common as c
from client_sdk._http import AsyncConnection, BrokenConnection, Endpoint
from client_sdk.aio_planning import AsyncClientPlanner, AsyncHttpMedium, AsyncMedium, AsyncShmMedium
from kvstore.wire.rest import BATCH_MEDIA, FRAME_MEDIA, H_TOKENS, KV_MEDIA, host_id
from kvstore.errors import ConnectionFailed, Forbidden, RequestTimeout, ServiceError
from kvstore.wire.errors import error_from
from kvstore.errors import KVStoreError, TierFull
from kvstore.keys import BlockHash, check_key, validate_namespace
from kvstore.planner import Decision, Planner
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["AsyncKVClient"]

T = TypeVar("T")
_THREAD_COPY_BYTES = 1 << 20  # copies larger than this leave the loop


class AsyncKVClient:
    """The asynchronous client. Arguments as ``KVClient``'s; ``max_connections`` bounds the socket pool.

    ``plan`` (default on) lets the transfer planner pick shm or HTTP per transfer, or answer
    "recompute" (``client_sdk.aio_planning``); ``wrap_media`` wraps each of its media (tests and
    benchmarks inject a slow link with ``AsyncThrottled``).
    """

    def __init__(self, url: str, token: str | None = None, namespace: str = "default", *,
                 timeout_s: float | None = 60.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05, colocated: bool | None = None,
                 buffer_pool_bytes: int = 512 << 20, max_connections: int = 8, plan: bool = True,
                 slo_s: float | None = None, wrap_media: Callable[[AsyncMedium], AsyncMedium] | None = None) -> None:
        self.url = url.rstrip("/")
        self.endpoint = Endpoint.parse(self.url)
        self.token = token
        self.namespace = validate_namespace(namespace)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.colocated = colocated
        self.stats = c.ClientStats()
        self._pool = c.TensorPool(buffer_pool_bytes)
        self._idle: list[AsyncConnection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._arena: c.Arena | None = None
        self._retired: list[c.Arena] = []  # arenas of a server that restarted, closed at close()
        self._medium: str | None = None
        self._medium_lock = asyncio.Lock()
        self._plan_lock = asyncio.Lock()
        self._reporting: asyncio.Task | None = None
        """The access (and decision) report in flight, if any."""
        self.plan = plan
        self.slo_s = slo_s
        self._wrap_media = wrap_media
        self._decider = Planner()
        """The planner's estimates and log: built now, so a prefill rate can be set before any transfer."""
        self._planner: AsyncClientPlanner | None = None
        self._report_wanted = False
        self._closing = False
        self._http = httpx.AsyncClient(base_url=self.url,
                                       timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                       headers=c.headers_for(token, self.namespace))

    # -- data API ------------------------------------------------------------------------------

    async def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, durable: bool = False) -> int:
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        kv = c.validate_put(spec, toks, kv)
        if self.plan:
            stored = await (await self._planned()).put_kv(spec, toks, kv, self.slo_s)
        else:
            got = await self._put_shm(spec, toks, kv) if await self._use_shm() else None
            stored = got if got is not None else await self._put_http(spec, toks, kv)
        if durable:
            c.check_durable(stored, await self.lookup_blocks(spec, toks))
        return stored

    async def _put_http(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        answer = await self._send("POST", "/v1/kv/put", c.kv_parts(spec, toks, kv), KV_MEDIA)
        self.stats.http_puts += 1
        self.stats.last_medium = "http"
        return int(answer["stored_tokens"])

    async def get_kv(self, spec: KVSpec, tokens: Any, *, out: Any = None,
                     slo_s: float | None = None) -> tuple[torch.Tensor, int]:
        """As ``KVClient.get_kv``: with planning on, ``n`` is 0 when recomputing is predicted faster."""
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        if self.plan:
            return await (await self._planned()).get_kv(spec, toks, out, self.slo_s if slo_s is None else slo_s)
        if await self._use_shm():
            return await self._get_shm(spec, toks, out)
        return await self._get_http(spec, toks, out)

    async def _get_http(self, spec: KVSpec, toks: Any, out: Any) -> tuple[torch.Tensor, int]:
        parts = c.kv_parts(spec, toks, None)
        if self.endpoint.tls:
            return await self._get_httpx(spec, parts, out)
        return await self._retrying(lambda: self._get_once(spec, parts, out))

    async def _probe_http(self, nbytes: int) -> None:
        """``GET /v1/probe``: ``nbytes`` of filler, read and dropped."""
        path = f"/v1/probe?bytes={int(nbytes)}"
        if self.endpoint.tls:
            resp = await self._request_http("GET", path)
            if resp.status_code != 200:
                raise error_from(resp.status_code, resp.content)
            return

        async def use(conn: AsyncConnection) -> None:
            head = await conn.request("GET", path, self._headers())
            body = await conn.read_body()
            if head.status != 200:
                raise error_from(head.status, body)
        await self._retrying(lambda: self._with_conn(use))

    # -- the planner -----------------------------------------------------------------------------

    def set_prefill_rate(self, spec: KVSpec, tokens_per_s: float) -> None:
        """The caller's prefill speed for ``spec``: the planner answers "recompute" when that is faster."""
        self._decider.model.set_prefill_rate(c.check_spec(spec).fingerprint(), tokens_per_s)

    @property
    def last_decision(self) -> Decision | None:
        """The planner's latest decision (inputs, candidates, choice, reason, actual cost)."""
        return None if self._planner is None else self._planner.last

    def decisions(self, limit: int = 100) -> list[dict]:
        """This client's newest decision records, oldest first."""
        return [d.to_dict() for d in self._decider.log.records(limit)]

    async def _planned(self) -> AsyncClientPlanner:
        if self._planner is None:
            async with self._plan_lock:
                if self._planner is None:
                    self._planner = await self._build_planner()
        return self._planner

    async def _build_planner(self) -> AsyncClientPlanner:
        colocated = await self._use_shm()
        built: dict[str, AsyncMedium] = {}
        if colocated:
            built["shm"] = AsyncShmMedium(self)
        built["http"] = AsyncHttpMedium(self)
        if self._wrap_media is not None:
            built = {k: self._wrap_media(m) for k, m in built.items()}
        return await AsyncClientPlanner.create(
            built, fetch_policies=lambda: self._json("GET", "/v1/policy"), routing_key=self.namespace,
            locality="colocated" if colocated else "remote", planner=self._decider, report=self._report_soon)

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
                await self._report_accesses()
        except Exception:  # noqa: BLE001 - reports are advisory: logged, never left for the loop to find
            log.debug("a report failed", exc_info=True)

    async def lookup(self, spec: KVSpec, tokens: Any) -> int:
        return int((await self.lookup_blocks(spec, tokens))["tokens"])

    async def lookup_blocks(self, spec: KVSpec, tokens: Any) -> dict:
        spec = c.check_spec(spec)
        return await self._send("POST", "/v1/lookup", c.kv_parts(spec, c.tokens_of(tokens), None), KV_MEDIA)

    async def delete(self, spec: KVSpec, tokens: Any) -> int:
        spec = c.check_spec(spec)
        answer = await self._send("POST", "/v1/kv/delete", c.kv_parts(spec, c.tokens_of(tokens), None), KV_MEDIA)
        return int(answer["deleted_blocks"])

    async def get_block(self, key: BlockHash) -> bytes | None:
        resp = await self._request_http("GET", f"/v1/blocks/{check_key(key).hex()}")
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise error_from(resp.status_code, resp.content)
        return resp.content

    async def put_block(self, key: BlockHash, frame: Any) -> None:
        body = bytes(memoryview(frame).cast("B"))
        await self._send("PUT", f"/v1/blocks/{check_key(key).hex()}", [body], FRAME_MEDIA)

    async def delete_block(self, key: BlockHash) -> bool:
        try:
            return bool((await self._json("DELETE", f"/v1/blocks/{check_key(key).hex()}"))["deleted"])
        except KeyError:  # BlockNotFound
            return False

    async def get_blocks(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        resp = await self._request_http("POST", "/v1/blocks/get", {"keys": [check_key(k).hex() for k in keys]})
        if resp.status_code >= 400:
            raise error_from(resp.status_code, resp.content)
        return c.frames_of(resp.content)

    async def put_blocks(self, items: Sequence[tuple[BlockHash, Any]], *, make_room: bool = False) -> int:
        parts = c.batch_parts(items)
        path = "/v1/blocks/put?make_room=true" if make_room else "/v1/blocks/put"
        return int((await self._send("POST", path, parts, BATCH_MEDIA))["stored"])

    async def blocks_exist(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each key holds a block of this namespace, in any tier (one request)."""
        body = {"keys": [check_key(k).hex() for k in keys]}
        return [bool(x) for x in (await self._json("POST", "/v1/blocks/exists", body))["present"]]

    async def pin_blocks(self, keys: Sequence[BlockHash], ttl_s: float) -> int:
        """As ``KVClient.pin_blocks``: hold this namespace's blocks in place for ``ttl_s`` seconds."""
        body = {"keys": [check_key(k).hex() for k in keys], "ttl_s": ttl_s}
        return int((await self._json("POST", "/v1/blocks/pin", body))["pinned"])

    async def unpin_blocks(self, keys: Sequence[BlockHash]) -> int:
        body = {"keys": [check_key(k).hex() for k in keys]}
        return int((await self._json("POST", "/v1/blocks/unpin", body))["unpinned"])

    async def delete_blocks(self, keys: Sequence[BlockHash]) -> int:
        body = {"keys": [check_key(k).hex() for k in keys]}
        return int((await self._json("POST", "/v1/blocks/delete", body))["deleted"])

    async def evict_mine(self, **selectors: Any) -> dict:
        return await self._json("POST", "/v1/evict", selectors)

    # -- admin helpers ----------------------------------------------------------------------------

    async def evict(self, *, dry_run: bool = False, **selectors: Any) -> dict:
        if "keys" in selectors:
            selectors["keys"] = [k.hex() if isinstance(k, bytes) else k for k in selectors["keys"]]
        return await self._json("POST", "/admin/evict", {**selectors, "dry_run": dry_run})

    async def pin(self, keys: Sequence[Any], ttl_s: float | None = None) -> dict:
        body: dict[str, Any] = {"keys": [k.hex() if isinstance(k, bytes) else k for k in keys]}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return await self._json("POST", "/admin/pin", body)

    async def unpin(self, keys: Sequence[Any]) -> dict:
        body = {"keys": [k.hex() if isinstance(k, bytes) else k for k in keys]}
        return await self._json("DELETE", "/admin/pin", body)

    async def migrate(self, key: Any, tier: str) -> dict:
        return await self._json("POST", "/admin/migrate", {"key": key.hex() if isinstance(key, bytes) else key,
                                                           "tier": tier})

    async def admin_stats(self) -> dict:
        return await self._json("GET", "/admin/stats")

    async def connectors(self) -> list[dict]:
        """Engine connectors' counters by namespace and engine (admin token)."""
        return (await self._json("GET", "/admin/connectors"))["connectors"]

    async def report_connector(self, engine: str, instance: str, counters: dict[str, float]) -> None:
        """An engine connector's cumulative counters, for the server's /metrics and dashboard."""
        await self._json("POST", "/v1/connectors/report",
                         {"engine": engine, "instance": instance, "counters": counters})

    async def tiers(self) -> list[dict]:
        return (await self._json("GET", "/admin/tiers"))["tiers"]

    async def explain(self, key: Any) -> dict:
        return await self._json("GET", f"/admin/explain/{key.hex() if isinstance(key, bytes) else key}")

    async def audit(self, limit: int = 100, offset: int = 0) -> dict:
        return await self._json("GET", "/admin/audit", params={"limit": limit, "offset": offset})

    async def entries(self, sort: str = "heat", order: str = "desc", limit: int = 100, offset: int = 0,
                      namespace: str | None = None, tier: str | None = None, *,
                      min_heat_per_s: float | None = None, max_heat_per_s: float | None = None,
                      min_age_s: float | None = None, max_age_s: float | None = None) -> dict:
        """A page of index entries (``GET /admin/entries``), sorted and filtered as the route says."""
        params = c.entries_params(sort, order, limit, offset, namespace=namespace, tier=tier,
                                  min_heat_per_s=min_heat_per_s, max_heat_per_s=max_heat_per_s,
                                  min_age_s=min_age_s, max_age_s=max_age_s)
        return await self._json("GET", "/admin/entries", params=params)

    async def heat(self, bins: int = 12) -> dict:
        """The heat histogram by tier (``GET /admin/heat``)."""
        return await self._json("GET", "/admin/heat", params={"bins": bins})

    async def history(self, limit: int = 720) -> dict:
        """The hit ratio over time, overall and by tier (``GET /admin/history``)."""
        return await self._json("GET", "/admin/history", params={"limit": limit})

    async def info(self) -> dict:
        return await self._json("GET", "/v1/info")

    async def health(self) -> dict:
        return await self._json("GET", "/healthz")

    async def metrics(self) -> str:
        return (await self._request_http("GET", "/metrics")).text

    async def ready(self) -> dict:
        return await self._json("GET", "/readyz")

    async def _report_accesses(self) -> None:
        """Send the reads served from remembered handles, and finished planner decisions.

        Both are advisory (heat, the decision log): a failed report is dropped.
        """
        while self._arena is not None and (report := self._arena.accesses.drain()) is not None:
            try:
                await self._json("POST", "/v1/kv/touch", report)
            except (KVStoreError, ValueError) as exc:
                log.debug("access report dropped: %s", exc)
        while records := self._decider.log.drain(256):
            try:
                await self._json("POST", "/v1/decisions", {"decisions": [d.to_dict() for d in records]})
            except (KVStoreError, ValueError) as exc:
                log.debug("decision report dropped: %s", exc)
                break

    async def aclose(self) -> None:
        self._closing = True
        if self._reporting is not None:  # finished, failed or cancelled: closing the rest matters more
            await asyncio.gather(self._reporting, return_exceptions=True)
        try:
            await self._report_accesses()
        except Exception:  # noqa: BLE001 - as above
            log.debug("the last report failed", exc_info=True)
        if self._planner is not None:
            self._planner.close()
        for conn in self._idle:
            conn.close()
        self._idle.clear()
        if self._arena is not None:
            for lease in self._arena.leases:
                try:
                    await self._json("DELETE", f"/v1/staging/lease/{lease['lease']}")
                except KVStoreError:
                    pass
            self._arena.close()
            self._arena = None
        for arena in self._retired:
            arena.close()
        self._retired.clear()
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncKVClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- co-located path --------------------------------------------------------------------------

    async def _current_arena(self) -> c.Arena | None:
        """The mapped arena (mapped anew after ``_arena_changed``), or None when shm is not used."""
        if self._arena is None and not await self._use_shm():
            return None
        return self._arena

    def _arena_changed(self, arena: c.Arena, named: Any, which: str) -> bool:
        """``KVClient._arena_changed``: the server named other segments than ``arena`` maps (a restart)."""
        if named == getattr(arena, which):
            return False
        log.info("kvstore at %s serves from other shm segments (a restart?): mapping them again", self.url)
        if self._arena is arena:
            self._retired.append(arena)
            self._arena, self._medium = None, None
        return True

    async def _use_shm(self) -> bool:
        if self.colocated is False:
            return False
        async with self._medium_lock:
            if self._medium is None:
                self._medium = await self._pick_medium()
        return self._medium == "shm"

    async def _pick_medium(self) -> str:
        offer = (await self.info()).get("colocated")
        reason = None
        if not offer:
            reason = "the server offers no shm path"
        elif offer.get("host_id") != host_id():
            reason = "the server runs on another host"
        else:
            try:
                self._arena = c.Arena(offer["segment"], offer["staging_segment"])
                return "shm"
            except KVStoreError as exc:
                reason = f"its shm segments cannot be opened here ({exc})"
        if self.colocated:
            raise ServiceError(f"colocated=True but {reason}")
        return "http"

    async def _off_loop(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        if nbytes > _THREAD_COPY_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def _get_shm(self, spec: KVSpec, toks: Any, out: Any) -> tuple[torch.Tensor, int]:
        arena = await self._current_arena()
        if arena is None:  # the server restarted without an arena this client can map: HTTP
            return await self._get_http(spec, toks, out)
        bt = spec.block_tokens
        cached = arena.handles.lookup(spec, toks, self.namespace)
        if cached is not None:  # every block's handle is remembered: no request unless one went stale
            kv = c.result_tensor(spec, len(cached) * bt, out, self._pool)
            nbytes = spec.bytes_per_token * len(cached) * bt
            if not await self._off_loop(nbytes, arena.fill_from_handles, cached, kv, bt, self.stats):
                arena.served_from_cache(cached, bt, self.stats)
                if arena.accesses.due():
                    self._report_soon()  # no get waits on it
                return kv, len(cached) * bt
            arena.handles.forget(cached)
        answer = await self._send("POST", "/v1/kv/handles", c.kv_parts(spec, toks, None), KV_MEDIA)
        blocks = answer["blocks"]
        kv = c.result_tensor(spec, len(blocks) * bt, out, self._pool)
        nbytes = spec.bytes_per_token * len(blocks) * bt
        if self._arena_changed(arena, answer.get("segment"), "segment"):
            missing: Any = range(len(blocks))  # its handles name slots of another arena
        else:
            arena.handles.remember(blocks)
            missing = await self._off_loop(nbytes, arena.fill_from_handles, blocks, kv, bt, self.stats)
        good = len(blocks)
        if missing:
            want = {blocks[i]["key"]: i for i in missing}
            resp = await self._request_http("POST", "/v1/blocks/get", {"keys": list(want)})
            if resp.status_code >= 400:
                raise error_from(resp.status_code, resp.content)
            arrived = c.fill_from_batch(resp.content, want, kv, bt, {})
            self.stats.shm_blocks_fetched_over_http += len(arrived)
            lost = sorted(set(missing) - arrived)
            good = lost[0] if lost else good
        self.stats.shm_gets += 1
        self.stats.last_medium = "shm"
        if good < len(blocks):
            kv = kv[:, :, :, :good * bt].clone() if out is None else c.result_tensor(spec, good * bt, out)
        return kv, good * bt

    async def _put_shm(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int | None:
        arena = await self._current_arena()
        nbytes = spec.bytes_per_token * int(kv.shape[3])
        if nbytes == 0 or arena is None:
            return None
        for attempt in range(2):
            # one per put in flight: concurrent puts never share. After a refused lease, a fresh one:
            # another idle lease may be as stale (all of them, after a server restart)
            lease = arena.take_lease(nbytes) if attempt == 0 else None
            if lease is None:
                try:
                    lease = await self._json("POST", "/v1/staging/lease", {"nbytes": max(nbytes, 1 << 20)})
                except TierFull as exc:
                    if exc.tier == "staging":
                        return None
                    raise
                if self._arena_changed(arena, lease.get("segment"), "staging_segment"):
                    with contextlib.suppress(KVStoreError):  # not ours to write: hand it back now
                        await self._json("DELETE", f"/v1/staging/lease/{lease['lease']}")
                    return None  # this put goes over HTTP; the next maps the new arena
                arena.add_lease(lease)
            try:
                await self._off_loop(nbytes, arena.write_staging, lease, kv)
                answer = await self._send("POST", f"/v1/kv/put-staged/{lease['lease']}",
                                          c.kv_parts(spec, toks, kv, with_kv=False), KV_MEDIA)
            except Forbidden:
                arena.drop_lease(lease)
                if attempt:
                    raise
                continue
            except BaseException:
                arena.give_back(lease)
                raise
            arena.give_back(lease)
            self.stats.shm_puts += 1
            self.stats.last_medium = "shm"
            return int(answer["stored_tokens"])
        return None

    # -- plumbing ---------------------------------------------------------------------------------

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        return c.headers_for(self.token, self.namespace, content_type)

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

    async def _retrying(self, once: Callable[[], Awaitable[T]]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await once()
            except BrokenConnection as exc:
                last = exc
            except TimeoutError as exc:
                raise RequestTimeout(f"no answer from {self.url} within {self.timeout_s} s") from exc
            if attempt < self.retries:
                self.stats.retries += 1
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay *= 2
        raise ConnectionFailed(f"{self.url}: {last} (after {self.retries} retries)") from last

    async def _send(self, method: str, path: str, parts: Sequence[Any], content_type: str) -> Any:
        if self.endpoint.tls:
            body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            resp = await self._request_http(method, path, content=body, content_type=content_type)
            if resp.status_code >= 400:
                raise error_from(resp.status_code, resp.content)
            return resp.json()

        async def use(conn: AsyncConnection) -> Any:
            head = await conn.request(method, path, self._headers(content_type), parts)
            body = await conn.read_body()
            if head.status >= 400:
                raise error_from(head.status, body)
            return json.loads(body) if body else None
        return await self._retrying(lambda: self._with_conn(use))

    async def _get_once(self, spec: KVSpec, parts: list, out: Any) -> tuple[torch.Tensor, int]:
        async def use(conn: AsyncConnection) -> tuple[torch.Tensor, int]:
            head = await conn.request("POST", "/v1/kv/get", self._headers(KV_MEDIA), parts)
            if head.status != 200:
                raise error_from(head.status, await conn.read_body())
            n = int(head.headers.get(H_TOKENS, "-1"))
            if n < 0 or head.length != spec.bytes_per_token * n:
                conn.close()
                raise ServiceError(f"get_kv answer of {head.length} bytes for {n} tokens does not match the spec")
            kv = c.result_tensor(spec, n, out, self._pool)
            if n:
                await conn.read_into(c.byte_view(kv))
            else:
                await conn.read_body()
            return kv, n
        kv, n = await self._with_conn(use)
        self.stats.http_gets += 1
        self.stats.last_medium = "http"
        return kv, n

    async def _get_httpx(self, spec: KVSpec, parts: list, out: Any) -> tuple[torch.Tensor, int]:
        body = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        resp = await self._request_http("POST", "/v1/kv/get", content=body, content_type=KV_MEDIA)
        if resp.status_code != 200:
            raise error_from(resp.status_code, resp.content)
        n = int(resp.headers.get(H_TOKENS, "0"))
        kv = c.result_tensor(spec, n, out, self._pool)
        c.byte_view(kv)[:] = resp.content
        self.stats.http_gets += 1
        self.stats.last_medium = "http"
        return kv, n

    async def _request_http(self, method: str, path: str, payload: Any = None, params: Any = None, *,
                            content: bytes | None = None, content_type: str | None = None) -> httpx.Response:
        headers = {"Content-Type": content_type} if content_type else None
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await self._http.request(method, path, json=payload, params=params, content=content,
                                                headers=headers)
            except httpx.TimeoutException as exc:
                raise RequestTimeout(f"{method} {path}: no answer within {self.timeout_s} s") from exc
            except httpx.TransportError as exc:
                last = exc
            if attempt < self.retries:
                self.stats.retries += 1
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay *= 2
        raise ConnectionFailed(f"{self.url}: {last} (after {self.retries} retries)") from last

    async def _json(self, method: str, path: str, payload: Any = None, params: Any = None) -> Any:
        resp = await self._request_http(method, path, payload, params)
        if resp.status_code >= 400:
            raise error_from(resp.status_code, resp.content)
        return resp.json()
