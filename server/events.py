"""KV events for subscribers: ``GET /v1/events`` (Server-Sent Events) and ``GET /v1/events/snapshot``;
``start`` also runs the ZMQ publisher in vLLM's format (``server.kv_events_zmq``) when asked for.

One ring, many cursors (``kvstore.engine.events.EventLog``). A stream is a cursor into the store's one
event ring, not a queue: an idle subscriber costs its connection and one suspended coroutine,
and a subscriber that stops reading stops at its socket's send buffer (uvicorn's flow control)
while puts go on. One that falls more than the ring behind gets a ``lost`` marker.

Waking. The emitting threads (puts, the mover) call one hook per event; it schedules at most
one wake-up of the event loop at a time (``loop.call_soon_threadsafe``), and that wake-up
resolves the one future every stream awaits (``Notifier``). So an event costs the loop one
callback whatever the number of subscribers (none while no stream is open), and each event's
SSE frame is encoded once, not once per subscriber.

Ids are ``<epoch>:<seq>``. A stream resumes after the ``Last-Event-ID`` header (or
``?last_event_id=``); without one it starts at the next event. A ``lost`` event (``id``
``<epoch>:S``) says some events up to S are missing: the subscriber resynchronises from
the snapshot (``GET /v1/events/snapshot``, valid at its ``seq`` T) and applies only the events
with seq > T, or opens a new stream with the snapshot's ``id`` as ``Last-Event-ID``. Its
``reason``: ``epoch`` (an id from an earlier run of the server), ``expired`` (an id older than
the ring), ``behind`` (the stream fell more than the ring behind while open).

Shutdown. uvicorn drains open responses *before* the app's shutdown runs, so an open stream
would hold SIGTERM for ``graceful_timeout_s``. ``start`` chains the process's SIGINT/SIGTERM
handlers (uvicorn's, when it runs in the main thread) so that every stream ends as soon as the
signal arrives; the closer ``start`` returns ends them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import threading
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from kvstore.errors import InvalidInput, MalformedRequest, ServerBusy
from kvstore.engine.events import Event, EventLog
from server.auth import Principal
from server.errors import error_response, field_error
from server.requests import authenticate

__all__ = ["router", "start", "Notifier", "HEARTBEAT_S"]

log = logging.getLogger("kvstore.server")

router = APIRouter()

HEARTBEAT_S = 15.0
"""Seconds between keep-alive comments on every stream (proxies close silent connections)."""
_BATCH = 256
"""Events read, and written as one chunk, per turn of a stream: a backlog is sent in bounded
bites, with a yield to the loop between them."""
WAKE_GAP_S = 0.002
"""Streams wake at most this often: under a burst of puts one wake-up carries many events, so the
event loop and the self-pipe cost the puts little (the latency target has 50 ms of room)."""
_FRAMES = 4096
"""Encoded SSE frames kept for reuse by the other streams (a ring, by sequence number)."""
_ID = re.compile(r"([0-9a-fA-F]{1,64}):([0-9]{1,19})")


class Notifier:
    """Wakes every stream of one event loop after new events, and ends them at shutdown.

    Args:
        loop: the server's event loop (streams run there).
        events: the store's event log.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, events: EventLog) -> None:
        self.loop = loop
        self.events = events
        self.open = 0
        """Streams open now (bounded by ``max_event_subscribers``)."""
        self.beats = 0
        """Heartbeats so far: a stream that sees it change and has nothing to send sends a comment."""
        self.stopping = False
        self._future: asyncio.Future = loop.create_future()
        self._pending = False
        self._woke_at = -1.0
        self._frames: list[tuple[int, bytes] | None] = [None] * _FRAMES
        self._remove_hook = events.add_hook(self._emitted)
        self._beat = loop.call_later(HEARTBEAT_S, self._heartbeat)

    def _emitted(self, seq: int) -> None:
        """The log's hook, in the emitting thread: O(1), never raises."""
        # No stream open: nothing to wake (one that opens next reads the log after taking the
        # future, so it misses nothing). A wake-up already on its way will see this event too.
        if self._pending or not self.open:
            return
        self._pending = True
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            self.loop.call_soon_threadsafe(self._soon)

    def _soon(self) -> None:
        """Wake now, or at ``WAKE_GAP_S`` after the last wake-up (``_pending`` stays set till then,
        so the events emitted meanwhile cost their threads nothing)."""
        due = self._woke_at + WAKE_GAP_S
        if self.loop.time() >= due:
            self._wake()
        else:
            self.loop.call_at(due, self._wake)

    def _wake(self) -> None:
        # Cleared before the future turns: an event emitted from here on schedules a new wake-up.
        self._woke_at = self.loop.time()
        self._pending = False
        fut, self._future = self._future, self.loop.create_future()
        fut.set_result(None)

    def _heartbeat(self) -> None:
        self.beats += 1
        self._wake()
        self._beat = self.loop.call_later(HEARTBEAT_S, self._heartbeat)

    def changed(self) -> asyncio.Future:
        """The future the next wake-up resolves. Take it *before* reading the log: an event
        appended after the read then resolves it, so no wake-up is missed."""
        return self._future

    def stop(self) -> None:
        """End every stream and refuse new ones. Thread- and signal-safe."""
        self.stopping = True
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        self._remove_hook()
        self._beat.cancel()
        self._wake()

    def frame(self, ev: Event) -> bytes:
        """``ev`` as an SSE frame, encoded once for all streams."""
        slot = ev.seq % _FRAMES
        cached = self._frames[slot]
        if cached is not None and cached[0] == ev.seq:
            return cached[1]
        data = json.dumps(ev.to_dict(), separators=(",", ":"))
        out = f"id: {self.events.epoch}:{ev.seq}\nevent: {ev.kind}\ndata: {data}\n\n".encode()
        self._frames[slot] = (ev.seq, out)
        return out

    def lost(self, seq: int, reason: str) -> bytes:
        """The ``lost`` marker: the events up to ``seq`` are not coming; resynchronise."""
        data = json.dumps({"type": "lost", "seq": seq, "reason": reason}, separators=(",", ":"))
        return f"id: {self.events.epoch}:{seq}\nevent: lost\ndata: {data}\n\n".encode()


