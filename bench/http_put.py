"""``python -m bench.http_put``: a remote put next to loopback TCP and to what ASGI can take, one run.

=========================  ==================================================================
row                        one operation on the same n bytes (32 MiB: 16 blocks of 2 MiB)
=========================  ==================================================================
limit tcp put              ``bench.limits``: sent over a loopback socket to a child process
                           that ``recv_into``s a reused buffer, then one byte back
http put                   ``KVClient(colocated=False).put_kv``: block-major
                           (``KV_BLOCKS_MEDIA``), received into reserved shm slots
http put, token-major      the same, from a client told the server takes only the old body
                           (``KV_MEDIA``): buffered whole, then encoded into the tier
asgi drop                  the same bytes POSTed (the SDK's socket) to a raw ASGI app under
                           uvicorn (uvloop, httptools) that reads and drops them: the most a
                           route that reads ASGI's receive stream can move
=========================  ==================================================================

The spec is ``bench.paths.spec_for``'s (32 layers, 8 KV heads of 128, fp16, 16-token blocks);
each put writes fresh token ids, deleted after the clock. Rows are sampled interleaved
(``bench.sampling.interleave``, after warm-up rounds); figures are GB/s medians and same-run
ratios of medians.

    python -m bench.http_put [--repeats N] [--mib M] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from typing import Any

import numpy as np
import torch

from bench.limits import Limits
from bench.paths import spec_for
from bench.report import header, publish
from bench.sampling import Row, interleave, summary, timed
from bench.serving import child, free_port, kvstore_server

__all__ = ["run", "ROWS"]

MiB = 1 << 20
ROWS = ("limit tcp put", "http put", "http put, token-major", "asgi drop")


def _put_row(client: Any, spec: Any, tokens: int, kv: torch.Tensor, counter: list[int]) -> Any:
    def once() -> float:
        counter[0] += 1
        toks = [counter[0] * 65_536 + i for i in range(tokens)]
        took = timed(lambda: client.put_kv(spec, toks, kv))()
        client.delete(spec, toks)
        return took
    return once


def run(repeats: int = 21, nbytes: int = 32 * MiB, out_dir: str | None = None) -> dict:
    """Measure the rows; print the table; write the JSON; return the result."""
    from client_sdk import KVClient
    from client_sdk._http import Connection, Endpoint
    from kvstore.wire.rest import KV_BLOCKS_MEDIA, KV_MEDIA

    torch.set_num_threads(1)  # client-side copies: a thread team stalls on a busy two-core machine
    spec, tokens = spec_for(nbytes)
    kv = torch.randn(spec.kv_shape(tokens), generator=torch.Generator().manual_seed(0)).half()
    blob = memoryview(np.random.default_rng(4).integers(0, 256, nbytes, dtype=np.uint8))
    bare_port = free_port()
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(kvstore_server("http-put", KVSTORE_SHM_BYTES=str(4 * nbytes + 256 * MiB)))
        stack.enter_context(child([sys.executable, "-m", "bench.service", "bare", str(bare_port), "1"], bare_port,
                                  path="/"))
        limits = Limits(nbytes, stack.enter_context(tempfile.TemporaryDirectory()))
        stack.callback(limits.close)
        blocks = stack.enter_context(KVClient(url, namespace="bench-put", colocated=False, plan=False))
        old = stack.enter_context(KVClient(url, namespace="bench-put", colocated=False, plan=False))
        old.http.put_media = frozenset({KV_MEDIA})  # the bench reaches in: as a server from before would say
        bare = Connection(Endpoint.parse(f"http://127.0.0.1:{bare_port}"), connect_timeout_s=5, timeout_s=60)
        stack.callback(bare.close)

        def drop() -> None:
            bare.request("POST", "/sink", {"Content-Type": "application/octet-stream"}, [blob])
            bare.read_body()

        counter = [0]
        rows = {"limit tcp put": limits.rows()["limit tcp put"],
                "http put": Row(nbytes, _put_row(blocks, spec, tokens, kv, counter)),
                "http put, token-major": Row(nbytes, _put_row(old, spec, tokens, kv, counter)),
                "asgi drop": Row(nbytes, timed(drop))}
        probe = list(range(tokens))  # both bodies store the same KV, and each client sent its own
        for client in (blocks, old):
            client.put_kv(spec, probe, kv)
            got, n = client.get_kv(spec, probe)
            if n != tokens or not torch.equal(got, kv):
                raise AssertionError("a put did not store the KV it was given")
            client.delete(spec, probe)
        if KV_BLOCKS_MEDIA not in (blocks.http.put_media or ()):
            raise AssertionError("the server does not list block-major put bodies in /v1/info")
        samples = interleave(rows, repeats, tick=lambda r: print(f"round {r + 1}/{repeats}", file=sys.stderr))
    gbps = {name: summary(s, rows[name].times) for name, s in samples.items()}
    tcp = gbps["limit tcp put"]["median"]
    ratios = {name: g["median"] / tcp for name, g in gbps.items() if name != "limit tcp put"}
    ratios["http put / http put, token-major"] = gbps["http put"]["median"] / gbps["http put, token-major"]["median"]
    result = header("http_put", repeats=repeats, bytes=nbytes, spec=spec.to_dict(), gbps=gbps,
                    ratios_to_tcp_put=ratios, unit="GB/s = 1e9 bytes/s, median (min-max) over samples")
    publish(result, _table, out_dir)
    return result


def _table(result: dict) -> str:
    lines = [f"{result['bytes'] // MiB} MiB puts, {result['repeats']} interleaved rounds",
             "| row | GB/s median (min-max) | / tcp put |", "|---|---|---|"]
    for name in ROWS:
        g = result["gbps"][name]
        ratio = result["ratios_to_tcp_put"].get(name)
        lines.append(f"| {name} | {g['median']:.2f} ({g['min']:.2f}-{g['max']:.2f}) | "
                     f"{'' if ratio is None else f'{ratio:.2f}x'} |")
    lines.append(f"block-major / token-major: {result['ratios_to_tcp_put']['http put / http put, token-major']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_put", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="interleaved rounds (default 21)")
    parser.add_argument("--mib", type=int, default=32, help="put size in MiB, a multiple of 2 (default 32)")
    parser.add_argument("--out", default="bench/results", help="directory for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    run(args.repeats, args.mib * MiB, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
