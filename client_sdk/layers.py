"""Layer-wise gets: the KV of the longest stored prefix, handed over one layer at a time.

``get_kv`` returns ``[L, 2, H, n, D]`` when the last byte is in. A model needs
layer 0 first and layer ``L-1`` last, so a consumer that takes each layer
``[2, H, n, D]`` as it lands can compute layer 0 while later layers are in
flight (LMCache's layerwise mode, AttentionStore's layer-wise preloading).
``get_kv_layers`` returns a ``LayerStream``: ``n_tokens`` is known at once,
and iterating yields ``(layer, kv_layer)`` in order. ``aget_kv_layers`` is the
async client's: an ``AsyncLayerStream``, drained with ``async for``.

Over HTTP (``POST /v1/kv/get-layers``) the server sends one layer per write
and the stream receives each straight into its slice of the result. The
stream owns a connection of its own, not the calling thread's, so it may be
drained from another thread (``kvstore.integrations.hf_layers`` does) while
this thread makes other calls; the async stream's is a socket of the event
loop's, outside the transport's pool (over ``https``, which the loop's sockets
do not speak, httpx brings the answer whole and the layers are handed out of it).

Over shared memory the stream copies layer ``l`` of every block out of the
arena when layer ``l`` is asked for. Each raw frame is checked as a full get
checks it (header, body checksum, the checksum the index recorded, shape and
dtype) before layer 0 is handed over; after that a layer is a copy under the
slot's seqlock. Other frames (int8) are decoded whole up front, and blocks
not in the arena come over HTTP, as ``KVClient.get_kv`` does. A slot that
changes after layer 0 went out is fetched again by key; a block that left the
store by then raises ``BlockNotFound`` (the prefix length is already promised).
That logic is written once, as flows (``client_sdk.colocated``): ``layers_flow``
places layer 0, ``ShmLayers.layer_flow`` each layer after it; the blocking stream
drives them, the async one awaits them (copies over 1 MiB in a worker thread).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np
import torch

from client_sdk import _common as c
from client_sdk.aio_media import AsyncShmPath
from client_sdk.arena import Arena
from client_sdk._common import VERIFIED_VIEW  # the full get's verified-view slot: both paths share one check per handle
from client_sdk import calls
from client_sdk._http import AsyncConnection, BrokenConnection, Connection, Head
from client_sdk.colocated import Copy, Flow, drive, missing_flow
from client_sdk.rest_media import ShmPath
from client_sdk.transport import AsyncHttpTransport, HttpTransport, kv_answer
from kvstore.wire.rest import KV_MEDIA
from kvstore.errors import ConnectionFailed, RequestTimeout, ServiceError
from kvstore.wire.errors import error_from
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import BlockNotFound, FrameError, InvalidKV, KVStoreError
from kvstore.memory.shm import SlotHandle
from kvstore.spec import KVSpec


__all__ = ["LAYERS_PATH", "LayerStream", "AsyncLayerStream", "ShmLayers", "get_kv_layers", "aget_kv_layers",
           "iter_layers_http", "aiter_layers_http", "iter_layers_shm", "aiter_layers_shm", "layers_flow"]

LAYERS_PATH = "/v1/kv/get-layers"


class _Stream:
    """What both layer streams hold: the prefix, the result its layers land in, and how it came."""

    def __init__(self, n_tokens: int, kv: torch.Tensor, layers: Any, medium: str,
                 on_close: Callable[[], None] | None = None) -> None:
        self.n_tokens = n_tokens
        self.kv = kv
        self.medium = medium
        self._layers = self._nothing() if layers is None else layers
        self._on_close = on_close

    @staticmethod
    def _nothing() -> Any:
        return iter(())

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])


class LayerStream(_Stream):
    """The layers of one get, in order: iterate for ``(layer_index, kv_layer [2, H, n, D])``.

    A miss (``n_tokens == 0``) yields nothing. Each yielded tensor is a view of
    ``kv``, so once the stream is drained ``kv`` is what ``get_kv`` returns.
    Close it (or leave the ``with`` block) to stop early: the rest is dropped
    and the HTTP connection closed.

    Args:
        layers: the iterator of ``(layer_index, kv_layer)``; None: a miss, no layer.
        on_close: called on ``close`` (the stream's own connection).

    Attributes:
        n_tokens: tokens of the stored prefix, known before any layer arrives.
        kv: ``[L, 2, H, n_tokens, D]``; layer ``l`` holds data once it was yielded.
        medium: ``"http"`` or ``"shm"``.
    """

    def __init__(self, n_tokens: int, kv: torch.Tensor, layers: Iterator[tuple[int, torch.Tensor]] | None,
                 medium: str, on_close: Callable[[], None] | None = None) -> None:
        super().__init__(n_tokens, kv, layers, medium, on_close)

    def __iter__(self) -> "LayerStream":
        return self

    def __next__(self) -> tuple[int, torch.Tensor]:
        return next(self._layers)

    def read_all(self) -> tuple[torch.Tensor, int]:
        """Drain the rest; ``(kv, n_tokens)``, as ``get_kv`` answers."""
        for _ in self:
            pass
        return self.kv, self.n_tokens

    def close(self) -> None:
        close = getattr(self._layers, "close", None)
        if close is not None:
            close()
        if self._on_close is not None:  # a generator closed before its first step never runs its finally
            self._on_close()

    def __enter__(self) -> "LayerStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _no_layers() -> AsyncIterator[tuple[int, torch.Tensor]]:
    return
    yield  # an async generator that yields nothing


class AsyncLayerStream(_Stream):
    """``LayerStream`` on the event loop: ``async for layer, kv_layer in stream``.

    The same attributes; ``read_all`` and ``aclose`` are awaited (``async with`` closes it).
    """

    _nothing = staticmethod(_no_layers)

    def __init__(self, n_tokens: int, kv: torch.Tensor, layers: AsyncIterator[tuple[int, torch.Tensor]] | None,
                 medium: str, on_close: Callable[[], None] | None = None) -> None:
        super().__init__(n_tokens, kv, layers, medium, on_close)

    def __aiter__(self) -> "AsyncLayerStream":
        return self

    async def __anext__(self) -> tuple[int, torch.Tensor]:
        return await self._layers.__anext__()

    async def read_all(self) -> tuple[torch.Tensor, int]:
        """Drain the rest; ``(kv, n_tokens)``, as ``get_kv`` answers."""
        async for _ in self:
            pass
        return self.kv, self.n_tokens

    async def aclose(self) -> None:
        aclose = getattr(self._layers, "aclose", None)
        if aclose is not None:
            await aclose()
        if self._on_close is not None:  # as in LayerStream.close
            self._on_close()

    async def __aenter__(self) -> "AsyncLayerStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def get_kv_layers(shm: ShmPath, spec: KVSpec, tokens: Any) -> LayerStream:
    """The KV of the longest stored prefix, layer by layer, over a client's co-located path
    when it has one (the server's arena is mapped here), HTTP otherwise.

    Raises:
        InvalidSpec, InvalidTokens: bad input. Unauthorized, Forbidden, ConnectionFailed,
            RequestTimeout: as ``get_kv``. While iterating: ``ConnectionFailed`` or
            ``RequestTimeout`` (HTTP) or ``BlockNotFound`` (shm) if the rest cannot arrive.
    """
    if shm.arena() is not None:
        return iter_layers_shm(shm, spec, tokens)
    return iter_layers_http(shm.http, spec, tokens, shm.pool)


async def aget_kv_layers(shm: AsyncShmPath, spec: KVSpec, tokens: Any) -> AsyncLayerStream:
    """``get_kv_layers`` over an async client's paths, awaited."""
    if await shm.arena() is not None:
        return await aiter_layers_shm(shm, spec, tokens)
    return await aiter_layers_http(shm.http, spec, tokens, shm.pool)


# -- HTTP ------------------------------------------------------------------------------------


def iter_layers_http(http: HttpTransport, spec: KVSpec, tokens: Any, pool: c.TensorPool | None = None) -> LayerStream:
    """Layers of ``POST /v1/kv/get-layers``, each received straight into its slice of the result.

    Returns once the answer's head is in (``n_tokens`` known); the request is
    retried like any other until then, never after.

    Raises:
        As ``get_kv_layers``; ``ServiceError`` when the answer's length does not fit the spec.
    """
    spec = c.check_spec(spec)
    parts = c.kv_parts(spec, c.tokens_of(tokens), None)
    conn = Connection(http.endpoint, connect_timeout_s=http.connect_timeout_s, timeout_s=http.timeout_s)
    try:
        def once() -> Head:
            head = conn.request("POST", LAYERS_PATH, http.headers(KV_MEDIA), parts)
            if head.status != 200:
                raise error_from(head.status, conn.read_body())
            return head
        head = http.retry.run(once, http.url, http.stats)
        kv, n = kv_answer(spec, head, None, pool, conn, "get_kv_layers", http.stats)
    except BaseException:
        conn.close()
        raise
    return _http_stream(LayerStream, http, conn, head, kv, n, _receive)


async def aiter_layers_http(http: AsyncHttpTransport, spec: KVSpec, tokens: Any,
                            pool: c.TensorPool | None = None) -> AsyncLayerStream:
    """``iter_layers_http`` on the event loop: each layer received by the loop's socket calls,
    within the transport's read timeout (``RequestTimeout`` past it)."""
    spec = c.check_spec(spec)
    parts = c.kv_parts(spec, c.tokens_of(tokens), None)
    if http.endpoint.tls:  # httpx buffers the answer whole: its layers are handed out of it
        kv, n = await http.get_kv(spec, parts, None, pool, path=LAYERS_PATH, what="get_kv_layers")
        return AsyncLayerStream(n, kv, _held(kv) if n else None, "http")
    conn = AsyncConnection(http.endpoint, connect_timeout_s=http.connect_timeout_s, timeout_s=http.timeout_s)
    try:
        async def once() -> Head:
            head = await conn.request("POST", LAYERS_PATH, http.headers(KV_MEDIA), parts)
            if head.status != 200:
                raise error_from(head.status, await conn.read_body())
            return head
        head = await http.retry.arun(once, http.url, http.stats)
        kv, n = kv_answer(spec, head, None, pool, conn, "get_kv_layers", http.stats)
    except BaseException:
        conn.close()
        raise
    return _http_stream(AsyncLayerStream, http, conn, head, kv, n, _areceive)


def _http_stream(stream: type, http: Any, conn: Any, head: Head, kv: torch.Tensor, n: int,
                 receive: Callable[..., Any]) -> Any:
    """The stream of an answer whose head is in: its layers received as they are asked for."""
    http.stats.http_gets += 1
    http.stats.last_medium = "http"
    if n == 0:  # a miss: the answer is its head
        conn.close()
        return stream(0, kv, None, "http")
    return stream(n, kv, receive(conn, kv, head.keep_alive, http), "http", on_close=conn.close)


def _reads(kv: torch.Tensor, keep_alive: bool) -> Iterator[memoryview | None]:
    """Per layer, what to receive before it is handed out: its bytes of the Content-Length body;
    or, of a close-delimited answer (``read_into`` closes it after one call), all of it first."""
    for layer in range(kv.shape[0]):
        if keep_alive:
            yield c.byte_view(kv[layer])
        else:
            yield c.byte_view(kv) if layer == 0 else None


def _broke(url: str, exc: OSError) -> KVStoreError:
    if isinstance(exc, BrokenConnection):
        return ConnectionFailed(f"{url}: the layer stream broke: {exc}")
    return RequestTimeout(f"{url}: the layer stream stalled past the timeout")


def _receive(conn: Connection, kv: torch.Tensor, keep_alive: bool,
             http: HttpTransport) -> Iterator[tuple[int, torch.Tensor]]:
    try:
        for layer, view in enumerate(_reads(kv, keep_alive)):
            if view is not None:
                conn.read_into(view)
            yield layer, kv[layer]
    except (BrokenConnection, TimeoutError) as exc:
        raise _broke(http.url, exc) from exc
    finally:
        conn.close()  # a stream's own connection; one stopped early still has body on the wire


async def _areceive(conn: AsyncConnection, kv: torch.Tensor, keep_alive: bool,
                    http: AsyncHttpTransport) -> AsyncIterator[tuple[int, torch.Tensor]]:
    try:
        for layer, view in enumerate(_reads(kv, keep_alive)):
            if view is not None:  # the socket's own timeout, had it one: a stall is not waited out
                await asyncio.wait_for(conn.read_into(view), http.timeout_s)
            yield layer, kv[layer]
    except (BrokenConnection, TimeoutError) as exc:
        raise _broke(http.url, exc) from exc
    finally:
        conn.close()  # as in _receive


async def _held(kv: torch.Tensor) -> AsyncIterator[tuple[int, torch.Tensor]]:
    for layer in range(kv.shape[0]):
        yield layer, kv[layer]


# -- shared memory ---------------------------------------------------------------------------


def iter_layers_shm(shm: ShmPath, spec: KVSpec, tokens: Any) -> LayerStream:
    """Layers copied out of the co-located server's shm arena as they are asked for.

    Layer 0 is copied (and every block checked) before this returns, so the
    prefix length is settled: a block missing by then shortens the prefix as
    in ``get_kv``.

    Raises:
        ServiceError: the client does not use the shm path. Otherwise as ``get_kv_layers``.
    """
    spec = c.check_spec(spec)
    toks = c.tokens_of(tokens)
    arena = shm.arena()
    if arena is None:
        _check_uses_shm(shm)
        return iter_layers_http(shm.http, spec, toks, shm.pool)  # the server restarted without one
    got = drive(layers_flow(shm, arena, spec, toks), shm.http.run)
    if got is None:  # a restarted server's slots
        return iter_layers_http(shm.http, spec, toks, shm.pool)
    return LayerStream(got.n_tokens, got.kv, _copied(got, shm.http.run) if got.n_tokens else None, "shm")


async def aiter_layers_shm(shm: AsyncShmPath, spec: KVSpec, tokens: Any) -> AsyncLayerStream:
    """``iter_layers_shm`` over an async client's co-located path, awaited."""
    spec = c.check_spec(spec)
    toks = c.tokens_of(tokens)
    arena = await shm.arena()
    if arena is None:
        _check_uses_shm(shm)
        return await aiter_layers_http(shm.http, spec, toks, shm.pool)
    got = await shm.run(layers_flow(shm, arena, spec, toks))
    if got is None:
        return await aiter_layers_http(shm.http, spec, toks, shm.pool)
    return AsyncLayerStream(got.n_tokens, got.kv, _acopied(got, shm) if got.n_tokens else None, "shm")


def _check_uses_shm(shm: ShmPath | AsyncShmPath) -> None:
    if shm.colocation.decided == "http" or shm.colocation.colocated is False:
        raise ServiceError("iter_layers_shm: this client does not use the shm path "
                           "(remote server or colocated=False)")


def _copied(layers: "ShmLayers", run: Callable[[Any], Any]) -> Iterator[tuple[int, torch.Tensor]]:
    for layer in range(layers.kv.shape[0]):
        yield drive(layers.layer_flow(layer), run)


async def _acopied(layers: "ShmLayers", shm: AsyncShmPath) -> AsyncIterator[tuple[int, torch.Tensor]]:
    for layer in range(layers.kv.shape[0]):
        yield await shm.run(layers.layer_flow(layer))


def layers_flow(shm: ShmPath | AsyncShmPath, arena: Arena, spec: KVSpec, toks: Any) -> Flow["ShmLayers | None"]:
    """A co-located layer stream up to layer 0: every block checked and layer 0 placed (or a
    block decoded whole), what the arena lacks over HTTP. None when the server names another
    arena's slots (it restarted): the caller streams over HTTP.

    Args:
        shm: the client's co-located path (its colocation, pool, namespace, stats, report).
    """
    bt = spec.block_tokens
    cached = arena.blocks_for(spec, toks, shm.namespace)
    if cached is not None:  # every slot known here (remembered, or indexed): no request unless one went stale
        kv, sources, missing = yield Copy(spec.bytes_per_token * len(cached) * bt, _prepare, arena, cached, spec,
                                          shm.pool, shm.stats)
        if not missing:
            arena.served_from_cache(cached, bt, shm.stats)
            if arena.accesses.due():
                shm.report()
            return ShmLayers(arena, cached, spec, kv, sources, shm.stats)
        arena.handles.forget(cached)
    answer = yield calls.kv_call("/v1/kv/handles", spec, toks, None)
    c.warn_hint(shm.stats, spec, answer.get("hint"))
    if shm.colocation.changed(arena, answer.get("segment"), "segment"):
        return None
    blocks = answer["blocks"]
    arena.handles.remember(blocks)
    kv, sources, missing = yield Copy(spec.bytes_per_token * len(blocks) * bt, _prepare, arena, blocks, spec,
                                      shm.pool, shm.stats)
    good = (yield from missing_flow(blocks, missing, kv, bt, shm.stats)) if missing else len(blocks)
    shm.stats.shm_gets += 1
    shm.stats.last_medium = "shm"
    if good < len(blocks):  # rare: a block vanished; keep the result one contiguous tensor
        kv = kv[:, :, :, :good * bt].clone()
        sources = sources[:good]
    return ShmLayers(arena, blocks[:good], spec, kv, sources, shm.stats)


class ShmLayers:
    """A co-located layer stream once layer 0 is placed; ``layer_flow`` copies each layer after it.

    Args:
        arena: the arena the handles came from, read to the end even if the client has moved
            on since (a server restart).
        blocks: the prefix's blocks (the server's handle answers). sources: per block, its
            verified payload in the arena, or None when it is in place already (decoded whole).
    """

    def __init__(self, arena: Arena, blocks: list[dict], spec: KVSpec, kv: torch.Tensor, sources: _Sources,
                 stats: c.ClientStats) -> None:
        self.arena = arena
        self.blocks = blocks
        self.spec = spec
        self.kv = kv
        self.stats = stats
        self.n_tokens = len(blocks) * spec.block_tokens
        self._live = {i: src for i, src in enumerate(sources) if src is not None}
        """Block -> its source, while its layers are still copied from the arena."""
        self._ints: np.ndarray | None = None

    def layer_flow(self, layer: int) -> Flow[tuple[int, torch.Tensor]]:
        """``(layer, kv_layer)`` once every block's part of ``layer`` is in place."""
        if layer:  # layer 0 was placed with the checks
            stale = yield Copy(self.kv[layer].nbytes, self._copy, layer)
            for i in stale:
                yield from self._refetch(i, layer)
        return layer, self.kv[layer]

    def _copy(self, layer: int) -> list[int]:
        """``layer`` of every live block, each under its slot's seqlock; the blocks whose slot changed."""
        if self._ints is None:
            self._ints = int_view(self.kv)
        reader, ints = self.arena.reader, self._ints
        bt = self.spec.block_tokens
        stale = []
        for i, src in self._live.items():
            h = self.blocks[i]["handle"]
            if not reader.copy_current(h["index"], h["gen"], ints[layer, :, :, i * bt:(i + 1) * bt], src[layer]):
                stale.append(i)
        return stale

    def _refetch(self, i: int, layer: int) -> Flow[None]:
        """Layers ``layer..`` of block ``i``, whose slot changed mid-stream, fetched again by key.

        Raises:
            BlockNotFound: the block is no longer stored (or its frame fails), so the layers cannot be completed.
        """
        block = self.blocks[i]
        self.arena.handles.forget([block])
        key = block["key"]
        bt = self.spec.block_tokens
        whole = torch.empty(self.spec.kv_shape(bt), dtype=self.spec.torch_dtype)
        body = yield calls.raw_blocks([key])
        if not c.fill_from_batch(body, {key: 0}, whole, bt, {}):
            raise BlockNotFound(f"block {key} left the store while its layers streamed (at layer {layer})")
        self.kv[layer:, :, :, i * bt:(i + 1) * bt].copy_(whole[layer:])
        self.stats.shm_blocks_fetched_over_http += 1
        del self._live[i]  # its remaining layers are in place


_Sources = list["np.ndarray | None"]
"""Per block: its verified payload in the arena (copied a layer at a time), or None (already in place)."""


def _prepare(arena: Arena, blocks: list[dict], spec: KVSpec, pool: c.TensorPool,
             stats: c.ClientStats) -> tuple[torch.Tensor, _Sources, list[int]]:
    """Check every block and place layer 0 (raw frames) or the whole block (others).

    Returns:
        ``(kv, sources, missing)``: the result tensor, each block's arena source,
        and the block indexes still to fetch (no handle, stale, or a frame that failed).
    """
    bt = spec.block_tokens
    kv, ints = pool.tensor_and_ints(spec.kv_shape(len(blocks) * bt), spec.torch_dtype)
    sources: _Sources = [None] * len(blocks)
    missing = []
    for i, b in enumerate(blocks):
        cut = slice(i * bt, (i + 1) * bt)
        got = _place_first(arena, b, spec, kv[:, :, :, cut], None if ints is None else ints[:, :, :, cut], stats)
        if got is False:
            missing.append(i)
        elif got is not True:
            sources[i] = got
    return kv, sources, missing


def _place_first(arena: Arena, b: dict, spec: KVSpec, part: torch.Tensor, part_ints: np.ndarray | None,
                 stats: c.ClientStats) -> "np.ndarray | bool":
    """One block: its raw payload view with layer 0 copied, True when decoded whole, False when missing."""
    h = b.get("handle")
    if h is None:
        return False
    src = b.get(VERIFIED_VIEW)
    if src is not None:  # verified before (by this path or a full get): layer 0 under the seqlock
        if arena.reader.copy_current(h["index"], h["gen"], part_ints[0], src[0]):
            stats.shm_frames_copied += 1
            return src
        return False
    handle = SlotHandle(arena.segment, h["index"], h["offset"], h["length"], h["gen"])
    src = (arena.trusted_payload(handle, tuple(part.shape), part.dtype)
           if b.get("verified") and part_ints is not None else None)
    if src is not None:  # the server hashed this publication: layer 0 under the seqlock, no hash
        if not arena.reader.copy_current(h["index"], h["gen"], part_ints[0], src[0]):
            return False
        stats.shm_frames_trusted += 1
        b[VERIFIED_VIEW] = src
        return src
    ints = SAME_SIZE_INTS.get(part.element_size(), (None, None))[1]
    try:
        with arena.reader.lease(handle) as view:
            if view is None:  # moved or gone since the server looked
                return False
            header = codec_mod.read_header(view)
            if header.codec is not codec_mod.Codec.RAW or header.lz4 or ints is None:
                codec_mod.decode(view, out=part, expect_checksum=b.get("checksum"))
                stats.shm_frames_verified += 1
                return True
            # decode's checks without its copy: the layers are copied one by one later
            codec_mod.verify(view)
            expect = b.get("checksum")
            if expect is not None and header.body_checksum != expect:
                return False
            if header.dtype != spec.dtype or header.shape != tuple(part.shape):
                return False
            src = arena.reader.frame_array(handle, header.payload_offset, ints, header.shape)
            np.copyto(part_ints[0], src[0])  # under the lease: the range cannot be reused meanwhile
    except (FrameError, InvalidKV, KVStoreError):
        return False
    stats.shm_frames_verified += 1
    b[VERIFIED_VIEW] = src
    return src
