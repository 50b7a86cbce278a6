"""kvstore's own paths at one size, as rows for ``bench.sampling.interleave``.

====================  ===============================================  ==========
row                   one operation                                    its limit
====================  ===============================================  ==========
limit memcpy+request  one-thread copy of the bytes, then ``/healthz``    -
                      (a 1 MiB put's floor: a copy and one request)
colocated put         ``KVClient.put_kv`` over shared memory            memcpy
colocated put,        the same with ``wait=False``: until it returns    memcpy
nowait                its handle (the KV copied aside); the put lands
                      in the client's put thread, ``flush``ed outside
                      the clock
colocated get         ``KVClient.get_kv`` over shared memory (a fresh   memcpy
                      tensor; ``out=``: into a reused one). A client
                      serves a repeated get from the slot handles it
                      remembers; ``asking``: a client that remembers
                      none, so each get is a first get: it finds the
                      slots in the arena's key index (no request) and
                      reads each frame the way a first read does
handoff               a co-located put (agent A, this process), then    memcpy
                      a first get of that sequence by agent B, another
                      process with its own client (``bench.handoff``):
                      from before A's put to after B's get returns
http put / get        the same over HTTP (``colocated=False``)          tcp
flight put / get      ``FlightMedium.put_kv`` / ``get_kv``               tcp
redis tier put / get  ``RedisTier.put`` / ``get_into`` of one frame     tcp
nvme tier put / get   ``NVMeTier.put`` / ``get_into`` of one frame,     file
                      its file dropped from the page cache first
====================  ===============================================  ==========

SDK rows move fp16 KV ``[L, 2, 8, T, 128]`` against ``kvstore serve`` in a
child process; every put writes fresh token ids and deletes them after the
clock, every get reads one stored sequence (the hand-off's get reads what its
put just wrote). Tier rows run the tier in this process on random frame bytes
(tiers never look inside a frame), as the server's own tiers do.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch

from bench.handoff import AgentB, digest
from bench.sampling import Row, timed

__all__ = ["spec_for", "Paths", "remember_no_handles"]

KiB, MiB = 1 << 10, 1 << 20


def spec_for(nbytes: int) -> tuple[Any, int]:
    """A spec whose KV of ``T`` tokens is ``nbytes``, and ``T``.

    From 1 MiB up, a 7B-class layout (32 layers, 8 KV heads of 128: 128 KiB a token); below,
    2 layers (8 KiB a token), so a smoke run moves tens of KiB.
    """
    from kvstore.spec import KVSpec

    layers = 32 if nbytes >= MiB else 2
    per_token = layers * 2 * 8 * 128 * 2
    if nbytes % per_token:
        raise ValueError(f"size {nbytes} is not a whole number of {per_token}-byte tokens")
    tokens = nbytes // per_token
    return KVSpec("bench-all", layers, 8, 128, "float16", min(16, tokens), fingerprint="bench-1"), tokens


def small_spec_for(nbytes: int) -> tuple[Any, int]:
    """A small model's spec (8 layers, 2 KV heads of 64, fp16: 4 KiB a token, 64 KiB a 16-token
    block) whose KV of ``T`` tokens is ``nbytes``, and ``T``: per-block cost, not bandwidth, is what
    a first get of many small blocks meets (issue 33's 64 KiB rows)."""
    from kvstore.spec import KVSpec

    per_token = 8 * 2 * 2 * 64 * 2
    if nbytes % per_token:
        raise ValueError(f"size {nbytes} is not a whole number of {per_token}-byte tokens")
    tokens = nbytes // per_token
    return KVSpec("bench-all-small", 8, 2, 64, "float16", min(16, tokens), fingerprint="bench-small-1"), tokens


def remember_no_handles(client: Any) -> None:
    """Make a co-located client (past its first get) forget every slot handle, now and after.

    The bench reaches into the SDK here: no user-facing switch turns the handle cache off.
    """
    handles = client.colocation.arena.handles
    handles.max_entries = 0
    handles.remember([])  # trims to max_entries: what the first get remembered goes too


class Paths:
    """The kvstore rows at one size, against a running server (and Flight, Redis when given)."""

    def __init__(self, nbytes: int, url: str, *, flight_port: int | None, redis_url: str | None,
                 workdir: str) -> None:
        from client_sdk import KVClient

        self.nbytes = nbytes
        self.spec, self.tokens = spec_for(nbytes)
        self.kv = torch.randn(self.spec.kv_shape(self.tokens), generator=torch.Generator().manual_seed(0)).half()
        with contextlib.ExitStack() as stack:  # a failure half-way closes what was opened
            # plan=False: each row measures one fixed medium
            self.shm = stack.enter_context(KVClient(url, namespace="bench-all", plan=False))
            self.http = stack.enter_context(KVClient(url, namespace="bench-all", colocated=False, plan=False))
            # The SDK remembers slots and serves a repeated get with a plain copy; this client
            # forgets them at once, so each of its gets is a first get: it finds the slots in
            # the arena's key index (no request) and checks each frame's header (hashing one the
            # server has not verified), as the first get of a sequence by any client does.
            self.shm_asking = stack.enter_context(KVClient(url, namespace="bench-all", plan=False))
            self.fixed = list(range(1_000_000, 1_000_000 + self.tokens))
            self.http.put_kv(self.spec, self.fixed, self.kv)
            self.small_spec, small_tokens = small_spec_for(nbytes)
            # a sequence of its own per size: one size's would be a prefix of another's, stored already
            self.small_fixed = list(range(3_000_000 + nbytes // 64, 3_000_000 + nbytes // 64 + small_tokens))
            self.small_kv = torch.randn(self.small_spec.kv_shape(small_tokens),
                                        generator=torch.Generator().manual_seed(2)).half()
            self.http.put_kv(self.small_spec, self.small_fixed, self.small_kv)
            self.out = torch.empty(nbytes, dtype=torch.uint8)
            self.flight = None
            if flight_port is not None:
                from client_sdk.flight import FlightMedium

                self.flight = FlightMedium(url, flight_port, namespace="bench-all")
                stack.callback(self.flight.close)
            self.frame = memoryview(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
            self.frame_out = memoryview(bytearray(nbytes))
            self.redis_tier = None
            if redis_url is not None:
                from tiers.redis import RedisTier

                self.redis_tier = RedisTier(redis_url, 4 * nbytes + MiB, keyspace=f"bench-all-{os.getpid()}")
                stack.callback(self.redis_tier.close)
            from tiers.nvme import NVMeTier

            self.nvme_dir = tempfile.mkdtemp(prefix="nvme-", dir=workdir)
            self.nvme_tier = NVMeTier(self.nvme_dir, 4 * nbytes + MiB)
            stack.callback(self.nvme_tier.close)
            self.shm_asking.get_kv(self.spec, self.fixed)  # picks shm and maps the arena
            remember_no_handles(self.shm_asking)
            self.agent_b = AgentB(url, self.spec, self.tokens, namespace="bench-all", warm_base=self.fixed[0])
            stack.callback(self.agent_b.close)
            self.kv_digest = digest(self.kv)
            self._stack = stack.pop_all()
        self._counter = 0

    def _fresh(self) -> list[int]:
        self._counter += 1
        return [self._counter * 65_536 + i for i in range(self.tokens)]

    def _put(self, put: Any, settle: Any = None) -> Any:
        """A put row; ``settle()`` runs after the clock, before the delete (a nowait put lands)."""
        def once() -> float:
            toks = self._fresh()
            took = timed(lambda: put(self.spec, toks, self.kv))()
            if settle is not None:
                settle()
            self.http.delete(self.spec, toks)
            return took
        return once

    def _nowait(self, spec: Any, toks: list[int], kv: torch.Tensor) -> None:
        self.shm.put_kv(spec, toks, kv, wait=False)

    def _settle(self) -> None:
        # Each sample's put lands before the next starts: queued puts would otherwise pile up
        # and a later return would wait for room (max_pending_bytes), or the server's copy
        # would run under another row's clock.
        if not self.shm.flush(timeout_s=60):
            raise AssertionError("a put_kv(wait=False) did not land within 60 s")

    def _handoff(self, check: bool = False) -> Any:
        """The hand-off row (``bench.handoff``); ``check``: B's copy must match A's bytes too."""
        def once() -> float:
            toks = self._fresh()
            start = time.perf_counter()
            self.shm.put_kv(self.spec, toks, self.kv)
            end, hashed = self.agent_b.get(toks[0], check=check)
            self.http.delete(self.spec, toks)
            if end <= start:
                raise AssertionError(f"handoff: agent B's get ended {start - end:.6f} s before A's put began")
            if check and hashed != self.kv_digest:
                raise AssertionError("handoff: agent B read KV that differs from what agent A put")
            return end - start
        return once

    def _get(self, get: Any, out: torch.Tensor | None, small: bool = False) -> Any:
        spec, toks = (self.small_spec, self.small_fixed) if small else (self.spec, self.fixed)

        def once() -> float:
            start = time.perf_counter()
            _, n = get(spec, toks, out=out)
            took = time.perf_counter() - start
            if n != len(toks):
                raise AssertionError(f"get returned {n} of {len(toks)} tokens")
            return took
        return once

    def rows(self) -> dict[str, Row]:
        n, key = self.nbytes, bytes([7]) * 32
        src, dst = self.kv.reshape(-1).view(torch.uint8).numpy(), self.out.numpy()[:n]

        def copy_and_ask() -> None:  # a put's floor: its bytes copied once, one minimal request
            np.copyto(dst, src)
            self.shm.health()
        rows = {
            "limit memcpy+request": Row(n, timed(copy_and_ask)),
            "colocated put": Row(n, self._put(self.shm.put_kv)),
            "colocated put, nowait": Row(n, self._put(self._nowait, self._settle)),
            "handoff": Row(n, self._handoff()),
            "colocated get": Row(n, self._get(self.shm.get_kv, None)),
            "colocated get out=": Row(n, self._get(self.shm.get_kv, self.out)),
            "colocated get, asking": Row(n, self._get(self.shm_asking.get_kv, self.out)),
            "colocated get, asking, 64 KiB blocks": Row(n, self._get(self.shm_asking.get_kv, self.out, small=True)),
            "http put": Row(n, self._put(self.http.put_kv)),
            "http get": Row(n, self._get(self.http.get_kv, None)),
            "http get out=": Row(n, self._get(self.http.get_kv, self.out)),
        }
        if self.flight is not None:
            rows["flight put"] = Row(n, self._put(self.flight.put_kv))
            rows["flight get"] = Row(n, self._get(self.flight.get_kv, None))
            rows["flight get out="] = Row(n, self._get(self.flight.get_kv, self.out))
        if self.redis_tier is not None:
            self.redis_tier.put(key, self.frame)
            rows["redis tier put"] = Row(n, timed(lambda: self.redis_tier.put(key, self.frame)))
            rows["redis tier get"] = Row(n, timed(lambda: self.redis_tier.get_into(key, self.frame_out)))
        self.nvme_tier.put(key, self.frame)
        rows["nvme tier put"] = Row(n, timed(lambda: self.nvme_tier.put(key, self.frame)))
        rows["nvme tier get"] = Row(n, self._cold(timed(lambda: self.nvme_tier.get_into(key, self.frame_out)), key))
        return rows

    def _cold(self, op: Any, key: bytes) -> Any:
        """``op`` after the frame's file left the page cache, as the file-read limit reads.

        The tier writes with O_DIRECT but reads through the page cache, so without this every
        get after the first would be a memcpy from cache.
        """
        path = os.path.join(self.nvme_dir, key.hex()[:2], f"{key.hex()}.safetensors")

        def once() -> float:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            return op()
        return once

    def verify(self) -> None:
        """Every medium returns the stored KV bit for bit, and each tier the stored frame."""
        for name, get in (("colocated", self.shm.get_kv), ("http", self.http.get_kv),
                          ("flight", self.flight.get_kv if self.flight else None)):
            if get is not None and not torch.equal(get(self.spec, self.fixed)[0], self.kv):
                raise AssertionError(f"{name}: the KV read back differs from the KV stored")
        if not torch.equal(self.shm_asking.get_kv(self.small_spec, self.small_fixed)[0], self.small_kv):
            raise AssertionError("colocated, 64 KiB blocks: the KV read back differs from the KV stored")
        self._handoff(check=True)()
        if not self.shm.stats.shm_gets or not self.shm_asking.stats.shm_gets or self.http.stats.shm_gets:
            raise AssertionError("a client used the wrong medium")
        if self.shm_asking.stats.shm_frames_copied:
            raise AssertionError("the asking client served a get from remembered slots")
        key = bytes([7]) * 32
        for name, tier in (("redis tier", self.redis_tier), ("nvme tier", self.nvme_tier)):
            if tier is not None and bytes(tier.get(key)) != bytes(self.frame):
                raise AssertionError(f"{name}: the frame read back differs from the one written")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.http.delete(self.spec, self.fixed)
        self._stack.close()
