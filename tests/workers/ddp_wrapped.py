"""dp = 2 worker: a zinf-compiled model wrapped in DistributedDataParallel, as a user might try.

zinf reduce-scatters the gradients itself; DDP's reducer then writes into each partitioned
parameter's gradient. The test expects a clear error naming DistributedDataParallel and the fix.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zinf_compile.models import GPT, GPTConfig, make_batch


def main(order: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    cfg = GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    if order == "ddp_then_compile":
        run = torch.compile(DistributedDataParallel(model), backend="zinf", options={"compiler": "eager"})
    else:  # a module whose compiled network DDP wraps (Lightning's DDP strategy does this)
        class Outer(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.compile(model, backend="zinf", options={"compiler": "eager"})

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return self.net(x, y)

        run = DistributedDataParallel(Outer())
    x, y = make_batch(cfg, 2, seed=dist.get_rank())
    run(x, y).backward()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
