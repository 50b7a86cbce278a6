"""Time to first token with prefix reuse: a full prefill against ``get_kv`` and a prefill of the rest.

The model is ``bench.agents_model``'s seeded random Llama (8 layers, hidden 512,
2 KV heads; fp32 on the CPU), run with torch on every CPU both ways. For each prompt length the KV of the whole
prompt is put once; then samples alternate, A B C A B C:

- ``prefill``: a full prefill of the prompt, to the last position's logits;
- ``<medium>``: a fresh client (its medium picked, the arena mapped and its
  connection opened by a get of another sequence before the clock, as a running
  agent has them), ``get_kv`` of the prompt, a cache rebuilt
  from all but its last token, and a prefill of that one token
  (``bench.agents_model``'s ``ttft_with``).

A fresh client per sample keeps the SDK's handle cache from serving a second
get. Every reuse must give the same first token as the full prefill; the
largest logit difference is reported (about 1e-6: the KV comes back bit for bit,
and a one-token prefill rounds differently from the whole prompt's).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["measure"]


def measure(url: str, *, flight_port: int | None, prompts: tuple[int, ...], repeats: int,
            torch_threads: int | None = None, tick: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """TTFT rows for each prompt length, against a running server.

    Args:
        torch_threads: torch threads for the model, both ways (default: every CPU, as a
            serving engine would give its prefill).

    Returns:
        ``{"model": {...}, "rows": [{"tokens", "prefill_s": {...}, "media": {name: {...}}}]}``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(torch_threads or os.cpu_count() or 1)
    try:
        return _measure(url, flight_port, prompts, repeats, tick)
    finally:
        torch.set_num_threads(before)


def _measure(url: str, flight_port: int | None, prompts: tuple[int, ...], repeats: int,
             tick: Callable[[str], None]) -> dict[str, Any]:
    from bench.agents_model import DemoConfig, build_model, ttft_with
    from client_sdk import KVClient
    from kvstore.integrations.hf import kv_from_cache, out_cache, spec_for

    cfg = DemoConfig(context_tokens=max(prompts))
    model, digest = build_model(cfg)
    spec = spec_for(model, fingerprint=digest[:32], block_tokens=cfg.block_tokens, model_id="bench-ttft")
    media: dict[str, Callable[[], Any]] = {
        "colocated": lambda: KVClient(url, namespace="bench-ttft", plan=False),
        "http": lambda: KVClient(url, namespace="bench-ttft", colocated=False, plan=False),
    }
    if flight_port is not None:
        from client_sdk.flight import FlightMedium

        media["flight"] = lambda: FlightMedium(url, flight_port, namespace="bench-ttft")
    rows = []
    with torch.inference_mode(), KVClient(url, namespace="bench-ttft", colocated=False, plan=False) as putter:
        model(torch.zeros((1, 16), dtype=torch.long))  # first-call allocations weigh on no clock
        # Another sequence each fresh client gets before the clock: it picks its medium, maps
        # the arena and opens its connection there, as a running agent has them.
        warm = list(range(cfg.block_tokens))
        putter.put_kv(spec, warm, torch.zeros(spec.kv_shape(len(warm)), dtype=spec.torch_dtype))
        for n in prompts:
            prompt = torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=True)
            reference = out.logits[0, -1]
            kv = kv_from_cache(out_cache(out), spec)
            putter.put_kv(spec, prompt, kv)
            samples: dict[str, list[float]] = {"prefill": [], **{m: [] for m in media}}
            checks: dict[str, dict[str, Any]] = {m: {"first_token_match": True, "max_logit_diff": 0.0,
                                                     "hit_tokens": 0} for m in media}
            for r in range(repeats):
                t0 = time.perf_counter()
                model(ids)
                samples["prefill"].append(time.perf_counter() - t0)
                for name, make in media.items():
                    client = make()
                    try:
                        client.get_kv(spec, warm)
                        w = ttft_with(client, model, spec, prompt, ids)
                        if name == "colocated" and client.stats.last_medium != "shm":
                            raise AssertionError(f"the co-located client used {client.stats.last_medium}")
                    finally:
                        client.close()
                    samples[name].append(w["ttft_s"])
                    check = checks[name]
                    check["hit_tokens"] = w["hit"]
                    check["first_token_match"] &= int(w["logits"].argmax()) == int(reference.argmax())
                    check["max_logit_diff"] = max(check["max_logit_diff"],
                                                  float((w["logits"] - reference).abs().max()))
                tick(f"{n} tokens, round {r + 1}/{repeats}")
            putter.delete(spec, prompt)
            prefill = statistics.median(samples["prefill"])
            rows.append({
                "tokens": n, "kv_bytes": spec.bytes_per_token * n, "prefill_s": _stats(samples["prefill"]),
                "media": {m: {**_stats(samples[m]), **checks[m],
                              "speedup": prefill / statistics.median(samples[m])} for m in media},
            })
    return {"model": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                      "dtype": "float32", "torch_threads": torch.get_num_threads()},
            "repeats": repeats, "rows": rows}


def _stats(seconds: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}
