"""The Redis tier: frames in a Redis server or Redis Cluster, shared by every kvstore using it.

A frame is a manifest key plus its chunks, all on one cluster slot; accounting (bytes
used, entries) lives in Redis, so all users of a keyspace see the same numbers. The key
layout and the scripts that publish, delete and reserve atomically are in ``redis_lua``.

Never torn: a writer stages chunks under a fresh version and one Lua script publishes
them; a delete is one script. Reads take the manifest and chunks inside MULTI/EXEC; a
frame read in two transactions is kept only if both saw the same version.

Copies: writes send the caller's memory as it is (no packing copy); reads land each
chunk straight from the socket in one buffer, the caller's for ``get_into``. The
layout and the read path live in ``kvstore.wire.redis``, which the SDK's ``redis``
medium reads with too.

URLs: ``redis://``, ``rediss://``, ``unix://`` name one server (redis-py's form);
``redis+cluster://host:port`` (or ``rediss+cluster://``) a cluster, through any node.
Needs Redis >= 7.0 (script flags) and ``maxmemory-policy noeviction`` (the default): an
evicting Redis would drop chunks and accounting behind the tier's back. Out-of-memory
replies become ``TierFull``.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Sequence

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (ClusterDownError, NoScriptError, OutOfMemoryError, RedisClusterException, RedisError,
                              ResponseError, TryAgainError)

from kvstore.errors import (InvalidInput, StoreClosed, TierError, TierFull, TierIOError,
                            TierUnavailable)
from kvstore.keys import BlockHash, check_key
from kvstore.tier import Buffer, FrameWriter, Tier, TierCounters, TierStats
from kvstore.wire.redis import KEYSPACE, Read, connect_options, frame_key, frame_of, read_frames, redact, writable
from tiers.redis_lua import DELETE, PUBLISH, RESERVE

__all__ = ["RedisTier", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20
"""A frame of at least twice this size travels as ``len // CHUNK_BYTES`` pipelined values.

