"""kvstore as SGLang HiCache's storage backend (its "L3"): ``KVStoreHiCacheStorage``.

SGLang loads it by configuration, with no code of ours in its tree::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "url": "http://127.0.0.1:8470", "namespace": "sglang"}'

Each HiCache page is one kvstore block. SGLang names pages by its own chained SHA-256
of the tokens; the block key is ``named_key(namespace, "sglang", scope + page key)``,
where the scope folds in the model fingerprint, the host pool's layout, dtype and page
geometry, and the tensor-parallel rank. So two models, two page layouts or two TP
shards never read each other's bytes: they miss instead.

A page is stored as a 1-D raw frame of the pool's dtype, its bytes in the order
SGLang's flat data page has them (``get_data_page(flat=True)``), so the generic and
the zero-copy (``interface_v1``) paths read each other's pages. 1-D frames cannot take
the int8 codec, so pages stay lossless in every tier, cold ones included.

With ``interface_v1`` the backend reads from and writes into the host pool's pages
directly (``get_page_buffer_meta``): a co-located put copies each page once into the
server's staging memory; a get verifies the frame in the server's shm arena and copies
it once into the page. Nothing ever raises into SGLang: a store that fails or is down
makes lookups miss and writes fail, and after a failure the backend pauses (2 s,
doubling to 30 s) instead of making every call wait on a dead server.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from client_sdk import KVClient
from kvstore import codec as codec_mod
from kvstore.errors import InvalidInput, KVStoreError
from kvstore.keys import BlockHash, block_meta, name_fingerprint, named_key, validate_namespace

log = logging.getLogger("kvstore.sglang")

__all__ = ["KVStoreHiCacheStorage", "BackendConfig", "DOMAIN"]

DOMAIN = "sglang"
"""Folded into every key and fingerprint: SGLang's page names never meet another system's."""
KEYS_KEPT = 1 << 16
"""Page keys whose block key a backend remembers (about 200 bytes each)."""

_OURS = {"url", "namespace", "token", "fingerprint", "timeout_s"}
_SGLANG_LOADER = {"backend_name", "module_path", "class_name", "interface_v1"}
_PAUSE_FIRST_S, _PAUSE_MAX_S = 2.0, 30.0
_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


@dataclass(frozen=True)
class BackendConfig:
    """Our keys of ``--hicache-storage-backend-extra-config``."""

    url: str = "http://127.0.0.1:8470"
    namespace: str = "sglang"
    token: str | None = None
    fingerprint: str | None = None
    """Names the model's weights; default: SGLang's model name. Set it when two deployments
    serve different weights under one name."""
    timeout_s: float = 5.0

    @classmethod
    def parse(cls, extra: dict | None) -> "BackendConfig":
        """Raises InvalidInput naming the bad key. Keys SGLang itself reads pass through."""
        extra = dict(extra or {})
        out: dict[str, Any] = {}
        for name in ("url", "token", "fingerprint"):
            value = extra.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInput(f"kvstore backend: {name} must be a non-empty string, got {value!r}")
            if value is not None:
                out[name] = value
        if "namespace" in extra:
            out["namespace"] = validate_namespace(extra["namespace"])
        if "timeout_s" in extra:
            t = extra["timeout_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 600:
                raise InvalidInput(f"kvstore backend: timeout_s must be a number in (0, 600], got {t!r}")
            out["timeout_s"] = float(t)
        unknown = sorted(set(extra) - _OURS - _SGLANG_LOADER)
        if unknown:
            log.info("kvstore backend: extra_config keys %s are not ours; left to SGLang", unknown)
        return cls(**out)


class _Pause:
    """After a failure, no calls for a while (2 s doubling to 30 s); a success resets it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until = 0.0
        self._next = _PAUSE_FIRST_S
        self._lock = threading.Lock()

    def active(self) -> bool:
        return self._clock() < self._until

    def failed(self) -> float:
        with self._lock:
            pause, self._next = self._next, min(self._next * 2, _PAUSE_MAX_S)
            self._until = self._clock() + pause
            return pause

    def ok(self) -> None:
        with self._lock:
            self._next, self._until = _PAUSE_FIRST_S, 0.0


