"""LMCache chunks as kvstore entries: their keys, their frames, and the store calls the listener makes.

One LMCache key string names one entry in one namespace (``KVSTORE_LMCACHE_NAMESPACE``,
default ``lmcache``): block key ``named_key(namespace, "lmcache", canonical key)``. The
chunk's bytes are a raw uint8 frame, and LMCache's shape, dtype code, memory format
and key string ride in the frame's metadata, so a GET answers exactly what the PUT
sent, after a restart too (durable tiers are re-indexed from that metadata).

The entry's spec fingerprint is ``name_fingerprint("lmcache", model@world_size@worker_id@dtype)``:
``/admin/evict`` by fingerprint takes one model's chunks (one worker's shard). A uint8
frame is never quantized, so a demotion into an int8 tier keeps it exact. Otherwise the
entries are like any other: placement moves and evicts them, pins hold them, and
``/admin/explain`` and ``/metrics`` show them.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

from kvstore import codec as codec_mod
from kvstore.errors import FrameError, TierError
from kvstore.keys import BlockHash, block_meta, name_fingerprint, named_key, validate_namespace
from kvstore.store import KVStore
from server import engine
from server.lmcache_protocol import SUCCESS, LMKey, Request, server_meta

__all__ = ["LMCacheChunks", "DOMAIN"]

log = logging.getLogger("kvstore.lmcache")

_SEND_PIECE_BYTES = 1 << 20
"""A GET's payload is hashed and sent a piece at a time: the piece is still in cache when sent."""

DOMAIN = "lmcache"
"""Folded into every key and fingerprint, so LMCache's names never meet another system's."""


class LMCacheChunks:
    """The listener's view of the store: LMCache chunks in one namespace.

    Args:
        store: the engine.
        namespace: where the chunks live.
    """

    def __init__(self, store: KVStore, namespace: str) -> None:
        self.store, self.namespace = store, validate_namespace(namespace)
        self._scope = frozenset({namespace})
        self._names: dict[bytes, str] = {}
        """Block key -> LMCache key string, for LIST: learnt from puts, and from frames for
        entries found at start (read once, when first listed)."""
        self._names_lock = threading.Lock()

    def block_key(self, key: LMKey) -> BlockHash:
        return named_key(self.namespace, DOMAIN, key.canonical())

    # -- PUT -------------------------------------------------------------------------------

    def put(self, key: LMKey, req: Request, receive: Callable[[memoryview], None]) -> None:
        """Store ``req``'s chunk, whose payload ``receive`` reads into the view it is given.

        The view is the payload's place in the frame, in the tier's own memory where the
        tier lends it (shm, cxl): the bytes are received once, where they stay. Room is made
        as ``put_kv`` makes it: colder entries are demoted, and the last tier evicts.

        Raises:
            whatever ``receive`` raises (nothing is stored).
            TierFull, TierError: no tier took it. ``receive`` may not have run then: the
                caller must then read the payload off the connection itself.
        """
        meta = block_meta(self.namespace, name_fingerprint(DOMAIN, key.model_part()), 0,
                          lmcache={"key": key.canonical(), "fmt": req.fmt, "dtype": req.dtype,
                                   "shape": list(req.shape), "length": req.length})
        at = codec_mod.raw_payload_offset(1, len(meta))

        def writer(view: memoryview) -> int:
            receive(view[at : at + req.length])
            return codec_mod.seal_raw(view, "uint8", (req.length,), meta)

        bkey = self.block_key(key)
        self.store.put_frame_with(bkey, self.namespace, at + req.length, writer)
        with self._names_lock:
            self._names[bkey] = key.canonical()


    # -- GET, EXIST, LIST ----------------------------------------------------------------------

    def exists(self, key: LMKey) -> bool:
        return engine.current_entry(self.store, self.block_key(key), self._scope) is not None

    def get(self, key: LMKey, send: Callable[[memoryview], None]) -> bool:
        """Send the stored chunk of ``key`` (its 36-byte meta in one call, then the payload) with
        ``send``, straight from the tier's memory where it can lend it; False on a miss.

        The payload is checked as it goes out (``codec.stream_payload``): its last piece is
        sent only once the whole checksum matched, so a damaged chunk never arrives whole.

        Raises:
            CorruptFrame: the chunk turned out damaged part-way (it is dropped): close the
                connection, so the client sees a short read.
        """
        bkey = self.block_key(key)

        def answer(view: memoryview, header: codec_mod.FrameHeader, entry: Any) -> bool:
            info = _chunk_info(view, header)
            if info.get("length") != header.payload_len:  # not a chunk LMCache put (a block put by key)
                return False
            send(memoryview(server_meta(SUCCESS, info["length"], info["fmt"], info["dtype"], tuple(info["shape"]))))
            for piece in codec_mod.stream_payload(view, header, _SEND_PIECE_BYTES):
                send(piece)
            return True

        return bool(engine.read_frame_with(self.store, bkey, self._scope, answer, verify=False))

    def list_keys(self) -> list[str]:
        """The key strings of every chunk stored in the namespace."""
        entries = [e for e in self.store.entries() if e.namespace == self.namespace]
        names = []
        for e in entries:
            with self._names_lock:
                name = self._names.get(e.key)
            if name is None:
                name = self._name_from_frame(e.key)
                if name is None:
                    continue  # not an LMCache chunk (a block put by key), or gone meanwhile
                with self._names_lock:
                    self._names[e.key] = name
            names.append(name)
        live = {e.key for e in entries}
        with self._names_lock:  # forget what was evicted or deleted
            for k in [k for k in self._names if k not in live]:
                del self._names[k]
        return names

    def _name_from_frame(self, bkey: BlockHash) -> str | None:
        def name(view: memoryview, header: codec_mod.FrameHeader, entry: Any) -> str:
            return _chunk_info(view, header).get("key", "")

        try:
            got = engine.read_frame_with(self.store, bkey, self._scope, name)
        except (FrameError, TierError):
            return None
        return got or None


def _chunk_info(view: memoryview, header: codec_mod.FrameHeader) -> dict[str, Any]:
    """The LMCache description a chunk's frame carries (empty for other frames)."""
    try:
        meta = json.loads(bytes(view[header.meta_offset : header.meta_offset + header.meta_len]))
        info = meta["lmcache"]
        if not isinstance(info, dict):
            return {}
        return info
    except (ValueError, KeyError, TypeError):
        return {}
