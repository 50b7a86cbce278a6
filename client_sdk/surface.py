"""The calls ``KVClient`` and ``AsyncKVClient`` share, written once.

Each method builds a ``client_sdk.calls.Call`` and hands it to ``self._run``: a
blocking client's ``_run`` returns the answer, an async client's returns an
awaitable of it (``await client.lookup(...)``). So the two clients cannot drift
apart on these calls: same names, same arguments, same requests, same answers
(``tests/client_sdk/test_surface.py`` checks the whole of both surfaces).

``AdminClient`` is the operator's half (``client.admin``): the ``/admin`` routes,
which need the admin token.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from client_sdk import calls
from client_sdk.calls import Call, key_hex
from kvstore.keys import BlockHash
from kvstore.spec import KVSpec

__all__ = ["DataCalls", "AdminClient"]


class DataCalls:
    """Lookups, deletes, blocks by key, and the service's own small routes."""

    namespace: str
    stats: Any
    """The client's ``ClientStats`` (``client_sdk.shell``): which hints it warned of, among others."""
    _run: Callable[[Call[Any]], Any]

    def lookup(self, spec: KVSpec, tokens: Any) -> Any:
        """Tokens of the longest stored prefix (index only, no KV moves). 0 while the tokens are
        stored under another spec of the model warns ``KVStoreWarning`` naming how they differ."""
        return self._run(calls.lookup(spec, tokens, self.stats))

    def lookup_blocks(self, spec: KVSpec, tokens: Any) -> Any:
        """The lookup answer: ``{"tokens", "block_tokens", "durable_tokens", "blocks": [{"key", "tier"}]}``."""
        return self._run(calls.lookup_blocks(spec, tokens))

    def delete(self, spec: KVSpec, tokens: Any) -> Any:
        """Delete the stored blocks of ``tokens``; returns blocks removed."""
        return self._run(calls.delete(spec, tokens))

    def prefetch(self, spec: KVSpec, tokens: Any) -> Any:
        """Have the server bring the longest stored prefix of ``tokens`` to the fastest tier this
        client reaches (its shm arena; on a node reading a shared tier, that node's own arena),
        in the background. Returns at once: the tokens it will bring (0: nothing stored)."""
        return self._run(calls.prefetch(spec, tokens))

    def retain(self, spec: KVSpec, tokens: Any, ttl_s: float, priority: int = 0) -> Any:
        """Keep the stored prefix of ``tokens`` in the top tier for ``ttl_s`` seconds (a soft pin
        for a conversation paused on a tool call), ended early by ``release``.

        Args:
            ttl_s: seconds, at most the server's ``KVSTORE_RETAIN_MAX_TTL_S`` (default 3600).
            priority: 0-9; under pressure the tenant's lower-priority, sooner-expiring retentions
                yield first.

        Returns:
            ``{"tokens", "blocks", "bytes", "expires_in_s", "priority", "owner", "retained_bytes",
            "quota_bytes"}``: what was retained, and where the tenant stands against its quota.

        Raises:
            RetainQuotaExceeded: the tenant's retained bytes would pass its quota (nothing new
                was retained; ``retained_bytes`` and ``quota_bytes`` say where it stands).
            InvalidInput: a bad ``ttl_s`` or ``priority`` (422, naming the field).
        """
        return self._run(calls.retain(spec, tokens, ttl_s, priority))

    def release(self, spec: KVSpec, tokens: Any) -> Any:
        """End this tenant's retention of the stored prefix of ``tokens``; returns blocks released."""
        return self._run(calls.release(spec, tokens))

    def handoff(self, spec: KVSpec, tokens: Any, to: str = "here", ttl_s: float | None = None) -> Any:
        """Place the stored prefix of ``tokens`` where its next reader will read it.

        Args:
            to: ``"here"``: the consumer reads from this server: hold the blocks in its top tier
                for ``ttl_s`` (a retention of this tenant's). A node's name, or ``"shared"``: the
                consumer is on another node: write the blocks through to the shared tier now
                (its ``prefetch`` then brings them into its own arena).
            ttl_s: how long ``"here"`` holds them (default the server's ``KVSTORE_HANDOFF_TTL_S``).

        Returns:
            ``{"tokens", "blocks", "held", "shared", "to"}``.

        Raises:
            InvalidInput: another node named and the server has no shared tier (422).
            RetainQuotaExceeded: ``"here"`` over the tenant's retention quota.
        """
        return self._run(calls.handoff(spec, tokens, to, ttl_s))

    def get_block(self, key: BlockHash) -> Any:
        """The stored frame of ``key`` in this namespace, or None."""
        return self._run(calls.get_block(key))

    def put_block(self, key: BlockHash, frame: Any) -> Any:
        """Store one encoded frame under ``key`` (its metadata must name this namespace)."""
        return self._run(calls.put_block(key, frame))

    def delete_block(self, key: BlockHash) -> Any:
        """Delete one block; False when it was not stored."""
        return self._run(calls.delete_block(key))

    def get_blocks(self, keys: Sequence[BlockHash]) -> Any:
        """Frames of many keys in one request; None for each absent one."""
        return self._run(calls.get_blocks(keys))

    def put_blocks(self, items: Sequence[tuple[BlockHash, Any]], *, make_room: bool = False) -> Any:
        """Store many frames in one request; returns how many. ``make_room`` places them as
        ``put_kv`` places blocks (colder entries demoted or evicted) instead of falling through
        full tiers."""
        return self._run(calls.put_blocks(items, make_room))

    def delete_blocks(self, keys: Sequence[BlockHash]) -> Any:
        return self._run(calls.delete_blocks(keys))

    def pin_blocks(self, keys: Sequence[BlockHash], ttl_s: float) -> Any:
        """Hold this namespace's blocks in place for ``ttl_s`` seconds (at most an hour): placement
        neither demotes nor evicts them until then or ``unpin_blocks``. Pins do not count: one
        unpin releases a key however often it was pinned. Returns how many were stored."""
        return self._run(calls.pin_blocks(keys, ttl_s))

    def unpin_blocks(self, keys: Sequence[BlockHash]) -> Any:
        return self._run(calls.unpin_blocks(keys))

    def name_blocks(self, spec: KVSpec, tokens: Any, engine_hashes: Sequence[Any], *, first: int = 0,
                    parent: Any = None, with_tokens: bool = True) -> Any:
        """Tell the server an engine's own names for stored blocks of ``tokens`` (vLLM's block
        hashes: bytes, or ints): ``engine_hashes[i]`` names block ``first + i`` and ``parent`` the
        engine's name for block ``first - 1``. The server's KV events (vLLM's ZMQ format, SSE)
        then announce those blocks under the engine's names too, with their token ids unless
        ``with_tokens`` is False, so a router indexing the engine's own events counts kvstore's
        copies. Blocks not stored are skipped; returns how many were named."""
        return self._run(calls.name_blocks(spec, tokens, self.namespace, engine_hashes, first, parent, with_tokens))

    def evict_mine(self, **selectors: Any) -> Any:
        """Evict blocks of this namespace (``POST /v1/evict``): the admin selectors, tenant-scoped."""
        return self._run(calls.evict_mine(selectors))

    def report_connector(self, engine: str, instance: str, counters: Mapping[str, float]) -> Any:
        """An engine connector's cumulative counters, for the server's /metrics and dashboard."""
        return self._run(calls.report_connector(engine, instance, counters))

    def info(self) -> Any:
        """``/v1/info``: version, media offered, the co-located arena's segments."""
        return self._run(calls.info())

    def health(self) -> Any:
        return self._run(calls.health())

    def ready(self) -> Any:
        """``/readyz``'s answer, degraded or not (a 503 raises ``ServiceError``)."""
        return self._run(calls.ready())

    def metrics(self) -> Any:
        """The Prometheus exposition text of ``/metrics``."""
        return self._run(calls.metrics())


