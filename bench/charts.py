"""PNG charts of a ``kvstore bench all`` result: throughput by path and size, TTFT, scaling."""

from __future__ import annotations

from pathlib import Path

__all__ = ["draw"]

_COLORS = {"limit": "#9e9e9e", "kvstore": "#1f77b4", "peer": "#ff7f0e"}


def _kind(row: str) -> str:
    if row.startswith("limit"):
        return "limit"
    if row.startswith(("redis-py", "pickle", "lmcache")):
        return "peer"
    return "kvstore"


def draw(result: dict, out_dir: Path, stamp: str) -> list[Path]:
    """Write the charts as ``<out_dir>/<stamp>-<name>.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, fn in (("throughput", _throughput), ("ttft", _ttft), ("scale", _scale)):
        fig = fn(plt, result)
        path = out_dir / f"{stamp}-{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _throughput(plt, result: dict):
    sizes = result["sizes"]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 8.5), sharey=True, squeeze=False)
    names = []
    for s in sizes:
        names += [n for n in s["gbps"] if n not in names and not n.startswith("remote")]
    for ax, s in zip(axes[0], sizes):
        vals = [s["gbps"].get(n, {}).get("median", 0.0) for n in names]
        lo = [v - s["gbps"][n]["min"] if n in s["gbps"] else 0 for n, v in zip(names, vals)]
        hi = [s["gbps"][n]["max"] - v if n in s["gbps"] else 0 for n, v in zip(names, vals)]
        ax.barh(range(len(names)), vals, xerr=[lo, hi], color=[_COLORS[_kind(n)] for n in names],
                error_kw={"elinewidth": 0.8, "capsize": 2})
        ax.set_xscale("log")
        ax.set_title(s["size"])
        ax.set_xlabel("GB/s (median, min-max)")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(names)), names)
    axes[0][0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    fig.legend(handles, ["physical limit", "kvstore", "what users would use instead"], loc="lower center",
               ncol=3, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("Throughput by path and size (one run, interleaved samples)")
    return fig


def _ttft(plt, result: dict):
    rows = result["ttft"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["prefill_s"]["median_s"] for r in rows], "o-", color="black", label="prefill from scratch")
    for medium in rows[0]["media"] if rows else ():
        ax.plot(tokens, [r["media"][medium]["median_s"] for r in rows], "o-", label=f"get_kv via {medium}, then 1 token")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, s (median)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    m = result["ttft"]["model"]
    ax.set_title(f"TTFT with prefix reuse: random Llama, {m['layers']} layers, hidden {m['hidden']}, CPU")
    return fig


def _scale(plt, result: dict):
    rows = result["scale"]["rows"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, medium in enumerate(dict.fromkeys(r["medium"] for r in rows)):
        mine = [r for r in rows if r["medium"] == medium]
        n, color = [r["clients"] for r in mine], f"C{i}"
        a.plot(n, [r["gbps"] for r in mine], "o-", color=color, label=medium)
        b.plot(n, [r["p50_ms"] for r in mine], "o--", color=color, label=f"{medium} p50")
        b.plot(n, [r["p99_ms"] for r in mine], "o-", color=color, label=f"{medium} p99")
    size = result["scale"]["bytes"] / (1 << 20)
    a.set(xlabel="client processes", ylabel="GB/s, all clients", title=f"get_kv throughput ({size:g} MiB each)",
          yscale="log")
    b.set(xlabel="client processes", ylabel="ms", title="get_kv latency", yscale="log")
    mem = result["memory"]["rows"]
    gib = [r["stored_bytes"] / (1 << 30) for r in mem]
    c.plot(gib, [r["vmrss"] / (1 << 20) for r in mem], "o-", label="VmRSS")
    c.plot(gib, [r["overhead_bytes"] / (1 << 20) for r in mem], "o-", label="RSS less shm pages (heap)")
    c.set(xlabel="GiB stored", ylabel="MiB", title="server resident set")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["clients"] for r in rows}), [str(x) for x in sorted({r["clients"] for r in rows})])
    return fig
