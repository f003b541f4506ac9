"""Swap engine: rewriting the same keys every step, ``reuse_files=True`` against ``False``.

Why: a training step rewrites every NVMe key (master, gradient, moments: 4 per parameter unit),
each a file of a few MB. With ``reuse_files=False`` each write creates ``<key>.v<N>.tmp``, reserves
it with ``posix_fallocate``, fills it and renames it over the previous version, whose blocks are
then freed: allocation, unwritten-extent conversion, create, rename and unlink per write, all
journalled. With ``reuse_files=True`` (the default) the write overwrites the key's spare file, the
previous-but-one version, whose blocks are already allocated and written. Both keep the current
version intact until the write completes. This script measures what the difference is worth on a
given disk, in one process, with both modes' rounds interleaved so the disk's drift hits both:

    for round in 1..R:   for mode in (reuse, replace) (order alternating per round):
        every key rewritten once, all writes queued at once, then waited  -> GB/s

Each mode has its own engine and its own keys, laid out (written twice, so that the reuse mode has
its spare) before the timed rounds. The figure is payload bytes / wall time of the round; the
device's own counters (``/proc/diskstats``, device-wide) are printed beside it, so a round the page
cache absorbed would show as "device moved" far below 1 (the engine uses O_DIRECT). It also prints
the disk footprint of each mode (``stats()["disk_bytes"]``): reuse keeps two files per key.

    python benchmarks/swap_rewrite.py                       # 856 keys of 1.3 MB, 5 rounds, under /tmp
    python benchmarks/swap_rewrite.py --keys 200 --kib 8192 --rounds 7 --dir /local_nvme
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from swap_bandwidth import block_device, disk_counters  # noqa: E402
from zinf_runtime.swap import SwapConfig, SwapEngine  # noqa: E402


def one_round(eng: SwapEngine, tensors: List[torch.Tensor], prefix: str) -> float:
    t = time.perf_counter()
    handles = [eng.write(f"{prefix}{i}", x) for i, x in enumerate(tensors)]
    for h in handles:
        h.wait()
    return time.perf_counter() - t


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=856, help="keys per mode (the 70M overlap model: 856 per step)")
    ap.add_argument("--kib", type=int, default=1316, help="bytes per key, KiB (that model: ~1.3 MB per unit)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir under /tmp)")
    ap.add_argument("--queue-depth", type=int, default=8)
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="zinf-rewrite-", dir=args.dir)
    dev = block_device(root)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (args.kib * 1024,), dtype=torch.uint8, generator=g) for _ in range(args.keys)]
    payload = sum(x.numel() for x in tensors)
    engines: Dict[str, SwapEngine] = {
        mode: SwapEngine(SwapConfig(nvme_path=root, queue_depth=args.queue_depth, reuse_files=(mode == "reuse")))
        for mode in ("reuse", "replace")}
    for eng in engines.values():  # lay out: version 1 and 2 (the reuse mode's spare exists from here)
        one_round(eng, tensors, "k")
        one_round(eng, tensors, "k")
    rates: Dict[str, List[float]] = {m: [] for m in engines}
    moved: Dict[str, List[float]] = {m: [] for m in engines}
    print(f"{args.keys} keys x {args.kib} KiB = {payload / 2**20:.0f} MiB per round, device {dev}, dir {root}")
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for mode in order:
            before = disk_counters(dev)
            dt = one_round(engines[mode], tensors, "k")
            after = disk_counters(dev)
            written = (after[1] - before[1]) if dev else 0
            rates[mode].append(payload / dt / 1e9)
            moved[mode].append(written / payload if dev else float("nan"))
            print(f"round {r} {mode:8s} {payload / dt / 1e9:6.3f} GB/s  device moved {moved[mode][-1]:.2f} of the payload")
    for mode, eng in engines.items():
        st = eng.stats()
        print(f"{mode:8s} median {statistics.median(rates[mode]):.3f} GB/s (min {min(rates[mode]):.3f}, max "
              f"{max(rates[mode]):.3f}); disk footprint {st['disk_bytes'] / 2**20:.0f} MiB for "
              f"{payload / 2**20:.0f} MiB of payload; O_DIRECT {st['direct_io']}")
        eng.close()
    ratio = statistics.median(a / b for a, b in zip(rates["reuse"], rates["replace"]))
    print(f"reuse / replace, median of per-round ratios: {ratio:.2f}")
    os.rmdir(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
