"""LMCache's multi-process server driven as vLLM drives it, and kvstore's L2 adapter driven directly.

Runs under LMCache's interpreter (``.venv-lmcache``, this checkout on ``PYTHONPATH``),
started by ``bench.lmcache_mp.MPDriver``. It reads one JSON command a line on stdin
and answers one JSON line on stdout (``{"ok": true, ...}`` or ``{"ok": false,
"error": ...}``); everything else it or LMCache prints goes to stderr.

Engine commands (a stock ``lmcache server``, through LMCache's own vLLM-side adapters,
``LMCacheMPSchedulerAdapter`` and ``LMCacheMPWorkerAdapter``, without vLLM):

    connect   url, status_url, model, layers, heads, head_size, block, max_tokens
    store     seed, tokens [, settle_timeout_s]: KV of ``tokens`` tokens, made from ``seed``,
              stored; then waits until the server's store controller has nothing in flight
              and L1 holds no more than before (``--l2-store-policy skip_l1`` drops what L2
              took), or the timeout passes (``settled`` false: L2 did not take it)
    fetch     seed, tokens: lookup (LMCache prefetches from L2 into L1), then retrieve the hit
              into other blocks and compare with what ``store`` stored for ``seed``
    disconnect

Adapter commands (``KVStoreL2Adapter`` in this process, on stand-in L1 buffers):

    adapter_open    params;      adapter_close
    adapter_store   keys, nbytes: chunks of ``nbytes`` made from each key (an int)
    adapter_lookup  keys;        adapter_unlock keys
    adapter_load    keys, nbytes: loads, and compares with what ``adapter_store`` stored
    adapter_status
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import random
import select
import sys
import threading
import time
import traceback
import urllib.request
from typing import Any, Callable

_REPLIES = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # LMCache logs to stdout: only replies go down the pipe
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import torch  # noqa: E402 - after the stdout swap: imports may print

POLL_S = 0.002
STEP_TIMEOUT_S = 120.0


class Engine:
    """One "vLLM": a paged CPU KV cache registered with an LMCache server, and its two adapters."""

    def __init__(self, url: str, status_url: str, model: str, layers: int, heads: int, head_size: int,
                 block: int, max_tokens: int) -> None:
        import zmq
        from lmcache.integration.vllm.vllm_multi_process_adapter import (LMCacheMPSchedulerAdapter,
                                                                         LMCacheMPWorkerAdapter, ParallelStrategy)

        self.status_url = status_url
        self.block, self.layers = block, layers
        self.max_blocks = max_tokens // block
        self.shape = (block, heads, head_size)
        self.ctx = zmq.Context()
        ps = ParallelStrategy(mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1)
        self.sched = LMCacheMPSchedulerAdapter([url], self.ctx, model, block, ps)
        self.worker = LMCacheMPWorkerAdapter(url, self.ctx, model, block, ps)
        # vLLM's flash-attention layout, [2, blocks, block, heads, head_size]; block 0 is the null block
        self.kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 1 + 2 * self.max_blocks, *self.shape,
                                                                   dtype=torch.bfloat16) for i in range(layers)}
        self.worker.register_kv_caches(self.kv, layout_hints={"kv_layout": "NHD"})
        self._ids = 0

    def _req(self, what: str) -> str:
        self._ids += 1
        return f"{what}-{self._ids}"

    def _reference(self, seed: int, nblocks: int) -> list[torch.Tensor]:
        """Each layer's KV of the first ``nblocks`` blocks of ``seed``'s tokens: block by block, so a
        longer store of the same tokens extends a shorter one (as real KV of a prefix does)."""
        out = torch.empty(self.layers, 2, nblocks, *self.shape, dtype=torch.bfloat16)
        for b in range(nblocks):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
            out[:, :, b] = torch.randn(self.layers, 2, *self.shape, generator=gen)
        return list(out)

    @staticmethod
    def tokens(seed: int, n: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(32000) for _ in range(n)]

    def store(self, seed: int, tokens: int, settle_timeout_s: float = 60.0) -> dict:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        nb = tokens // self.block
        blocks = list(range(1, 1 + nb))
        for layer, ref in zip(self.kv.values(), self._reference(seed, nb)):
            layer[:, blocks] = ref
        req = self._req("store")
        before = self._l1_objects()  # chunks a failed store left in L1 stay there
        started = time.perf_counter()
        self.worker.submit_store_request(req, LoadStoreOp(token_ids=self.tokens(seed, tokens), block_ids=[blocks],
                                                          start=0, end=tokens), self.worker.create_recorded_event())
        _until(lambda: req in (self.worker.get_finished({req})[0] or set()), f"store {req}")
        to_l1 = time.perf_counter() - started
        settled = _until(lambda: self._idle(before), "settle", settle_timeout_s, fail=False)
        return {"store_l1_s": to_l1, "settled": settled, "l2_store_s": time.perf_counter() - started - to_l1,
                "nbytes": nb * self._block_bytes()}

    def _l1_objects(self) -> int:
        return self.status()["storage_manager"]["l1_manager"]["total_object_count"]

    def _idle(self, l1_before: int) -> bool:
        """Nothing in flight to L2, and what this store put in L1 gone from it again (skip_l1)."""
        sm = self.status()["storage_manager"]
        return (sm["store_controller"]["in_flight_task_count"] == 0
                and sm["l1_manager"]["total_object_count"] <= l1_before)

    def fetch(self, seed: int, tokens: int) -> dict:
        from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

        toks = self.tokens(seed, tokens)
        req = self._req("fetch")
        started = time.perf_counter()
        self.sched.maybe_submit_lookup_request(req, toks)
        hit = _until(lambda: self.sched.check_lookup_result(req), f"lookup {req}")
        lookup_s = time.perf_counter() - started
        hb = hit // self.block
        load = list(range(1 + self.max_blocks, 1 + self.max_blocks + hb))
        for layer in self.kv.values():
            layer[:, 1 + self.max_blocks:].zero_()
        retrieve_s, errors = 0.0, []
        if hb:
            started = time.perf_counter()
            self.worker.submit_retrieve_request(req, LoadStoreOp(token_ids=toks, block_ids=[load], start=0, end=hit),
                                                self.worker.create_recorded_event())
            _until(lambda: req in (self.worker.get_finished(set())[1] or set()), f"retrieve {req}")
            retrieve_s = time.perf_counter() - started
            errors = sorted(self.worker.get_block_ids_with_load_errors())
        identical = all(torch.equal(layer[:, load].view(torch.int16), ref[:, :hb].view(torch.int16))
                        for layer, ref in zip(self.kv.values(), self._reference(seed, tokens // self.block)))
        self.sched.end_session(req)
        self.sched.cleanup_lookup_result(req)
        return {"hit_tokens": hit, "identical": identical, "load_errors": errors, "lookup_s": lookup_s,
                "retrieve_s": retrieve_s, "nbytes": hb * self._block_bytes()}

    def _block_bytes(self) -> int:
        return 2 * self.layers * self.block * self.shape[1] * self.shape[2] * 2

    def status(self) -> dict:
        with urllib.request.urlopen(self.status_url, timeout=5) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()
        self.ctx.term()


class _Chunk:
    """A stand-in for LMCache's L1 ``MemoryObj``: ``byte_array`` is a ``'<B'`` memoryview, as L1's is."""

    def __init__(self, data: bytes | None, nbytes: int) -> None:
        self._buf = (ctypes.c_ubyte * nbytes)()
        if data is not None:
            ctypes.memmove(self._buf, data, nbytes)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self._buf)


class AdapterSession:
    """``KVStoreL2Adapter`` driven through LMCache's interface, each task waited for on its event fd."""

    MODEL, RANK = "driver-model", 0x01000100

    def __init__(self, params: dict) -> None:
        from kvstore.integrations.lmcache import KVStoreL2Adapter

        self.adapter = KVStoreL2Adapter(params)
        self.stored_results: dict[int, Any] = {}

    def key(self, n: int) -> Any:
        from lmcache.v1.distributed.api import ObjectKey

        return ObjectKey(chunk_hash=hashlib.sha256(str(n).encode()).digest(), model_name=self.MODEL, kv_rank=self.RANK)

    @staticmethod
    def data(n: int, nbytes: int) -> bytes:
        return random.Random(n).randbytes(nbytes)

    def _wait(self, fd: int, result: Callable[[], Any]) -> Any:
        from lmcache.v1.platform import consume_fd

        deadline = time.monotonic() + STEP_TIMEOUT_S
        while (got := result()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the adapter posted no result")
            if select.select([fd], [], [], 0.5)[0]:
                consume_fd(fd)
        return got

    def store(self, keys: list[int], nbytes: int) -> dict:
        a = self.adapter
        started = time.perf_counter()
        tid = a.submit_store_task([self.key(k) for k in keys], [_Chunk(self.data(k, nbytes), nbytes) for k in keys])
        submit_s = time.perf_counter() - started

        def done() -> Any:
            self.stored_results.update(a.pop_completed_store_tasks())
            return self.stored_results.pop(tid, None)
        result = self._wait(a.get_store_event_fd(), done)
        return {"success": result.is_successful(), "bytes": result.bytes_transferred(), "submit_s": submit_s,
                "seconds": time.perf_counter() - started}

    def lookup(self, keys: list[int]) -> dict:
        a = self.adapter
        started = time.perf_counter()
        tid = a.submit_lookup_and_lock_task([self.key(k) for k in keys], {})
        submit_s = time.perf_counter() - started
        bits = self._wait(a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid))
        return {"found": [bits.test(i) for i in range(len(keys))], "submit_s": submit_s,
                "again": a.query_lookup_and_lock_result(tid) is not None}

    def unlock(self, keys: list[int]) -> dict:
        self.adapter.submit_unlock([self.key(k) for k in keys])
        return {}

    def load(self, keys: list[int], nbytes: int) -> dict:
        a = self.adapter
        bufs = [_Chunk(None, nbytes) for _ in keys]
        tid = a.submit_load_task([self.key(k) for k in keys], bufs)
        bits = self._wait(a.get_load_event_fd(), lambda: a.query_load_result(tid))
        loaded = [bits.test(i) for i in range(len(keys))]
        return {"loaded": loaded, "identical": [bytes(b.byte_array) == self.data(k, nbytes) if ok else None
                                                for b, k, ok in zip(bufs, keys, loaded)]}

    def status(self) -> dict:
        usage = self.adapter.get_usage()
        page = self.adapter.list_l2_keys(page_size=1000)
        return {"status": self.adapter.report_status(), "usage_bytes": usage.total_bytes_used,
                "listed": len(page.entries)}

    def close(self) -> dict:
        """Close the adapter; then what threads of its are left, and how a task submitted after fares."""
        self.adapter.close()
        tid = self.adapter.submit_lookup_and_lock_task([self.key(0)], {})
        late = self.adapter.query_lookup_and_lock_result(tid)
        self.adapter.submit_unlock([self.key(0)])
        return {"threads_left": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvstore-l2")),
                "late_lookup": None if late is None else [late.test(0)]}


