"""The media a ``KVClient`` always has: HTTP, and where offered shm; plus in-process.

``HttpMedium`` owns nothing but an ``HttpTransport``: raw KV received straight
into the result, frames by key over the block routes. HTTP can also carry int8
frames (``POST /v1/blocks/get`` with a codec: the server transcodes, the client
decodes), half the bytes on a slow link.

``ShmPath`` is a blocking client's co-located path, and the planner's ``shm``
medium: it maps the server's arena (once, and again after a server restart) and
drives ``client_sdk.colocated``'s flows over the HTTP transport; what it cannot
carry (no arena to map, frames by key to write) goes to the HTTP medium.

``InprocMedium`` is an ``EmbeddedStore`` in this process: no socket, no copy
on the way in, tensors by reference.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from client_sdk import _common as c
from client_sdk.arena import Arena
from client_sdk import calls
from client_sdk.blockwise import Place, place_flow, place_from_tensor
from client_sdk.colocated import (Colocation, blocks_exist_flow, cached_get, drive, frames_flow, get_blocks_into_flow,
                                  get_flow)
from client_sdk.colocated_puts import asking_for_slots, pooled_put_flow, put_blocks_flow, put_flow
from client_sdk.media import Medium, RestPuts
from client_sdk.transport import HttpTransport
from kvstore.errors import KVStoreError, ServiceError
from kvstore.keys import BlockHash, check_key
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["HttpMedium", "ShmPath", "InprocMedium", "side_media", "shm_probe"]


class HttpMedium(RestPuts):
    """Streamed REST over one ``HttpTransport``.

    Args:
        http: the transport (its namespace is this medium's).
        pool: where a get's result memory comes from (None: a fresh tensor each time).
    """

    name = "http"
    codecs = (None, "raw", "int8")

    def __init__(self, http: HttpTransport, pool: c.TensorPool | None = None) -> None:
        self.http = http
        self.namespace = http.namespace
        self.pool = pool

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        return self.http.run(calls.get_blocks(keys, codec))

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        if codec not in (None, "raw"):
            return super().get_kv(spec, tokens, out, codec=codec)
        return self.http.get_kv(spec, c.kv_parts(spec, c.tokens_of(tokens), None), out, self.pool)

    def probe(self, nbytes: int) -> None:
        self.http.probe(nbytes)


class ShmPath(Medium):
    """A blocking client's co-located path, and its ``shm`` medium: the server's arena, mapped on
    first use. Gets copy out of the arena; puts write into pool slots or a staging lease, and go
    to ``fallback`` when the server lends neither (or offers no arena this client can map).

    Args:
        http: the client's transport (control requests; blocks the arena lacks).
        colocation: the mapping state (``colocated`` as the client was given it).
        pool, out_views: where results land (a pooled tensor, or a view of the caller's ``out``).
        report: asks for the reads served without a request to be reported (must not block).
        fallback: the HTTP medium, for puts this path cannot carry and frames by key.
    """

    name = "shm"
    remote = False

    def __init__(self, http: HttpTransport, colocation: Colocation, pool: c.TensorPool, out_views: c.OutViews,
                 report: Callable[[], None], fallback: Medium) -> None:
        self.http = http
        self.colocation = colocation
        self.pool = pool
        self.out_views = out_views
        self.stats = http.stats
        self.namespace = http.namespace
        self.report = report
        self.fallback = fallback
        self._lock = threading.Lock()
        self._buf: memoryview | None = None

    def arena(self) -> Arena | None:
        """The mapped arena; None when the server is not on this host (or ``colocated=False``).

        Raises:
            ServiceError: ``colocated=True`` and the arena cannot be used here.
        """
        colo = self.colocation
        if colo.decided == "shm":  # the common case, first: one attribute read
            return colo.arena
        if colo.undecided:
            with self._lock:
                if colo.undecided:
                    drive(colo.pick_flow(), self.http.run)
                    arena = colo.current()
                    # pooled puts commit over the server's channel, when it offers one
                    self.http.use_channel(None if arena is None else arena.commit_socket)
        return colo.current()

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        toks = c.tokens_of(tokens)  # the client's own calls pass ids normalized already: no copy
        arena = self.arena()
        if arena is None:  # the server restarted without an arena this client can map: HTTP
            return self.http.get_kv(spec, c.kv_parts(spec, toks, None), out, self.pool)
        got = cached_get(arena, spec, toks, out, self.pool, self.out_views, self.namespace, self.stats)
        if got is not None:  # every block's slot was known here (remembered, or indexed): no request
            if arena.accesses.due():
                self.report()
            return got
        return drive(get_flow(self.colocation, arena, spec, toks, out, self.pool, self.stats), self.http.run)

    def get_kv_blocks(self, spec: KVSpec, toks: Any, first: int, place: Place) -> int:
        """``KVClient.get_kv_blocks``: from the arena when co-located, else over HTTP."""
        arena = self.arena()
        got = None if arena is None else drive(place_flow(self.colocation, arena, spec, toks, first, place,
                                                          self.namespace, self.stats, self.report), self.http.run)
        if got is None:  # no arena here (or the server restarted): a get, then its blocks placed
            kv, got = self.get_kv(spec, toks, None)
            place_from_tensor(kv[:, :, :, first * spec.block_tokens:got], spec, first, place)
        return got

    def lookup(self, spec: KVSpec, toks: Any) -> int | None:
        """Tokens of the stored prefix when every full block of ``toks`` is in the arena (found
        with no request); None when one is not (a lower tier may hold it: ask the server)."""
        arena = self.arena()
        blocks = None if arena is None else arena.blocks_for(spec, toks, self.namespace)
        return None if blocks is None else len(blocks) * spec.block_tokens

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        """A put into pool slots or a staging lease; over ``fallback`` when neither is lent here."""
        toks = c.tokens_of(tokens)
        arena = self.arena()
        got = None if arena is None or not kv.shape[3] else drive(
            put_flow(self.colocation, arena, spec, toks, kv, self.stats, self.namespace), self.http.run)
        return self.fallback.put_kv(spec, toks, kv) if got is None else got

    def put_kv_blocks(self, spec: KVSpec, toks: Any, fill: c.BlockFill) -> int | None:
        """A pooled put whose new blocks ``fill`` writes into their slots; None when the server
        lends no pool slots here (the caller fills a tensor and puts that)."""
        arena = self.arena()
        if arena is None or not arena.pooled_puts or not spec.full_blocks(len(toks)) or not asking_for_slots(arena):
            return None
        return drive(pooled_put_flow(self.colocation, arena, spec, toks, fill, self.stats, self.namespace),
                     self.http.run)

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        arena = self.arena()
        if arena is None:
            return self.http.run(calls.get_blocks(keys))
        return drive(frames_flow(arena, [check_key(k) for k in keys], self.namespace), self.http.run)

    def blocks_exist(self, keys: Sequence[BlockHash], ask_server: bool = True) -> list[bool]:
        return drive(blocks_exist_flow(self.colocation, self.arena(), keys, self.namespace, ask_server),
                     self.http.run)

    def get_blocks_into(self, keys: list[BlockHash], sink: c.BlockSink) -> list[bool]:
        return drive(get_blocks_into_flow(self.colocation, self.arena(), keys, sink, self.namespace, self.stats,
                                          self.report), self.http.run)

    def put_blocks_with(self, keys: list[BlockHash], offsets: list[int], writer: c.BlockWriter,
                        make_room: bool) -> int:
        return drive(put_blocks_flow(self.colocation, self.arena(), keys, offsets, writer, make_room, self.stats),
                     self.http.run)

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        return self.fallback.put_frames(items)  # frames are already encoded: no staging gain

    def probe(self, nbytes: int) -> None:
        arena = self.arena()  # mapped again if the server restarted
        if arena is None:
            raise ServiceError("the server no longer offers a shm arena this client can map")
        self._buf = shm_probe(arena, self._buf, nbytes)


class InprocMedium(Medium):
    """An ``EmbeddedStore`` in this process (the server's own, when the agent hosts it)."""

    name = "inproc"
    remote = False

    def __init__(self, store: Any, namespace: str = "default") -> None:
        """``store``: an ``EmbeddedStore`` (typed loosely: the SDK does not import the engine's store)."""
        self.store = store
        self.namespace = namespace
        self._buf: memoryview | None = None
        self._src: torch.Tensor | None = None

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        # The store's frames by key verify what they serve and count the read, as a server does.
        namespaces = frozenset({self.namespace})
        return [None if (got := self.store.frames.read(check_key(k), namespaces)) is None else got[0]
                for k in keys]

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        for key, frame in items:
            self.store.frames.put(key, frame, self.namespace)
        return len(items)

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        kv, n = self.store.get_kv(spec, tokens, self.namespace)
        if out is None:
            return kv, n
        dst = c.result_tensor(spec, n, out)
        dst.copy_(kv)
        return dst, n

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        return self.store.put_kv(spec, tokens, kv, self.namespace)

    def probe(self, nbytes: int) -> None:
        """An index read, then a copy of ``nbytes`` (what decoding a raw block costs here)."""
        self.store.core.entries_of([])
        if nbytes:
            src = torch.empty(nbytes, dtype=torch.uint8) if self._src is None or len(self._src) < nbytes else self._src
            self._src = src
            self._buf = _scratch(self._buf, nbytes)
            self._buf[:nbytes] = memoryview(src.numpy())[:nbytes]


def shm_probe(arena: Any, buf: memoryview | None, nbytes: int) -> memoryview | None:
    """The shm medium's probe: a read of one slot's generation (a get from remembered handles
    asks the server nothing), or a copy of ``nbytes`` out of the arena's own mapping into
    ``buf`` (reused; returned, grown if it was short)."""
    assert arena is not None
    if nbytes == 0:
        arena.reader.generation(0)
        return buf
    view = arena.reader.mapping()
    n = min(nbytes, len(view))
    buf = _scratch(buf, n)
    buf[:n] = view[:n]
    return buf


def _scratch(buf: memoryview | None, nbytes: int) -> memoryview:
    """A probe's landing buffer, reused: a fresh one would time page faults, not the medium."""
    return buf if buf is not None and len(buf) >= nbytes else memoryview(bytearray(nbytes))


def side_media(http: HttpTransport, info: dict, redis_url: str | None) -> dict[str, Medium]:
    """The media a server offers beside REST (``/v1/info`` ``media``) that this client can use.

    Flight needs pyarrow; direct Redis needs the client's own ``redis_url``. One
    that cannot be set up is left out, and the planner never sees it.
    """
    offers = info.get("media") or {}
    out: dict[str, Medium] = {}
    if offers.get("flight"):
        try:
            from client_sdk.flight import FlightMedium

            out["flight"] = FlightMedium.from_info(http.url, {"media": {"flight": offers["flight"]}}, http.token,
                                                   http.namespace, timeout_s=http.timeout_s)
        except (ImportError, KVStoreError) as exc:
            log.warning("flight offered but not usable here: %s", exc)
    if offers.get("redis") and redis_url:
        try:
            from client_sdk.redis_direct import RedisDirectMedium

            offer = offers["redis"]
            out["redis"] = RedisDirectMedium(http, redis_url, offer["keyspace"], offer.get("tier", "redis"))
        except (ImportError, KVStoreError, KeyError) as exc:
            log.warning("redis offered but not usable here: %s", exc)
    return out
