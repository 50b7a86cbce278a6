"""A co-located get's checks and copies for many blocks at once.

A first get of many small blocks paid for each block what a large block pays once: a handle
built, a header view, a namespace check, the verified word, the header's layout, a payload view,
a copy and the seqlock's two loads, each a call or two (about 22 us a block of 64 KiB here,
against 5 us for its bytes' memcpy). Here a get's blocks take those steps together: their headers'
first bytes in one call, checks on plain bytes, and one ``np.copyto`` for each run of blocks
that lie equally spaced in the arena in the order of the get (a put's slots are taken so: HTTP
puts upwards, pooled puts downwards). What this path cannot decide (a slot the server has not
verified, a frame of another codec or shape, metadata that needs parsing) is left to the
per-block path, which decides it as before.

The seqlock holds for a batch as for one block: a generation is never reused, so a slot whose
generation is the one its handle names both before the first read of its bytes and after the
last copy (``ShmReader.holds``) held the same bytes throughout.
"""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import torch

from client_sdk._common import VERIFIED_VIEW, raw_frame_of
from kvstore import codec as codec_mod
from kvstore.errors import FrameError
from kvstore.keys import meta_prefix, surely_names
from kvstore.memory import halves
from kvstore.memory.shm import IndexHit, ShmReader, SlotHandle

__all__ = ["BATCH_MIN", "TrustedRuns"]

BATCH_MIN = 2
"""From this many blocks a get copies this way (one block gains nothing from it); a look-up's
namespace check always runs here."""
META_WINDOW = 320
"""A frame's first bytes read for its metadata: a KV frame's header is 128 bytes and a block's
metadata about 100; a frame whose metadata ends past them is checked on its own."""
_CACHED_LAYOUTS = 64


