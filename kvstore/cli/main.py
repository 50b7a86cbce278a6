"""The ``kvstore`` command.

    kvstore --version
    kvstore serve [--host H] [--port P] [--data-dir D] [--redis-url URL] [--tokens-file F] [--admin-token T]
                  [--tiers shm,cxl,nvme] [--codec raw] [--shm-bytes 1GiB] ... (each flag also KVSTORE_<NAME>)
    kvstore stats   [--url URL] [--token T] [--json]            a running server's stats
    kvstore evict   [--url URL] [--token T] selectors... [--dry-run]
    kvstore pin     [--url URL] [--token T] KEY... [--ttl S] [--unpin]
    kvstore prefetch|retain|release [--url URL] [--token T] [--namespace NS] --spec SPEC --tokens TOKENS
                                    (retain: --ttl S [--priority P])
    kvstore demo    [--url URL] [--token T] [--namespace NS]      a scripted put/get with timings
    kvstore demo agents [--out DIR] [--context-tokens N] [--quick] [--handoff]
                                                              three agent processes share a context
    kvstore bench codec [--quick] [--no-real] [--repeats N] [--out DIR]
    kvstore bench tiers [--quick] [--tiers shm,cxl,...] [--repeats N] [--redis-url URL] [--dir DIR] [--out DIR]
    kvstore bench service [--quick] [--repeats N] [--caches warm|cold] [--torch-threads N] [--out DIR]
    kvstore bench planner|flight|layers|paged|steady [--quick] [--repeats N] [--torch-threads N] [--out DIR]
    kvstore bench reliability [--quick] [--out DIR] [--docs PAGE]
    kvstore bench all [--quick] [--with-lmcache | --no-lmcache] [--repeats N] [--out DIR] [--docs PAGE]
    kvstore bench lmcache [--quick] [--with-lmcache] [--repeats N] [--out DIR] [--docs PAGE]
    kvstore bench vllm [--quick] [--repeats N] [--out DIR] [--docs PAGE]
    kvstore bench engines [--quick] [--repeats N] [--out DIR] [--docs PAGE]
    kvstore bench agents [--quick] [--parts ttft,events,retain] [--out DIR]
    kvstore doctor [--data-dir D] [--port P] [--redis-url U] [--engine vllm|sglang|lmcache ...] [--json]
                                                              check this host for serve; say what to fix

The client commands talk to a server at ``--url`` (``KVSTORE_URL``, default
``http://127.0.0.1:8470``) with ``--token`` (``KVSTORE_ADMIN_TOKEN`` for the admin
commands, ``KVSTORE_TOKEN`` for ``demo`` and the locality commands). ``SPEC`` (``KVSpec.to_dict``)
and ``TOKENS`` (a list of ids) are JSON, inline or a file's path. The service and SDK are imported
only by the commands that use them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

from kvstore._version import __version__
from kvstore.cli.client import COMMANDS, client_parsers
from kvstore.cli.doctor import doctor, doctor_parser

__all__ = ["main"]

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache store for LLM agents.")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser("bench", help="run a benchmark; prints a table and writes JSON")
    which = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    codec = which.add_parser("codec", help="int8/raw codec GB/s, size and error against memcpy")
    codec.add_argument("--quick", action="store_true", help="small shapes, 3 repeats (a smoke run)")
    codec.add_argument("--no-real", action="store_true", help="skip the real-model (MiniLM) rows")
    codec.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 15)")
    codec.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")

    tiers = which.add_parser("tiers", help="each tier's put/get GB/s against its raw baseline")
    tiers.add_argument("--quick", action="store_true", help="1 MiB and 64 KiB frames, 3 repeats (a smoke run)")
    tiers.add_argument("--tiers", default="memory,device,shm,cxl,redis,nvme",
                       help="comma-separated tiers to run (default all)")
    tiers.add_argument("--repeats", type=int, default=None, help="timed samples per row (default 11)")
    tiers.add_argument("--redis-url", default=None, help="use this Redis (default: a private redis-server)")
    tiers.add_argument("--dir", default=None, help="where the nvme rows write (default: a temp dir here)")
    tiers.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")

    service = which.add_parser("service", help="SDK put/get GB/s over shm and HTTP, lookup req/s, vs baselines")
    service.add_argument("--quick", action="store_true", help="1 MiB only, few repeats (a smoke run)")
    service.add_argument("--repeats", type=int, default=None, help="timed samples per row (default 9)")
    service.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    service.add_argument("--caches", choices=("warm", "cold"), default="warm",
                         help="each sample right after the same call (warm, default) or after a 96 MiB scrub")
    service.add_argument("--torch-threads", type=int, default=1,
                         help="torch intra-op threads in the client process (default 1; 0: torch's default)")

    for name, what in (("planner", "planner choices against an oracle over sizes, link bandwidths and prompts; "
                                    "Flight vs HTTP; time to first layer"),
                       ("flight", "Arrow Flight against HTTP for 32 MiB batches of frames and KV"),
                       ("layers", "layer-wise get: time to the first layer against the whole KV"),
                       ("paged", "vLLM's paged cache <-> the arena: loads and saves, one copy or two"),
                       ("steady", "puts into a full store against an empty one, co-located and HTTP")):
        p = which.add_parser(name, help=what)
        p.add_argument("--quick", action="store_true", help="a small sweep, few repeats (a smoke run)")
        p.add_argument("--repeats", type=int, default=None, help="timed samples per row or option")
        p.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
        p.add_argument("--torch-threads", type=int, default=1,
                       help="torch intra-op threads in the client process (default 1; 0: torch's default)")

    for name, what in (("placement", "placement policies replayed over traces, against LRU, LFU and Belady"),
                       ("write-policy", "Redis bytes and cross-node hit ratio per shared-tier write policy")):
        p = which.add_parser(name, help=what)
        p.add_argument("--quick", action="store_true", help="small traces (a smoke run)")
        p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
        p.add_argument("--out", default="bench/results", help="directory for the results (default bench/results)")
        p.set_defaults(repeats=None)

    rel = which.add_parser("reliability", help="crash, fuzz, load and memory scenarios of the reliability suite")
    rel.add_argument("--quick", action="store_true", help="the suite's default sizes (about 2 minutes)")
    rel.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    rel.add_argument("--docs", default=None, help="render the table into this page (docs/reliability.md)")
    rel.set_defaults(repeats=None)

    lmb = which.add_parser("lmcache", help="LMCache's own client against LMCache's server and kvstore's lm:// "
                                             "listener: put/get GiB/s of 32 MiB chunks, one run")
    lmb.add_argument("--quick", action="store_true", help="5 samples a row (about a minute)")
    lmb.add_argument("--with-lmcache", dest="lmcache", action="store_const", const="with", default="auto",
                     help="install LMCache 0.5.6 into .venv-lmcache when missing (about a minute)")
    lmb.add_argument("--repeats", type=int, default=None, help="samples a row (default 21; 5 with --quick)")
    lmb.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    lmb.add_argument("--docs", default=None, help="render the results into this page (docs/benchmarks.md)")

    vb = which.add_parser("vllm", help="TTFT in real vLLM engines (CPU build): recompute, vLLM's prefix cache, "
                                       "kvstore co-located and over HTTP, ExampleConnector; decode with saving")
    vb.add_argument("--quick", action="store_true", help="3 samples a row (a few minutes)")
    vb.add_argument("--repeats", type=int, default=None, help="samples a row (default 11; 3 with --quick)")
    vb.add_argument("--out", default="bench/results", help="directory for the JSON and PNG (default bench/results)")
    vb.add_argument("--docs", default=None, help="render the results into this page (docs/benchmarks.md)")

    eb = which.add_parser("engines", help="kvstore as SGLang HiCache's storage and LMCache's L2 against their "
                                          "built-in backends and a plain copy")
    eb.add_argument("--quick", action="store_true", help="3 rounds a row (about a minute)")
    eb.add_argument("--repeats", type=int, default=None, help="rounds a row (default 9; 3 with --quick)")
    eb.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    eb.add_argument("--docs", default=None, help="render the results into this page (docs/benchmarks.md)")

    every = which.add_parser("all", help="limits, kvstore's paths and its peers side by side; TTFT; scale")
    every.add_argument("--quick", action="store_true", help="3 samples a row, short windows (under 3 minutes)")
    lmc = every.add_mutually_exclusive_group()
    lmc.add_argument("--with-lmcache", dest="lmcache", action="store_const", const="with", default="auto",
                     help="install LMCache 0.5.6 into .venv-lmcache when missing (about a minute), and run it")
    lmc.add_argument("--no-lmcache", dest="lmcache", action="store_const", const="no",
                     help="leave LMCache out (default: run it when .venv-lmcache has it)")
    every.add_argument("--repeats", type=int, default=None, help="samples a row (default 21; 3 with --quick)")
    every.add_argument("--out", default="bench/results", help="directory for the JSON and PNGs")
    every.add_argument("--docs", default=None, help="render the results into this page (docs/benchmarks.md)")
    every.add_argument("--sizes", default=None, help="block sizes (default 1MiB,4MiB,32MiB)")
    every.add_argument("--prompts", default=None, help="TTFT prompt lengths, tokens (default 512,1024,2048,4096)")
    every.add_argument("--clients", default=None, help="client process counts (default 1,4,16)")
    every.add_argument("--stored", default=None, help="stored levels for the server's RSS (default 0,1GiB,4GiB)")

    ab = which.add_parser("agents", help="multi-agent locality: hand-off TTFT with prefetch, KV events, retention")
    ab.add_argument("--quick", action="store_true", help="small runs (about two minutes)")
    ab.add_argument("--parts", default="ttft,events,retain", help="which parts (default ttft,events,retain)")
    ab.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    ab.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")

    _serve_parser(sub)
    client_parsers(sub)
    doctor_parser(sub)
    return parser


# ``kvstore serve`` flags named as their ServerSettings field: (field, type, help).
_SERVICE_FLAGS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("max_event_subscribers", int, "open /v1/events streams taken; one more gets 503 (default 1024)"),
    ("event_queue", int, "events kept for subscribers that fall behind (default 65536)"),
    ("kv_events_endpoint", str, "publish KV events in vLLM's format on this ZMQ PUB address, e.g. tcp://*:5557"),
    ("kv_events_topic", str, "the ZMQ topic of those events (default '')"),
    ("kv_events_replay_endpoint", str, "a ZMQ ROUTER address that replays missed event batches"),
    ("retain_quota_bytes", str, "bytes one tenant may keep retained, e.g. 1GiB (default a quarter of the top tier)"),
    ("retain_max_ttl_s", float, "longest retention a call may ask for, seconds (default 3600)"),
    ("handoff_ttl_s", float, "how long a hand-off to 'here' holds its blocks, seconds (default 120)"),
    ("max_tokens_per_request", int, "most token ids one request may carry; more gets 413 (default 1048576)"),
)


def _serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the HTTP service (embedded default: shm + cxl + nvme, no Redis)")
    flag = serve.add_argument
    flag("--host", default=None, help="bind address (KVSTORE_HOST, default 127.0.0.1; loopback only without tokens)")
    flag("--port", type=int, default=None, help="port (KVSTORE_PORT, default 8470)")
    flag("--data-dir", default=None,
         help="nvme tier and audit log directory (KVSTORE_DATA_DIR, default ./kvstore-data)")
    flag("--redis-url", default=None, help="shared Redis tier, redis:// or redis+cluster:// (KVSTORE_REDIS_URL)")
    flag("--tokens-file", default=None, help='JSON {"<token>": {"tenant", "namespaces"}} (KVSTORE_TOKENS_FILE)')
    flag("--admin-token", default=None, help="token for /admin (KVSTORE_ADMIN_TOKEN)")
    flag("--tiers", default=None, help="tiers fastest first (KVSTORE_TIERS, default shm,cxl,nvme)")
    flag("--codec", default=None, help="codec of new frames: raw, int8, int8+lz4 (KVSTORE_CODEC)")
    flag("--tier-codecs", default=None, help="per-tier codecs, e.g. redis=raw (KVSTORE_TIER_CODECS)")
    for name in ("memory", "device", "shm", "cxl", "nvme", "redis"):
        flag(f"--{name}-bytes", default=None, help=f"{name} tier capacity, e.g. 1GiB (KVSTORE_{name.upper()}_BYTES)")
    flag("--scrub-bytes-per-s", default=None,
         help="how fast the shm and cxl arenas are re-hashed in the background, e.g. 256MiB; 0: off "
              "(KVSTORE_SCRUB_BYTES_PER_S, default 256MiB)")
    flag("--max-body-bytes", default=None, help="request body limit; more gets 413 (KVSTORE_MAX_BODY_BYTES)")
    flag("--max-inflight-bytes", default=None,
         help="memory all request bodies in flight may hold; past it 503 (KVSTORE_MAX_INFLIGHT_BYTES; "
              "default a quarter of RAM, 1-16 GiB)")
    flag("--no-colocated", action="store_true", help="do not offer the shared-memory path (KVSTORE_COLOCATED=0)")
    flag("--flight-port", type=int, default=None,
         help="also serve Arrow Flight on this port, 0 for a free one (KVSTORE_FLIGHT_PORT; default: none)")
    flag("--lmcache-port", type=int, default=None,
         help="also serve LMCache's lm:// protocol on this port, 0 for a free one (KVSTORE_LMCACHE_PORT; "
              "default: none); chunks go to namespace KVSTORE_LMCACHE_NAMESPACE (lmcache)")
    for name, kind, what in _SERVICE_FLAGS:
        flag("--" + name.replace("_", "-"), type=kind, default=None, help=f"{what} (KVSTORE_{name.upper()})")
    flag("--log-level", default=None, help="debug, info, warning (KVSTORE_LOG_LEVEL)")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "bench": _bench, "serve": _serve, "doctor": doctor, **COMMANDS}
    if args.command in commands:
        return commands[args.command](args)
    _parser().print_help()
    return 0


# -- bench -----------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    if args.repeats is not None and args.repeats < 1:
        print("kvstore bench: --repeats must be at least 1", file=sys.stderr)
        return 2
    benches: dict[str, Callable[[argparse.Namespace], int]] = {
        "codec": _bench_codec, "tiers": _bench_tiers, "service": _bench_service,
        "placement": _bench_traces, "write-policy": _bench_traces,
        "planner": _bench_module, "flight": _bench_module, "layers": _bench_module, "paged": _bench_module,
        "steady": _bench_module,
        "all": _bench_all,
        "reliability": _bench_reliability, "lmcache": _bench_lmcache, "vllm": _bench_vllm,
        "engines": _bench_engines, "agents": _bench_agents,
    }
    return benches[args.bench](args)


def _bench_agents(args: argparse.Namespace) -> int:
    from bench.locality import run

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    return _bench_reported("agents", None, lambda: run(quick=args.quick, parts=parts, out_dir=args.out))


def _bench_codec(args: argparse.Namespace) -> int:
    from bench.codec import run

    run(quick=args.quick, real=not args.no_real, repeats=args.repeats, out_dir=args.out)
    return 0


def _bench_tiers(args: argparse.Namespace) -> int:
    from bench.tiers import ALL_TIERS, run

    names = tuple(n.strip() for n in args.tiers.split(",") if n.strip())
    unknown = sorted(set(names) - set(ALL_TIERS))
    if unknown or not names:
        print(f"kvstore bench tiers: --tiers takes names from {','.join(ALL_TIERS)}, got {args.tiers!r}",
              file=sys.stderr)
        return 2
    run(tiers=names, quick=args.quick, repeats=args.repeats, redis_url=args.redis_url,
        directory=args.dir, out_dir=args.out)
    return 0


def _bench_traces(args: argparse.Namespace) -> int:
    if args.bench == "placement":
        from bench.placement import run
    else:
        from bench.write_policy import run
    run(quick=args.quick, out_dir=args.out, seed=args.seed)
    return 0


def _bench_module(args: argparse.Namespace) -> int:
    import importlib

    run = importlib.import_module(f"bench.{args.bench}").run
    run(quick=args.quick, repeats=args.repeats, out_dir=args.out, torch_threads=args.torch_threads)
    return 0


def _bench_reported(name: str, docs: str | None, run: Callable[[], object],
                    failures: tuple[type[BaseException], ...] = (RuntimeError,)) -> int:
    """Run a bench that renders ``docs``: 2 for a bad page (missing, or without its markers)
    or bad input, 1 for ``failures`` (a server that did not start, a failed install), else 0."""
    if docs is not None and not os.path.isfile(docs):
        print(f"kvstore bench {name}: --docs {docs}: no such page", file=sys.stderr)
        return 2
    try:
        run()
    except ValueError as exc:  # a page without markers, a size that is no whole number of tokens
        print(f"kvstore bench {name}: {exc}", file=sys.stderr)
        return 2
    except failures as exc:
        print(f"kvstore bench {name}: {exc}", file=sys.stderr)
        return 1
    return 0


def _bench_reliability(args: argparse.Namespace) -> int:
    from bench.reliability import run

    return _bench_reported("reliability", args.docs, lambda: run(quick=args.quick, out_dir=args.out, docs=args.docs))


def _bench_lmcache(args: argparse.Namespace) -> int:
    from bench.lm_backend import run

    if args.repeats is not None and args.repeats < 1:
        print(f"kvstore bench lmcache: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    return _bench_reported("lmcache", args.docs, lambda: run(quick=args.quick, repeats=args.repeats,
                                                             lmcache=args.lmcache, out_dir=args.out, docs=args.docs))


def _bench_vllm(args: argparse.Namespace) -> int:
    from bench.vllm_ttft import run

    if args.repeats is not None and args.repeats < 1:
        print(f"kvstore bench vllm: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    return _bench_reported("vllm", args.docs, lambda: run(quick=args.quick, repeats=args.repeats, out_dir=args.out,
                                                          docs=args.docs))


def _bench_engines(args: argparse.Namespace) -> int:
    from bench.engine_backends import run

    if args.repeats is not None and args.repeats < 1:
        print(f"kvstore bench engines: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    return _bench_reported("engines", args.docs, lambda: run(quick=args.quick, repeats=args.repeats,
                                                             out_dir=args.out, docs=args.docs))


def _bench_all(args: argparse.Namespace) -> int:
    from bench.all import run
    from kvstore.config import parse_size

    def listed(text: str | None, parse: Callable[[str], int], least: int) -> tuple[int, ...] | None:
        if text is None:
            return None
        values = tuple(parse(v.strip()) for v in text.split(",") if v.strip())
        if not values or min(values) < least:
            raise ValueError(f"want a comma-separated list of values >= {least}, got {text!r}")
        return values

    try:
        lists = {"sizes": listed(args.sizes, parse_size, 1), "prompts": listed(args.prompts, int, 16),
                 "clients": listed(args.clients, int, 1),
                 "stored": listed(args.stored, lambda v: 0 if v == "0" else parse_size(v), 0)}
    except ValueError as exc:
        print(f"kvstore bench all: {exc}", file=sys.stderr)
        return 2
    return _bench_reported("all", args.docs, lambda: run(quick=args.quick, lmcache=args.lmcache, repeats=args.repeats,
                                                         out_dir=args.out, docs=args.docs, **lists),
                           failures=(RuntimeError, ImportError))


def _bench_service(args: argparse.Namespace) -> int:
    from bench.service import run

    run(quick=args.quick, repeats=args.repeats, out_dir=args.out, torch_threads=args.torch_threads,
        caches=args.caches)
    return 0


# -- serve -----------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    import dataclasses

    from kvstore.config import Settings
    from kvstore.errors import KVStoreError

    try:
        engine = Settings.from_env()
        changes = {k: v for k, v in {
            "data_dir": args.data_dir, "redis_url": args.redis_url, "tiers": args.tiers, "codec": args.codec,
            "scrub_bytes_per_s": args.scrub_bytes_per_s,
            **{f"{n}_bytes": getattr(args, f"{n}_bytes") for n in ("memory", "device", "shm", "cxl", "nvme", "redis")},
        }.items() if v is not None}
        engine = dataclasses.replace(engine, **changes)
        from server.config import ServerSettings

        settings = ServerSettings.from_env(
            host=args.host, port=args.port, tokens_file=args.tokens_file, admin_token=args.admin_token,
            tier_codecs=args.tier_codecs, max_body_bytes=args.max_body_bytes,
            max_inflight_bytes=args.max_inflight_bytes, log_level=args.log_level,
            colocated=False if args.no_colocated else None, flight_port=args.flight_port,
            lmcache_port=args.lmcache_port, **{name: getattr(args, name) for name, _, _ in _SERVICE_FLAGS})
    except KVStoreError as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    from server.serve import serve

    try:
        return serve(settings, engine)
    except KVStoreError as exc:
        print(f"kvstore serve: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover  (python -m kvstore.cli.main)
    sys.exit(main())
