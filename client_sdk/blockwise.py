"""A prefix handed to the caller block by block, straight out of the arena: one copy in all.

``get_kv`` copies the arena's frames into one result tensor ``[L, 2, H, n, D]``; an engine
then copies that into its own paged layout (vLLM's per-layer caches, K transposed on the
CPU), a second pass over every byte. ``get_kv_blocks`` instead hands each block's payload,
a read-only view of the arena, to ``place(depth, src)``, which copies it where the engine
keeps it; the slot's generation is checked before and after (the seqlock), so a block whose
slot changed under the copy is read again (or, gone, ends the prefix) and the caller's copy
of it is overwritten or dropped.

``src`` is ``[L, 2, H, block_tokens, D]`` of the spec dtype's bits as same-size integers
(``kvstore.codec.SAME_SIZE_INTS``: numpy has no bfloat16), so the caller copies it with
``np.copyto`` into integer views of its tensors (``kvstore.codec.int_view``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk._common import VERIFIED_VIEW, raw_frame_of
from client_sdk.arena import Arena
from client_sdk.colocated import Colocation, Copy, Flow
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import FrameError, InvalidKV, KVStoreError
from kvstore.memory.shm import SlotHandle
from kvstore.spec import KVSpec
from kvstore.wire.rest import parse_batch_head

__all__ = ["Place", "place_flow", "place_from_handles", "place_from_tensor", "ints_of"]

Place = Callable[[int, np.ndarray], None]
"""``place(depth, src)``: copy block ``depth``'s payload (``[L, 2, H, block_tokens, D]`` as
same-size ints, valid only during the call) where the caller keeps it."""


def ints_of(spec: KVSpec) -> Any:
    """The numpy integer type with the spec dtype's item size (the type ``src`` comes in)."""
    ints = SAME_SIZE_INTS.get(spec.torch_dtype.itemsize, (None, None))[1]
    if ints is None:
        raise InvalidKV(f"get_kv_blocks: no same-size integer type for {spec.dtype}")
    return ints


def _payload(arena: Arena, b: dict, shape: tuple[int, ...], dtype: torch.dtype, ints: Any,
             stats: c.ClientStats) -> np.ndarray | None:
    """Block ``b``'s verified raw payload in the arena (remembered on ``b``), or None: a frame
    the server did not vouch for is hashed here once, under a read lease; one that is not a
    raw frame of ``shape`` and ``dtype`` (compressed, another spec) is None (read another way)."""
    src = b.get(VERIFIED_VIEW)
    if src is not None:
        return src
    h = b["handle"]
    handle = SlotHandle(arena.segment, h["index"], h["offset"], h["length"], h["gen"])
    if b.get("verified"):
        src = arena.trusted_payload(handle, shape, dtype)
        if src is not None:
            stats.shm_frames_trusted += 1
            b[VERIFIED_VIEW] = src
            return src
    try:
        with arena.reader.lease(handle) as view:
            if view is None:  # moved or gone since the server looked
                return None
            header = codec_mod.read_header(view)
            if not raw_frame_of(header, shape, dtype):
                return None
            codec_mod.verify(view)
            expect = b.get("checksum")
            if expect is not None and header.body_checksum != expect:
                return None
    except (FrameError, InvalidKV, KVStoreError):
        return None
    stats.shm_frames_verified += 1
    src = arena.reader.frame_array(handle, header.payload_offset, ints, header.shape)
    b[VERIFIED_VIEW] = src
    return src


def place_from_handles(arena: Arena, blocks: Sequence[dict], spec: KVSpec, first: int, place: Place,
                       stats: c.ClientStats) -> list[int]:
    """``place`` each block with a handle (block ``i`` is depth ``first + i``) straight from the
    arena, under its slot's seqlock; the block indexes still to fetch (no handle, a slot that
    changed, a frame that failed or is not raw)."""
    shape, dtype, ints = spec.kv_shape(spec.block_tokens), spec.torch_dtype, ints_of(spec)
    words, missing = arena.reader, []
    for i, b in enumerate(blocks):
        h = b.get("handle")
        src = None if h is None else _payload(arena, b, shape, dtype, ints, stats)
        if src is None:
            missing.append(i)
            continue
        if words.generation(h["index"]) != h["gen"]:
            missing.append(i)
            continue
        place(first + i, src)
        if words.generation(h["index"]) != h["gen"]:  # reused under the copy: what was placed is garbage
            missing.append(i)
            continue
        stats.shm_frames_copied += 1
    return missing


