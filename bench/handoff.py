"""The hand-off row: agent A puts a fresh sequence, agent B, another process, gets it.

Agent A is the bench process: a synchronous co-located ``put_kv`` of fresh token ids.
Agent B is ``AgentB``, a child process with one long-lived co-located ``KVClient``
that gets the sequence into a reused ``out=`` tensor. B's client has never seen the
new blocks, so it remembers no slots for them: each get is a first get of its
sequence (it finds the slots in the arena's key index, with no request, and
copies frames the server verified, or hashes one it has not verified yet).

The clock runs from just before A's put to just after B's get returns. Both ends
read ``time.perf_counter``, which is ``CLOCK_MONOTONIC`` on Linux, one clock for
every process on the machine (``AgentB`` checks both report it). A tells B what to
get over B's stdin and B sends its end time back over its stdout. The first hop,
A's line and B waking to read it, is inside the clock, as it would be between two
real agents: a few microseconds at p50 on an idle two-core machine, tens to
thousands at p99 when the scheduler is busy (``AgentB.ping`` measures it). B's
answer is not: B reads the clock before it writes.

A failure in B surfaces: B answers ``error <message>`` and exits, or it dies, or
it stops answering, and A raises ``RuntimeError`` each way (a silent B is killed
after ``REPLY_TIMEOUT_S``).

Protocol, one line each way: ``get <first token id> <check 0|1>`` answered by
``ok <end perf_counter> <tokens> <digest or ->``; ``ping`` by ``ok <perf_counter>``
(what the signalling alone costs); ``quit`` ends B.

    python -m bench.handoff URL SPEC_JSON TOKENS NAMESPACE WARM_BASE     agent B (what ``AgentB`` spawns)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import time

import torch

from bench.serving import reply_line
from kvstore.spec import KVSpec

__all__ = ["AgentB", "digest", "CLOCK"]

CLOCK = "clock_gettime(CLOCK_MONOTONIC)"
"""What ``perf_counter`` must read in both processes for their times to compare."""
START_TIMEOUT_S = 180.0
"""B imports torch and the SDK and warms up; on a busy two-core machine, well within this."""
REPLY_TIMEOUT_S = 60.0
"""One get of at most tens of MiB: milliseconds; a B silent this long is hung."""


def digest(kv: torch.Tensor) -> str:
    """A hash of a tensor's bytes: B's copy and A's compare without sending megabytes back."""
    return hashlib.blake2b(kv.contiguous().view(torch.uint8).numpy(), digest_size=16).hexdigest()


