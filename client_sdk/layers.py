"""Layer-wise gets: the KV of the longest stored prefix, handed over one layer at a time.

``get_kv`` returns ``[L, 2, H, n, D]`` when the last byte is in. A model needs
layer 0 first and layer ``L-1`` last, so a consumer that takes each layer
``[2, H, n, D]`` as it lands can compute layer 0 while later layers are in
flight (LMCache's layerwise mode, AttentionStore's layer-wise preloading).
``get_kv_layers`` returns a ``LayerStream``: ``n_tokens`` is known at once,
and iterating yields ``(layer, kv_layer)`` in order.

Over HTTP (``POST /v1/kv/get-layers``) the server sends one layer per write
and the stream receives each straight into its slice of the result. The
stream owns a connection of its own, not the calling thread's, so it may be
drained from another thread (``kvstore.integrations.hf_layers`` does) while
this thread makes other calls.

Over shared memory the stream copies layer ``l`` of every block out of the
arena when layer ``l`` is asked for. Each raw frame is checked as a full get
checks it (header, body checksum, the checksum the index recorded, shape and
dtype) before layer 0 is handed over; after that a layer is a copy under the
slot's seqlock. Other frames (int8) are decoded whole up front, and blocks
not in the arena come over HTTP, as ``KVClient.get_kv`` does. A slot that
changes after layer 0 went out is fetched again by key; a block that left the
store by then raises ``BlockNotFound`` (the prefix length is already promised).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from client_sdk import _common as c
from client_sdk.arena import Arena
from client_sdk._common import VERIFIED_VIEW  # the full get's verified-view slot: both paths share one check per handle
from client_sdk import calls
from client_sdk._http import BrokenConnection, Connection
from client_sdk.rest_media import ShmPath
from client_sdk.transport import HttpTransport
from kvstore.wire.rest import H_TOKENS, KV_MEDIA
from kvstore.errors import ConnectionFailed, RequestTimeout, ServiceError
from kvstore.wire.errors import error_from
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import BlockNotFound, FrameError, InvalidKV, KVStoreError
from kvstore.memory.shm import SlotHandle
from kvstore.spec import KVSpec


__all__ = ["LAYERS_PATH", "LayerStream", "get_kv_layers", "iter_layers_http", "iter_layers_shm"]

LAYERS_PATH = "/v1/kv/get-layers"


class LayerStream:
    """The layers of one get, in order: iterate for ``(layer_index, kv_layer [2, H, n, D])``.

    A miss (``n_tokens == 0``) yields nothing. Each yielded tensor is a view of
    ``kv``, so once the stream is drained ``kv`` is what ``get_kv`` returns.
    Close it (or leave the ``with`` block) to stop early: the rest is dropped
    and the HTTP connection closed.

    Attributes:
        n_tokens: tokens of the stored prefix, known before any layer arrives.
        kv: ``[L, 2, H, n_tokens, D]``; layer ``l`` holds data once it was yielded.
        medium: ``"http"`` or ``"shm"``.
    """

    def __init__(self, n_tokens: int, kv: torch.Tensor, layers: Iterator[tuple[int, torch.Tensor]],
                 medium: str, on_close: Callable[[], None] | None = None) -> None:
        self.n_tokens = n_tokens
        self.kv = kv
        self.medium = medium
        self._layers = layers
        self._on_close = on_close

    @property
    def num_layers(self) -> int:
        return int(self.kv.shape[0])

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
        def once() -> Any:
            head = conn.request("POST", LAYERS_PATH, http.headers(KV_MEDIA), parts)
            if head.status != 200:
                raise error_from(head.status, conn.read_body())
            return head
        head = http.retry.run(once, http.url, http.stats)
        n = int(head.headers.get(H_TOKENS, "-1"))
        if n < 0 or head.length != spec.bytes_per_token * n:
            raise ServiceError(f"get_kv_layers answer of {head.length} bytes for {n} tokens does not match the spec")
        kv = c.result_tensor(spec, n, None, pool)
    except BaseException:
        conn.close()
        raise
    http.stats.http_gets += 1
    http.stats.last_medium = "http"
    if n == 0:  # a miss: the answer is its head
        conn.close()
        return LayerStream(0, kv, iter(()), "http")
    return LayerStream(n, kv, _receive(conn, kv, head.keep_alive, http.url), "http", on_close=conn.close)


def _receive(conn: Connection, kv: torch.Tensor, keep_alive: bool, url: str) -> Iterator[tuple[int, torch.Tensor]]:
    try:
        if not keep_alive:  # read_into closes a close-delimited connection after one call: take it whole
            conn.read_into(c.byte_view(kv))
        for layer in range(kv.shape[0]):
            if keep_alive:
                conn.read_into(c.byte_view(kv[layer]))  # exactly this layer's bytes of the Content-Length body
            yield layer, kv[layer]
    except BrokenConnection as exc:
        raise ConnectionFailed(f"{url}: the layer stream broke: {exc}") from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"{url}: the layer stream stalled past the timeout") from exc
    finally:
        conn.close()  # a stream's own connection; one stopped early still has body on the wire


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
        if shm.colocation.decided == "http" or shm.colocation.colocated is False:
            raise ServiceError("iter_layers_shm: this client does not use the shm path "
                               "(remote server or colocated=False)")
        return iter_layers_http(shm.http, spec, toks, shm.pool)  # the server restarted without one
    bt = spec.block_tokens
    cached = arena.handles.lookup(spec, toks, shm.namespace)
    if cached is not None:  # every handle remembered: no request unless one went stale
        got = _prepare(arena, cached, spec, shm.pool, shm.stats)
        if not got[2]:
            arena.served_from_cache(cached, bt, shm.stats)
            if arena.accesses.due():
                shm.report()
            return _shm_stream(shm.http, arena, cached, spec, got[0], got[1])
        arena.handles.forget(cached)
    answer = shm.http.run(calls.kv_call("/v1/kv/handles", spec, toks, None))
    if shm.colocation.changed(arena, answer.get("segment"), "segment"):  # a restarted server's slots
        return iter_layers_http(shm.http, spec, toks, shm.pool)
    blocks = answer["blocks"]
    arena.handles.remember(blocks)
    kv, sources, missing = _prepare(arena, blocks, spec, shm.pool, shm.stats)
    good = _fill_missing(shm.http, blocks, missing, kv, bt)
    shm.stats.shm_gets += 1
    shm.stats.last_medium = "shm"
    if good < len(blocks):  # rare: a block vanished; keep the result one contiguous tensor
        kv = kv[:, :, :, :good * bt].clone()
        sources = sources[:good]
    return _shm_stream(shm.http, arena, blocks[:good], spec, kv, sources)


def _fill_missing(http: HttpTransport, blocks: Sequence[dict], missing: Sequence[int], kv: torch.Tensor,
                  bt: int) -> int:
    """Fetch over HTTP the blocks the arena did not have; returns how many blocks of the prefix
    are now in ``kv`` (it stops at the first that is gone)."""
    if not missing:
        return len(blocks)
    want = {blocks[i]["key"]: i for i in missing}
    arrived = c.fill_from_batch(http.run(calls.raw_blocks(list(want))), want, kv, bt, {})
    http.stats.shm_blocks_fetched_over_http += len(arrived)
    lost = sorted(set(missing) - arrived)
    return lost[0] if lost else len(blocks)


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


def _shm_stream(http: HttpTransport, arena: Arena, blocks: list[dict], spec: KVSpec, kv: torch.Tensor,
                sources: _Sources) -> LayerStream:
    n = len(blocks) * spec.block_tokens
    return LayerStream(n, kv, _copy_layers(http, arena, blocks, spec, kv, sources) if n else iter(()), "shm")


def _copy_layers(http: HttpTransport, arena: Arena, blocks: list[dict], spec: KVSpec, kv: torch.Tensor,
                 sources: _Sources) -> Iterator[tuple[int, torch.Tensor]]:
    reader = arena.reader  # the arena the handles came from, even if the client has moved on since
    ints = int_view(kv)
    bt = spec.block_tokens
    live = {i: src for i, src in enumerate(sources) if src is not None}
    yield 0, kv[0]
    for layer in range(1, kv.shape[0]):
        for i, src in list(live.items()):
            h = blocks[i]["handle"]
            cut = slice(i * bt, (i + 1) * bt)
            if not reader.copy_current(h["index"], h["gen"], ints[layer, :, :, cut], src[layer]):
                _refetch(http, arena, blocks[i], spec, kv[layer:, :, :, cut], layer)
                del live[i]  # its remaining layers are in place
        yield layer, kv[layer]


def _refetch(http: HttpTransport, arena: Arena, block: dict, spec: KVSpec, rest: torch.Tensor,
             layer: int) -> None:
    """Layers ``layer..`` of a block whose slot changed mid-stream, fetched again by key.

    Raises:
        BlockNotFound: the block is no longer stored (or its frame fails), so the layers cannot be completed.
    """
    arena.handles.forget([block])
    key = block["key"]
    whole = torch.empty(spec.kv_shape(spec.block_tokens), dtype=spec.torch_dtype)
    body = http.run(calls.raw_blocks([key]))
    if not c.fill_from_batch(body, {key: 0}, whole, spec.block_tokens, {}):
        raise BlockNotFound(f"block {key} left the store while its layers streamed (at layer {layer})")
    rest.copy_(whole[layer:])
    http.stats.shm_blocks_fetched_over_http += 1