class TrustedRuns:
    """The batch steps of one arena's reader, with the headers of the layouts it has parsed."""

    def __init__(self, reader: ShmReader) -> None:
        self.reader = reader
        self._prefixes: dict[str, bytes] = {}
        self._layouts: dict[bytes, codec_mod.FrameHeader] = {}
        """Layout bytes (``codec.layout_prefix``) -> the header parsed from a server-verified frame
        of that layout: a frame whose layout bytes equal them has that payload offset and shape."""

    def names_checked(self, hits: list[IndexHit | None], namespace: str) -> list[IndexHit | None]:
        """``hits`` (a look-up's, changed in place) with None for every frame whose metadata does
        not name ``namespace``, or whose slot changed meanwhile. Sure answers come from the
        metadata's bytes (``_surely_named``); the rest is parsed (``meta_names``)."""
        at = [i for i, hit in enumerate(hits) if hit is not None]
        if not at:
            return hits
        found: list[IndexHit] = [hits[i] for i in at]  # type: ignore[misc]
        heads = self.reader.heads([h.offset for h in found], META_WINDOW)
        holds, prefix = self.reader.holds, self.prefix(namespace)
        for i, h, head in zip(at, found, heads):
            if not ((_surely_named(head, h.length, prefix) or self._names(h, namespace)) and holds(h.index, h.gen)):
                hits[i] = None  # another namespace's, or changed while it was read
        return hits

    def first_fill(self, keys: Sequence[bytes], hexes: Sequence[str], namespace: str, ints: np.ndarray, bt: int,
                   dtype: torch.dtype) -> tuple[list[dict], set[int]] | None:
        """A first get's blocks, none of them remembered: looked up in the arena's key index,
        checked and copied in one pass. ``names_checked`` then ``fill`` decide the same, but read
        each frame's first bytes twice and loop over the blocks four times; a first get of many
        small blocks is that per-block cost (issue 33's 64 KiB rows).

        Every block must be in the index, its frame ``namespace``'s (as ``names_checked`` checks); those the server verified, of ``ints``' block shape and ``dtype``, are
        copied in runs (as ``fill``). A generation read at the look-up that stands after the last
        copy covers everything read of its slot in between (a generation is never reused).

        Returns:
            The blocks (as ``_indexed`` builds them; a copied one keeps its payload's view,
            ``VERIFIED_VIEW``) and the positions copied (the rest are the per-block path's); None
            when a key is not there, not this namespace's, or its slot changed: ask the server.
        """
        reader = self.reader
        hits = reader.look_up(keys)
        if None in hits:
            return None
        heads = reader.heads([h.offset for h in hits], META_WINDOW)  # type: ignore[union-attr]
        block_shape = (*ints.shape[:3], bt, ints.shape[4])
        suits: dict[bytes, tuple[int, int] | None] = {}
        blocks: list[dict] = []
        took: list[tuple[int, dict]] = []
        starts: list[int] = []
        copies, verified, prefix = ints.flags.c_contiguous, reader.holds_verified, self.prefix(namespace)
        for i, (hit, head, key) in enumerate(zip(hits, heads, hexes)):
            _, index, offset, length, gen, ver = hit  # type: ignore[misc]
            if not (_surely_named(head, length, prefix) or self._names(hit, namespace)):  # type: ignore[arg-type]
                return None
            h = {"index": index, "offset": offset, "length": length, "gen": gen}
            ver = ver or verified(index, gen)
            blocks.append({"key": key, "checksum": None, "verified": ver, "handle": h})
            if ver and copies:
                start = self._payload_start(head, h, block_shape, dtype, suits)
                if start is not None:
                    took.append((i, h))
                    starts.append(start)
        runs = self._copy_runs(took, starts, ints, bt, block_shape) if took else []
        holds = reader.holds
        for hit in hits:
            if not holds(hit.index, hit.gen):  # type: ignore[union-attr]
                return None  # changed since the look-up: what was read of it may be another's
        done: set[int] = set()
        for first, count, arrays in runs:
            for (i, _), array in zip(took[first:first + count], arrays):
                blocks[i][VERIFIED_VIEW] = array
                done.add(i)
        return blocks, done

    def prefix(self, namespace: str) -> bytes:
        """How every block metadata of ``namespace`` begins (``keys.meta_prefix``), kept."""
        prefix = self._prefixes.get(namespace)
        if prefix is None:
            prefix = self._prefixes[namespace] = meta_prefix(namespace)
        return prefix

    def meta_names(self, frame: memoryview, namespace: str) -> bool:
        """Whether the metadata of a frame the server indexed (read as it lies, the caller checks
        the slot's generation after) names ``namespace``: by its first bytes where that is sure
        (``keys.surely_names``), else parsed as the server parsed it (``json.loads``)."""
        meta = codec_mod.trusted_meta(frame)
        if surely_names(meta, self.prefix(namespace)):
            return True
        try:
            parsed = json.loads(meta)
        except ValueError:  # torn or damaged: the caller's seqlock check or a full read says which
            return False
        return isinstance(parsed, dict) and parsed.get("ns") == namespace

    def _names(self, hit: IndexHit, namespace: str) -> bool:
        """``meta_names`` of a look-up's hit, its frame read where the hit says."""
        return self.meta_names(self.reader.frame_view(hit.handle), namespace)

    def fill(self, blocks: Sequence[dict], ints: np.ndarray, bt: int, dtype: torch.dtype) -> tuple[set[int], int, int]:
        """Copy every block of ``blocks`` (a get's, in order: block ``i`` fills tokens
        ``[i * bt, (i + 1) * bt)`` of ``ints``, the result as same-size ints) that this path can
        decide: its slot holds the handle's generation, the server verified that publication,
        and its frame is a raw one of ``ints``' block shape and ``dtype``. Each one copied keeps
        its payload's view (``VERIFIED_VIEW``) for a repeat get.

        Returns:
            The positions filled, how many of them were read here for the first time, and how
            many were read before (had a view).
        """
        if not ints.flags.c_contiguous:
            return set(), 0, 0  # a run's copy needs ``ints`` by block, a view: the per-block path copies
        reader = self.reader
        verified = reader.holds_verified
        todo = []
        for i, b in enumerate(blocks):
            h = b.get("handle")
            if h is not None and verified(h["index"], h["gen"]):
                todo.append((i, h))
        if not todo:
            return set(), 0, 0
        heads = reader.heads([h["offset"] for _, h in todo], codec_mod.HEAD_BYTES)
        block_shape = (*ints.shape[:3], bt, ints.shape[4])
        suits: dict[bytes, tuple[int, int] | None] = {}  # this call's layouts: frame length, payload offset
        took: list[tuple[int, dict]] = []
        starts: list[int] = []
        for (i, h), head in zip(todo, heads):
            start = self._payload_start(head, h, block_shape, dtype, suits)
            if start is not None:
                took.append((i, h))
                starts.append(start)
        runs = self._copy_runs(took, starts, ints, bt, block_shape)
        # A slot copied from that still holds the generation it held before its header was read
        # did not change meanwhile: the copy is of that publication's bytes
        done: set[int] = set()
        fresh = again = 0
        for first, count, arrays in runs:
            for (i, h), array in zip(took[first:first + count], arrays):
                if reader.holds(h["index"], h["gen"]):
                    b = blocks[i]
                    if VERIFIED_VIEW in b:
                        again += 1
                    else:
                        fresh += 1
                    b[VERIFIED_VIEW] = array
                    done.add(i)
        return done, fresh, again

    def _copy_runs(self, took: list[tuple[int, dict]], starts: list[int], ints: np.ndarray, bt: int,
                   shape: tuple[int, ...]) -> list[tuple[int, int, np.ndarray]]:
        """Copy the payloads at ``starts`` (data-region bytes) into the blocks ``took`` names, one
        ``np.copyto`` for each run of consecutive blocks equally spaced in the arena.

        Returns:
            Each run: its first place in ``took``, its length, and its payloads' arrays.
        """
        runs: list[tuple[int, int, np.ndarray]] = []
        L, kv, heads, _, dim = ints.shape
        by_block = ints.reshape(L, kv, heads, -1, bt, dim)  # a view: ``ints`` is contiguous (``fill``)
        if by_block.flags.owndata:
            return runs  # a copy after all: what is copied into it would be lost
        s = 0
        for j in range(1, len(took) + 1):
            if j < len(took) and took[j][0] == took[j - 1][0] + 1 and (
                    j == s + 1 or starts[j] - starts[j - 1] == starts[s + 1] - starts[s]):
                continue
            count = j - s
            stride = starts[s + 1] - starts[s] if count > 1 else 0
            src = self.reader.spaced_arrays(starts[s], stride, count, ints.dtype, shape)
            first = took[s][0]
            halves.copyto(by_block[:, :, :, first:first + count], src.transpose(1, 2, 3, 0, 4, 5))
            runs.append((s, count, src))
            s = j
        return runs

    def _payload_start(self, head: bytes, h: dict, shape: tuple[int, ...], dtype: torch.dtype,
                       suits: dict[bytes, tuple[int, int] | None]) -> int | None:
        """The data-region offset of the payload of slot ``h`` (a server-verified frame whose first
        bytes are ``head``) when it is a raw frame of ``shape`` and ``dtype``, else None (the
        per-block path says what it is). ``suits``: one call's layouts, each with its frames'
        length and payload offset, or None."""
        if len(head) < 16:
            return None
        layout = codec_mod.layout_of(head)
        suit = suits.get(layout, 0)
        if suit == 0:
            header = self._suited(layout, h, shape, dtype)
            suit = suits[layout] = None if header is None else (header.frame_len, header.payload_offset)
        # a slot of another length than its layout's frame holds something else
        if suit is None or h["length"] != suit[0]:
            return None
        return h["offset"] + suit[1]

    def _suited(self, layout: bytes, h: dict, shape: tuple[int, ...], dtype: torch.dtype) -> codec_mod.FrameHeader | None:
        """The header of frames of ``layout`` when they are raw frames of ``shape`` and ``dtype``
        (else None): remembered, else parsed from the frame of handle ``h`` (server-verified)."""
        header = self._layouts.get(layout)
        if header is None:
            header = self._parse(layout, SlotHandle(self.reader.segment, h["index"], h["offset"], h["length"], h["gen"]))
        if header is None or not raw_frame_of(header, shape, dtype):
            return None
        return header

    def _parse(self, layout: bytes, handle: SlotHandle) -> codec_mod.FrameHeader | None:
        """The header of the frame at ``handle``, remembered for ``layout`` once the slot is seen
        unchanged after the parse (its header checksum is checked here; later frames of the layout
        are the server's to have verified whole)."""
        view = self.reader.frame_view(handle)
        try:
            header = codec_mod.read_header(view)
        except FrameError:
            return None
        same = codec_mod.layout_prefix(view, len(header.shape)) == layout
        if not (same and self.reader.current(handle)):
            return None  # torn, or changed since its layout was read
        if len(self._layouts) >= _CACHED_LAYOUTS:
            self._layouts.clear()
        self._layouts[layout] = header
        return header


def _surely_named(head: bytes, length: int, prefix: bytes) -> bool:
    """Whether the frame whose first bytes are ``head`` (of a ``length``-byte slot) surely names the
    namespace of ``prefix``, by its metadata's bytes (``keys.surely_names``); False: parse it."""
    if len(head) < 16:
        return False
    start, size = codec_mod.meta_span(head)
    end = start + size
    return end <= len(head) and end <= length and surely_names(head[start:end], prefix)