def notifier_of(svc: Any) -> Notifier:
    """The app's ``Notifier`` (made on first use, on the running loop)."""
    notifier = getattr(svc, "event_notifier", None)
    if notifier is None:
        notifier = svc.event_notifier = Notifier(asyncio.get_running_loop(), svc.store.events)
    return notifier


# -- routes ----------------------------------------------------------------------------------


def _namespaces(p: Principal, request: Request) -> frozenset[str] | None:
    """The namespaces a caller sees: those it asks for (``?namespace=``, each checked against its
    token), else all its token grants (None: every namespace)."""
    asked = request.query_params.getlist("namespace")
    if not asked:
        return p.namespaces
    for ns in asked:
        try:
            p.check_namespace(ns)
        except InvalidInput as exc:
            raise field_error(exc, "namespace") from exc
    return frozenset(asked)


def _resume(events: EventLog, notifier: Notifier, request: Request) -> tuple[int, bytes | None]:
    """Where a stream starts (it sends the events after it) and the marker it opens with, if any.

    Raises:
        MalformedRequest: (400) an id that is not ``<epoch>:<seq>``, or one from this run's future.
    """
    raw = request.headers.get("last-event-id")
    if raw is None:
        raw = request.query_params.get("last_event_id")
    last = events.last_seq
    if not raw or not raw.strip():  # the SSE spec's empty id means none
        return last, None
    m = _ID.fullmatch(raw.strip())
    if m is None:
        raise field_error(MalformedRequest(f"must be <epoch>:<seq> as this server's event ids are, got {raw[:80]!r}"),
                          "Last-Event-ID")
    epoch, seq = m.group(1), int(m.group(2))
    if epoch != events.epoch:
        return last, notifier.lost(last, "epoch")
    if seq > last:
        raise field_error(MalformedRequest(f"event {seq} is in the future: the latest of epoch {epoch} is {last}"),
                          "Last-Event-ID")
    oldest = events.oldest_seq()
    if seq + 1 < oldest:  # said here, not by the stream's first read, to tell "expired" from "behind"
        return oldest - 1, notifier.lost(oldest - 1, "expired")
    return seq, None


async def _frames(notifier: Notifier, after: int, opening: bytes | None,
                  namespaces: frozenset[str] | None) -> AsyncIterator[bytes]:
    """The stream's body: events after ``after`` as they come, filtered by namespace."""
    events = notifier.events
    yield b": kvstore events\n\n" + (opening or b"")  # headers and a first chunk go out now
    beats = notifier.beats
    while not notifier.stopping:
        changed = notifier.changed()
        batch, lost = events.read(after, _BATCH)
        if batch:
            parts = [notifier.lost(batch[0].seq - 1, "behind")] if lost else []
            parts += [notifier.frame(ev) for ev in batch
                      if namespaces is None or ev.namespace is None or ev.namespace in namespaces]
            after = batch[-1].seq
            if parts:
                yield b"".join(parts)
            await asyncio.sleep(0)  # a long backlog must not hold the loop: puts are served here too
            continue
        if notifier.beats != beats:
            beats = notifier.beats
            yield b": keep-alive\n\n"
            continue
        await asyncio.shield(changed)  # shielded: a cancelled stream must not cancel everyone's future