def place_from_tensor(kv: torch.Tensor, spec: KVSpec, first: int, place: Place) -> None:
    """``place`` every block of ``kv`` (``[L, 2, H, n, D]``; block ``i`` is depth ``first + i``)."""
    bt = spec.block_tokens
    ints = int_view(kv)
    for i in range(int(kv.shape[3]) // bt):
        place(first + i, ints[:, :, :, i * bt:(i + 1) * bt])


def place_flow(colo: Colocation, arena: Arena, spec: KVSpec, toks: Any, first: int, place: Place,
               namespace: str, stats: c.ClientStats, report: Callable[[], None]) -> Flow[int | None]:
    """``get_kv_blocks`` co-located: the prefix's slots found with no request (remembered, or in
    the arena's key index), else named by the server (one request, which counts the get); each
    block from ``first`` on placed from the arena, what it lacks fetched over HTTP in one batch.
    Returns the prefix in tokens (from token 0) whose blocks from ``first`` on were placed;
    None when the server names another arena's slots (it restarted): the caller goes over HTTP.
    """
    bt = spec.block_tokens
    blocks = arena.blocks_for(spec, toks, namespace)
    if blocks is not None:
        missing = yield Copy(spec.bytes_per_token * max(0, len(blocks) - first) * bt, place_from_handles, arena,
                             blocks[first:], spec, first, place, stats)
        if not missing:  # reported as a get of the blocks read (the caller held those before ``first``)
            arena.served_from_cache(blocks[first:], bt, stats)
            if arena.accesses.due():
                report()
            return len(blocks) * bt
        arena.handles.forget([blocks[first + i] for i in missing])
    answer = yield calls.kv_call("/v1/kv/handles", spec, toks, None)
    c.warn_hint(stats, spec, answer.get("hint"))
    if colo.changed(arena, answer.get("segment"), "segment"):
        return None
    blocks = answer["blocks"]
    arena.handles.remember(blocks)
    stats.shm_gets += 1
    stats.last_medium = "shm"
    if len(blocks) <= first:
        return len(blocks) * bt
    missing = yield Copy(spec.bytes_per_token * (len(blocks) - first) * bt, place_from_handles, arena,
                         blocks[first:], spec, first, place, stats)
    if not missing:
        return len(blocks) * bt
    # rare: blocks in a lower tier, or slots that changed twice: over HTTP, decoded, then placed
    want = {blocks[first + i]["key"]: i for i in missing}
    body = yield calls.raw_blocks(list(want))
    arrived = _place_batch(body, want, spec, first, place)
    stats.shm_blocks_fetched_over_http += len(arrived)
    lost = sorted(set(missing) - arrived)
    return (first + lost[0] if lost else len(blocks)) * bt


def _place_batch(body: bytes, want: dict[str, int], spec: KVSpec, first: int, place: Place) -> set[int]:
    """The frames of a ``/v1/blocks/get`` answer decoded and placed; the block indexes that arrived sound."""
    parsed, data_at = parse_batch_head(body)
    view = memoryview(body)
    block = torch.empty(spec.kv_shape(spec.block_tokens), dtype=spec.torch_dtype)
    ints = int_view(block)
    done = set()
    for b in parsed:
        i = want.get(b.get("key"))
        if i is None or b.get("offset") is None:
            continue
        try:
            codec_mod.decode(view[data_at + b["offset"]:data_at + b["offset"] + b["length"]], out=block)
        except (FrameError, InvalidKV):
            continue
        place(first + i, ints)
        done.add(i)
    return done
