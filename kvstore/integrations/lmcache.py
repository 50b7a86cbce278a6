"""kvstore as an L2 store of LMCache's multi-process server: ``KVStoreL2Adapter``.

LMCache (0.5.6) loads it by configuration, with no code of ours in its tree::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvstore.integrations.lmcache", "class_name": "KVStoreL2Adapter",
        "adapter_params": {"url": "http://127.0.0.1:8470", "namespace": "lmcache"}}'

(this checkout on the server's ``PYTHONPATH``; kvstore's own dependencies in its venv).

Each LMCache chunk is one kvstore block, mapped as the ``lm://`` listener maps keys:
``named_key(namespace, "lmcache", name)``, where the name is the spelling LMCache's fs
adapter gives the chunk's file: ``model@0x<kv_rank>@<group>@<chunk hash hex>[@salt]``.
The model, rank, object group and cache salt are also folded into the block's spec
fingerprint (``name_fingerprint("lmcache", model@0x<kv_rank>@<group>[@salt])``), so two
models or two ranks never read each other's bytes, and ``/admin/evict`` by fingerprint
takes one rank's chunks. A chunk is stored as a 1-D uint8 frame of its exact bytes (never
quantized, so cold tiers keep it exact); the key's fields ride in the frame's metadata
under ``lmcache_mp`` (not ``lmcache``: the ``lm://`` listener's LIST skips these frames).

Nothing blocks LMCache's threads: ``submit_*`` queue the task and return; worker threads
do the I/O, post the result, then signal the task kind's event fd. Lookups pin what they
find (kvstore pins do not count, so the adapter keeps a count per key: pin on 0 -> 1,
unpin on 1 -> 0, each pin bounded by ``lock_ttl_s`` so a dead adapter cannot hold blocks
forever). The pin and unpin requests go out on a lane of their own, in order, after the lookup
has answered: a lookup of chunks in kvstore's arena reads its shared key index and makes no
request, and the lock is in force one request later. A chunk evicted in that window is a miss
of the load that follows (the load reads under the arena's seqlock: never a wrong byte). Stores skip chunks kvstore already holds. kvstore evicts on its own (puts make
room); the adapter learns it when a lookup, load or store finds a chunk it had reported
stored gone, and from a background sweep of those keys, and tells LMCache through
``_notify_keys_deleted``. A monitor thread polls ``/readyz``: ``report_status`` answers
from it, and while kvstore is down tasks finish at once as failures and misses instead of
waiting on it. No error reaches LMCache as an exception.

``adapter_params`` (all optional): ``url`` (``$KVSTORE_URL`` or ``http://127.0.0.1:8470``;
LMCache's own HTTP port defaults to 8080), ``namespace`` (``lmcache``), ``token``,
``timeout_s`` (5), ``lock_ttl_s`` (600), ``workers`` (threads per task lane, 1),
``batch_bytes`` (bytes per put request, 64 MiB), ``status_interval_s`` (1), ``colocated``
(null: shared memory when kvstore is on this host; false: HTTP always).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

from client_sdk import KVClient
from kvstore.errors import ConnectionFailed, RequestTimeout, ServiceError
from kvstore import codec as codec_mod
from kvstore.errors import KVStoreError, StoreClosed, TierUnavailable
from kvstore.integrations.lmcache_parts import (DOMAIN, AdapterParams, Health, Results, Workers, chunk_name,
                                                scope_fingerprint, scope_name)
from kvstore.keys import BlockHash, block_meta, named_key

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

log = init_logger(__name__)  # LMCache's handler and format: these lines sit in its server's log

__all__ = ["KVStoreL2Adapter", "AdapterParams", "DOMAIN", "chunk_name"]

_SWEEP_KEYS = 1024
"""Stored keys the monitor checks per tick (one small request)."""
_MAX_KEYS_PER_PUT = 4096
_WARN_EVERY_S = 10.0


def _is_down(exc: KVStoreError) -> bool:
    """Whether ``exc`` says kvstore itself is unreachable or failing (not that this one call was refused)."""
    return isinstance(exc, (ConnectionFailed, RequestTimeout, TierUnavailable, StoreClosed)) \
        or type(exc) is ServiceError


@dataclass
class _Known:
    size: int
    seq: int
    """Which remembering this is: a stale 'it is gone' answer cannot forget a newer store."""


class KVStoreL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter over a running ``kvstore serve`` (the SDK; shared memory on one host).

    Args:
        config: ``adapter_params`` (see ``AdapterParams``).
        l1_memory_desc: LMCache's L1 arena (unused: chunks are copied through the SDK).
        client: a ``KVClient`` to use instead of one built from ``config`` (tests).

    Raises:
        InvalidInput: a bad or unknown parameter.
    """

    def __init__(self, config: Any, l1_memory_desc: Any = None, *, client: KVClient | None = None) -> None:
        super().__init__(max_capacity_bytes=0)  # kvstore evicts on its own; LMCache need not
        self.params = p = AdapterParams.parse(config)
        self.client = client or KVClient(p.url, token=p.token, namespace=p.namespace, timeout_s=p.timeout_s,
                                         connect_timeout_s=min(1.0, p.timeout_s), retries=1, backoff_s=0.02,
                                         colocated=p.colocated, plan=False)
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._known: dict[ObjectKey, _Known] = {}  # what this adapter reported stored
        self._known_bytes = 0
        self._seq = itertools.count(1)
        self._known_lock = threading.Lock()
        self._locks: dict[ObjectKey, int] = {}  # lookups' locks per key, under _locks_lock
        self._locks_lock = threading.Lock()
        self._pin_lock = threading.Lock()  # held from a count's change to its call's queueing: calls go in order
        self._warned: dict[str, float] = {}
        self._counts: dict[str, int] = dict.fromkeys(
            ("stored_chunks", "skipped_chunks", "lookups", "lookup_hits", "loaded_chunks", "load_misses",
             "gone_chunks", "damaged_chunks", "failed_calls", "skipped_calls"), 0)
        self._counts_lock = threading.Lock()
        self._health = Health()
        self._closed = threading.Event()
        self._stored, self._looked_up, self._loaded = Results(), Results(), Results()
        self._store_workers = Workers("store", p.workers)
        self._fetch_workers = Workers("fetch", p.workers)  # lookups and loads: what a request waits on
        self._pin_workers = Workers("pin", 1)  # pins and unpins, in the order the counts changed
        self._sweep: list[ObjectKey] = []
        self._monitor = threading.Thread(target=self._watch, name="kvstore-l2-monitor", daemon=True)
        self._monitor.start()
        log.info("kvstore L2 adapter: %s namespace %s", p.url, p.namespace)

    # -- event fds ----------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._stored.notifier.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._looked_up.notifier.fileno()

    def get_load_event_fd(self) -> int:
        return self._loaded.notifier.fileno()

    # -- tasks --------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list["MemoryObj"]) -> L2TaskId:
        # The objects stay readable (L1 read-locked) until LMCache pops this task's result.
        return self._submit(self._store_workers, self._stored, lambda: self._do_store(keys, objects),
                            lambda: L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._stored.take_all()

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: Any) -> L2TaskId:
        return self._submit(self._fetch_workers, self._looked_up, lambda: self._do_lookup(keys),
                            lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._looked_up.take(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Release one lock of each key (LMCache never retries this): never raises."""
        try:
            self._release(keys, call=not self._closed.is_set())  # counts only; the unpin is queued
        except Exception:
            log.exception("kvstore L2 adapter: unlock of %d keys failed", len(keys))

    def submit_load_task(self, keys: list[ObjectKey], objects: list["MemoryObj"]) -> L2TaskId:
        return self._submit(self._fetch_workers, self._loaded, lambda: self._do_load(keys, objects),
                            lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._loaded.take(task_id)

    def _submit(self, workers: Workers, results: Results, work: Callable[[], Any],
                failed: Callable[[], Any]) -> L2TaskId:
        """Queue ``work``; after ``close`` the task fails at once (still posted: LMCache may be waiting)."""
        with self._ids_lock:
            tid = next(self._ids)
        if self._closed.is_set():
            results.post(tid, failed())
        else:
            workers.run(results, tid, work, failed)
        return tid

    # -- the work -----------------------------------------------------------------------------

    def _do_store(self, keys: list[ObjectKey], objects: list["MemoryObj"]) -> L2StoreResult:
        """Put the chunks kvstore does not hold yet; success only when every chunk is stored."""
        if not keys:
            return L2StoreResult(True, 0)
        srcs = [memoryview(obj.byte_array).cast("B") for obj in objects]  # L1's is '<B', which slices refuse
        bkeys = [self.block_key(k) for k in keys]
        seen = self._seen(keys)
        # the arena's index alone (no request: a store makes one, its put): a chunk only a lower
        # tier holds is copied again, and the server keeps the one it has
        present = self._call("store", lambda: self.client.blocks_exist(bkeys, ask_server=False), None)
        if present is None:
            return L2StoreResult(False, 0)
        todo = [i for i, have in enumerate(present) if not have]
        self._forget([keys[i] for i in todo], seen)  # evicted since we stored it: stored anew below
        self._remember([keys[i] for i, have in enumerate(present) if have],
                       [len(srcs[i]) for i, have in enumerate(present) if have])
        self._count(skipped_chunks=len(keys) - len(todo))
        nbytes = 0
        for batch in _batches(todo, [len(s) for s in srcs], self.params.batch_bytes):
            metas = [self._meta(keys[i], len(srcs[i])) for i in batch]
            at = [codec_mod.raw_payload_offset(1, len(m)) for m in metas]

            def writer(j: int, view: memoryview) -> int:
                src = srcs[batch[j]]
                view[at[j]:at[j] + len(src)] = src
                return codec_mod.seal_raw(view, "uint8", (len(src),), metas[j])
            sizes = [a + len(srcs[i]) for a, i in zip(at, batch)]
            stored = self._call("store", lambda: self.client.put_blocks_with(
                [bkeys[i] for i in batch], sizes, writer, make_room=True), None)
            if stored is None:
                return L2StoreResult(False, nbytes)
            self._remember([keys[i] for i in batch], [len(srcs[i]) for i in batch])
            self._count(stored_chunks=len(batch))
            nbytes += sum(len(srcs[i]) for i in batch)
        return L2StoreResult(True, nbytes)

    def _do_lookup(self, keys: list[ObjectKey]) -> Bitmap:
        """Which keys kvstore holds, each now locked (pinned) until its unlock."""
        found = Bitmap(len(keys))
        self._count(lookups=1)
        if not keys:
            return found
        bkeys = [self.block_key(k) for k in keys]
        seen = self._seen(keys)
        present = self._call("lookup", lambda: self.client.blocks_exist(bkeys), None)
        if present is None:
            return found
        hits = [i for i, have in enumerate(present) if have]
        self._hold([keys[i] for i in hits])
        for i in hits:
            found.set(i)
        self._count(lookup_hits=len(hits))
        self._forget([k for k, have in zip(keys, present) if not have], seen)
        return found

    def _do_load(self, keys: list[ObjectKey], objects: list["MemoryObj"]) -> Bitmap:
        """Copy each stored chunk into its L1 buffer; a chunk missing, damaged or of another size is a miss."""
        loaded = Bitmap(len(keys))
        if not keys:
            return loaded
        dsts = [memoryview(obj.byte_array).cast("B") for obj in objects]
        bkeys = [self.block_key(k) for k in keys]
        seen = self._seen(keys)
        wrong: set[int] = set()

        def sink(i: int, header: codec_mod.FrameHeader, payload: memoryview) -> None:
            if header.dtype != "uint8" or len(payload) != len(dsts[i]):
                wrong.add(i)  # not this buffer's chunk: never copy a part
                return
            dsts[i][:] = payload
            wrong.discard(i)  # a repeat read (the slot changed under the first) brought it whole
        got = self._call("load", lambda: self.client.get_blocks_into(bkeys, sink), None)
        if got is None:
            return loaded
        ok = [i for i, hit in enumerate(got) if hit and i not in wrong]
        for i in ok:
            loaded.set(i)
        self._count(loaded_chunks=len(ok), load_misses=len(keys) - len(ok))
        if ok:
            self._notify_keys_accessed([keys[i] for i in ok])
        missed = [i for i, hit in enumerate(got) if not hit]  # gone, or there but failing its checksum
        if missed:
            self._drop_damaged([keys[i] for i in missed], [bkeys[i] for i in missed], seen)
        return loaded

    def _drop_damaged(self, keys: list[ObjectKey], bkeys: list[BlockHash], seen: dict[ObjectKey, int]) -> None:
        """Of chunks a load missed, forget those kvstore no longer holds, and delete those it holds
        (they failed their checksum: every later lookup would lock them and every load miss them,
        while deleting them lets LMCache's next store of the chunk put it anew)."""
        still = self._call("load", lambda: self.client.blocks_exist(bkeys), None)
        if still is None:
            return
        damaged = [i for i, have in enumerate(still) if have]
        if damaged:
            log.warning("kvstore L2 adapter: %d stored chunks failed their checksum; deleted", len(damaged))
            if self._call("delete", lambda: self.client.delete_blocks([bkeys[i] for i in damaged]), None) is None:
                damaged = []
            self._count(damaged_chunks=len(damaged))
        gone = set(damaged) | {i for i, have in enumerate(still) if not have}
        self._forget([keys[i] for i in sorted(gone)], seen)

    # -- locks --------------------------------------------------------------------------------

    def _hold(self, keys: Sequence[ObjectKey]) -> None:
        with self._pin_lock:
            first = []
            with self._locks_lock:
                for k in keys:
                    n = self._locks.get(k, 0)
                    self._locks[k] = n + 1
                    if n == 0:
                        first.append(k)
            if first:  # off the lookup's path: the lookup answers with no request (module docstring)
                bkeys = [self.block_key(k) for k in first]
                self._pin_workers.put(lambda: self._call("pin", lambda: self.client.pin_blocks(
                    bkeys, self.params.lock_ttl_s), None))

    def _release(self, keys: Sequence[ObjectKey], *, call: bool) -> None:
        try:
            with self._pin_lock:
                last = []
                with self._locks_lock:
                    for k in keys:
                        n = self._locks.get(k, 0)
                        if n <= 1:
                            if self._locks.pop(k, None) is not None:
                                last.append(k)
                        else:
                            self._locks[k] = n - 1
                if last and call:  # when kvstore is down the pins lapse after lock_ttl_s
                    bkeys = [self.block_key(k) for k in last]
                    self._pin_workers.put(lambda: self._call("unpin", lambda: self.client.unpin_blocks(bkeys), None))
        except Exception:
            log.exception("kvstore L2 adapter: unlock of %d keys failed", len(keys))

    # -- what LMCache was told is stored --------------------------------------------------------

    def _seen(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, int]:
        with self._known_lock:
            return {k: e.seq for k in keys if (e := self._known.get(k)) is not None}

    def _remember(self, keys: Sequence[ObjectKey], sizes: Sequence[int]) -> None:
        new_keys, new_sizes = [], []
        with self._known_lock:
            for k, n in zip(keys, sizes):
                if k not in self._known:
                    self._known[k] = _Known(n, next(self._seq))
                    self._known_bytes += n
                    new_keys.append(k)
                    new_sizes.append(n)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)

    def _forget(self, gone: Sequence[ObjectKey], seen: dict[ObjectKey, int]) -> None:
        """Tell LMCache that ``gone`` left kvstore: those remembered when ``seen`` was taken and not since."""
        keys, sizes = [], []
        with self._known_lock:
            for k in gone:
                e = self._known.get(k)
                if e is not None and e.seq == seen.get(k):
                    del self._known[k]
                    self._known_bytes -= e.size
                    keys.append(k)
                    sizes.append(e.size)
        if keys:
            self._count(gone_chunks=len(keys))
            self._notify_keys_deleted(keys, sizes)

    # -- keys and frames ------------------------------------------------------------------------

    def block_key(self, key: ObjectKey) -> BlockHash:
        """The kvstore block key of LMCache's ``key``."""
        return named_key(self.params.namespace, DOMAIN, chunk_name(key))

    def _meta(self, key: ObjectKey, nbytes: int) -> bytes:
        return block_meta(self.params.namespace, scope_fingerprint(scope_name(key)), 0, lmcache_mp={
            "model": key.model_name, "kv_rank": key.kv_rank, "group": key.object_group_id,
            "salt": key.cache_salt, "hash": key.chunk_hash.hex(), "bytes": nbytes})

    # -- calls, health, counters --------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any], default: Any) -> Any:
        """``fn()``; ``default`` when kvstore is down (no call) or the call fails."""
        if not self._health.up:
            self._count(skipped_calls=1)
            return default
        try:
            return fn()
        except KVStoreError as exc:
            self._count(failed_calls=1)
            if _is_down(exc):
                self._health.seen(False, "unreachable", f"{what}: {type(exc).__name__}: {exc}")
            elif time.monotonic() - self._warned.get(what, -_WARN_EVERY_S) >= _WARN_EVERY_S:
                self._warned[what] = time.monotonic()  # a refusal repeats on every call: say it now and then
                log.warning("kvstore L2 adapter: %s failed: %s: %s", what, type(exc).__name__, exc)
            return default

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            for name, n in deltas.items():
                self._counts[name] += n

    def _watch(self) -> None:
        """Probe ``/readyz`` every ``status_interval_s``; while up, check a slice of the stored keys."""
        while True:
            try:
                answer = self.client.ready()
                self._health.seen(True, str(answer.get("status", "ok")), "; ".join(answer.get("reasons") or []) or None)
            except KVStoreError as exc:  # a 503 (not ready) or no answer at all
                status = "unreachable" if isinstance(exc, (ConnectionFailed, RequestTimeout)) else "unavailable"
                self._health.seen(False, status, f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # an answer we cannot read is no answer
                self._health.seen(False, "unreadable", repr(exc))
            if self._health.up and not self._closed.is_set():
                try:
                    self._sweep_some()
                except Exception:
                    log.exception("kvstore L2 adapter: sweep failed")
            if self._closed.wait(self.params.status_interval_s):
                return

    def _sweep_some(self) -> None:
        """Forget the next few remembered keys that kvstore no longer holds (it evicts on its own)."""
        if not self._sweep:
            with self._known_lock:
                self._sweep = list(self._known)
        batch, self._sweep = self._sweep[:_SWEEP_KEYS], self._sweep[_SWEEP_KEYS:]
        seen = self._seen(batch)
        batch = [k for k in batch if k in seen]
        if not batch:
            return
        present = self._call("sweep", lambda: self.client.blocks_exist([self.block_key(k) for k in batch]), None)
        if present is not None:
            self._forget([k for k, have in zip(batch, present) if not have], seen)

    # -- the rest of LMCache's interface -------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete chunks (LMCache's eviction, ``DELETE /cache/objects``); locked ones stay."""
        with self._locks_lock:
            free = [k for k in keys if not self._locks.get(k)]
        if not free:
            return
        seen = self._seen(free)
        if self._call("delete", lambda: self.client.delete_blocks([self.block_key(k) for k in free]), None) is not None:
            self._forget(free, seen)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:
        """The chunks this adapter stored that kvstore held when last checked, a page at a time."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise ValueError(f"malformed cursor {cursor!r}") from None
        if start < 0:
            raise ValueError(f"malformed cursor {cursor!r}")
        with self._known_lock:
            items = [(k, e.size) for k, e in self._known.items() if model_name is None or k.model_name == model_name]
        page = items[start:start + page_size]
        more = start + page_size < len(items)
        return KeyListPage(entries=tuple(KeyEntry(key=k.to_encoded_object_key(), size_bytes=n) for k, n in page),
                           next_page_token=str(start + page_size) if more else None)

    def report_status(self) -> dict:
        """Answered from what the monitor last saw: never waits on kvstore."""
        h = self._health
        with h.lock:
            health = {"is_healthy": h.up and not self._closed.is_set(), "kvstore_status": h.status,
                      "kvstore_reason": h.reason,
                      "checked_s_ago": None if h.checked_at is None else round(time.monotonic() - h.checked_at, 3)}
        with self._known_lock:
            stored = {"stored_object_count": len(self._known), "stored_bytes": self._known_bytes}
        with self._locks_lock:
            locked = {"locked_key_count": len(self._locks), "lock_count": sum(self._locks.values())}
        with self._counts_lock:
            counts = dict(self._counts)
        return {**health, "type": "kvstore", "url": self.params.url, "namespace": self.params.namespace,
                **stored, **locked, **counts}

    def close(self) -> None:
        """Stop the threads, release the pins this adapter holds, close the client and the fds."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._monitor.join(timeout=self.params.timeout_s + 1)
        for workers in (self._store_workers, self._fetch_workers, self._pin_workers):  # pins queued last
            workers.stop(self.params.timeout_s + 5)
        with self._pin_lock, self._locks_lock:
            held, self._locks = list(self._locks), {}
        if held:
            self._call("unpin", lambda: self.client.unpin_blocks([self.block_key(k) for k in held]), None)
        try:
            self.client.close()
        except Exception:
            log.exception("kvstore L2 adapter: closing the client failed")
        for results in (self._stored, self._looked_up, self._loaded):
            results.close()
        log.info("kvstore L2 adapter closed")


def _batches(todo: Sequence[int], sizes: Sequence[int], batch_bytes: int) -> list[list[int]]:
    """``todo`` cut into runs of at most ``batch_bytes`` (a larger chunk goes alone) and of bounded length."""
    out: list[list[int]] = []
    run: list[int] = []
    nbytes = 0
    for i in todo:
        if run and (nbytes + sizes[i] > batch_bytes or len(run) >= _MAX_KEYS_PER_PUT):
            out.append(run)
            run, nbytes = [], 0
        run.append(i)
        nbytes += sizes[i]
    if run:
        out.append(run)
    return out
