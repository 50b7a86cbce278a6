"""The media a ``KVClient`` always has: HTTP, and where offered shm; plus in-process.

``HttpMedium`` and ``ShmMedium`` are thin views of one ``KVClient``: its KV
fast paths (raw KV received straight into the result; arena slot handles) are
their ``get_kv``/``put_kv``, and the block routes are their frames. HTTP can
also carry int8 frames (``POST /v1/blocks/get`` with a codec: the server
transcodes, the client decodes), half the bytes on a slow link.

``InprocMedium`` is an ``EmbeddedStore`` in this process: no socket, no copy
on the way in, tensors by reference.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Sequence

import torch

from client_sdk import _common as c
from client_sdk.media import Medium
from kvstore.errors import ServiceError
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHash, check_key
from kvstore.spec import KVSpec

if TYPE_CHECKING:
    from client_sdk.client import KVClient

log = logging.getLogger("kvstore.client")

__all__ = ["HttpMedium", "ShmMedium", "InprocMedium", "side_media", "shm_probe"]


class HttpMedium(Medium):
    """Streamed REST through one ``KVClient``'s socket path."""

    name = "http"
    codecs = (None, "raw", "int8")

    def __init__(self, client: "KVClient") -> None:
        self.client = client
        self.namespace = client.namespace

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        payload: dict[str, Any] = {"keys": [check_key(k).hex() for k in keys]}
        if codec is not None:
            payload["codec"] = codec
        return c.frames_of(self.client._send_raw("POST", "/v1/blocks/get", payload))

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        return self.client.put_blocks(items)

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        if codec not in (None, "raw"):
            return super().get_kv(spec, tokens, out, codec=codec)
        toks = c.tokens_of(tokens)
        parts = c.kv_parts(spec, toks, None)
        return self.client._retrying(lambda: self.client._get_http_once(spec, parts, out))

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        return self.client._put_http(spec, c.tokens_of(tokens), kv)

    def probe(self, nbytes: int) -> None:
        self.client._probe_http(nbytes)


class ShmMedium(Medium):
    """The co-located path: gets copy out of the server's arena, puts write into a staging lease."""

    name = "shm"
    remote = False

    def __init__(self, client: "KVClient") -> None:
        self.client = client
        self.namespace = client.namespace
        self._buf: memoryview | None = None

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        return self.client._frames_shm(keys)

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        return self.client.put_blocks(items)  # frames are already encoded: no staging gain

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        return self.client._get_shm(spec, c.tokens_of(tokens), out)

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, codec: str = "raw") -> int:
        toks = c.tokens_of(tokens)
        got = self.client._put_shm(spec, toks, kv)
        return self.client._put_http(spec, toks, kv) if got is None else got

    def probe(self, nbytes: int) -> None:
        arena = self.client._current_arena()  # mapped again if the server restarted
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
        out: list[Any] = []
        tiers = {t.name: t for t in self.store.tiers}
        for entry, key in zip(self.store.entries_of([check_key(k) for k in keys]), keys):
            frame = None
            if entry is not None and entry.namespace == self.namespace and entry.tier in tiers:
                frame = tiers[entry.tier].get(key)
            out.append(frame)
        return out

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        for key, frame in items:
            self.store.put_frame(key, frame, self.namespace)
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
        self.store.entries_of([])
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
        int(arena.reader._words[0])
        return buf
    view = arena.reader._view
    n = min(nbytes, len(view))
    buf = _scratch(buf, n)
    buf[:n] = view[:n]
    return buf


def _scratch(buf: memoryview | None, nbytes: int) -> memoryview:
    """A probe's landing buffer, reused: a fresh one would time page faults, not the medium."""
    return buf if buf is not None and len(buf) >= nbytes else memoryview(bytearray(nbytes))



def side_media(client: "KVClient", info: dict) -> dict[str, Medium]:
    """The media a server offers beside REST (``/v1/info`` ``media``) that this client can use.

    Flight needs pyarrow; direct Redis needs the client's own ``redis_url``. One
    that cannot be set up is left out, and the planner never sees it.
    """
    offers = info.get("media") or {}
    out: dict[str, Medium] = {}
    if offers.get("flight"):
        try:
            from client_sdk.flight import FlightMedium

            out["flight"] = FlightMedium.for_client(client, offers["flight"])
        except (ImportError, KVStoreError) as exc:
            log.info("flight offered but not usable here: %s", exc)
    if offers.get("redis") and client.redis_url:
        try:
            from client_sdk.redis_direct import RedisDirectMedium

            offer = offers["redis"]
            out["redis"] = RedisDirectMedium(client, client.redis_url, offer["keyspace"], offer.get("tier", "redis"))
        except (ImportError, KVStoreError, KeyError) as exc:
            log.info("redis offered but not usable here: %s", exc)
    return out
