"""The parts of ``kvstore.integrations.lmcache`` that never talk to kvstore: its parameters,
its names for LMCache's chunks, and the plumbing that keeps LMCache's threads from waiting.

LMCache calls an L2 adapter from its controllers' poll loops, which must never wait on
I/O: a task is queued to a ``Workers`` thread, its result posted to a ``Results`` and
the kind's event fd signalled. ``Health`` is kvstore's readiness as last seen.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from lmcache.logging import init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvstore.errors import InvalidInput
from kvstore.keys import name_fingerprint, validate_namespace

__all__ = ["DOMAIN", "AdapterParams", "chunk_name", "scope_name", "scope_fingerprint", "Results", "Workers", "Health"]

log = init_logger(__name__)

DOMAIN = "lmcache"
"""The ``lm://`` listener's domain: LMCache's names never meet another system's."""


@dataclass(frozen=True)
class AdapterParams:
    """``adapter_params`` of the ``--l2-adapter`` JSON. (Not named ``KVStoreL2AdapterConfig``:
    LMCache would then pass an instance of it instead of the dict.)"""

    url: str = "http://127.0.0.1:8470"
    namespace: str = "lmcache"
    token: str | None = None
    timeout_s: float = 5.0
    lock_ttl_s: float = 600.0
    """How long one lookup's pin holds a chunk at most; LMCache unlocks within seconds."""
    workers: int = 1
    """Threads per lane (stores; lookups, loads and unlocks): one keeps a task's requests in order."""
    batch_bytes: int = 64 << 20
    """A store task's chunks go in puts of about this many bytes (one staging lease each)."""
    status_interval_s: float = 1.0
    colocated: bool | None = None

    @classmethod
    def parse(cls, params: Any) -> "AdapterParams":
        """Raises InvalidInput (a ValueError) naming the bad or unknown key."""
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidInput(f"kvstore L2 adapter: adapter_params must be an object, got {type(params).__name__}")
        unknown = sorted(set(params) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidInput(f"kvstore L2 adapter: unknown adapter_params {unknown} "
                               f"(known: {sorted(cls.__dataclass_fields__)})")
        out: dict[str, Any] = {"url": os.environ.get("KVSTORE_URL") or cls.url}
        for name in ("url", "token"):
            value = params.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidInput(f"kvstore L2 adapter: {name} must be a non-empty string, got {value!r}")
            if value is not None:
                out[name] = value
        if not out["url"].startswith(("http://", "https://")):
            raise InvalidInput(f"kvstore L2 adapter: url must be http(s)://host:port, got {out['url']!r}")
        if "namespace" in params:
            out["namespace"] = validate_namespace(params["namespace"])
        for name, top in (("timeout_s", 600.0), ("lock_ttl_s", 3600.0), ("status_interval_s", 60.0)):
            if name in params:
                out[name] = _number(name, params[name], top)
        for name, low, top in (("workers", 1, 16), ("batch_bytes", 1 << 20, 1 << 30)):
            if name in params:
                v = params[name]
                if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= top:
                    raise InvalidInput(f"kvstore L2 adapter: {name} must be an integer in [{low}, {top}], got {v!r}")
                out[name] = v
        if "colocated" in params:
            if params["colocated"] is not None and not isinstance(params["colocated"], bool):
                raise InvalidInput(f"kvstore L2 adapter: colocated must be true, false or null, "
                                   f"got {params['colocated']!r}")
            out["colocated"] = params["colocated"]
        return cls(**out)


def _number(name: str, value: Any, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= top:
        raise InvalidInput(f"kvstore L2 adapter: {name} must be a number of seconds in (0, {top:g}], got {value!r}")
    return float(value)


def scope_name(key: ObjectKey) -> str:
    """What a chunk's name says beside its hash: the model, the rank's slice, the object group, the salt."""
    salt = f"@{key.cache_salt}" if key.cache_salt else ""
    return f"{key.model_name}@0x{key.kv_rank:08x}@{key.object_group_id:x}{salt}"


def chunk_name(key: ObjectKey) -> str:
    """The chunk's name, spelled as LMCache's fs adapter names its file (without ``.data``)."""
    salt = f"@{key.cache_salt}" if key.cache_salt else ""
    return f"{key.model_name}@0x{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}{salt}"


@functools.lru_cache(maxsize=256)  # one per model, rank and group in practice
def scope_fingerprint(scope: str) -> str:
    """The spec fingerprint of one scope's blocks: ``/admin/evict`` by it takes that scope's chunks."""
    return name_fingerprint(DOMAIN, scope)


class Results:
    """Finished tasks of one kind and the event fd that says so.

    A result is posted before the fd is signalled: LMCache reads a kind's results once
    per signal, so a result posted after its signal could wait forever.
    """

    def __init__(self) -> None:
        self.notifier = create_event_notifier()
        self.done: dict[L2TaskId, Any] = {}
        self.lock = threading.Lock()
        self.closed = False

    def post(self, tid: L2TaskId, result: Any) -> None:
        with self.lock:
            self.done[tid] = result
            if not self.closed:  # after close nobody polls the fd, and notifying a closed one raises
                self.notifier.notify()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.notifier.close()

    def take(self, tid: L2TaskId) -> Any:
        with self.lock:
            return self.done.pop(tid, None)  # answered once

    def take_all(self) -> dict[L2TaskId, Any]:
        with self.lock:
            done, self.done = self.done, {}
        return done


class Workers:
    """Threads running queued jobs in order (one thread: strictly in order)."""

    def __init__(self, name: str, n: int) -> None:
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.threads = [threading.Thread(target=self._run, name=f"kvstore-l2-{name}-{i}", daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def run(self, results: Results, tid: L2TaskId, work: Callable[[], Any], failed: Callable[[], Any]) -> None:
        """Run ``work`` on a worker and post its result (``failed()`` if it raises)."""
        def job() -> None:
            try:
                result = work()
            except Exception:  # a bug must not leave LMCache waiting on a task that never ends
                log.exception("kvstore L2 adapter: task %d failed", tid)
                result = failed()
            results.post(tid, result)
        self.jobs.put(job)

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job``, which has no result to post (an unlock)."""
        self.jobs.put(job)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except Exception:  # jobs catch their own errors; this keeps the thread if one does not
                log.exception("kvstore L2 adapter: a job failed")

    def stop(self, timeout_s: float) -> None:
        """Let the queued jobs finish (within ``timeout_s``), then end the threads."""
        for _ in self.threads:
            self.jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


class Health:
    """kvstore's ``/readyz`` as last seen, and whether to talk to it at all meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.up = True  # until the first probe says otherwise: the first tasks try
        self.status = "unprobed"
        self.reason: str | None = None
        self.checked_at: float | None = None

    def seen(self, up: bool, status: str, reason: str | None) -> None:
        with self.lock:
            if up != self.up:
                log.log(logging.INFO if up else logging.WARNING, "kvstore L2 adapter: kvstore is %s%s",
                        "back" if up else "down", "" if up else f" ({reason}); tasks fail fast until it is back")
            self.up, self.status, self.reason, self.checked_at = up, status, reason, time.monotonic()
