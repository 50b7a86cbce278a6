"""The ``kvstore`` command's client commands: stats, evict, pin, prefetch, retain, release, demo.

They talk to a server at ``--url`` (``KVSTORE_URL``, default ``http://127.0.0.1:8470``) with
``--token``; ``kvstore.cli`` (the command itself: serve and bench) takes their parsers and
handlers from here. The SDK is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

__all__ = ["client_parsers", "COMMANDS"]

_DEFAULT_URL = "http://127.0.0.1:8470"


def client_parsers(sub: Any) -> None:
    """The client commands' parsers, under ``sub`` (the ``kvstore`` command's subparsers)."""
    def client(name: str, help: str, token_env: str = "KVSTORE_ADMIN_TOKEN") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--url", default=os.environ.get("KVSTORE_URL", _DEFAULT_URL), help="server URL (KVSTORE_URL)")
        p.add_argument("--token", default=os.environ.get(token_env), help=f"bearer token ({token_env})")
        return p

    stats = client("stats", "a running server's store and tier stats")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")

    evict = client("evict", "evict blocks from a running server (admin)")
    evict.add_argument("--keys", nargs="+", default=None, metavar="HEX", help="block keys")
    evict.add_argument("--namespace", default=None)
    evict.add_argument("--fingerprint", default=None, help="spec fingerprint (64 hex digits)")
    evict.add_argument("--tier", default=None)
    evict.add_argument("--older-than", type=float, default=None, metavar="SECONDS", help="last access older than")
    evict.add_argument("--watermark", default=None, metavar="TIER=FRAC", help="coldest first until TIER is under FRAC")
    evict.add_argument("--limit", type=int, default=None)
    evict.add_argument("--include-pinned", action="store_true")
    evict.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    pin = client("pin", "pin (or --unpin) blocks on a running server (admin)")
    pin.add_argument("keys", nargs="+", metavar="HEX")
    pin.add_argument("--ttl", type=float, default=None, metavar="SECONDS")
    pin.add_argument("--unpin", action="store_true")

    for name, what in (("prefetch", "bring a stored prefix to the server's top tier, in the background"),
                       ("retain", "keep a stored prefix in the top tier for a while (a soft pin, within a quota)"),
                       ("release", "end this tenant's retention of a stored prefix")):
        p = client(name, what, token_env="KVSTORE_TOKEN")
        p.add_argument("--namespace", default="default")
        p.add_argument("--spec", required=True, help="the KV spec: JSON, inline or a file's path")
        p.add_argument("--tokens", required=True, help="token ids: a JSON list, inline or a file's path")
        if name == "retain":
            p.add_argument("--ttl", type=float, required=True, metavar="SECONDS")
            p.add_argument("--priority", type=int, default=0, help="0-9; lower yields first under pressure")

    demo = client("demo", "a scripted put/get against a running server, or the multi-agent demo",
                  token_env="KVSTORE_TOKEN")
    # One optional positional keeps `kvstore demo [--url ...]` what it was while `demo agents` joins it.
    demo.add_argument("what", nargs="?", choices=("basic", "agents"), default="basic",
                      help="basic (default): put/get against --url; agents: planner, coder and reviewer "
                           "processes share a long context through a private server")
    demo.add_argument("--namespace", default="default")
    demo.add_argument("--tokens", type=int, default=1024, help="basic: sequence length (default 1024)")
    demo.add_argument("--remote", action="store_true", help="basic: force HTTP even on the server's host")
    demo.add_argument("--out", default="bench/results", help="agents: directory for the JSON and PNG")
    demo.add_argument("--context-tokens", type=int, default=None,
                      help="agents: shared context length (default 1536; 768 with --quick)")
    demo.add_argument("--quick", action="store_true", help="agents: a smaller model and context (a smoke run)")
    demo.add_argument("--handoff", action="store_true",
                      help="agents: the hand-off scenario: tool-call pauses with churn, TTFT per agent with no "
                           "help, with a prefetch at each hand-off, and with retention across the pause")


def _client(args: argparse.Namespace, **kwargs: Any) -> Any:
    from client_sdk import KVClient

    return KVClient(args.url, token=args.token, retries=1, **kwargs)


def _run_client(args: argparse.Namespace, what: str, call: Callable[[Any], int], **client: Any) -> int:
    from kvstore.errors import KVStoreError

    try:
        with _client(args, **client) as c:
            return call(c)
    except KVStoreError as exc:
        print(f"kvstore {what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _stats(args: argparse.Namespace) -> int:
    def call(client: Any) -> int:
        stats = client.admin.stats()
        if args.json:
            print(json.dumps(stats, indent=2, default=str))
            return 0
        c = stats["counters"]
        print(f"blocks {stats['blocks']}  frame bytes {stats['frame_bytes']}  raw bytes {stats['raw_bytes']}  "
              f"codec saved {stats['codec_bytes_saved']}")
        print(f"puts {c['put_calls']}  gets {c['get_calls']}  lookups {c['lookup_calls']}  "
              f"tokens hit {c['tokens_hit']}/{c['tokens_requested']}")
        # reads: block reads each tier served on every path (co-located shm reads too), the figure
        # /metrics (kvstore_tier_reads_total) and the dashboard show; the tier's own backend
        # counters (which a co-located read bypasses) are in --json, under backend_counters.
        print(f"{'tier':<10}{'kind':<8}{'entries':>9}{'used':>14}{'capacity':>16}{'reads':>10}")
        for t in stats["tiers"]:
            reads = t.get("reads", stats.get("reads_by_tier", {}).get(t["name"], 0))  # an older server: no "reads"
            print(f"{t['name']:<10}{t['kind']:<8}{t['entries']:>9}{t['used_bytes']:>14}{t['capacity_bytes']:>16}"
                  f"{reads:>10}")
        return 0
    return _run_client(args, "stats", call)


def _evict(args: argparse.Namespace) -> int:
    selectors: dict[str, Any] = {k: v for k, v in {
        "keys": args.keys, "namespace": args.namespace, "fingerprint": args.fingerprint, "tier": args.tier,
        "older_than_s": args.older_than, "limit": args.limit}.items() if v is not None}
    if args.include_pinned:
        selectors["include_pinned"] = True
    if args.watermark:
        tier, sep, frac = args.watermark.partition("=")
        try:
            selectors["watermark"] = {"tier": tier, "frac": float(frac)}
        except ValueError:
            sep = ""
        if not sep or not tier:
            print(f"kvstore evict: --watermark is TIER=FRAC, got {args.watermark!r}", file=sys.stderr)
            return 2

    def call(client: Any) -> int:
        answer = client.admin.evict(dry_run=args.dry_run, **selectors)
        verb = "would evict" if answer["dry_run"] else "evicted"
        n = answer["blocks"] if answer["dry_run"] else answer["removed_blocks"]
        b = answer["bytes"] if answer["dry_run"] else answer["removed_bytes"]
        print(f"{verb} {n} blocks, {b} bytes (skipped {answer['skipped_pinned']} pinned; audit #{answer['audit_id']})")
        for tier, t in sorted(answer["by_tier"].items()):
            print(f"  {tier}: {t['blocks']} blocks, {t['bytes']} bytes")
        return 0
    return _run_client(args, "evict", call)


def _pin(args: argparse.Namespace) -> int:
    def call(client: Any) -> int:
        if args.unpin:
            answer = client.admin.unpin(args.keys)
            print(f"unpinned {answer['unpinned']} of {answer['requested']} blocks")
        else:
            answer = client.admin.pin(args.keys, ttl_s=args.ttl)
            print(f"pinned {answer['pinned']} of {answer['requested']} blocks"
                  + (f" for {args.ttl} s" if args.ttl else ""))
        return 0
    return _run_client(args, "pin", call)


def _json_arg(text: str, what: str) -> Any:
    """``--spec``/``--tokens``: inline JSON, or the path of a file holding it."""
    if not text.lstrip().startswith(("{", "[")):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{what}: not JSON: {exc}") from None


def _locality(args: argparse.Namespace) -> int:
    """``kvstore prefetch|retain|release``: a tenant's calls on a stored prefix."""
    from kvstore.spec import KVSpec

    try:
        spec = KVSpec.from_dict(_json_arg(args.spec, "--spec"))
        tokens = _json_arg(args.tokens, "--tokens")
    except (OSError, ValueError) as exc:  # a spec's own errors are InvalidInput, a ValueError
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2

    def call(client: Any) -> int:
        if args.command != "retain":
            n = getattr(client, args.command)(spec, tokens)
            print(f"prefetching {n} tokens" if args.command == "prefetch" else f"released {n} blocks")
            return 0
        a = client.retain(spec, tokens, args.ttl, args.priority)
        print(f"retained {a['tokens']} tokens ({a['blocks']} blocks, {a['bytes']} bytes) for {a['expires_in_s']:g} s "
              f"at priority {a['priority']}; {a['owner']} retains {a['retained_bytes']} of {a['quota_bytes']} bytes")
        return 0
    return _run_client(args, args.command, call, namespace=args.namespace)


