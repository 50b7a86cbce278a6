"""One vLLM engine (the CPU build), driven one JSON line a command: for tests and ``kvstore bench vllm``.

Runs under the vLLM venv's interpreter (``bench.engines``), never the project's::

    python bench/vllm_driver.py make-model DIR [--layers 4 --hidden 256 ...]
    python bench/vllm_driver.py serve --model DIR [--connector kvstore|example|none] [--kv-config JSON]

``make-model`` saves a random-initialised Llama with transformers' ``save_pretrained``
(no hub, no tokenizer): seeded, so every process that makes it gets the same weights.
docs/engines.md gives it to ``vllm serve --skip-tokenizer-init`` as a first model
(``PYTHONPATH=$PWD .venv-vllm/bin/python -m bench.vllm_driver make-model DIR``).
``serve`` starts ``LLM(...)`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
prints ``{"ok": true, "ready": ...}``, then answers each line on stdin::

    {"cmd": "generate", "prompts": [[ids...]], "max_tokens": 8}
        -> {"ok": true, "tokens": [[...]], "cached": [n], "seconds": s, "ttft_s": [..], "decode_tok_s": [..]}
    {"cmd": "reset_prefix_cache"}   {"cmd": "quit"}

Replies go to the original stdout; everything the engine prints goes to stderr, so a
log line never lands in the reply channel. The spawn start method vLLM's CPU platform
forces re-imports this file in children: everything runs under ``__main__``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def make_model(args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         max_position_embeddings=args.max_len, initializer_range=args.init_range,
                         torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.dir, safe_serialization=True)
    print(json.dumps({"ok": True, "dir": args.dir}))


def _kv_transfer(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    extra = json.loads(args.kv_config) if args.kv_config else {}
    if args.connector == "kvstore":
        return KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=extra)
    if args.connector == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    return None


def _stats(out: Any) -> tuple[float | None, float | None]:
    """TTFT and decode tokens/s of one request, from vLLM's own per-request timestamps."""
    m = getattr(out, "metrics", None)
    if m is None:
        return None, None
    first = getattr(m, "first_token_latency", None)
    n = getattr(m, "num_generation_tokens", 0) or len(out.outputs[0].token_ids)
    span = (getattr(m, "last_token_ts", 0) or 0) - (getattr(m, "first_token_ts", 0) or 0)
    return first, ((n - 1) / span if n > 1 and span > 0 else None)


def serve(args: argparse.Namespace) -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the engine's prints and logs go to stderr; replies alone on the original stdout
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype=args.dtype,
                                  max_model_len=args.max_model_len, seed=0, block_size=args.block_size,
                                  enable_prefix_caching=args.prefix_caching, disable_log_stats=False,
                                  max_num_batched_tokens=args.max_num_batched_tokens)
    transfer = _kv_transfer(args)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    if args.kv_events_endpoint:  # vLLM's own KV events, published on ZMQ as `vllm serve --kv-events-config` does
        from vllm.config import KVEventsConfig
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=args.kv_events_endpoint)
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # the caller sees why the engine refused to start
        reply.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    reply.write(json.dumps({"ok": True, "ready": True, "start_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "quit":
                break
            if cmd["cmd"] == "reset_prefix_cache":
                llm.reset_prefix_cache()
                answer: dict[str, Any] = {}
            elif cmd["cmd"] == "generate":
                params = SamplingParams(max_tokens=int(cmd.get("max_tokens", 8)), temperature=0.0, detokenize=False,
                                        ignore_eos=True)
                prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in cmd["prompts"]]
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - t
                stats = [_stats(o) for o in outs]
                answer = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                          "cached": [int(o.num_cached_tokens or 0) for o in outs], "seconds": seconds,
                          "ttft_s": [s[0] for s in stats], "decode_tok_s": [s[1] for s in stats]}
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
            reply.write(json.dumps({"ok": True, **answer}) + "\n")
        except Exception as exc:
            reply.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
    del llm


def main() -> None:
    parser = argparse.ArgumentParser(prog="vllm_driver")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("dir")
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--vocab", type=int, default=1024)
    m.add_argument("--max-len", type=int, default=8192)
    m.add_argument("--init-range", type=float, default=0.02)
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--connector", choices=("none", "kvstore", "example"), default="none")
    s.add_argument("--kv-config", default=None, help="kv_connector_extra_config as JSON")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--block-size", type=int, default=128)
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192)
    s.add_argument("--prefix-caching", action="store_true")
    s.add_argument("--kv-events-endpoint", default=None, help="publish vLLM's KV events on this ZMQ endpoint")
    args = parser.parse_args()
    (make_model if args.command == "make-model" else serve)(args)


if __name__ == "__main__":
    main()
