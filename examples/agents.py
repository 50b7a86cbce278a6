"""Three LLM agents in three processes share one long context through kvstore.

The scenario: a planner, a coder and a reviewer work on the same task. Each
prompt starts with the same long shared context (a system prompt plus the
task, ~1.5k tokens) and ends with tens of tokens of the agent's own role
text. Without a KV store every agent prefills the whole context again; with
kvstore the first agent puts the KV of its prompt, and the next ones fetch the
shared context's KV (over shared memory on this host), rebuild their
transformers cache from it and prefill only their own role text.

Each agent is a separate Python process running the same seeded, randomly
initialised ``LlamaForCausalLM`` on the CPU (no download needed). The script
starts a private ``kvstore serve``, runs the agents one after another,
prints each agent's time to first token with and without the store, checks
that both give the same first token, and writes a JSON and a PNG chart.

    python examples/agents.py [--quick] [--out DIR]

The same as ``kvstore demo agents``; needs transformers and matplotlib
(``pip install 'kvstore[hf]' matplotlib``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.agents import run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and context")
    parser.add_argument("--out", default="bench/results", help="where the JSON and PNG go")
    args = parser.parse_args()
    result = run(out_dir=args.out, quick=args.quick)
    later = result["agents"][1:]
    ok = all(a["first_token_match"] and a["hit_tokens"] > 0 for a in later)
    print("\nagents after the first reused the shared context: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
