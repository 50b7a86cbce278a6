"""Child process for the nvme kill -9 test: puts frames in a loop until killed.

    python -m tests.tiers.nvme_crash_child DATA_DIR START FRAME_BYTES N_KEYS [SPARES [SYNC_INTERVAL_S [LAYOUT]]]

LAYOUT ``log`` puts into ``tiers.nvme_log.LogTier`` (small segments, its compactor busy)
instead of the file layout.

Put number ``i`` (from START on) stores ``crash_frame(i)`` under ``crash_key(i % N_KEYS)``
and then writes ``i`` and a newline to stdout in one write: a reported ``i``
is an acknowledged put.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

CAPACITY_BYTES = 1 << 40
LOG_SEGMENT_BYTES = 1 << 20  # small: the log layout's child rolls and compacts all the time
_STAMP = 8  # the first bytes of a frame carry its put number


def crash_key(k: int) -> bytes:
    return bytes([k + 1]) * 32


@functools.lru_cache(maxsize=2)
def _base(frame_bytes: int) -> bytes:
    return np.random.default_rng(1234).integers(0, 256, frame_bytes, dtype=np.uint8).tobytes()


def crash_frame(i: int, frame_bytes: int) -> bytes:
    """The exact bytes of put number ``i``."""
    return i.to_bytes(_STAMP, "little") + _base(frame_bytes)[_STAMP:]


def frame_number(frame: bytes) -> int:
    return int.from_bytes(frame[:_STAMP], "little")


def main(argv: list[str]) -> None:
    from tiers.nvme import NVMeTier
    from tiers.nvme_log import LogTier

    data_dir, start, frame_bytes, n_keys = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    spares = int(argv[4]) if len(argv) > 4 else 64
    sync_interval_s = float(argv[5]) if len(argv) > 5 else 0.0  # > 0: group commit, puts acked unsynced
    if len(argv) > 6 and argv[6] == "log":
        tier = LogTier(data_dir, CAPACITY_BYTES, sync_interval_s=sync_interval_s, segment_bytes=LOG_SEGMENT_BYTES,
                       compact_interval_s=0.01)
    else:
        tier = NVMeTier(data_dir, CAPACITY_BYTES, spare_files=spares, sync_interval_s=sync_interval_s)
    frame = bytearray(_base(frame_bytes))  # restamped in place: no 32 MiB copy per put
    i = start
    while True:
        frame[:_STAMP] = i.to_bytes(_STAMP, "little")
        tier.put(crash_key(i % n_keys), frame)
        os.write(1, f"{i}\n".encode())  # one write: the parent never sees half a line
        i += 1


if __name__ == "__main__":
    main(sys.argv[1:])