Measured on the 2-core dev VM (loopback, redis-py 8.1 + hiredis, redis 7.0), GB/s put/get,
medians, raw = redis-py SET/GET of one value in the same run. Chunk sweep (interleaved,
get = get_into), 32 MiB frame, 30 repeats: raw 0.46/0.60; chunks of 256 KiB 2.06/1.99,
512 KiB 2.37/2.32, 1 MiB 2.49/2.41, 2 MiB 2.42/2.43, 4 MiB 1.86/2.25. 1 MiB frame, 300
repeats: raw 0.81/1.37; one value 3.53/3.60, 2 x 512 KiB 2.07/4.17, 4 x 256 KiB 1.67/3.17.
1 MiB ties 2 MiB on big frames and keeps a 1 MiB frame one value. ``kvstore bench tiers
--tiers redis``: 32 MiB 3.29/3.18 vs raw 0.42/0.65; 1 MiB 2.29/2.69 vs raw 0.57/2.23.
One 32 MiB value is slow mostly because glibc maps fresh pages for every buffer that
big: with MALLOC_MMAP_THRESHOLD_=256MiB raw moved 1.38/1.54.
"""

_COPY_BELOW_BYTES = 6000  # redis-py sends each view with its own syscall; below this a copy is cheaper
_STAGE_TTL_MS = 60_000  # a staged chunk outlives any live writer, not a dead one
_CAS_TRIES = 8  # cluster publishes lost to concurrent writers before giving up
_HEX_KEY = re.compile(r"^[0-9a-f]{64}$")
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError,
                RedisClusterException)
_UNAVAILABLE_REPLIES = ("LOADING", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN")  # as Wire sees them


def _byte_view(frame: Buffer) -> memoryview:
    view = memoryview(frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    try:
        return view.cast("B")
    except TypeError:  # not C-contiguous: one copy
        return memoryview(view.tobytes())


@dataclass(slots=True)
class _Write:
    """One frame on its way in: its staged chunks and the manifest that publishes them."""

    mkey: str
    manifest: str
    length: int
    chunks: list[memoryview]
    staged: list[str]


class RedisTier(Tier):
    """Frames in Redis under ``keyspace``, bounded by ``capacity_bytes`` of frame data."""

    shared = True
    shared_writers = True  # every kvstore on this Redis and keyspace writes here too

    def __init__(self, url: str, capacity_bytes: int, *, name: str = "redis",
                 keyspace: str = "default", chunk_bytes: int = CHUNK_BYTES,
                 socket_timeout_s: float = 2.0, connect_timeout_s: float = 1.0) -> None:
        """Set up the tier. Redis may be down: the tier connects when first used.

        Args:
            url: ``redis://host:port/db`` for one server, ``redis+cluster://host:port`` for a
                cluster (``rediss`` for TLS).
            capacity_bytes: the frame bytes this keyspace may hold, shared by all its users.
            keyspace: tiers on the same Redis and keyspace see the same frames.
            chunk_bytes: frames of twice this or more go as values of 1-2x this size.
            socket_timeout_s, connect_timeout_s: how long a hung or dead Redis can stall a call.

        Raises:
            InvalidInput: a bad URL scheme, keyspace or size.
        """
        for what, value in (("capacity_bytes", capacity_bytes), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidInput(f"{what} must be a positive int, got {value!r}")
        if not isinstance(keyspace, str) or not KEYSPACE.fullmatch(keyspace):
            raise InvalidInput(f"keyspace must be 1-128 characters of [A-Za-z0-9._-], got {keyspace!r}")
        self._cluster, self._url, self._options = connect_options(url, socket_timeout_s, connect_timeout_s)
        self.name, self.capacity_bytes = name, capacity_bytes
        self.keyspace, self.chunk_bytes = keyspace, chunk_bytes
        self._shown_url = redact(url)
        self._prefix = f"kv:{keyspace}:"
        self._acct = f"kv:{{{keyspace}}}:acct"
        self._client: Any = None
        self._lock = threading.Lock()  # guards _client, _closed, _counters, _last
        self._closed = False
        self._counters = TierCounters()
        self._last = (0, 0)  # entries, used_bytes at the last stats() that reached Redis
        # A lone get first asks for as many chunks as the last frame read had: a store's
        # frames tend to be alike, a GET of an absent chunk costs little, a second
        # transaction a round trip. (Batches ask for one: misses would multiply.)
        self._read_hint = 1
        self._staging = threading.local()  # put_with's buffer, one per thread
        self.durable = self._aof_everywhere()

    # -- the contract -------------------------------------------------------------------

    def put(self, key: BlockHash, frame: Buffer) -> None:
        """Store ``frame`` under ``key``, replacing any older frame.

        Raises:
            InvalidKey: ``key`` is not 32 bytes.
            TierFull: over ``capacity_bytes``, or Redis is out of memory; nothing changed.
            TierUnavailable: Redis is down or unreachable.
            TierIOError: Redis answered with an unexpected error.
        """
        self.put_many([(key, frame)])

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> None:
        """Store frames in order, pipelined (one round trip standalone).

        Raises: as ``put``; the frames before the one that failed stay stored, later ones not.
        """
        writes = [self._write(check_key(key), frame) for key, frame in items]
        if writes:
            with self._redis("put") as r:
                if self._cluster:
                    for write in writes:
                        self._publish_cas(r, write)
                else:
                    self._publish_atomic(r, writes)

    def put_with(self, key: BlockHash, size: int, writer: FrameWriter) -> int:
        """Store what ``writer`` writes into a per-thread buffer reused across puts.

        Redis keeps its own copy once ``put`` returns, so the buffer can be; a fresh one
        per put would cost an allocation and, for big frames, fresh pages each time.

        Returns:
            The stored frame's length.
        """
        buf = getattr(self._staging, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._staging.buf = bytearray(size)
        with memoryview(buf) as view:
            n = writer(view[:size])
            self.put(key, view[:n])
        return n

    def get(self, key: BlockHash) -> Buffer | None:
        """The frame under ``key`` in a fresh ``bytearray`` (the caller's alone), or ``None``.

        Raises: InvalidKey, TierUnavailable, TierIOError.
        """
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockHash]) -> list[Buffer | None]:
        """Frames for ``keys`` in order (each a fresh ``bytearray``), ``None`` for each miss.

        Raises: InvalidKey, TierUnavailable, TierIOError.
        """
        reads = [Read(self._mkey(check_key(key))) for key in keys]
        with self._redis("get") as r:
            self._read(r, reads)
        frames = [read.result() for read in reads]
        hits = sum(frame is not None for frame in frames)
        self._count(gets=len(frames), hits=hits, misses=len(frames) - hits)
        return frames  # type: ignore[return-value]

    def get_into(self, key: BlockHash, out: Buffer) -> int | None:
        """Land the frame under ``key`` in ``out``, straight from the socket (no staging copy).

        Returns:
            The frame's length, or ``None`` when absent.

        Raises:
            InvalidInput: ``out`` is read-only, not contiguous, or shorter than the frame.
            InvalidKey, TierUnavailable, TierIOError.
        """
        read = Read(self._mkey(check_key(key)), out=writable(out))
        with self._redis("get") as r:
            self._read(r, [read])
        length = read.result()
        self._count(gets=1, hits=int(length is not None), misses=int(length is None))
        return length  # type: ignore[return-value]

    def delete(self, key: BlockHash) -> bool:
        """Remove ``key``; ``True`` when something was removed.

        Raises: InvalidKey, TierUnavailable, TierIOError.
        """
        return self.delete_many([key]) == 1

    def delete_many(self, keys: Iterable[BlockHash]) -> int:
        """Remove ``keys`` (one script standalone); returns how many were stored.

        Raises: InvalidKey, TierUnavailable, TierIOError.
        """
        mkeys = [self._mkey(check_key(key)) for key in keys]
        if not mkeys:
            return 0
        with self._redis("delete") as r:
            if self._cluster:
                removed = sum(self._delete_cas(r, mkey) for mkey in mkeys)
            else:
                lengths = DELETE(r, [self._acct, *mkeys], "acct")
                removed = sum(length >= 0 for length in lengths)
        self._count(deletes=removed)
        return removed

    def contains(self, key: BlockHash) -> bool:
        """Whether ``key`` is stored. Raises: InvalidKey, TierUnavailable, TierIOError."""
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each key is stored, in one pipeline. Raises: as ``contains``."""
        mkeys = [self._mkey(check_key(key)) for key in keys]
        with self._redis("contains") as r:
            pipe = r.pipeline(transaction=False)
            for mkey in mkeys:
                pipe.exists(mkey)
            return [bool(n) for n in pipe.execute()]

    def keys(self) -> Iterator[BlockHash]:
        """This keyspace's keys: a SCAN snapshot (of every master, in a cluster).

        Raises: TierUnavailable, TierIOError.
        """
        start = len(self._prefix) + 1
        with self._redis("keys") as r:
            found = set(r.scan_iter(match=f"{self._prefix}{{*}}", count=1000))
        hexes = [name[start:-1].decode("ascii", "replace") for name in found]
        return iter([BlockHash(bytes.fromhex(h)) for h in hexes if _HEX_KEY.fullmatch(h)])

    def stats(self) -> TierStats:
        """Occupancy as Redis counts it; while Redis is down, the last figures seen.

        ``details["connected"]`` says which. Raises: StoreClosed after ``close()``.
        """
        details = {"url": self._shown_url, "mode": "cluster" if self._cluster else "standalone",
                   "keyspace": self.keyspace, "chunk_bytes": str(self.chunk_bytes),
                   "persistence": "aof on every master" if self.durable else "no aof seen"}
        try:
            with self._redis("stats") as r:
                entries, used = r.hmget(self._acct, "entries", "used")
            with self._lock:
                self._last = (int(entries or 0), int(used or 0))
            details["connected"] = "yes"
        except TierError as exc:
            details.update(connected="no", error=str(exc))
        with self._lock:
            (entries, used), counters = self._last, replace(self._counters)
        return TierStats(name=self.name, kind="redis", entries=entries, used_bytes=used,
                         capacity_bytes=self.capacity_bytes, durable=self.durable,
                         shared=self.shared, counters=counters, details=details)

    def close(self) -> None:
        """Drop the connections. Idempotent; later calls raise ``StoreClosed``."""
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            client.close()

    # -- writing ------------------------------------------------------------------------

    def _write(self, key: BlockHash, frame: Buffer) -> _Write:
        view, version = _byte_view(frame), os.urandom(8).hex()
        # len // chunk_bytes near-equal chunks of 1-2x chunk_bytes: a frame just over a
        # power of two (a payload plus its codec header) stays one value, not one plus a sliver.
        step = -(-len(view) // max(1, len(view) // self.chunk_bytes)) or 1
        chunks = [view[i:i + step] for i in range(0, len(view), step)]  # views: no copy
        if len(view) <= _COPY_BELOW_BYTES:  # one small send beats a syscall per view
            chunks = [chunk.tobytes() for chunk in chunks]
        mkey = self._mkey(key)
        staged = [f"{mkey}:s:{version}:{i}" for i in range(len(chunks))]
        return _Write(mkey, f"{version}:{len(chunks)}:{len(view)}", len(view), chunks, staged)

    @staticmethod
    def _stage(pipe: Any, write: _Write) -> None:
        for name, chunk in zip(write.staged, write.chunks):
            pipe.set(name, chunk, px=_STAGE_TTL_MS)

    def _publish_atomic(self, r: Any, writes: list[_Write]) -> None:
        """Standalone: stage every chunk and publish, with accounting, in one round trip."""
        pipe = r.pipeline(transaction=False)
        keys, args = [self._acct], ["acct", self.capacity_bytes]
        for write in writes:
            self._stage(pipe, write)
            keys += [write.mkey, *write.staged]
            args += [write.manifest, len(write.staged), write.length]
        pipe.evalsha(PUBLISH.sha, len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        result = replies[-1]
        if isinstance(result, NoScriptError):  # the staged chunks are in: publish them
            result = replies[-1] = PUBLISH(r, keys, *args)
        done = 0 if isinstance(result, Exception) else int(result[0])
        self._count(puts=done)
        if done == len(writes):
            return
        self._discard(r, writes[done:])
        failure = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failure is not None:  # e.g. a chunk refused for OOM
            raise self._error(failure, "put") from failure
        raise self._refusal(writes[done], result[1], result[2])

    def _publish_cas(self, r: Any, write: _Write) -> None:
        """Cluster: stage, reserve the byte delta, then publish if the frame did not change."""
        pipe = r.pipeline(transaction=False)  # all on the frame's slot: one node, one trip
        self._stage(pipe, write)
        pipe.get(write.mkey)
        replies = pipe.execute(raise_on_error=False)
        failure = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if failure is not None:
            self._discard(r, [write])
            raise self._error(failure, "put") from failure
        old = replies[-1]
        for _ in range(_CAS_TRIES):
            delta, new_entries = write.length - frame_of(old)[1], int(old is None)
            if not RESERVE(r, [self._acct], delta, new_entries, self.capacity_bytes):
                self._discard(r, [write])
                raise self._refusal(write, b"full", r.hget(self._acct, "used") or b"0")
            try:
                done, status, detail = PUBLISH(r, [write.mkey, *write.staged], "cas", old or "",
                                                write.manifest, len(write.staged), write.length)
            except ResponseError:  # refused (OOM, say): nothing was published
                RESERVE(r, [self._acct], -delta, -new_entries, self.capacity_bytes)
                self._discard(r, [write])
                raise
            # (A lost connection leaves the outcome unknown: the reservation stays.)
            if done:
                self._count(puts=1)
                return
            RESERVE(r, [self._acct], -delta, -new_entries, self.capacity_bytes)
            if status != b"conflict":
                self._discard(r, [write])
                raise self._refusal(write, status, detail)
            old = detail or None  # another writer got in first: account against its frame
        self._discard(r, [write])
        raise TierIOError(f"tier {self.name!r}: gave up after {_CAS_TRIES} conflicting writes",
                          tier=self.name)

    def _refusal(self, write: _Write, status: bytes, detail: bytes) -> TierError:
        self._count(errors=1)
        if status == b"full":
            return TierFull(f"tier {self.name!r}: a {write.length}-byte frame does not fit "
                            f"({int(detail)} of {self.capacity_bytes} bytes used)", tier=self.name)
        return TierIOError(f"tier {self.name!r}: a staged chunk vanished before publish "
                           "(expired or evicted; is maxmemory-policy noeviction?)", tier=self.name)

    def _discard(self, r: Any, writes: list[_Write]) -> None:
        """Drop staged chunks now rather than at their TTL (DEL works even when Redis is full)."""
        pipe = r.pipeline(transaction=False)
        for name in (name for write in writes for name in write.staged):
            pipe.delete(name)
        pipe.execute(raise_on_error=False)

    # -- reading and deleting -----------------------------------------------------------

    def _read(self, r: Any, reads: list[Read]) -> None:
        """Land each frame (``kvstore.wire.redis.read_frames``), then count what went wrong and
        remember how many chunks a frame had, for the next lone get."""
        read_frames(r, reads, self._read_hint if len(reads) == 1 else 1, self._cluster)  # batches: one miss
        for read in reads:
            if read.bad:
                self._count(errors=1)  # a chunk gone behind the tier's back (eviction, FLUSH)
            elif read.done and read.manifest is not None:
                self._read_hint = max(1, frame_of(read.manifest)[0])

    def _delete_cas(self, r: Any, mkey: str) -> bool:
        """Cluster: drop the frame on its slot, then give its bytes back to the accounting."""
        (length,) = DELETE(r, [mkey], "bare")
        if length < 0:
            return False
        RESERVE(r, [self._acct], -length, -1, self.capacity_bytes)
        return True

    # -- plumbing -----------------------------------------------------------------------

    def _mkey(self, key: BlockHash) -> str:
        return frame_key(self.keyspace, key)

    def connect(self) -> Any:
        """The redis-py client of this tier (connected on first use; the SDK's redis medium reads with it).

        Raises:
            StoreClosed: the tier is closed.
        """
        with self._lock:
            if self._closed:
                raise StoreClosed(f"tier {self.name!r} is closed")
            if self._client is None:  # a cluster client connects now, to learn the slot map
                factory = RedisCluster if self._cluster else redis.Redis
                self._client = factory.from_url(self._url, **self._options)
            return self._client

    @contextmanager
    def _redis(self, doing: str) -> Iterator[Any]:
        """The client; Redis errors leave as TierError subclasses."""
        try:
            yield self.connect()
        except (RedisError, RedisClusterException) as exc:
            raise self._error(exc, doing) from exc

    def _error(self, exc: Exception, doing: str) -> TierError:
        self._count(errors=1)
        message = f"tier {self.name!r}: {doing} failed: {exc}"
        if isinstance(exc, _UNAVAILABLE) or str(exc).startswith(_UNAVAILABLE_REPLIES):
            return TierUnavailable(message, tier=self.name)
        if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "OOM" in str(exc)):
            return TierFull(message, tier=self.name)
        return TierIOError(message, tier=self.name)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for field, delta in deltas.items():
                setattr(self._counters, field, getattr(self._counters, field) + delta)

    def _aof_everywhere(self) -> bool:
        """Whether every master appends to an AOF, so acknowledged puts survive its kill -9.

        Asked once, here; False when Redis is down or refuses CONFIG.
        """
        try:
            with self._redis("config") as r:
                nodes = [r.get_redis_connection(n) for n in r.get_primaries()] if self._cluster else [r]
                return all(n.config_get("appendonly").get("appendonly") in ("yes", b"yes") for n in nodes)
        except TierError:
            return False
