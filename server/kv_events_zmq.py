"""KV events in vLLM's wire format: msgpack batches on a ZMQ PUB socket, for KV-aware routers.

vLLM's engines publish their prefix cache's changes this way (``vllm.distributed.kv_events``)
and routers (vLLM's, Dynamo, llm-d) subscribe to it; publishing the same lets them route to a
kvstore node unchanged. Each message is ``[topic, seq, payload]``: ``seq`` numbers the batches
from 0 (8 bytes, big-endian) and ``payload`` is a ``KVEventBatch`` in msgpack, array-like
``[ts, [event, ...]]``, each event a map tagged by ``type``:

- ``BlockStored``: ``block_hashes`` (our block keys, 32 bytes each: consecutive blocks of one
  chain in one medium go in one event), ``parent_block_hash`` (the chain's previous block, when
  known), ``token_ids`` (the blocks' tokens, concatenated), ``block_size`` (tokens per block: from
  the tokens, else as last seen for the block's spec; 0 when never seen, e.g. a block recovered at
  start), ``lora_id``/``lora_name`` None, ``medium``.
- ``BlockRemoved``: ``block_hashes``, ``medium``.
- Blocks an engine named (``POST /v1/blocks/names``: the vLLM connector sends vLLM's own block
  hashes for the blocks it saved) are announced again under the engine's name once named: a
  ``BlockStored`` whose ``block_hashes`` and ``parent_block_hash`` are the engine's, with
  ``token_ids`` when kept and kvstore's keys beside them in ``kvstore_keys`` (a field vLLM's
  decoder skips). So a router that indexes the engine's own events (vLLM's, llm-d's indexer,
  Dynamo's) finds kvstore's copy under the hashes it already knows. Such a block's moves and
  removals name it both ways: its ``BlockRemoved`` lists the key and the engine's hash.
- ``AllBlocksCleared``: sent when the publisher closes (the store's index goes with the process;
  blocks a restart recovers are published again as stored).

Media are vLLM's: a device tier is ``GPU``; shm, cxl and memory are ``CPU``; nvme and redis are
``STORAGE``. A move between media is ``BlockRemoved`` (the old) then ``BlockStored`` (the new,
with no token ids); a move within one medium is nothing to a router and is not sent.

One thread reads the store's event log by cursor (``EventLog.wait``/``read``), like any
subscriber, so publishing never slows a put. It batches up to ``max_batch`` events, and an
event waits at most ``window_s`` for company. The log is the only queue: a publisher that falls
more than the ring behind skips what it lost, logs a warning and counts it (``on_lost``); vLLM's
format has no resync marker, so a router that needs exactness uses ``GET /v1/events`` and its
snapshot. With ``replay_endpoint`` a ROUTER socket serves vLLM's replay protocol from a bounded
buffer of recent batches: a request ``[b"", start_seq]`` (a REQ or DEALER client) gets every
kept batch numbered from ``start_seq`` on as ``[b"", topic, seq, payload]``, then
``[b"", b"", -1, b""]``.

The ZMQ sockets have no authentication, and ``token_ids`` are prompt tokens of every tenant:
bind them where only the routers reach.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable, Sequence

import msgpack
import numpy as np
import zmq

from kvstore.errors import InvalidInput
from kvstore.engine.events import CLEARED, MOVED, REMOVED, STORED, Event, EventLog

__all__ = ["KVEventsPublisher", "MEDIA", "tier_media", "vllm_events"]

log = logging.getLogger("kvstore.server")

MEDIA = {"device": "GPU", "shm": "CPU", "cxl": "CPU", "memory": "CPU", "nvme": "STORAGE", "redis": "STORAGE"}
"""vLLM's medium of each tier kind."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay, as vLLM's publisher sends it."""


def tier_media(tiers: Iterable[Any]) -> dict[str, str | None]:
    """Tier name -> vLLM medium (None for a kind vLLM has no name for)."""
    return {t.name: MEDIA.get(getattr(t, "kind", None) or t.stats().kind) for t in tiers}


def vllm_events(events: Sequence[Event], media: dict[str, str | None], block_sizes: dict[str, int]) -> list[dict]:
    """``events`` as vLLM's tagged event maps, in order.

    Args:
        events: from the store's log.
        media: tier name -> medium (``tier_media``).
        block_sizes: spec fingerprint -> tokens per block; learned here from stored events that
            carry tokens, read for blocks that do not.
    """
    out: list[dict] = []
    for ev in events:
        if ev.kind == STORED:
            if ev.reason == "named":  # the engine's name for a stored block: announced under that name
                _stored(out, ev.engine_hash, ev.engine_parent, ev.tokens, ev.spec_fp, media.get(ev.tier or ""),
                        block_sizes, ev.key)
            else:
                _stored(out, ev.key, ev.parent, ev.tokens, ev.spec_fp, media.get(ev.tier or ""), block_sizes)
        elif ev.kind == REMOVED:
            _removed(out, ev.key, media.get(ev.tier or ""), ev.engine_hash)
        elif ev.kind == MOVED:
            src, dst = media.get(ev.src or ""), media.get(ev.tier or "")
            if src != dst:
                _removed(out, ev.key, src, ev.engine_hash)
                _stored(out, ev.key, None, None, ev.spec_fp, dst, block_sizes)
                if ev.engine_hash is not None:
                    _stored(out, ev.engine_hash, None, None, ev.spec_fp, dst, block_sizes, ev.key)
        elif ev.kind == CLEARED:
            out.append({"type": "AllBlocksCleared"})
    return out


def _stored(out: list[dict], key: Any, parent: Any, tokens: bytes | None, spec_fp: str | None,
            medium: str | None, block_sizes: dict[str, int], ours: bytes | None = None) -> None:
    """Append a BlockStored for ``key`` (or extend the last one, the chain's previous block's).
    ``ours``: kvstore's key, where ``key`` is the engine's name for the block (``kvstore_keys``)."""
    token_ids = np.frombuffer(tokens, "<u4").tolist() if tokens else []
    if token_ids:
        size = len(token_ids)
        if spec_fp is not None and block_sizes.get(spec_fp) != size and len(block_sizes) < 4096:
            block_sizes[spec_fp] = size  # bounded: specs are few; past that, sizes come from tokens only
    else:
        size = block_sizes.get(spec_fp or "", 0)
    last = out[-1] if out else None
    if (last is not None and last["type"] == "BlockStored" and parent is not None and last["block_hashes"][-1] == parent
            and last["medium"] == medium and last["block_size"] == size and bool(last["token_ids"]) == bool(token_ids)
            and ("kvstore_keys" in last) == (ours is not None)):
        last["block_hashes"].append(key)  # the next block of the same chain: one event, as vLLM sends
        last["token_ids"].extend(token_ids)
        if ours is not None:
            last["kvstore_keys"].append(ours)
        return
    ev = {"type": "BlockStored", "block_hashes": [key], "parent_block_hash": parent, "token_ids": token_ids,
          "block_size": size, "lora_id": None, "medium": medium, "lora_name": None}
    if ours is not None:
        ev["kvstore_keys"] = [ours]  # not vLLM's field: its decoder skips it; our own subscribers read it
    out.append(ev)


def _removed(out: list[dict], key: Any, medium: str | None, engine_hash: Any = None) -> None:
    """Append ``key`` (and the engine's name for it, when named) to a BlockRemoved of ``medium``."""
    names = [key] if engine_hash is None else [key, engine_hash]
    last = out[-1] if out else None
    if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
        last["block_hashes"].extend(names)
        return
    out.append({"type": "BlockRemoved", "block_hashes": names, "medium": medium})


class KVEventsPublisher:
    """Publishes a store's events in vLLM's format from a thread of its own.

    Args:
        events: the store's event log (set its ``keep_tokens`` for token ids in BlockStored).
        media: tier name -> medium (``tier_media``).
        endpoint: the PUB socket's address, bound (``tcp://*:5557``, ``ipc://...``).
        topic: every message's first frame.
        replay_endpoint: a ROUTER address serving vLLM's replay protocol, or None.
        max_batch: events per message at most.
        window_s: how long the first event of a batch waits for company.
        replay_batches, replay_bytes: the replay buffer's bounds (batches, payload bytes).
        on_lost: called with the number of events lost each time the publisher falls behind.

    Raises:
        InvalidInput: an endpoint cannot be bound.
    """

    def __init__(self, events: EventLog, media: dict[str, str | None], endpoint: str, *, topic: str = "",
                 replay_endpoint: str | None = None, max_batch: int = 256, window_s: float = 0.005,
                 replay_batches: int = 10_000, replay_bytes: int = 64 << 20,
                 on_lost: Callable[[int], None] | None = None) -> None:
        self.events, self.media = events, media
        self.topic = topic.encode()
        self.max_batch, self.window_s = max_batch, window_s
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self.on_lost = on_lost
        self.published = 0
        """Batches sent (the next batch's sequence number)."""
        self._block_sizes: dict[str, int] = {}
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._bind(zmq.PUB, endpoint, "KVSTORE_KV_EVENTS_ENDPOINT")
            if replay_endpoint:
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, "KVSTORE_KV_EVENTS_REPLAY_ENDPOINT")
        except BaseException:
            self._close_sockets(0)
            raise
        self._stop = threading.Event()
        # From the log's first event: blocks recovered at start are published too, while the ring holds them.
        self._cursor = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, setting: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if kind == zmq.PUB:
            sock.set_hwm(100_000)  # vLLM's: a slow router drops messages, it never blocks the publisher
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise InvalidInput(f"{setting}: cannot bind {endpoint!r}: {exc}") from exc
        return sock

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is left and ``AllBlocksCleared``, stop the thread and close the sockets."""
        self._stop.set()
        self._thread.join(timeout_s)
        self._close_sockets(int(timeout_s * 1000 / 4))  # a moment for the last batch to leave

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._ctx.term()

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._serve_replay()
                if not self.events.wait(self._cursor, 0.05):
                    continue
                if self.events.last_seq - self._cursor < self.max_batch:
                    self._stop.wait(self.window_s)
                self._drain(once=True)
            self._drain(once=False)
            self._send([{"type": "AllBlocksCleared"}])
        except Exception:  # noqa: BLE001 - the publisher must say why it stopped, not vanish
            log.exception("kvstore: the KV events publisher failed; routers get no more events from this node")

    def _drain(self, *, once: bool) -> None:
        """Publish the events after the cursor: one batch, or all there are."""
        while self.events.last_seq > self._cursor:
            batch, lost = self.events.read(self._cursor, self.max_batch)
            if lost:
                n = batch[0].seq - self._cursor - 1
                log.warning("kvstore: the KV events publisher fell %d events behind the ring (KVSTORE_EVENT_QUEUE="
                            "%d) and skipped them: its routers miss those changes", n, self.events.capacity)
                if self.on_lost is not None:
                    self.on_lost(n)
            self._cursor = batch[-1].seq
            out = vllm_events(batch, self.media, self._block_sizes)
            if out:
                self._send(out)
            if once:
                return

    def _send(self, out: list[dict]) -> None:
        assert self._pub is not None
        seq = self.published
        payload = msgpack.packb([time.time(), out], use_bin_type=True)
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            log.exception("kvstore: publishing KV events batch %d failed", seq)
        self.published += 1
        self._buffer.append((seq, payload))
        self._buffered += len(payload)
        while self._buffer and (len(self._buffer) > self.replay_batches or self._buffered > self.replay_bytes):
            self._buffered -= len(self._buffer.popleft()[1])

    def _serve_replay(self) -> None:
        """Answer every replay request waiting (vLLM's protocol; see the module's docstring)."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kvstore: ignored a KV events replay request of %d frames", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
