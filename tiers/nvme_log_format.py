"""The log-structured nvme layout's records: what one append writes and how a scan reads it back.

A segment file is a run of records, each a fixed 72-byte header then its frame:

    magic "KVL1" | kind u8 | 3 zero bytes | seq u64 | key 32 B | frame length u64 |
    xxh3-64 of the frame | xxh3-64 of the 64 header bytes before it

``kind`` is a frame or a tombstone (a delete; no body). ``seq`` orders every record the
tier ever wrote: at start the highest seq of a key wins, so a tombstone hides the older
frames of its key and a compacted copy (which keeps its record's seq) never hides a newer
put. Records are padded to 8 bytes so every header starts aligned.

The header's own hash makes a torn or zeroed header fail on its own; the frame's hash
makes a torn body fail. A scan stops at the first record that fails: what follows in
that segment cannot be trusted to start where the lengths say.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterator

import xxhash

__all__ = [
    "HEADER", "FRAME", "TOMBSTONE", "Record", "encode_header", "frame_checksum", "parse_header", "record_size", "scan",
    "MAX_FRAME_BYTES",
]

_HEAD = struct.Struct("<4sB3xQ32sQQ")  # the 64 hashed bytes
_CHECK = struct.Struct("<Q")
HEADER = _HEAD.size + _CHECK.size  # 72
MAGIC = b"KVL1"
FRAME, TOMBSTONE = 1, 2
MAX_FRAME_BYTES = 1 << 36  # a longer length is damage, not a record of ours
_ALIGN = 8
_SCAN_CHUNK = 1 << 20  # a scan that verifies bodies reads them in pieces of at most this


@dataclass(frozen=True, slots=True)
class Record:
    """One record as a scan found it: where it starts and what its header says."""

    offset: int
    kind: int
    seq: int
    key: bytes
    length: int
    checksum: int

    @property
    def size(self) -> int:
        return record_size(self.length)


def record_size(length: int) -> int:
    """Bytes a record with a ``length``-byte frame takes in its segment, padding included."""
    return (HEADER + length + _ALIGN - 1) // _ALIGN * _ALIGN


def encode_header(kind: int, seq: int, key: bytes, length: int, checksum: int) -> bytes:
    """The header of a record whose frame is ``length`` bytes hashing to ``checksum`` (``frame_checksum``)."""
    head = _HEAD.pack(MAGIC, kind, seq, key, length, checksum)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def frame_checksum(frame: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(frame)


def parse_header(raw: bytes | memoryview, offset: int) -> Record | None:
    """The record whose header is ``raw`` (72 bytes at ``offset``), or None when it fails its checks."""
    if len(raw) < HEADER:
        return None
    head = raw[: _HEAD.size]
    if _CHECK.unpack_from(raw, _HEAD.size)[0] != xxhash.xxh3_64_intdigest(head):
        return None
    magic, kind, seq, key, length, checksum = _HEAD.unpack(head)
    if magic != MAGIC or kind not in (FRAME, TOMBSTONE) or length > MAX_FRAME_BYTES:
        return None
    if kind == TOMBSTONE and length != 0:
        return None
    return Record(offset, kind, seq, bytes(key), length, checksum)


def scan(fd: int, size: int, *, verify: bool) -> Iterator[Record]:
    """The records of a segment of ``size`` bytes, in order, up to the first that fails.

    ``verify`` hashes every frame too (a segment that was still being written when the tier
    stopped: its tail may be torn); without it only headers are read, one ``pread`` each,
    and a damaged body shows on the first read of that frame.
    """
    offset = 0
    while offset + HEADER <= size:
        raw = os.pread(fd, HEADER, offset)
        rec = parse_header(raw, offset)
        if rec is None or offset + HEADER + rec.length > size:
            return
        if verify and rec.length:
            if not _body_matches(fd, offset + HEADER, rec.length, rec.checksum):
                return
        yield rec
        offset += rec.size


def _body_matches(fd: int, at: int, length: int, checksum: int) -> bool:
    hasher = xxhash.xxh3_64()
    done = 0
    while done < length:
        chunk = os.pread(fd, min(length - done, _SCAN_CHUNK), at + done)
        if not chunk:
            return False
        hasher.update(chunk)
        done += len(chunk)
    return hasher.intdigest() == checksum
