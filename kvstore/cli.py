"""The ``kvstore`` command.

    kvstore --version
    kvstore bench codec [--quick] [--no-real] [--repeats N] [--out DIR]
    kvstore bench tiers [--quick] [--tiers shm,cxl,...] [--repeats N] [--redis-url URL] [--dir DIR] [--out DIR]
    kvstore serve        (the HTTP service lands with the server issue)
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kvstore._version import __version__

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

    sub.add_parser("serve", help="run the HTTP service (not built yet)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        if args.repeats is not None and args.repeats < 1:
            print("kvstore bench: --repeats must be at least 1", file=sys.stderr)
            return 2
        if args.bench == "tiers":
            return _bench_tiers(args)
        from bench.codec import run

        run(quick=args.quick, real=not args.no_real, repeats=args.repeats, out_dir=args.out)
        return 0
    if args.command == "serve":
        print(
            "kvstore serve: not yet - the HTTP service lands with the server issue (#5).\n"
            "Meanwhile use the engine in-process: from kvstore import EmbeddedStore",
            file=sys.stderr,
        )
        return 2
    _parser().print_help()
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
