"""The nvme tier's file format: safetensors with one U8 tensor, read and written by hand.

A file is a u64 header length, a JSON header padded with spaces so the data
starts at byte 4096 (the O_DIRECT unit), and one U8 tensor "frame".
``__metadata__`` holds the format tag, key hex, frame length and an xxh3-64 of
the frame, plus codec, dtype, shape and spec fingerprint when the bytes parse as
a KVSF frame. Any safetensors reader opens these files; no pickle is involved.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from dataclasses import dataclass

import xxhash

from kvstore import codec as codec_mod
from kvstore.errors import InvalidInput
from kvstore.memory.buffers import Scratch
from kvstore.tier import Buffer, FrameWriter

__all__ = [
    "FORMAT", "DATA_OFFSET", "NO_SPACE", "Corrupt", "FileHeader", "staging_pool", "check_size",
    "fill_staged", "file_header", "load", "read_prefix",
    "write_direct", "write_all", "byte_view", "fsync_dir", "unlink_quietly",
]

FORMAT = "kvstore-nvme/1"
"""``__metadata__["format"]`` of every file the nvme tier writes."""

ALIGN = 4096  # data offset and O_DIRECT unit: covers 512 B and 4 KiB logical blocks
DATA_OFFSET = ALIGN  # our header always fits in the first 4 KiB (fields are bounded)
MAX_HEADER_BYTES = 1 << 20  # a larger header length is damage, not a file of ours
MAX_POOLED_BYTES = 256 << 20  # per-thread staging kept for reuse up to this size
FACT_MAX_CHARS = 128  # optional metadata strings are cut to this, so the header fits
U64 = struct.Struct("<Q")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class Corrupt(Exception):
    """A file failed a check; ``ident`` is its (st_dev, st_ino) when known."""

    def __init__(self, reason: str, ident: tuple[int, int] | None = None) -> None:
        super().__init__(reason)
        self.ident = ident


@dataclass(frozen=True, slots=True)
class FileHeader:
    """What a file's safetensors header promises about its frame."""

    frame_len: int
    checksum: int  # xxh3-64 of the frame bytes
    data_offset: int
    ident: tuple[int, int]  # (st_dev, st_ino): a failed read quarantines that file, not a newer one


def staging_pool() -> Scratch[mmap.mmap]:
    """One page-aligned buffer per thread (O_DIRECT needs the alignment), reused across puts:
    a fresh 32 MiB allocation costs ~15 ms of page faults here, more than the write."""
    return Scratch(_anonymous_map, len, round_to=ALIGN, max_kept=MAX_POOLED_BYTES)


def check_size(size: object) -> None:
    """A ``put_with``'s ``size``, checked before capacity is held for it.

    Raises:
        InvalidInput: not a non-negative int.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidInput(f"size must be a non-negative int, got {size!r}")


def fill_staged(pool: Scratch[mmap.mmap], at: int, size: int, writer: FrameWriter) -> tuple[memoryview, int]:
    """A ``put_with``'s frame: ``writer`` fills ``size`` bytes at ``at`` of this thread's staging
    buffer (reused across puts, none allocated); (the whole buffer, the length it reported).

    Raises:
        InvalidInput: ``writer`` reported more than ``size`` bytes.
    """
    staged = memoryview(pool.get(at + size))
    with staged[at:at + size] as view:
        n = writer(view)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= size:
        raise InvalidInput(f"writer reported {n!r} bytes for a {size}-byte buffer")
    return staged, n


def _anonymous_map(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


def file_header(key_hex: str, frame: memoryview) -> bytes:
    """The safetensors header (length + JSON padded to ``DATA_OFFSET``) for ``frame``."""
    n = len(frame)
    meta = {"format": FORMAT, "key": key_hex, "frame_len": str(n), "xxh3_64": f"{xxhash.xxh3_64_intdigest(frame):016x}"}
    meta.update(frame_facts(frame))
    doc = {"__metadata__": meta, "frame": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    body = json.dumps(doc, separators=(",", ":")).encode()
    room = DATA_OFFSET - U64.size
    if len(body) > room:  # unreachable with bounded facts; keep the layout fixed regardless
        raise AssertionError(f"nvme header of {len(body)} bytes exceeds {room}")
    return U64.pack(room) + body + b" " * (room - len(body))


def frame_facts(frame: memoryview) -> dict[str, str]:
    """Codec, dtype, shape and spec fingerprint of a KVSF frame; codec "opaque" otherwise.

    Tiers treat frames as opaque bytes: these facts are a courtesy for other
    tools and for re-indexing, so nothing here may fail a put.
    """
    try:
        head = codec_mod.read_header(frame)
        facts = {"codec": head.codec.value, "dtype": head.dtype, "shape": ",".join(map(str, head.shape))}
    except Exception:  # noqa: BLE001 - any bytes are a valid frame for a tier
        return {"codec": "opaque"}
    try:
        info = json.loads(bytes(frame[head.meta_offset : head.meta_offset + head.meta_len]))
        for ours, theirs in (("spec_fingerprint", "spec"), ("namespace", "ns"), ("depth", "depth")):
            if isinstance(info.get(theirs), (str, int)):
                facts[ours] = str(info[theirs])
    except Exception:  # noqa: BLE001 - caller meta need not be JSON
        pass
    return {k: v[:FACT_MAX_CHARS] for k, v in facts.items()}


def load(path: str, key_hex: str, *, body: bool, out: memoryview | None = None) -> tuple[FileHeader, Buffer | None]:
    """Check ``path``'s header against ``key_hex`` and its length; read and hash the frame if ``body``.

    With ``out``, the frame lands there (no allocation) and the returned body is ``out``.

    Raises:
        Corrupt: not a file of ours for this key, the wrong length or checksum.
        InvalidInput: ``out`` is shorter than the frame.
        OSError: as the OS reports it (FileNotFoundError included).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = parse_header(fd, key_hex)
        return header, (read_body(fd, header, out) if body else None)
    finally:
        os.close(fd)


