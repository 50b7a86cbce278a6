"""What ``KVClient`` and ``AsyncKVClient`` share: request bodies, answers, the shm arena side.

No I/O to the server happens here; the two clients drive it, one blocking,
one on the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvstore.wire.rest import (H_NAMESPACE, MAX_TOUCH_KEYS, encode_batch_head, encode_kv_head_json, pad64,
                               parse_batch_head)
from kvstore.errors import ServiceError
from kvstore import codec as codec_mod
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import FrameError, InvalidInput, InvalidKV, InvalidSpec, KVStoreError, NotDurable
from kvstore.keys import block_hashes, check_key, normalize_tokens
from kvstore.memory.shm import SHM_DIR, ShmReader, SlotHandle
from kvstore.spec import KVSpec

__all__ = ["entries_params", "ClientStats", "TensorPool", "OutViews", "kv_parts", "kv_bytes", "result_tensor", "check_spec", "Arena",
           "HandleCache", "AccessLog",
           "fill_from_batch", "batch_parts", "frames_of", "give_frame", "verified_header", "VerifiedSlots", "BlockSink",
           "BlockWriter",
           "headers_for", "SHM_DIR"]


_SRC = object()
"""Key of a verified payload view in a handle's dict: never a JSON key, so a server cannot set it."""


@dataclass(slots=True)
class ClientStats:
    """Which medium carried what, as this client saw it."""

    shm_gets: int = 0
    http_gets: int = 0
    shm_puts: int = 0
    http_puts: int = 0
    shm_blocks_fetched_over_http: int = 0
    """Blocks of a co-located get that were not in the arena (or went stale) and came over HTTP."""
    shm_cached_gets: int = 0
    """Co-located gets served from remembered slot handles, without asking the server."""
    shm_frames_verified: int = 0
    """Arena frames read with a full check (header and body checksum): a handle's first read."""
    shm_frames_copied: int = 0
    """Arena frames copied from a handle verified before, under the seqlock only."""
    retries: int = 0
    last_medium: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


def headers_for(token: str | None, namespace: str, content_type: str | None = None) -> dict[str, str]:
    headers = {H_NAMESPACE: namespace}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if content_type:
        headers["Content-Type"] = content_type
    return headers


def entries_params(sort: str, order: str, limit: int, offset: int, **filters: Any) -> dict[str, Any]:
    """Query parameters of ``GET /admin/entries``: filters left at None are not sent."""
    params: dict[str, Any] = {"sort": sort, "order": order, "limit": limit, "offset": offset}
    params.update({k: v for k, v in filters.items() if v is not None})
    return params


def check_spec(spec: Any) -> KVSpec:
    if not isinstance(spec, KVSpec):
        raise InvalidSpec(f"spec must be a KVSpec, got {type(spec).__name__}")
    return spec


def kv_bytes(kv: torch.Tensor) -> memoryview:
    """The bytes of a CPU, C-contiguous ``kv`` (a copy only when it is not already so)."""
    kv = kv.detach()
    if kv.device.type != "cpu":
        kv = kv.cpu()
    kv = kv.contiguous()
    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def kv_parts(spec: KVSpec, tokens: np.ndarray, kv: torch.Tensor | None, *, with_kv: bool = True) -> list[Any]:
    """A KV body as buffers to send one after another (``kvstore.wire.rest``)."""
    kv_tokens = 0 if kv is None else int(kv.shape[3])
    head, tok_region = encode_kv_head_json(_spec_json(spec), len(tokens), kv_tokens)
    tok = memoryview(tokens).cast("B")
    parts: list[Any] = [head, tok]
    if tok_region > len(tok):
        parts.append(bytes(tok_region - len(tok)))
    if kv is not None and with_kv:
        parts.append(kv_bytes(kv))
    return parts


@functools.lru_cache(maxsize=256)
def _spec_json(spec: KVSpec) -> str:
    """A spec's JSON, encoded once per spec (specs are frozen: one per model, used for every call)."""
    return json.dumps(spec.to_dict(), separators=(",", ":"))


def tokens_of(tokens: Any) -> np.ndarray:
    return normalize_tokens(tokens)


