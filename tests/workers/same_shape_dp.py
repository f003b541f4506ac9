"""dp = 2 worker for tests/test_keep_alive.py: the same-shape model through Inductor in each offload mode.

``SameShape`` adds a parameter to an activation of its own shape, so a pointwise kernel could write
its result over the parameter's gathered buffer (or a gradient's) once nothing in the graph reads it
any more. At dp 2 the fetched shard is all-gathered into a runtime-owned buffer and released after its
last reader; gradients are reduce-scattered by a transfer that reads them asynchronously. Each rank
trains on its own micro-batches (the mean over ranks is the global loss); rank 0 writes the losses
and the full parameters after the SGD steps, per mode, for the test to hold against eager.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_keep_alive import SameShape, same_shape_batches  # noqa: E402

SGD = dict(lr=1e-2, momentum=0.9)


def train(options: dict, steps: int, accum: int) -> dict:
    torch._dynamo.reset()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SameShape()
    cm = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x = same_shape_batches(steps, accum, world)[step][micro][rank]
            loss = cm(x).pow(2).mean()
            (loss / accum).backward()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": zinf_compile.full_state_dict(model, rank0_only=True)}


def main(out_path: str, modes_json: str, steps: int, accum: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {name: train(options, steps, accum) for name, options in json.loads(modes_json).items()}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
