"""How a client plans its transfers: media, probes, the policy it runs under, reports.

``ClientPlanner`` owns one ``kvstore.planner.Planner`` and the media a client
can reach. Per transfer it asks the planner for an option, runs it through
that medium, times it, and tells the planner what it cost. At start (and when
an estimate grows older than the policy's ``explore_after_s``) it probes each
medium: one empty round trip and one bounded transfer (``probe_bytes``). Until
real transfers are measured, an estimate also pays the work its transfer
does that the probe does not (``UNPROBED_ROUND_TRIPS``); a co-located get whose
slots are all remembered is shm's "cached" path, with its own estimate (``PATHS``).

The policies come from the server (``GET /v1/policy``, refreshed every
``refresh_s``); each transfer runs under the baseline or the canary candidate
by a stable hash of the namespace (``PolicySet.for_key``). Finished decision
records go back to the server in batches (``POST /v1/decisions``), where
``/admin/decisions`` shows them and the canary is judged.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Generator, Iterator

import torch

from client_sdk._common import VERIFIED_VIEW
from client_sdk.colocated import Steps
from client_sdk.media import Medium
from kvstore.errors import ConnectionFailed
from kvstore.errors import InvalidInput, KVStoreError, QuotaExceeded, TierFull
from kvstore.planner import RECOMPUTE, Decision, Option, Planner, wire_bytes
from kvstore.policy import Policy, PolicySet
from kvstore.spec import KVSpec

log = logging.getLogger("kvstore.client")

__all__ = ["PlanCore", "ClientPlanner", "free_memory_bytes"]

UNPROBED_ROUND_TRIPS = {("get", "shm"): 1, **{("put", medium): 2 for medium in ("shm", "http", "flight", "redis")}}
"""(op, medium) -> work a real transfer does that the medium's probe does not, in empty HTTP round
trips: the estimate's prior (``Estimate.overhead_s``) until real transfers replace it. A shm get
asks where its blocks are, while its probe reads the arena and asks nothing (so does a get from
remembered slots: the "cached" path). A put has the server reserve room and commit the frames: a
shm put's two requests, done inside the one request of an HTTP or Flight put (whose probes fetch
filler). Measured on one host, the real extra was 3-6 round trips; without it a first 64 KiB shm
put was predicted 0.04 ms and took 1.7 ms."""
PATHS = {("get", "shm"): ("cached", "indexed")}
"""(op, medium) -> its other paths, each with its own estimate, which its probes seed too (the shm
probe times exactly what a cached get does: a copy out of the arena). "indexed": a first read of
blocks found in the arena's key index, with no request either, but a header checked per block
and, for a frame the server has not verified yet, a hash: costlier than a remembered copy."""


_MEMINFO_TTL_S = 1.0
_meminfo: list[float | int | None] = [-_MEMINFO_TTL_S, None]  # [read at (monotonic s), MemAvailable bytes]


def free_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo: the receiver's room for a result; None where unknown.

    Read at most once a second: a get asks every time, and the file read cost 37 us, as much
    as the rest of the planning.
    """
    now = time.monotonic()
    if now - _meminfo[0] < _MEMINFO_TTL_S:  # type: ignore[operator]
        return _meminfo[1]  # type: ignore[return-value]
    value = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    value = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    _meminfo[:] = [now, value]
    return value