def _until(probe: Callable[[], Any], what: str, timeout_s: float = STEP_TIMEOUT_S, fail: bool = True) -> Any:
    """``probe()``'s first answer that is not None or False, polled; False (or TimeoutError) past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (got := probe()) is None or got is False:
        if time.monotonic() > deadline:
            if fail:
                raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s")
            return False
        time.sleep(POLL_S)
    return got


def main() -> None:
    engine: Engine | None = None
    session: AdapterSession | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            if name == "quit":
                break
            if name == "connect":
                engine = Engine(**cmd)
                reply: dict = {}
            elif name == "disconnect":
                if engine is not None:
                    engine.close()
                engine, reply = None, {}
            elif name in ("store", "fetch"):
                assert engine is not None, "connect first"
                reply = getattr(engine, name)(**cmd)
            elif name == "adapter_open":
                session, reply = AdapterSession(cmd["params"]), {}
            elif name == "adapter_close":
                reply = session.close() if session is not None else {}
                session = None
            elif name.startswith("adapter_"):
                assert session is not None, "adapter_open first"
                reply = getattr(session, name.removeprefix("adapter_"))(**cmd)
            else:
                raise ValueError(f"unknown command {name!r}")
            reply["ok"] = True
        except Exception as exc:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        _REPLIES.write(json.dumps(reply) + "\n")
    for thing in (session, engine):
        if thing is not None:
            thing.close()


if __name__ == "__main__":
    main()
