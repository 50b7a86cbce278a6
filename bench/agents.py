"""``kvstore demo agents``: three agents in three processes share one long context through kvstore.

A planner, a coder and a reviewer run one after another, each in its own
process, each with the same seeded random Llama (``bench.agents_model``). Every
prompt is the same shared context (system prompt plus task, ~1.5k tokens) and
then tens of tokens of the agent's own role text. Each agent measures its TTFT
with a full prefill and again with ``get_kv`` plus a prefill of the rest, checks
that both give the same first token, and puts its prompt's KV. The planner
finds nothing; the coder and the reviewer find the shared context.

The hand-off scenario (``run(scenario="handoff")``, ``kvstore demo agents --handoff``) puts a
tool call between agents: while it runs, other tenants put three top tiers' worth of hot KV,
so the shared context sinks to disk. It runs three ways, each in its own namespace: nothing
done (the next agent reads the context from disk); a prefetch of the next agent's prompt when
it is handed the task (it starts once the prefix is back in shm); the context retained by the
agent that wrote it until the next one has read it. Its agents live across the variants (one
process each, ``bench.agents_model.AgentSession``, a turn per JSON line on stdin) and report
where their context was when they arrived, which medium served it and their TTFT.

The demo starts its own ``kvstore serve`` on a free loopback port with a temp
data dir and stops it at the end. Agents report to this process as JSON lines
on their stdout (``{"event": "step" | "result", ...}``); anything else they
print goes to stderr. The result is printed as a table and written as JSON and
a PNG bar chart to ``--out`` (default ``bench/results``).

    python -m bench.agents agent JOB_JSON            the agent entry point (what ``run`` spawns)

The hand-off scenario (``scenario="handoff"``) lives in ``bench.agents_handoff``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from bench.agents_model import ROLES, DemoConfig
from bench.agents_proc import AGENT_TIMEOUT_S, DemoFailed, child_env, json_lines, serving
from bench.report import header, publish

__all__ = ["DemoFailed", "DemoConfig", "run", "format_table"]

def _spawn_agent(job: dict[str, Any], workdir: Path, step: Callable[[str], None]) -> dict[str, Any]:
    """Run one agent process; pass its progress lines to ``step``; return its result.

    Raises:
        DemoFailed: it exited without a result, or ran past ``AGENT_TIMEOUT_S``.
    """
    err_path = workdir / f"agent-{job['role']}.err"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "bench.agents", "agent", json.dumps(job)], env=child_env(),
                                stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
    watchdog = threading.Timer(AGENT_TIMEOUT_S, proc.kill)
    watchdog.start()
    result = None
    try:
        assert proc.stdout is not None
        step(f"started (pid {proc.pid})")
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or "event" not in event:
                print(line, end="", file=sys.stderr)  # a stray print of a library, not ours
            elif event["event"] == "step":
                step(event["text"])
            elif event["event"] == "result":
                result = event["result"]
        code = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0 or result is None:
        raise DemoFailed(f"agent {job['role']} exited with {code}:\n{err_path.read_text(errors='replace')[-3000:]}")
    return result


def run(*, out_dir: str | Path | None = "bench/results", context_tokens: int | None = None, quick: bool = False,
        config: DemoConfig | None = None, namespace: str = "agents", scenario: str = "agents") -> dict[str, Any]:
    """Run the three agents against a private server; print progress and a table; write JSON and a PNG.

    Args:
        out_dir: where ``agents-<time>.json`` and ``.png`` go (``agents-handoff-<time>.*`` for
            the hand-off scenario).
        context_tokens: shared context length; default the config's (1,536; 768 with ``quick``).
        quick: a smaller model and context (a smoke run).
        config: the whole model and prompt setup; overrides ``quick``.
        scenario: ``"agents"``, each agent in turn, right after the one before; ``"handoff"``,
            a tool-call pause between agents while other tenants churn the top tier, run three
            ways (``bench.agents_handoff.HANDOFF_VARIANTS``: nothing done, a prefetch at the hand-off, the context
            retained across the pause).

    Returns:
        The result (as written to the JSON) with ``path`` and ``plot`` added; ``agents`` holds
        one dict per agent (see ``bench.agents_model.run_agent``); for ``"handoff"``, ``agents``
        describes each agent process and ``turns`` holds one dict per agent and variant (see
        ``bench.agents_model.AgentSession.turn``), with the pause before it (``handoff``).

    Raises:
        DemoFailed: transformers is missing, the server did not start, or an agent failed.
        ValueError: an inconsistent config or context length, or an unknown scenario.
    """
    if scenario not in ("agents", "handoff"):
        raise ValueError(f"scenario must be 'agents' or 'handoff', got {scenario!r}")
    if importlib.util.find_spec("transformers") is None:
        raise DemoFailed("the agents demo needs transformers: pip install 'kvstore[hf]'")
    cfg = config or (DemoConfig.quick() if quick else DemoConfig())
    if context_tokens is not None:
        cfg = DemoConfig.from_dict({**asdict(cfg), "context_tokens": context_tokens})
    start = time.perf_counter()
    if scenario == "handoff":
        from bench.agents_handoff import run_handoff  # its own module: three variants, churn, pauses

        return run_handoff(cfg, out_dir, namespace, start)
    print(f"kvstore demo agents: {len(ROLES)} agents, each in its own process, share a {cfg.context_tokens}-token "
          f"context\n  model: random Llama, {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads "
          f"({cfg.kv_heads} KV), vocab {cfg.vocab}; torch {cfg.torch_threads} threads per agent", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-agents-"))
    agents = []
    try:
        with serving(workdir) as url:
            print(f"[server] kvstore serve at {url} ready in {time.perf_counter() - start:.1f} s", flush=True)
            for i, (role, role_tokens) in enumerate(ROLES, 1):
                def step(text: str, i: int = i, role: str = role) -> None:
                    print(f"[{i}/{len(ROLES)}] {role}: {text}", flush=True)

                job = {"config": asdict(cfg), "role": role, "role_tokens": role_tokens, "url": url,
                       "namespace": namespace}
                agents.append(_spawn_agent(job, workdir, step))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = header("agents", config=asdict(cfg), agents=agents,
                    wall_s=round(time.perf_counter() - start, 1), unit="seconds; speed-up = TTFT without / with")
    result["machine"]["cpus"] = os.cpu_count()
    path = publish(result, format_table, out_dir)
    result["plot"] = str(_plot(result, path.with_suffix(".png")))
    print(f"wrote {result['plot']}")
    return result


def format_table(result: dict) -> str:
    """One row per agent: tokens, medium, both TTFTs, speed-up, first-token check; then the wall time."""
    head = (f"{'agent':10}{'prompt':>7}{'hit':>7}  {'medium':10}{'TTFT without':>13}{'TTFT with':>11}"
            f"{'speed-up':>10}  first token")
    lines = ["", head, "-" * len(head)]
    for a in result["agents"]:
        same = "same" if a["first_token_match"] else "DIFFERENT"
        lines.append(f"{a['role']:10}{a['prompt_tokens']:7d}{a['hit_tokens']:7d}  {str(a['medium']):10}"
                     f"{a['ttft_without_s']:11.3f} s{a['ttft_with_s']:9.3f} s{a['speedup']:9.1f}x  "
                     f"{a['first_token_with']} ({same})")
    lines.append(f"\nwall time {result['wall_s']} s (server, {len(result['agents'])} agent processes, model builds)")
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> Path:
    """TTFT without and with the store per agent, as grouped bars labelled with the speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = result["agents"]
    xs = range(len(agents))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - 0.2 for x in xs], [a["ttft_without_s"] for a in agents], 0.4, label="full prefill (no store)")
    bars = ax.bar([x + 0.2 for x in xs], [a["ttft_with_s"] for a in agents], 0.4, label="get_kv + rest (kvstore)")
    for bar, a in zip(bars, agents):
        ax.annotate(f"{a['speedup']:.1f}x\n{a['hit_tokens']} hit", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{a['role']}\n({a['prompt_tokens']} tokens)" for a in agents])
    ax.set_ylabel("time to first token, s")
    ax.margins(y=0.2)  # room for the labels above the tallest bar
    cfg = result["config"]
    ax.set_title(f"kvstore demo agents: {cfg['context_tokens']}-token shared context, "
                 f"{cfg['layers']}-layer random Llama on the CPU", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _agent_main(job_json: str) -> int:
    """The agent process: run ``run_agent`` and report on stdout as JSON lines."""
    from bench.agents_model import run_agent

    job = json.loads(job_json)
    emit = json_lines()
    result = run_agent(DemoConfig.from_dict(job["config"]), job["role"], job["role_tokens"], job["url"],
                       job["namespace"], lambda text: emit({"event": "step", "text": text}))
    emit({"event": "result", "result": result})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "agent":
        sys.exit("usage: python -m bench.agents agent JOB_JSON")
    sys.exit(_agent_main(sys.argv[2]))