class PlanCore:
    """What the sync and async planners share: policies, options, set-aside media, the
    bookkeeping of decisions and reports, and a transfer itself (``_transfer``: a flow whose
    steps do the I/O; ``ClientPlanner`` calls them, ``AsyncClientPlanner`` awaits them).

    Args:
        media: what this client can reach, by name (``Medium``s, or the async client's media:
            anything with ``name``, ``puts`` and ``codecs``).
        routing_key: what the canary hashes (the client's namespace).
        locality: "colocated" or "remote", recorded in every decision.
        refresh_s: how often the policies are fetched again.
        report: called (it must not block) when finished decisions should go to the server:
            every ``report_every`` of them, or ``report_after_s`` after the last report.
    """

    policy: Callable[[], Any]
    """The policy a transfer runs under now (fetched again every ``refresh_s``)."""
    fetch_policies: Callable[[], Any] | None
    _timed: Callable[..., Any]
    """``_timed(probe, nbytes)``: the seconds ``probe(nbytes)`` took."""
    _probing: Any
    """Held while a transfer probes: a ``threading.Lock``, or an ``asyncio.Lock``."""

    def __init__(self, media: dict[str, Any], *, routing_key: str = "default", locality: str = "remote",
                 refresh_s: float = 5.0, planner: Planner | None = None, report: Callable[[], None] | None = None,
                 report_every: int = 64, report_after_s: float = 1.0) -> None:
        self.media = media
        self.planner = planner or Planner()
        self.routing_key = routing_key
        self.locality = locality
        self.refresh_s = refresh_s
        self.policies = PolicySet()
        self._option_cache: dict[tuple[str, int], list[Option]] = {}
        self._fetched_s = -1e18
        self._down: dict[str, float] = {}
        """Medium -> monotonic time until which it is set aside after a failure."""
        self.last: Decision | None = None
        self._report = report
        self._report_every = report_every
        self._report_after_s = report_after_s
        self._finished = 0
        self._reported_s = time.monotonic()
        self._inflight: dict[str, list[int]] = {}
        """Medium -> wire bytes of each of this client's transfers in flight over it (the receiver's queue)."""
        self._inflight_n = 0
        self._inflight_lock = threading.Lock()
        self._rtt_s: dict[str, float] = {}
        """Medium -> its latest probe's empty round trip (what ``UNPROBED_ROUND_TRIPS`` are priced at)."""

    # -- policies ----------------------------------------------------------------------------

    def _refresh_due(self, force: bool = False) -> bool:
        if not force and time.monotonic() - self._fetched_s < self.refresh_s:
            return False
        self._fetched_s = time.monotonic()
        return True

    def _fresh_policy(self) -> Policy | None:
        """The policy a transfer runs under, when no refresh is due (most transfers: no I/O);
        None when one is (``policy()`` fetches)."""
        if self.fetch_policies is None or time.monotonic() - self._fetched_s < self.refresh_s:
            return self.policies.for_key(self.routing_key)
        return None

    def _apply_policies(self, data: Any) -> None:
        """The server's ``/v1/policy`` answer; a malformed one keeps the last good policies."""
        try:
            if data is not None:
                policies = PolicySet.from_dict(data)
                if policies != self.policies:
                    self.policies, self._option_cache = policies, {}
        except (KVStoreError, ValueError, TypeError) as exc:
            log.debug("policy refresh failed: %s", exc)

    # -- estimates -----------------------------------------------------------------------------

    def _options(self, op: str, policy: Policy) -> list[Option]:
        """The options ``policy`` allows on this client's media, built once per policy (not per get)."""
        key = (op, policy.version)
        cached = self._option_cache.get(key)
        if cached is not None:
            return cached
        out = []
        for name in policy.media:
            medium = self.media.get(name)
            if medium is None:
                continue
            if op == "put":
                if medium.puts:
                    out.append(Option(name))
                continue
            for codec in policy.codecs:
                if codec in medium.codecs or (codec == "raw" and None in medium.codecs):
                    out.append(Option(name, codec))
        self._option_cache[key] = out
        return out

    def _stale(self, op: str, options: list[Option], policy: Policy) -> list[Option]:
        """The options whose estimate for ``op`` is missing or older than ``explore_after_s``: to probe."""
        return [o for o in options if self.planner.model.age_s(op, o.name) >= policy.explore_after_s]

    def _probed(self, op: str, option: Option, policy: Policy, rtt_s: float, wire: int, wire_s: float) -> None:
        self._rtt_s[option.medium] = rtt_s
        for path in ("",) + PATHS.get((op, option.medium), ()):
            self.planner.model.observe(op, option.name, 0, rtt_s, policy, real=False, path=path)
            if wire:
                self.planner.model.observe(op, option.name, wire, wire_s, policy, real=False, path=path)

    def _price_requests(self, op: str, options: list[Option]) -> None:
        """Each option's prior pays the work its probe does not do (``UNPROBED_ROUND_TRIPS``), at
        the HTTP probe's empty round trip (once it is known: media are probed in the policy's
        order, shm before http)."""
        rtt = self._rtt_s.get("http")
        if rtt is None:
            return
        for option in options:
            extra = UNPROBED_ROUND_TRIPS.get((op, option.medium), 0)
            if extra:
                self.planner.model.set_overhead(op, option.name, extra * rtt)

    def _paths(self, spec: KVSpec, toks: Any) -> dict[str, str] | None:
        """``{"shm": "cached"}`` when the shm medium would serve this get from slots it remembers
        and checked before, ``{"shm": "indexed"}`` from slots the arena's key index names (a first
        read), both without asking the server: a copy, against a request and a first read
        (64 KiB: 0.08 ms against 1.0; 4 MiB: 0.9 against 8.4). Without it the two were one
        estimate, wrong by 10x either way. None otherwise (a wrapped medium hides its path)."""
        shm = self.media.get("shm")
        colocation = getattr(shm, "colocation", None)
        arena = None if colocation is None else colocation.current()
        blocks = None if arena is None else arena.blocks_for(spec, toks, shm.namespace)  # type: ignore[union-attr]
        if blocks is None:
            return None
        return {"shm": "cached" if all(VERIFIED_VIEW in b for b in blocks) else "indexed"}

    def _probe_failed(self, option: Option, policy: Policy, exc: KVStoreError) -> None:
        log.info("probe of %s failed: %s", option.name, exc)
        self.planner.forget_choice(option.name)
        if option.medium != "http":  # set aside; retried after explore_after_s, not every get
            self._down[option.medium] = time.monotonic() + policy.explore_after_s

    @staticmethod
    def _probe_wire(option: Option, policy: Policy) -> int:
        """A probe moves filler the way a get does; it seeds a put's estimate too, until real puts refine it."""
        return policy.probe_bytes if option.codec == "raw" else policy.probe_bytes // 2

    def _probes(self, op: str, options: list[Option], policy: Policy) -> Generator[Callable[[], Any], Any, None]:
        """Probe every option whose estimate for ``op`` is missing or older than ``explore_after_s``:
        one empty round trip (the least of three: the first may pay for a connect), then one
        bounded transfer. Steps of ``_transfer``; one transfer probes at a time, and one that
        waited for it finds the estimates fresh.
        """
        yield self._probing.acquire
        try:
            for option in self._stale(op, options, policy):
                medium = self.media[option.medium]
                try:
                    rtt = []
                    for _ in range(3):
                        rtt.append((yield partial(self._timed, medium.probe, 0)))
                    wire = self._probe_wire(option, policy)
                    took = (yield partial(self._timed, medium.probe, wire)) if wire else 0.0
                    self._probed(op, option, policy, min(rtt), wire, took)
                except KVStoreError as exc:
                    self._probe_failed(option, policy, exc)
            self._price_requests(op, options)
        finally:
            self._probing.release()

    def _calibrate_codecs(self) -> None:
        """Seed int8 encode/decode seconds per byte from a small block (the server encodes alike).

        The least of three after an untimed round: a process's first int8 encode pays for
        torch's lazy set-up (about 0.2 s here), which once made int8 look 100x slower than it is.
        """
        from kvstore import codec as codec_mod

        if not any("int8" in m.codecs for m in self.media.values()):
            return  # no medium here carries int8 frames (the async client's): nothing to weigh
        kv = torch.randn(4, 2, 4, 64, 128).to(torch.float16)  # 512 KiB
        codec_mod.decode(codec_mod.encode(kv, "int8"))
        enc, dec = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            frame = codec_mod.encode(kv, "int8")
            t1 = time.perf_counter()
            codec_mod.decode(frame)
            enc.append(t1 - t0)
            dec.append(time.perf_counter() - t1)
        raw = kv.numel() * kv.element_size()
        self.planner.model.observe_codec("int8", "encode", raw, min(enc))
        self.planner.model.observe_codec("int8", "decode", raw, min(dec))

    def set_prefill_rate(self, spec: KVSpec, tokens_per_s: float) -> None:
        self.planner.model.set_prefill_rate(spec.fingerprint(), tokens_per_s)

    # -- transfers ----------------------------------------------------------------------------------

    def _queued(self) -> dict[str, tuple[int, ...]] | None:
        """Wire bytes of each transfer in flight, by medium; None when there are none (the usual case)."""
        if not self._inflight_n:
            return None
        with self._inflight_lock:
            return {m: tuple(sizes) for m, sizes in self._inflight.items() if sizes}

    @contextmanager
    def _in_flight(self, option: Option, raw_bytes: int) -> Iterator[None]:
        """Count a transfer's wire bytes as in flight over its medium while it runs."""
        wire = wire_bytes(option, raw_bytes)
        with self._inflight_lock:
            self._inflight.setdefault(option.medium, []).append(wire)
            self._inflight_n += 1
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight[option.medium].remove(wire)
                self._inflight_n -= 1

    def _up(self, op: str, policy: Policy) -> list[Option]:
        """The policy's options on media that are not set aside.

        Raises:
            InvalidInput: the policy allows none of this client's media.
            ConnectionFailed: every allowed medium failed within ``explore_after_s``.
        """
        options = self._options(op, policy)
        if not options:
            raise InvalidInput(f"policy v{policy.version} allows none of this client's media {sorted(self.media)}")
        now = time.monotonic()
        up = [o for o in options if self._down.get(o.medium, 0.0) <= now]
        if not up:
            raise ConnectionFailed(f"every medium the policy allows failed lately: {sorted(self._down)}")
        return up

    def _still_up(self, up: list[Option]) -> list[Option]:
        up = [o for o in up if self._down.get(o.medium, 0.0) <= time.monotonic()]
        if not up:
            raise ConnectionFailed(f"every medium the policy allows failed its probe: {sorted(self._down)}")
        return up

    def _transfer(self, op: str, decide: Callable[[Policy, list[Option]], Decision], move: Callable[[Any, Option], Any],
                  done: Callable[[Decision, Policy, Option, Any, float], None],
                  recomputed: Callable[[], Any] | None = None) -> Generator[Callable[[], Any], Any, Any]:
        """One planned transfer: decide, move it over the chosen medium, learn what it cost.

        A medium that fails is set aside and the transfer tried once more over the next best.
        Written once for both planners: the steps that do I/O (the policy, probes of stale
        estimates, the move) are yielded as callables, which ``ClientPlanner`` calls and
        ``AsyncClientPlanner`` awaits (``_drive``); what one raised is thrown back in.
        """
        for attempt in range(2):
            policy = self._fresh_policy()
            if policy is None:
                policy = yield self.policy
            up = self._up(op, policy)
            if self._stale(op, up, policy):
                yield from self._probes(op, up, policy)
            d = decide(policy, self._still_up(up))
            if d.choice == RECOMPUTE:
                assert recomputed is not None
                return recomputed()
            option = d.option
            assert option is not None
            t0 = time.perf_counter()
            try:
                with self._in_flight(option, d.nbytes):
                    got = yield partial(move, self.media[option.medium], option)
            except KVStoreError as exc:
                self._failed(d, policy, option, t0, exc, retry=attempt == 0)
                continue
            except BaseException as exc:  # cancelled, or a bug: recorded, and raised as it is
                self._abandoned(d, policy, t0, exc)
                raise
            done(d, policy, option, got, time.perf_counter() - t0)
            return got
        raise AssertionError("unreachable: the second failure raises")

    def _decide_get(self, spec: KVSpec, toks: Any, out: Any, slo_s: float | None, policy: Policy,
                    options: list[Option]) -> Decision:
        n_tokens = spec.full_blocks(len(toks)) * spec.block_tokens
        d = self.planner.decide("get", options, nbytes=n_tokens * spec.bytes_per_token, tokens=n_tokens,
                                policy=policy, fingerprint=spec.fingerprint(), locality=self.locality,
                                slo_s=slo_s, free_bytes=free_memory_bytes() if out is None else _capacity(out),
                                queued=self._queued(), paths=self._paths(spec, toks) if n_tokens else None)
        self.last = d
        if d.choice == RECOMPUTE:
            self.planner.finish(d, policy, actual_s=0.0, actual_bytes=0)
            self._finished_one()
        return d

    def _finish_get(self, d: Decision, policy: Policy, option: Option, spec: KVSpec, n: int, elapsed: float) -> None:
        raw = n * spec.bytes_per_token
        codec_s = 0.0
        if option.codec != "raw":
            model = self.planner.model.codec_s_per_byte
            codec_s = raw * (model.get((option.codec, "encode"), 0.0) + model.get((option.codec, "decode"), 0.0))
        self.planner.finish(d, policy, actual_s=elapsed, actual_bytes=raw, codec_s=min(codec_s, elapsed * 0.9))
        self._finished_one()

    def _decide_put(self, spec: KVSpec, toks: Any, slo_s: float | None, policy: Policy,
                    options: list[Option]) -> Decision:
        nbytes = spec.full_blocks(len(toks)) * spec.block_nbytes
        d = self.planner.decide("put", options, nbytes=nbytes, tokens=0, policy=policy,
                                fingerprint=spec.fingerprint(), locality=self.locality, slo_s=slo_s,
                                queued=self._queued())
        self.last = d
        return d

    def _finish_put(self, d: Decision, policy: Policy, spec: KVSpec, n: int, elapsed: float) -> None:
        self.planner.finish(d, policy, actual_s=elapsed, actual_bytes=n * spec.bytes_per_token)
        self._finished_one()

    def _failed(self, d: Decision, policy: Policy, option: Option, t0: float, exc: KVStoreError, *,
                retry: bool) -> None:
        """Record a failed transfer; set its medium aside and return for one retry, or raise.

        The caller's own mistakes (bad input, a refused token) and the store's answers (no
        room, a quota) fail the same on any medium and are raised at once: a full store is
        not a broken medium, and setting shm aside for it sent every put over HTTP for 30 s.
        """
        self._abandoned(d, policy, t0, exc)
        self.planner.forget_choice(option.name)
        if isinstance(exc, (InvalidInput, PermissionError, TierFull, QuotaExceeded)) or not retry:
            raise exc
        self._set_aside(option.medium, policy, exc)

    def _abandoned(self, d: Decision, policy: Policy, t0: float, exc: BaseException) -> None:
        """Finish the record of a transfer that did not complete (nothing is learnt from it)."""
        self.planner.finish(d, policy, actual_s=time.perf_counter() - t0, actual_bytes=0, error=repr(exc))
        self._finished_one()

    def _set_aside(self, medium: str, policy: Policy, exc: Exception) -> None:
        if medium == "http":  # the medium every other one falls back to; its errors are the caller's answer
            raise exc
        log.warning("medium %s failed (%s); not used for %g s", medium, exc, policy.explore_after_s)
        self._down[medium] = time.monotonic() + policy.explore_after_s

    def _finished_one(self) -> None:
        self._finished += 1
        now = time.monotonic()
        if self._report is not None and (self._finished >= self._report_every
                                         or now - self._reported_s >= self._report_after_s):
            self._finished, self._reported_s = 0, now
            self._report()

    def close(self) -> None:
        for medium in self.media.values():
            try:
                medium.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                log.debug("closing medium %s failed", medium.name, exc_info=True)


