"""Checkpointing for a long run must not leak: RSS and open file descriptors per save, with NVMe offload.

A small GPT trains ``--steps`` steps with params and optimizer on NVMe and saves to one path every
``--every`` steps (each save replaces the last). After each save the resident set (``VmRSS``) and the
number of open file descriptors (``/proc/self/fd``) are recorded; after ``--warmup`` saves (the first
saves allocate DCP's and the swap engine's buffers and import lazily) both must be flat. The slope is
a least-squares fit of RSS against the save index, in bytes per save, next to the bytes one
checkpoint holds: a leak of any one checkpoint's worth of tensors per save would show as a slope of
about that size.

    python benchmarks/checkpoint_soak.py --steps 300 --every 30 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Dict, List

import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def slope(ys: List[float]) -> float:
    n = len(ys)
    xs = list(range(n))
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def soak(steps: int, every: int, warmup: int, root: str, hidden: int = 128, layers: int = 2) -> Dict[str, object]:
    cfg = GPTConfig(vocab=256, seq=32, layers=layers, hidden=hidden, heads=4)
    swap = os.path.join(root, "swap")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    cmodel = torch.compile(model, backend="zinf", options={"offload_params": "nvme", "offload_optimizer": "nvme",
                                                           "nvme_path": swap, "compiler": "eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = os.path.join(root, "ck")
    rss, fds = [], []
    for step in range(1, steps + 1):
        x, y = make_batch(cfg, 4, seed=step)
        cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step % every == 0:
            zinf_compile.save(ck, cmodel, opt, extra={"step": step})
            rss.append(rss_bytes())
            fds.append(open_fds())
    ck_bytes = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck))
    zinf_compile.load(ck, cmodel, opt)  # and a load at the end: the checkpoint is usable
    after = rss[warmup:]
    return {"saves": len(rss), "warmup": warmup, "rss_MiB": [r / 2**20 for r in rss], "fds": fds,
            "rss_slope_bytes_per_save": slope(after) if len(after) > 1 else 0.0,
            "fds_after_warmup": sorted(set(fds[warmup:])), "checkpoint_bytes": ck_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2, help="saves before RSS and fds must be flat")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="zinf_soak_", dir=args.dir)
    try:
        out = soak(args.steps, args.every, args.warmup, root, hidden=args.hidden)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