class _Stats:
    """Counters for ``get_stats`` (SGLang's ``StorageMetrics``: pages and GB/s per batch)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []
        self.failures = 0

    def add(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        with self.lock:
            getattr(self, f"{kind}_pgs").append(pages)
            getattr(self, f"{kind}_bandwidth").append(nbytes / max(seconds, 1e-9) / (1 << 30))


class KVStoreHiCacheStorage(HiCacheStorage):
    """A ``HiCacheStorage`` over a running ``kvstore serve`` (the SDK; shared memory on one host).

    Args:
        storage_config: SGLang's; ``extra_config`` carries ``url``, ``namespace``, ``token``,
            ``fingerprint``, ``timeout_s`` (see ``BackendConfig``).
        kwargs: what SGLang's factory passes on (unused).

    Raises:
        InvalidInput: a bad config value.
        NotImplementedError: decode context parallelism or heterogeneous-TP head splitting
            (pages would need to be cut per head; not supported).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None, *,
                 client: KVClient | None = None) -> None:
        self.config = BackendConfig.parse(storage_config.extra_config)
        if storage_config.dcp_size > 1 or storage_config.should_split_heads:
            raise NotImplementedError("kvstore backend: decode context parallelism and tp_lcm_size head "
                                      "splitting are not supported")
        self.storage_config = storage_config
        self.is_writer = storage_config.is_storage_writer
        sc = storage_config
        # MLA KV is the same on every TP rank: one copy, one writer (SGLang's is_storage_writer).
        shard = "" if sc.is_mla_model else f"tp{sc.tp_rank}of{sc.tp_size}"
        if sc.pp_size > 1:
            shard += f"pp{sc.pp_rank}of{sc.pp_size}"
        if sc.attn_cp_size > 1:
            shard += f"cp{sc.attn_cp_rank}of{sc.attn_cp_size}"
        self._shard = shard
        self._model = self.config.fingerprint or sc.model_name or "unnamed-model"
        self.client = client or KVClient(self.config.url, token=self.config.token, namespace=self.config.namespace,
                                         timeout_s=self.config.timeout_s, connect_timeout_s=min(1.0, self.config.timeout_s),
                                         retries=1, backoff_s=0.02)
        self._pause = _Pause()
        self._stats = _Stats()
        self._scope: str | None = None
        self._keys: dict[str, BlockHash] = {}
        """SGLang's page keys -> block keys: a prefetch names each page twice (its hit query, then
        its get), and a key is a hash of a hundred-odd bytes (about 1.5 us)."""
        self.mem_pool_host = None

    # -- the pool and the keys -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page geometry that the keys' scope and the frames' shape come from."""
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self.page_size = int(pool.page_size)
        self.dtype = pool.dtype
        self.itemsize = torch.tensor([], dtype=pool.dtype).element_size()
        self.page_bytes = int(pool.get_size_per_token()) * self.page_size
        self.page_numel = self.page_bytes // self.itemsize
        self.layout = getattr(pool, "layout", "layer_first")
        name = str(self.dtype).removeprefix("torch.")
        # fp8 and other dtypes a frame cannot name travel as their bytes (uint8): raw, exact
        self._frame_dtype, self._frame_shape = ((name, (self.page_numel,)) if name in ("float16", "bfloat16", "float32")
                                                else ("uint8", (self.page_bytes,)))
        # MHA's layer_first meta lists K0, V0, K1, V1...; its flat page is all K layers, then all V
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        self._kv_interleaved = isinstance(pool, MHATokenToKVPoolHost) and self.layout == "layer_first"
        self._scope = (f"{self._model}|{type(pool).__name__}|{self.layout}|{str(self.dtype).removeprefix('torch.')}"
                       f"|page{self.page_size}x{self.page_numel}|{self._shard}")
        self._spec_fp = name_fingerprint(DOMAIN, self._scope)
        self._keys = {}  # of the scope before

    def key_of(self, key: str) -> BlockHash:
        """The kvstore block key of SGLang's page key ``key``."""
        # The memo before the scope: a new scope comes before its new memo, so a key of either
        # scope lands in a memo of its own scope, or in one already dropped
        memo = self._keys
        got = memo.get(key)
        if got is None:
            scope = self._scope
            if scope is None:
                raise RuntimeError("kvstore backend: register_mem_pool_host was not called")
            got = named_key(self.config.namespace, DOMAIN, f"{scope}|{key}")
            if len(memo) >= KEYS_KEPT:
                memo.clear()  # bounded; a prefetch's pages come back as they are named again
            memo[key] = got
        return got

    def _meta(self, key: str, depth: int) -> bytes:
        return block_meta(self.config.namespace, self._spec_fp, depth, sglang={"key": key})

    def _depth0(self, extra_info: HiCacheStorageExtraInfo | None) -> int:
        return len(extra_info.prefix_keys) if extra_info is not None and extra_info.prefix_keys else 0

    # -- failures ---------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any], default: Any) -> Any:
        """``fn()``, or ``default`` when the store is paused or the call fails (then pause)."""
        if self._pause.active():
            return default
        try:
            got = fn()
        except KVStoreError as exc:
            pause = self._pause.failed()
            with self._stats.lock:
                self._stats.failures += 1
            log.warning("kvstore backend: %s failed (%s); no calls for %.0f s", what, exc, pause)
            return default
        self._pause.ok()
        return got

    # -- lookups ----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many keys from the start are stored (a prefix: SGLang loads only a prefix)."""
        if not keys:
            return 0
        present = self._call("lookup", lambda: self.client.blocks_exist([self.key_of(k) for k in keys]), None)
        if present is None:
            return 0
        return present.index(False) if False in present else len(present)

    # -- the generic path: flat page tensors -----------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """Fill each target (a flat page tensor; a new one when None) with its stored page."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else torch.empty(self.page_numel, dtype=self.dtype) for t in targets]
        dsts = [_bytes_of(t) for t in targets]

        def sink(i: int, header: Any, payload: memoryview) -> None:
            if len(payload) != len(dsts[i]):
                raise _Mismatch
            dsts[i][:] = payload

        found = self._read(keys, sink)
        return [t if ok else None for t, ok in zip(targets, found)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if not self.is_writer:
            return True
        srcs = [_bytes_of(v.contiguous()) for v in values]

        def fill(i: int, payload: memoryview) -> None:
            payload[:] = srcs[i]
        return all(self._write(keys, fill, 0))

    # -- the zero-copy path: straight from and into the host pool's pages --------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pieces = self._pieces(keys, host_indices)

        def sink(i: int, header: Any, payload: memoryview) -> None:
            if len(payload) != self.page_bytes:
                raise _Mismatch
            src = _address(payload)
            at = 0
            for ptr, size in pieces[i]:
                ctypes.memmove(ptr, src + at, size)
                at += size
        return self._read(keys, sink)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not self.is_writer:
            return [True] * len(keys)
        pieces = self._pieces(keys, host_indices)

        def fill(i: int, payload: memoryview) -> None:
            dst = _address(payload)
            at = 0
            for ptr, size in pieces[i]:
                ctypes.memmove(dst + at, ptr, size)
                at += size
        return self._write(keys, fill, self._depth0(extra_info))

    def _pieces(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Each page's (address, bytes) runs in the order of its flat data page."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys:
            return []
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs) or sum(sizes[:per]) != self.page_bytes:
            raise RuntimeError(f"kvstore backend: host pool gave {len(ptrs)} runs for {len(keys)} pages of "
                               f"{self.page_bytes} bytes")
        out = []
        for p in range(len(keys)):
            runs = list(zip(ptrs[p * per:(p + 1) * per], sizes[p * per:(p + 1) * per]))
            if self._kv_interleaved:
                runs = runs[0::2] + runs[1::2]
            out.append(runs)
        return out

    # -- both paths -----------------------------------------------------------------------------

    def _read(self, keys: Sequence[str], sink: Callable[[int, Any, memoryview], None]) -> list[bool]:
        """Pages of ``keys`` handed to ``sink``; False where missing, damaged or of another shape."""
        if not keys:
            return []
        started = time.perf_counter()
        bad: set[int] = set()

        def checked(i: int, header: Any, payload: memoryview) -> None:
            if header.dtype != self._frame_dtype or header.shape != self._frame_shape:
                bad.add(i)
                return
            try:
                sink(i, header, payload)
            except _Mismatch:
                bad.add(i)
        found = self._call("get", lambda: self.client.get_blocks_into([self.key_of(k) for k in keys], checked),
                           [False] * len(keys))
        found = [ok and i not in bad for i, ok in enumerate(found)]
        n = sum(found)
        self._stats.add("prefetch", n, n * self.page_bytes, time.perf_counter() - started)
        return found

    def _write(self, keys: Sequence[str], fill: Callable[[int, memoryview], None], depth0: int) -> list[bool]:
        """Store the pages ``fill`` writes, skipping those already stored; True per stored page."""
        if not keys:
            return []
        started = time.perf_counter()
        bkeys = [self.key_of(k) for k in keys]
        # the arena's index alone (no request: a set makes one, its put): a page only a lower
        # tier holds is copied again, and the server keeps the one it has
        present = self._call("lookup", lambda: self.client.blocks_exist(bkeys, ask_server=False), None)
        if present is None:
            return [False] * len(keys)
        todo = [i for i, have in enumerate(present) if not have]
        if not todo:
            return [True] * len(keys)
        metas = [self._meta(keys[i], depth0 + i) for i in todo]
        payload_at = [codec_mod.raw_payload_offset(1, len(m)) for m in metas]
        sizes = [at + self.page_bytes for at in payload_at]

        def writer(j: int, view: memoryview) -> int:
            fill(todo[j], view[payload_at[j]:payload_at[j] + self.page_bytes])
            return codec_mod.seal_raw(view, self._frame_dtype, self._frame_shape, metas[j])
        stored = self._call("put", lambda: self.client.put_blocks_with([bkeys[i] for i in todo], sizes, writer,
                                                                       make_room=True), None)
        if stored is None:
            return present  # the pages stored before stay stored; the rest failed
        self._stats.add("backup", len(todo), len(todo) * self.page_bytes, time.perf_counter() - started)
        return [True] * len(keys)

    # -- housekeeping -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete this model's pages of this rank (their scope's fingerprint, in this namespace):
        what SGLang's ``/clear_hicache_storage`` asks."""
        if self._scope is not None:
            self._call("clear", lambda: self.client.evict_mine(fingerprint=self._spec_fp), None)

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._stats.lock:
            s = self._stats
            out.prefetch_pgs.extend(s.prefetch_pgs)
            out.backup_pgs.extend(s.backup_pgs)
            out.prefetch_bandwidth.extend(s.prefetch_bandwidth)
            out.backup_bandwidth.extend(s.backup_bandwidth)
            s.prefetch_pgs, s.backup_pgs, s.prefetch_bandwidth, s.backup_bandwidth = [], [], [], []
        return out

    def close(self) -> None:
        self.client.close()


class _Mismatch(Exception):
    """A stored page whose size is not this pool's page: a miss."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (numpy has no bfloat16: through uint8)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data
