"""Cost of the swap engine's crc32 check (``nvme_checksum``) on a 64 MiB read and write.

    .venv/bin/python benchmarks/swap_checksum.py [--dir /nvme] [--mib 64] [--reps 7]

Prints zlib.crc32's own throughput on one thread (1 MiB blocks, as the engine hashes them), then the
median wall time of engine writes and reads of one tensor with checksum on and off, alternating so
drift hits both alike. O_DIRECT reads hit the disk; the buffered rows show the cost where IO is
cheap (page cache), i.e. the worst case for the relative overhead.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib

import torch

from zinf_runtime.swap import SwapConfig, SwapEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="zinf-bench-", dir="/tmp")
    n = a.mib << 20
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    mv = memoryview(t.numpy())
    t0 = time.perf_counter()
    for i in range(0, n, 1 << 20):
        zlib.crc32(mv[i:i + (1 << 20)])
    dt = time.perf_counter() - t0
    print(f"zlib {zlib.ZLIB_RUNTIME_VERSION} crc32, one thread: {a.mib} MiB in {dt * 1e3:.1f} ms = "
          f"{a.mib / 1024 / dt:.2f} GiB/s")
    for direct in (True, False):
        engines = {c: SwapEngine(SwapConfig(root, direct_io=direct, checksum=c)) for c in (False, True)}
        times = {(c, k): [] for c in engines for k in ("write", "read")}
        out = torch.empty_like(t)
        for r in range(a.reps + 1):
            for c, e in (engines.items() if r % 2 else reversed(list(engines.items()))):
                s = time.perf_counter()
                e.write("x", t).wait()
                w = time.perf_counter() - s
                s = time.perf_counter()
                e.read("x", out).wait()
                rd = time.perf_counter() - s
                if r:  # first round: warm-up
                    times[(c, "write")].append(w)
                    times[(c, "read")].append(rd)
        for k in ("write", "read"):
            off, on = statistics.median(times[(False, k)]), statistics.median(times[(True, k)])
            print(f"{'O_DIRECT' if direct else 'buffered'} {k:5s} {a.mib} MiB: checksum off {off * 1e3:7.1f} ms, "
                  f"on {on * 1e3:7.1f} ms  ({(on - off) / off * 100:+.0f}%)")
        for e in engines.values():
            e.close()


if __name__ == "__main__":
    main()