def validate_put(spec: KVSpec, tokens: np.ndarray, kv: Any) -> torch.Tensor:
    """The same checks ``KVStore.put_kv`` makes, before anything is sent."""
    return spec.validate_kv(kv, min_tokens=spec.full_blocks(len(tokens)) * spec.block_tokens)


def check_durable(stored: int, lookup: dict) -> None:
    """Raise ``NotDurable`` unless the lookup after a put finds all ``stored`` tokens durable.

    The lookup runs after the put's answer, so a block deleted or evicted in between is
    not durable either: the put stands, its promise does not.
    """
    durable = int(lookup.get("durable_tokens", 0))
    if durable < stored:
        raise NotDurable(f"{stored} tokens stored, {durable} of them on durable tiers (the server's tiers: "
                         f"{sorted({b['tier'] for b in lookup.get('blocks', [])}) or 'none hold them'})",
                         stored_tokens=stored, durable_tokens=durable)


class TensorPool:
    """Result memory that is reused once the caller lets go of a result.

    A fresh 32 MiB tensor costs page faults on first touch: here the fault-in
    ran slower than the network (``docs/design.md``, "Figures this design rests on": 2-7.5 GB/s, and
    under 1 GB/s on a busy VM). A result is a view of a pooled numpy buffer; a
    finalizer on that view fires only when torch frees the storage (every
    tensor sharing it is gone), and gives the buffer back for the next get.

    Args:
        keep_bytes: idle buffer bytes kept for reuse (0: allocate every time).
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []
        self._live: dict[int, tuple[weakref.ref, np.ndarray]] = {}
        self._lock = threading.Lock()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.tensor_and_ints(shape, dtype)[0]

    def tensor_and_ints(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray | None]:
        """A result tensor and, for 2- and 4-byte dtypes, the same memory as same-size ints in numpy."""
        nbytes = math.prod(shape) * dtype.itemsize
        ints_dtype = SAME_SIZE_INTS.get(dtype.itemsize, (None, None))[1]
        if self.keep_bytes <= 0 or nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
            return t, int_view(t) if ints_dtype is not None else None
        base = None
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes + 4096]
            if fits:  # by index: list.remove would compare arrays element by element
                base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        if base is None:
            # torch's allocator, not numpy's: numpy asks for transparent huge pages above 4 MiB,
            # and a get's block-strided copy into those ran 13% slower here (3.5 vs 3.1 ms, 32 MiB)
            base = torch.empty(-(-nbytes // 4096) * 4096, dtype=torch.uint8).numpy()
        view = base[:nbytes]
        ints = None if ints_dtype is None else view.view(ints_dtype).reshape(shape)
        held = view if ints is None else ints  # the very array torch keeps alive (numpy collapses .base chains)
        # a weakref callback, not weakref.finalize: a tenth of the cost on a path measured in microseconds
        ref = weakref.ref(held, self._release)
        self._live[id(ref)] = (ref, base)
        t = torch.from_numpy(held)
        return (t.view(dtype).view(shape) if ints is None else t.view(dtype)), ints

    def _release(self, ref: weakref.ref) -> None:
        with self._lock:
            _, base = self._live.pop(id(ref))
            self._free.append(base)
            while sum(b.nbytes for b in self._free) > self.keep_bytes:  # keep the big ones: they fault most
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))


def result_tensor(spec: KVSpec, n_tokens: int, out: Any = None, pool: TensorPool | None = None) -> torch.Tensor:
    """Where a get's KV lands: a pooled (or fresh) tensor, or a view over the first bytes of ``out``.

    Raises:
        InvalidInput: ``out`` is not a writable contiguous buffer or is too small.
    """
    shape = spec.kv_shape(n_tokens)
    if out is None:
        return pool.tensor(shape, spec.torch_dtype) if pool is not None else torch.empty(shape, dtype=spec.torch_dtype)
    if isinstance(out, torch.Tensor):
        if out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidInput("out must be a contiguous CPU tensor or a writable buffer")
        flat = out.view(-1).view(torch.uint8)
    else:
        try:
            flat = torch.frombuffer(out, dtype=torch.uint8)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"out must be a contiguous CPU tensor or a writable buffer: {exc}") from exc
    need = spec.bytes_per_token * n_tokens
    if flat.numel() < need:
        raise InvalidInput(f"out holds {flat.numel()} bytes, the KV needs {need}")
    return flat[:need].view(spec.torch_dtype).view(shape)


class OutViews:
    """The KV views of the last ``out=`` buffer, reused while callers pass that buffer again.

    ``get_kv(out=)`` exists so a loop reuses one buffer; building its tensor and
    numpy views costs about 5 us of torch calls, a fifth of copying a
    cache-hot 1 MiB. A hit is checked against what could have changed: the
    same ``out`` object, its storage address and size, and the returned view's
    shape and address.
    """

    def __init__(self) -> None:
        self._last: tuple | None = None

    def get(self, spec: KVSpec, n_tokens: int, out: Any) -> tuple[torch.Tensor, np.ndarray]:
        """(KV view, same-size-int numpy view) of ``out``'s first bytes for ``n_tokens``."""
        last = self._last
        if (last is not None and last[0] is out and (last[1] is spec or last[1] == spec) and last[2] == n_tokens
                and out.data_ptr() == last[3] and out.numel() == last[4]):
            kv = last[5]
            if kv.data_ptr() == last[3] and kv.shape == last[7] and kv.is_contiguous():
                return kv, last[6]
        kv = result_tensor(spec, n_tokens, out)
        views = (kv, int_view(kv))
        if isinstance(out, torch.Tensor):
            self._last = (out, spec, n_tokens, out.data_ptr(), out.numel(), kv, views[1], kv.shape)
        return views


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def batch_parts(items: Sequence[tuple[bytes, Any]]) -> list[Any]:
    """A batch body (``kvstore.wire.rest``) of ``(key, frame)`` pairs, as buffers to send."""
    metas, parts, at = [], [], 0
    for key, frame in items:
        view = memoryview(frame).cast("B")
        metas.append({"key": check_key(key).hex(), "offset": at, "length": len(view)})
        parts.append(view)
        if pad64(len(view)) > len(view):
            parts.append(bytes(pad64(len(view)) - len(view)))
        at += pad64(len(view))
    head, _ = encode_batch_head(metas)
    return [head, *parts]


