"""The transfer planner: per transfer, pick the medium and wire codec, or say "recompute".

Cost model, per option (a medium, and for gets a wire codec):

    predicted = latency + wire_bytes / bandwidth + codec_cost_per_byte * raw_bytes

plus, where this client already has transfers in flight over the same medium,
the wait behind them (``shared_wire``), against ``recompute = tokens /
prefill_rate`` for the caller's spec. Per option, path and payload size class,
an EWMA (in log space) of seconds per byte from every real transfer
(``Estimate``); sizes not measured yet take a line fitted to the measured
classes, and before any real transfer the probes' line plus the work the
transfer does that its probe does not. A path is a way a medium has of doing
one transfer, known before it runs (``paths``: a shm get from remembered slot
handles asks the server nothing). Codec costs are EWMAs of measured encode and
decode seconds per byte.

Exploration: an option not measured in a size class lately gets a burst of
real transfers, paid for by the class's chosen transfers (``EXPLORE_SHARE``).

Stability: the planner keeps a current choice per (operation, size class). It
moves to another option only when that option has been the predicted best for
``window_s`` without a break, better by ``margin_frac`` when the window starts
and when it ends; a choice that becomes unavailable is left at once. A queue
on this client's side moves one transfer, never the choice. Payloads of at most
``small_bytes`` take the first available medium in the policy's order without
deliberation.

Every decision is a ``Decision`` record (inputs, candidates with predictions,
choice, reason, then the actual cost), kept in a bounded ``DecisionLog``. Its
reason is ``"<verb> <choice>: <why>"``, built from a code (``REASONS``) and the
choice in one place (``_record``): whichever rule decided, the text names the
option taken first ("kept shm: http (1.64 ms) has beaten it (4.54 ms) by the
margin for 1.2 of 5 s; ...", never "kept: http ... beats shm").
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from kvstore.costs import (BURST_MAX, EXPLORE_SHARE, EXPLORE_WITHIN, CostModel, Estimate, Option, shared_wire,
                           size_class, wire_bytes)
from kvstore.decisions import RECOMPUTE, Candidate, Decision, DecisionLog, reason_text
from kvstore.errors import InvalidInput
from kvstore.policy import Policy

# The cost model (kvstore.costs) and the decision records (kvstore.decisions) are re-exported:
# the planner's users name them from here.
__all__ = ["Option", "RECOMPUTE", "Estimate", "CostModel", "Candidate", "Decision", "DecisionLog", "Planner",
           "wire_bytes", "shared_wire", "size_class"]


@dataclass(slots=True)
class _Sticky:
    current: str
    challenger: str | None = None
    since_s: float = 0.0
    under_since_s: float | None = None
    """When the challenger, still the predicted best, fell under the margin (its window lapses
    after ``window_s`` of that: a lone stall must not leave one running)."""
    provisional: bool = False
    """Chosen before ``current`` had a real transfer of this size class (on probes or other
    sizes' fits): the first real evidence against it is new information, not noise, so it
    is acted on without waiting out the window."""


ARENA_PATHS = ("cached", "indexed")
"""A get's paths that read every block from the co-located arena with no request: no other
medium can be faster (each has the server read that arena first), so the planner takes it."""


class Planner:
    """Decides per transfer from a ``CostModel``, with hysteresis per (op, size class).

    Args:
        model: the shared estimates (a client keeps one per server).
        clock: monotonic seconds (tests drive it).
    """

    def __init__(self, model: CostModel | None = None, *, clock: Callable[[], float] = time.monotonic,
                 log: DecisionLog | None = None) -> None:
        self.model = model or CostModel(clock)
        self.clock = clock
        self.log = log or DecisionLog()
        self._sticky: dict[tuple[int, str, int, tuple], _Sticky] = {}
        """(policy version, op, size class, paths) -> the current choice there."""
        self._explored: dict[tuple[str, str, int], list[float]] = {}
        self._budget: dict[tuple[str, int], float] = {}
        """(op, size class) -> seconds of exploration earned and not spent (``EXPLORE_SHARE``)."""
        self._lock = threading.Lock()

    def decide(self, op: str, options: Iterable[Option], *, nbytes: int, tokens: int, policy: Policy,
               fingerprint: str = "", locality: str = "remote", slo_s: float | None = None,
               free_bytes: int | None = None, queued: Mapping[str, Sequence[int]] | None = None,
               paths: Mapping[str, str] | None = None) -> Decision:
        """Pick an option for one transfer (``op`` "get" or "put"), or "recompute" for a get.

        Args:
            options: what is available for this transfer, already filtered by the policy's media.
            nbytes: raw KV bytes the transfer moves at most.
            tokens: tokens the caller would recompute instead.
            slo_s: this transfer's latency bound (default: the policy's).
            free_bytes: the receiver's free buffer space; an option needing more is infeasible.
            queued: medium -> wire bytes of each transfer this client has in flight over it. Their
                wait is predicted for this transfer alone: hysteresis weighs the media without it.
            paths: medium -> how it would do this transfer where it has more than one way
                ("cached": a shm get from remembered slot handles, no request). Each path has
                its own estimate, and its own hysteresis.
        """
        opts = [o for o in options if o.medium in policy.media and (op == "put" or o.codec in policy.codecs)]
        if not opts:
            raise InvalidInput(f"no medium available for {op} under policy v{policy.version}")
        slo = policy.slo_s if slo_s is None else slo_s
        paths = {m: p for m, p in (paths or {}).items() if p}
        if nbytes <= policy.small_bytes:
            first = min(opts, key=lambda o: (policy.media.index(o.medium), o.codec != "raw"))
            path = paths.get(first.medium, "")
            cand = Candidate(first.name, self.model.predict(op, first, nbytes, path=path), path=path,
                             learnt=self.model.learnt(op, first.name, path))
            return self._record(op, nbytes, tokens, locality, [cand], first.name, "small",
                                f"payload of {nbytes} B is at most small_bytes ({policy.small_bytes} B): "
                                f"the policy's first medium, without deliberation", policy, slo, free_bytes)
        queued = queued or {}
        cands = [self._candidate(op, o, nbytes, slo, free_bytes, tuple(queued.get(o.medium, ())),
                                 paths.get(o.medium, "")) for o in opts]
        recompute = None
        if op == "get" and policy.recompute and tokens > 0:
            rs = self.model.recompute_s(fingerprint, tokens)
            if rs is not None:
                recompute = Candidate(RECOMPUTE, rs)
        known = [c for c in cands if c.feasible and c.predicted_s is not None]
        everything = cands + ([recompute] if recompute else [])
        if not any(c.feasible for c in cands):  # the transfer fails where it lands, with the typed error
            return self._record(op, nbytes, tokens, locality, everything, cands[0].option, "infeasible",
                                f"no option fits: {cands[0].why}", policy, slo, free_bytes)
        near = next((c for o, c in zip(opts, cands) if op == "get" and c.feasible and c.path in ARENA_PATHS
                     and o.codec == "raw"), None)
        if near is not None and not (recompute is not None and near.predicted_s is not None
                                     and recompute.predicted_s < near.predicted_s):  # type: ignore[operator]
            return self._record(op, nbytes, tokens, locality, everything, near.option, "arena",
                                f"every block is in the co-located arena ({near.path}): {near.option} reads it "
                                f"with no request, one copy; another medium has the server read the same "
                                f"arena, then moves it", policy, slo, free_bytes)
        if not known:  # nothing measured yet: the policy's order decides
            first = next(c for c in cands if c.feasible)
            return self._record(op, nbytes, tokens, locality, everything, first.option, "unmeasured",
                                "no estimates yet: the first available medium in the policy's order",
                                policy, slo, free_bytes)
        best = min(known, key=lambda c: c.alone_s)  # type: ignore[arg-type, return-value]
        explore = self._to_explore(op, nbytes, policy, cands, best, recompute)
        if explore is not None:
            return self._record(op, nbytes, tokens, locality, everything, explore.option, "explore",
                                f"no real {op} over it in {policy.explore_after_s:g} s (predicted "
                                f"{_ms(explore.predicted_s)}; the best, {best.option}, {_ms(best.predicted_s)})",
                                policy, slo, free_bytes, explore=True)
        by_name = {c.option: c for c in cands}
        state = tuple(sorted(paths.items()))
        choice, code, why = self._stable(op, nbytes, policy, by_name, best, state)
        # This client's own queue is this transfer's state, not a medium's: it is weighed after
        # hysteresis, and moves this transfer alone, when another option beats the wait by the margin.
        now_best = min(known, key=lambda c: c.predicted_s)  # type: ignore[arg-type, return-value]
        held = by_name[choice]
        if (now_best.option != choice and held.wait_s
                and now_best.predicted_s < held.predicted_s * (1.0 - policy.margin_frac)):  # type: ignore[operator]
            choice, code, why = now_best.option, "queue", (
                f"{held.option} has {sum(held.queued)} B in flight: {_ms(held.predicted_s)} with the wait, "
                f"{now_best.option} {_ms(now_best.predicted_s)} (this transfer only)")
        # Fetch or recompute is this request's question (its tokens, the caller's prefill rate),
        # not a medium's state, so no hysteresis: recompute wins when it beats the fetch that would run.
        fetch = by_name[choice]
        if recompute is not None and recompute.predicted_s < fetch.predicted_s:  # type: ignore[operator]
            if now_best.predicted_s < recompute.predicted_s:  # type: ignore[operator]
                # Recompute beats what hysteresis holds, the best fetch beats recompute: that fetch,
                # for this transfer only (the challenger's window runs on).
                choice, code, why = now_best.option, "beats-recompute", (
                    f"{_ms(now_best.predicted_s)} beats recomputing {tokens} tokens "
                    f"({_ms(recompute.predicted_s)}), which beats the held {fetch.option} "
                    f"({_ms(fetch.predicted_s)}): this transfer only")
            else:
                choice, code, why = RECOMPUTE, "recompute", (
                    f"recompute {tokens} tokens predicted {_ms(recompute.predicted_s)}, "
                    f"fetching over {fetch.option} {_ms(fetch.predicted_s)}")
        return self._record(op, nbytes, tokens, locality, everything, choice, code, why, policy, slo, free_bytes)

    def _to_explore(self, op: str, nbytes: int, policy: Policy, cands: list[Candidate],
                    best: Candidate, recompute: Candidate | None) -> Candidate | None:
        """An option with no real transfer of this size class learnt in ``explore_after_s`` gets
        a burst of them (``BURST_MAX``).

        A burst starts only when the option is predicted within 4x of the best
        way to get the KV, recompute included (a medium far behind is not worth
        real transfers), and when the class's exploration budget covers one
        transfer of it (``EXPLORE_SHARE``). Once started, it goes on unless the option is then over
        16x: a first transfer of a size is often several times slower (a first
        8 MiB int8 get measured 12x its later ones), and one cold sample must not
        stand as the option's estimate until the next interval.
        """
        ref = best.alone_s
        if ref is None:
            return None
        if recompute is not None and recompute.predicted_s is not None:
            ref = min(ref, recompute.predicted_s)
        now = self.clock()
        # The best fetch runs (held, or for single transfers that beat recompute), and so measures
        # itself; not while recompute wins, though.
        fetch_runs = recompute is None or recompute.predicted_s is None or recompute.predicted_s >= best.alone_s
        for c in cands:
            if not c.feasible or c.why or c.predicted_s is None or (fetch_runs and c.option == best.option):
                continue
            if self.model.age_s(op, c.option, nbytes=nbytes, path=c.path) < policy.explore_after_s:
                continue
            key = (op, f"{c.option}@{c.path}", size_class(nbytes))
            with self._lock:  # at most BURST_MAX tries per option, class and interval, failed or not
                tries = [t for t in self._explored.get(key, []) if now - t < policy.explore_after_s]
                within = EXPLORE_WITHIN * (EXPLORE_WITHIN if tries else 1.0) * ref
                if len(tries) >= BURST_MAX or c.alone_s > within:  # type: ignore[operator]
                    continue
                if not tries and self._budget.get((op, key[2]), 0.0) < c.alone_s:  # type: ignore[operator]
                    continue  # a new burst waits until exploiting has paid for a transfer of it
                self._explored[key] = tries + [now]
            return c
        return None

    def _candidate(self, op: str, option: Option, nbytes: int, slo: float | None,
                   free_bytes: int | None, queued: tuple[int, ...] = (), path: str = "") -> Candidate:
        predicted = self.model.predict(op, option, nbytes, queued, path)
        cand = Candidate(option.name, predicted, queued=queued, path=path,
                         learnt=self.model.learnt(op, option.name, path))
        if queued and predicted is not None:
            alone = self.model.predict(op, option, nbytes, path=path)
            cand.wait_s = max(0.0, predicted - (alone or 0.0))
        if free_bytes is not None and nbytes > free_bytes:
            cand.feasible, cand.why = False, f"needs {nbytes} B of buffer, receiver has {free_bytes}"
        elif slo is not None and predicted is not None and predicted > slo:
            cand.why = f"predicted {predicted * 1e3:.2f} ms is over the SLO of {slo * 1e3:.2f} ms"
        return cand

    def _stable(self, op: str, nbytes: int, policy: Policy, by_name: dict[str, Candidate],
                best: Candidate, state: tuple = ()) -> tuple[str, str, str]:
        """Hysteresis: keep the current choice unless ``best`` has been best for the window,
        beating it by the margin when the window started and now. Returns (choice, reason
        code, why): the why explains the choice, whichever option it is."""
        best_s = best.alone_s
        key = (policy.version, op, size_class(nbytes), state)
        now = self.clock()
        with self._lock:
            st = self._sticky.get(key)
            if st is not None and st.provisional:
                st.provisional = self._unproven(op, by_name.get(st.current), nbytes)
            cur = by_name.get(st.current) if st else None
            cur_s = None if cur is None or not cur.feasible else cur.alone_s
            if st is None or cur_s is None:
                self._sticky[key] = _Sticky(best.option, provisional=self._unproven(op, best, nbytes))
                if st is None:
                    return best.option, "best", f"lowest predicted time ({_ms(best_s)})"
                return best.option, "replaced", (f"the current choice, {st.current}, is unavailable; "
                                                 f"lowest predicted time ({_ms(best_s)})")
            if best.option == st.current:
                st.challenger = None
                return st.current, "best", f"lowest predicted time ({_ms(best_s)})"
            if best_s > cur_s * (1.0 - policy.margin_frac):  # type: ignore[operator]
                # A challenger that stays the predicted best keeps its window while noise dips it
                # under the margin (sub-millisecond estimates jitter by about that much), for at
                # most a window; another option becoming best, or the current one again, starts over.
                if st.challenger != best.option:
                    st.challenger = None
                elif st.under_since_s is None:
                    st.under_since_s = now
                elif now - st.under_since_s > policy.window_s:
                    st.challenger, st.under_since_s = None, None
                return st.current, "kept", (f"{best.option} ({_ms(best_s)}) is predicted faster than it "
                                            f"({_ms(cur_s)}), by less than the {policy.margin_frac:.0%} margin")
            if st.under_since_s is not None and now - st.under_since_s > policy.window_s:
                st.challenger = None  # its window lapsed under the margin, however long ago the last look
            st.under_since_s = None
            if st.provisional and not self._unproven(op, best, nbytes):
                old = st.current
                self._sticky[key] = _Sticky(best.option)
                return best.option, "proven", (f"from {old}, chosen before any real transfer of this size: "
                                               f"{best.option} measured {_ms(best_s)} against {_ms(cur_s)}")
            if st.challenger != best.option:
                st.challenger, st.since_s = best.option, now
            held = now - st.since_s
            if held < policy.window_s:
                return st.current, "waiting", (
                    f"{best.option} ({_ms(best_s)}) has beaten it ({_ms(cur_s)}) by the margin for "
                    f"{held:.1f} of {policy.window_s:g} s; it takes over once that holds for the window")
            old = st.current
            self._sticky[key] = _Sticky(best.option)
            return best.option, "switched", (f"from {old}: predicted {_ms(best_s)} against {_ms(cur_s)} "
                                             f"for {held:.1f} s")

    def _unproven(self, op: str, cand: Candidate | None, nbytes: int) -> bool:
        return cand is not None and self.model.age_s(op, cand.option, nbytes=nbytes, path=cand.path) == math.inf

    def _record(self, op: str, nbytes: int, tokens: int, locality: str, cands: list[Candidate], choice: str,
                code: str, why: str, policy: Policy, slo: float | None, free_bytes: int | None, *,
                explore: bool = False) -> Decision:
        """The decision, logged; its reason is built here from the code and the choice
        (``reason_text``), so it cannot name another option first."""
        chosen = next((c for c in cands if c.option == choice), None)
        d = Decision(op, nbytes, tokens, locality, cands, choice, reason_text(code, choice, why), policy.version,
                     slo, free_bytes, None if chosen is None else chosen.predicted_s, explore=explore,
                     reason_code=code, path="" if chosen is None else chosen.path,
                     learnt=None if chosen is None or choice == RECOMPUTE else chosen.learnt)
        self.log.add(d)
        return d

    def finish(self, decision: Decision, policy: Policy, *, actual_s: float, actual_bytes: int,
               codec_s: float = 0.0, error: str | None = None) -> None:
        """Record what the chosen transfer cost, and learn from it.

        Args:
            actual_s: the whole transfer, codec work included.
            actual_bytes: raw KV bytes that moved.
            codec_s: of ``actual_s``, seconds spent encoding or decoding (not the link's).
            error: the failure, when the transfer failed (nothing is learnt from it).
        """
        option = decision.option
        decision.actual_s, decision.actual_bytes, decision.error = actual_s, actual_bytes, error
        key = (decision.op, size_class(decision.nbytes))
        if option is not None:
            with self._lock:
                earned = -actual_s if decision.explore else (0.0 if error else EXPLORE_SHARE * actual_s)
                self._budget[key] = self._budget.get(key, 0.0) + earned
        elif decision.predicted_s:
            # Recomputing pays for exploring too (its predicted time: the caller's, not measured
            # here): else a link that recovered would never be tried while recompute wins.
            with self._lock:
                self._budget[key] = self._budget.get(key, 0.0) + EXPLORE_SHARE * decision.predicted_s
        if option is not None and decision.explore and (error is not None or not actual_bytes):
            self.model.abandon_burst(decision.op, option.name, decision.nbytes, decision.path)
        if option is not None and error is None:
            queued = next((c.queued for c in decision.candidates if c.option == decision.choice), ())
            # What was predicted for this transfer, when it moved what was asked (a get may hit less).
            decision.predicted_actual_s = (
                decision.predicted_s if actual_bytes == decision.nbytes and decision.predicted_s is not None
                else self.model.predict(decision.op, option, actual_bytes, queued, decision.path))
            # What moved shared the link with what was queued: learnt as that many bytes' time.
            wire = shared_wire(wire_bytes(option, actual_bytes), queued)
            best_s = None
            if decision.explore:  # what the best option was predicted to take for the KV that moved
                preds = [c.predicted_s for c in decision.candidates if c.option != RECOMPUTE and c.predicted_s]
                best_s = min(preds, default=math.inf) * actual_bytes / max(decision.nbytes, 1)
            # A burst's tries are filed under the size asked for, as abandon_burst finds them (a
            # partial hit may move a smaller class's worth).
            self.model.observe(decision.op, option.name, wire, max(actual_s - codec_s, 1e-9), policy,
                               raw_bytes=decision.nbytes if decision.explore else actual_bytes, burst_best_s=best_s,
                               path=decision.path)
        self.log.finished(decision)

    def forget_choice(self, option: str) -> None:
        """Drop ``option`` as the current choice everywhere (its medium failed)."""
        with self._lock:
            for key in [k for k, st in self._sticky.items() if st.current == option]:
                del self._sticky[key]


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds * 1e3:.2f} ms"
