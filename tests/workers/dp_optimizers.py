"""dp = 2 worker: every elementwise torch.optim optimizer, unchanged, on a small GPT (tests/test_any_optimizer.py).

Each rank trains on its half of each global batch; rank 0 writes every optimizer's final full state.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch


def main(out_path: str, options_json: str, cfg_json: str, optimizers_json: str, steps: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**json.loads(cfg_json))
    results = {}
    for name, kw in json.loads(optimizers_json).items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(cfg)
        cmodel = torch.compile(model, backend="zinf", options=json.loads(options_json))
        opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2, **kw)
        for step in range(steps):
            x, y = make_batch(cfg, 8, seed=step)
            lo, hi = rank * 8 // world, (rank + 1) * 8 // world
            cmodel(x[lo:hi], y[lo:hi]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        results[name] = zinf_compile.full_state_dict(model)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
