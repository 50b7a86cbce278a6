"""The worker half of the vLLM connector's data path: layer-wise loads and background saves.

Nothing here imports vLLM: it moves KV between a ``PagedLayout`` (vLLM's paged
cache) and a kvstore client, so it is tested on its own.

- ``Load``: one step's loads. A thread drains one ``LayerStream`` per request,
  layer 0 of every request first, and sets layer ``l``'s event once layer ``l`` of
  every request is in the paged cache, so the forward pass computes layer 0
  while later layers are still arriving (``wait_for_layer_load``). A stream that
  fails, or a store that answers with fewer tokens than the lookup promised,
  marks the blocks it did not deliver as failed: vLLM recomputes them.
- ``Saver``: a thread that copies a finished request's full blocks out of the
  paged cache into the canonical layout and puts them, so a save never blocks the
  forward pass. vLLM keeps a saved request's blocks until ``pending(req)`` is 0
  (the connector reports it through ``get_finished``), and a preempted request's
  blocks until ``wait_for`` returns, so a block is never read after vLLM reused it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvstore import codec
from kvstore.integrations.vllm_layout import PagedLayout
from kvstore.keys import block_hashes, block_meta
from kvstore.spec import KVSpec

__all__ = ["LoadJob", "SaveJob", "Counters", "Load", "Saver"]

log = logging.getLogger("kvstore.integrations.vllm")


def unbind() -> None:
    """Let the calling thread run on any CPU the process may use.

    vLLM's CPU worker binds its threads to cores, and a thread inherits the binding of the
    thread that started it: a loader or saver started from the forward pass's thread would
    share that one core with it and only slow it down.
    """
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, ValueError):  # a cpuset that forbids some CPUs, or no such call here: stay bound
        pass


@dataclass
class LoadJob:
    """Load tokens ``[start, len(tokens))`` of a request into ``block_ids`` (one per block of that range)."""

    req_id: str
    tokens: list[int]
    start: int
    block_ids: list[int]


@dataclass
class SaveJob:
    """Put the KV of ``tokens`` (whole blocks), which sits in ``block_ids`` (one per block, from token 0)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    seen: int = 0
    """How many load-failure reports the scheduler had taken in when it planned this save: failures
    reported after that may lie under its blocks (``KVStoreConnector.wait_for_save``)."""
    hashes: list[Any] | None = None
    """vLLM's own block hashes of these blocks (as its KV events write them), when the scheduler
    has them: the saved blocks are named by them on the server, for routers (``Saver``)."""


@dataclass
class Counters:
    """What one connector did, cumulative; ``delta()`` hands out what changed since the last call.

    Four token figures follow a prompt from vLLM's question to the store's bytes, each counted
    where it happens (docs/engines.md, "What the connector counts"):

    - ``looked_up_tokens`` (scheduler): the prompt tokens vLLM asked about in
      ``get_num_new_matched_tokens``, past those it holds itself (its own prefix cache);
    - ``offered_tokens`` (scheduler): of those, what the connector answered kvstore can provide;
    - ``loaded_tokens`` (worker): what the loads put into vLLM's paged cache;
    - ``saved_tokens`` (worker): what the saves stored that kvstore lacked.

    The first two are counted once per admission of a request (when vLLM allocates for it, as
    vLLM counts its own external prefix-cache queries and hits), so a request that waits several
    steps for room is not counted once per step. A hit ratio is ``loaded / looked_up``.
    """

    lookups: int = 0
    """Lookups sent to kvstore (each request's answer is kept until it is scheduled)."""
    looked_up_tokens: int = 0
    offered_tokens: int = 0
    lookup_errors: int = 0
    loads: int = 0
    """Requests' loads that put blocks into vLLM's cache (a shorter one than promised counts for what it put)."""
    loaded_tokens: int = 0
    load_errors: int = 0
    failed_blocks: int = 0
    load_seconds: float = 0.0
    saves: int = 0
    saved_tokens: int = 0
    save_errors: int = 0
    save_seconds: float = 0.0
    _last: dict = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **delta: float) -> None:
        with self._lock:
            for name, value in delta.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def delta(self) -> dict[str, float]:
        now = self.snapshot()
        with self._lock:
            out = {k: v - self._last.get(k, 0) for k, v in now.items()}
            self._last = now
        return {k: v for k, v in out.items() if v}


