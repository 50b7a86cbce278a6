"""SGLang's HiCache machinery on CPU, driven one JSON line a command: for tests and ``kvstore bench engines``.

Runs under the SGLang venv's interpreter (``bench.engines``), never the project's::

    python bench/sglang_driver.py

It prints ``{"ok": true, "ready": ...}`` and answers each line on stdin with one JSON
line. What it drives is SGLang's own code: a CPU ``MHATokenToKVPool``, a real
``MHATokenToKVPoolHost`` in the asked layout, and a real ``HiCacheController`` (its
backup, prefetch and I/O threads, over a one-rank gloo group) whose storage backend
SGLang's ``StorageBackendFactory`` builds (``dynamic`` for kvstore, ``file`` for its own)::

    {"cmd": "setup", "backend": "dynamic"|"file", "layout": "page_first", "extra": {...},
     "page": 16, "layers": 4, "heads": 2, "head_dim": 64, "dtype": "bfloat16"}
    {"cmd": "write", "tokens": [...], "seed": 1}     -> {"completed_tokens", "digests": [page sha256...]}
    {"cmd": "prefetch", "tokens": [...]}             -> {"hit_tokens", "completed_tokens", "digests"}
    {"cmd": "exists", "tokens": [...]}               -> {"pages": n}   (the backend's batch_exists)
    {"cmd": "keys", "tokens": [...]}                 -> {"keys": [kvstore block key hex...]}
    {"cmd": "direct", "tokens": [...], "seed": 1}    -> the backend's own calls, both interfaces (below)
    {"cmd": "bench", "pages": 128, "repeat": 7}      -> medians of batch_set_v1/batch_get_v1 and memcpy
    {"cmd": "threads"}  {"cmd": "quit"}

``write`` fills fresh host pages with seeded random data, asks the controller to back
them up, waits for its ack, then frees the host pages (evicts them from host). ``prefetch``
is what the scheduler does for a request: the controller's hit query, then host pages
for the hit, then its I/O thread's transfer. Digests are of each page's flat bytes, so a
test compares what was written with what came back without moving the pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

_STUBS = Path(__file__).resolve().parent.parent / "tests" / "stubs" / "sglang"
sys.path.insert(0, str(_STUBS))  # torchvision: the index's build is CUDA-only (see the stub's docstring)

REPLY = sys.stdout
sys.stdout = sys.stderr  # whatever SGLang prints goes to the log, never the reply channel

ACK_TIMEOUT_S = 60.0


def _init_process() -> None:
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    # one rank, no parallelism: what a single-GPU SGLang publishes at start
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0,
                                        pp_size=1)


class Rig:
    """A device pool, a host pool and a controller with its storage backend attached."""

    def __init__(self, cmd: dict) -> None:
        import torch
        import torch.distributed as dist
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        self.page = int(cmd.get("page", 16))
        layers = int(cmd.get("layers", 4))
        dtype = getattr(torch, cmd.get("dtype", "bfloat16"))
        tokens = int(cmd.get("device_tokens", 8192))
        self.device = MHATokenToKVPool(tokens, self.page, dtype, int(cmd.get("heads", 2)),
                                       int(cmd.get("head_dim", 64)), layers, "cpu", False, start_layer=0,
                                       end_layer=layers - 1)
        info = self.device.get_device_pool_infos()[0].buffer_info
        self.host = MHATokenToKVPoolHost(info, float(cmd.get("host_ratio", 2.0)), 0, self.page, cmd["layout"],
                                         pin_memory=False, device="cpu", device_capacity_tokens=self.device.size,
                                         start_layer=0, end_layer=layers - 1)
        device = self.device

        class Allocator:
            def get_kvcache(self) -> Any:
                return device

        self.controller = HiCacheController(Allocator(), self.host, self.page, dist.group.WORLD, threading.Event(),
                                            storage_backend=cmd.get("backend", "dynamic"),
                                            model_name=cmd.get("model", "test-model"),
                                            storage_backend_extra_config=dict(cmd.get("extra") or {}))
        self.backend = self.controller.storage_backend
        self.v1 = bool((cmd.get("extra") or {}).get("interface_v1"))  # the zero-copy calls, as the controller uses

    def hashes(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_hash_str

        return get_hash_str(tokens, None, page_size=self.page)

    def fill(self, indices: Any, seed: int) -> list[str]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        digests = []
        for p in range(0, len(indices), self.page):
            page = self.host.get_data_page(int(indices[p]), flat=False)
            page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
            digests.append(self.digest(int(indices[p])))
        return digests

    def digest(self, index: int) -> str:
        import torch

        flat = self.host.get_data_page(index, flat=True).contiguous()
        return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()

    def write(self, tokens: list[int], seed: int) -> dict:
        n = len(tokens) // self.page * self.page
        indices = self.host.alloc(n)
        digests = self.fill(indices, seed)
        op_id = self.controller.write_storage(indices, tokens[:n], self.hashes(tokens[:n]))
        op = self.controller.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        assert op.id == op_id, "backup acks out of order"
        self.controller.evict_host(indices)
        return {"completed_tokens": op.completed_tokens, "digests": digests}

    def prefetch(self, tokens: list[int]) -> dict:
        c = self.controller
        c.prefetch(f"r{time.monotonic_ns()}", tokens)
        op = c.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        hit = op.storage_hit_count
        out: dict[str, Any] = {"hit_tokens": hit, "completed_tokens": 0, "digests": []}
        if hit == 0:
            return out
        op.host_indices = self.host.alloc(hit)
        c.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = c.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.completed_req:
                break
        out["completed_tokens"] = completed
        out["digests"] = [self.digest(int(op.host_indices[p])) for p in range(0, completed, self.page)]
        self.controller.evict_host(op.host_indices)
        return out

    def direct(self, tokens: list[int], seed: int) -> dict:
        """The backend's calls without the controller: set through one interface, get through both."""
        import torch

        keys = self.hashes(tokens)
        n = len(keys) * self.page
        src = self.host.alloc(n)
        digests = self.fill(src, seed)
        flat = [self.host.get_data_page(int(src[p])) for p in range(0, n, self.page)]
        b = self.backend
        out: dict[str, Any] = {"digests": digests}
        if self.v1:
            out["set"] = b.batch_set_v1(keys, src)
        else:
            out["set"] = [b.batch_set(keys, flat)] * len(keys)
        out["exists"] = b.batch_exists(keys)
        dst = self.host.alloc(n)
        out["get_v1"] = b.batch_get_v1(keys, dst)
        out["get_v1_digests"] = [self.digest(int(dst[p])) for p in range(0, n, self.page)]
        pages = b.batch_get(keys, [self.host.get_dummy_flat_data_page() for _ in keys])
        out["get_digests"] = [None if t is None else hashlib.sha256(t.contiguous().view(torch.uint8).numpy()
                                                                     .tobytes()).hexdigest() for t in pages]
        self.controller.evict_host(src)
        self.controller.evict_host(dst)
        return out

    def bench(self, pages: int, repeat: int) -> dict:
        """Medians over ``repeat`` rounds of one ``pages``-page batch: a set, the first prefetch of
        those pages as the controller makes it (``batch_exists``, then the get; the store verifies
        what it reads first), a repeat one, and a plain copy of the same page runs
        (``ctypes.memmove`` over ``get_page_buffer_meta``: the floor on this host).

        Keys are fresh every round: a stored key is skipped by a set, which would time nothing.
        """
        import ctypes

        n = pages * self.page
        src, dst = self.host.alloc(n), self.host.alloc(n)
        self.fill(src, 7)
        runs = list(zip(self.host.get_page_buffer_meta(dst)[0], *self.host.get_page_buffer_meta(src)))
        times: dict[str, list[float]] = {"set_s": [], "get_s": [], "get_repeat_s": [], "memcpy_s": []}
        for r in range(repeat):
            keys = self.hashes(list(range(r * n + 10**6, (r + 1) * n + 10**6)))
            t0 = time.perf_counter()
            ok = self._set(keys, src)
            t1 = time.perf_counter()
            got = self._prefetch(keys, dst)
            t2 = time.perf_counter()
            again = self._prefetch(keys, dst)
            t3 = time.perf_counter()
            for d, s_, size in runs:
                ctypes.memmove(d, s_, size)
            t4 = time.perf_counter()
            if not (all(ok) and all(got) and all(again)):
                raise RuntimeError(f"bench round {r}: a page failed to store or load")
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[name].append(seconds)
        self.controller.evict_host(src)
        self.controller.evict_host(dst)
        return {"bytes": pages * self.host.get_size_per_token() * self.page,
                **{name: statistics.median(v) for name, v in times.items()}}

    def _set(self, keys: list[str], indices: Any) -> list[bool]:
        """A batch set as the controller makes it (``_page_set_zero_copy`` or ``_generic_page_set``)."""
        if self.v1:
            return self.backend.batch_set_v1(keys, indices)
        pages = [self.host.get_data_page(int(indices[p])) for p in range(0, len(keys) * self.page, self.page)]
        return [self.backend.batch_set(keys, pages)] * len(keys)

    def _prefetch(self, keys: list[str], indices: Any) -> list[bool]:
        """One batch as the controller prefetches it: its hit query (``batch_exists``), then the get."""
        if self.backend.batch_exists(keys) != len(keys):
            return [False]
        return self._get(keys, indices)

    def _get(self, keys: list[str], indices: Any) -> list[bool]:
        """A batch get as the controller makes it (``_page_get_zero_copy`` or ``_generic_page_get``)."""
        if self.v1:
            return self.backend.batch_get_v1(keys, indices)
        got = self.backend.batch_get(keys, [self.host.get_dummy_flat_data_page() for _ in keys])
        for p, page in zip(range(0, len(keys) * self.page, self.page), got):
            if page is not None:
                self.host.set_from_flat_data_page(int(indices[p]), page)
        return [page is not None for page in got]

    def scopes(self, ranks: list[dict], extra: dict) -> list[dict]:
        """Backends built for other ranks (``{"tp_rank", "tp_size", "mla"}``) over this host pool: the
        block key each gives one page key, and whether it writes."""
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from kvstore.integrations.sglang import KVStoreHiCacheStorage

        out = []
        for r in ranks:
            config = HiCacheStorageConfig(tp_rank=r["tp_rank"], tp_size=r["tp_size"], pp_rank=0, pp_size=1,
                                          attn_cp_rank=0, attn_cp_size=1, is_mla_model=r.get("mla", False),
                                          enable_storage_metrics=False, is_page_first_layout=False,
                                          model_name="test-model", extra_config=extra)
            backend = KVStoreHiCacheStorage(config, {})
            backend.register_mem_pool_host(self.host)
            out.append({"key": backend.key_of("ab" * 32).hex(), "writer": backend.is_writer})
            backend.close()
        return out

    def close(self) -> None:
        self.controller.detach_storage_backend()