class AdminClient:
    """The operator's calls (``/admin``; the admin token): ``client.admin``.

    Args:
        run: the client's transport (a blocking one returns answers, an async one awaitables).
        namespace: the client's, for pins named by spec and tokens.
    """

    def __init__(self, run: Callable[[Call[Any]], Any], namespace: str) -> None:
        self._run = run
        self.namespace = namespace

    def evict(self, *, dry_run: bool = False, **selectors: Any) -> Any:
        """``POST /admin/evict``: keys, prefix, namespace, fingerprint, tier, older_than_s, watermark."""
        return self._run(calls.evict(selectors, dry_run))

    def pin(self, keys: Sequence[Any] | None = None, *, spec: KVSpec | None = None, tokens: Any = None,
            namespace: str | None = None, ttl_s: float | None = None) -> Any:
        """Pin blocks by key, or the stored prefix of ``tokens`` (in ``namespace``, the client's by default)."""
        body = calls.pin_body(keys, spec, tokens, namespace or self.namespace, ttl_s)
        return self._run(calls.json_call("POST", "/admin/pin", body))

    def unpin(self, keys: Sequence[Any] | None = None, *, spec: KVSpec | None = None, tokens: Any = None,
              namespace: str | None = None) -> Any:
        body = calls.pin_body(keys, spec, tokens, namespace or self.namespace, None)
        return self._run(calls.json_call("DELETE", "/admin/pin", body))

    def migrate(self, key: Any, tier: str) -> Any:
        """Move one block to ``tier`` now (pins do not stop an operator)."""
        return self._run(calls.json_call("POST", "/admin/migrate", {"key": key_hex(key), "tier": tier}))

    def stats(self) -> Any:
        """``/admin/stats``: the store's counters, tiers, moves, heat and reads by tier."""
        return self._run(calls.json_call("GET", "/admin/stats"))

    def connectors(self) -> Any:
        """Engine connectors' counters by namespace and engine."""
        return self._run(calls.json_call("GET", "/admin/connectors", parse=lambda a: a["connectors"]))

    def tiers(self) -> Any:
        return self._run(calls.json_call("GET", "/admin/tiers", parse=lambda a: a["tiers"]))

    def entries(self, sort: str = "heat", order: str = "desc", limit: int = 100, offset: int = 0,
                namespace: str | None = None, tier: str | None = None, *,
                min_heat_per_s: float | None = None, max_heat_per_s: float | None = None,
                min_age_s: float | None = None, max_age_s: float | None = None) -> Any:
        """A page of index entries (``GET /admin/entries``), sorted and filtered as the route says."""
        return self._run(calls.entries(sort, order, limit, offset, namespace=namespace, tier=tier,
                                       min_heat_per_s=min_heat_per_s, max_heat_per_s=max_heat_per_s,
                                       min_age_s=min_age_s, max_age_s=max_age_s))

    def heat(self, bins: int = 12) -> Any:
        """The heat histogram by tier (``GET /admin/heat``)."""
        return self._run(calls.json_call("GET", "/admin/heat", params={"bins": bins}))

    def history(self, limit: int = 720) -> Any:
        """The hit ratio over time, overall and by tier (``GET /admin/history``)."""
        return self._run(calls.json_call("GET", "/admin/history", params={"limit": limit}))

    def moves(self, limit: int = 100) -> Any:
        """The store's latest placement moves, newest last (``GET /admin/moves``)."""
        return self._run(calls.json_call("GET", "/admin/moves", params={"limit": limit}))

    def explain(self, key: Any) -> Any:
        """Where a block is, what it is, how hot, its pins and its last moves."""
        return self._run(calls.json_call("GET", f"/admin/explain/{key_hex(key)}"))

    def audit(self, limit: int = 100, offset: int = 0, action: str | None = None) -> Any:
        """The audit log of operator actions, newest first."""
        return self._run(calls.json_call("GET", "/admin/audit",
                                         params={"limit": limit, "offset": offset, "action": action}))
