"""The state one app holds, and the parsing helpers every route uses.

``Service`` owns the store handle, auth, metrics, audit log, staging arena,
quotas, a pool of reused request buffers and the thread pool that blocking
store calls run in (the event loop never touches a tier). Who is calling, and
what a request's body and quota charge are, is ``server.requests``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch
from fastapi import Request

from kvstore.engine.store import KVStore
from kvstore.errors import InvalidInput, MalformedRequest, PayloadTooLarge, QuotaExceeded, TooManyTokens
from kvstore.keys import BlockHash, normalize_tokens
from kvstore.memory.buffers import BufferPool
from kvstore.memory.shm import SlotHandle
from kvstore.spec import KVSpec
from kvstore.wire.rest import host_id
from server.audit import AuditLog
from server.auth import Authenticator, Principal
from server.colocated import ReadTally, SlotHandles
from server.config import ServerSettings
from server.history import History
from server.inflight import InflightBudget, lazy_buffer
from server.errors import field_error
from server.connector_board import ConnectorBoard
from server.metrics import Metrics
from server.staging import StagingArena

__all__ = ["Service", "Quotas", "parse_spec", "parse_tokens", "too_many_tokens", "json_body", "json_object", "require"]

log = logging.getLogger("kvstore.server")

T = TypeVar("T")


class Quotas:
    """Per-tenant byte quotas, checked against a namespace usage snapshot at most ``ttl_s`` old."""

    def __init__(self, store: KVStore, ttl_s: float = 1.0) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._usage: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._at = -float("inf")
        self._lock = threading.Lock()

    def _snapshot(self) -> dict[str, int]:
        with self._lock:
            if time.monotonic() - self._at <= self._ttl_s:
                return {ns: self._usage.get(ns, 0) + self._pending.get(ns, 0)
                        for ns in set(self._usage) | set(self._pending)}
        usage: dict[str, int] = {}
        for e in self._store.entries():
            usage[e.namespace] = usage.get(e.namespace, 0) + e.size
        with self._lock:
            self._usage, self._pending, self._at = usage, {}, time.monotonic()
        return dict(usage)

    def check(self, principal: Principal, namespace: str, nbytes: int) -> None:
        """Refuse a write of up to ``nbytes`` that would take the tenant over its quota.

        Raises:
            QuotaExceeded: with the tenant's usage and quota.
        """
        if principal.quota_bytes is None or nbytes <= 0:
            return
        usage = self._snapshot()
        used = sum(usage.get(ns, 0) for ns in (principal.namespaces or {namespace}))
        if used + nbytes > principal.quota_bytes:
            raise QuotaExceeded(f"tenant {principal.name!r} holds {used} bytes of its {principal.quota_bytes}-byte "
                                f"quota; this write needs up to {nbytes} more", status=507)
        with self._lock:
            self._pending[namespace] = self._pending.get(namespace, 0) + nbytes


class Service:
    """Everything a request handler needs, hung on ``app.state.svc``."""

    def __init__(self, store: KVStore, settings: ServerSettings, *, close_store: bool = True) -> None:
        self.store = store
        self.settings = settings
        self.close_store = close_store
        self.auth = Authenticator(settings)
        self.started_s = time.time()
        self.host_id = host_id()
        self.pool = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 8),
                                       thread_name_prefix="kvstore-io")
        self.inflight = InflightBudget(settings.max_inflight_bytes)
        """Bytes of request bodies being received, under ``max_inflight_bytes`` (``server.inflight``)."""
        # Fresh buffers commit memory as bytes land in them; idle ones kept are part of the
        # server's baseline, so at most a quarter of the in-flight cap.
        self.buffers = BufferPool(min(512 << 20, settings.max_inflight_bytes // 4), alloc=lazy_buffer)
        self.quotas = Quotas(store)
        data_dir = _data_dir(store)
        self.audit = AuditLog(settings.audit_log or (os.path.join(data_dir, "audit.jsonl") if data_dir else None))
        kinds = [getattr(t, "kind", None) or t.stats().kind for t in store.tiers]
        self.index_is_local = "redis" not in kinds
        """No tier is shared between stores, so lookups never leave this process."""
        self.shm = next((t for t, k in zip(store.tiers, kinds) if k == "shm"), None)
        self.staging: StagingArena | None = None
        if settings.colocated and self.shm is not None:
            self.staging = StagingArena(settings.staging_bytes)
        self.slots = SlotHandles(self.shm) if self.shm is not None else None
        """The shm tier's slot handles, as the event loop reads them (``server.colocated``)."""
        self.tally = ReadTally(store.core, store.clock)
        """Reads the event loop served, counted off it (``server.colocated``)."""
        self.metrics = Metrics(store.stats, self._figures)
        self.connectors = ConnectorBoard()
        """Engine connectors' counters (``POST /v1/connectors/report``), in ``/metrics`` too."""
        self.metrics.registry.register(self.connectors)  # type: ignore[arg-type]
        self.history = History(store, settings.history_interval_s)
        """Read counters over time (``/admin/history``); sampling starts with the app."""
        self.commit_socket: str | None = None
        """The commit channel's socket path (``server.commit_channel``), once it listens."""
        self.commit_channel: Any = None
        """That ``CommitChannel`` (its connections, for the tests and the operator's eye)."""
        self.offers: dict[str, Any] = {}
        """Extra media this server offers, by name (``flight``, ``redis``), as ``/v1/info`` shows them:
        a client's planner counts them among its candidates."""
        redis_tier = next((t for t, k in zip(store.tiers, kinds) if k == "redis"), None)
        if redis_tier is not None:  # the keyspace only: a client brings its own URL and credentials
            self.offers["redis"] = {"keyspace": getattr(redis_tier, "keyspace", "default"), "tier": redis_tier.name}
        self.lmcache: Any = None
        """The ``lm://`` listener (``server.lmcache_listener``) when ``lmcache_port`` is set."""
        self.closers: list[Callable[[], None]] = []
        """Run first at close (in reverse order): servers started beside the app, e.g. Arrow Flight."""
        self.event_notifier: Any = None
        """The SSE streams' notifier (``server.events``), made at startup."""
        self.kv_events_lost = 0
        """Events the ZMQ publisher fell past (``server.kv_events_zmq``)."""

    def reservations_off(self) -> str | None:
        """Why this server takes no reserved or pooled puts now, or None when it takes them."""
        if not self.settings.reserved_puts:
            return "reserved puts are off on this server (KVSTORE_RESERVED_PUTS=0)"
        return self.store.reservations.unavailable()

    def _figures(self) -> dict[str, float]:
        out = {"uptime_seconds": time.time() - self.started_s, "kv_events_lost": float(self.kv_events_lost)}
        if self.event_notifier is not None:
            out["event_subscribers"] = self.event_notifier.open
        if self.staging is not None:
            stats = self.staging.stats()
            out["staging_leases"] = stats["leases"]
            out["staging_leased_bytes"] = stats["leased_bytes"]
        return out

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking ``fn`` in the I/O pool, off the event loop, once the reads the loop
        handed to ``tally`` are counted: ``fn`` sees every read of the requests answered before."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._counted_then, functools.partial(fn, *args, **kwargs))

    def _counted_then(self, call: Callable[[], T]) -> T:
        self.tally.flush()
        with self.store.scrubber.answering():  # the verifier starts on what ``call`` publishes after it
            return call()

    async def run_index(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn``, which reads the index (its own short lock, never a tier's or placement's)
        and may consult the shared tier on a miss.

        Without a Redis tier that is tens of microseconds of CPU, cheaper than a
        thread hop, so it runs right here; with one it may wait on the network,
        so it goes to the pool.
        """
        if self.index_is_local:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    async def slot_handles(self, keys: list[BlockHash]) -> list[SlotHandle | None]:
        """The shm tier's handle of each key (None: not there now): remembered ones checked on
        the loop without the tier's lock, the others asked of the tier in the pool."""
        assert self.slots is not None
        handles = self.slots.known(keys)
        missing = [i for i, h in enumerate(handles) if h is None]
        if missing:
            found = await self.run(self.slots.look_up, [keys[i] for i in missing])
            for i, handle in zip(missing, found):
                handles[i] = handle
        return handles

    async def read_body(self, request: Request) -> tuple[bytearray, int]:
        """The whole body in a pooled buffer: (buffer, length). Release it with ``buffers.release``.

        A fresh buffer of the declared length commits memory only as bytes are written into
        it, and every part received is charged to ``inflight`` (``server.inflight``).

        Raises:
            PayloadTooLarge: over ``max_body_bytes``.
        """
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        size = int(declared) if declared and declared.isdigit() else 0
        if size > limit:
            raise PayloadTooLarge(f"body of {size} bytes is over the {limit}-byte limit", field="body")
        buf = self.buffers.acquire(size or 1 << 20)
        n = 0
        try:
            async for chunk in request.stream():
                end = n + len(chunk)
                if end > limit:
                    raise PayloadTooLarge(f"body is over the {limit}-byte limit", field="body")
                if end > len(buf):  # no or a wrong Content-Length: grow
                    bigger = lazy_buffer(max(end, 2 * len(buf)))
                    bigger[:n] = memoryview(buf)[:n]
                    buf = bigger
                buf[n:end] = chunk
                n = end
        except BaseException:
            self.buffers.release(buf)
            raise
        return buf, n

    def close(self) -> None:
        for closer in reversed(self.closers):
            try:
                closer()
            except Exception:  # noqa: BLE001 - one failed side server must not keep the store open
                log.exception("kvstore: closing a side server failed")
        self.closers.clear()
        self.pool.shutdown(wait=True)
        self.tally.close()
        if self.slots is not None:
            self.slots.close()
        if self.staging is not None:
            self.staging.close()
        if self.close_store:
            self.store.close()


def _data_dir(store: KVStore) -> str | None:
    for tier in store.tiers:
        root = getattr(tier, "data_dir", None)  # the nvme tier's <data_dir>/nvme
        if isinstance(root, str):
            return os.path.dirname(os.path.abspath(root))
    return None


# -- parsing helpers ---------------------------------------------------------------------


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        MalformedRequest: not JSON, or not an object.
    """
    return json_object(await request.body())


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` (empty: ``{}``) as a JSON object.

    Raises:
        MalformedRequest: not JSON, or not an object.
    """
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise MalformedRequest(f"body: not JSON: {exc}", field="body") from exc
    if not isinstance(data, dict):
        raise MalformedRequest(f"body: must be a JSON object, got {type(data).__name__}", field="body")
    return data


_MISSING = object()


def require(data: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = _MISSING) -> Any:
    """``data[name]`` checked against ``kind``.

    Raises:
        InvalidInput: missing (without a default) or of the wrong type, naming the field.
    """
    value = data.get(name, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise InvalidInput(f"{name}: required", field=name)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise InvalidInput(f"{name}: must be {names}, got {type(value).__name__}", field=name)
    return value


def parse_spec(data: Any, field: str = "spec") -> KVSpec:
    """A ``KVSpec`` from its wire form; a hot spec is built once (its fingerprint is a blake3)."""
    try:
        if not isinstance(data, dict):
            return KVSpec.from_dict(data)
        # Types are part of the key: True == 1 would otherwise share a cache slot with 1.
        key = tuple((str(k), type(v).__name__, v) for k, v in sorted(data.items(), key=lambda kv: str(kv[0])))
        try:
            return _spec_cached(key)
        except TypeError:  # an unhashable value (a list, a dict): let from_dict say what is wrong
            return KVSpec.from_dict(data)
    except InvalidInput as exc:
        raise field_error(exc, field) from exc


@functools.lru_cache(maxsize=256)
def _spec_cached(items: tuple) -> KVSpec:
    return KVSpec.from_dict({k: v for k, _, v in items})


def parse_tokens(data: Any, field: str = "tokens", limit: int | None = None) -> np.ndarray:
    """Token ids from their wire form (a JSON list).

    Raises:
        InvalidTokens: (422, ``field``) not a flat list of ids in [0, 2**32).
        TooManyTokens: (413, ``field``) more than ``limit`` of them, counted before they are checked.
    """
    if limit is not None and isinstance(data, list) and len(data) > limit:
        raise too_many_tokens(f"{len(data)} token ids", limit, field)
    try:
        return normalize_tokens(data)
    except InvalidInput as exc:
        raise field_error(exc, field) from exc


def too_many_tokens(what: str, limit: int, field: str = "tokens") -> TooManyTokens:
    """The 413 of a request over ``max_tokens_per_request``; ``what`` says what was counted."""
    return TooManyTokens(f"{field}: {what} is over the server's limit of {limit} token ids per request "
                         f"(KVSTORE_MAX_TOKENS_PER_REQUEST={limit}): split the sequence, or raise the setting",
                         limit=limit, field=field)


def kv_view(buf: bytearray, offset: int, spec: KVSpec, kv_tokens: int) -> torch.Tensor:
    """The KV bytes at ``offset`` of ``buf`` as a tensor, without a copy."""
    if kv_tokens == 0:
        return spec.empty_kv(0)
    count = spec.bytes_per_token * kv_tokens // spec.element_size
    flat = torch.frombuffer(buf, dtype=spec.torch_dtype, count=count, offset=offset)
    return flat.view(spec.kv_shape(kv_tokens))


@contextmanager
def released(pool: BufferPool, buf: bytearray) -> Iterator[bytearray]:
    try:
        yield buf
    finally:
        pool.release(buf)