def frames_of(body: bytes) -> list[bytes | None]:
    """The frames of a batch answer, in order; None for each absent one."""
    blocks, data_at = parse_batch_head(body)
    view = memoryview(body)
    return [None if b["offset"] is None else bytes(view[data_at + b["offset"]:data_at + b["offset"] + b["length"]])
            for b in blocks]


def frame_in_namespace(frame: Any, namespace: str) -> bool:
    """Whether a frame's metadata names ``namespace`` (a frame read outside the server's checks)."""
    try:
        meta = json.loads(codec_mod.frame_meta(frame))
    except (FrameError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("ns") == namespace


BlockSink = Callable[[int, "codec_mod.FrameHeader", memoryview], None]
"""``sink(i, header, payload)``: takes block ``i``'s verified raw payload (valid only during the call)."""

BlockWriter = Callable[[int, memoryview], int]
"""``writer(i, view) -> n``: writes block ``i``'s sealed frame into ``view``; returns its length."""


def give_frame(frame: memoryview, namespace: str, i: int, sink: BlockSink, checksum: int | None) -> bool:
    """Verify ``frame`` and hand its raw payload to ``sink``; False (a miss) when it fails its
    checksum (or is not the ``checksum`` the server indexed), is another namespace's, or cannot
    be decoded."""
    header = verified_header(frame, namespace, checksum)
    if header is None:
        return False
    if header.codec is codec_mod.Codec.RAW and not header.lz4:
        payload = frame[header.payload_offset:header.frame_len]
    else:  # a cold tier's int8 or lz4 frame: its raw bytes first
        try:
            payload = memoryview(int_view(codec_mod.decode(frame))).cast("B")
        except (FrameError, InvalidKV):
            return False
    sink(i, header, payload)
    return True


def verified_header(frame: memoryview, namespace: str, checksum: int | None) -> "codec_mod.FrameHeader | None":
    """``frame``'s header once its body checksum passed (one pass) and its metadata names
    ``namespace`` (and its checksum is ``checksum``, when given); None otherwise."""
    try:
        header = codec_mod.verify(frame)
        meta = json.loads(bytes(frame[header.meta_offset:header.meta_offset + header.meta_len]))
    except (FrameError, ValueError):
        return None
    if checksum is not None and header.body_checksum != checksum:
        return None
    return header if isinstance(meta, dict) and meta.get("ns") == namespace else None


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


def fill_from_batch(body: bytes, want: dict[str, int], out: torch.Tensor, bt: int,
                    checksums: dict[str, int]) -> set[int]:
    """Decode the frames of a ``/v1/blocks/get`` answer into ``out``'s block slices.

    Args:
        want: key hex -> block index in ``out``.

    Returns:
        The block indexes that arrived sound.
    """
    blocks, data_at = parse_batch_head(body)
    view = memoryview(body)
    done = set()
    for b in blocks:
        i = want.get(b.get("key"))
        if i is None or b.get("offset") is None:
            continue
        frame = view[data_at + b["offset"]:data_at + b["offset"] + b["length"]]
        try:
            codec_mod.decode(frame, out=out[:, :, :, i * bt:(i + 1) * bt])
        except (FrameError, InvalidKV):
            continue
        done.add(i)
    return done


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
        self._keys: OrderedDict[tuple[str, str, bytes], list[str]] = OrderedDict()
        self._lock = threading.Lock()

    def keys_of(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> list[str]:
        """The hex block keys of ``tokens``, memoized: an agent re-reads the same prefixes."""
        if len(tokens) > self.MEMO_MAX_TOKENS:
            return [k.hex() for k in block_hashes(spec, tokens, namespace)]
        memo = (namespace, spec.fingerprint(), tokens.tobytes())
        keys = self._keys.get(memo)
        if keys is None:
            keys = [k.hex() for k in block_hashes(spec, tokens, namespace)]
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
        keys = self.keys_of(spec, tokens, namespace)
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
            if self._since is None:
                self._since = time.monotonic()

    def due(self) -> bool:
        return self._since is not None and (self._reads >= self.max_keys
                                            or time.monotonic() - self._since >= self.max_age_s)

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


class Arena:
    """The server's shm arena (read, through ``ShmReader``) and staging segment (write), mapped here.

    Raises:
        KVStoreError: either segment cannot be opened (not co-located after all).
    """

    def __init__(self, segment: str, staging_segment: str, shm_dir: str = SHM_DIR) -> None:
        self.segment = segment
        self.reader = ShmReader(segment, shm_dir)
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
        self.handles = HandleCache()
        self.verified = VerifiedSlots()
        self.accesses = AccessLog()
        self._idle: list[dict] = []
        self.leases: list[dict] = []
        """Every staging lease this client holds; each put uses one no other put is using."""
        self._lock = threading.Lock()

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
        for i, b in enumerate(blocks):
            h = b.get("handle")
            if h is None:
                missing.append(i)
                continue
            src = b.get(_SRC)
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
                b[_SRC] = self.reader.frame_array(handle, header.payload_offset, ints, header.shape)
        return missing

    def write_staging(self, lease: dict, kv: torch.Tensor) -> int:
        """Copy ``kv``'s bytes into ``lease``; returns the byte count."""
        src = np.frombuffer(kv_bytes(kv), np.uint8)
        # numpy, not torch's copy_: torch's threaded copy stalls when the cores are busy
        dst = np.frombuffer(self.staging, np.uint8, len(src), lease["offset"])
        np.copyto(dst, src)
        del dst  # drop the export, so the mapping can close
        return len(src)

    def read_block(self, h: dict, checksum: int | None, namespace: str, i: int, sink: BlockSink,
                   stats: ClientStats) -> bool:
        """Hand the frame in slot handle ``h`` to ``sink``; False when the slot changed since the
        server named it, or the frame fails (a miss). Only a slot's first read hashes
        (``VerifiedSlots``); it holds a read lease, later ones copy under the seqlock."""
        done = self.copy_verified(h, checksum, i, sink, stats)
        if done is not None:
            return done
        handle = SlotHandle(self.segment, h["index"], h["offset"], h["length"], h["gen"])
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

    def close(self) -> None:
        self.verified.clear()
        self.handles.clear()  # drops the payload views, so the mapping can close
        self.reader.close()
        with contextlib.suppress(BufferError):
            self.staging.close()

