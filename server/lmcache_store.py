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
``/admin/explain`` and ``/metrics`` show them. With a shared tier (Redis), a chunk another
node put is found there, as ``/v1/blocks`` finds blocks.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from kvstore import codec as codec_mod
from kvstore.memory.buffers import BufferPool
from kvstore.errors import FrameError, TierError
from kvstore.keys import BlockHash, block_meta, name_fingerprint, named_key, validate_namespace
from kvstore.engine.store import KVStore
from kvstore.wire.lmcache import SUCCESS, LMKey, Request, server_meta

__all__ = ["LMCacheChunks", "DOMAIN"]

log = logging.getLogger("kvstore.lmcache")

DOMAIN = "lmcache"
"""Folded into every key and fingerprint, so LMCache's names never meet another system's."""
_HEAD_BYTES = 4096
"""A chunk frame's header and metadata fit well inside this (LIST reads no more)."""


class LMCacheChunks:
    """The listener's view of the store: LMCache chunks in one namespace.

    Args:
        store: the engine.
        namespace: where the chunks live.
        buffers: reused buffers, for a put that must make room before it is stored.
    """

    def __init__(self, store: KVStore, namespace: str, buffers: BufferPool) -> None:
        self.store, self.namespace, self.buffers = store, validate_namespace(namespace), buffers
        self._scope = frozenset({namespace})

    def block_key(self, key: LMKey) -> BlockHash:
        return named_key(self.namespace, DOMAIN, key.canonical())

    # -- PUT -------------------------------------------------------------------------------

    def put(self, key: LMKey, req: Request, receive: Callable[[memoryview], None]) -> None:
        """Store ``req``'s chunk, whose payload ``receive`` reads into the view it is given.

        Where a tier has room, the view is the payload's place in its frame, in the tier's
        own memory where it lends it (shm, cxl): the bytes are received once, where they
        stay. Where none has, the payload is received into a pooled buffer first, and only
        then is room made (colder entries demoted, the last tier evicting): a request whose
        bytes never come evicts nothing.

        Raises:
            whatever ``receive`` raises (nothing is stored).
            TierFull, TierError: no tier took it. The payload has been read off by then,
                so the connection stays in step.
        """
        meta = block_meta(self.namespace, name_fingerprint(DOMAIN, key.model_part()), 0,
                          lmcache={"key": key.canonical(), "fmt": req.fmt, "dtype": req.dtype,
                                   "shape": list(req.shape), "length": req.length})
        at = codec_mod.raw_payload_offset(1, len(meta))
        size = at + req.length
        received = False

        def writer(view: memoryview) -> int:
            nonlocal received
            received = True
            receive(view[at:size])
            return codec_mod.seal_raw(view, "uint8", (req.length,), meta)

        bkey = self.block_key(key)
        try:
            self.store.frames.put_with(bkey, self.namespace, size, writer)
            return
        except TierError:  # TierFull included
            if received:
                raise
        buf = self.buffers.acquire(size)  # no tier took it as it is: take the bytes, then make room
        try:
            with memoryview(buf) as view:
                n = writer(view)
                self.store.frames.put(bkey, view[:n], self.namespace, make_room=True)
        finally:
            self.buffers.release(buf)

    # -- GET, EXIST, LIST ----------------------------------------------------------------------

    def exists(self, key: LMKey) -> bool:
        return self.store.frames.block_entry(self.block_key(key), self._scope) is not None

    def get(self, key: LMKey, send: Callable[[memoryview], None]) -> bool:
        """Send the stored chunk of ``key`` (its 36-byte meta in one call, then the payload) with
        ``send``, straight from the tier's memory where it can lend it; False on a miss.

        The whole frame is checked before its first byte goes (its body once per publish of
        an arena slot: "Verified once" in docs/design.md): a damaged chunk is a miss (and
        dropped), answered like any miss, so the client's connection stays usable (LMCache
        does not reconnect one it lost).
        """
        bkey = self.block_key(key)

        def answer(view: memoryview, header: codec_mod.FrameHeader, entry: Any) -> bool:
            info = _chunk_info(view, header)
            if info.get("length") != header.payload_len:  # not a chunk LMCache put (a block put by key)
                return False
            send(memoryview(server_meta(SUCCESS, info["length"], info["fmt"], info["dtype"], tuple(info["shape"]))))
            send(view[header.payload_offset : header.frame_len])
            return True

        found = self.store.frames.read_with(bkey, self._scope, answer, tally=False)
        if found is None and self.store.frames.shared_tier is not None \
                and self.store.frames.current_entry(bkey, self._scope) is None:
            got = self.store.frames.read(bkey, self._scope)  # another node's, in the shared tier
            if got is not None:
                with memoryview(got[0]).cast("B") as view:
                    found = answer(view, codec_mod.read_header(view), got[1])
        return bool(found)

    def list_keys(self) -> list[str]:
        """The key strings of every chunk this store holds in the namespace.

        Each is read from its frame's metadata (a prefix of the frame; not a read of the
        chunk, so it warms nothing).
        """
        names = []
        for e in self.store.entries():
            if e.namespace != self.namespace:
                continue
            tier = self.store.core.tier(e.tier) if self.store.core.has_tier(e.tier) else None
            try:
                got = tier.head(e.key, _HEAD_BYTES) if tier is not None else None
                if got is None:
                    continue  # gone meanwhile
                head = memoryview(got[0]).cast("B")
                header = codec_mod.read_header(head, prefix=True)
                name = _chunk_info(head, header).get("key")
            except (FrameError, TierError) as exc:
                log.warning("LIST: block %s unreadable (%s); left out", e.key.hex(), exc)
                continue
            if isinstance(name, str):  # else not an LMCache chunk (a block put by key)
                names.append(name)
        return names


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
