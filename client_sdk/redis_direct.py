"""The ``redis`` medium: frames read straight from the shared Redis tier.

When a server keeps blocks in Redis (the scale-out tier several kvstore nodes
share), a client that can reach that Redis skips the server's copy: it asks
the server where the blocks live (one small lookup), then reads the Redis
ones itself with the reader the tier reads with (``kvstore.wire.redis.read_frames``,
pipelined, chunk-aware: the layout is defined once). Blocks in other tiers come over HTTP.

The server never hands out Redis credentials: it offers only the keyspace
(``/v1/info`` ``media.redis``); the client brings its own ``redis_url``. Reads
only: a put goes through the server, which keeps the index and quotas. A frame
whose metadata names another namespace is treated as absent.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import redis
import torch
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException

from client_sdk import _common as c
from client_sdk import calls
from client_sdk.media import RestPuts, decode_prefix
from client_sdk.transport import HttpTransport
from kvstore.errors import TierIOError, TierUnavailable
from kvstore.keys import BlockHash, check_key, from_hex
from kvstore.spec import KVSpec
from kvstore.wire.redis import Read, connect_options, frame_key, read_frames


__all__ = ["RedisDirectMedium"]

_PROBE_TTL_MS = 60_000


class RedisDirectMedium(RestPuts):
    """Reads of the server's Redis tier from this process; puts go to the server (``RestPuts``).

    Args:
        http: the transport to the server that indexes the blocks (lookups, puts, fallbacks).
        redis_url: this client's URL of the same Redis.
        keyspace: the server's keyspace (its ``/v1/info`` ``media.redis.keyspace``).
        tier: the name of the server's Redis tier (lookup answers name it).
    """

    name = "redis"
    puts = False

    def __init__(self, http: HttpTransport, redis_url: str, keyspace: str, tier: str = "redis") -> None:
        self.http = http
        self.namespace = http.namespace
        self.tier_name = tier
        self.keyspace = keyspace
        self._cluster, self._url, self._options = connect_options(redis_url, 2.0, 1.0)
        self._client: Any = None
        self._probe_key = f"kv:{keyspace}:probe:{os.urandom(8).hex()}"
        self._probe_len = 0

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[Any]:
        reads = [Read(frame_key(self.keyspace, check_key(k))) for k in keys]
        try:
            read_frames(self._connect(), reads, 1, self._cluster)
        except (redis.ConnectionError, redis.TimeoutError, RedisClusterException) as exc:
            raise TierUnavailable(f"redis medium: {exc}", tier=self.tier_name) from exc
        except redis.RedisError as exc:
            raise TierIOError(f"redis medium: {exc}", tier=self.tier_name) from exc
        frames = [read.result() for read in reads]
        return [f if f is not None and c.frame_in_namespace(f, self.namespace) else None for f in frames]

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        blocks = self.http.run(calls.lookup_blocks(spec, tokens))["blocks"]
        keys = [from_hex(b["key"]) for b in blocks]
        direct = [i for i, b in enumerate(blocks) if b.get("tier") == self.tier_name]
        frames: list[Any] = [None] * len(keys)
        for i, frame in zip(direct, self.get_frames([keys[i] for i in direct])):
            frames[i] = frame
        rest = [i for i, f in enumerate(frames) if f is None]
        if rest:
            for i, frame in zip(rest, self.http.run(calls.get_blocks([keys[i] for i in rest]))):
                frames[i] = frame
        return decode_prefix(spec, frames, out)

    def probe(self, nbytes: int) -> None:
        """A PING, or a GET of this client's own probe value.

        The value (``probe_bytes``, 2 MiB) is this client's one write to Redis, under
        ``kv:<keyspace>:probe:<random>``, expiring in a minute; it is set again when it expired.
        """
        try:
            client = self._connect()
            if nbytes == 0:
                client.ping()
                return
            if self._probe_len != nbytes or client.get(self._probe_key) is None:  # new size, or expired
                client.set(self._probe_key, bytes(nbytes), px=_PROBE_TTL_MS)
                self._probe_len = nbytes
                if client.get(self._probe_key) is None:
                    raise TierUnavailable("redis probe value vanished right after it was set")
        except (redis.RedisError, RedisClusterException) as exc:
            raise TierUnavailable(f"redis probe failed: {exc}") from exc

    def _connect(self) -> Any:
        """The redis-py client, connected on first use (a cluster client learns the slot map then)."""
        if self._client is None:
            self._client = (RedisCluster if self._cluster else redis.Redis).from_url(self._url, **self._options)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
