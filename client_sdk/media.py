"""The ``Medium`` contract: one way to move KV frames between a caller and a store.

A medium moves frames (``kvstore.codec``) by key: ``get_frames`` and
``put_frames`` are the whole contract. ``get_kv``/``put_kv`` have defaults
built on them (hash the tokens, fetch the frames, decode the longest sound
prefix); a medium with a faster KV path of its own (shm slot handles, HTTP's
raw KV stream) overrides them. The planner (``kvstore.planner``) picks one
medium per transfer from measured costs.

Media, by ``name``:

- ``inproc``: an ``EmbeddedStore`` in this process; tensors pass by reference.
- ``shm``: the co-located slot path of ``KVClient`` (``client_sdk.client``).
- ``http``: streamed REST (``client_sdk._http``).
- ``flight``: Arrow Flight beside the REST app (``client_sdk.flight``).
- ``redis``: frames read straight from the shared Redis tier (``client_sdk.redis_direct``).

``codec`` on a get asks for frames in that codec (``"int8"`` halves the bytes
of an fp16 block on a slow link); None takes them as stored. A medium that
cannot transcode lists only ``None`` in ``codecs``.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import torch

from client_sdk import calls
from kvstore import codec as codec_mod
from kvstore.errors import FrameError
from kvstore.keys import BlockHash, block_hashes, block_meta, normalize_tokens
from kvstore.spec import KVSpec

__all__ = ["Medium", "RestPuts", "Throttled", "decode_prefix", "encode_blocks"]


class Medium(ABC):
    """Frames by key, over one transport, for one namespace."""

    name: ClassVar[str]
    remote: ClassVar[bool] = True
    """Whether bytes cross a socket (the planner's probe and locality use it)."""
    codecs: ClassVar[tuple[str | None, ...]] = (None,)
    """Wire codecs a get may ask for; None means "as stored"."""
    puts: ClassVar[bool] = True
    """Whether the planner may send puts this way (a read-only medium forwards them)."""
    namespace: str

    @abstractmethod
    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        """The frames of ``keys`` in order, None for each absent one.

        Raises:
            KVStoreError subclasses: the transport failed (``ConnectionFailed``, ``TierUnavailable``...).
        """

    @abstractmethod
    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        """Store ``(key, frame)`` pairs; returns how many were stored."""

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix, ``(kv [L, 2, H, n, D], n)``, from frames."""
        keys = block_hashes(spec, tokens, self.namespace)
        frames = self.get_frames(keys, codec=codec) if keys else []
        return decode_prefix(spec, frames, out)

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        """Store every full block of ``tokens``; returns tokens covered."""
        items = encode_blocks(spec, tokens, kv, self.namespace, codec)
        if items:
            self.put_frames(items)
        return len(items) * spec.block_tokens

    def probe(self, nbytes: int) -> None:
        """Move ``nbytes`` of filler the way a get would (0: one round trip), for the planner's estimates.

        The planner times it. Bounded by the policy's ``probe_bytes`` (a few MB).
        The default asks for one absent block: a round trip, no payload.
        """
        self.get_frames([BlockHash(os.urandom(32))])

    def close(self) -> None:
        """Release the transport; idempotent."""


class RestPuts(Medium):
    """A medium whose writes go through the server's REST routes over ``http`` (an
    ``HttpTransport``): frames in one batch, KV as one raw body. The HTTP medium's own
    puts, and those a read-only medium (direct Redis) forwards to the server, which keeps
    the index and the quotas."""

    http: Any

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        return self.http.run(calls.put_blocks(items))

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        stored = self.http.run(calls.put_kv_http(spec, normalize_tokens(tokens), kv))
        self.http.stats.http_puts += 1
        self.http.stats.last_medium = "http"
        return stored


def decode_prefix(spec: KVSpec, frames: Sequence[Any], out: Any = None) -> tuple[torch.Tensor, int]:
    """Decode frames block by block into one KV tensor, stopping at the first absent or bad one.

    A frame that fails to verify ends the prefix there: wrong KV is never returned.
    """
    from client_sdk._common import result_tensor  # the out= rules are the SDK's

    good = 0
    for frame in frames:
        if frame is None:
            break
        good += 1
    bt = spec.block_tokens
    kv = result_tensor(spec, good * bt, out)
    for i in range(good):
        try:
            codec_mod.decode(frames[i], out=kv[:, :, :, i * bt:(i + 1) * bt])
        except FrameError:
            good = i
            break
    if good * bt < kv.shape[3]:
        kv = kv[:, :, :, :good * bt]
    return kv, good * bt


def encode_blocks(spec: KVSpec, tokens: Any, kv: torch.Tensor, namespace: str,
                  codec: str = "raw") -> list[tuple[BlockHash, bytearray]]:
    """``(key, frame)`` for every full block of ``tokens``, framed as the store frames them."""
    toks = normalize_tokens(tokens)
    kv = spec.validate_kv(kv, min_tokens=spec.full_blocks(len(toks)) * spec.block_tokens)
    keys = block_hashes(spec, toks, namespace)
    bt, fp = spec.block_tokens, spec.fingerprint()
    return [(key, codec_mod.encode(kv[:, :, :, i * bt:(i + 1) * bt].contiguous(), codec,
                                   meta=block_meta(namespace, fp, i)))
            for i, key in enumerate(keys)]


class Throttled(Medium):
    """Any medium behind an injected link: extra latency per call and a bandwidth cap.

    How tests and ``kvstore bench planner`` model a slow or far link without
    one: the wrapped call runs, then the caller waits until ``latency_s +
    bytes / bandwidth_Bps`` has passed since it started (never less than the
    real call took).
    """

    def __init__(self, inner: Medium, *, latency_s: float = 0.0, bandwidth_Bps: float | None = None) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.remote = inner.remote  # type: ignore[misc]
        self.codecs = inner.codecs  # type: ignore[misc]
        self.puts = inner.puts  # type: ignore[misc]
        self.namespace = inner.namespace
        self.latency_s = latency_s
        self.bandwidth_Bps = bandwidth_Bps

    def _hold(self, started: float, nbytes: int) -> None:
        left = self.left_s(started, nbytes)
        if left > 0:
            time.sleep(left)

    def left_s(self, started: float, nbytes: int) -> float:
        """How long a call that started at ``started`` and moved ``nbytes`` must still wait."""
        floor = self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps else 0.0)
        return started + floor - time.perf_counter()

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        t0 = time.perf_counter()
        frames = self.inner.get_frames(keys, codec=codec)
        self._hold(t0, sum(len(memoryview(f).cast("B")) for f in frames if f is not None))
        return frames

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        t0 = time.perf_counter()
        n = self.inner.put_frames(items)
        self._hold(t0, sum(len(memoryview(f).cast("B")) for _, f in items))
        return n

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        t0 = time.perf_counter()
        kv, n = self.inner.get_kv(spec, tokens, out, codec=codec)
        wire = n * spec.bytes_per_token
        self._hold(t0, wire if codec in (None, "raw") else wire // 2)
        return kv, n

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        t0 = time.perf_counter()
        n = self.inner.put_kv(spec, tokens, kv, codec=codec)
        self._hold(t0, n * spec.bytes_per_token)
        return n

    def probe(self, nbytes: int) -> None:
        t0 = time.perf_counter()
        self.inner.probe(nbytes)
        self._hold(t0, nbytes)

    def close(self) -> None:
        self.inner.close()
