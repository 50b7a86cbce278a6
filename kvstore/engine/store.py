"""KVStore: put_kv / get_kv / lookup / delete / stats over an ordered list of tiers.

A sequence's KV is cut into full blocks of ``spec.block_tokens`` tokens; block
``i`` is stored under the chained key ``h_i`` (see ``kvstore.keys``), so a
stored block also vouches for every token before it and ``get_kv`` can return
the longest stored prefix by walking the chain.

Writes go to the tier placement's admission picks and fall through to slower tiers
when it is full. Reads come from wherever the index says
the block is. A frame that fails to decode, or that the index says exists but
the tier no longer has, is dropped and treated as a miss: the caller gets fewer
tokens, never wrong KV.

This module is one unit, longer than most: ``KVStore`` is the engine's whole
public surface (the data calls, frames by key, placement, stats and lifecycle),
so that what the engine offers reads in one file. Each call checks its input and
then works through the parts that own the state: the index, tiers and counters
are ``kvstore.engine.core``'s, frames by key ``kvstore.engine.frames``', moves the mover's,
copies to the shared tier ``kvstore.engine.shared``'s.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from dataclasses import asdict, dataclass, field
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.config import Settings
from kvstore.errors import (
    FrameError,
    InvalidInput,
    InvalidKV,
    StoreClosed,
    TierError,
    TierFull,
)
from kvstore.engine.core import EngineCore, StoreCounters, is_current
from kvstore.engine.events import DEFAULT_CAPACITY, EventLog
from kvstore.engine.index import IndexEntry
from kvstore.memory.buffers import Scratch
from kvstore.engine.heat import Scorer
from kvstore.engine.placement import MoveOrder, PlacementConfig, PlacementManager, RoomHold, TierPolicy
from kvstore.engine.mover import Mover
from kvstore.engine.prefetch import HandoffLearner, Job, Prefetcher
from kvstore.engine.frames import Frames, PrefixBlock
from kvstore.engine.recovery import recover
from kvstore.engine.reserved import Reservation, ReservedPuts
from kvstore.engine.shared import SharedTier, WritePolicy, find_shared
from kvstore.keys import BlockHash, block_hashes, block_meta, check_key, iter_block_hashes, normalize_tokens
from kvstore.spec import KVSpec
from kvstore.tier import FrameWriter, Tier, TierStats

__all__ = ["KVStore", "EmbeddedStore", "StoreStats"]

log = logging.getLogger("kvstore.engine.store")
T = TypeVar("T")

_KEY_OF = operator.attrgetter("key")

PREFETCH_HOLD_S = 60.0
"""How long a prefetched prefix is held for its reader by default (its first read ends the hold)."""


@dataclass(slots=True)
class StoreStats:
    """A snapshot for operators and ``/admin/stats``."""

    blocks: int
    frame_bytes: int
    """Bytes of frames held, across tiers."""
    raw_bytes: int
    """Bytes the same KV takes decoded."""
    codec_bytes_saved: int
    counters: StoreCounters
    tiers: list[TierStats] = field(default_factory=list)
    moves: dict[str, int] = field(default_factory=dict)
    """Placement moves by kind (promoted, demoted, evicted, migrated) and bytes moved."""
    shared: dict[str, Any] = field(default_factory=dict)
    """The shared tier's write policy, bytes written and blocks adopted from other nodes."""
    heat: dict[str, Any] = field(default_factory=dict)
    """The heat scorer; for ``adaptive-rate``, the memory it follows and its shadow hits."""
    reads_by_tier: dict[str, int] = field(default_factory=dict)
    """Block reads served from each tier since start, on every read path (gets, shm handles,
    block routes, co-located reads reported back): with ``tokens_hit`` it splits hits by tier.
    The one account of reads by tier: ``/admin/stats``, ``/admin/tiers``, ``/metrics``
    (``kvstore_tier_reads_total``), the dashboard and ``kvstore stats`` all report this."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tiers"] = [self.tier_dict(t, self.reads_by_tier) for t in self.tiers]
        return data

    @staticmethod
    def tier_dict(tier: TierStats, reads_by_tier: Mapping[str, int]) -> dict[str, Any]:
        """``tier`` as the JSON routes show it: ``reads``, the block reads it served (from
        ``reads_by_tier``, however the bytes travelled), and ``backend_counters``, the tier's
        own operation counters (``TierCounters``). Those count only what went through the tier's
        methods (the server's reads and writes, placement's moves), never a co-located client's
        read of an shm slot: a tier that served every token can show 0 backend hits."""
        data = tier.to_dict()
        data["reads"] = reads_by_tier.get(tier.name, 0)
        data["backend_counters"] = data.pop("counters")
        return data


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
        background: run the placement mover in a thread; tests and the
            simulator call ``run_placement()`` themselves instead.
        write_policy: when blocks reach a shared tier (Redis), if there is one:
            ``write_through``, ``write_back``, ``selective`` (or a ``WritePolicy``).
        clock: a function returning seconds, non-decreasing (default ``time.time``).
            Every timestamp the engine records (an entry's ``created_s`` and
            ``last_access_s``: at a put, a read, an adoption from the shared tier,
            recovery) is a reading of it; it is kept as ``self.clock`` for callers that
            compare ages against those stamps (``kvstore.engine.evict.select(store, q,
            now_s=store.clock())``). A clock given here drives placement too (heat decay,
            pin TTLs, residency, the move log's ages): one clock for both lets a test age
            heat and entries together by advancing it, with no sleep. With none given,
            placement keeps its own ``time.monotonic`` (a wall clock can step back; heat
            must not) and entries keep wall time, as before.
        event_capacity: events kept for subscribers (``kvstore.engine.events``): how far one may fall
            behind before it must resynchronise from a snapshot.
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
    ) -> None:
        tiers = list(tiers)
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise InvalidInput("a store needs a non-empty list of Tier objects")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidInput(f"tier names must be unique, got {names}")
        overrides = dict(tier_codecs or {})
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise InvalidInput(f"tier_codecs names unknown tier(s) {unknown}; tiers are {names}")
        default = Codec.parse(codec)
        kinds = {t.name: _kind(t) for t in tiers}
        cold = {name for name, kind in kinds.items() if kind in COLD_KINDS}
        self.durable_tiers = frozenset(t.name for t in tiers if t.durable)
        """Names of the tiers whose acknowledged writes survive a crash (``Tier.durable``, as at start)."""
        # Hot tiers keep the store's codec; cold ones hold int8 unless told otherwise.
        codecs = {
            t.name: Codec.parse(overrides.get(t.name, Codec.INT8 if t.name in cold and default is Codec.RAW else default))
            for t in tiers
        }
        # NaN and Inf are refused up front only where a put writes into a non-raw tier
        # by design: the top tier, or the next one (admission). A put that falls
        # through to a cold tier, and a demotion, keep such a block raw instead.
        # The scan costs 2 ms per 32 MiB; a raw top tier does not need it.
        self._put_codecs_lossy = any(codecs[t.name] is not Codec.RAW for t in tiers[:2])
        policies = dict(tier_policies or {})
        unknown = sorted(set(policies) - set(names))
        if unknown:
            raise InvalidInput(f"tier_policies names unknown tier(s) {unknown}; tiers are {names}")
        self.placement = PlacementManager(
            [TierPolicy(t.name, t.capacity_bytes, cold=t.name in cold, **policies.get(t.name, {})) for t in tiers],
            scorer=scorer, config=placement, **({} if clock is None else {"clock": clock}),
        )
        self.clock: Callable[[], float] = time.time if clock is None else clock
        """The engine's wall clock: what ``created_s`` and ``last_access_s`` are readings of."""
        # One core owns the index; the mover, the shared tier and recovery get it explicitly.
        self._core = core = EngineCore(tiers, codecs, self.placement, clock=self.clock,
                                       event_capacity=event_capacity)
        policy = write_policy if isinstance(write_policy, WritePolicy) else WritePolicy(str(write_policy))
        shared = find_shared(tiers)
        self._shared = SharedTier(core, shared, policy) if shared is not None else None
        core.shared = self._shared
        self._mover = Mover(core, self._shared, on_move=self._moved)
        self._frames = Frames(core, self._shared, self._take_room)
        self._reserved = ReservedPuts(core, self._take_room, shared=self._shared is not None)
        self._prefetcher = Prefetcher(core, self._mover.execute,
                                      self._shared.adopt if self._shared is not None else None)
        self._forced_warned: dict[str, float] = {}
        self.handoffs = HandoffLearner(clock=self.placement.clock)
        """Hand-offs learned per namespace from the agents' puts and reads (``kvstore.engine.prefetch``)."""
        self.policy_for: Callable[[str], tuple[int | None, bool]] = lambda namespace: (None, True)
        """(policy version, whether learned hand-offs may be prefetched) for a namespace: the server
        points it at the planner's policies, so a canary that turns prefetch on is judged and
        rolled back like any policy."""
        self.recovered = recover(core)
        if background:
            self._mover.start()

    # -- public API -------------------------------------------------------------

    @property
    def tiers(self) -> list[Tier]:
        return self._core.tiers

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
        self._core.count(put_calls=1)
        if not keys:
            return 0
        if self._put_codecs_lossy:  # a put writes where int8 is the codec: refuse before storing anything
            _check_finite(kv[:, :, :, : n_blocks * spec.block_tokens])
        bt, spec_fp, now = spec.block_tokens, spec.fingerprint(), self._core.clock()
        keep = self._core.events.keep_tokens  # only vLLM's event format carries token ids
        heat_now = self.placement.clock()  # one reading for the whole chain: its blocks tie, depth decides
        held: list[BlockHash] = []  # this call's blocks: making room must not push out the chain being written
        try:
            for i, key in enumerate(keys):
                if is_current(self._core.entry(key), namespace, spec_fp):
                    self._core.count(blocks_deduped=1)
                    self.placement.accessed([key])  # a shared prefix written again is in use
                    if self.placement.lease(key):
                        held.append(key)
                    continue
                block = kv[:, :, :, i * bt : (i + 1) * bt]
                if self._put_block(key, block, namespace, spec_fp, i, now, heat_now, held,
                                   parent=keys[i - 1] if i else None,
                                   tokens=toks[i * bt:(i + 1) * bt].astype("<u4").tobytes() if keep else None):
                    self._core.count(blocks_written=1)
                else:
                    self._core.count(blocks_deduped=1)
        finally:
            for key in held:
                self.placement.release(key)
        if agent is not None:
            self._wrote(keys, namespace, spec, agent)
        return n_blocks * bt

    def get_kv(self, spec: KVSpec, tokens: Any, namespace: str = "default", *,
               out: torch.Tensor | None = None, agent: str | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix of ``tokens``.

        Args:
            out: optional CPU tensor ``[L, 2, H, >= full-block tokens, D]`` in
                ``spec.dtype`` to decode into; a server or an engine reusing one
                buffer skips the page faults of a fresh allocation per call.
            agent: who is reading, for learning hand-offs; None: not learned.

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
        self._core.count(get_calls=1, tokens_requested=spec.full_blocks(len(toks)) * spec.block_tokens)
        spec_fp = spec.fingerprint()
        found: list[tuple[BlockHash, IndexEntry]] = []
        adopted: dict[BlockHash, Any] = {}  # frames just read from the shared tier: not read twice
        for key in iter_block_hashes(spec, toks, namespace):
            entry = self._core.entry(key)
            if not is_current(entry, namespace, spec_fp):
                got = self._shared.adopt(key, namespace, spec_fp) if self._shared is not None else None
                if got is None or not is_current(got[0], namespace, spec_fp):
                    break
                entry, frame = got
                if frame is not None:
                    adopted[key] = frame
                    self._core.count(blocks_adopted=1)
            found.append((key, entry))
        bt = spec.block_tokens
        given = out is not None
        out = out[:, :, :, : len(found) * bt] if given else spec.empty_kv(len(found) * bt)
        # One reused frame buffer per thread: a fresh buffer per block would page-fault
        # at a fraction of copy speed (see kvstore.memory.buffers).
        scratch = _FRAMES.get(max((e.size for _, e in found), default=0))
        good = 0
        for i, (key, entry) in enumerate(found):
            part = out[:, :, :, i * bt : (i + 1) * bt]
            frame = adopted.pop(key, None)
            if frame is None and self._core.tier(entry.tier).lends_frames:
                # Decoded straight out of the slot, hashed on its first read only.
                try:
                    done = self._core.decode_into(entry, part)
                except (FrameError, InvalidKV) as exc:  # InvalidKV: a frame of another shape or dtype
                    log.warning("block %s in tier %s failed to decode (%s); dropped as a miss", key.hex(),
                                entry.tier, exc)
                    self._core.drop(entry, corrupt=True)
                    break
                if done is not None:
                    good += 1
                    continue
                # gone from that tier meanwhile (moved?): the copy path below looks once more
            if frame is not None:
                n = len(memoryview(frame).cast("B"))
                scratch[:n] = memoryview(frame).cast("B")
            else:
                n = self._core.read_into(entry, scratch)
            if n is None:  # moved between our index read and the copy: look once more
                again = self._core.entry(key)
                if again is None or again is entry or not is_current(again, namespace, spec_fp):
                    break
                entry = again
                n = self._core.read_into(entry, scratch)
                if n is None:
                    break
            try:
                # expect_checksum: a sound frame that is not the one indexed (a tier mix-up) is refused
                codec_mod.decode(scratch[:n], out=part, expect_checksum=entry.checksum)
            except (FrameError, InvalidKV) as exc:  # InvalidKV: a frame of another shape or dtype
                log.warning("block %s in tier %s failed to decode (%s); dropped as a miss", key.hex(), entry.tier, exc)
                self._core.drop(entry, corrupt=True)
                break
            good += 1
        hits = [key for key, _ in found[:good]]
        self._core.touch(hits)
        if agent is not None:
            self.handoffs.read(hits, namespace, agent)
        if self._shared is not None:
            for entry in self._shared.after_hits([e for _, e in found[:good]]):
                self._shared.replicate(entry)
        self._core.count(tokens_hit=good * bt)
        if good * bt < out.shape[3]:
            out = out[:, :, :, : good * bt] if given else out[:, :, :, : good * bt].clone()
        return out, good * bt

    # -- two-phase puts (``kvstore.engine.reserved``) -------------------------------------------------

    @property
    def reservations(self) -> ReservedPuts:
        """Reserved puts: a co-located writer fills top-tier slots itself, then commits."""
        return self._reserved

    def reserve_put(self, spec: KVSpec, tokens: Any, namespace: str, *, owner: str,
                    pid: int | None = None) -> Reservation | None:
        """Top-tier slots for the blocks of ``tokens`` not stored yet; None when there is no room
        for all of them. ``ReservedPuts.reserve`` has the rest."""
        self._check_open()
        spec = _check_spec(spec)
        return self._reserved.reserve(spec, normalize_tokens(tokens), namespace, owner, pid)

    def commit_put(self, reservation: str, owner: str, checksums: list[int], *,
                   agent: str | None = None) -> tuple[int, int]:
        """Publish a reservation's frames: (tokens covered, KV bytes written). ``ReservedPuts.commit``
        has the rest; ``agent`` is the writer, for learning hand-offs."""
        self._check_open()
        res = self._reserved.get(reservation) if agent is not None else None
        done = self._reserved.commit(reservation, owner, checksums)
        if res is not None:
            self._wrote(res.keys, res.namespace, res.spec, agent)
        return done

    def abort_put(self, reservation: str, owner: str) -> None:
        self._reserved.abort(reservation, owner)

    def lookup(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        """Tokens of the longest stored prefix of ``tokens``, from the index alone.

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec = _check_spec(spec)
        self._core.count(lookup_calls=1)
        spec_fp = spec.fingerprint()
        keys = block_hashes(spec, tokens, namespace)
        n = 0
        for key in keys:
            if not is_current(self._core.entry(key), namespace, spec_fp):
                break
            n += 1
        if n < len(keys) and self._shared is not None:  # other nodes may have stored the rest
            n += self._shared.count_prefix(keys[n:])
        return n * spec.block_tokens

    def durable_tokens(self, spec: KVSpec, tokens: Any, namespace: str = "default") -> int:
        """Tokens of the longest prefix of ``tokens`` whose blocks this store holds on durable tiers.

        A durable tier's acknowledged write survives a crash of this process (``Tier.durable``:
        nvme with fsync; Redis with an AOF on every master, as seen at start). Only blocks this
        store's index holds count: one only the shared tier holds is not vouched for. A prefix:
        blocks after a volatile one cannot be read after a crash anyway. What this says holds
        when it is read: placement may later promote a block into a volatile tier, and a frame
        put may rewrite one there, unless every tier is durable (``tiers="nvme"``).

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec = _check_spec(spec)
        spec_fp = spec.fingerprint()
        n = 0
        for key in block_hashes(spec, tokens, namespace):
            entry = self._core.entry(key)
            if not is_current(entry, namespace, spec_fp) or entry.tier not in self.durable_tiers:
                break
            n += 1
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
            if is_current(self._core.entry(key), namespace, spec_fp):
                removed += self._core.delete_key(key)
        return removed

    def delete_blocks(self, keys: Sequence[BlockHash], *, reason: str = "deleted") -> int:
        """Delete blocks by key (an operator's tool: no namespace check). Returns how many went."""
        self._check_open()
        try:
            checked = [check_key(key) for key in keys]  # all or nothing: validate before deleting
        except TypeError as exc:
            raise InvalidInput(f"keys must be a list of 32-byte block keys: {exc}") from exc
        return sum(self._core.delete_key(key, reason=reason) for key in checked)

    def codec_of(self, tier: str) -> Codec:
        """The codec new frames get in ``tier`` (cold tiers default to int8).

        Raises:
            InvalidInput: an unknown tier.
        """
        self._core.tier(tier)
        return self._core.codec_of(tier)

    def entry(self, key: BlockHash) -> IndexEntry | None:
        """The index entry of ``key`` (a live object: read, do not change)."""
        return self._core.entry(check_key(key))

    def entries_of(self, keys: Sequence[BlockHash]) -> list[IndexEntry | None]:
        """``entry`` for each key, read in one pass over the index."""
        return self._core.entries_of([check_key(key) for key in keys])

    def entries(self) -> list[IndexEntry]:
        """Copies of every index entry."""
        return self._core.snapshot()

    # -- for services that read and write frames themselves ---------------------------

    @property
    def closed(self) -> bool:
        return self._core.closed

    def touch(self, keys: Sequence[BlockHash], counts: Sequence[int] | None = None, *, tally: bool = True) -> None:
        """Count reads that bypassed ``get_kv`` (a co-located client, a block route) as accesses.

        Args:
            counts: reads of each key (default one each).
            tally: count them in ``reads_by_tier`` too; False for reads whose tokens no get counted
                (another protocol's), which would otherwise skew the per-tier hit ratio.
        """
        keys = list(keys)
        if counts is not None and len(counts) != len(keys):
            raise InvalidInput(f"touch: {len(counts)} counts for {len(keys)} keys")
        self._core.touch(keys, counts, tally=tally)

    def drop_entry(self, entry: IndexEntry, *, corrupt: bool) -> None:
        """Unpublish a block a reader outside ``get_kv`` found damaged (``corrupt``: its frame is
        deleted, counted in ``corrupt_blocks``) or gone from its tier (``stale_blocks``), as
        ``get_kv`` does with its own; a block rewritten meanwhile is left alone."""
        self._core.drop(entry, corrupt=corrupt)

    def count_lookup(self) -> None:
        """Count a lookup a service answered from its own index walk."""
        self._core.count(lookup_calls=1)

    def count_get(self, tokens_requested: int, tokens_hit: int, calls: int = 1) -> None:
        """Count gets a service served without ``get_kv`` (e.g. through shm handles)."""
        self._core.count(get_calls=calls, tokens_requested=tokens_requested, tokens_hit=tokens_hit)

    def put_frame(self, key: BlockHash, frame: Any, namespace: str, *, make_room: bool = False) -> IndexEntry:
        """Store an already encoded frame under ``key`` (``kvstore.engine.frames.Frames.put``).

        Raises:
            FrameError: the frame does not verify or has no kvstore metadata.
            InvalidInput: its namespace is not ``namespace``.
            TierFull: no tier has room. TierError: every tier with room failed.
        """
        self._check_open()
        return self._frames.put(check_key(key), frame, namespace, make_room=make_room)

    def put_frame_with(self, key: BlockHash, namespace: str, size: int, writer: FrameWriter, *,
                       make_room: bool = False) -> IndexEntry:
        """Store a frame that ``writer`` writes in place (``kvstore.engine.frames.Frames.put_with``).

        Raises:
            whatever ``writer`` raises: nothing is stored.
            FrameError, InvalidInput: the frame is not a kvstore frame of ``namespace``.
            TierFull: no tier has room. TierError: the tier failed.
        """
        self._check_open()
        return self._frames.put_with(check_key(key), namespace, size, writer, make_room=make_room)

    def read_frame(self, key: BlockHash, namespaces: frozenset[str] | None) -> tuple[Any, IndexEntry] | None:
        """``key``'s frame and entry, a read counted (``kvstore.engine.frames.Frames.read``)."""
        return self._frames.read(check_key(key), namespaces)

    def read_frame_with(self, key: BlockHash, namespaces: frozenset[str] | None,
                        reader: Callable[[memoryview, Any, IndexEntry], T], *, tally: bool = True) -> T | None:
        """``reader`` over ``key``'s verified frame, lent in place (``kvstore.engine.frames.Frames.read_with``)."""
        return self._frames.read_with(check_key(key), namespaces, reader, tally=tally)

    def block_entry(self, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
        """What ``read_frame`` would serve, without counting a read."""
        return self._frames.block_entry(check_key(key), namespaces)

    def current_entry(self, key: BlockHash, namespaces: frozenset[str] | None) -> IndexEntry | None:
        """``key``'s entry if its namespace is one of ``namespaces`` (None: any); a block of
        another namespace is reported exactly like an absent one."""
        return self._frames.current_entry(check_key(key), namespaces)

    def prefix_blocks(self, spec: KVSpec, tokens: Any, namespace: str, *,
                      agent: str | None = None) -> list[PrefixBlock]:
        """The blocks of the longest stored prefix of ``tokens`` (``kvstore.engine.frames.Frames.prefix``);
        ``agent``: a reader about to read them (a co-located get), for learning hand-offs."""
        self._check_open()
        spec = _check_spec(spec)
        toks = normalize_tokens(tokens)
        keys = block_hashes(spec, toks, namespace)
        found = self._frames.local_prefix(keys, namespace, spec.fingerprint())
        if agent is not None and found:
            self.handoffs.read(found, namespace, agent, key=_KEY_OF)
        if len(found) == len(keys):
            self._core.count(lookup_calls=1)
            return found
        n = self.lookup(spec, toks, namespace) // spec.block_tokens  # counts the call
        return self._frames.extend_prefix(found, keys[:n], namespace, spec.fingerprint())

    def durable_blocks(self, blocks: Sequence[PrefixBlock]) -> int:
        """How many of ``blocks``, from the first, sit on durable tiers in this store's index
        (as ``durable_tokens`` counts, without walking the keys again)."""
        n = 0
        for b in blocks:
            if b.entry is None or b.tier not in self.durable_tiers:
                break
            n += 1
        return n

    @property
    def shared_tier(self) -> Tier | None:
        """The tier other stores write to (Redis), where this store's index may be behind."""
        return self._frames.shared_tier

    def tier_named(self, name: str) -> Tier | None:
        """The tier called ``name``, or None."""
        return self._core.tier(name) if self._core.has_tier(name) else None

    # -- events (``kvstore.engine.events``) -------------------------------------------------------

    @property
    def events(self) -> EventLog:
        """Every block stored, moved, removed, and every clear, numbered."""
        return self._core.events

    def events_snapshot(self, namespaces: frozenset[str] | None = None) -> tuple[int, list[IndexEntry]]:
        """(the event number the copy is valid at, copies of the entries of ``namespaces`` (None: all)).
        Replaying the events after that number onto the copy gives the index."""
        return self._core.events_snapshot(namespaces)

    # -- locality: prefetch, hand-off, retention (``kvstore.engine.prefetch``, placement rule 5) ----------

    def prefetch(self, spec: KVSpec, tokens: Any, namespace: str = "default", *,
                 reason: str = "requested by a caller", trigger: str = "requested",
                 hold_s: float = PREFETCH_HOLD_S) -> int:
        """Bring the longest stored prefix of ``tokens`` to the top tier, in the background.

        Blocks only the shared tier holds (another node stored them) are adopted first, so a
        node reading from the shared tier gets them into its own arena. Returns at once.

        Args:
            hold_s: then hold the blocks in the top tier this long, or until their first read
                (a soft retention no tenant pays for, within a quarter of the tier): without
                it, churn in a full top tier could push them out before their reader comes.
                0: no hold.

        Returns:
            Tokens of the prefix the prefetch will bring (what a get would find now).

        Raises:
            InvalidSpec, InvalidTokens: bad input.
        """
        self._check_open()
        spec = _check_spec(spec)
        toks = normalize_tokens(tokens)
        keys = block_hashes(spec, toks, namespace)
        spec_fp = spec.fingerprint()
        n = len(self._core.current_prefix(keys, namespace, spec_fp))
        if n < len(keys) and self._shared is not None:
            n += self._shared.count_prefix(keys[n:])
        if n:
            self._prefetcher.submit(Job(keys[:n], namespace, spec_fp, trigger, reason, hold_s=hold_s,
                                        policy_version=self.policy_for(namespace)[0],
                                        block_tokens=spec.block_tokens))
        return n * spec.block_tokens

    def prefetch_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued prefetch is done (tests and benches); False on timeout."""
        return self._prefetcher.idle(timeout_s)

    def prefetch_log(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest prefetch decisions, newest last: trigger, reason, source tiers, what moved."""
        return self._prefetcher.log(limit)

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
        _check_retention(ttl_s, priority)
        owner = namespace if owner is None else owner
        keys = self._current_keys(spec, tokens, namespace)
        n, nbytes, total = self.placement.retain(keys, float(ttl_s), owner=owner, priority=priority,
                                                 quota_bytes=quota_bytes)
        spec = _check_spec(spec)
        top = self._core.tiers[0].name
        below = [k for k in keys if (e := self._core.entry(k)) is not None and e.tier != top]
        if below:  # the mover would promote them too, but only at its next round and within its budget
            self._prefetcher.submit(Job(keys, namespace, spec.fingerprint(), "retain",
                                        f"retained by {owner!r} for {ttl_s:g} s",
                                        policy_version=self.policy_for(namespace)[0],
                                        block_tokens=spec.block_tokens))
        return {"tokens": n * spec.block_tokens, "blocks": n, "bytes": nbytes, "expires_in_s": float(ttl_s),
                "priority": priority, "owner": owner, "retained_bytes": total, "quota_bytes": quota_bytes}

    def release(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, owner: str | None = None) -> int:
        """End the retention of the stored prefix of ``tokens`` (only ``owner``'s, when given);
        returns how many blocks it ended for."""
        return self.placement.unretain(self._current_keys(spec, tokens, namespace), owner)

    def handoff(self, spec: KVSpec, tokens: Any, namespace: str = "default", *, to: str = "here",
                ttl_s: float | None = None, owner: str | None = None,
                quota_bytes: int | None = None) -> dict[str, Any]:
        """Place the stored prefix of ``tokens`` where its next reader will read it.

        Args:
            to: ``"here"``: the reader is on this node: keep the blocks in the top tier for
                ``ttl_s`` (a retention of ``owner``'s, within ``quota_bytes``). Anything else (a
                node's name, or ``"shared"``): the reader is on another node: copy every block
                to the shared tier now, whatever the write policy, so that node finds it (its
                ``prefetch`` brings it into its own arena).
            ttl_s: how long to hold for ``"here"`` (default 120 s).

        Returns:
            tokens and blocks of the prefix; held (blocks retained here); shared (blocks the
            shared tier holds now).

        Raises:
            InvalidInput: a bad ``to`` or ``ttl_s``, or another node named with no shared tier.
            RetainQuotaExceeded: ``"here"`` over the owner's quota.
        """
        if not isinstance(to, str) or not to or len(to) > 256:
            raise InvalidInput(f"to must be 'here', 'shared' or a node name (at most 256 characters), got {to!r}")
        spec = _check_spec(spec)
        keys = self._current_keys(spec, tokens, namespace)
        out = {"tokens": len(keys) * spec.block_tokens, "blocks": len(keys), "held": 0, "shared": 0, "to": to}
        if to == "here":
            ttl = 120.0 if ttl_s is None else ttl_s
            _check_retention(ttl, 0)
            out["held"] = self.placement.retain(keys, float(ttl), owner=namespace if owner is None else owner,
                                                quota_bytes=quota_bytes)[0]
            return out
        if self._shared is None:
            raise InvalidInput(f"a hand-off to {to!r} needs a shared tier (KVSTORE_REDIS_URL) that both nodes "
                               "use; this store has none")
        shared = 0
        for key in keys:
            entry = self._core.entry(key)
            if entry is None:
                break
            if entry.tier == self._shared.name or self._shared.replica(key) is not None \
                    or self._shared.replicate(entry):
                shared += 1
        out["shared"] = shared
        return out

    def retention_of(self, key: BlockHash) -> dict[str, Any] | None:
        """``key``'s retention (owner, priority, expires_in_s), or None."""
        return self.placement.retention(check_key(key))

    def retained_bytes(self) -> dict[str, int]:
        """Bytes each owner retains now."""
        return self.placement.retained_bytes()

    def _wrote(self, keys: Sequence[BlockHash], namespace: str, spec: KVSpec, agent: str) -> None:
        """An agent stored ``keys``: remember it for hand-off learning, and when this namespace has
        shown hand-offs (and its policy lets it), hold the chain in the top tier for its reader."""
        self.handoffs.wrote(keys, namespace, agent)
        learned = self.handoffs.pattern(namespace)
        if learned is None or not keys:
            return
        version, allowed = self.policy_for(namespace)
        if not allowed:
            return
        count, gap = learned
        hold = min(600.0, max(10.0, 2 * gap))
        self._prefetcher.submit(Job(list(keys), namespace, spec.fingerprint(), "hand-off",
                                    f"{namespace!r} showed {count} hand-offs in {self.handoffs.window_s:g} s "
                                    f"(median gap {gap:.1f} s): held {hold:.0f} s for the next agent",
                                    hold_s=hold, policy_version=version, block_tokens=spec.block_tokens))

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
        entry = self._core.entry(check_key(key))
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
        self._core.tier(tier)  # InvalidInput naming the tiers when there is no such tier
        entry = self._core.entry(check_key(key))
        if entry is None or entry.tier == tier:
            return False
        return self._mover.execute(MoveOrder(key, entry.tier, tier, entry.size, reason))

    def moves(self, limit: int = 100) -> list[dict[str, Any]]:
        """The store's latest moves, newest last; ``age_s`` says how long ago each was."""
        now = self.placement.clock()
        return [m.to_dict(now) for m in self.placement.log(limit)]

    def run_placement(self) -> int:
        """One placement round now (what the background mover does); returns moves made."""
        self._check_open()
        return self._mover.run_once()

    def _current_keys(self, spec: KVSpec, tokens: Any, namespace: str) -> list[BlockHash]:
        self._check_open()
        spec = _check_spec(spec)
        spec_fp = spec.fingerprint()
        keys = []
        for key in iter_block_hashes(spec, tokens, namespace):
            if not is_current(self._core.entry(key), namespace, spec_fp):
                break
            keys.append(key)
        return keys

    def _put_block(self, key: BlockHash, block: torch.Tensor, namespace: str, spec_fp: str, depth: int,
                   now: float, heat_now: float, held: list[BlockHash], *, parent: BlockHash | None,
                   tokens: bytes | None) -> bool:
        """Write one block of a put where admission places it, with room made there; False if
        another put wrote it meanwhile. A written block is leased and added to ``held`` (making
        room for the rest of its chain must not push it out).

        A write the tier refuses although room was made and held (a reader still holds a range
        it freed, or its disk is fuller than its capacity says) is tried once more, with room
        forced.
        """
        top = self._core.tiers[0]
        size = codec_mod.frame_size(block.shape, block.dtype, self._core.codec_of(top.name), meta_len=_META_BUDGET)
        for force in (False, True):
            with self._take_room(size, force=force) as room:  # outside any claim: it moves other keys
                with self._core.claim(key):
                    if is_current(self._core.entry(key), namespace, spec_fp):  # written while we waited
                        return False
                    try:
                        entry = self._write(key, block, namespace, spec_fp, depth, now,
                                            stored_tokens=depth * block.shape[3], first=room.tier)
                    except TierFull:
                        if force:
                            raise
                        continue
                    self._core.publish(entry, now=heat_now, parent=parent, tokens=tokens)
                    if self._shared is not None:
                        self._shared.after_put(entry, block, block_meta(namespace, spec_fp, depth))
                    if self.placement.lease(key):
                        held.append(key)
                    return True
        raise AssertionError("unreachable: the forced try returns or raises")

    def _take_room(self, size: int, *, force: bool = False) -> RoomHold:
        """Room for a new frame of ``size`` bytes in the tier admission picks, made now (colder
        entries demoted or evicted) and held until the hold is released, after the write."""
        target = self.placement.place_new(size)
        if force:
            self._room_forced(target)
        room = self.placement.hold_room(target, size, force=force)
        try:
            for order in room.orders:
                self._mover.execute(order)
        except BaseException:
            room.release()
            raise
        return room

    def _room_forced(self, tier: str) -> None:
        self._core.count(room_forced=1)
        now = time.monotonic()
        if now - self._forced_warned.get(tier, -math.inf) >= 60:  # at most once a minute per tier
            self._forced_warned[tier] = now
            log.warning("tier %s refused a write although placement had made room (a reader holds a freed "
                        "range, or its disk holds less than its capacity): freeing room by force; "
                        "counter room_forced", tier)

    def _moved(self, order: MoveOrder, new_size: int) -> None:
        self._core.count(**{f"blocks_{order.reason.split(':', 1)[0]}": 1})

    def stats(self) -> StoreStats:
        blocks, frame_bytes, raw_bytes = self._core.totals()
        counters = self._core.counters()
        return StoreStats(
            blocks=blocks,
            frame_bytes=frame_bytes,
            raw_bytes=raw_bytes,
            codec_bytes_saved=raw_bytes - frame_bytes,
            counters=counters,
            tiers=[t.stats() for t in self._core.tiers],
            moves=self.placement.counters(),
            heat=self.placement.scorer_state(),
            shared=self._shared.stats() if self._shared is not None else {},
            reads_by_tier=self._core.reads_by_tier(),
        )

    def read_counters(self) -> tuple[StoreCounters, dict[str, int]]:
        """The counters and block reads by tier, without asking any tier (cheap: for sampling)."""
        return self._core.counters(), self._core.reads_by_tier()

    def close(self) -> None:
        """Close every tier. Idempotent; the store refuses calls afterwards."""
        if self._core.closed:
            return
        self._prefetcher.close()
        self._mover.stop()  # no move may start against tiers that are closing
        self._reserved.close()
        self._core.closed = True
        self._core.clear()
        for tier in self._core.tiers:
            try:
                tier.close()
            except TierError as exc:  # close the rest regardless
                log.warning("closing tier %s failed: %s", tier.name, exc)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------

    def _write(
        self, key: BlockHash, block: torch.Tensor, namespace: str, spec_fp: str, depth: int,
        now: float, *, stored_tokens: int, first: int = 0,
    ) -> IndexEntry:
        """Encode ``block`` straight into the first tier with room, from tier ``first`` down.

        Runs under ``claim(key)``.
        """
        meta = block_meta(namespace, spec_fp, depth)
        failure: TierError | None = None
        for tier in self._core.tiers[first:]:
            codec = self._core.codec_of(tier.name)
            try:
                try:
                    n, header = _encode_into_tier(tier, key, block, codec, meta)
                except InvalidKV:
                    if codec is Codec.RAW or self._put_codecs_lossy:
                        raise
                    # int8 cannot hold it (NaN or Inf): keep it exact, as a demotion would
                    n, header = _encode_into_tier(tier, key, block, Codec.RAW, meta)
                    self._core.count(blocks_kept_raw=1)
            except TierFull as exc:
                failure = failure or exc
                continue
            except TierError as exc:  # down or failing: degrade to the next tier
                self._core.count(tier_errors=1)
                log.warning("tier %s failed a put (%s); trying the next tier", tier.name, exc)
                failure = exc if failure is None or isinstance(failure, TierFull) else failure
                continue
            return IndexEntry(
                key=key, tier=tier.name, size=n, codec=header.codec, checksum=header.body_checksum,
                raw_bytes=header.raw_nbytes, namespace=namespace, spec_fp=spec_fp, depth=depth,
                created_s=now, last_access_s=now,
            )
        if isinstance(failure, TierFull) or failure is None:
            raise TierFull(
                f"no tier has room for a block ({', '.join(self._core.tier_names)} are full); "
                f"{stored_tokens} tokens are stored",
                stored_tokens=stored_tokens,
            ) from failure
        raise failure

    def _check_open(self) -> None:
        if self._core.closed:
            raise StoreClosed("the store is closed")


class EmbeddedStore(KVStore):
    """An in-process store. With no ``tiers``, the tiers ``Settings`` names.

    The default is shm -> cxl -> nvme (under ``./kvstore-data``), with Redis
    above nvme when ``KVSTORE_REDIS_URL`` is set.

    Args:
        tiers: tiers to use instead of the configured ones.
        codec, tier_codecs: as for ``KVStore``; ``codec`` defaults to the settings'.
        settings: defaults to ``Settings.from_env()``.
        placement: ``placement``, ``tier_policies``, ``scorer``, ``background``, ``write_policy``,
            ``clock``, as for ``KVStore``.
    """

    def __init__(
        self,
        tiers: Sequence[Tier] | None = None,
        *,
        codec: str | Codec | None = None,
        tier_codecs: Mapping[str, str | Codec] | None = None,
        settings: Settings | None = None,
        **placement: Any,
    ) -> None:
        settings = settings or Settings.from_env()
        if tiers is None:
            from kvstore.engine.build import build_tiers  # lazy: tiers import kvstore.tier

            tiers = build_tiers(settings)
        super().__init__(tiers, codec=codec or settings.codec, tier_codecs=tier_codecs, **placement)


# -- helpers ---------------------------------------------------------------------


def _frame_buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


# One frame buffer per thread, grown (at least doubling) to the largest frame read so far.
_FRAMES = Scratch(_frame_buffer, len, grow=2.0)


MAX_RETAIN_S = 86400.0
"""The longest retention the engine takes (a day); a server may allow less."""


def _check_retention(ttl_s: Any, priority: Any) -> None:
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_RETAIN_S:
        raise InvalidInput(f"ttl_s must be a number of seconds in (0, {MAX_RETAIN_S:g}], got {ttl_s!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
        raise InvalidInput(f"priority must be an int in 0..9, got {priority!r}")


def _check_spec(spec: Any) -> KVSpec:
    if not isinstance(spec, KVSpec):
        raise InvalidInput(f"spec must be a KVSpec, got {type(spec).__name__}")
    return spec


def _encode_into_tier(tier: Tier, key: BlockHash, block: torch.Tensor, codec: Codec,
                      meta: bytes) -> tuple[int, codec_mod.FrameHeader]:
    """Encode ``block`` in ``codec`` straight into ``tier``'s slot for ``key``: (frame bytes, its header)."""
    headers: list[codec_mod.FrameHeader] = []

    def writer(view: memoryview) -> int:
        n = codec_mod.encode_into(block, view, codec, meta=meta)
        headers.append(codec_mod.read_header(view[:n]))
        return n

    n = tier.put_with(key, codec_mod.frame_size(block.shape, block.dtype, codec, meta_len=len(meta)), writer)
    return n, headers[-1]


def _check_finite(kv: torch.Tensor) -> None:
    # aminmax propagates NaN and Inf and runs ~20x faster than isfinite().all() on fp16
    # (13 ms against 265 ms for 128 MiB here): a tenth of the int8 encode it protects.
    if kv.numel() == 0:
        return
    lo, hi = torch.aminmax(kv)
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise InvalidKV("kv holds NaN or Inf values; the int8 codec cannot store them (nothing was stored)")


COLD_KINDS = ("nvme", "redis")
"""Tier kinds whose frames are int8 by default: slow media, where halving bytes pays."""

_META_BUDGET = 256  # bytes reserved for frame metadata when sizing a block ahead of encoding


def _kind(tier: Tier) -> str:
    kind = getattr(tier, "kind", None)
    return kind if isinstance(kind, str) else tier.stats().kind



