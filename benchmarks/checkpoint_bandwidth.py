"""Save and load bandwidth of ``zinf_compile.save`` / ``load`` against the disk's own, in the same run.

Why: a checkpoint is worth taking often only if it runs near the disk's speed. The model's sharded
state (fp32 masters + AdamW moments, >= 2 GiB) is saved to and loaded from a directory next to the
swap folder, and the disk is measured on the same filesystem, in the same run, doing the same kind of
IO. The disk is bursty, so the disk is measured between every two calls, each of ``--repeat`` saves and
loads is set against the mean of the measurements just before and just after it, and the median of
those ratios is the figure (every pair is in the JSON):

* disk write: ``--chunk-mib`` buffered writes of as many bytes as the checkpoint holds, then ``fsync``
  (``save`` fsyncs every file too), timed to the end of the fsync;
* disk read: the same file read sequentially after ``posix_fadvise(DONTNEED)`` evicted it from the page
  cache; ``load`` reads its files after the same eviction;
* disk copy (for state on the NVMe tier): reading one file while writing another, chunk by chunk, plus
  the fsync: a save of NVMe-resident state reads the swap files and writes the checkpoint on one disk.

Bandwidth = checkpoint bytes on disk / wall time of the call (DCP planning, the commit renames and, for
``load``, putting the shards back into their slots included). ``--tier cpu`` keeps the state in memory,
``--tier nvme`` (params and optimizer on NVMe) is the streamed case.

    python benchmarks/checkpoint_bandwidth.py --dir /tmp --tier nvme --layers 12 --width 4096
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

import torch

import zinf_compile


def evict(paths: List[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(d: str) -> List[str]:
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]


def disk(root: str, nbytes: int, chunk: int, copy: bool = True) -> Dict[str, float]:
    """Sequential write+fsync, read after eviction, and read-while-writing (copy, if asked), in GB/s."""
    buf = os.urandom(chunk)
    a, b = os.path.join(root, "disk_a"), os.path.join(root, "disk_b")
    n = -(-nbytes // chunk)
    t = time.perf_counter()
    with open(a, "wb", buffering=0) as f:
        for _ in range(n):
            f.write(buf)
        os.fsync(f.fileno())
    write = n * chunk / (time.perf_counter() - t)
    evict([a])
    t = time.perf_counter()
    with open(a, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    read = n * chunk / (time.perf_counter() - t)
    if not copy:
        os.remove(a)
        return {"write_GBps": write / 1e9, "read_GBps": read / 1e9}
    evict([a])
    t = time.perf_counter()
    with open(a, "rb", buffering=0) as src, open(b, "wb", buffering=0) as dst:
        while True:
            data = src.read(chunk)
            if not data:
                break
            dst.write(data)
        os.fsync(dst.fileno())
    copy = n * chunk / (time.perf_counter() - t)
    os.remove(a)
    os.remove(b)
    return {"write_GBps": write / 1e9, "read_GBps": read / 1e9, "copy_GBps": copy / 1e9}


class Stack(torch.nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="filesystem to measure (swap + checkpoint)")
    ap.add_argument("--tier", choices=["cpu", "nvme"], default="nvme")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="save/load pairs, each between two disk measurements")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zinf_ckbw_", dir=args.dir)
    try:
        swap = os.path.join(root, "swap")
        os.makedirs(swap)
        torch.manual_seed(0)
        model = Stack(args.layers, args.width)
        opts = {"offload_params": args.tier, "offload_optimizer": args.tier, "compiler": "eager"}
        if args.tier == "nvme":
            opts["nvme_path"] = swap
        cmodel = torch.compile(model, backend="zinf", options=opts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t = time.perf_counter()
        cmodel(torch.randn(1, args.width)).backward()
        opt.step()
        opt.zero_grad()
        step_s = time.perf_counter() - t
        state_bytes = 3 * 4 * sum(p.numel() for p in model.parameters())  # master + exp_avg + exp_avg_sq
        # this disk is bursty: each save and each load is paired with a disk measurement right before it,
        # and the ratio of each pair is reported (median over --repeat pairs, every pair kept in the JSON)
        pairs = []
        measure = lambda: disk(root, state_bytes, args.chunk_mib << 20, copy=args.tier == "nvme")  # noqa: E731
        d0 = measure()
        for r in range(args.repeat):
            ck = os.path.join(root, f"ck{r}")
            t = time.perf_counter()
            zinf_compile.save(ck, cmodel, opt)
            save_s = time.perf_counter() - t
            files = files_under(ck)
            ck_bytes = sum(os.path.getsize(f) for f in files)
            d1 = measure()
            evict(files)
            t = time.perf_counter()
            zinf_compile.load(ck, cmodel, opt)
            load_s = time.perf_counter() - t
            d2 = measure()
            disk_w = {k: (d0[k] + d1[k]) / 2 for k in d0}  # the disk around the save
            disk_r = {k: (d1[k] + d2[k]) / 2 for k in d1}  # and around the load
            pair = {"save_s": save_s, "save_GBps": ck_bytes / save_s / 1e9, "load_s": load_s,
                    "load_GBps": ck_bytes / load_s / 1e9, "disk_around_save": disk_w, "disk_around_load": disk_r,
                    "save_vs_disk_write": ck_bytes / save_s / 1e9 / disk_w["write_GBps"],
                    "load_vs_disk_read": ck_bytes / load_s / 1e9 / disk_r["read_GBps"]}
            if args.tier == "nvme":
                pair["save_vs_disk_copy"] = ck_bytes / save_s / 1e9 / disk_w["copy_GBps"]
                pair["load_vs_disk_copy"] = ck_bytes / load_s / 1e9 / disk_r["copy_GBps"]
            pairs.append(pair)
            shutil.rmtree(ck, ignore_errors=True)
            d0 = d2
        ratios = [k for k in pairs[0] if "_vs_" in k]
        out = {
            "tier": args.tier, "params": sum(p.numel() for p in model.parameters()),
            "state_GiB": state_bytes / 2**30, "checkpoint_GiB": ck_bytes / 2**30, "first_step_s": step_s,
            "repeat": args.repeat, "pairs": pairs,
            **{f"median_{k}": statistics.median(pr[k] for pr in pairs) for k in ["save_GBps", "load_GBps", *ratios]},
        }
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
