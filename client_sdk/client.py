"""``KVClient``: put_kv / get_kv / lookup against a kvstore server, over shm or HTTP.

The medium is picked once, on first use: when the server advertises an shm
arena, its host id equals ours and we can open its segments, KV moves through
shared memory (get: slot handles, decoded straight out of the arena under a
read lease; put: written into a staging range the server leased us, then one
small commit request). Otherwise KV moves over HTTP, as raw bytes received
straight into the returned tensor (``client_sdk._http``). Small JSON calls
(admin, info) go through httpx.

Errors come back as the server's classes (``kvstore.wire.errors.ERRORS``):
``InvalidSpec``, ``TierFull``, ``Unauthorized`` ... Connection failures are
retried with exponential backoff (every call is idempotent: a put of stored
blocks is a no-op); a timeout is not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import httpx
import torch

from client_sdk import _common as c
from client_sdk._http import BrokenConnection, Connection, Endpoint
from client_sdk.media import Medium
from client_sdk.planning import ClientPlanner
from client_sdk.rest_media import HttpMedium, InprocMedium, ShmMedium, side_media
from kvstore.wire.rest import BATCH_MEDIA, FRAME_MEDIA, H_TOKENS, KV_MEDIA, host_id, pad64
from kvstore.errors import ConnectionFailed, Forbidden, RequestTimeout, ServiceError
from kvstore.wire.errors import error_from
from client_sdk._common import BlockSink, BlockWriter
from kvstore.errors import InvalidInput, KVStoreError, TierFull
from kvstore.keys import BlockHash, check_key, validate_namespace
from kvstore.planner import Decision
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["KVClient"]

T = TypeVar("T")


class KVClient:
    """A blocking client; safe to share between threads (one socket per thread).

    Args:
        url: ``http://host:port`` of a ``kvstore serve``.
        token: bearer token (a tenant's, or the admin token for admin helpers).
        namespace: the namespace every data call works in.
        timeout_s: per-request read timeout (None: wait forever).
        connect_timeout_s: TCP connect timeout.
        retries: extra attempts after a connection error.
        backoff_s: first retry delay; doubles each attempt, with jitter.
        colocated: None picks shm when it works, False never uses it (remote), True requires it.
        buffer_pool_bytes: idle result memory kept for reuse (``_common.TensorPool``); 0 turns
            it off. A result's memory is reused only after every tensor viewing it is gone.
        plan: let the transfer planner pick the medium per transfer (``client_sdk.planning``);
            False keeps the medium fixed: shm when co-located, else HTTP.
        inproc: an ``EmbeddedStore`` in this process that the server serves (the agent hosts the
            server): the ``inproc`` medium, tensors by reference.
        redis_url: the shared Redis tier, for the ``redis`` medium, when the server offers it.
        wrap_media: applied to every medium as it is built (tests and benchmarks inject slow links
            with ``client_sdk.media.Throttled``).
        slo_s: default latency bound of a transfer for the planner (None: the policy's).
    """

    def __init__(self, url: str, token: str | None = None, namespace: str = "default", *,
                 timeout_s: float | None = 60.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05, colocated: bool | None = None,
                 buffer_pool_bytes: int = 512 << 20, plan: bool = True, inproc: Any = None,
                 redis_url: str | None = None, wrap_media: Callable[[Medium], Medium] | None = None,
                 slo_s: float | None = None) -> None:
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
        self._out_views = c.OutViews()
        self._local = threading.local()
        self._conns: list[Connection] = []
        self._conns_lock = threading.Lock()
        self._report_cv = threading.Condition()
        self._reporter: threading.Thread | None = None
        self._report_wanted = self._report_busy = self._closing = False
        self._arena: c.Arena | None = None
        self._retired: list[c.Arena] = []  # arenas of a server that restarted, closed at close()
        self._medium: str | None = None
        self._medium_lock = threading.RLock()  # _planned() holds it while _use_shm() takes it
        self.plan = plan
        self.slo_s = slo_s
        self._inproc = inproc
        self.redis_url = redis_url
        self._wrap_media = wrap_media
        self._planner: ClientPlanner | None = None
        self._info: dict | None = None
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                  headers=c.headers_for(token, self.namespace))

    # -- the data API (EmbeddedStore's, without namespace) --------------------------------

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, durable: bool = False) -> int:
        """Store the KV of every full block of ``tokens``; returns tokens covered.

        Args:
            durable: return only if every stored block sat on a durable tier when checked
                (one more lookup after the put); on a server whose tiers are all durable, the
                put then survives a crash of the server. ``docs/reliability.md`` has the rest.

        Raises:
            InvalidSpec, InvalidTokens, InvalidKV: bad input (checked here first).
            TierFull, QuotaExceeded, TierUnavailable, Unauthorized, Forbidden: from the server.
            NotDurable: ``durable`` was asked and some stored block sits on a volatile tier.
            ConnectionFailed: the server could not be reached after the retries.
        """
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        kv = c.validate_put(spec, toks, kv)
        if self.plan:
            stored = self._planned().put_kv(spec, toks, kv, self.slo_s)
        else:
            got = self._put_shm(spec, toks, kv) if self._use_shm() else None
            stored = got if got is not None else self._put_http(spec, toks, kv)
        if durable:
            c.check_durable(stored, self.lookup_blocks(spec, toks))
        return stored

    def _put_http(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        parts = c.kv_parts(spec, toks, kv)
        answer = self._send("POST", "/v1/kv/put", parts, KV_MEDIA)
        self.stats.http_puts += 1
        self.stats.last_medium = "http"
        return int(answer["stored_tokens"])

    def get_kv(self, spec: KVSpec, tokens: Any, *, out: Any = None,
               slo_s: float | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix: ``(kv [L, 2, H, n, D], n)``.

        With planning on, ``n`` is 0 when the planner predicts that recomputing
        is faster than fetching; ``last_decision.reason`` says why.

        Args:
            out: optional contiguous CPU tensor or writable buffer to receive the KV; the
                returned tensor is then a view of its first bytes (no allocation per call).
            slo_s: this transfer's latency bound for the planner (default: the client's).
        """
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        if self.plan:
            return self._planned().get_kv(spec, toks, out, self.slo_s if slo_s is None else slo_s)
        if self._use_shm():
            return self._get_shm(spec, toks, out)
        parts = c.kv_parts(spec, toks, None)
        return self._retrying(lambda: self._get_http_once(spec, parts, out))

    def get_kv_layers(self, spec: KVSpec, tokens: Any) -> Any:
        """The longest stored prefix, layer by layer as it arrives (``client_sdk.layers.LayerStream``).

        Yields ``(layer_index, kv_layer [2, H, n, D])``; ``n_tokens`` is known before the first layer.
        Over shm when co-located, else streamed HTTP.
        """
        from client_sdk.layers import get_kv_layers

        return get_kv_layers(self, c.check_spec(spec), tokens)

    def lookup(self, spec: KVSpec, tokens: Any) -> int:
        """Tokens of the longest stored prefix (index only, no KV moves)."""
        return int(self.lookup_blocks(spec, tokens)["tokens"])

    def lookup_blocks(self, spec: KVSpec, tokens: Any) -> dict:
        """The lookup answer: ``{"tokens", "block_tokens", "blocks": [{"key", "tier"}]}``."""
        spec = c.check_spec(spec)
        return self._send("POST", "/v1/lookup", c.kv_parts(spec, c.tokens_of(tokens), None), KV_MEDIA)

    def delete(self, spec: KVSpec, tokens: Any) -> int:
        """Delete the stored blocks of ``tokens``; returns blocks removed."""
        spec = c.check_spec(spec)
        answer = self._send("POST", "/v1/kv/delete", c.kv_parts(spec, c.tokens_of(tokens), None), KV_MEDIA)
        return int(answer["deleted_blocks"])

    # -- blocks ----------------------------------------------------------------------------

    def get_block(self, key: BlockHash) -> bytes | None:
        """The stored frame of ``key`` in this namespace, or None."""
        def once() -> bytes | None:
            conn = self._conn()
            head = conn.request("GET", f"/v1/blocks/{check_key(key).hex()}", self._headers())
            body = conn.read_body()
            if head.status == 404:
                return None
            if head.status != 200:
                raise error_from(head.status, body)
            return body
        return self._retrying(once)

    def put_block(self, key: BlockHash, frame: Any) -> None:
        self._send("PUT", f"/v1/blocks/{check_key(key).hex()}", [frame], FRAME_MEDIA)

    def delete_block(self, key: BlockHash) -> bool:
        try:
            return bool(self._json("DELETE", f"/v1/blocks/{check_key(key).hex()}")["deleted"])
        except KeyError:
            return False

    def get_blocks(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """Frames of many keys in one request; None for each absent one."""
        return c.frames_of(self._send_raw("POST", "/v1/blocks/get", {"keys": [check_key(k).hex() for k in keys]}))

    def put_blocks(self, items: Sequence[tuple[BlockHash, Any]], *, make_room: bool = False) -> int:
        """Store many frames in one request; returns how many. ``make_room`` places them as
        ``put_kv`` places blocks (colder entries demoted or evicted) instead of falling through
        full tiers."""
        path = "/v1/blocks/put?make_room=true" if make_room else "/v1/blocks/put"
        return int(self._send("POST", path, c.batch_parts(items), BATCH_MEDIA)["stored"])

    def delete_blocks(self, keys: Sequence[BlockHash]) -> int:
        return int(self._json("POST", "/v1/blocks/delete", {"keys": [check_key(k).hex() for k in keys]})["deleted"])

    def blocks_exist(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each key holds a block of this namespace, in any tier (one request).

        Co-located, the answer also names the arena slots of the blocks there, which are
        remembered: a ``get_blocks_into`` of them that follows (a cache's lookup, then its
        load) reads them with no request of its own, and a block whose remembered slot still
        holds the generation the server named is known present without asking.
        """
        hexes = [check_key(k).hex() for k in keys]
        arena = self._current_arena()
        if arena is not None and hexes:
            # a remembered slot whose generation stands still holds its block: no need to ask
            present = [b is not None and arena.holds(b) for b in arena.handles.blocks(hexes)]
            ask = [i for i, here in enumerate(present) if not here]
            if not ask:
                return present
            answer = _json_of(self._send_raw("POST", "/v1/blocks/handles",
                                             {"keys": [hexes[i] for i in ask], "count": False}))
            if not self._arena_changed(arena, answer.get("segment"), "segment"):
                arena.handles.remember(answer["blocks"])
                for i, b in zip(ask, answer["blocks"]):
                    present[i] = b.get("checksum") is not None
                return present
        answer = self._send_raw("POST", "/v1/blocks/exists", {"keys": hexes})
        return [bool(x) for x in _json_of(answer)["present"]]

    def pin_blocks(self, keys: Sequence[BlockHash], ttl_s: float) -> int:
        """Hold this namespace's blocks in place for ``ttl_s`` seconds (at most an hour): placement
        neither demotes nor evicts them until then or ``unpin_blocks``. Pins do not count: one
        unpin releases a key however often it was pinned. Returns how many were stored."""
        answer = self._send_raw("POST", "/v1/blocks/pin", {"keys": [check_key(k).hex() for k in keys], "ttl_s": ttl_s})
        return int(_json_of(answer)["pinned"])

    def unpin_blocks(self, keys: Sequence[BlockHash]) -> int:
        answer = self._send_raw("POST", "/v1/blocks/unpin", {"keys": [check_key(k).hex() for k in keys]})
        return int(_json_of(answer)["unpinned"])

    def get_blocks_into(self, keys: Sequence[BlockHash], sink: BlockSink) -> list[bool]:
        """Hand each stored block of ``keys`` to ``sink(i, header, payload)``, verified; True where it did.

        Co-located, the server names the arena slots of the blocks it holds there (one small
        request, which counts the reads) and each is read in place: ``payload`` views the
        arena and is valid only during the call, so the sink copies it where it belongs (one
        copy in all). Slots are remembered (from this call's answer, or a ``blocks_exist``
        before it): a remembered slot is read with no request while its generation stands,
        hashed only the first time (reads reported in the background, for placement's heat);
        a changed one is asked for again. Other blocks come over HTTP in one batch.
        ``payload`` holds the raw bytes of ``header.shape`` in ``header.dtype``: a block a
        cold tier holds in int8 is decoded to them first. A block that fails its checksum,
        or is another namespace's, is a miss (False), never bytes.
        """
        keys = [check_key(k) for k in keys]
        done = [False] * len(keys)
        absent: set[int] = set()
        arena = self._current_arena()
        if arena is not None and keys:
            hexes = [k.hex() for k in keys]
            # slots remembered from an earlier answer (a lookup's, or a get's): read with no request
            served, ask = [], []
            for i, b in enumerate(arena.handles.blocks(hexes)):
                if b is not None and arena.read_block(b["handle"], b.get("checksum"), self.namespace, i, sink,
                                                      self.stats):
                    done[i] = True
                    served.append(b)
                else:
                    ask.append(i)
            if served:  # the server never saw these reads: report them, for placement's heat
                arena.accesses.add(served, 0, 0)
                if arena.accesses.due():
                    self._report_soon()
            if ask:
                answer = _json_of(self._send_raw("POST", "/v1/blocks/handles", {"keys": [hexes[i] for i in ask]}))
                if not self._arena_changed(arena, answer.get("segment"), "segment"):
                    arena.handles.remember(answer["blocks"])
                    for i, b in zip(ask, answer["blocks"]):
                        h = b.get("handle")
                        if h is None:
                            if b.get("checksum") is None:
                                absent.add(i)  # not stored: nothing to fetch
                            continue
                        # the checksum the server indexed: a slot reused meanwhile cannot pass for it
                        done[i] = arena.read_block(h, b.get("checksum"), self.namespace, i, sink, self.stats)
            self.stats.shm_gets += 1
            self.stats.last_medium = "shm"
        missing = [i for i, ok in enumerate(done) if not ok and i not in absent]
        if missing:
            for i, frame in zip(missing, self.get_blocks([keys[i] for i in missing])):
                if frame is not None and c.give_frame(memoryview(frame), self.namespace, i, sink, None):
                    done[i] = True
        return done

    def put_blocks_with(self, keys: Sequence[BlockHash], sizes: Sequence[int], writer: BlockWriter, *,
                        make_room: bool = False) -> int:
        """Store one frame per key, each written in place by ``writer(i, view) -> frame length``.

        ``view`` is ``sizes[i]`` writable bytes: co-located, a range of a staging lease in the
        server's shared memory (the caller's bytes are copied once, into it); otherwise a
        buffer sent over HTTP as one batch. The writer fills it with a sealed frame
        (``kvstore.codec.seal_raw``). ``make_room`` places the blocks as ``put_kv`` does,
        demoting or evicting colder entries, instead of falling through full tiers.

        Returns:
            How many were stored.
        """
        keys = [check_key(k) for k in keys]
        if len(sizes) != len(keys):
            raise InvalidInput(f"sizes: {len(sizes)} for {len(keys)} keys")
        if not keys:
            return 0
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + pad64(int(n)))
        arena = self._current_arena()
        if arena is not None:
            stored = self._put_blocks_staged(arena, keys, offsets, writer, make_room)
            if stored is not None:
                return stored
        buf = bytearray(offsets[-1])
        view = memoryview(buf)
        items = []
        for i, key in enumerate(keys):
            n = writer(i, view[offsets[i]:offsets[i + 1]])
            items.append((key, view[offsets[i]:offsets[i] + n]))
        return self.put_blocks(items, make_room=make_room)

    def _put_blocks_staged(self, arena: c.Arena, keys: list[BlockHash], offsets: list[int], writer: BlockWriter,
                           make_room: bool) -> int | None:
        """``put_blocks_with`` through a staging lease; None when staging has no room (then HTTP)."""
        return self._staged(arena, offsets[-1], self._commit_blocks, arena, keys, offsets, writer, make_room)

    def _commit_blocks(self, lease: dict, arena: c.Arena, keys: list[BlockHash], offsets: list[int],
                       writer: BlockWriter, make_room: bool) -> int:
        view = memoryview(arena.staging)[lease["offset"]:lease["offset"] + offsets[-1]]
        try:
            blocks = [{"key": key.hex(), "offset": offsets[i], "length": writer(i, view[offsets[i]:offsets[i + 1]])}
                      for i, key in enumerate(keys)]
        finally:
            view.release()
        answer = self._send_raw("POST", f"/v1/blocks/put-staged/{lease['lease']}",
                                {"blocks": blocks, "make_room": make_room})
        return int(_json_of(answer)["stored"])

    def evict_mine(self, **selectors: Any) -> dict:
        """Evict blocks of this namespace (``POST /v1/evict``): the admin selectors, tenant-scoped."""
        return self._json("POST", "/v1/evict", selectors)

    # -- admin helpers (need the admin token) --------------------------------------------------

    def evict(self, *, dry_run: bool = False, **selectors: Any) -> dict:
        """``POST /admin/evict``: keys, prefix, namespace, fingerprint, tier, older_than_s, watermark."""
        if "keys" in selectors:
            selectors["keys"] = [k.hex() if isinstance(k, bytes) else k for k in selectors["keys"]]
        if isinstance(selectors.get("prefix"), dict) and isinstance(selectors["prefix"].get("spec"), KVSpec):
            p = dict(selectors["prefix"])
            p["spec"] = p["spec"].to_dict()
            p["tokens"] = [int(t) for t in c.tokens_of(p["tokens"])]
            selectors["prefix"] = p
        return self._json("POST", "/admin/evict", {**selectors, "dry_run": dry_run})

    def pin(self, keys: Sequence[Any] | None = None, *, spec: KVSpec | None = None, tokens: Any = None,
            namespace: str | None = None, ttl_s: float | None = None) -> dict:
        return self._json("POST", "/admin/pin", self._pin_body(keys, spec, tokens, namespace, ttl_s))

    def unpin(self, keys: Sequence[Any] | None = None, *, spec: KVSpec | None = None, tokens: Any = None,
              namespace: str | None = None) -> dict:
        return self._json("DELETE", "/admin/pin", self._pin_body(keys, spec, tokens, namespace, None))

    def migrate(self, key: Any, tier: str) -> dict:
        return self._json("POST", "/admin/migrate", {"key": key.hex() if isinstance(key, bytes) else key, "tier": tier})

    def admin_stats(self) -> dict:
        return self._json("GET", "/admin/stats")

    def connectors(self) -> list[dict]:
        """Engine connectors' counters by namespace and engine (admin token)."""
        return self._json("GET", "/admin/connectors")["connectors"]

    def report_connector(self, engine: str, instance: str, counters: dict[str, float]) -> None:
        """An engine connector's cumulative counters, for the server's /metrics and dashboard."""
        self._json("POST", "/v1/connectors/report", {"engine": engine, "instance": instance, "counters": counters})

    def tiers(self) -> list[dict]:
        return self._json("GET", "/admin/tiers")["tiers"]

    def entries(self, sort: str = "heat", order: str = "desc", limit: int = 100, offset: int = 0,
                namespace: str | None = None, tier: str | None = None, *,
                min_heat_per_s: float | None = None, max_heat_per_s: float | None = None,
                min_age_s: float | None = None, max_age_s: float | None = None) -> dict:
        """A page of index entries (``GET /admin/entries``), sorted and filtered as the route says."""
        params = c.entries_params(sort, order, limit, offset, namespace=namespace, tier=tier,
                                  min_heat_per_s=min_heat_per_s, max_heat_per_s=max_heat_per_s,
                                  min_age_s=min_age_s, max_age_s=max_age_s)
        return self._json("GET", "/admin/entries", params=params)

    def heat(self, bins: int = 12) -> dict:
        """The heat histogram by tier (``GET /admin/heat``)."""
        return self._json("GET", "/admin/heat", params={"bins": bins})

    def history(self, limit: int = 720) -> dict:
        """The hit ratio over time, overall and by tier (``GET /admin/history``)."""
        return self._json("GET", "/admin/history", params={"limit": limit})

    def explain(self, key: Any) -> dict:
        return self._json("GET", f"/admin/explain/{key.hex() if isinstance(key, bytes) else key}")

    def audit(self, limit: int = 100, offset: int = 0, action: str | None = None) -> dict:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if action:
            params["action"] = action
        return self._json("GET", "/admin/audit", params=params)

    def info(self) -> dict:
        return self._json("GET", "/v1/info")

    def health(self) -> dict:
        return self._json("GET", "/healthz")

    def ready(self) -> dict:
        """``/readyz``'s answer, degraded or not (a 503 raises ``ServiceError``)."""
        return self._json("GET", "/readyz")

    def metrics(self) -> str:
        return self._request_http("GET", "/metrics").text

    def _report_accesses(self) -> None:
        """Send the reads served from remembered handles, and finished planner decisions.

        Both are advisory (heat, the decision log): a failed report is dropped.
        """
        while self._arena is not None and (report := self._arena.accesses.drain()) is not None:
            try:
                self._send("POST", "/v1/kv/touch", [json.dumps(report, separators=(",", ":")).encode()],
                           "application/json")
            except KVStoreError as exc:
                log.debug("access report dropped: %s", exc)
        while self._planner is not None and (records := self._planner.planner.log.drain(256)):
            try:
                self._send("POST", "/v1/decisions", [json.dumps({"decisions": [d.to_dict() for d in records]},
                                                                separators=(",", ":")).encode()], "application/json")
            except KVStoreError as exc:
                log.debug("decision report dropped: %s", exc)
                break

    def _report_soon(self) -> None:
        """Hand the pending access report to the reporter thread, so no get waits on it.

        One report is in flight at a time; reads served meanwhile join the next.
        """
        with self._report_cv:
            self._report_wanted = True
            if self._reporter is None and not self._closing:
                self._reporter = threading.Thread(target=self._report_loop, name="kvstore-access-report",
                                                  daemon=True)
                self._reporter.start()
            self._report_cv.notify_all()

    def _report_loop(self) -> None:
        while True:
            with self._report_cv:
                self._report_cv.wait_for(lambda: self._report_wanted or self._closing)
                if self._closing:
                    return  # close() sends what is left
                self._report_wanted, self._report_busy = False, True
            try:
                self._report_accesses()
            finally:
                with self._report_cv:
                    self._report_busy = False
                    self._report_cv.notify_all()

    def wait_reports(self, timeout_s: float | None = None) -> bool:
        """Wait until no access report is queued or in flight; False if ``timeout_s`` passed first."""
        with self._report_cv:
            return self._report_cv.wait_for(lambda: not (self._report_busy or self._report_wanted)
                                            or self._reporter is None, timeout_s)

    def close(self) -> None:
        with self._report_cv:
            self._closing = True
            self._report_cv.notify_all()
        if self._reporter is not None:
            self._reporter.join()
        self._report_accesses()
        if self._planner is not None:
            self._planner.close()  # Flight channels, Redis pools
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        if self._arena is not None:
            for lease in self._arena.leases:
                try:
                    self._json("DELETE", f"/v1/staging/lease/{lease['lease']}")
                except KVStoreError:
                    pass  # it expires on its own
            self._arena.close()
            self._arena = None
        for arena in self._retired:
            arena.close()
        self._retired.clear()
        self._http.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the planner -----------------------------------------------------------------------------

    def set_prefill_rate(self, spec: KVSpec, tokens_per_s: float) -> None:
        """The caller's prefill speed for ``spec``: the planner answers "recompute" when that is faster."""
        self._planned().set_prefill_rate(c.check_spec(spec), tokens_per_s)

    @property
    def last_decision(self) -> Decision | None:
        """The planner's latest decision (inputs, candidates, choice, reason, actual cost)."""
        return None if self._planner is None else self._planner.last

    def decisions(self, limit: int = 100) -> list[dict]:
        """This client's newest decision records, oldest first."""
        return [] if self._planner is None else [d.to_dict() for d in self._planner.planner.log.records(limit)]

    def _planned(self) -> ClientPlanner:
        if self._planner is None:
            with self._medium_lock:
                if self._planner is None:
                    self._planner = self._build_planner()
        return self._planner

    def _build_planner(self) -> ClientPlanner:
        colocated = self._use_shm()
        if self._info is None:
            self._info = self.info()
        built: dict[str, Medium] = {}
        if self._inproc is not None:
            built["inproc"] = InprocMedium(self._inproc, self.namespace)
        if colocated:
            built["shm"] = ShmMedium(self)
        built["http"] = HttpMedium(self)
        for name, medium in self._side_media().items():
            built[name] = medium
        if self._wrap_media is not None:
            built = {k: self._wrap_media(m) for k, m in built.items()}
        return ClientPlanner(built, fetch_policies=self._fetch_policies, routing_key=self.namespace,
                             locality="colocated" if colocated else "remote", report=self._report_soon)

    def _side_media(self) -> dict[str, Medium]:
        """Flight and direct Redis, where the server offers them and this process can use them."""
        return side_media(self, self._info or {})

    def _fetch_policies(self) -> Any:
        return self._json("GET", "/v1/policy")

    # -- co-located path -----------------------------------------------------------------------

    def _use_shm(self) -> bool:
        if self.colocated is False:
            return False
        if self._medium is None:
            with self._medium_lock:
                if self._medium is None:
                    self._medium = self._pick_medium()
        return self._medium == "shm"

    def _current_arena(self) -> c.Arena | None:
        """The mapped arena (mapped anew after ``_arena_changed``), or None when shm is not used."""
        if self._arena is None and not self._use_shm():
            return None
        return self._arena

    def _arena_changed(self, arena: c.Arena, named: Any, which: str) -> bool:
        """True when the server named other segments than ``arena`` maps: it restarted, and what this
        client would write into (or read from) its old mapping is no longer the server's memory. The
        arena is retired (closed at ``close()``: another thread may still be reading it) and the next
        call maps the server's new one."""
        if named == getattr(arena, which):
            return False
        log.info("kvstore at %s serves from other shm segments (a restart?): mapping them again", self.url)
        with self._medium_lock:
            if self._arena is arena:
                self._retired.append(arena)
                self._arena, self._medium = None, None
        return True

    def _pick_medium(self) -> str:
        info = self._info = self.info()
        offer = info.get("colocated")
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

    def _get_shm(self, spec: KVSpec, toks: Any, out: Any) -> tuple[torch.Tensor, int]:
        arena = self._current_arena()
        if arena is None:  # the server restarted without an arena this client can map: HTTP
            parts = c.kv_parts(spec, toks, None)
            return self._retrying(lambda: self._get_http_once(spec, parts, out))
        bt = spec.block_tokens
        cached = arena.handles.lookup(spec, toks, self.namespace)
        if cached is not None:  # every block's handle is remembered: no request unless one went stale
            if out is None:
                kv, dst = self._pool.tensor_and_ints(spec.kv_shape(len(cached) * bt), spec.torch_dtype)
            else:
                kv, dst = self._out_views.get(spec, len(cached) * bt, out)
            if not arena.fill_from_handles(cached, kv, bt, self.stats, dst):
                arena.served_from_cache(cached, bt, self.stats)
                if arena.accesses.due():
                    self._report_soon()
                return kv, len(cached) * bt
            arena.handles.forget(cached)
        answer = self._send("POST", "/v1/kv/handles", c.kv_parts(spec, toks, None), KV_MEDIA)
        blocks = answer["blocks"]
        kv = c.result_tensor(spec, len(blocks) * bt, out, self._pool)
        if self._arena_changed(arena, answer.get("segment"), "segment"):
            missing: Sequence[int] = range(len(blocks))  # its handles name slots of another arena
        else:
            arena.handles.remember(blocks)
            missing = arena.fill_from_handles(blocks, kv, bt, self.stats)
        good = self._fill_missing(blocks, missing, kv, bt)
        self.stats.shm_gets += 1
        self.stats.last_medium = "shm"
        if good < len(blocks):
            kv = kv[:, :, :, :good * bt].clone() if out is None else c.result_tensor(spec, good * bt, out)
        return kv, good * bt

    def _fill_missing(self, blocks: Sequence[dict], missing: Sequence[int], kv: torch.Tensor, bt: int) -> int:
        """Fetch over HTTP the blocks of a co-located get the arena did not have; returns how many
        blocks of the prefix are now in ``kv`` (it stops at the first that is gone)."""
        if not missing:
            return len(blocks)
        want = {blocks[i]["key"]: i for i in missing}
        body = self._send_raw("POST", "/v1/blocks/get", {"keys": list(want)})
        arrived = c.fill_from_batch(body, want, kv, bt, {})
        self.stats.shm_blocks_fetched_over_http += len(arrived)
        lost = sorted(set(missing) - arrived)
        return lost[0] if lost else len(blocks)

    def _frames_shm(self, keys: Sequence[BlockHash]) -> list[Any]:
        """Frames of ``keys``: read from the arena where it holds them (and they are this
        namespace's), the rest over HTTP."""
        arena = self._current_arena()
        if arena is None:  # the server restarted without an arena this client can map
            return self.get_blocks(keys)
        frames: list[Any] = []
        for key in keys:
            handle = arena.reader.find(check_key(key))
            frame = arena.reader.read(handle) if handle is not None else None
            if frame is not None and not c.frame_in_namespace(frame, self.namespace):
                frame = None
            frames.append(frame)
        missing = [i for i, f in enumerate(frames) if f is None]
        if missing:
            for i, frame in zip(missing, self.get_blocks([keys[i] for i in missing])):
                frames[i] = frame
        return frames

    def _probe_http(self, nbytes: int) -> None:
        """``GET /v1/probe``: ``nbytes`` of filler received into a reused buffer."""
        def once() -> None:
            conn = self._conn()
            head = conn.request("GET", f"/v1/probe?bytes={int(nbytes)}", self._headers())
            if head.status != 200:
                raise error_from(head.status, conn.read_body())
            if head.length:
                buf = getattr(self._local, "probe_buf", None)
                if buf is None or len(buf) < head.length:
                    buf = self._local.probe_buf = bytearray(head.length)
                conn.read_into(memoryview(buf)[:head.length])
            else:
                conn.read_body()
        self._retrying(once)

    def _put_shm(self, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int | None:
        """A put through a staging lease (``_staged``); None when staging has no room (then HTTP)."""
        arena = self._current_arena()
        nbytes = spec.bytes_per_token * int(kv.shape[3])
        if nbytes == 0 or arena is None:
            return None
        return self._staged(arena, nbytes, self._commit_kv, arena, spec, toks, kv)

    def _commit_kv(self, lease: dict, arena: c.Arena, spec: KVSpec, toks: Any, kv: torch.Tensor) -> int:
        arena.write_staging(lease, kv)
        answer = self._send("POST", f"/v1/kv/put-staged/{lease['lease']}", c.kv_parts(spec, toks, kv, with_kv=False),
                            KV_MEDIA)
        return int(answer["stored_tokens"])

    def _staged(self, arena: c.Arena, nbytes: int, commit: Callable[..., T], *args: Any) -> T | None:
        """``commit(lease, *args)`` (write into a staging lease of at least ``nbytes``, then commit the put);
        None when staging has no room or the server's arena changed: the caller goes over HTTP.

        Each put holds its own lease while it writes and commits, so concurrent puts from one
        client never write into the same range. A lease the server expired is dropped and a
        fresh one taken, once.
        """
        for attempt in range(2):
            # After a refused lease, a fresh one: another idle lease may be as stale (all of them,
            # after a server restart)
            lease = arena.take_lease(nbytes) if attempt == 0 else None
            if lease is None:
                try:
                    lease = self._json("POST", "/v1/staging/lease", {"nbytes": max(nbytes, 1 << 20)})
                except TierFull as exc:
                    if exc.tier == "staging":
                        return None  # staging full: go over HTTP
                    raise
                if self._arena_changed(arena, lease.get("segment"), "staging_segment"):
                    with contextlib.suppress(KVStoreError):  # not ours to write: hand it back now
                        self._json("DELETE", f"/v1/staging/lease/{lease['lease']}")
                    return None  # this put goes over HTTP; the next maps the new arena
                arena.add_lease(lease)
            try:
                got = commit(lease, *args)
            except Forbidden:  # the lease expired server-side: lease again once
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
            return got
        return None

    # -- plumbing --------------------------------------------------------------------------------

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        return c.headers_for(self.token, self.namespace, content_type)

    def _conn(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = Connection(self.endpoint, connect_timeout_s=self.connect_timeout_s, timeout_s=self.timeout_s)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _retrying(self, once: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return once()
            except BrokenConnection as exc:
                last = exc
            except TimeoutError as exc:
                raise RequestTimeout(f"no answer from {self.url} within {self.timeout_s} s") from exc
            if attempt < self.retries:
                self.stats.retries += 1
                time.sleep(delay * (0.5 + random.random()))
                delay *= 2
        raise ConnectionFailed(f"{self.url}: {last} (after {self.retries} retries)") from last

    def _send(self, method: str, path: str, parts: Sequence[Any], content_type: str) -> Any:
        """A request with a binary body over the fast connection; the JSON answer."""
        def once() -> Any:
            conn = self._conn()
            head = conn.request(method, path, self._headers(content_type), parts)
            body = conn.read_body()
            if head.status >= 400:
                raise error_from(head.status, body)
            return _json_of(body)
        return self._retrying(once)

    def _send_raw(self, method: str, path: str, payload: dict) -> bytes:
        """A JSON request over the fast connection; the raw answer."""
        raw = json.dumps(payload, separators=(",", ":")).encode()

        def once() -> bytes:
            conn = self._conn()
            head = conn.request(method, path, self._headers("application/json"), [raw])
            body = conn.read_body()
            if head.status >= 400:
                raise error_from(head.status, body)
            return body
        return self._retrying(once)

    def _get_http_once(self, spec: KVSpec, parts: list, out: Any) -> tuple[torch.Tensor, int]:
        conn = self._conn()
        head = conn.request("POST", "/v1/kv/get", self._headers(KV_MEDIA), parts)
        if head.status != 200:
            raise error_from(head.status, conn.read_body())
        n = int(head.headers.get(H_TOKENS, "-1"))
        if n < 0 or head.length != spec.bytes_per_token * n:
            conn.close()
            raise ServiceError(f"get_kv answer of {head.length} bytes for {n} tokens does not match the spec")
        try:
            kv = c.result_tensor(spec, n, out, self._pool)
        except KVStoreError:
            conn.close()  # the body is still on the wire
            raise
        if n:
            conn.read_into(c.byte_view(kv))
        else:
            conn.read_body()
        self.stats.http_gets += 1
        self.stats.last_medium = "http"
        return kv, n

    def _request_http(self, method: str, path: str, payload: Any = None, params: Any = None) -> httpx.Response:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return self._http.request(method, path, json=payload, params=params)
            except httpx.TimeoutException as exc:
                raise RequestTimeout(f"{method} {path}: no answer within {self.timeout_s} s") from exc
            except httpx.TransportError as exc:
                last = exc
            if attempt < self.retries:
                self.stats.retries += 1
                time.sleep(delay * (0.5 + random.random()))
                delay *= 2
        raise ConnectionFailed(f"{self.url}: {last} (after {self.retries} retries)") from last

    def _json(self, method: str, path: str, payload: Any = None, params: Any = None) -> Any:
        resp = self._request_http(method, path, payload, params)
        if resp.status_code >= 400:
            raise error_from(resp.status_code, resp.content)
        return resp.json()

    def _pin_body(self, keys: Any, spec: KVSpec | None, tokens: Any, namespace: str | None,
                  ttl_s: float | None) -> dict:
        body: dict[str, Any] = {}
        if keys is not None:
            body["keys"] = [k.hex() if isinstance(k, bytes) else k for k in keys]
        else:
            body.update(spec=c.check_spec(spec).to_dict(), tokens=[int(t) for t in c.tokens_of(tokens)],
                        namespace=namespace or self.namespace)
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        return body


def _json_of(body: bytes) -> Any:
    return json.loads(body) if body else None
