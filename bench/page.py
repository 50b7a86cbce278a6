"""A ``kvstore bench all`` result as markdown tables, for the terminal and for ``docs/benchmarks.md``.

``render`` replaces what lies between the page's ``<!-- bench:results -->``
and ``<!-- /bench:results -->`` markers and copies the charts next to the page
(``<page dir>/benchmarks/*.png``), so the hand-written method around the
results stays as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.report import latency_table
from bench.rows import LATENCY_ROWS, LIMIT_OF, PEER_OF

__all__ = ["tables", "render", "replace_section"]

START, END = "<!-- bench:results -->", "<!-- /bench:results -->"


def _bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"


def _g(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def _size_table(s: dict) -> list[str]:
    lines = [f"**{s['size']}**", "", "| row | GB/s median (min–max) | / its limit | / peers |", "|---|---|---|---|"]
    ratios = s["ratios"]
    for name, g in s["gbps"].items():
        if name.startswith("remote"):
            continue
        limit = LIMIT_OF.get(name)
        to_limit = ""
        if f"{name} / {limit}" in ratios:
            ratio = ratios[f"{name} / {limit}"]
            # past its limit by more than noise: the limit is the plain pattern, the path a better
            # one (O_DIRECT writes), or both ran from cache (small sizes)
            to_limit = f"{ratio:.2f}x {limit.removeprefix('limit ')}" + (" (beats it)" if ratio > 1.1 else "")
        if name == "colocated get" and "colocated get / limit shm out" in ratios:
            to_limit += f"; {ratios['colocated get / limit shm out']:.2f}x shm out"
        to_peers = "; ".join(f"{ratios[f'{name} / {p}']:.2f}x {p}" for p in PEER_OF.get(name, ())
                             if f"{name} / {p}" in ratios)
        lines.append(f"| {name} | {_g(g)} | {to_limit} | {to_peers} |")
    return lines + [""]


def _copy_threads(machine: dict) -> str:
    n = machine.get("copy_threads")  # runs before stop 49 did not record it: one thread
    return "" if n is None else f", {n} copy thread{'s' if n != 1 else ''} (kvstore.memory.halves)"


def tables(result: dict) -> str:
    """Every section of ``result`` as markdown."""
    m = result["machine"]
    lines = [f"Run {result['when']}{' (--quick)' if result['quick'] else ''}, {result['elapsed_s']:.0f} s: "
             f"{m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, Python {m['python']}, torch {m['torch']}"
             f"{_copy_threads(m)}. {result['repeats']} samples a row.", ""]
    lines += ["### Targets (same-run ratios)", "", "| figure | size | value | target | met |", "|---|---|---|---|---|"]
    for t in result["targets"]:
        rows = t.get("rows")
        name = f"{t['name']} ({rows[0]} / {rows[1]})" if rows else t["name"]
        if t["value"] is None:
            lines.append(f"| {name} | {t['size']} | not run | ≥ {t['target']}x | - |")
        else:
            lines.append(f"| {name} | {t['size']} | {t['value']:.2f}x | ≥ {t['target']}x | "
                         f"{'yes' if t['met'] else '**no**'} |")
    lines += ["", "### Throughput by path and size", ""]
    for s in result["sizes"]:
        lines += _size_table(s)
    lines += latency_table(result["sizes"], LATENCY_ROWS, LIMIT_OF)
    t = result["ttft"]
    media = list(t["rows"][0]["media"]) if t["rows"] else []
    lines += ["### TTFT with prefix reuse", "",
              "| prompt tokens | KV | prefill s | " + " | ".join(f"{x} TTFT ms (speed-up)" for x in media) + " |",
              "|---" * (3 + len(media)) + "|"]
    for r in t["rows"]:
        cells = [f"{1e3 * r['media'][x]['median_s']:.1f} ({r['media'][x]['speedup']:.0f}x)"
                 + ("" if r["media"][x]["first_token_match"] else " first token differs") for x in media]
        lines.append(f"| {r['tokens']} | {_bytes(r['kv_bytes'])} | {r['prefill_s']['median_s']:.3f} | "
                     + " | ".join(cells) + " |")
    sc = result["scale"]
    lines += ["", f"### Scale: get_kv of {_bytes(sc['bytes'])} from concurrent client processes "
                  f"({sc['duration_s']:.0f} s window)", "",
              "| medium | clients | GB/s (all) | gets/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    for r in sc["rows"]:
        lines.append(f"| {r['medium']} | {r['clients']} | {r['gbps']:.2f} | {r['gets_per_s']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    lines += ["", "### Server memory", "", "| stored | VmRSS | of it shm pages | anonymous | file |",
              "|---|---|---|---|---|"]
    for r in result["memory"]["rows"]:
        lines.append(f"| {_bytes(r['stored_bytes'])} | {r['vmrss'] / (1 << 20):.0f} MiB | "
                     f"{r.get('rssshmem', 0) / (1 << 20):.0f} MiB | {r.get('rssanon', 0) / (1 << 20):.0f} MiB | "
                     f"{r.get('rssfile', 0) / (1 << 20):.0f} MiB |")
    if result["notes"]:
        lines += ["", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines)


def render(result: dict, page: Path) -> None:
    """Put ``result``'s tables and charts into ``page`` between its markers.

    Raises:
        ValueError: the page lacks the markers.
    """
    if START not in page.read_text() or END not in page.read_text():
        raise ValueError(f"{page} has no {START} ... {END} section to fill")
    img_dir = page.parent / "benchmarks"
    img_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for chart in result.get("charts", []):
        name = Path(chart).name.split("-")[-1]  # <stamp>-throughput.png -> throughput.png
        shutil.copyfile(chart, img_dir / name)
        images.append(f"![{name.removesuffix('.png')}](benchmarks/{name})")
    replace_section(page, f"{tables(result)}\n\n" + "\n\n".join(images))


def replace_section(page: Path, body: str, name: str = "results") -> None:
    """Put ``body`` between ``page``'s ``<!-- bench:<name> -->`` markers, keeping the rest.

    Raises:
        ValueError: the page lacks the markers.
    """
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = page.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{page} has no {start} ... {end} section to fill")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    page.write_text(f"{head}{start}\n\n{body}\n\n{end}{tail}")