def main() -> None:
    started = time.monotonic()
    _init_process()
    import sglang

    rig: Rig | None = None
    reply({"ok": True, "ready": True, "sglang": sglang.__version__, "start_s": time.monotonic() - started})
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.get("cmd")
        try:
            if name == "quit":
                break
            if name == "setup":
                if rig is not None:
                    rig.close()
                rig = Rig(cmd)
                reply({"ok": True, "backend": type(rig.backend).__name__})
            elif name == "write":
                reply({"ok": True, **rig.write(cmd["tokens"], int(cmd.get("seed", 0)))})
            elif name == "prefetch":
                reply({"ok": True, **rig.prefetch(cmd["tokens"])})
            elif name == "exists":
                reply({"ok": True, "pages": rig.backend.batch_exists(rig.hashes(cmd["tokens"]))})
            elif name == "keys":
                reply({"ok": True, "keys": [rig.backend.key_of(h).hex() for h in rig.hashes(cmd["tokens"])]})
            elif name == "direct":
                reply({"ok": True, **rig.direct(cmd["tokens"], int(cmd.get("seed", 0)))})
            elif name == "bench":
                reply({"ok": True, **rig.bench(int(cmd.get("pages", 128)), int(cmd.get("repeat", 7)))})
            elif name == "clear":
                rig.backend.clear()
                reply({"ok": True})
            elif name == "scopes":
                reply({"ok": True, "scopes": rig.scopes(cmd["ranks"], cmd.get("extra") or {})})
            elif name == "stats":
                client = getattr(rig.backend, "client", None)
                metrics = rig.backend.get_stats()  # SGLang's StorageMetrics, drained
                reply({"ok": True, "client": client.stats.to_dict() if client is not None else None,
                       "storage": None if metrics is None else {k: list(getattr(metrics, k)) for k in (
                           "prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")}})
            elif name == "threads":
                c = rig.controller
                reply({"ok": True, "alive": all(t.is_alive() for t in (c.prefetch_thread, c.backup_thread,
                                                                       c.prefetch_io_aux_thread,
                                                                       c.prefetch_sync_thread))})
            else:
                reply({"ok": False, "error": f"unknown command {name!r}"})
        except Exception as exc:  # noqa: BLE001 - the test reads the reason
            import traceback

            traceback.print_exc()
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    if rig is not None:
        rig.close()


def reply(obj: dict) -> None:
    REPLY.write(json.dumps(obj) + "\n")
    REPLY.flush()


if __name__ == "__main__":
    main()
