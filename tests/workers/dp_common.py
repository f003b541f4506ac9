"""The data-parallel training loop the dp workers share (launched by torchrun from tests).

Each rank takes its slice of every global batch (``make_batch(cfg, global_batch, seed=step)``); the
logged loss is the mean over ranks (equal slices, so the mean of local means is the global mean).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from zinf_compile.models import GPTConfig, make_batch


def train_on_slices(cmodel: Callable, opt: torch.optim.Optimizer, cfg: GPTConfig, steps: int, global_batch: int,
                    after_first_backward: Optional[Callable[[], None]] = None) -> List[float]:
    """``steps`` optimizer steps of forward, backward, step, zero_grad; returns the global losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per, losses = global_batch // world, []
    for step in range(steps):
        x, y = make_batch(cfg, global_batch, seed=step)
        loss = cmodel(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        if step == 0 and after_first_backward is not None:
            after_first_backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses
