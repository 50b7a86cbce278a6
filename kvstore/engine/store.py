"""KVStore: the engine's facade, and its public data API over an ordered list of tiers.

A sequence's KV is cut into full blocks of ``spec.block_tokens`` tokens; block ``i`` is stored
under the chained key ``h_i`` (``kvstore.keys``), so a stored block vouches for every token
before it and ``get_kv`` returns the longest stored prefix by walking the chain. A frame that
fails to decode, or that the index names but its tier no longer has, is dropped and read as a
miss: fewer tokens, never wrong KV.

Each call checks its input and works through the part that owns the state; callers that need a
part itself reach it directly: ``core`` (the index, tiers, counters), ``frames`` (frames by key),
``reservations`` (reserved puts), ``prefetcher`` and ``locality`` (prefetch, hand-offs, retention),
``placement``. The put path is ``kvstore.engine.puts``', the get's decoding ``kvstore.engine.reads``'.
"""

from __future__ import annotations

import logging
import time
import operator
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from kvstore.codec import Codec
from kvstore.config import RECODE_BACKLOG_BYTES, SCRUB_BYTES_PER_S, Settings
from kvstore.errors import InvalidInput, InvalidKV, StoreClosed, TierError
from kvstore.engine.core import EngineCore, is_current
from kvstore.engine.events import DEFAULT_CAPACITY, EventLog
from kvstore.engine.frames import Frames, PrefixBlock
from kvstore.engine.heat import Scorer
from kvstore.engine.hints import SpecHints
from kvstore.engine.index import IndexEntry
from kvstore.engine.locality import PREFETCH_HOLD_S, Locality, check_retention
from kvstore.engine.mover import Mover
from kvstore.engine.placement import MoveOrder, PlacementConfig, PlacementManager, TierPolicy
from kvstore.engine.prefetch import HandoffLearner, Prefetcher
from kvstore.engine.puts import Puts, check_finite, tier_codecs_of
from kvstore.engine.recode import Recoder
from kvstore.engine.recovery import recover
from kvstore.engine.reserved import Reservation, ReservedPuts
from kvstore.engine.reads import decode_chain
from kvstore.engine.scrub import Scrubber
from kvstore.engine.shared import SharedTier, WritePolicy, find_shared
from kvstore.engine.stats import StoreStats
from kvstore.engine.trim import Trimmer
from kvstore.keys import BlockHash, block_hashes, check_key, iter_block_hashes, normalize_tokens
from kvstore.spec import KVSpec
from kvstore.tier import Tier

__all__ = ["KVStore", "EmbeddedStore", "StoreStats"]

log = logging.getLogger("kvstore.engine.store")

_KEY_OF = operator.attrgetter("key")


class KVStore:
    """The engine facade over an ordered list of tiers (fastest first).

    Args:
        tiers: at least one tier; names must be unique.
        codec: codec for new frames (``raw``, ``int8``, ``int8+lz4``). Cold
            tiers (nvme, redis) default to ``int8`` when this is ``raw``.
        tier_codecs: per-tier overrides by tier name, e.g. ``{"nvme": "raw"}``.
        placement: placement knobs (``PlacementConfig()`` by default).
        tier_policies: per-tier ``TierPolicy`` fields by tier name, e.g.
            ``{"shm": {"high_watermark_frac": 0.8}}``.
        scorer: heat strategy (default: decayed access rate).
        background: run the placement mover, the scrubber, the re-encoder and the trimmer in threads;
            tests and the simulator call ``run_placement()`` themselves instead (frames are hashed by
            their readers, and a put encodes for a cold tier itself).
        write_policy: when blocks reach a shared tier (Redis), if there is one:
            ``write_through``, ``write_back``, ``selective`` (or a ``WritePolicy``).
        clock: a function returning seconds, non-decreasing (default ``time.time``). Every timestamp
            the engine records (an entry's ``created_s`` and ``last_access_s``: at a put, a read, an
            adoption from the shared tier, recovery) is a reading of it; it is kept as ``self.clock``
            for callers that compare ages against those stamps (``kvstore.engine.evict.select(store,
            q, now_s=store.clock())``). A clock given here drives placement too (heat decay, pin
            TTLs, residency, the move log's ages): one clock for both lets a test age heat and
            entries together by advancing it, with no sleep. With none given, placement keeps its
            own ``time.monotonic`` (a wall clock can step back; heat must not) and entries keep wall time.
        event_capacity: events kept for subscribers (``kvstore.engine.events``): how far one may fall
            behind before it must resynchronise from a snapshot.
        scrub_bytes_per_s: the scrub's rate over the shm and cxl arenas, bytes/s; 0: off (``scrubber``).
        recode_backlog_bytes: raw bytes puts may spill into cold tiers ahead of ``recoder``; 0: off.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        codec: str | Codec = Codec.RAW,
        tier_codecs: Mapping[str, str | Codec] | None = None,
        placement: PlacementConfig | None = None,
        tier_policies: Mapping[str, Mapping[str, Any]] | None = None,
        scorer: Scorer | None = None,
        background: bool = True,
        write_policy: str | WritePolicy = "write_through",
        clock: Callable[[], float] | None = None,
        event_capacity: int = DEFAULT_CAPACITY,
        scrub_bytes_per_s: int = SCRUB_BYTES_PER_S,
        recode_backlog_bytes: int = RECODE_BACKLOG_BYTES,
    ) -> None:
        tiers = list(tiers)
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise InvalidInput("a store needs a non-empty list of Tier objects")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be unique, got {names}")
        codecs, cold = tier_codecs_of(tiers, Codec.parse(codec), dict(tier_codecs or {}))
        # NaN and Inf are refused up front only where a put writes into a non-raw tier by design:
        # the top tier, or the next one (admission). A put that falls through to a cold tier, and a
        # demotion, keep such a block raw instead. The scan costs 2 ms per 32 MiB.
        lossy = any(codecs[t.name] is not Codec.RAW for t in tiers[:2])
        policies = dict(tier_policies or {})
        unknown = sorted(set(policies) - set(names))
        if unknown:
            raise InvalidInput(f"tier_policies names unknown tier(s) {unknown}; tiers are {names}")
        self.placement = PlacementManager(
            [TierPolicy(t.name, t.capacity_bytes, cold=t.name in cold, **policies.get(t.name, {})) for t in tiers],
            scorer=scorer, config=placement, **({} if clock is None else {"clock": clock}))
        self.clock: Callable[[], float] = time.time if clock is None else clock
        """The engine's wall clock: what ``created_s`` and ``last_access_s`` are readings of."""
        # One core owns the index; the mover, the shared tier and recovery get it explicitly.
        self.core = core = EngineCore(tiers, codecs, self.placement, clock=self.clock,
                                       event_capacity=event_capacity)
        self.durable_tiers = core.durable_tiers
        """Names of the tiers whose acknowledged writes survive a crash (``Tier.durable``, as at start)."""
        policy = write_policy if isinstance(write_policy, WritePolicy) else WritePolicy(str(write_policy))
        shared = find_shared(tiers)
        self._shared = SharedTier(core, shared, policy) if shared is not None else None
        core.shared = self._shared
        self.recoder = Recoder(core, backlog_bytes=recode_backlog_bytes if background else 0)
        """Re-encodes, in the puts' gaps, blocks spilled or demoted raw into cold tiers (``kvstore.engine.recode``)."""
        self._mover = Mover(core, self._shared, on_move=self._moved, recoder=self.recoder)
        self._puts = Puts(core, self._shared, self._mover.execute, lossy=lossy, recoder=self.recoder)
        self.frames = Frames(core, self._shared, self._puts.take_room)
        """Frames by key: the block routes', shm handles' and lm:// reads and puts."""
        self.reservations = ReservedPuts(core, self._puts.take_room, shared=self._shared is not None)
        """Reserved puts: a co-located writer fills top-tier slots itself, then commits."""
        self.prefetcher = Prefetcher(core, self._mover.execute)
        """Background prefetches: ``idle`` (tests and benches wait on it), ``log``."""
        self.events: EventLog = core.events
        """Every block stored, moved, removed, and every clear, numbered (``kvstore.engine.events``)."""
        self.policy_for: Callable[[str], tuple[int | None, bool]] = lambda namespace: (None, True)
        """(policy version, whether learned hand-offs may be prefetched) for a namespace: the server
        points it at the planner's policies, so a canary that turns prefetch on is judged and
        rolled back like any policy."""
        self.locality = Locality(core, self._shared, self.prefetcher, HandoffLearner(clock=self.placement.clock),
                                 lambda namespace: self.policy_for(namespace))
        """Prefetch, hand-offs and retention (``kvstore.engine.locality``); ``locality.handoffs``: the
        hand-offs learned per namespace from the agents' puts and reads."""
        self.hints = SpecHints(core)
        """The specs stored per namespace and model, for a missed get's hint (``kvstore.engine.hints``)."""
        self.scrubber = Scrubber(core, bytes_per_s=scrub_bytes_per_s)
        """Verifies frames published into shm and cxl arenas, and scrubs them (``kvstore.engine.scrub``)."""
        self.trimmer = Trimmer(core)
        """Hands an idle store's free arena memory back to the kernel (``kvstore.engine.trim``)."""
        self.recovered = recover(core)
        if background:
            for thread in (self._mover, self.scrubber, self.recoder, self.trimmer):
                thread.start()

    # -- public API -------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return self.core.tiers

    def put_kv(self, spec: KVSpec, tokens: Any, kv: torch.Tensor, namespace: str = "default", *,
               agent: str | None = None) -> int:
        """Store the KV of every full block of ``tokens``.

        Args:
            spec: the model's KV spec.
            tokens: token ids (list of ints or 1-D integer tensor).
            kv: ``[num_layers, 2, num_kv_heads, >= full-block tokens, head_dim]`` in ``spec.dtype``.
            namespace: the tenant's namespace; part of every key.
            agent: who is writing (the SDK's agent id), for learning hand-offs; None: not learned.

        Returns:
            Tokens covered after the call (full blocks only), new or already stored.

        Raises:
            InvalidSpec, InvalidTokens, InvalidKV: bad input; nothing was stored.
            TierFull: no tier had room; ``stored_tokens`` says how far it got.
            TierUnavailable, TierIOError: every tier with room failed.
        """
        self._check_open()
        spec = _check_spec(spec)
        toks = normalize_tokens(tokens)
        n_blocks = spec.full_blocks(len(toks))
        kv = spec.validate_kv(kv, min_tokens=n_blocks * spec.block_tokens)
        keys = block_hashes(spec, toks, namespace)
        self.core.count(put_calls=1)
        if not keys:
            return 0
        if self._puts.lossy:  # a put writes where int8 is the codec: refuse before storing anything
            check_finite(kv[:, :, :, : n_blocks * spec.block_tokens])
        self._puts.write_chain(keys, kv, toks, namespace, spec.fingerprint(), spec.block_tokens)
        self.hints.saw(spec, namespace)
        if agent is not None:
            self.locality.wrote(keys, namespace, spec, agent)
        return n_blocks * spec.block_tokens

    def get_kv(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, out: torch.Tensor | None = None,
               agent: str | None = None, hints: list[str] | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix of ``tokens``.

        Args:
            out: optional CPU tensor ``[L, 2, H, >= full-block tokens, D]`` in
                ``spec.dtype`` to decode into; a server or an engine reusing one
                buffer skips the page faults of a fresh allocation per call.
            agent: who is reading, for learning hand-offs; None: not learned.
            hints: when nothing is found but the first block is stored under another spec of the
                model, the hint saying how they differ is appended here; None: warned instead, a
                ``KVStoreWarning`` once per pair of specs (``kvstore.engine.hints``).

        Returns:
            ``(kv, n_tokens)``: ``kv`` is ``[L, 2, H, n_tokens, D]`` in ``spec.dtype``
            (a view of ``out`` when given); with nothing stored, ``n_tokens == 0`` and
            ``kv`` is empty in that dimension.

        Raises:
            InvalidSpec, InvalidTokens: bad input. InvalidKV: ``out`` does not fit.
        """
        self._check_open()
        spec = _check_spec(spec)
        toks = normalize_tokens(tokens)
        if out is not None:
            out = spec.validate_kv(out, min_tokens=spec.full_blocks(len(toks)) * spec.block_tokens)
            if out.device.type != "cpu" or out.requires_grad:
                # checked here: a decode refusing ``out`` must not look like a damaged frame
                raise InvalidKV(f"out must be a CPU tensor without grad, got {out.device} grad={out.requires_grad}")
        self.core.count(get_calls=1, tokens_requested=spec.full_blocks(len(toks)) * spec.block_tokens)
        spec_fp = spec.fingerprint()
        adopted: dict[BlockHash, Any] = {}  # frames just read from the shared tier: not read twice
        found = self.core.current_prefix(iter_block_hashes(spec, toks, namespace), namespace, spec_fp,
                                         adopted=adopted)
        if adopted:
            self.core.count(blocks_adopted=len(adopted))
        bt = spec.block_tokens
        if not found and len(toks) >= bt:
            self.hints.after_miss(spec, toks, namespace, hints)
        given = out is not None
        out = out[:, :, :, : len(found) * bt] if given else spec.empty_kv(len(found) * bt)
        good = decode_chain(self.core, found, adopted, out, bt, namespace, spec_fp)
        hits = [e.key for e in found[:good]]
        self.core.touch(hits)
        if agent is not None:
            self.locality.handoffs.read(hits, namespace, agent)
        if self._shared is not None:
            for entry in self._shared.after_hits(found[:good]):
                self._shared.replicate(entry)
        self.core.count(tokens_hit=good * bt)
        if good * bt < out.shape[3]:
            out = out[:, :, :, : good * bt] if given else out[:, :, :, : good * bt].clone()
        return out, good * bt

    # -- two-phase puts (``kvstore.engine.reserved``) -------------------------------------------------

    def reserve_put(self, spec: KVSpec, tokens: Any, namespace: str, *, owner: str,
                    pid: int | None = None) -> Reservation | None:
        """Top-tier slots for the blocks of ``tokens`` not stored yet; None when there is no room
        for all of them. ``ReservedPuts.reserve`` has the rest."""
        self._check_open()
        spec = _check_spec(spec)
        self.hints.saw(spec, namespace)
        return self.reservations.reserve(spec, normalize_tokens(tokens), namespace, owner, pid)

    def commit_put(self, reservation: str, owner: str, checksums: list[int], *,
                   agent: str | None = None, sealed: bool = False) -> tuple[int, int]:
        """Publish a reservation's frames: (tokens covered, KV bytes written). ``ReservedPuts.commit``
        has the rest (``sealed`` too); ``agent`` is the writer, for learning hand-offs."""
        self._check_open()
        res = self.reservations.get(reservation) if agent is not None else None
        done = self.reservations.commit(reservation, owner, checksums, sealed=sealed)
        if res is not None:
            self.locality.wrote(res.keys, res.namespace, res.spec, agent)
        return done

    def lookup(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        """Tokens of the longest stored prefix of ``tokens``, from the index alone.

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec = _check_spec(spec)
        self.core.count(lookup_calls=1)
        keys = block_hashes(spec, tokens, namespace)
        n = len(self.core.current_prefix(keys, namespace, spec.fingerprint()))
        if n < len(keys) and self._shared is not None:  # other nodes may have stored the rest
            n += self._shared.count_prefix(keys[n:])
        return n * spec.block_tokens

    def durable_tokens(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        """Tokens of the longest prefix of ``tokens`` whose blocks this store holds on durable tiers.

        A durable tier's acknowledged write survives a crash (``Tier.durable``: nvme, whose group
        commit this waits for; Redis with an AOF on every master, as seen at start). Only blocks
        this store's index holds count; a shared tier's alone are not vouched for. A prefix. It
        holds when read: placement may later promote a block into a volatile tier, and a frame
        put may rewrite one there, unless every tier is durable (``tiers="nvme"``).

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec, _ = _check_spec(spec), self.core.sync_durable()
        n = len(self.core.current_prefix(iter_block_hashes(spec, tokens, namespace), namespace,
                                         spec.fingerprint(), tiers=self.core.durable_tiers))
        return n * spec.block_tokens

    def delete(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        """Delete every stored block of ``tokens`` (shared prefix blocks included).

        Returns:
            The number of blocks removed.
        """
        self._check_open()
        spec = _check_spec(spec)
        spec_fp = spec.fingerprint()
        removed = 0
        for key in block_hashes(spec, tokens, namespace):
            if is_current(self.core.entry(key), namespace, spec_fp):
                removed += self.core.delete_key(key)
        return removed

    def delete_blocks(self, keys: Sequence[BlockHash], *, reason: str = "deleted") -> int:
        """Delete blocks by key (an operator's tool: no namespace check). Returns how many went."""
        self._check_open()
        try:
            checked = [check_key(key) for key in keys]  # all or nothing: validate before deleting
        except TypeError as exc:
            raise InvalidInput(f"keys must be a list of 32-byte block keys: {exc}") from exc
        return sum(self.core.delete_key(key, reason=reason) for key in checked)

    def entry(self, key: BlockHash) -> IndexEntry | None:
        """The index entry of ``key`` (a live object: read, do not change)."""
        return self.core.entry(check_key(key))

    def entries(self) -> list[IndexEntry]:
        """Copies of every index entry."""
        return self.core.snapshot()

    # -- for services that read and write frames themselves ---------------------------

    def prefix_blocks(self, spec: KVSpec, tokens: Any, namespace: str, *, agent: str | None = None,
                      hints: list[str] | None = None) -> list[PrefixBlock]:
        """The blocks of the longest stored prefix of ``tokens``: this index's (``Frames.local_prefix``),
        then those only the shared tier holds (another node's), counted as one lookup. ``agent``: a
        reader about to read them (a co-located get), for learning hand-offs. ``hints``: as ``get_kv``'s,
        but None asks for no hint."""
        self._check_open()
        spec = _check_spec(spec)
        toks = normalize_tokens(tokens)
        keys = block_hashes(spec, toks, namespace)
        found = self.frames.local_prefix(keys, namespace, spec.fingerprint())
        if agent is not None and found:
            self.locality.handoffs.read(found, namespace, agent, key=_KEY_OF)
        self.core.count(lookup_calls=1)
        if len(found) < len(keys) and self._shared is not None:
            n = len(found) + self._shared.count_prefix(keys[len(found):])
            found = self.frames.extend_prefix(found, keys[:n], namespace, spec.fingerprint())
        if not found and keys and hints is not None:
            self.hints.after_miss(spec, toks, namespace, hints)
        return found

    # -- locality: prefetch, hand-off, retention (``kvstore.engine.prefetch``, placement rule 5) ----------

    def prefetch(self, spec: KVSpec, tokens: Any, namespace: str = "default", *,
                 reason: str = "requested by a caller", trigger: str = "requested",
                 hold_s: float = PREFETCH_HOLD_S) -> int:
        """Bring the longest stored prefix of ``tokens`` to the top tier, in the background.

        Blocks only the shared tier holds (another node stored them) are adopted first, so a
        node reading from the shared tier gets them into its own arena. Returns at once.

        ``hold_s``: then hold the blocks in the top tier this long, or until their first read (a soft
        retention no tenant pays for, within a quarter of the tier), so that churn in a full top
        tier does not push them out before their reader comes; 0: no hold. Returns the tokens of
        the prefix the prefetch will bring (what a get would find now).

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec = _check_spec(spec)
        keys = block_hashes(spec, normalize_tokens(tokens), namespace)
        return self.locality.prefetch(spec, keys, namespace, reason=reason, trigger=trigger, hold_s=hold_s)

    def retain(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, ttl_s: float,
               priority: int = 0, owner: str | None = None, quota_bytes: int | None = None) -> dict[str, Any]:
        """Keep the stored prefix of ``tokens`` in the top tier for ``ttl_s`` seconds: a soft pin,
        honoured ahead of heat, ended by expiry or ``release`` (placement's rule 5).

        Blocks below the top tier are brought up in the background. Blocks only the shared tier
        holds are not retained: ``prefetch`` brings them, then retain.

        Args:
            priority: 0-9; under pressure a lower priority of the same owner yields first.
            owner: who pays for it (the tenant; default the namespace).
            quota_bytes: the owner's retained bytes may not pass this (None: no bound).

        Returns:
            tokens, blocks and bytes retained; expires_in_s; priority; owner; the owner's
            retained_bytes now and its quota_bytes.

        Raises:
            InvalidInput: ``ttl_s`` not in (0, 86400] or ``priority`` not an int in 0..9.
            RetainQuotaExceeded: over ``quota_bytes``; nothing new is retained.
        """
        check_retention(ttl_s, priority)
        keys = self._current_keys(spec, tokens, namespace)
        return self.locality.retain(spec, keys, namespace, ttl_s=ttl_s, priority=priority,
                                    owner=namespace if owner is None else owner, quota_bytes=quota_bytes)

    def release(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, owner: str | None = None) -> int:
        """End the retention of the stored prefix of ``tokens`` (only ``owner``'s, when given);
        returns how many blocks it ended for."""
        return self.placement.unretain(self._current_keys(spec, tokens, namespace), owner)

    def handoff(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, to: str = "here",
                ttl_s: float | None = None, owner: str | None = None,
                quota_bytes: int | None = None) -> dict[str, Any]:
        """Place the stored prefix of ``tokens`` where its next reader will read it.

        ``to="here"``: the reader is on this node: keep the blocks in the top tier for ``ttl_s``
        (default 120 s; a retention of ``owner``'s, within ``quota_bytes``). Anything else (a node's
        name, or ``"shared"``): copy every block to the shared tier now, whatever the write policy,
        so that node finds it (its ``prefetch`` brings it into its own arena). Returns tokens and
        blocks of the prefix, held (blocks retained here), shared (blocks the shared tier holds).

        Raises:
            InvalidInput: a bad ``to`` or ``ttl_s``, or another node named with no shared tier.
            RetainQuotaExceeded: ``"here"`` over the owner's quota.
        """
        if not isinstance(to, str) or not to or len(to) > 256:
            raise InvalidInput(f"to must be 'here', 'shared' or a node name (at most 256 characters), got {to!r}")
        keys = self._current_keys(spec, tokens, namespace)
        return self.locality.handoff(spec, keys, namespace, to=to, ttl_s=ttl_s, owner=owner,
                                     quota_bytes=quota_bytes)

    # -- placement ------------------------------------------------------------------

    def pin(self, spec: KVSpec, tokens: Any, namespace: str = "default", ttl_s: float | None = None) -> int:
        """Keep the stored blocks of ``tokens`` in their tier or higher; returns blocks pinned."""
        return self.pin_keys(self._current_keys(spec, tokens, namespace), ttl_s)

    def unpin(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        return self.unpin_keys(self._current_keys(spec, tokens, namespace))

    def pin_keys(self, keys: Sequence[BlockHash], ttl_s: float | None = None) -> int:
        """Pin blocks by key (for ``ttl_s`` seconds, or until unpinned); returns how many were stored."""
        self._check_open()
        return sum(self.placement.pin(check_key(k), ttl_s) for k in list(keys))

    def unpin_keys(self, keys: Sequence[BlockHash]) -> int:
        self._check_open()
        return sum(self.placement.unpin(check_key(k)) for k in list(keys))

    @contextmanager
    def lease(self, keys: Sequence[BlockHash]) -> Iterator[list[BlockHash]]:
        """Hold blocks where they are (placement neither moves nor evicts them) while a
        zero-copy reader uses them; yields the keys that were stored and are now held."""
        self._check_open()
        held = [k for k in (check_key(k) for k in list(keys)) if self.placement.lease(k)]
        try:
            yield held
        finally:
            for key in held:
                self.placement.release(key)

    def explain(self, key: BlockHash) -> dict[str, Any] | None:
        """Where a block is, what it is, how hot, its pins and its last moves; None if absent."""
        entry = self.core.entry(check_key(key))
        if entry is None:
            return None
        info = self.placement.explain(key) or {}
        return {"key": key.hex(), "tier": entry.tier, "size": entry.size, "codec": entry.codec.value,
                "raw_bytes": entry.raw_bytes, "namespace": entry.namespace, "spec_fingerprint": entry.spec_fp,
                "depth": entry.depth, "hits": entry.hits, "created_s": entry.created_s,
                "last_access_s": entry.last_access_s, **{k: v for k, v in info.items() if k not in ("tier", "size")}}

    def migrate(self, key: BlockHash, tier: str, reason: str = "migrated: by an operator") -> bool:
        """Move one block to ``tier`` now (pins do not stop an operator); False if it did not move.

        Raises:
            InvalidInput: an unknown tier.
        """
        self._check_open()
        self.core.tier(tier)  # InvalidInput naming the tiers when there is no such tier
        entry = self.core.entry(check_key(key))
        if entry is None or entry.tier == tier:
            return False
        return self._mover.execute(MoveOrder(key, entry.tier, tier, entry.size, reason))

    def moves(self, limit: int = 100) -> list[dict[str, Any]]:
        """The store's latest moves, newest last; ``age_s`` says how long ago each was."""
        now = self.placement.clock()
        return [m.to_dict(now) for m in self.placement.log(limit)]

    def run_placement(self, *, bounded: bool = False) -> int:
        """One placement round now, as ``Mover.run_once(bounded=)`` makes it; returns moves made."""
        self._check_open()
        return self._mover.run_once(bounded=bounded)

    def _current_keys(self, spec: KVSpec, tokens: Any, namespace: str) -> list[BlockHash]:
        self._check_open()
        spec = _check_spec(spec)
        found = self.core.current_prefix(iter_block_hashes(spec, tokens, namespace), namespace, spec.fingerprint())
        return [e.key for e in found]

    def _moved(self, order: MoveOrder, new_size: int) -> None:
        self.core.count(**{f"blocks_{order.reason.split(':', 1)[0]}": 1})

    def stats(self) -> StoreStats:
        blocks, frame_bytes, raw_bytes = self.core.totals()
        counters = self.core.counters()
        return StoreStats(
            blocks=blocks, frame_bytes=frame_bytes, raw_bytes=raw_bytes,
            codec_bytes_saved=raw_bytes - frame_bytes,
            counters=counters,
            tiers=[t.stats() for t in self.core.tiers],
            moves=self.placement.counters(),
            heat=self.placement.scorer_state(),
            shared=self._shared.stats() if self._shared is not None else {},
            reads_by_tier=self.core.reads_by_tier(),
            scrub=self.scrubber.stats(),
            recode=self.recoder.stats().to_dict(),
        )

    def close(self) -> None:
        """Close every tier. Idempotent; the store refuses calls afterwards."""
        if self.core.closed:
            return
        self.scrubber.close()  # it reads the arenas: stopped before they close
        self.trimmer.close()  # so does it
        self.prefetcher.close()
        self._mover.stop()  # no move may start against tiers that are closing
        self.recoder.close()
        self.reservations.close()
        self.core.closed = True
        self.core.clear()
        for tier in self.core.tiers:
            try:
                tier.close()
            except TierError as exc:  # close the rest regardless
                log.warning("closing tier %s failed: %s", tier.name, exc)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------

    def _check_open(self) -> None:
        if self.core.closed:
            raise StoreClosed("the store is closed")


class EmbeddedStore(KVStore):
    """An in-process store. With no ``tiers``, the tiers ``Settings`` names.

    The default is shm -> cxl -> nvme (under ``./kvstore-data``), Redis above nvme when ``KVSTORE_REDIS_URL`` is set.

    Args:
        tiers: tiers to use instead of the configured ones.
        codec, tier_codecs: as for ``KVStore``; ``codec`` defaults to the settings'.
        settings: defaults to ``Settings.from_env()``.
        placement: ``placement``, ``tier_policies``, ``scorer``, ``background``, ``write_policy``,
            ``clock``, as for ``KVStore``; the settings give the scrub's rate and the top tier's
            low watermark (``build.top_policies``).
    """

    def __init__(self, tiers: Sequence[Tier] | None = None, *, codec: str | Codec | None = None,
                 tier_codecs: Mapping[str, str | Codec] | None = None, settings: Settings | None = None,
                 **placement: Any) -> None:
        from kvstore.engine.build import build_tiers, top_policies  # lazy: tiers import kvstore.tier

        settings = settings or Settings.from_env()
        tiers = build_tiers(settings) if tiers is None else list(tiers)
        super().__init__(tiers, codec=codec or settings.codec, tier_codecs=tier_codecs,
                         tier_policies=top_policies(settings, tiers, placement.pop("tier_policies", None)),
                         **{"scrub_bytes_per_s": settings.scrub_bytes_per_s,
                            "recode_backlog_bytes": settings.recode_backlog_bytes,
                            "placement": PlacementConfig(full_top=settings.full_top_tier), **placement})


# -- helpers ---------------------------------------------------------------------


def _check_spec(spec: Any) -> KVSpec:
    if not isinstance(spec, KVSpec):
        raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
    return spec
