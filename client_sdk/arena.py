"""The co-located arena as a client maps it: slot reads, remembered handles, staging leases.

``Arena`` maps a server's shm arena (``kvstore.memory.shm.ShmReader``) and its
staging segment, and holds what a client learns of them: the slot handles the
server named (``HandleCache``: a repeat get reads them with no request while their
generation stands), the frames already verified in a slot (``VerifiedSlots``), the
reads to report for heat (``AccessLog``) and its idle staging leases.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from client_sdk._common import (VERIFIED_VIEW, BlockFill, BlockSink, BlockWriter, ClientStats, give_frame, kv_bytes,
                                verified_header)
from client_sdk.slot_pool import SlotPool
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import FrameError, InvalidKV, KVStoreError, ServiceError
from kvstore.keys import block_hashes, meta_prefix
from kvstore.memory.shm import SHM_DIR, IndexHit, ShmReader, ShmSlotWriter, SlotHandle
from kvstore.spec import KVSpec
from kvstore.wire.rest import MAX_TOUCH_KEYS

__all__ = ["Arena", "HandleCache", "AccessLog", "VerifiedSlots"]


def _indexed(key_hex: str, hit: IndexHit) -> dict:
    """A block the shared key index found, in the form the server's handles answers take (no
    checksum: the frame's own header is checked instead, under the slot's seqlock)."""
    h = hit.handle
    return {"key": key_hex, "checksum": None, "verified": hit.verified,
            "handle": {"index": h.index, "offset": h.offset, "length": h.length, "gen": h.gen}}


class VerifiedSlots:
    """Arena slots (index, generation) whose frame this client verified, with its header.

    A generation is never reused and a published slot's bytes never change, so while
    a read lease shows the same generation the bytes are those that verified: a repeat
    read copies and hashes nothing, as ``Arena.fill_from_handles`` does for ``get_kv``.
    """

    def __init__(self, max_entries: int = 65_536) -> None:
        self._max = max_entries
        self._slots: OrderedDict[tuple[int, int], "codec_mod.FrameHeader"] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, index: int, gen: int, checksum: int | None) -> "codec_mod.FrameHeader | None":
        with self._lock:
            header = self._slots.get((index, gen))
            if header is not None:
                self._slots.move_to_end((index, gen))
        return header if header is not None and (checksum is None or header.body_checksum == checksum) else None

    def add(self, index: int, gen: int, header: "codec_mod.FrameHeader") -> None:
        with self._lock:
            self._slots[(index, gen)] = header
            while len(self._slots) > self._max:
                self._slots.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()


class HandleCache:
    """Slot handles a co-located client was given, by block key, so a repeated get
    can skip asking the server where its blocks are.

    A remembered handle is only a hint: the reader copies under the slot's
    generation check, and the server makes the generation odd before a slot is
    deleted, moved or reused, so a stale handle reads as a miss (then the
    client asks the server) and never as another block's bytes.
    """

    MEMO_SEQUENCES = 1024
    MEMO_MAX_TOKENS = 8192
    """Sequences up to this long have their block keys memoized (at most 32 KiB of ids each)."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self._blocks: OrderedDict[str, dict] = OrderedDict()
        self._keys: OrderedDict[tuple[str, str, bytes], tuple[list[str], list[bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def keys_of(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> tuple[list[str], list[bytes]]:
        """The block keys of ``tokens``, hex and raw, memoized: an agent re-reads the same prefixes."""
        if len(tokens) > self.MEMO_MAX_TOKENS:
            raw = block_hashes(spec, tokens, namespace)
            return [k.hex() for k in raw], raw
        memo = (namespace, spec.fingerprint(), tokens.tobytes())
        keys = self._keys.get(memo)
        if keys is None:
            raw = block_hashes(spec, tokens, namespace)
            keys = ([k.hex() for k in raw], raw)
            with self._lock:
                self._keys[memo] = keys
                while len(self._keys) > self.MEMO_SEQUENCES:
                    self._keys.popitem(last=False)
        return keys

    def remember(self, blocks: Sequence[dict]) -> None:
        with self._lock:
            for b in blocks:
                if b.get("handle") is not None:
                    self._blocks[b["key"]] = b
                    self._blocks.move_to_end(b["key"])
            while len(self._blocks) > self.max_entries:
                self._blocks.popitem(last=False)

    def lookup(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> list[dict] | None:
        """Every full block of ``tokens`` with a remembered handle, or None if any is missing."""
        keys, _ = self.keys_of(spec, tokens, namespace)
        with self._lock:
            found = [self._blocks.get(k) for k in keys]
        return found if keys and None not in found else None  # type: ignore[return-value]

    def blocks(self, keys: Sequence[str]) -> list[dict | None]:
        """The remembered block (key, checksum, handle) of each hex key, or None."""
        with self._lock:
            return [self._blocks.get(k) for k in keys]

    def forget(self, blocks: Sequence[dict]) -> None:
        with self._lock:
            for b in blocks:
                self._blocks.pop(b["key"], None)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._keys.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class AccessLog:
    """Reads a client served from remembered handles, for the server's heat and counters.

    Placement ranks blocks by how often they are read; reads the server never
    saw would let it demote the blocks a co-located agent uses most. They are
    reported in batches (``POST /v1/kv/touch``): when ``max_keys`` reads are
    pending or the oldest is ``max_age_s`` old, and when the client closes.
    Repeated reads of a key travel as one key and a count, so a hot loop over
    one prefix sends a few bytes, not a key per read.
    """

    def __init__(self, max_keys: int = 4096, max_age_s: float = 1.0) -> None:
        self.max_keys, self.max_age_s = max_keys, max_age_s
        self.on_pending: Callable[[], None] | None = None
        """Called (outside the lock, from the reading thread) when a read is added to an empty log:
        the client then sends the report within ``max_age_s`` even if no further read comes."""
        self._counts: dict[str, int] = {}
        self._reads = self._gets = self._requested = self._hit = 0
        self._since: float | None = None
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[dict], requested: int, hit: int) -> None:
        with self._lock:
            counts = self._counts
            for b in blocks:
                counts[b["key"]] = counts.get(b["key"], 0) + 1
            self._reads += len(blocks)
            self._gets += 1
            self._requested += requested
            self._hit += hit
            first = self._since is None
            if first:
                self._since = time.monotonic()
        if first and self.on_pending is not None:
            self.on_pending()

    def due(self) -> bool:
        # One read of _since: the reporter thread's drain() may set it to None in between.
        since = self._since
        return since is not None and (self._reads >= self.max_keys or time.monotonic() - since >= self.max_age_s)

    MAX_REPORT_KEYS = MAX_TOUCH_KEYS
    """The most keys one report carries (the server's limit); more wait for the next report."""

    def drain(self) -> dict | None:
        """The next report (at most ``MAX_REPORT_KEYS`` keys), or None when nothing is pending."""
        with self._lock:
            if not self._counts and not self._gets:
                return None
            items = list(self._counts.items())
            now, rest = items[:self.MAX_REPORT_KEYS], items[self.MAX_REPORT_KEYS:]
            report = {"keys": [k for k, _ in now], "counts": [n for _, n in now], "gets": self._gets,
                      "tokens_requested": self._requested, "tokens_hit": self._hit}
            self._counts = dict(rest)
            self._reads = sum(n for _, n in rest)
            self._gets = self._requested = self._hit = 0
            if not rest:
                self._since = None  # else the rest keep the oldest read's time: due by age soon
            return report


class _Mappings:
    """An arena's mappings and descriptors, closed once (``Arena.close``, or its finalizer)."""

    def __init__(self, reader: ShmReader, staging: mmap.mmap) -> None:
        self.reader, self.staging = reader, staging
        self.writer: ShmSlotWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader.close()
        with contextlib.suppress(BufferError):  # a view still held: the GC unmaps later
            self.staging.close()


class Arena:
    """The server's shm arena (read, through ``ShmReader``) and staging segment (write), mapped here.

    Raises:
        KVStoreError: either segment cannot be opened (not co-located after all).
    """

    def __init__(self, segment: str, staging_segment: str, shm_dir: str = SHM_DIR, *,
                 reserved_puts: bool = False) -> None:
        self.segment = segment
        self.reader = ShmReader(segment, shm_dir)
        self.reserved_puts = reserved_puts
        """The server reserves top-tier slots for puts (``/v1/kv/reserve``): write frames there."""
        self._shm_dir = shm_dir
        self._writer: ShmSlotWriter | None = None
        self.staging_segment = staging_segment
        try:
            fd = os.open(os.path.join(shm_dir, staging_segment), os.O_RDWR)
        except OSError as exc:
            self.reader.close()
            raise ServiceError(f"staging segment {staging_segment!r} cannot be opened: {exc}") from exc
        try:
            self.staging = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._maps = _Mappings(self.reader, self.staging)
        self._unmap = weakref.finalize(self, self._maps.close)
        """Unmaps when called (``close``) or when the arena is collected: a retired arena goes
        once the last stream or call holding it is done (it holds nothing that points back)."""
        self.handles = HandleCache()
        self.namespaces: frozenset[str] | None = None
        """The namespaces the client's token may read (``/v1/info``; None: all). Reads with no
        request serve only these: another tenant's blocks in the arena are the server's to refuse."""
        self.pool = SlotPool()
        self.pooled_puts = reserved_puts
        """The server lends pool slots (one request a put); off once it answers that it does not."""
        self.commit_socket: str | None = None
        """The server's commit channel (``/v1/info``): where its pooled puts' one request goes."""
        self.no_room_until = 0.0
        """``time.monotonic()`` before which puts go straight through staging: the server last
        answered that its top tier has no room for new blocks (a full store places them lower), and
        asking for slots on every put would cost two requests a put that both come back empty."""
        self.verified = VerifiedSlots()
        self.accesses = AccessLog()
        self._idle: list[dict] = []
        self.leases: list[dict] = []
        """Every staging lease this client holds; each put uses one no other put is using."""
        self._lock = threading.Lock()

    def blocks_for(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> list[dict] | None:
        """Every full block of ``tokens`` with its slot in this arena, found with no request: a
        remembered handle, else the arena's shared key index (``ShmReader.look_up``; what it
        finds is remembered). None when one is in neither (another tier may hold it, or none:
        ask the server), or ``tokens`` hold no full block."""
        hexes, raw = self.handles.keys_of(spec, tokens, namespace)
        if not hexes:
            return None
        # A remembered slot whose generation moved on (moved, replaced) is looked up again
        found = [b if b is not None and self.holds(b) else None for b in self.handles.blocks(hexes)]
        ask = [i for i, b in enumerate(found) if b is None]
        if not self.reader.owner_alive() or (self.namespaces is not None and namespace not in self.namespaces):
            return None  # a killed server's arena is not the store; a namespace not granted: the server says so
        if ask:
            if not self.reader.indexed:
                return None
            new = []
            for i, hit in zip(ask, self.reader.look_up([raw[j] for j in ask])):
                if hit is None:
                    return None
                found[i] = _indexed(hexes[i], hit)
                new.append(found[i])
            self.handles.remember(new)
        return found  # type: ignore[return-value]

    def blocks_by_key(self, hexes: Sequence[str], keys: Sequence[bytes], namespace: str) -> list[dict | None]:
        """The slot of each key in this arena as far as this client can tell with no request (a
        remembered handle whose generation stands, else the shared key index), or None.

        A key given by the caller (not hashed here from tokens under ``namespace``) may name
        another namespace's block: one the index finds counts only when its frame's metadata
        names ``namespace``, read under the slot's seqlock (the server's answers are checked so).
        """
        if not self.reader.owner_alive() or (self.namespaces is not None and namespace not in self.namespaces):
            return [None] * len(hexes)  # a killed server's arena is not the store; an ungranted namespace: ask
        found = [b if b is not None and self.holds(b) else None for b in self.handles.blocks(hexes)]
        ask = [i for i, b in enumerate(found) if b is None]
        if ask and self.reader.indexed:
            new = []
            prefix = meta_prefix(namespace)
            for i, hit in zip(ask, self.reader.look_up([keys[j] for j in ask])):
                if hit is not None and codec_mod.meta_starts_with(self.reader.frame_view(hit.handle), prefix) \
                        and self.reader.current(hit.handle):
                    found[i] = _indexed(hexes[i], hit)
                    new.append(found[i])
            self.handles.remember(new)
        return found

    def served_from_cache(self, blocks: Sequence[dict], bt: int, stats: ClientStats) -> None:
        """A get served from remembered handles: queue its report, count it."""
        self.accesses.add(blocks, len(blocks) * bt, len(blocks) * bt)
        stats.shm_gets += 1
        stats.shm_cached_gets += 1
        stats.last_medium = "shm"

    def take_lease(self, nbytes: int) -> dict | None:
        """An idle lease of at least ``nbytes`` (the smallest), or None: then lease a new one."""
        with self._lock:
            fits = [i for i, lease in enumerate(self._idle) if lease["length"] >= nbytes]
            if not fits:
                return None
            return self._idle.pop(min(fits, key=lambda i: self._idle[i]["length"]))

    def add_lease(self, lease: dict) -> None:
        with self._lock:
            self.leases.append(lease)

    def give_back(self, lease: dict) -> None:
        with self._lock:
            self._idle.append(lease)

    def drop_lease(self, lease: dict) -> None:
        """Forget a lease the server no longer has (expired)."""
        with self._lock:
            self.leases = [x for x in self.leases if x is not lease]

    def fill_from_handles(self, blocks: Sequence[dict], out: torch.Tensor, bt: int,
                          stats: ClientStats | None = None, dst: np.ndarray | None = None) -> list[int]:
        """Copy each block with a handle straight out of the arena into its slice of ``out``.

        A handle's first read verifies the whole frame (header and body
        checksum, under a read lease) and remembers a view of its payload.
        Later reads of the same handle copy that view under the seqlock and
        hash nothing: a generation is never reused, so an unchanged one means
        the same bytes that verified. The server verified or encoded every
        frame it put in the arena, so this read-once check guards the client
        against a wrong handle, a tier mix-up or a frame damaged in the arena
        before it first read it, without paying the hash (about 40% of a
        32 MiB get here) on every get.

        Args:
            dst: ``out`` as same-size ints in numpy, when the caller has it at hand.

        Returns:
            Block indexes still to fetch (no handle, stale handle, or a frame that failed).
        """
        missing = []
        block_shape = (*out.shape[:3], bt, out.shape[4])
        ref: list = []  # the first trusted header of this get (``trusted_payload``)
        for i, b in enumerate(blocks):
            h = b.get("handle")
            if h is None:
                missing.append(i)
                continue
            src = b.get(VERIFIED_VIEW)
            if src is not None:  # verified before: a plain copy under the seqlock
                if dst is None:
                    dst = int_view(out)
                if self.reader.copy_current(h["index"], h["gen"], dst[:, :, :, i * bt:(i + 1) * bt], src):
                    if stats is not None:
                        stats.shm_frames_copied += 1
                else:
                    missing.append(i)
                continue
            handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
            src = self.trusted_payload(handle, block_shape, out.dtype, ref) if b.get("verified") else None
            if src is not None:  # the server hashed this publication: copy, hash nothing
                if dst is None:
                    dst = int_view(out)
                if self.reader.copy_current(h["index"], h["gen"], dst[:, :, :, i * bt:(i + 1) * bt], src):
                    b[VERIFIED_VIEW] = src
                    if stats is not None:
                        stats.shm_frames_trusted += 1
                else:
                    missing.append(i)
                continue
            part = out[:, :, :, i * bt:(i + 1) * bt]
            try:
                with self.reader.lease(handle) as view:
                    if view is None:  # moved or gone since the server looked: generation changed
                        missing.append(i)
                        continue
                    header = codec_mod.read_header(view)
                    codec_mod.decode(view, out=part, expect_checksum=b.get("checksum"))
            except (FrameError, InvalidKV, KVStoreError):
                missing.append(i)
                continue
            if stats is not None:
                stats.shm_frames_verified += 1
            ints = SAME_SIZE_INTS.get(part.element_size(), (None, None))[1]
            if header.codec is codec_mod.Codec.RAW and not header.lz4 and ints is not None:
                b[VERIFIED_VIEW] = self.reader.frame_array(handle, header.payload_offset, ints, header.shape)
        return missing

    def trusted_payload(self, handle: SlotHandle, shape: tuple[int, ...], dtype: torch.dtype,
                        ref: list) -> np.ndarray | None:
        """The payload of a frame the server verified whole (the slot's verified word), as same-size
        ints in the arena, once it is a raw frame of ``shape`` and ``dtype``; None otherwise (the
        caller reads it the checked way) or when the slot changed meanwhile.

        ``ref`` carries, across the blocks of one get, the first such header and its layout bytes:
        a frame whose layout bytes match has that header (same shape, lengths and offsets), so
        only the first block of a get parses one (``codec.layout_prefix``).
        """
        ints = SAME_SIZE_INTS.get(dtype.itemsize, (None, None))[1]
        if ints is None:
            return None
        view = self.reader.frame_view(handle)
        if ref and len(view) == ref[0].frame_len and codec_mod.layout_prefix(view, len(shape)) == ref[1]:
            header = ref[0]
        else:
            try:
                header = codec_mod.read_header(view)
            except FrameError:
                return None
            if (header.codec is not codec_mod.Codec.RAW or header.lz4 or header.shape != shape
                    or codec_mod.DTYPES.get(header.dtype) != dtype):
                return None
            if self.reader.current(handle):
                ref[:] = [header, codec_mod.layout_prefix(view, len(shape))]
        if not self.reader.current(handle):  # what was read may be torn: the slot changed
            return None
        return self.reader.frame_array(handle, header.payload_offset, ints, header.shape)

    def write_staging(self, lease: dict, kv: torch.Tensor) -> int:
        """Copy ``kv``'s bytes into ``lease``; returns the byte count."""
        src = np.frombuffer(kv_bytes(kv), np.uint8)
        # numpy, not torch's copy_: torch's threaded copy stalls when the cores are busy
        dst = np.frombuffer(self.staging, np.uint8, len(src), lease["offset"])
        np.copyto(dst, src)
        del dst  # drop the export, so the mapping can close
        return len(src)

    def write_reserved(self, blocks: Sequence[dict], spec: KVSpec, kv: "torch.Tensor | BlockFill") -> list[int]:
        """Encode each reserved block of ``kv`` as a raw frame straight into its slot; the body
        checksums, in order, for the commit. The copy and the hash run in one pass per
        cache-sized run (``codec.encode_into``), so the bytes are read once. ``kv`` may instead
        be a ``fill(depth, dst)`` that writes block ``depth`` into the slot's payload itself
        (``KVClient.put_kv_blocks``: an engine's own layout, copied once), then hashed in place.
        A block's ``meta`` is hex (as a reservation names it) or bytes (a pooled put's, made here)."""
        with self._lock:
            if self._writer is None:
                self._writer = self._maps.writer = ShmSlotWriter(self.segment, self._shm_dir)
            writer = self._writer
        bt, checksums = spec.block_tokens, []
        shape, ints = spec.kv_shape(bt), SAME_SIZE_INTS[spec.torch_dtype.itemsize][1]
        for b in blocks:
            depth = b["depth"]
            meta = b["meta"] if isinstance(b["meta"], bytes) else bytes.fromhex(b["meta"])
            with writer.slot(b["offset"], b["length"]) as view:
                if isinstance(kv, torch.Tensor):
                    n = codec_mod.encode_into(kv[:, :, :, depth * bt:(depth + 1) * bt], view, codec_mod.Codec.RAW,
                                              meta=meta)
                else:
                    at = codec_mod.raw_payload_offset(len(shape), len(meta))
                    dst = np.frombuffer(view, ints, spec.bytes_per_token * bt // ints().itemsize, at).reshape(shape)
                    kv(depth, dst)
                    del dst  # drop the export before the slot closes
                    n = codec_mod.seal_raw(view, spec.dtype, shape, meta)
                checksums.append(codec_mod.read_header(view[:n]).body_checksum)
        return checksums

    def write_frames(self, slots: Sequence[dict], sizes: Sequence[int], writer: BlockWriter) -> list[int]:
        """``writer(i, view)`` writes frame ``i`` (at most ``sizes[i]`` bytes) straight into pool slot
        ``slots[i]``; the frames' body checksums, in order (a by-key pooled put names them)."""
        with self._lock:
            if self._writer is None:
                self._writer = self._maps.writer = ShmSlotWriter(self.segment, self._shm_dir)
            slot_writer = self._writer
        checksums = []
        for i, (slot, size) in enumerate(zip(slots, sizes)):
            with slot_writer.slot(slot["offset"], slot["length"]) as view:
                n = writer(i, view[:size])
                checksums.append(codec_mod.read_header(view[:n]).body_checksum)
        return checksums

    def read_block(self, h: dict, checksum: int | None, namespace: str, i: int, sink: BlockSink,
                   stats: ClientStats) -> bool:
        """Hand the frame in slot handle ``h`` to ``sink``; False when the slot changed since the
        server named it, or the frame fails (a miss). Only a slot's first read hashes
        (``VerifiedSlots``); it holds a read lease, later ones copy under the seqlock."""
        done = self.copy_verified(h, checksum, i, sink, stats)
        if done is not None:
            return done
        handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
        if self.reader.verified(handle):  # the server hashed this publication: check the header only
            header = verified_header(self.reader.frame_view(handle), namespace, checksum, trusted=True)
            if (header is not None and self.reader.current(handle) and header.codec is codec_mod.Codec.RAW
                    and not header.lz4):
                self.verified.add(handle.index, handle.gen, header)
                stats.shm_frames_trusted += 1
                return bool(self.copy_verified(h, checksum, i, sink, stats))
        with self.reader.lease(handle) as view:
            if view is None:
                return False
            header = verified_header(view, namespace, checksum)
            if header is None or header.codec is not codec_mod.Codec.RAW or header.lz4:
                return header is not None and give_frame(view, namespace, i, sink, checksum)
            self.verified.add(handle.index, handle.gen, header)
            sink(i, header, view[header.payload_offset:header.frame_len])
            stats.shm_frames_verified += 1
            return True

    def holds(self, block: dict) -> bool:
        """Whether a remembered block's slot still holds the generation the server named: the
        block is stored there still (a delete, move or eviction changes the generation first)."""
        h = block["handle"]
        return self.reader.current(SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"]))

    def copy_verified(self, h: dict, checksum: int | None, i: int, sink: BlockSink,
                      stats: ClientStats) -> bool | None:
        """A slot this client verified before, handed to ``sink`` under the seqlock (no lease, no
        hash): True, or False when the slot changed; None when it was never verified here."""
        header = self.verified.get(h["index"], h["gen"], checksum)
        if header is None:
            return None
        handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
        if not self.reader.current(handle):
            return False
        sink(i, header, self.reader.frame_view(handle)[header.payload_offset:header.frame_len])
        if not self.reader.current(handle):
            return False  # changed meanwhile: what the sink got is garbage, a miss
        stats.shm_frames_copied += 1
        return True

    def retire(self) -> None:
        """Forget what this client learned of the arena (a restarted server's old one): its
        segments are unmapped once nothing uses it, when the last stream or call reading it lets
        go (``_Mappings``), not at the client's close."""
        self.verified.clear()
        self.handles.clear()  # drops the payload views, so the mapping can close
        self.pool.clear()
        with self._lock:
            self._idle.clear()
            self.leases = []

    def close(self) -> None:
        self.retire()
        self._unmap()