class _EventStream(StreamingResponse):
    """An SSE response that takes a subscriber slot for its life and ends when the client goes.

    Starlette watches for the client's disconnect only under ASGI < 2.4; under 2.4 it learns of
    it at the next write, which for an idle stream is the next heartbeat. This one awaits the
    disconnect beside the stream, so a gone subscriber frees its slot at once.
    """

    def __init__(self, body: AsyncIterator[bytes], notifier: Notifier, cap: int) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.notifier, self.cap = notifier, cap

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        notifier = self.notifier
        if notifier.stopping or notifier.open >= self.cap:
            return await _busy(notifier, self.cap)(scope, receive, send)
        notifier.open += 1
        try:
            stream = asyncio.ensure_future(self.stream_response(send))
            gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
            try:
                await asyncio.wait((stream, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stream.cancel()
                gone.cancel()
                done = await asyncio.gather(stream, gone, return_exceptions=True)
            if isinstance(done[0], Exception) and not isinstance(done[0], OSError):
                raise done[0]  # a real failure; a vanished client (OSError) is the normal end
        finally:
            notifier.open -= 1


def _busy(notifier: Notifier, cap: int) -> Response:
    if notifier.stopping:
        exc = ServerBusy("the server is shutting down: subscribe to another node, or again after its restart")
    else:
        exc = ServerBusy(f"the server has {notifier.open} event subscribers, as many as it takes "
                         f"(KVSTORE_MAX_EVENT_SUBSCRIBERS={cap}): retry later")
    response = error_response(exc)
    response.headers["Retry-After"] = str(round(ServerBusy.retry_after_s))
    return response


@router.get("/v1/events")
async def events_stream(request: Request) -> Response:
    """KV events as Server-Sent Events (``id: <epoch>:<seq>``, ``event: stored|moved|removed|cleared|lost``,
    ``data:`` the event as JSON), from ``Last-Event-ID`` on; tenants see their namespaces only."""
    svc, p = authenticate(request)
    namespaces = _namespaces(p, request)
    notifier = notifier_of(svc)
    after, opening = _resume(svc.store.events, notifier, request)
    return _EventStream(_frames(notifier, after, opening, namespaces), notifier, svc.settings.max_event_subscribers)


def _snapshot_body(store: Any, namespaces: frozenset[str] | None) -> bytes:
    seq, entries = store.core.events_snapshot(namespaces)
    epoch = store.events.epoch
    blocks = [{"key": e.key.hex(), "namespace": e.namespace, "tier": e.tier, "size": e.size, "depth": e.depth}
              for e in entries]
    for block, e in zip(blocks, entries):
        if e.engine_hash is not None:  # the engine's name, as the stream's named events carry it
            block["engine_hash"] = e.engine_hash.hex() if isinstance(e.engine_hash, bytes) else e.engine_hash
    return json.dumps({"epoch": epoch, "seq": seq, "id": f"{epoch}:{seq}", "blocks": blocks},
                      separators=(",", ":")).encode()


@router.get("/v1/events/snapshot")
async def events_snapshot(request: Request) -> Response:
    """The block set (the caller's namespaces) and the event it is valid at: apply the events
    after ``seq`` to it, or stream from ``id``."""
    svc, p = authenticate(request)
    namespaces = _namespaces(p, request)
    body = await svc.run(_snapshot_body, svc.store, namespaces)  # a copy of the whole index: off the loop
    return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})


# -- beside the app ----------------------------------------------------------------------------


def start(svc: Any, settings: Any) -> Callable[[], None] | None:
    """Start what the events need beside the app: the streams' notifier, the signal hook that
    ends them at shutdown and, when ``kv_events_endpoint`` is set, the ZMQ publisher. Called in
    the app's startup, on its loop; returns the closer.

    Raises:
        InvalidInput: the ZMQ endpoints cannot be bound.
    """
    notifier = notifier_of(svc)
    svc.kv_events_lost = 0  # events the ZMQ publisher fell past (more than the ring behind)
    publisher = None
    if settings.kv_events_endpoint:
        from server.kv_events_zmq import KVEventsPublisher, tier_media  # zmq loads only when asked for

        def lost(n: int) -> None:  # the publisher's thread is the only writer
            svc.kv_events_lost += n

        svc.store.events.keep_tokens = True  # vLLM's BlockStored carries the token ids
        publisher = KVEventsPublisher(svc.store.events, tier_media(svc.store.tiers), settings.kv_events_endpoint,
                                      topic=settings.kv_events_topic,
                                      replay_endpoint=settings.kv_events_replay_endpoint, on_lost=lost)
        log.info("kvstore: KV events in vLLM's format on %s", settings.kv_events_endpoint)
    untrap = _stop_on_signal(notifier)

    def close() -> None:
        untrap()
        notifier.stop()
        if publisher is not None:
            publisher.close()
    return close


def _stop_on_signal(notifier: Notifier) -> Callable[[], None]:
    """Chain SIGINT/SIGTERM to ``notifier.stop`` before the handler in place (uvicorn's), so open
    streams end when the drain starts rather than at its timeout. Only in the main thread (where
    signals are handled) and only over a Python handler: a process's default action is left alone.
    Returns the function that puts the old handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    chained: dict[int, tuple[Any, Any]] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue

        def handler(signum: int, frame: Any, prev: Any = prev) -> None:
            notifier.stop()
            prev(signum, frame)
        signal.signal(sig, handler)
        chained[sig] = (prev, handler)

    def untrap() -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, (prev, handler) in chained.items():
            if signal.getsignal(sig) is handler:  # still ours: someone else's is not ours to undo
                signal.signal(sig, prev)
    return untrap
