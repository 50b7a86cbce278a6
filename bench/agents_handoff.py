"""``kvstore demo agents --handoff``: planner, coder and reviewer hand one context over, with
tool-call pauses between them while other tenants churn the top tier.

Three agent processes (``bench.agents_model.AgentSession``) stay alive across three variants,
each in its own namespace: nothing done across the pause; a prefetch of the next agent's
prompt when it is handed the task; the producer's prompt retained until the next agent has
read it. Each turn reports where the context was when the agent arrived, its fetch time and
its TTFT, and checks the first token against a full prefill.

    python -m bench.agents_handoff agent JOB_JSON    a hand-off agent (turns as JSON lines on stdin)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from bench.agents_proc import AGENT_TIMEOUT_S, DemoFailed, child_env, json_lines, serving
from bench.agents_model import ROLES, DemoConfig, prompt_tokens
from bench.report import header, publish
from kvstore.spec import KVSpec

__all__ = ["HANDOFF_VARIANTS", "run_handoff", "format_handoff_table"]

HANDOFF_VARIANTS = ("none", "prefetch", "retain")
"""Across each tool-call pause: nothing; a prefetch of the next agent's prompt when it is handed
the task; the producing agent's prompt retained (``retain``) until the next one has read it."""
RETAIN_S = 120.0
"""The retention an agent asks for across the pause (the pause takes seconds; the next agent
releases it once it has read the context)."""
PREFETCH_WAIT_S = 10.0
"""The next agent starts once its prefix is in the top tier, or after this (then it reads what is where)."""
CHURN_TIMES = 3.0
"""Other tenants put this many top tiers' worth of KV in each pause."""
TOOL_CALL_S = 2.0
"""Each pause lasts this long, the churn spread over it: placement moves blocks in rounds
(every 0.25 s), so churn crammed into a fraction of a second could leave the context up."""


