"""A block a co-located writer wrote into a lent top-tier slot, and the checks before it is published.

Reservations (``kvstore.engine.reserved``) and pools (``kvstore.engine.pools``) both lend slots of
the shm tier to a writer in another process and publish what it wrote: the frame's header must
be the block's raw frame with the checksum the writer claims. The body is not hashed here: the
server verifies it in the background right after publish (``kvstore.engine.scrub``), and a
reader hashes it itself until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.engine.placement import RoomHold
from kvstore.errors import CorruptFrame, FrameError
from kvstore.keys import BlockHash
from kvstore.spec import KVSpec

__all__ = ["ReservedBlock", "WrittenHeaders", "check_written", "block_tokens", "give_back", "Progress",
           "publish_written"]


@dataclass(slots=True)
class ReservedBlock:
    depth: int
    key: BlockHash
    slot: Any
    """The tier's handle for the reserved range (``tiers.arena.Slot``)."""
    size: int
    meta: bytes
    parent: BlockHash | None = None
    """The chain's previous block (for the ``stored`` event)."""
    tokens: bytes = b""
    """The block's token ids, <u4 (for the ``stored`` event; empty unless the event log keeps them)."""
    room: RoomHold | None = None
    """Placement counts the slot's bytes as in the top tier until the reservation ends."""


class WrittenHeaders:
    """The headers of one put's frames, written into lent slots by one writer: the first of a
    layout parsed (its own checksum checked), each later one whose layout bytes equal it taken
    with ``codec.header_like`` (no parse: a batch of 128 pages paid 15 us a page for two parses).

    What that skips is the check of the later headers' own checksums: their every other byte but
    the body checksum equals a header that passed it, and the body checksum is compared with the
    writer's claim. The verifier (``kvstore.engine.scrub``) checks each frame whole, header
    included, before any reader trusts it, as it does every frame.
    """

    __slots__ = ("_ref",)

    def __init__(self) -> None:
        self._ref: tuple[codec_mod.FrameHeader, bytes] | None = None

    def read(self, view: memoryview) -> codec_mod.FrameHeader:
        """The header of the frame at the start of ``view`` (a slot, perhaps longer than its frame).

        Raises:
            FrameError: a damaged header.
        """
        ref = self._ref
        if ref is not None and len(view) >= ref[0].frame_len:
            header = codec_mod.header_like(view[:ref[0].frame_len], *ref)
            if header is not None:
                return header
        # A pool slot may be longer than its frame: parse the header alone (at most 120 bytes: 8
        # dims; its own checksum checked), then hold the frame to the length it says it is
        head = bytes(view[:min(len(view), 128)])  # one snapshot: the writer may still be writing
        header = codec_mod.read_header(head, prefix=True)
        self._ref = (header, codec_mod.layout_prefix(head, len(header.shape)))
        return header


def check_written(top: Any, b: ReservedBlock, checksum: int, spec: KVSpec, *,
                  exact: bool = True, headers: WrittenHeaders | None = None) -> codec_mod.FrameHeader:
    """The header of the frame written into ``b``'s slot, once it is the block's raw frame with
    ``checksum``. ``exact``: the slot was sized for this very frame (a reservation); a pool
    slot may be larger than the frame. ``headers``: the put's other frames' (a pool's put)."""
    view = top.reserved_view(b.slot)
    try:
        if headers is not None:
            header = headers.read(view)
        else:
            header = codec_mod.read_header(view if exact else view[:min(len(view), 128)], prefix=not exact)
    except FrameError as exc:
        raise CorruptFrame(f"block {b.depth}: the frame written into its slot is damaged: {exc}") from None
    want = spec.kv_shape(spec.block_tokens)
    if header.codec is not Codec.RAW or header.dtype != spec.dtype or header.shape != tuple(want) \
            or header.frame_len > b.size or (exact and header.frame_len != b.size) \
            or header.meta_len != len(b.meta):
        raise CorruptFrame(f"block {b.depth}: the frame in its slot is not the raw {spec.dtype} "
                           f"{list(want)} frame reserved ({b.size} bytes)")
    if bytes(view[header.meta_offset:header.meta_offset + header.meta_len]) != b.meta:
        raise CorruptFrame(f"block {b.depth}: the frame's metadata is not the reserved block's")
    if header.body_checksum != checksum:
        raise CorruptFrame(f"block {b.depth}: the frame says body checksum {header.body_checksum:#x}, "
                           f"the commit {checksum:#x}")
    return header


def block_tokens(tokens: Any, depth: int, bt: int) -> bytes:
    """Block ``depth``'s token ids as <u4 bytes (64 bytes for a 16-token block)."""
    return np.asarray(tokens[depth * bt:(depth + 1) * bt], dtype="<u4").tobytes()


def give_back(top: Any, blocks: list[Any]) -> None:
    """Return reserved slots to the tier unpublished, and their room to placement (``ReservedBlock``s
    or pool slots: anything with ``slot``, ``size`` and ``room``)."""
    try:
        for b in blocks:
            top.abort_reserved(b.slot, b.size)
    finally:
        for b in blocks:
            if b.room is not None:
                b.room.release()


class Progress:
    """How far ``publish_written`` got, for its caller's clean-up after a failure: slots before
    ``at`` were handled (published, or ``held`` by the caller); the one at ``at`` failed in its
    commit (the tier took it back) when ``committing`` is set; the rest were not touched."""

    __slots__ = ("at", "committing", "held", "published")

    def __init__(self) -> None:
        self.at, self.committing = 0, False
        self.held: list[int] = []
        """Indexes of the blocks stored already, whose slots the caller keeps or gives back."""
        self.published: list[int] = []

    def untouched(self) -> int:
        """The first index neither handled nor failed."""
        return self.at + 1 if self.committing else self.at


def publish_written(core: Any, entries: list[Any], slots: list[tuple[Any, int]],
                    held: Callable[[Any, Any], bool], *, now: float, vouch: bool,
                    chain: list[tuple[BlockHash | None, bytes | None]], progress: Progress) -> int:
    """Commit each lent slot's frame, ``slots[i]`` = (slot, reserved bytes), as ``entries[i]``
    (top-tier ``IndexEntry``s, each key once) and publish them, in order, under the claims of
    all their keys; an entry whose current one ``held(old, entry)`` says is stored already is
    skipped (``progress.held``). ``vouch``: this process hashed the frames (verified at once).
    Returns the raw bytes published.

    Why one ``claim_all``: a block at a time, its claim, the index, placement and the event log
    were each taken once a block (17 us a 64 KiB block of a pooled put, half of the server's
    work); now once a put. A delete of one of these keys still waits for the claims, so its
    ``removed`` event follows the ``stored`` one. On a failure what was committed is published.
    """
    top = core.tiers[0]
    done, links, nbytes = [], [], 0
    with core.claim_all([e.key for e in entries]):
        try:
            for i, (entry, (slot, size)) in enumerate(zip(entries, slots)):
                if held(core.entry(entry.key), entry):
                    progress.held.append(i)
                else:
                    progress.committing = True
                    top.commit_reserved(entry.key, slot, size, entry.size)
                    progress.committing = False
                    done.append(entry)  # committed: published below, whatever fails after
                    links.append(chain[i])
                    progress.published.append(i)
                    nbytes += entry.raw_bytes
                    if vouch:
                        top.vouch(entry.key, slot.stamp)
                progress.at = i + 1
        finally:
            core.publish_many(done, now=now, reason="reserved", chain=links)
            core.count(blocks_written=len(done), blocks_deduped=len(progress.held))
    return nbytes