def _demo(args: argparse.Namespace) -> int:
    if args.what == "agents":
        return _demo_agents(args)

    def call(client: Any) -> int:
        import time

        import torch

        from kvstore.spec import KVSpec

        spec = KVSpec("kvstore-demo", num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16",
                      block_tokens=16, fingerprint="demo-rev-1")
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 32000, (args.tokens,), generator=gen).tolist()
        kv = torch.randn(spec.kv_shape(len(tokens)), generator=gen).to(torch.float16)
        t0 = time.perf_counter()
        stored = client.put_kv(spec, tokens, kv)
        t1 = time.perf_counter()
        hit = client.lookup(spec, tokens + [1, 2, 3])
        t2 = time.perf_counter()
        got, n = client.get_kv(spec, tokens)
        t3 = time.perf_counter()
        blocks = client.lookup_blocks(spec, tokens)["blocks"]
        tiers: dict[str, int] = {}
        for b in blocks:
            tiers[b["tier"]] = tiers.get(b["tier"], 0) + 1
        same = bool(torch.equal(got, kv[:, :, :, :n]))
        mib = kv[:, :, :, :stored].numel() * 2 / 2**20
        print(f"server {args.url}  namespace {args.namespace}  medium {client.stats.last_medium}")
        print(f"put_kv  {stored} tokens ({mib:.1f} MiB) in {1e3 * (t1 - t0):.1f} ms")
        print(f"lookup  {hit} tokens hit in {1e3 * (t2 - t1):.2f} ms")
        print(f"get_kv  {n} tokens in {1e3 * (t3 - t2):.1f} ms, bit-identical: {same}")
        print("tiers   " + ", ".join(f"{k}: {v} blocks" for k, v in sorted(tiers.items())))
        return 0 if same and n == stored else 1
    return _run_client(args, "demo", call, namespace=args.namespace, colocated=False if args.remote else None,
                       plan=False)


def _demo_agents(args: argparse.Namespace) -> int:
    from bench.agents import DemoFailed, run

    try:
        run(out_dir=args.out, context_tokens=args.context_tokens, quick=args.quick,
            scenario="handoff" if args.handoff else "agents")
    except ValueError as exc:
        print(f"kvstore demo agents: {exc}", file=sys.stderr)
        return 2
    except DemoFailed as exc:
        print(f"kvstore demo agents: {exc}", file=sys.stderr)
        return 1
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "stats": _stats, "evict": _evict, "pin": _pin, "demo": _demo,
    "prefetch": _locality, "retain": _locality, "release": _locality,
}