class ClientPlanner(PlanCore):
    """The planner as one (synchronous) client uses it.

    Args:
        media: what this client can reach, by name.
        fetch_policies: returns the server's ``PolicySet`` JSON (None: keep the defaults).
        Others: as ``PlanCore``'s.
    """

    def __init__(self, media: dict[str, Medium], *, fetch_policies: Callable[[], Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(media, **kwargs)
        self.fetch_policies = fetch_policies
        self._probing = threading.Lock()
        self._refresh(force=True)
        self._calibrate_codecs()

    def policy(self) -> Policy:
        self._refresh()
        return self.policies.for_key(self.routing_key)

    def _refresh(self, force: bool = False) -> None:
        if self.fetch_policies is None or not self._refresh_due(force):
            return
        try:
            data = self.fetch_policies()
        except (KVStoreError, ValueError, TypeError) as exc:  # keep the last good policies
            log.debug("policy refresh failed: %s", exc)
            return
        self._apply_policies(data)

    def get_kv(self, spec: KVSpec, toks: Any, out: Any, slo_s: float | None) -> tuple[torch.Tensor, int]:
        return self._drive(self._transfer(
            "get", lambda policy, options: self._decide_get(spec, toks, out, slo_s, policy, options),
            lambda medium, option: medium.get_kv(spec, toks, out, codec=None if option.codec == "raw" else option.codec),
            lambda d, policy, option, got, took: self._finish_get(d, policy, option, spec, got[1], took),
            lambda: (spec.empty_kv(0), 0)))

    def put_kv(self, spec: KVSpec, toks: Any, kv: torch.Tensor, slo_s: float | None) -> int:
        return self._drive(self._transfer(
            "put", lambda policy, options: self._decide_put(spec, toks, slo_s, policy, options),
            lambda medium, option: medium.put_kv(spec, toks, kv),
            lambda d, policy, option, got, took: self._finish_put(d, policy, spec, got, took)))

    @staticmethod
    def _timed(probe: Callable[[int], None], nbytes: int) -> float:
        t0 = time.perf_counter()
        probe(nbytes)
        return time.perf_counter() - t0

    @staticmethod
    def _drive(transfer: Generator[Callable[[], Any], Any, Any]) -> Any:
        """Run a transfer (``PlanCore._transfer``), calling each of its steps here."""
        steps = Steps(transfer)
        for step in steps:
            try:
                steps.answer = step()
            except BaseException as exc:  # the transfer records it, then raises it or tries the next medium
                steps.error = exc
        return steps.result


def _capacity(out: Any) -> int | None:
    try:
        if isinstance(out, torch.Tensor):
            return out.numel() * out.element_size()
        return memoryview(out).nbytes
    except TypeError:
        return None