class Load:
    """One step's loads; ``wait(layer)`` blocks until that layer is in place.

    The streams open in the caller's thread (one request each: the store answers how many
    tokens it holds). A client that reads the co-located arena into a CPU cache skips the
    streams: each job's blocks go from the arena straight into vLLM's blocks before the
    forward pass (``KVClient.get_kv_blocks``, one copy; the key index usually answers with no
    request). Otherwise the layers are copied either on a thread of their own, so the
    forward pass computes layer ``l`` while later layers arrive, or right away, before the
    forward pass starts. ``layerwise=None`` (auto) picks the thread when a stream comes over
    HTTP or the cache is on a GPU, and copies right away when every stream reads this host's
    shared memory into a CPU cache: there a copy outruns the hand-off, and a second Python
    thread only contends with the forward pass for the GIL (measured in vLLM on 2 cores, 2k
    tokens: 106 ms layer-wise, 94 ms at once; HTTP at 4k: 203 ms layer-wise, 214 ms at once).

    Args:
        client: a ``KVClient`` (``get_kv_layers``).
        spec: the store's spec of this model.
        layout: vLLM's paged cache.
        jobs: this step's loads.
        counters: where loaded tokens and errors are counted.
        layerwise: True, False, or None for auto (above).
        one_copy: False keeps the streams where the one-copy path would serve (a comparison);
            None: auto (above).
    """

    def __init__(self, client: Any, spec: KVSpec, layout: PagedLayout, jobs: Sequence[LoadJob],
                 counters: Counters, *, layerwise: bool | None = None, one_copy: bool | None = None) -> None:
        self.client = client
        self.spec = spec
        self.layout = layout
        self.jobs = list(jobs)
        self.counters = counters
        self.failed: set[int] = set()
        self._events = [threading.Event() for _ in range(layout.num_layers)]
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        live: list[tuple[LoadJob, Any, int]] = []
        self.one_copy = one_copy = (one_copy is not False and layout.device.type == "cpu" and layerwise is not True
                                    and _reads_arena(client))
        for job in self.jobs:
            if one_copy:  # straight from the arena into the paged cache, before the forward pass
                self._load_now(job)
                continue
            opened = self._open(job)
            if opened is not None:
                live.append((job, *opened))
        if layerwise is None:
            layerwise = layout.device.type != "cpu" or any(stream.medium != "shm" for _, stream, _ in live)
        self.layerwise = layerwise
        if layerwise and live:
            self._thread = threading.Thread(target=self._threaded, args=(live,), name="kvstore-vllm-load",
                                            daemon=True)
            self._thread.start()
        else:  # every layer in place before the forward pass starts
            self._layers(live)

    def wait(self, layer: int) -> None:
        self._events[layer].wait()

    def _threaded(self, live: list[tuple[LoadJob, Any, int]]) -> None:
        unbind()
        self._layers(live)

    def finish(self) -> set[int]:
        """Wait for every layer; returns the block ids that did not load."""
        if self._thread is not None:
            self._thread.join()
        return self.failed

    def _load_now(self, job: LoadJob) -> None:
        """The job's blocks copied from the co-located arena straight into vLLM's blocks
        (``KVClient.get_kv_blocks``: one copy, no result tensor between)."""
        bs, n = self.spec.block_tokens, len(job.block_ids)
        if len(job.tokens) < job.start + n * bs or job.start % bs:  # nothing (whole) to load them from
            self.failed.update(job.block_ids)
            return
        first = job.start // bs
        try:
            got = self.client.get_kv_blocks(self.spec, job.tokens[:job.start + n * bs],
                                            self.layout.placer(job.block_ids, first), first=first)
        except Exception as exc:  # the store is down or refused: vLLM recomputes these blocks
            log.warning("kvstore load of %s failed, vLLM recomputes %d blocks: %s", job.req_id, n, exc)
            self.counters.add(load_errors=1)
            self.failed.update(job.block_ids)
            return
        have = min(n, max(0, got - job.start) // bs)
        if have < n:  # evicted or damaged since the lookup: a shorter prefix (what was placed past it is not used)
            log.warning("kvstore holds %d of %d tokens promised to %s; vLLM recomputes the rest",
                        got, job.start + n * bs, job.req_id)
            self.failed.update(job.block_ids[have:])
        if have:
            self.counters.add(loads=1, loaded_tokens=have * bs)

    def _open(self, job: LoadJob) -> tuple[Any, int] | None:
        """The job's stream and how many of its blocks it delivers, or None when none."""
        bs = self.spec.block_tokens
        if len(job.tokens) < job.start + len(job.block_ids) * bs:  # nothing to load them from
            self.failed.update(job.block_ids)
            return None
        try:
            stream = self.client.get_kv_layers(self.spec, job.tokens)
        except Exception as exc:  # the store is down or refused: vLLM recomputes these blocks
            log.warning("kvstore load of %s failed, vLLM recomputes %d blocks: %s", job.req_id,
                        len(job.block_ids), exc)
            self.counters.add(load_errors=1)
            self.failed.update(job.block_ids)
            return None
        have = min(len(job.block_ids), max(0, stream.n_tokens - job.start) // bs)
        if have < len(job.block_ids):  # evicted or damaged since the lookup: a shorter prefix
            log.warning("kvstore holds %d of %d tokens promised to %s; vLLM recomputes the rest",
                     stream.n_tokens, len(job.tokens), job.req_id)
            self.failed.update(job.block_ids[have:])
        if have == 0:
            stream.close()
            return None
        return stream, have

    def _layers(self, live: list[tuple[LoadJob, Any, int]]) -> None:
        bs = self.spec.block_tokens
        try:
            for layer in range(self.layout.num_layers):
                for entry in list(live):
                    job, stream, have = entry
                    try:
                        index, kv_layer = next(stream)
                        if index != layer:
                            raise RuntimeError(f"layer stream yielded layer {index}, expected {layer}")
                        self.layout.write_layer(layer, kv_layer[:, :, job.start:job.start + have * bs],
                                                job.block_ids[:have])
                    except Exception as exc:  # every block of the job is recomputed, loaded layers included
                        log.warning("kvstore load of %s broke at layer %d, vLLM recomputes it: %s",
                                    job.req_id, layer, exc)
                        self.counters.add(load_errors=1)
                        self.failed.update(job.block_ids)
                        live.remove(entry)
                        stream.close()
                if self.layout.device.type == "cuda":
                    torch.cuda.current_stream(self.layout.device).synchronize()
                self._events[layer].set()
            for job, stream, have in live:
                stream.close()
                if not self.failed.intersection(job.block_ids[:have]):
                    self.counters.add(loads=1, loaded_tokens=have * bs)
        except BaseException as exc:  # never leave the forward pass waiting on an event
            log.exception("kvstore load failed: %s", exc)
            for job in self.jobs:
                self.failed.update(job.block_ids)
        finally:
            for event in self._events:
                event.set()
            self.counters.add(failed_blocks=len(self.failed), load_seconds=time.perf_counter() - self._t0)


def _reads_arena(client: Any) -> bool:
    """Whether ``client`` reads a co-located server's arena (a ``KVClient`` that decided so)."""
    reads = getattr(client, "reads_arena", None)
    try:
        return bool(reads()) if reads is not None else False
    except Exception:  # undecided and the server is down: the stream path says so, per job
        return False


SAVE_BACKOFF_S = 2.0
"""After a failed save, the saves queued in the next 2 s are dropped (counted as errors) rather
than each waiting out a timeout while vLLM holds their blocks."""


class Saver:
    """Background puts of whole blocks out of the paged cache, one job at a time.

    One thread and one reused gather buffer: a slow store makes jobs wait (their
    blocks stay with vLLM, counted in ``pending``), not memory grow; a failing one
    drops them (``SAVE_BACKOFF_S``).
    """

    def __init__(self, client: Any, spec: KVSpec, layout: PagedLayout, counters: Counters, *,
                 one_copy: bool | None = None, name_blocks: bool | None = None) -> None:
        self.client = client
        self.name_blocks = name_blocks
        """Name saved blocks by vLLM's hashes on the server (``KVClient.name_blocks``): True, False,
        or None: when the server publishes KV events in vLLM's format (``/v1/info``'s ``kv_events``),
        asked once. One small request per save that stored blocks, on this thread."""
        self.spec = spec
        self.layout = layout
        self.one_copy = one_copy
        """False: gather and put even where blocks could go straight into slots (a comparison); None: auto."""
        self.counters = counters
        self._jobs: collections.deque[tuple[SaveJob, Any]] = collections.deque()
        self._pending: collections.Counter[str] = collections.Counter()
        self._cv = threading.Condition()
        self._closed = False
        self._down_until = 0.0
        self._name_failed = False
        self._buffer: torch.Tensor | None = None
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-save", daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob, ready: Any = None) -> None:
        """Queue ``job``; ``ready`` (a CUDA event) is waited on before its blocks are read."""
        with self._cv:
            self._pending[job.req_id] += 1
            self._jobs.append((job, ready))
            self._cv.notify_all()

    def drop(self, req_id: str) -> int:
        """Forget ``req_id``'s queued saves (a preempted request's blocks go back to vLLM); returns how many."""
        with self._cv:
            keep = collections.deque(item for item in self._jobs if item[0].req_id != req_id)
            dropped = len(self._jobs) - len(keep)
            self._jobs = keep
            if dropped:
                self._pending[req_id] -= dropped
                if not self._pending[req_id]:
                    del self._pending[req_id]
                self._cv.notify_all()
        return dropped

    def pending(self, req_id: str) -> int:
        with self._cv:
            return self._pending[req_id]

    def wait_for(self, req_id: str, timeout_s: float | None = None) -> bool:
        """Block until ``req_id`` has no queued or running save; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending[req_id], timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued saves (up to ``timeout_s``), then stop the thread."""
        with self._cv:
            self._cv.wait_for(lambda: not self._jobs and not sum(self._pending.values()), timeout_s)
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _out(self, num_tokens: int) -> torch.Tensor:
        need = self.spec.bytes_per_token * num_tokens
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=torch.uint8)
        return self._buffer[:need].view(self.spec.torch_dtype).view(self.spec.kv_shape(num_tokens))

    def _save(self, job: SaveJob) -> int:
        """Put what the store lacks of ``job``; returns the tokens newly stored.

        A lookup comes first: a prompt that hit most of its prefix (or another engine's save of
        it) needs its tail only, and a chunked prefill plans each chunk's save from token 0, so
        copying before looking would copy the whole prefix again for every chunk. Co-located
        with a CPU cache, each new block goes from vLLM's cache straight into a slot of the
        server's arena (``KVClient.put_kv_blocks``: one copy; the lookup reads the arena's key
        index, no request). Otherwise only the blocks the store lacks are copied out of vLLM's
        cache (vLLM keeps a request's blocks until its saves are reported done, so they hold
        still meanwhile) and sent: from token 0 on ``put_kv``'s path, a tail as frames by key
        (``put_blocks``).
        """
        bs, end = self.spec.block_tokens, len(job.tokens)
        have = min(self.client.lookup(self.spec, job.tokens), end)
        if have >= end:
            return 0
        first = have // bs
        if self.one_copy is not False and self.layout.device.type == "cpu" and _reads_arena(self.client):
            ids = job.block_ids
            self.client.put_kv_blocks(self.spec, job.tokens, lambda d, dst: self.layout.read_block(ids[d], dst))
            self._name(job, first)
            return end - first * bs
        kv = self.layout.gather(job.block_ids[first:], self._out(end - first * bs))
        if first == 0:
            stored = self.client.put_kv(self.spec, job.tokens, kv)
            self._name(job, 0)
            return stored
        keys = block_hashes(self.spec, job.tokens, self.client.namespace)[first:]
        fp = self.spec.fingerprint()
        frames = [(key, codec.encode(kv[:, :, :, i * bs:(i + 1) * bs],
                                     meta=block_meta(self.client.namespace, fp, first + i)))
                  for i, key in enumerate(keys)]
        self.client.put_blocks(frames)
        self._name(job, first)
        return end - first * bs

    def _name(self, job: SaveJob, first: int) -> None:
        """Name the blocks this save stored (from block ``first``) by vLLM's hashes, when on."""
        n = len(job.tokens) // self.spec.block_tokens
        if not job.hashes or len(job.hashes) < n or first >= n:
            return
        if self.name_blocks is None:
            self.name_blocks = bool(self.client.info().get("kv_events"))  # asked once; a failure asks again
        if not self.name_blocks:
            return
        try:
            self.client.name_blocks(self.spec, job.tokens, job.hashes[first:n], first=first,
                                    parent=job.hashes[first - 1] if first else None)
        except Exception as exc:  # advisory: the blocks are stored; only routers miss their vLLM names
            (log.debug if self._name_failed else log.warning)(
                "kvstore: naming %d saved blocks by vLLM's hashes failed (routers will not count them): %s",
                n - first, exc)
            self._name_failed = True

    def _run(self) -> None:
        unbind()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job, ready = self._jobs.popleft()
            t0 = time.perf_counter()
            try:
                if time.monotonic() < self._down_until:  # the store just failed: release the blocks now
                    self.counters.add(save_errors=1)
                    continue
                if ready is not None:
                    ready.synchronize()
                stored = self._save(job)
                self._down_until = 0.0
                self.counters.add(saves=1, saved_tokens=stored, save_seconds=time.perf_counter() - t0)
            except Exception as exc:  # the request completes all the same; the KV is only not shared
                log.warning("kvstore save of %s (%d tokens) failed: %s", job.req_id, len(job.tokens), exc)
                self._down_until = time.monotonic() + SAVE_BACKOFF_S
                self.counters.add(save_errors=1)
            finally:
                with self._cv:
                    self._pending[job.req_id] -= 1
                    if not self._pending[job.req_id]:
                        del self._pending[job.req_id]
                    self._cv.notify_all()


class Reporter:
    """Sends a connector's cumulative counters every ``interval_s`` from a thread of its own.

    A report is an HTTP call; made from the scheduler's or the worker's thread, a store
    that is down would stall the engine on connect timeouts. A failed report is dropped:
    the next one carries the same totals.
    """

    def __init__(self, send: Any, counters: Counters, interval_s: float = 5.0) -> None:
        self._send = send
        self._counters = counters
        self._interval_s = interval_s
        self._sent: dict[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-report", daemon=True)
        self._thread.start()

    def _report(self) -> None:
        now = self._counters.snapshot()
        if now == self._sent:
            return
        try:
            self._send(now)
            self._sent = now
        except Exception as exc:  # advisory
            log.debug("connector report dropped: %s", exc)

    def _run(self) -> None:
        unbind()
        while not self._stop.wait(self._interval_s):
            self._report()

    def close(self) -> None:
        """Stop, after one last report."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._report()