class _AgentProcess:
    """A hand-off agent (``bench.agents_model.AgentSession``) in its own process: a JSON line per
    turn on its stdin; its progress and answers as JSON lines on its stdout.

    Raises:
        DemoFailed: it exited, or did not answer within ``AGENT_TIMEOUT_S``.
    """

    def __init__(self, job: dict[str, Any], workdir: Path, step: Callable[[str], None]) -> None:
        self.role = job["role"]
        self._err_path = workdir / f"agent-{self.role}.err"
        with open(self._err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.agents_handoff", "agent", json.dumps(job)],
                                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True, bufsize=1)
        self._events: queue.Queue[dict | None] = queue.Queue()
        self._step = step
        threading.Thread(target=self._read, name=f"agent-{self.role}", daemon=True).start()
        step(f"started (pid {self.proc.pid})")
        self.info: dict[str, Any] = self._wait("ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "event" in event:
                self._events.put(event)
            else:
                print(line, end="", file=sys.stderr)  # a stray print of a library, not ours
        self._events.put(None)

    def _wait(self, kind: str) -> Any:
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                event = None
            if event is None:
                self.close()
                raise DemoFailed(f"agent {self.role} exited with {self.proc.returncode} (or hung):\n"
                                 f"{self._err_path.read_text(errors='replace')[-3000:]}")
            if event["event"] == "step":
                self._step(event["text"])
            elif event["event"] == kind:
                return event[kind]

    def turn(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._wait("result")

    def close(self) -> None:
        """End of input (the agent exits), then wait; killed if it does not."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Churn:
    """Other tenants' traffic in a tool-call pause: fresh 1 MiB puts, each followed by reads of
    it and of two recent ones (a busy neighbour's working set is hot, and so it takes the top
    tier), ``CHURN_TIMES`` top tiers' worth per pause, spread over ``TOOL_CALL_S``. Puts older
    than two top tiers' worth are deleted (those sessions ended), so the disk tier keeps the
    agents' contexts, not every byte of churn: the context sinks; it is not evicted."""

    SPEC = KVSpec(model_id="demo-other-tenants", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                  block_tokens=64, fingerprint="other-tenants-1")
    PUT_TOKENS = 512
    """1 MiB of KV per put (2 KiB per token)."""

    def __init__(self, url: str, top_bytes: int) -> None:
        self.url = url
        from client_sdk import KVClient

        self.client = KVClient(url, namespace="other-tenants", agent="other-tenants", plan=False)
        self.kv = torch.zeros(self.SPEC.kv_shape(self.PUT_TOKENS), dtype=torch.float16)
        self.put_bytes = self.SPEC.bytes_per_token * self.PUT_TOKENS
        self.puts = math.ceil(CHURN_TIMES * top_bytes / self.put_bytes)
        self.window = math.ceil(2 * top_bytes / self.put_bytes)
        self.live: deque[list[int]] = deque()
        self.next_id = 0

    def pause(self) -> dict[str, Any]:
        """One tool call's worth of churn; returns its bytes and time."""
        t0 = time.perf_counter()
        for k in range(self.puts):
            time.sleep(max(0.0, t0 + k * TOOL_CALL_S / self.puts - time.perf_counter()))
            tokens = list(range(self.next_id, self.next_id + self.PUT_TOKENS))
            self.next_id += self.PUT_TOKENS
            self.client.put_kv(self.SPEC, tokens, self.kv)
            self.live.append(tokens)
            for back in (1, 4, 8):
                if len(self.live) >= back:
                    self.client.get_kv(self.SPEC, self.live[-back])
            while len(self.live) > self.window:
                self.client.delete(self.SPEC, self.live.popleft())
        return {"churn_bytes": self.puts * self.put_bytes, "pause_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.client.close()


def _prefetch(client: Any, url: str, spec: KVSpec, prompt: list[int], top: str) -> dict[str, Any]:
    """Prefetch ``prompt``'s stored prefix; wait until every block is in ``top`` (or ``PREFETCH_WAIT_S``)."""
    t0 = time.perf_counter()
    n = client.prefetch(spec, prompt)
    blocks = n // spec.block_tokens
    while True:
        found = client.lookup_blocks(spec, prompt)["blocks"][:blocks]
        done = all(b["tier"] == top for b in found)
        if done or time.perf_counter() - t0 > PREFETCH_WAIT_S:
            break
        time.sleep(0.005)
    out = {"prefetch_tokens": n, "prefetch_s": time.perf_counter() - t0, "prefetch_complete": done,
           "prefetch_at": t0}
    if not done:  # say why: the server's record of this prefetch (moves made, refused and their reasons)
        with urllib.request.urlopen(f"{url}/admin/prefetches?limit=3", timeout=30) as r:
            out["prefetch_record"] = json.loads(r.read())
        out["blocks_not_in_top"] = [b for b in found if b["tier"] != top]
    return out


def _handoff_env(cfg: DemoConfig) -> tuple[dict[str, str], int]:
    """The server for the hand-off scenario, and its top tier's bytes.

    The top tier holds six shared contexts: small, so churn sinks one fast, and large enough
    that a context fits the quarter of it a prefetch may hold. The disk tier keeps raw frames
    (its default is int8), so that every variant reads the very KV that was put and the first
    tokens compare exactly. The retention quota holds two prompts.
    """
    kv_per_token = 2 * cfg.layers * cfg.kv_heads * (cfg.hidden // cfg.heads) * 4  # fp32 K and V
    prompt_bytes = (cfg.context_tokens + max(n for _, n in ROLES)) * kv_per_token
    top = max(8, math.ceil(6 * cfg.context_tokens * kv_per_token / 2**20)) << 20
    return {"KVSTORE_TIERS": "shm,nvme", "KVSTORE_SHM_BYTES": str(top), "KVSTORE_NVME_BYTES": "1GiB",
            "KVSTORE_TIER_CODECS": "nvme=raw", "KVSTORE_RETAIN_QUOTA_BYTES": str(2 * prompt_bytes)}, top


def _handoff_variant(variant: str, agents: list[_AgentProcess], orchestrator: Any, churn: _Churn, spec: KVSpec,
                     cfg: DemoConfig) -> list[dict[str, Any]]:
    """The three agents' turns in one variant, a tool-call pause (and the variant's act) between them."""
    top = orchestrator.admin.tiers()[0]["name"]
    turns = []
    for i, ((role, role_tokens), agent) in enumerate(zip(ROLES, agents)):
        handoff = None
        if i:  # the tool call between two agents
            handoff = churn.pause()
            if variant == "prefetch":
                handoff.update(_prefetch(orchestrator, churn.url, spec, prompt_tokens(cfg, role, role_tokens), top))
        retain = variant == "retain"
        turn = agent.turn(namespace=orchestrator.namespace, release=retain and i > 0,
                          retain_s=RETAIN_S if retain and i < len(agents) - 1 else None)
        turn.update(variant=variant, handoff=handoff)
        if handoff and "prefetch_at" in handoff:
            turn["prefetch_lead_s"] = turn["get_at"] - handoff.pop("prefetch_at")
        where = ", ".join(f"{n} in {t}" for t, n in turn["tiers_at_arrival"].items()) or "nothing stored"
        print(f"[{variant}] {role}: {where}; TTFT {turn['ttft_with_s']:.3f} s (fetch {1e3 * turn['get_s']:.1f} ms, "
              f"{turn['blocks_over_http']} blocks over http), without store {turn['ttft_without_s']:.3f} s", flush=True)
        turns.append(turn)
    return turns


def run_handoff(cfg: DemoConfig, out_dir: str | Path | None, namespace: str, start: float) -> dict[str, Any]:
    """The hand-off scenario (``run(scenario="handoff")``)."""
    from client_sdk import KVClient

    env, top_bytes = _handoff_env(cfg)
    print(f"kvstore demo agents --handoff: planner -> coder -> reviewer over a {cfg.context_tokens}-token context, "
          f"a tool-call pause between agents while other tenants put {CHURN_TIMES:g}x the {top_bytes >> 20} MiB "
          f"top tier; variants: {', '.join(HANDOFF_VARIANTS)}\n  model: random Llama, {cfg.layers} layers, "
          f"hidden {cfg.hidden}; torch {cfg.torch_threads} threads per agent", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-handoff-"))
    namespaces = {v: f"{namespace}-{v}" for v in HANDOFF_VARIANTS}
    turns: list[dict[str, Any]] = []
    try:
        with serving(workdir, env=env) as url, contextlib.ExitStack() as stack:
            print(f"[server] kvstore serve at {url} ready in {time.perf_counter() - start:.1f} s", flush=True)
            agents = []
            for i, (role, role_tokens) in enumerate(ROLES, 1):
                def step(text: str, i: int = i, role: str = role) -> None:
                    print(f"[{i}/{len(ROLES)}] {role}: {text}", flush=True)

                job = {"config": asdict(cfg), "role": role, "role_tokens": role_tokens, "url": url,
                       "namespaces": list(namespaces.values())}
                agents.append(_AgentProcess(job, workdir, step))
                stack.callback(agents[-1].close)
            spec = KVSpec.from_dict(agents[0].info["spec"])
            churn = _Churn(url, top_bytes)
            stack.callback(churn.close)
            for variant in HANDOFF_VARIANTS:
                orchestrator = stack.enter_context(KVClient(url, namespace=namespaces[variant], agent="orchestrator",
                                                            plan=False))
                turns += _handoff_variant(variant, agents, orchestrator, churn, spec, cfg)
            infos = [a.info for a in agents]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = header("agents-handoff", scenario="handoff", config=asdict(cfg), agents=infos,
                    variants=list(HANDOFF_VARIANTS), turns=turns, top_tier_bytes=top_bytes, churn_times=CHURN_TIMES,
                    retain_s=RETAIN_S, wall_s=round(time.perf_counter() - start, 1),
                    unit="seconds; speed-up = TTFT without / with")
    result["machine"]["cpus"] = os.cpu_count()
    path = publish(result, format_handoff_table, out_dir)
    result["plot"] = str(_plot_handoff(result, path.with_suffix(".png")))
    print(f"wrote {result['plot']}")
    return result


def format_handoff_table(result: dict) -> str:
    """One row per agent and variant: where its context was, the fetch, both TTFTs, the first token."""
    head = (f"{'agent':10}{'variant':10}{'context at arrival':22}{'fetch':>9}{'TTFT with':>11}{'TTFT without':>14}"
            f"{'speed-up':>10}  first token")
    lines = ["", head, "-" * len(head)]
    for role, _ in ROLES:
        for t in (t for t in result["turns"] if t["role"] == role):
            where = ", ".join(f"{t_} {n}" for t_, n in t["tiers_at_arrival"].items()) or "-"
            same = "same" if t["first_token_match"] else "DIFFERENT"
            lines.append(f"{role:10}{t['variant']:10}{where:22}{1e3 * t['get_s']:7.1f} ms{t['ttft_with_s']:9.3f} s"
                         f"{t['ttft_without_s']:12.3f} s{t['speedup']:9.1f}x  {t['first_token_with']} ({same})")
    pauses = [t["handoff"] for t in result["turns"] if t["handoff"]]
    prefetches = [p for p in pauses if "prefetch_s" in p]
    lines.append(f"\neach pause: other tenants put {pauses[0]['churn_bytes'] / 2**20:.0f} MiB "
                 f"({result['churn_times']:g}x the {result['top_tier_bytes'] >> 20} MiB top tier) in "
                 f"{min(p['pause_s'] for p in pauses):.1f}-{max(p['pause_s'] for p in pauses):.1f} s")
    if prefetches:
        lines.append("prefetch at hand-off: done in " + ", ".join(
            f"{1e3 * p['prefetch_s']:.0f} ms" + ("" if p["prefetch_complete"] else " (NOT all in the top tier)")
            for p in prefetches))
    lines.append(f"wall time {result['wall_s']} s (server, {len(result['agents'])} agent processes, "
                 f"{len(result['variants'])} variants)")
    return "\n".join(lines)


def _plot_handoff(result: dict, path: Path) -> Path:
    """TTFT per agent: without the store, then with it in each variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [r for r, _ in ROLES]
    width = 0.8 / (1 + len(result["variants"]))
    fig, ax = plt.subplots(figsize=(8, 4))
    without = {a["role"]: a["ttft_without_s"] for a in result["agents"]}
    ax.bar([x - 0.4 + width / 2 for x in range(len(roles))], [without[r] for r in roles], width, label="no store")
    for k, variant in enumerate(result["variants"], 1):
        by_role = {t["role"]: t["ttft_with_s"] for t in result["turns"] if t["variant"] == variant}
        ax.bar([x - 0.4 + width * (k + 0.5) for x in range(len(roles))], [by_role[r] for r in roles], width,
               label=f"kvstore, {variant}")
    ax.set_xticks(list(range(len(roles))), roles)
    ax.set_ylabel("time to first token, s")
    cfg = result["config"]
    ax.set_title(f"kvstore demo agents --handoff: {cfg['context_tokens']}-token context, tool-call pause with churn",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _handoff_agent_main(job_json: str) -> int:
    """A hand-off agent process: an ``AgentSession``, a turn per line of stdin, answers on stdout."""
    from bench.agents_model import AgentSession

    job = json.loads(job_json)
    emit = json_lines()
    session = AgentSession(DemoConfig.from_dict(job["config"]), job["role"], job["role_tokens"], job["url"],
                           job["namespaces"], lambda text: emit({"event": "step", "text": text}))
    emit({"event": "ready", "ready": session.describe()})
    try:
        for line in sys.stdin:  # the parent closes stdin when the scenario ends
            emit({"event": "result", "result": session.turn(**json.loads(line))})
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "agent":
        sys.exit("usage: python -m bench.agents_handoff agent JOB_JSON")
    sys.exit(_handoff_agent_main(sys.argv[2]))
