"""The read path of ``KVStore.get_kv``: the frames of a stored prefix decoded into the result.

``KVStore.get_kv`` walks the prefix (``EngineCore.current_prefix``, adopting what only the shared
tier holds); ``decode_chain`` then fills the caller's tensor block by block. A frame a tier
lends in place (the shm arena) is decoded straight out of its slot, hashed on its first read
only; any other is copied into a per-thread scratch buffer and decoded from there, checked
against the checksum the index holds. A frame that fails is dropped from the index
(``EngineCore.drop``) and the chain stops there: fewer tokens, never wrong KV.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore import codec as codec_mod
from kvstore.engine.core import EngineCore, is_current
from kvstore.engine.index import IndexEntry
from kvstore.errors import FrameError, InvalidKV
from kvstore.keys import BlockHash
from kvstore.memory.buffers import Scratch

__all__ = ["decode_chain"]

log = logging.getLogger("kvstore.engine.store")


def _frame_buffer(n: int) -> memoryview:
    return memoryview(bytearray(n))


# One frame buffer per thread, grown (at least doubling) to the largest frame read so far: a
# fresh buffer per block would page-fault at a fraction of copy speed (kvstore.memory.buffers).
_FRAMES = Scratch(_frame_buffer, len, grow=2.0)


def decode_chain(core: EngineCore, found: list[IndexEntry], adopted: dict[BlockHash, Any], out: torch.Tensor,
                 block_tokens: int, namespace: str, spec_fp: str) -> int:
    """Decode the blocks of ``found`` into ``out`` (``[L, 2, H, len(found) * block_tokens, D]``), in
    order; ``adopted`` holds frames already read from the shared tier. Returns how many blocks
    were decoded: the chain stops at the first that is damaged or gone."""
    bt = block_tokens
    scratch = _FRAMES.get(max((e.size for e in found), default=0))
    good = 0
    for i, entry in enumerate(found):
        key = entry.key
        part = out[:, :, :, i * bt: (i + 1) * bt]
        frame = adopted.pop(key, None)
        if frame is None and core.tier(entry.tier).lends_frames:
            try:  # decoded straight out of the slot, hashed on its first read only
                done = core.decode_into(entry, part)
            except (FrameError, InvalidKV) as exc:  # InvalidKV: a frame of another shape or dtype
                if _again(core, entry, scratch, part, namespace, spec_fp, exc):
                    good += 1
                    continue
                break
            if done is not None:
                good += 1
                continue
            # gone from that tier meanwhile (moved?): the copy path below looks once more
        if frame is not None:
            n = len(memoryview(frame).cast("B"))
            scratch[:n] = memoryview(frame).cast("B")
        else:
            n = core.read_into(entry, scratch)
        if n is None:  # moved between our index read and the copy: look once more
            again = core.entry(key)
            if again is None or again is entry or not is_current(again, namespace, spec_fp):
                break
            entry = again
            n = core.read_into(entry, scratch)
            if n is None:
                break
        try:
            # expect_checksum: a sound frame that is not the one indexed (a tier mix-up) is refused
            codec_mod.decode(scratch[:n], out=part, expect_checksum=entry.checksum)
        except (FrameError, InvalidKV) as exc:
            if _again(core, entry, scratch, part, namespace, spec_fp, exc):
                good += 1
                continue
            break
        good += 1
    return good


def _again(core: EngineCore, entry: IndexEntry, scratch: memoryview, part: torch.Tensor, namespace: str,
           spec_fp: str, exc: Exception) -> bool:
    """After ``entry``'s frame failed: if the key's entry changed meanwhile (the frame was
    rewritten in place, as a re-encode does: ``kvstore.engine.recode``), decode the new one once;
    otherwise the frame is damaged and dropped. True when the block was decoded."""
    again = core.entry(entry.key)
    if again is entry:  # a rewrite may be between its write and its index switch: let it finish
        with core.claim(entry.key):
            again = core.entry(entry.key)
    if again is None or again is entry or not is_current(again, namespace, spec_fp):
        _damaged(core, entry, exc)  # a no-op drop when the entry changed: it is not the one named
        return False
    buf = scratch if again.size <= len(scratch) else _FRAMES.get(again.size)
    n = core.read_into(again, buf)
    if n is None:
        return False
    try:
        codec_mod.decode(buf[:n], out=part, expect_checksum=again.checksum)
    except (FrameError, InvalidKV) as exc2:
        _damaged(core, again, exc2)
        return False
    return True


def _damaged(core: EngineCore, entry: IndexEntry, exc: Exception) -> None:
    log.warning("block %s in tier %s failed to decode (%s); dropped as a miss", entry.key.hex(), entry.tier, exc)
    core.drop(entry, corrupt=True)
