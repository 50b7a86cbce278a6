"""Follow a node's KV events: its block set (key -> tier), kept current in a thread.

    from client_sdk import EventFollower
    with EventFollower("http://10.0.0.1:8470") as node:   # returns once the snapshot is in
        held = node.prefix(block_hashes(spec, tokens, "chat"))

The follower speaks the server's contract (``server/events.py``, docs/operations.md "KV events"):

1. ``GET /v1/events/snapshot``: the block set and the id ``<epoch>:<seq>`` it is valid at;
2. ``GET /v1/events`` from that id (``Last-Event-ID``): ``stored`` and ``moved`` set a key's
   tier, ``removed`` drops it, ``cleared`` empties the set;
3. a dropped stream resumes from the last id applied; a ``lost`` marker (it fell more than the
   server's ring behind, or the server restarted: another epoch) or a 400 for its id means a
   new snapshot, and the stream resumes from that.

An unreachable or refusing server is retried with a short backoff until ``close`` (``failures``
counts the rounds that failed); nothing is raised in the thread. httpx is imported on first use,
like the rest of the SDK's, so ``import client_sdk`` does not pay for it.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from kvstore.errors import ConnectionFailed, RequestTimeout
from kvstore.wire.errors import error_from

if TYPE_CHECKING:
    import httpx

__all__ = ["EventFollower", "sse_messages", "OnEvent"]

log = logging.getLogger("kvstore.client")

OnEvent = Callable[[str, dict, float], None]
"""``on_event(kind, event, arrived)``: each event read (``lost`` included), with the
``time.perf_counter()`` at which it was parsed."""

READ_TIMEOUT_S = 45.0
"""A stream silent this long is dead (the server sends a heartbeat comment every 15 s): reconnect."""
BACKOFF_S = (0.05, 1.0)
"""The wait after a failed round, doubling from the first to at most the second."""


def sse_messages(lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """``(id, event, data)`` of each message of a ``text/event-stream``, per the SSE spec.

    Comments (the server's heartbeats) are skipped; a message with no ``data`` is not one; the
    id carries over to later messages until one sets another; a message cut off by the end of
    the stream is dropped.
    """
    msg_id, event, data = "", "", []
    for line in lines:
        if not line:  # a blank line ends a message
            if data:
                yield msg_id, event or "message", "\n".join(data)
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id" and "\0" not in value:
            msg_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data.append(value)


class _Resync(Exception):
    """The stream says the block set must be rebuilt from a new snapshot."""


class EventFollower:
    """One node's block set (key -> tier) from its snapshot and event stream, in a daemon thread.

    Args:
        url: the node's base URL.
        token: a bearer token (a tenant's sees its namespaces; the admin token, or none where
            auth is off, sees every namespace).
        namespaces: follow only these (``?namespace=``; each must be the token's); None: all
            the token sees.
        on_event: called in the follower's thread for each event read, before it is applied
            and outside the lock (so once ``wait_seq(s)`` returns it has seen every event up to
            ``s``); an exception it raises is logged and ignored. For benches and tracing.
    """

    def __init__(self, url: str, token: str | None = None, namespaces: Sequence[str] | None = None, *,
                 on_event: OnEvent | None = None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._params = [("namespace", ns) for ns in namespaces or ()]
        self._on_event = on_event
        self._cond = threading.Condition()  # the thread writes; readers, waiters, from any thread
        self.blocks: dict[bytes, str] = {}
        """Key -> tier. Read it under the follower's own calls (``prefix``, ``snapshot_blocks``)."""
        self.last_id: str | None = None
        """``<epoch>:<seq>`` of the last event applied (or of the snapshot): where a resume starts."""
        self.kinds: Counter[str] = Counter()
        """Events read, by kind (``lost`` included)."""
        self.resyncs = 0
        """Snapshots taken, the first included."""
        self.streams = 0
        """Streams opened (one more per resume)."""
        self.failures = 0
        """Rounds that failed (unreachable, refused, an error answer); each is retried."""
        self.last_error: BaseException | None = None
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._stream: Any = None
        self._streak = 0  # failed rounds in a row: the backoff's exponent
        self._thread = threading.Thread(target=self._run, name=f"events {self.url}", daemon=True)

    # -- reading (any thread) ---------------------------------------------------------------------

    @property
    def epoch(self) -> str | None:
        """The server run the block set belongs to (None before the first snapshot)."""
        last = self.last_id
        return last.rsplit(":", 1)[0] if last else None

    @property
    def seq(self) -> int:
        """The number of the last event applied (0 before the first snapshot)."""
        last = self.last_id
        return int(last.rsplit(":", 1)[1]) if last else 0

    def prefix(self, keys: Iterable[bytes]) -> int:
        """How many leading ``keys`` the node holds."""
        with self._cond:
            n = 0
            for key in keys:
                if key not in self.blocks:
                    break
                n += 1
            return n

    def snapshot_blocks(self) -> dict[bytes, str]:
        """A copy of the block set (key -> tier)."""
        with self._cond:
            return dict(self.blocks)

    def wait_synced(self, timeout_s: float) -> bool:
        """Wait for the first snapshot; False on timeout."""
        return self._synced.wait(timeout_s)

    def wait_seq(self, seq: int, timeout_s: float) -> bool:
        """Wait until the events up to ``seq`` are applied; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.seq >= seq, timeout_s)

    def catch_up(self, timeout_s: float = 10.0) -> bool:
        """Wait until the follower has applied every event the node had emitted when called
        (tests, demos and benches: a router never needs to). False on timeout.

        A follower of some namespaces gets no event of the others, so its ``seq`` may stay
        behind the node's; it is caught up once it holds exactly the node's block set as of the
        call (its snapshot), as applying the rest would leave it.

        Raises:
            ConnectionFailed, RequestTimeout, ServiceError: the node's snapshot could not be read.
        """
        with self._client() as http:
            epoch, seq, _, want = self._snapshot(http)
        with self._cond:
            return self._cond.wait_for(
                lambda: self.epoch == epoch and (self.seq >= seq or self.blocks == want), timeout_s)

    # -- life -------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> "EventFollower":
        """Start following; returns once the first snapshot is in (the block set is valid from
        there), or at once where ``timeout_s`` is 0 (the thread keeps trying: ``wait_synced``).

        Raises:
            TimeoutError: no snapshot within ``timeout_s`` (the follower is closed).
        """
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        if timeout_s > 0 and not self._synced.wait(timeout_s):
            error = self.last_error
            self.close()
            raise TimeoutError(f"{self.url} gave no events snapshot within {timeout_s:g} s"
                               + (f" (last error: {error!r})" if error else "")) from error
        return self

    def close(self) -> None:
        """Stop following (the block set stays as it was); idempotent."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            # Closing a socket does not wake a thread blocked reading it; shutting it down does.
            with suppress(OSError, AttributeError):
                stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "EventFollower":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- following (the follower's thread) ----------------------------------------------------------

    def _client(self) -> "httpx.Client":
        import httpx

        return httpx.Client(base_url=self.url, headers=self._headers,
                            timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))

    def _snapshot(self, http: "httpx.Client") -> tuple[str, int, str, dict[bytes, str]]:
        """``(epoch, seq, id, blocks)`` of the node's snapshot."""
        import httpx

        try:
            resp = http.get("/v1/events/snapshot", params=self._params)
        except httpx.TimeoutException as exc:
            raise RequestTimeout(f"{self.url}: no events snapshot within the timeout") from exc
        except httpx.HTTPError as exc:
            raise ConnectionFailed(f"{self.url}: {exc}") from exc
        if resp.status_code != 200:
            raise error_from(resp.status_code, resp.content)
        snap = resp.json()
        return snap["epoch"], snap["seq"], snap["id"], {bytes.fromhex(b["key"]): b["tier"] for b in snap["blocks"]}

    def _run(self) -> None:
        need_snapshot = True
        with self._client() as http:
            while not self._stop.is_set():
                try:
                    just_synced = need_snapshot
                    if need_snapshot:
                        self._resync(http)
                        need_snapshot = False
                    self._follow(http, resync_on_400=not just_synced)
                    # The stream ended (the server closed it): resume at once.
                except _Resync:
                    need_snapshot = True
                except Exception as exc:  # noqa: BLE001 - the thread must live: every failure is retried
                    if self._stop.is_set():
                        break
                    self.failures += 1
                    self.last_error = exc
                    (log.warning if self._streak == 0 else log.debug)("kvstore: events from %s: %r; retrying",
                                                                      self.url, exc)
                    self._stop.wait(min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** self._streak))
                    self._streak += 1

    def _resync(self, http: "httpx.Client") -> None:
        """Replace the block set with the node's snapshot."""
        _, _, snap_id, blocks = self._snapshot(http)
        with self._cond:
            self.blocks, self.last_id = blocks, snap_id
            self.resyncs += 1
            self._cond.notify_all()
        self._streak = 0
        self._synced.set()

    def _follow(self, http: "httpx.Client", resync_on_400: bool) -> None:
        """Apply the stream's events until it ends or fails.

        Raises:
            _Resync: a ``lost`` marker, or a 400 for the resume id (not right after a snapshot:
                then it is a failure, retried with backoff, not a loop of snapshots).
        """
        import httpx

        headers = {"Last-Event-ID": self.last_id or "", "Accept": "text/event-stream"}
        try:
            with http.stream("GET", "/v1/events", params=self._params, headers=headers) as resp:
                if resp.status_code == 400 and resync_on_400:  # an id this node never gave: start over
                    raise _Resync
                if resp.status_code != 200:
                    raise error_from(resp.status_code, resp.read())
                self.streams += 1
                self._streak = 0
                self._stream = resp.extensions.get("network_stream")
                try:
                    if self._stop.is_set():  # close() came before the stream was there to shut down
                        return
                    for msg_id, kind, data in sse_messages(resp.iter_lines()):
                        self._apply(kind, json.loads(data), msg_id, time.perf_counter())
                finally:
                    self._stream = None
        except httpx.HTTPError as exc:
            raise ConnectionFailed(f"{self.url}: the event stream failed: {exc!r}") from exc

    def _apply(self, kind: str, event: dict, msg_id: str, arrived: float) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, event, arrived)
            except Exception:  # noqa: BLE001 - a caller's bug must not stop the follower
                log.exception("kvstore: on_event raised for a %s event; ignored", kind)
        if kind == "lost":
            with self._cond:
                self.kinds[kind] += 1
            raise _Resync
        with self._cond:
            if kind in ("stored", "moved"):
                self.blocks[bytes.fromhex(event["key"])] = event["tier"]
            elif kind == "removed":
                self.blocks.pop(bytes.fromhex(event["key"]), None)
            elif kind == "cleared":
                self.blocks.clear()
            self.kinds[kind] += 1
            self.last_id = msg_id or self.last_id
            self._cond.notify_all()
