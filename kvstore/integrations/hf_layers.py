"""A transformers cache that fills a layer at a time from a layer stream.

``cache_from_kv(get_kv(...))`` waits for the whole KV before the model's
first layer runs. ``cache_from_layers(stream)`` returns a ``DynamicCache``
whose layer ``l`` becomes available when the stream yields it: the model's
forward computes layer 0 while later layers are still in flight, and blocks
in layer ``l``'s ``update`` (or any read of its keys and values) only until
that layer has arrived. ::

    stream = client.get_kv_layers(spec, prompt)          # client_sdk.layers
    cache = cache_from_layers(stream, model.config)
    out = model(prompt_ids[:, stream.n_tokens:], **cache_kwargs(model, cache))

A stream is any iterable of ``(layer_index, kv_layer [2, H, n, D])`` in order
(``client_sdk.layers.LayerStream``, ``FlightMedium.get_kv_layers``); when it
carries ``n_tokens`` the prefix length is known before layer 0 arrives,
otherwise it is learnt from layer 0. By default a daemon thread drains the
stream so the transfer overlaps compute; ``background=False`` pulls it in the
model's thread, on demand.

Needs transformers >= 4.56 (``Cache.layers``); full-attention layers only, as
``kvstore.integrations.hf``.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import torch

from kvstore.errors import InvalidKV, KVStoreError

__all__ = ["LayerFeed", "cache_from_layers"]


class LayerFeed:
    """The layers of one stream, as they arrive, for whichever thread waits on them.

    Args:
        layers: ``(layer_index, kv_layer [2, H, n, D])`` in order.
        num_layers: layers the stream should yield (a miss yields none).
        n_tokens: the prefix length when known up front; else read off layer 0.
        background: drain ``layers`` in a daemon thread; False pulls in the waiting thread.
        device, dtype: where and in what dtype the cache holds each layer (default: as streamed).
    """

    def __init__(self, layers: Iterable[tuple[int, torch.Tensor]], num_layers: int, *, n_tokens: int | None = None,
                 background: bool = True, device: Any = None, dtype: torch.dtype | None = None) -> None:
        self.num_layers = num_layers
        self._n_tokens = n_tokens
        self._source = iter(layers)
        self._device, self._dtype = device, dtype
        self._got: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._error: BaseException | None = None
        self._done = self._closing = False
        self._cv = threading.Condition()
        self._pull_lock = threading.Lock()  # one puller at a time (foreground mode: any model thread)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._drain, name="kvstore-layer-feed", daemon=True)
            self._thread.start()

    @property
    def n_tokens(self) -> int:
        """Tokens of the streamed prefix (waits for layer 0 when the stream did not say up front)."""
        if self._n_tokens is None:
            self._wait_for(lambda: self._n_tokens is not None or self._done)
            if self._n_tokens is None:
                if self._error is not None:
                    raise self._error
                self._n_tokens = 0  # the stream ended before any layer: a miss
        return self._n_tokens

    def arrived(self) -> int:
        """How many layers have arrived so far."""
        return len(self._got)

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s ``(keys, values)``, each ``[1, H, n, D]``, once it has arrived; None for a miss.

        Raises:
            InvalidKV: the stream ended before this layer, or yielded layers out of order.
            Whatever the stream raised (``ConnectionFailed``, ``BlockNotFound``...).
        """
        if self.n_tokens == 0:
            return None
        self._wait_for(lambda: len(self._got) > layer or self._done)
        with self._cv:
            if len(self._got) > layer:
                return self._got[layer]
        if self._error is not None:
            raise self._error
        raise InvalidKV(f"the layer stream ended after {len(self._got)} of {self.num_layers} layers")

    def close(self) -> None:
        """Stop taking layers (the stream is closed after the one in flight)."""
        with self._cv:
            self._closing = True
        if self._thread is None and self._pull_lock.acquire(blocking=False):
            try:
                self._finish()
            finally:
                self._pull_lock.release()

    def _wait_for(self, ready: Any) -> None:
        """Until ``ready()`` (a failed or finished stream is ``_done``, which every caller counts as ready)."""
        while True:
            with self._cv:
                if self._thread is not None:
                    self._cv.wait_for(ready)
                if ready():
                    return
            with self._pull_lock:  # foreground: this thread takes the next layer itself
                self._pull_one()

    def _drain(self) -> None:
        with self._pull_lock:
            while not self._done:
                self._pull_one()

    def _pull_one(self) -> None:
        if self._done:
            return
        try:
            if self._closing:
                raise StopIteration
            layer, kv = next(self._source)
        except StopIteration:
            self._finish()
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters, who raise it
            with self._cv:
                self._error = exc
            self._finish()
            return
        if layer != len(self._got) or kv.dim() != 4 or kv.shape[0] != 2:
            with self._cv:
                self._error = InvalidKV(f"the stream yielded layer {layer} shaped {list(kv.shape)}; expected layer "
                                        f"{len(self._got)} as [2, H, n, D]")
            self._finish()
            return
        kv = kv.to(device=self._device or kv.device, dtype=self._dtype or kv.dtype)
        with self._cv:
            self._got.append((kv[0].unsqueeze(0), kv[1].unsqueeze(0)))
            if self._n_tokens is None:
                self._n_tokens = int(kv.shape[2])
            self._cv.notify_all()

    def _finish(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            try:
                close()
            except KVStoreError:  # closing a stream that already failed: its first error is the one kept
                pass
        with self._cv:
            self._done = True
            self._cv.notify_all()


def cache_from_layers(layers: Iterable[tuple[int, torch.Tensor]], config: Any = None, *,
                      num_layers: int | None = None, background: bool = True, device: Any = None,
                      dtype: torch.dtype | None = None) -> Any:
    """A ``DynamicCache`` whose layer ``l`` fills when ``layers`` yields it.

    Args:
        layers: a layer stream (``LayerStream``, or any iterable of ``(l, [2, H, n, D])`` in order).
        config: the model config: checks the layer count and that every layer is full attention.
        num_layers: default the stream's ``num_layers``, else ``config.num_hidden_layers``.
        background, device, dtype: as ``LayerFeed``.

    Raises:
        InvalidKV: the layer count is unknown or differs from the config, or the config has
            sliding-window layers.
        ImportError: transformers is older than 4.56.
    """
    text = None
    if config is not None:
        get_text = getattr(config, "get_text_config", None)
        text = get_text(decoder=True) if callable(get_text) else config
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise InvalidKV(f"the model has {sorted(kinds)} layers; only full-attention caches fit the store")
    n_layers = num_layers or getattr(layers, "num_layers", None) or getattr(text, "num_hidden_layers", None)
    if not n_layers:
        raise InvalidKV("cache_from_layers: pass num_layers (or a config) for a stream that does not say")
    if text is not None and int(text.num_hidden_layers) != int(n_layers):
        raise InvalidKV(f"the stream has {n_layers} layers, the model {text.num_hidden_layers}")
    feed = LayerFeed(layers, int(n_layers), n_tokens=getattr(layers, "n_tokens", None), background=background,
                     device=device, dtype=dtype)
    return _cache_class()(feed)


_CLASS: type | None = None


def _cache_class() -> type:
    """The cache class, built on first use so importing this module does not import transformers."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _build_classes()
    return _CLASS


def _build_classes() -> type:
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    if not hasattr(DynamicCache(), "layers"):
        raise ImportError("cache_from_layers needs transformers >= 4.56 (Cache.layers)")

    class StreamedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose past keys and values arrive from a ``LayerFeed``.

        Until they do, its length is the feed's ``n_tokens`` (so masks and
        positions come out right without waiting) and any read of ``keys`` or
        ``values`` waits for the layer.
        """

        def __init__(self, feed: LayerFeed, index: int) -> None:
            self._feed, self._index, self._pending = feed, index, True
            self._keys = self._values = None
            self._initialized = False
            super().__init__()

        def _arrive(self) -> None:
            if self._pending:
                got = self._feed.wait(self._index)
                self._pending = False
                if got is not None:
                    self._keys, self._values = got
                    self.device = got[0].device
                    self._initialized = True

        def _get_keys(self) -> Any:
            self._arrive()
            return self._keys

        def _set_keys(self, value: Any) -> None:
            self._keys = value

        def _get_values(self) -> Any:
            self._arrive()
            return self._values

        def _set_values(self, value: Any) -> None:
            self._values = value

        keys = property(_get_keys, _set_keys)
        values = property(_get_values, _set_values)

        @property
        def is_initialized(self) -> bool:  # type: ignore[override]
            # a layer on its way counts as filled: some models tell prefill from decode by it
            return self._feed.n_tokens > 0 if self._pending else self._initialized

        @is_initialized.setter
        def is_initialized(self, value: bool) -> None:
            self._initialized = value

        def get_seq_length(self) -> int:
            return self._feed.n_tokens if self._pending else super().get_seq_length()

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self._arrive()
            return super().update(key_states, value_states, *args, **kwargs)

        def reset(self) -> None:
            self._pending = False  # what was on its way is no longer wanted
            super().reset()

    class StreamedCache(DynamicCache):
        """A ``DynamicCache`` over ``StreamedLayer``s fed by one ``LayerFeed`` (``feed``)."""

        def __init__(self, feed: LayerFeed) -> None:
            Cache.__init__(self, layers=[StreamedLayer(feed, i) for i in range(feed.num_layers)])
            self.feed = feed

        def close(self) -> None:
            """Stop the feed (layers not yet arrived never will)."""
            self.feed.close()

    return StreamedCache
