"""A reader process for the torn-read test: attaches by name and checks every copy.

Frames are ``xxh3_64(body) || body``, so any mix of two writes fails the check.
Prints one JSON line: {"ok": n, "stale": n, "torn": n, "leased": n, "torn_leased": n}.
"""

import json
import sys
import time

import xxhash

from kvstore.memory.shm import ShmReader


def check(frame) -> bool:
    frame = bytes(frame)
    return len(frame) >= 8 and xxhash.xxh3_64_digest(frame[8:]) == frame[:8]


def main(segment: str, seconds: float, keys_hex: str, how: str = "find") -> None:
    keys = [bytes.fromhex(k) for k in keys_hex.split(",")]
    counts = {"ok": 0, "stale": 0, "torn": 0, "leased": 0, "torn_leased": 0}
    out = bytearray(4 << 20)
    with ShmReader(segment) as reader:
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            if how == "index":  # the shared key index, as a co-located client finds a frame
                hit = reader.look_up([keys[i % len(keys)]])[0]
                handle = None if hit is None else hit.handle
            else:
                handle = reader.find(keys[i % len(keys)])
            i += 1
            if handle is None:
                counts["stale"] += 1
                continue
            if i % 3 == 0:
                with reader.lease(handle) as view:
                    if view is None:
                        counts["stale"] += 1
                    else:
                        first = bytes(view)
                        time.sleep(0.001)  # the writer churns meanwhile: a lease must hold still
                        counts["leased" if check(first) and bytes(view) == first else "torn_leased"] += 1
                continue
            n = reader.read(handle, out)
            if n is None:
                counts["stale"] += 1
            else:
                counts["ok" if check(out[:n]) else "torn"] += 1
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2], float(sys.argv[2]), *sys.argv[3:])
