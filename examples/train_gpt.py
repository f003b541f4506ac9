"""Train a GPT-style model under ``backend="zinf"`` and print losses and memory statistics.

    python examples/train_gpt.py                          # one process, parameters on the device
    python examples/train_gpt.py --offload-params cpu     # shards in CPU memory
    torchrun --nproc-per-node 2 examples/train_gpt.py     # data parallel: every parameter sharded 1/2

The model is unmodified PyTorch; the only zinf-specific lines are the compile call and the optimizer.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split across ranks)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--offload-params", default="none", choices=["none", "cpu"])
    ap.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"])
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--dump-dir", default=None, help="write every graph after every pass here")
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    cfg = GPTConfig(vocab=512, seq=64, layers=args.layers, hidden=args.hidden, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    options = {"offload_params": args.offload_params, "mixed_precision": args.mixed_precision,
               "compiler": args.compiler, "dump_dir": args.dump_dir}
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if rank == 0:
        print(f"GPT-style model: {n_params / 1e6:.2f}M parameters, dp={world}, options={options}")

    per = args.batch // world
    for step in range(args.steps):
        x, y = make_batch(cfg, args.batch, seed=step)
        t0 = time.perf_counter()
        loss = cmodel(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}  ({dt:.2f} s{', includes compile' if step == 0 else ''})")

    stats = zinf_compile.memory_stats()
    if rank == 0:
        print("memory (this rank), MiB current / peak:")
        for tier, kinds in stats.items():
            row = "  ".join(f"{k} {v['current'] / 2**20:.2f}/{v['peak'] / 2**20:.2f}" for k, v in kinds.items())
            print(f"  {tier:6s} {row}")
        full_bytes = n_params * 4
        print(f"  full fp32 parameters would be {full_bytes / 2**20:.2f} MiB; "
              f"peak gathered at once: {stats['device']['gathered']['peak'] / full_bytes:.0%} of that")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
