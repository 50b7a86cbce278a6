"""The co-located arena as a client maps it: slot reads, remembered handles, staging leases.

``Arena`` maps a server's shm arena (``kvstore.memory.shm.ShmReader``) and its
staging segment, and holds what a client learns of them: the slot handles the
server named (``HandleCache``: a repeat get reads them with no request while their
generation stands), the frames already verified in a slot (``VerifiedSlots``), the
reads to report for heat (``AccessLog``) and its idle staging leases.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from client_sdk._common import (VERIFIED_VIEW, BlockFill, BlockSink, BlockWriter, ClientStats, give_frame, kv_bytes,
                                raw_frame_of, verified_header)
from client_sdk.arena_memory import AccessLog, HandleCache, VerifiedSlots
from client_sdk.arena_runs import BATCH_MIN, TrustedRuns
from client_sdk.slot_pool import SlotPool
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import FrameError, InvalidKV, KVStoreError, ServiceError
from kvstore.memory import halves
from kvstore.memory.shm import SHM_DIR, IndexHit, ShmReader, ShmSlotWriter, SlotHandle
from kvstore.spec import KVSpec

__all__ = ["Arena", "HandleCache", "AccessLog", "VerifiedSlots"]  # the last three: client_sdk.arena_memory


def _indexed(key_hex: str, hit: IndexHit) -> dict:
    """A block the shared key index found, in the form the server's handles answers take (no
    checksum: the frame's own header is checked instead, under the slot's seqlock)."""
    return {"key": key_hex, "checksum": None, "verified": hit.verified,
            "handle": {"index": hit.index, "offset": hit.offset, "length": hit.length, "gen": hit.gen}}


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
        self._last_layout: tuple[codec_mod.FrameHeader, bytes] | None = None
        """The last trusted header parsed, and its layout bytes (``trusted_header``)."""
        self._payload_ok: tuple[codec_mod.FrameHeader, bytes, tuple, torch.dtype] | None = None
        """The last layout ``trusted_payload`` took as a raw frame of a shape and dtype, with its
        layout bytes: a frame whose layout bytes equal them passes the same checks."""
        self.runs = TrustedRuns(self.reader)
        """A get's blocks checked and copied together (``client_sdk.arena_runs``)."""
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
        if not self._may_read(namespace):
            return None
        if ask:
            if not self.reader.indexed:
                return None
            new = []
            for i, hit in zip(ask, self.indexed([raw[j] for j in ask], namespace)):
                if hit is None:
                    return None
                found[i] = _indexed(hexes[i], hit)
                new.append(found[i])
            self.handles.remember(new)
        return found  # type: ignore[return-value]

    def read_cached(self, spec: KVSpec, tokens: np.ndarray, namespace: str,
                    result: Callable[[int], tuple[torch.Tensor, np.ndarray]],
                    stats: ClientStats) -> tuple[list[dict], torch.Tensor] | None:
        """``blocks_for`` then ``fill_from_handles`` into ``result(n_blocks)`` (a KV tensor and it as
        same-size ints): the blocks and the KV, or None when a block is in neither the remembered
        handles nor the key index, or a read missed (ask the server). A first get, none of whose
        blocks is remembered here, looks up, checks and copies in one pass
        (``TrustedRuns.first_fill``)."""
        hexes, raw = self.handles.keys_of(spec, tokens, namespace)
        bt = spec.block_tokens
        if (len(hexes) >= BATCH_MIN and self.reader.indexed and not any(self.handles.blocks(hexes))
                and self._may_read(namespace)):
            kv, ints = result(len(hexes))
            ints = int_view(kv) if ints is None else ints
            got = self.runs.first_fill(raw, hexes, namespace, ints, bt, kv.dtype)
            if got is None:
                return None
            blocks, done = got
            self.handles.remember(blocks)
            stats.shm_frames_trusted += len(done)
            missed = self.fill_from_handles(blocks, kv, bt, stats, ints, done)
        else:
            found = self.blocks_for(spec, tokens, namespace)
            if found is None:
                return None
            blocks = found
            kv, ints = result(len(blocks))
            missed = self.fill_from_handles(blocks, kv, bt, stats, ints)
        if missed:
            self.handles.forget(blocks)
            return None
        return blocks, kv

    def _may_read(self, namespace: str) -> bool:
        """Whether reads with no request may serve ``namespace`` here: a killed server's arena is
        not the store, and a namespace not granted is the server's to refuse."""
        return self.reader.owner_alive() and (self.namespaces is None or namespace in self.namespaces)

    def indexed(self, keys: Sequence[bytes], namespace: str) -> list[IndexHit | None]:
        """Each key's slot as the arena's key index shows it, when its frame is ``namespace``'s
        (else None, as for a key not there). A key hashed from tokens under a namespace is still
        only a key: anyone can compute it, and a put by key may name any key, so a frame another
        tenant put under it is never taken for this namespace's block (the server's own reads
        check the entry's namespace the same way). Its metadata is read under the slot's seqlock."""
        return self.runs.names_checked(self.reader.look_up(keys), namespace)

    def blocks_by_key(self, hexes: Sequence[str], keys: Sequence[bytes], namespace: str) -> list[dict | None]:
        """The slot of each key in this arena as far as this client can tell with no request (a
        remembered handle whose generation stands, else the shared key index), or None.

        A key given by the caller (not hashed here from tokens under ``namespace``) may name
        another namespace's block: one the index finds counts only when its frame's metadata
        names ``namespace``, read under the slot's seqlock (the server's answers are checked so).
        """
        if not self._may_read(namespace):
            return [None] * len(hexes)
        found = [b if b is not None and self.holds(b) else None for b in self.handles.blocks(hexes)]
        ask = [i for i, b in enumerate(found) if b is None]
        if ask and self.reader.indexed:
            new = []
            for i, hit in zip(ask, self.indexed([keys[j] for j in ask], namespace)):
                if hit is not None:
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
                          stats: ClientStats | None = None, dst: np.ndarray | None = None,
                          done: set[int] | None = None) -> list[int]:
        """Copy each block with a handle straight out of the arena into its slice of ``out``.

        A slot the server verified at the handle's generation (its verified word) is read by its
        header, with no body hash: from two blocks up together (``TrustedRuns.fill``: one copy a
        run of equally spaced slots), else one at a time (``trusted_payload``). Any other slot's
        first read here verifies the whole frame: its payload is copied first, and checked after
        every copy (``_copy_then_check``: vouched for by then, or hashed here). Either way a view
        of its payload is remembered: later reads of the same handle copy it under the seqlock
        and hash nothing, since a generation is never reused, so an unchanged one means the same
        bytes that verified. This guards the client against a wrong handle, a
        tier mix-up or a frame damaged in the arena before it was first verified, without paying
        the hash (about 40% of a 32 MiB get here) on every get.

        Args:
            dst: ``out`` as same-size ints in numpy, when the caller has it at hand.
            done: positions copied already (``TrustedRuns.first_fill``): only the rest are read.

        Returns:
            Block indexes still to fetch (no handle, stale handle, or a frame that failed).
        """
        missing: list[int] = []
        later: list[int] = []
        block_shape = (*out.shape[:3], bt, out.shape[4])
        ints = int_view(out) if dst is None else dst
        if done is None and len(blocks) >= BATCH_MIN:  # what the batch decides, the loop below skips
            done, fresh, again = self.runs.fill(blocks, ints, bt, out.dtype)
            if stats is not None:
                stats.shm_frames_trusted += fresh
                stats.shm_frames_copied += again
        done = done or set()
        for i, b in enumerate(blocks):
            if i in done:
                continue
            got = self._fill_one(b, i, out, ints, bt, block_shape, stats, defer=True)
            if got is None:
                later.append(i)
            elif not got:
                missing.append(i)
        if later:
            missing += self._copy_then_check(blocks, later, out, ints, bt, block_shape, stats)
        return sorted(missing)

    def _copy_then_check(self, blocks: Sequence[dict], later: list[int], out: torch.Tensor, ints: np.ndarray,
                         bt: int, block_shape: tuple[int, ...], stats: ClientStats | None) -> list[int]:
        """The blocks ``later`` names, whose slots the server had not verified at the first pass:
        each raw frame's payload copied first (its header checked, under the seqlock), and every
        copy then checked, last to first: a slot the server has verified meanwhile is taken as
        it stands, any other is hashed here, in the arena. The copies run while the server's
        verifier hashes the same commit's frames first to last, so few are left to hash here. A
        frame that fails leaves garbage in its part of ``out``.

        Returns:
            The block indexes missed (changed meanwhile, or failed a check).
        """
        def copy(lo: int, hi: int) -> list[tuple[int, SlotHandle | None, np.ndarray | None]]:
            """Blocks ``later[lo:hi]`` copied: (i, handle, payload), or (i, None, None) when the
            copy failed (the slot changed), or (i, handle, None) when not a raw frame of this shape."""
            done: list[tuple[int, SlotHandle | None, np.ndarray | None]] = []
            for i in later[lo:hi]:
                b = blocks[i]
                h = b["handle"]
                handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
                src = self._unchecked_payload(handle, b.get("checksum"), block_shape, out.dtype)
                if src is None or self.reader.copy_current(h["index"], h["gen"], ints[:, :, :, i * bt:(i + 1) * bt], src):
                    done.append((i, handle, src))
                else:
                    done.append((i, None, None))
            return done

        missing: list[int] = []
        copied: list[tuple[int, SlotHandle, np.ndarray]] = []
        block_bytes = math.prod(block_shape) * ints.itemsize
        # two halves on two threads (``halves``); the checked reads and the checks stay on this one
        for i, handle, src in halves.run_halves(len(later), block_bytes * len(later), copy):
            if handle is None:
                missing.append(i)
            elif src is None:  # not a raw frame of this shape, or changed: the checked read, as before
                if not self._fill_one(blocks[i], i, out, ints, bt, block_shape, stats, defer=False):
                    missing.append(i)
            else:
                copied.append((i, handle, src))
        for i, handle, src in reversed(copied):
            trusted = self.reader.verified(handle)
            if not (trusted or self._body_sound(handle)):
                missing.append(i)
                continue
            blocks[i][VERIFIED_VIEW] = src
            if stats is not None:
                if trusted:
                    stats.shm_frames_trusted += 1
                else:
                    stats.shm_frames_verified += 1
        return missing

    def _unchecked_payload(self, handle: SlotHandle, checksum: int | None, shape: tuple[int, ...],
                           dtype: torch.dtype) -> np.ndarray | None:
        """The payload of the raw frame of ``shape`` and ``dtype`` in slot ``handle``, as same-size
        ints in the arena, its header checked (and its body checksum the one a server's answer
        named, ``checksum``) but not its body; None when the frame is not such, or changed."""
        ints = SAME_SIZE_INTS.get(dtype.itemsize, (None, None))[1]
        if ints is None:
            return None
        try:
            header = codec_mod.read_header(self.reader.frame_view(handle))
        except FrameError:
            return None
        if (not raw_frame_of(header, shape, dtype) or (checksum is not None and header.body_checksum != checksum)
                or not self.reader.current(handle)):
            return None
        return self.reader.frame_array(handle, header.payload_offset, ints, header.shape)

    def _body_sound(self, handle: SlotHandle) -> bool:
        """Whether slot ``handle``'s frame hashes to its header's body checksum, read as it stands
        under the seqlock (unchanged after the hash: the bytes copied before under the same
        generation are these)."""
        try:
            codec_mod.verify(self.reader.frame_view(handle))
        except FrameError:
            return False
        return self.reader.current(handle)

    def _fill_one(self, b: dict, i: int, out: torch.Tensor, dst: np.ndarray, bt: int,
                  block_shape: tuple[int, ...], stats: ClientStats | None, defer: bool) -> bool | None:
        """``fill_from_handles`` of block ``b`` into block ``i`` of ``out`` (``dst``: as ints): True when
        read, False when missed, None when left for later (``defer``: the server
        has not verified the slot yet)."""
        h = b.get("handle")
        if h is None:
            return False
        part_ints = dst[:, :, :, i * bt:(i + 1) * bt]
        src = b.get(VERIFIED_VIEW)
        if src is not None:  # verified before: a plain copy under the seqlock
            if not self.reader.copy_current(h["index"], h["gen"], part_ints, src):
                return False
            if stats is not None:
                stats.shm_frames_copied += 1
            return True
        handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
        if b.get("verified") or self.reader.verified(handle):  # the verified word as it stands now
            src = self.trusted_payload(handle, block_shape, out.dtype)
            if src is not None:  # the server hashed this publication: copy, hash nothing
                if not self.reader.copy_current(h["index"], h["gen"], part_ints, src):
                    return False
                b[VERIFIED_VIEW] = src
                if stats is not None:
                    stats.shm_frames_trusted += 1
                return True
        elif defer:
            return None
        part = out[:, :, :, i * bt:(i + 1) * bt]
        try:
            with self.reader.lease(handle) as view:
                if view is None:  # moved or gone since the server looked: generation changed
                    return False
                header = codec_mod.read_header(view)
                codec_mod.decode(view, out=part, expect_checksum=b.get("checksum"))
        except (FrameError, InvalidKV, KVStoreError):
            return False
        if stats is not None:
            stats.shm_frames_verified += 1
        ints = SAME_SIZE_INTS.get(part.element_size(), (None, None))[1]
        if header.codec is codec_mod.Codec.RAW and not header.lz4 and ints is not None:
            b[VERIFIED_VIEW] = self.reader.frame_array(handle, header.payload_offset, ints, header.shape)
        return True

    def trusted_payload(self, handle: SlotHandle, shape: tuple[int, ...],
                        dtype: torch.dtype) -> np.ndarray | None:
        """The payload of a frame the server verified whole (the slot's verified word), as same-size
        ints in the arena, once it is a raw frame of ``shape`` and ``dtype``; None otherwise (the
        caller reads it the checked way) or when the slot changed meanwhile. A frame of the last
        trusted header's layout is not parsed (``trusted_header``)."""
        ints = SAME_SIZE_INTS.get(dtype.itemsize, (None, None))[1]
        if ints is None:
            return None
        view = self.reader.frame_view(handle)
        ok = self._payload_ok
        if ok is not None and ok[2] == shape and ok[3] is dtype and codec_mod.layout_matches(view, ok[0], ok[1]):
            header = ok[0]  # the layout these checks passed for: a batch's blocks build no header each
        else:
            header = self.trusted_header(handle, view)
            if header is None or not raw_frame_of(header, shape, dtype):
                return None
            ok = (header, codec_mod.layout_prefix(view, len(header.shape)), shape, dtype)
        if not self.reader.current(handle):  # what was read may be torn: the slot changed
            return None
        self._payload_ok = ok  # read from one publication: its layout is sound to compare with
        return self.reader.frame_array(handle, header.payload_offset, ints, header.shape)

    def trusted_header(self, handle: SlotHandle, view: memoryview) -> "codec_mod.FrameHeader | None":
        """The header of a server-verified frame (``view``, of slot ``handle``), or None when it does
        not parse. Read without a lease: the caller checks the slot's generation after it.

        The last header parsed here is kept with its layout bytes: a frame whose layout bytes match
        has that header but for its body checksum (``codec.header_like``), so a get or a batch of
        one spec's blocks parses only its first (a parse took most of a first read's time beside
        its copy, for 256 KiB pages). Kept as one tuple: threads read and replace it whole.
        """
        last = self._last_layout
        if last is not None:
            header = codec_mod.header_like(view, last[0], last[1])
            if header is not None:
                return header
        try:
            header = codec_mod.read_header(view)
        except FrameError:
            return None
        layout = codec_mod.layout_prefix(view, len(header.shape))
        if self.reader.current(handle):  # both read from one publication
            self._last_layout = (header, layout)
        return header

    def write_staging(self, lease: dict, kv: torch.Tensor) -> int:
        """Copy ``kv``'s bytes into ``lease``; returns the byte count."""
        src = np.frombuffer(kv_bytes(kv), np.uint8)
        # numpy, not torch's copy_: torch's threaded copy stalls when the cores are busy
        dst = np.frombuffer(self.staging, np.uint8, len(src), lease["offset"])
        halves.copyto(dst, src)
        del dst  # drop the export, so the mapping can close
        return len(src)

    def _slot_writer(self) -> ShmSlotWriter:
        with self._lock:  # mapped on the first put
            if self._writer is None:
                self._writer = self._maps.writer = ShmSlotWriter(self.segment, self._shm_dir)
            return self._writer

    def write_reserved(self, blocks: Sequence[dict], spec: KVSpec, kv: "torch.Tensor | BlockFill") -> list[int]:
        """Encode each reserved block of ``kv`` as a raw frame straight into its slot; the body
        checksums, in order, for the commit. The copy and the hash run in one pass per
        cache-sized run (``codec.raw_frame_into``, from the KV viewed as ints once), so the bytes
        are read once. ``kv`` may instead be a ``fill(depth, dst)`` that writes block ``depth``
        into the slot's payload itself (``KVClient.put_kv_blocks``: an engine's own layout,
        copied once), then hashed in place.
        A block's ``meta`` is hex (as a reservation names it) or bytes (a pooled put's, made here)."""
        writer = self._slot_writer()
        bt = spec.block_tokens
        shape, ints = spec.kv_shape(bt), SAME_SIZE_INTS[spec.torch_dtype.itemsize][1]
        bits = int_view(kv.detach()) if isinstance(kv, torch.Tensor) and kv.device.type == "cpu" else None

        def part(lo: int, hi: int) -> list[int]:
            checksums = []
            for b in blocks[lo:hi]:
                depth = b["depth"]
                meta = b["meta"] if isinstance(b["meta"], bytes) else bytes.fromhex(b["meta"])
                with writer.slot(b["offset"], b["length"]) as view:
                    if bits is not None:  # 8 us a 64 KiB block; encode_into and a header read took 23
                        block = bits[:, :, :, depth * bt:(depth + 1) * bt]
                        checksums.append(codec_mod.raw_frame_into(block, spec.dtype, view, meta)[1])
                        continue
                    if isinstance(kv, torch.Tensor):  # on a device: copied to the host block by block
                        n = codec_mod.encode_into(kv[:, :, :, depth * bt:(depth + 1) * bt], view, meta=meta)
                    else:
                        at = codec_mod.raw_payload_offset(len(shape), len(meta))
                        dst = np.frombuffer(view, ints, spec.bytes_per_token * bt // ints().itemsize, at).reshape(shape)
                        kv(depth, dst)
                        del dst  # drop the export before the slot closes
                        n = codec_mod.seal_raw(view, spec.dtype, shape, meta)
                    checksums.append(codec_mod.read_header(view[:n]).body_checksum)
            return checksums

        if bits is None:  # an engine's fill runs on the caller's thread only; so does a device
            return part(0, len(blocks))  # tensor's copy to the host, on the caller's (CUDA) stream
        # the blocks in two halves, the second on the copy helper: copy and hash release the GIL
        return halves.run_halves(len(blocks), spec.bytes_per_token * bt * len(blocks), part)

    def write_frames(self, slots: Sequence[dict], sizes: Sequence[int], writer: BlockWriter) -> list[int]:
        """``writer(i, view)`` writes frame ``i`` (at most ``sizes[i]`` bytes) straight into pool slot
        ``slots[i]``; the frames' body checksums, in order (a by-key pooled put names them)."""
        slot_writer = self._slot_writer()
        checksums = []
        for i, (slot, size) in enumerate(zip(slots, sizes)):
            with slot_writer.slot(slot["offset"], slot["length"]) as view:
                n = writer(i, view[:size])
                checksums.append(codec_mod.read_header(view[:n]).body_checksum)
        return checksums

    def read_block(self, h: dict, checksum: int | None, namespace: str, i: int, sink: BlockSink,
                   stats: ClientStats, defer: bool = False) -> bool | None:
        """Hand the frame in slot handle ``h`` to ``sink``; False when the slot changed since the
        server named it, or the frame fails (a miss). Only a slot's first read hashes
        (``VerifiedSlots``); it holds a read lease, later ones copy under the seqlock.

        A slot the server verified is read by its header (``trusted_header``: a page of the last
        one's layout is not parsed) and its metadata's namespace, with no hash. ``defer``: a slot
        the server has not verified yet is left alone (None), for the caller to read after the
        others."""
        done = self.copy_verified(h, checksum, i, sink, stats)
        if done is not None:
            return done
        handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
        if self.reader.verified(handle):  # the server hashed this publication: check the header only
            view = self.reader.frame_view(handle)
            header = self.trusted_header(handle, view)
            if header is not None and not self._names(view, header, namespace, checksum):
                header = None
            if (header is not None and self.reader.current(handle) and header.codec is codec_mod.Codec.RAW
                    and not header.lz4):
                # the header read stands: the slot did not change meanwhile; the copy is checked after
                sink(i, header, view[header.payload_offset:header.frame_len])
                if not self.reader.current(handle):
                    return False  # changed during the copy: what the sink got is garbage, a miss
                self.verified.add(handle.index, handle.gen, header)
                stats.shm_frames_trusted += 1
                return True
        elif defer:
            return None
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

    def _names(self, frame: memoryview, header: "codec_mod.FrameHeader", namespace: str,
               checksum: int | None) -> bool:
        """Whether a trusted frame is ``namespace``'s (and has ``checksum``, when given): by its
        metadata's first bytes where that is sure (``keys.surely_names``), else parsed."""
        if checksum is not None and header.body_checksum != checksum:
            return False
        return self.runs.meta_names(frame, namespace)

    def holds(self, block: dict) -> bool:
        """Whether a remembered block's slot still holds the generation the server named: the
        block is stored there still (a delete, move or eviction changes the generation first)."""
        h = block["handle"]
        return self.reader.holds(h["index"], h["gen"])

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
