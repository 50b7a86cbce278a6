"""What ``KVClient`` and ``AsyncKVClient`` share: checks, request bodies, answers, result memory.

No I/O to the server happens here; the two clients drive it, one blocking,
one on the event loop. The mapped arena is ``client_sdk.arena``.
"""

from __future__ import annotations

import collections.abc
import functools
import json
import math
import os
import secrets
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from client_sdk._http import Strided
from kvstore import codec as codec_mod
from kvstore.memory.buffers import BufferPool
from kvstore.codec import SAME_SIZE_INTS, int_view
from kvstore.errors import FrameError, InvalidInput, InvalidKV, InvalidSpec, KVStoreWarning, NotDurable
from kvstore.keys import block_hashes, check_key, normalize_tokens
from kvstore.memory.shm import SHM_DIR
from kvstore.spec import KVSpec
from kvstore.wire.rest import (BLOCK_LABEL_BYTES, H_AGENT, H_NAMESPACE, encode_batch_head, encode_block_labels,
                               encode_kv_head_json, pad64, parse_batch_head)

__all__ = ["entries_params", "ClientStats", "TensorPool", "OutViews", "kv_parts", "kv_bytes", "result_tensor",
           "check_spec", "fill_from_batch", "batch_parts", "frames_of", "give_frame", "verified_header", "BlockSink",
           "BlockWriter", "BlockFill", "headers_for", "warn_hint", "SHM_DIR", "VERIFIED_VIEW", "KVPutBody",
           "raw_frame_of"]