def parse_header(fd: int, key_hex: str) -> FileHeader:
    st = os.fstat(fd)
    ident = (st.st_dev, st.st_ino)
    head = os.pread(fd, ALIGN, 0)
    if len(head) < U64.size:
        raise Corrupt("file shorter than a header", ident)
    (hlen,) = U64.unpack_from(head)
    if hlen > MAX_HEADER_BYTES:
        raise Corrupt(f"header length {hlen} is not plausible", ident)
    if len(head) < U64.size + hlen:
        head += os.pread(fd, U64.size + hlen - len(head), len(head))
    try:
        doc = json.loads(head[U64.size : U64.size + hlen])
        meta, tensor = doc["__metadata__"], doc["frame"]
        n = int(meta["frame_len"])
        checksum = int(meta["xxh3_64"], 16)
        ok = (meta["format"] == FORMAT and meta["key"] == key_hex and len(doc) == 2
              and tensor == {"dtype": "U8", "shape": [n], "data_offsets": [0, n]})
    except (ValueError, KeyError, TypeError) as exc:
        raise Corrupt(f"unreadable header: {exc}", ident) from None
    if not ok:
        raise Corrupt("header is not a frame of this key", ident)
    if st.st_size != U64.size + hlen + n:
        raise Corrupt(f"file is {st.st_size} bytes, its header promises {U64.size + hlen + n}", ident)
    return FileHeader(frame_len=n, checksum=checksum, data_offset=U64.size + hlen, ident=ident)


def read_prefix(path: str, key_hex: str, nbytes: int) -> tuple[bytes, int]:
    """The first ``nbytes`` of the frame in ``path`` (header checked, body not hashed) and its length.

    Raises:
        Corrupt: not a file of ours for this key, or the wrong length.
        OSError: as the OS reports it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = parse_header(fd, key_hex)
        return os.pread(fd, min(nbytes, header.frame_len), header.data_offset), header.frame_len
    finally:
        os.close(fd)


def read_body(fd: int, header: FileHeader, out: memoryview | None = None) -> Buffer:
    """Read and verify the frame bytes into ``out`` or one new buffer. Raises Corrupt."""
    if out is None:
        buf: Buffer = bytearray(header.frame_len)
        view = memoryview(buf)
    else:
        if len(out) < header.frame_len:
            raise InvalidInput(f"out holds {len(out)} bytes, the frame needs {header.frame_len}")
        buf = view = out[: header.frame_len]
    pos = 0
    while pos < header.frame_len:
        got = os.preadv(fd, [view[pos:]], header.data_offset + pos)
        if got == 0:
            raise Corrupt("file ended early", header.ident)
        pos += got
    if xxhash.xxh3_64_intdigest(view) != header.checksum:
        raise Corrupt("frame checksum mismatch", header.ident)
    return buf


# -- low-level writes ----------------------------------------------------------


def write_direct(fd: int, header: bytes, frame_len: int, staged: memoryview) -> None:
    """Write header + frame from the page-aligned ``staged`` in whole blocks, then trim the tail."""
    staged[:DATA_OFFSET] = header
    end = DATA_OFFSET + frame_len
    padded = round_up(end)
    staged[end:padded] = bytes(padded - end)
    write_all(fd, [staged[:padded]])
    os.ftruncate(fd, end)


def write_all(fd: int, views: list[memoryview]) -> None:
    """writev until every byte is written (the kernel may write less per call)."""
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def pwrite_all(fd: int, views: list[memoryview], pos: int = 0) -> None:
    """pwritev from ``pos`` until every byte is written (the kernel may write less per call)."""
    views = [v for v in views if len(v)]
    while views:
        n = os.pwritev(fd, views, pos)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def byte_view(frame: Buffer) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError as exc:
        raise InvalidInput(f"a frame must be a bytes-like object, got {type(frame).__name__}") from exc
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
