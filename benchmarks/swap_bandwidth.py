"""Swap engine bandwidth vs. the disk's own O_DIRECT bandwidth, measured in one run.

Why: ZeRO-Infinity's NVMe tier is only worth it if the engine keeps the disk
busy, so the number that matters is engine GB/s divided by what the disk can
do (goal >= 0.9).  Both sides use O_DIRECT, so the page cache inflates
neither.  The disk baseline comes from ``fio`` (libaio, same block size and
queue depth) if installed, else ``dd oflag=direct`` / ``dd iflag=direct``.

    python benchmarks/swap_bandwidth.py --size-gib 1 --dir /local_nvme
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from zinf_runtime.swap import SwapConfig, SwapEngine


def engine_bandwidth(args: argparse.Namespace, root: str) -> tuple[float, float, bool]:
    """Write then read ``size`` bytes as ``tensor_mib`` tensors; return (write GB/s, read GB/s, direct)."""
    tbytes = args.tensor_mib << 20
    n = max(1, round(args.size_gib * (1 << 30) / tbytes))
    cfg = SwapConfig(root, block_size=args.block_mib << 20, queue_depth=args.queue_depth,
                     buffer_count=args.buffer_count, buffer_size=max(64, args.block_mib) << 20)
    def alloc() -> torch.Tensor:  # --aligned: page-aligned like pinned memory, so no bounce copy
        t = torch.frombuffer(mmap.mmap(-1, tbytes), dtype=torch.uint8) if args.aligned else \
            torch.empty(tbytes, dtype=torch.uint8)
        return t.zero_()  # pre-fault: training reuses long-lived buffers; first-touch faults aren't disk time

    src = [alloc().random_(0, 256) for _ in range(min(n, 4))]
    outs = [alloc() for _ in range(n)]
    with SwapEngine(cfg) as eng:
        eng.write("warmup", src[0][: 8 << 20]).wait()
        t0 = time.perf_counter()
        hs = [eng.write(f"t{i}", src[i % len(src)]) for i in range(n)]
        for h in hs:
            h.wait()
        t1 = time.perf_counter()
        hs = [eng.read(f"t{i}", outs[i]) for i in range(n)]
        for h in hs:
            h.wait()
        t2 = time.perf_counter()
        direct = eng.stats()["direct_io"]
    for i, o in enumerate(outs):
        assert torch.equal(o, src[i % len(src)]), f"tensor {i} read back wrong"
    total = n * tbytes
    return total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9, direct


def fio_bandwidth(args: argparse.Namespace, root: str) -> tuple[float, float]:
    """Sequential O_DIRECT write and read of the same volume with fio."""
    path = os.path.join(root, "fio.dat")
    res = []
    for rw in ("write", "read"):
        out = subprocess.run(
            ["fio", "--name=disk", f"--filename={path}", f"--size={int(args.size_gib * 1024)}M",
             f"--bs={args.block_mib}M", f"--iodepth={args.queue_depth}", "--ioengine=libaio",
             "--direct=1", f"--rw={rw}", "--output-format=json"],
            check=True, capture_output=True, text=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0][rw]
        res.append(job["bw_bytes"] / 1e9)
    os.unlink(path)
    return res[0], res[1]


def dd_bandwidth(args: argparse.Namespace, root: str) -> tuple[float, float]:
    """Fallback baseline: dd with O_DIRECT, timed here (dd's own summary format varies)."""
    path = os.path.join(root, "dd.dat")
    count = int(args.size_gib * 1024) // args.block_mib
    total = count * (args.block_mib << 20)
    res = []
    for cmd in (["dd", "if=/dev/zero", f"of={path}", f"bs={args.block_mib}M", f"count={count}", "oflag=direct"],
                ["dd", f"if={path}", "of=/dev/null", f"bs={args.block_mib}M", "iflag=direct"]):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        res.append(total / (time.perf_counter() - t) / 1e9)
    os.unlink(path)
    return res[0], res[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="volume written and read (>= 1 recommended)")
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir under /tmp)")
    ap.add_argument("--tensor-mib", type=int, default=128, help="size of each swapped tensor")
    ap.add_argument("--block-mib", type=int, default=1, help="IO size (engine block_size, fio/dd bs)")
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--aligned", action="store_true", help="page-aligned tensors (zero-copy path)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per side; the median is reported")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zinf-swapbench-", dir=args.dir or "/tmp")
    tool = "fio" if shutil.which("fio") else "dd"
    eng, disk = [], []
    try:
        for _ in range(args.repeat):  # interleaved, so background load hits both sides alike
            *e, direct = engine_bandwidth(args, root)
            eng.append(e)
            disk.append(fio_bandwidth(args, root) if tool == "fio" else dd_bandwidth(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (ew, er), (dw, dr) = (tuple(statistics.median(x) for x in zip(*runs)) for runs in (eng, disk))
    print(f"dir={root} size={args.size_gib} GiB tensor={args.tensor_mib} MiB block={args.block_mib} MiB "
          f"queue_depth={args.queue_depth} aligned={args.aligned} engine_o_direct={direct} baseline={tool} "
          f"median of {args.repeat}")
    print(f"{'':8}{'engine GB/s':>13}{'disk GB/s':>12}{'ratio':>8}")
    for name, e, d in (("write", ew, dw), ("read", er, dr)):
        print(f"{name:8}{e:13.3f}{d:12.3f}{e / d:8.2f}{'' if e / d >= 0.9 else '  (< 0.9 goal)'}")


if __name__ == "__main__":
    main()