VERIFIED_VIEW = object()
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
    """Co-located gets served with no request: remembered slot handles, or the arena's shared key index."""
    shm_frames_verified: int = 0
    """Arena frames read with a full check (header and body checksum): a handle's first read."""
    shm_frames_copied: int = 0
    """Arena frames copied from a handle verified before, under the seqlock only."""
    shm_frames_trusted: int = 0
    """Arena frames the server had verified (the slot's verified word): copied with no body hash."""
    retries: int = 0
    last_medium: str | None = None
    hinted: set[tuple[str, str]] = field(default_factory=set, repr=False)
    """(asked spec's fingerprint, hint) of each spec-mismatch hint this client warned of (``warn_hint``)."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "hinted"}  # type: ignore[attr-defined]
        out["hints_warned"] = len(self.hinted)
        return out


_MAX_HINTED = 1024
"""Hints a client remembers having warned of; past it the set starts over (a repeat warning is
better than memory that grows with every pair of specs a long-lived client ever mixed up)."""


def warn_hint(stats: ClientStats, spec: KVSpec, hint: Any) -> None:
    """Warn of the server's hint (a get found nothing, but the tokens' first block is stored under
    another spec of the model: ``X-KV-Hint``, or ``hint`` in a JSON answer) as a ``KVStoreWarning``,
    once per pair of specs per client: the empty answer is right, but likely not what was meant."""
    if not hint or not isinstance(hint, str):
        return
    pair = (spec.fingerprint(), hint)
    if pair in stats.hinted:
        return
    if len(stats.hinted) >= _MAX_HINTED:
        stats.hinted.clear()
    stats.hinted.add(pair)
    warnings.warn(hint, KVStoreWarning, stacklevel=3)


def agent_id(agent: str | None) -> str:
    """The agent id a client sends (``x-kv-agent``): the caller's name for it, or one made up per
    client, so the server can tell one agent's reads from another's (it learns hand-offs).

    Raises:
        InvalidInput: a name of more than 128 characters or with unprintable ones.
    """
    if agent is None:
        return f"{os.getpid()}-{secrets.token_hex(4)}"
    if not isinstance(agent, str) or not 0 < len(agent) <= 128 or not agent.isprintable():
        raise InvalidInput(f"agent must be a printable name of 1 to 128 characters, got {agent!r}")
    return agent


def headers_for(token: str | None, namespace: str, content_type: str | None = None,
                agent: str | None = None) -> dict[str, str]:
    headers = {H_NAMESPACE: namespace}
    if agent:  # who is calling: the server learns hand-offs between agents from it
        headers[H_AGENT] = agent
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


def kv_parts(spec: KVSpec, tokens: np.ndarray, kv: torch.Tensor | None, *, with_kv: bool = True,
             extra: str = "") -> list[Any]:
    """A KV body as buffers to send one after another (``kvstore.wire.rest``); ``extra``: more
    members of its JSON head (``encode_kv_head_json``)."""
    kv_tokens = 0 if kv is None else int(kv.shape[3])
    head, tok_region = encode_kv_head_json(_spec_json(spec), len(tokens), kv_tokens, extra)
    tok = memoryview(tokens).cast("B")
    parts: list[Any] = [head, tok]
    if tok_region > len(tok):
        parts.append(bytes(tok_region - len(tok)))
    if kv is not None and with_kv:
        parts.append(kv_bytes(kv))
    return parts


class KVPutBody(collections.abc.Sequence):
    """A put's KV body in both layouts ``POST /v1/kv/put`` takes (``kvstore.wire.rest``).

    As a sequence of buffers it is the token-major body (``KV_MEDIA``), which every server takes;
    ``blocks()`` is the block-major one (``KV_BLOCKS_MEDIA``), which a server that lists it in
    ``/v1/info``'s ``put_media`` receives straight into its slots. The transport picks
    (``client_sdk.transport``); both are views of ``kv``, neither copies it (once contiguous).
    """

    __slots__ = ("spec", "tokens", "_parts")

    def __init__(self, spec: KVSpec, tokens: np.ndarray, kv: torch.Tensor) -> None:
        self.spec, self.tokens = spec, tokens
        self._parts = kv_parts(spec, tokens, kv)  # its last part: the KV's bytes, C order

    def __len__(self) -> int:
        return len(self._parts)

    def __getitem__(self, i: Any) -> Any:
        return self._parts[i]

    def blocks(self, namespace: str) -> list[Any]:
        """The block-major body for ``namespace``: head and tokens, then each full block's label
        (its depth and key) and its ``[L, 2, H, bt, D]`` bytes, sent as rows of the KV's memory
        (``client_sdk._http.Strided``)."""
        spec, n = self.spec, len(self.tokens)
        blocks, bt = spec.full_blocks(n), spec.block_tokens
        head, tok_region = encode_kv_head_json(_spec_json(spec), n, blocks * bt)
        tok = memoryview(self.tokens).cast("B")
        parts: list[Any] = [head, tok, bytes(tok_region - len(tok))]
        if blocks:
            labels = np.frombuffer(encode_block_labels(block_hashes(spec, self.tokens, namespace), spec.block_nbytes),
                                   np.uint8).reshape(blocks, BLOCK_LABEL_BYTES)
            kv = np.frombuffer(self._parts[-1], np.uint8)
            rows = spec.num_layers * 2 * spec.num_kv_heads
            run = bt * spec.bytes_per_token // rows  # one (layer, K/V, head)'s bytes of a block
            # [rows, T x D] -> [rows, blocks, run] (the tail past the full blocks left out) -> block-major
            grid = kv.reshape(rows, -1)[:, :blocks * run].reshape(rows, blocks, run).transpose(1, 0, 2)
            if grid.flags.c_contiguous:  # one block, no tail: a buffer, not a writev of its rows
                parts += [memoryview(labels.reshape(-1)), memoryview(grid.reshape(-1))]
            else:
                parts.append(Strided(grid, labels))
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
        # A result is not kept in a buffer over twice its size (plus a page), and the big buffers
        # are the ones worth keeping: they fault most when made again.
        self._buffers: BufferPool[np.ndarray] = BufferPool(keep_bytes, alloc=_torch_bytes, max_slack=4096,
                                                           drop_smallest=True)
        self._live: dict[int, tuple[weakref.ref, np.ndarray]] = {}

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.tensor_and_ints(shape, dtype)[0]

    def tensor_and_ints(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray | None]:
        """A result tensor and, for 2- and 4-byte dtypes, the same memory as same-size ints in numpy."""
        nbytes = math.prod(shape) * dtype.itemsize
        ints_dtype = SAME_SIZE_INTS.get(dtype.itemsize, (None, None))[1]
        if self.keep_bytes <= 0 or nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
            return t, int_view(t) if ints_dtype is not None else None
        base = self._buffers.acquire(nbytes)
        view = base[:nbytes]
        ints = None if ints_dtype is None else view.view(ints_dtype).reshape(shape)
        held = view if ints is None else ints  # the very array torch keeps alive (numpy collapses .base chains)
        # a weakref callback, not weakref.finalize: a tenth of the cost on a path measured in microseconds
        ref = weakref.ref(held, self._release)
        self._live[id(ref)] = (ref, base)
        t = torch.from_numpy(held)
        return (t.view(dtype).view(shape) if ints is None else t.view(dtype)), ints

    def _release(self, ref: weakref.ref) -> None:
        _, base = self._live.pop(id(ref))
        self._buffers.release(base)


def _torch_bytes(nbytes: int) -> np.ndarray:
    """A page-rounded uint8 buffer from torch's allocator, not numpy's: numpy asks for transparent
    huge pages above 4 MiB, and a get's block-strided copy into those ran 13% slower here (3.5 vs
    3.1 ms, 32 MiB)."""
    return torch.empty(-(-nbytes // 4096) * 4096, dtype=torch.uint8).numpy()


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
"""``sink(i, header, payload)``: takes block ``i``'s verified raw payload (valid only during the call).
Blocks come in any order; a block whose slot changed during its call comes again (the last call wins)."""

BlockFill = Callable[[int, np.ndarray], None]
"""``fill(depth, dst)``: writes block ``depth``'s KV into ``dst`` (``[L, 2, H, block_tokens, D]``
of the dtype's bits as same-size ints: a slot's payload, or a slice of a tensor)."""

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


def raw_frame_of(header: codec_mod.FrameHeader, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether ``header`` is a raw frame (no lz4) of a ``shape`` tensor of ``dtype``: one whose
    payload a reader copies straight into its result, as same-size ints."""
    return (header.codec is codec_mod.Codec.RAW and not header.lz4 and header.shape == shape
            and codec_mod.DTYPES.get(header.dtype) == dtype)


def verified_header(frame: memoryview, namespace: str, checksum: int | None, *,
                    trusted: bool = False) -> "codec_mod.FrameHeader | None":
    """``frame``'s header once its body checksum passed (one pass) and its metadata names
    ``namespace`` (and its checksum is ``checksum``, when given); None otherwise.
    ``trusted``: the server verified this body (the slot's verified word): check the header only."""
    try:
        header = codec_mod.read_header(frame) if trusted else codec_mod.verify(frame)
        meta = json.loads(bytes(frame[header.meta_offset:header.meta_offset + header.meta_len]))
    except (FrameError, ValueError):
        return None
    if checksum is not None and header.body_checksum != checksum:
        return None
    return header if isinstance(meta, dict) and meta.get("ns") == namespace else None


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
