"""``KVClient``: put_kv / get_kv / lookup against a kvstore server, over shm or HTTP.

A thin shell. The requests and their answers are ``client_sdk.calls`` (shared with
``AsyncKVClient``, with the simple calls themselves in ``client_sdk.surface``, and
the settings and state both clients keep in ``client_sdk.shell``);
the sockets and the one retry policy are ``client_sdk.transport.HttpTransport``;
the co-located path is ``client_sdk.rest_media.ShmPath`` driving
``client_sdk.colocated``'s flows; the planner (``client_sdk.planning``) picks a
medium per transfer; puts that do not wait (``put_kv(..., wait=False)``,
``flush``) queue in ``client_sdk.pending``. What is left here is wiring, and the
reporter thread that sends reads served without a request (for placement's heat)
and the planner's decisions.

The medium is picked once, on first use: when the server advertises an shm
arena, its host id equals ours and we can open its segments, KV moves through
shared memory (get: slot handles, copied straight out of the arena under a read
lease; put: written into a staging range the server leased us, then one small
commit request). Otherwise KV moves over HTTP, as raw bytes received straight
into the returned tensor.

Errors come back as the server's classes (``kvstore.wire.errors.ERRORS``):
``InvalidSpec``, ``TierFull``, ``Unauthorized`` ... Connection failures are
retried with exponential backoff (every call is idempotent: a put of stored
blocks is a no-op); a timeout is not.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk._common import BlockFill, BlockSink, BlockWriter
from client_sdk.blockwise import Place
from client_sdk.colocated import drive
from client_sdk.colocated_puts import filled_kv
from client_sdk.layers import LayerStream, get_kv_layers
from client_sdk.media import Medium
from client_sdk.pending import MAX_PENDING_BYTES, PutHandle, PutQueue
from client_sdk.planning import ClientPlanner
from client_sdk.rest_media import HttpMedium, InprocMedium, ShmPath, side_media
from client_sdk.shell import ClientShell
from client_sdk.transport import HttpTransport
from kvstore.errors import InvalidInput, KVStoreError
from kvstore.keys import BlockHash, check_key
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["KVClient"]


class KVClient(ClientShell):
    """A blocking client; safe to share between threads (one socket per thread).

    Args:
        url: ``http://host:port`` of a ``kvstore serve``.
        token: bearer token (a tenant's, or the admin token for ``client.admin``).
        namespace: the namespace every data call works in.
        agent: this client's agent name, sent with every request so that the server can learn
            hand-offs (one agent writes a context, another reads it next); default: one made up
            per client.
        timeout_s: per-request read timeout (None: wait forever).
        connect_timeout_s: TCP connect timeout.
        retries: extra attempts after a connection error.
        backoff_s: first retry delay; doubles each attempt, with jitter.
        colocated: None picks shm when it works, False never uses it (remote), True requires it.
        buffer_pool_bytes: idle result memory kept for reuse (``_common.TensorPool``); 0 turns
            it off. A result's memory is reused only after every tensor viewing it is gone.
        plan: let the transfer planner pick the medium per transfer (``client_sdk.planning``);
            False keeps the medium fixed: shm when co-located, else HTTP.
        inproc: an ``EmbeddedStore`` in this process that the server serves (the agent hosts the
            server): the ``inproc`` medium, tensors by reference.
        redis_url: the shared Redis tier, for the ``redis`` medium, when the server offers it.
        wrap_media: applied to every medium as it is built (tests and benchmarks inject slow links
            with ``client_sdk.media.Throttled``).
        slo_s: default latency bound of a transfer for the planner (None: the policy's).
        max_pending_bytes: the most bytes that copies of ``put_kv(..., wait=False)`` hold while
            queued; past it such a put waits for earlier ones to finish (one larger put goes alone).

    Attributes:
        admin: the operator's calls (``client_sdk.surface.AdminClient``; the admin token).
        http: the HTTP transport. shm: the co-located path. stats: what this client did.
        puts: the queued puts (``client_sdk.pending.PutQueue``; ``pending_bytes``).
    """

    def __init__(self, url: str, token: str | None = None, namespace: str = "default", *,
                 timeout_s: float | None = 60.0, connect_timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05, colocated: bool | None = None,
                 buffer_pool_bytes: int = 512 << 20, plan: bool = True, inproc: Any = None,
                 redis_url: str | None = None, wrap_media: Callable[[Medium], Medium] | None = None,
                 slo_s: float | None = None, max_pending_bytes: int = MAX_PENDING_BYTES,
                 agent: str | None = None) -> None:
        super().__init__(HttpTransport, url, token, namespace, timeout_s=timeout_s,
                         connect_timeout_s=connect_timeout_s, retries=retries, backoff_s=backoff_s,
                         colocated=colocated, buffer_pool_bytes=buffer_pool_bytes, plan=plan, slo_s=slo_s,
                         redis_url=redis_url, agent=agent)
        self._reporter = _Reporter(self)
        self.colocation.on_pending = self._reporter.start
        self._http_medium = HttpMedium(self.http, self.pool)
        self.shm = ShmPath(self.http, self.colocation, self.pool, c.OutViews(), self._reporter.soon, self._http_medium)
        self._inproc = inproc
        self._wrap_media = wrap_media
        self._planner: ClientPlanner | None = None
        self._planner_lock = threading.Lock()
        self.puts = PutQueue(self._put, self.pool, self.namespace, max_pending_bytes)

    # -- the data API (EmbeddedStore's, without namespace) --------------------------------

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, *, durable: bool = False,
               wait: bool = True, handoff: str | None = None) -> int | PutHandle:
        """Store the KV of every full block of ``tokens``; returns tokens covered.

        Args:
            durable: return only if every stored block sat on a durable tier when checked
                (one more lookup after the put); on a server whose tiers are all durable, the
                put then survives a crash of the server. ``docs/reliability.md`` has the rest.
            wait: False returns a ``PutHandle`` as soon as the KV is copied aside (``kv`` may
                then be overwritten); the put runs in the client's put thread, after the ones
                queued before it, and its blocks are visible once the handle is done. Its errors
                come on the handle, and once on this client's next ``put_kv`` or ``flush``
                (``client_sdk.pending`` has the rules).
            handoff: the consumer's node (a name, ``"shared"``) or ``"here"``: once the put has
                returned, ``handoff(spec, tokens, to=handoff)`` places the blocks for it (the
                server's hand-off hold for ``"here"``). Needs ``wait=True``: a hand-off names
                stored blocks, so a caller that does not wait calls ``handoff`` once the handle
                is done. A failed hand-off raises after the put, whose blocks stay stored.

        Raises:
            InvalidSpec, InvalidTokens, InvalidKV: bad input (checked here first, either way);
                InvalidInput: ``handoff`` with ``wait=False``.
            PutFailed: an earlier ``put_kv(wait=False)`` failed and no call had said so yet; this
                put was not made.
            TierFull, QuotaExceeded, TierUnavailable, Unauthorized, Forbidden: from the server.
            NotDurable: ``durable`` was asked and some stored block sits on a volatile tier.
            ConnectionFailed: the server could not be reached after the retries.
            StoreClosed: ``wait=False`` on a closed client.
        """
        spec, toks, kv = self._put_input(spec, tokens, kv, wait, handoff)
        if not wait:
            return self.puts.submit(spec, toks, kv, durable)
        stored = self._put(spec, toks, kv, durable)
        if handoff is not None:
            self.handoff(spec, toks, to=handoff)
        return stored

    def _put(self, spec: KVSpec, toks: Any, kv: torch.Tensor, durable: bool) -> int:
        """The put itself, of checked input: here for a waiting put, in the put thread otherwise."""
        if self.plan:
            stored = self._planned().put_kv(spec, toks, kv, self.slo_s)
        else:
            stored = self.shm.put_kv(spec, toks, kv)
        if durable:
            c.check_durable(stored, self._run(calls.lookup_blocks(spec, toks, sync=True)))
        return stored

    def get_kv(self, spec: KVSpec, tokens: Any, *, out: Any = None,
               slo_s: float | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix: ``(kv [L, 2, H, n, D], n)``.

        With planning on, ``n`` is 0 when the planner predicts that recomputing
        is faster than fetching; ``last_decision.reason`` says why.

        Args:
            out: optional contiguous CPU tensor or writable buffer to receive the KV; the
                returned tensor is then a view of its first bytes (no allocation per call).
            slo_s: this transfer's latency bound for the planner (default: the client's).
        """
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        if self.plan:
            return self._planned().get_kv(spec, toks, out, self.slo_s if slo_s is None else slo_s)
        return self.shm.get_kv(spec, toks, out)

    def get_kv_layers(self, spec: KVSpec, tokens: Any) -> LayerStream:
        """The longest stored prefix, layer by layer as it arrives (``client_sdk.layers.LayerStream``).

        Yields ``(layer_index, kv_layer [2, H, n, D])``; ``n_tokens`` is known before the first layer.
        Over shm when co-located, else streamed HTTP.
        """
        return get_kv_layers(self.shm, c.check_spec(spec), tokens)

    def put_kv_blocks(self, spec: KVSpec, tokens: Any, fill: BlockFill) -> int:
        """Store the KV of every full block of ``tokens``, each block written by ``fill(depth, dst)``;
        returns tokens covered, as ``put_kv``.

        For an engine that keeps KV in a layout of its own: co-located, with pool slots lent
        (``put_kv``'s one-request path), ``dst`` is the payload of the block's slot in the
        server's arena and ``fill`` copies the engine's block straight into it (one copy, then
        hashed in place); blocks the arena's key index shows stored are not asked for.
        Otherwise a tensor is filled block by block and put as ``put_kv`` puts it. ``dst`` is
        ``[L, 2, H, block_tokens, D]`` of the dtype's bits as same-size ints
        (``kvstore.codec.int_view`` gives a tensor's).
        """
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        got = self.shm.put_kv_blocks(spec, toks, fill)
        if got is None:
            got = self.put_kv(spec, toks, filled_kv(spec, toks, fill))
        return int(got)

    def reads_arena(self) -> bool:
        """Whether this client reads the server's shm arena (co-located; decided on first use, with
        one request then)."""
        return self.shm.arena() is not None

    def get_kv_blocks(self, spec: KVSpec, tokens: Any, place: Place, *, first: int = 0) -> int:
        """The longest stored prefix, handed block by block to ``place(depth, src)``; returns its
        length in tokens (counted from token 0; blocks before ``first`` are not read).

        For an engine that keeps KV in a layout of its own (vLLM's paged caches): co-located,
        ``src`` views the block's frame in the server's arena, verified (by the server, or
        here once), and ``place`` copies it straight where the engine keeps it, one copy in
        all. ``src`` is ``[L, 2, H, block_tokens, D]`` of the dtype's bits as same-size ints
        (``client_sdk.blockwise``), valid only during the call. A slot that changes under the
        copy is read again, or ends the prefix: a block past the returned length may have
        been placed with garbage, and the caller must not use it. Not co-located, the prefix
        comes over HTTP first (two copies). Reads are counted as ``get_kv``'s are.
        """
        spec = c.check_spec(spec)
        if first < 0:
            raise InvalidInput(f"get_kv_blocks: first={first} is negative")
        return self.shm.get_kv_blocks(spec, c.tokens_of(tokens), first, place)

    def lookup(self, spec: KVSpec, tokens: Any) -> Any:
        """Tokens of the longest stored prefix (index only, no KV moves). Co-located, when every
        full block is in the server's arena the answer comes from its shared key index with no
        request; otherwise the server answers (a lower tier may hold the rest). 0 while the
        tokens are stored under another spec of the model warns ``KVStoreWarning`` naming how
        they differ."""
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        here = self.shm.lookup(spec, toks)
        return here if here is not None else super().lookup(spec, toks)

    # -- blocks by key: the co-located paths (the rest are client_sdk.surface.DataCalls) ---------

    def blocks_exist(self, keys: Sequence[BlockHash], *, ask_server: bool = True) -> list[bool]:
        """Whether each key holds a block of this namespace, in any tier (at most one request).

        Co-located, blocks the arena's shared key index shows (or whose remembered slot still
        holds the generation the server named) are known present without asking; the server is
        asked about the rest, and its answer names the arena slots of those there, which are
        remembered: a ``get_blocks_into`` of them that follows (a cache's lookup, then its
        load) reads them with no request of its own.

        Args:
            ask_server: False answers co-located from the arena alone, with no request: a block
                only a lower tier holds then reads False. For a writer that skips what is stored
                before it copies: it then copies such a block again, and the server keeps one
                (a put by key of a stored key is deduplicated). Over HTTP the server is asked.
        """
        return self.shm.blocks_exist(keys, ask_server)

    def get_blocks_into(self, keys: Sequence[BlockHash], sink: BlockSink) -> list[bool]:
        """Hand each stored block of ``keys`` to ``sink(i, header, payload)``, verified; True where it did.

        Co-located, the server names the arena slots of the blocks it holds there (one small
        request, which counts the reads) and each is read in place: ``payload`` views the
        arena and is valid only during the call, so the sink copies it where it belongs (one
        copy in all). Slots are remembered (from this call's answer, or a ``blocks_exist``
        before it): a remembered slot is read with no request while its generation stands,
        hashed only the first time (reads reported in the background, for placement's heat);
        a changed one is asked for again. Other blocks come over HTTP in one batch.
        ``payload`` holds the raw bytes of ``header.shape`` in ``header.dtype``: a block a
        cold tier holds in int8 is decoded to them first. A block that fails its checksum,
        or is another namespace's, is a miss (False), never bytes.
        """
        return self.shm.get_blocks_into([check_key(k) for k in keys], sink)

    def put_blocks_with(self, keys: Sequence[BlockHash], sizes: Sequence[int], writer: BlockWriter, *,
                        make_room: bool = False) -> int:
        """Store one frame per key, each written in place by ``writer(i, view) -> frame length``.

        ``view`` is ``sizes[i]`` writable bytes: co-located, a range of a staging lease in the
        server's shared memory (the caller's bytes are copied once, into it); otherwise a
        buffer sent over HTTP as one batch. The writer fills it with a sealed frame
        (``kvstore.codec.seal_raw``). ``make_room`` places the blocks as ``put_kv`` does,
        demoting or evicting colder entries, instead of falling through full tiers.

        Returns:
            How many were stored.
        """
        keys, offsets = calls.put_layout(keys, sizes)
        return self.shm.put_blocks_with(keys, offsets, writer, make_room) if keys else 0

    # -- the planner -----------------------------------------------------------------------------

    def set_prefill_rate(self, spec: KVSpec, tokens_per_s: float) -> None:
        """The caller's prefill speed for ``spec``: the planner answers "recompute" when that is faster."""
        self._planned().set_prefill_rate(c.check_spec(spec), tokens_per_s)

    def decisions(self, limit: int = 100) -> list[dict]:
        """This client's newest decision records, oldest first."""
        return [] if self._planner is None else [d.to_dict() for d in self._planner.planner.log.records(limit)]

    def media(self) -> dict[str, Medium]:
        """The media the planner chooses among, by name (built on first use)."""
        return self._planned().media

    def _planned(self) -> ClientPlanner:
        if self._planner is None:
            with self._planner_lock:
                if self._planner is None:
                    self._planner = self._build_planner()
        return self._planner

    def _build_planner(self) -> ClientPlanner:
        colocated = self.shm.arena() is not None
        built: dict[str, Medium] = {}
        if self._inproc is not None:
            built["inproc"] = InprocMedium(self._inproc, self.namespace)
        if colocated:
            built["shm"] = self.shm
        built["http"] = self._http_medium
        built.update(side_media(self.http, self.info(), self.redis_url))
        if self._wrap_media is not None:
            built = {k: self._wrap_media(m) for k, m in built.items()}
        return ClientPlanner(built, fetch_policies=lambda: self.http.run(calls.policy()), routing_key=self.namespace,
                             locality="colocated" if colocated else "remote", report=self._reporter.soon)

    # -- reports and lifecycle ---------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every ``put_kv(wait=False)`` queued before this call has finished.

        Returns:
            True; False if ``timeout_s`` passed first (the puts go on).

        Raises:
            PutFailed: a queued put failed and no call had said so yet (once per failure).
        """
        return self.puts.flush(timeout_s)

    def wait_reports(self, timeout_s: float | None = None) -> bool:
        """Wait until no access report is queued or in flight; False if ``timeout_s`` passed first."""
        return self._reporter.wait(timeout_s)

    def close(self) -> None:
        """Wait for the queued puts (their failures not yet raised are logged, not raised), then
        let go of the connections, leases and threads."""
        self.puts.close()
        self._reporter.close()
        if self._planner is not None:
            self._planner.close()  # Flight channels, Redis pools
        drive(self.colocation.close_flow(), self.http.run)
        self.http.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reports(self) -> None:
        """Send the reads served from remembered handles, and finished planner decisions.

        Both are advisory (heat, the decision log): a failed report is dropped.
        """
        arena = self.colocation.arena
        while arena is not None and (report := arena.accesses.drain()) is not None:
            try:
                self.http.run(calls.touch(report))
            except KVStoreError as exc:
                log.debug("access report dropped: %s", exc)
        while self._planner is not None and (records := self._planner.planner.log.drain(256)):
            try:
                self.http.run(calls.decisions([d.to_dict() for d in records]))
            except KVStoreError as exc:
                log.debug("decision report dropped: %s", exc)
                break


AGE_CHECK_S = 0.25
"""How often the report thread looks whether pending reads have come of age (``AccessLog.max_age_s``)."""


class _Reporter:
    """The client's report thread: access reports and decisions leave here, so no get waits on them.

    One report is in flight at a time; reads served meanwhile join the next.
    """

    def __init__(self, client: KVClient) -> None:
        self._send = client._reports
        self._colocation = client.colocation
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wanted = self._busy = self._closing = False

    def soon(self) -> None:
        with self._cv:
            self._wanted = True
            self._start()
            self._cv.notify_all()

    def start(self) -> None:
        """Reads are pending: the thread runs (it sends them once they are ``max_age_s`` old, even
        when no later read asks it to). Wakes nothing when it runs already: called per first read."""
        if self._thread is None:
            with self._cv:
                self._start()

    def _start(self) -> None:
        if self._thread is None and not self._closing:
            self._thread = threading.Thread(target=self._loop, name="kvstore-access-report", daemon=True)
            self._thread.start()

    def _aged(self) -> bool:
        arena = self._colocation.arena
        return arena is not None and arena.accesses.due()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wanted or self._closing or self._aged(), AGE_CHECK_S)
                if self._closing:
                    return  # close() sends what is left
                if not (self._wanted or self._aged()):
                    continue
                self._wanted, self._busy = False, True
            try:
                self._send()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def wait(self, timeout_s: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not (self._busy or self._wanted) or self._thread is None, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._send()