class AgentB:
    """Agent B in a child process, started and warmed up; ``close`` ends it.

    Args:
        url: the server both agents use.
        spec, tokens: what each sequence is: its spec and its length.
        namespace: the namespace A puts in.
        warm_base: first token id of a stored sequence B gets a few times first (maps the
            arena, faults in ``out``), so the rows' first samples do not pay for that.

    Raises:
        RuntimeError: B did not start: it failed, exited or did not answer.
    """

    def __init__(self, url: str, spec: KVSpec, tokens: int, *, namespace: str, warm_base: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.handoff", url, json.dumps(spec.to_dict()),
                                      str(tokens), namespace, str(warm_base)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._failed = False
        try:
            [clock] = self._reply(START_TIMEOUT_S, "start")
            mine = time.get_clock_info("perf_counter").implementation
            if clock != CLOCK or mine != CLOCK:
                raise RuntimeError(f"perf_counter reads {mine} here and {clock} in agent B, not both {CLOCK}: "
                                   "their times would not compare")
        except BaseException:
            self.close()
            raise

    def get(self, first: int, *, check: bool = False) -> tuple[float, str | None]:
        """B gets the sequence of ids ``first, first + 1, ...``; its end time, and a digest if ``check``.

        Raises:
            RuntimeError: B failed (a miss counts: the sequence was just put), exited or hung.
        """
        self._send(f"get {first} {int(check)}", "get")
        end, _, hashed = self._reply(REPLY_TIMEOUT_S, "get")
        return float(end), (hashed if check else None)

    def ping(self) -> tuple[float, float]:
        """B's ``perf_counter`` when it read a ``ping``, and ours once its answer came back: the
        signalling a hand-off pays, one hop and the round trip, with no get between."""
        self._send("ping", "ping")
        [there] = self._reply(REPLY_TIMEOUT_S, "ping")
        return float(there), time.perf_counter()

    def _send(self, line: str, what: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError as exc:  # B is gone: say how it ended
            self._failed = True
            raise RuntimeError(f"agent B exited with {self.proc.wait()} before {what}") from exc

    def _reply(self, timeout_s: float, what: str) -> list[str]:
        try:
            line = reply_line(self.proc, timeout_s, f"agent B ({what})")  # kills a silent B
        except RuntimeError:
            self._failed = True
            raise
        word, _, rest = line.rstrip("\n").partition(" ")
        if word == "ok":
            return rest.split()
        self._failed = True
        if word == "error":
            raise RuntimeError(f"agent B ({what}): {rest}")
        raise RuntimeError(f"agent B exited with {self.proc.wait()} during {what}" if not line
                           else f"agent B ({what}) answered {line!r}")

    def close(self) -> None:
        """Ask B to quit and wait for it (killed after 30 s).

        Raises:
            RuntimeError: B exited with an error after ``quit`` (a failure before that has
                already been raised, and is not raised again).
        """
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):  # a B that already went has its own exit code
                self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        if self.proc.returncode != 0 and not self._failed:
            self._failed = True
            raise RuntimeError(f"agent B exited with {self.proc.returncode} on quit")


# -- agent B -----------------------------------------------------------------------------------


def _answer(*fields: object) -> None:
    print(*fields, flush=True)


def _serve(url: str, spec: KVSpec, tokens: int, namespace: str, warm_base: int) -> None:
    """Answer ``get`` and ``ping`` lines until ``quit`` or the end of stdin."""
    from client_sdk import KVClient

    torch.set_num_threads(1)  # as the bench process: one copy thread, no team to stall
    # zeros, not empty: its pages are faulted in now, not in the first hand-off
    out = torch.zeros(tokens * spec.bytes_per_token, dtype=torch.uint8)
    # colocated=True: a B that cannot map the arena fails here rather than measure HTTP
    with KVClient(url, namespace=namespace, colocated=True, plan=False) as client:
        for _ in range(3):
            if client.get_kv(spec, range(warm_base, warm_base + tokens), out=out)[1] != tokens:
                raise AssertionError(f"the warm-up sequence at {warm_base} is not stored")
        _answer("ok", time.get_clock_info("perf_counter").implementation)
        for line in sys.stdin:
            cmd, *args = line.split()
            if cmd == "quit":
                break
            if cmd == "ping":
                _answer("ok", repr(time.perf_counter()))
                continue
            first, check = int(args[0]), args[1] == "1"
            over_shm, copied = client.stats.shm_gets, client.stats.shm_frames_copied
            kv, n = client.get_kv(spec, range(first, first + tokens), out=out)
            end = time.perf_counter()
            if n != tokens:
                raise AssertionError(f"a get of the sequence at {first} returned {n} of {tokens} tokens")
            # A first get: found in the arena's key index (no request), never from slots B read before
            if client.stats.shm_frames_copied != copied or client.stats.shm_gets != over_shm + 1:
                raise AssertionError("a hand-off get was served from remembered slots, or not over shm")
            _answer("ok", repr(end), n, digest(kv) if check else "-")


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print("usage: python -m bench.handoff URL SPEC_JSON TOKENS NAMESPACE WARM_BASE", file=sys.stderr)
        return 2
    try:
        _serve(argv[0], KVSpec.from_dict(json.loads(argv[1])), int(argv[2]), argv[3], int(argv[4]))
    except BaseException as exc:  # noqa: BLE001 - A is waiting on a line: tell it, then fail
        with contextlib.suppress(OSError):
            _answer("error", f"{type(exc).__name__}: {exc}".replace("\n", " "))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
