"""Data-parallel worker, launched by torchrun from tests: trains the GPT-style model under zinf.

Each rank takes its half of the global batch; losses are averaged across ranks (equal halves, so the
mean of local means is the global mean). Rank 0 writes losses, the first step's full gradients
(gathered from every rank's shards, before the optimizer steps), the full state dict, per-rank shard
bytes and the compiled graphs' zinf op counts to the output path.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import zinf_full_grads  # noqa: E402  (tests/conftest.py: the store-level gradient read)
from dp_common import train_on_slices  # noqa: E402

# the optimizer both sides use: SGD with momentum (tests/conftest.py says why not Adam across dp)
SGD = dict(lr=0.1, momentum=0.9)


def main(out_path: str, options_json: str, steps: int, global_batch: int, cfg_json: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**json.loads(cfg_json))
    options = json.loads(options_json)
    torch.manual_seed(0)
    model = GPT(cfg)
    if rank == 1:  # a rank that initialised differently: rank 0's values must win
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    total_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.SGD(model.parameters(), **SGD)
    grads: dict = {}
    losses = train_on_slices(cmodel, opt, cfg, steps, global_batch,
                             after_first_backward=lambda: grads.update(zinf_full_grads(model)))  # collective
    stats = zinf_compile.memory_stats()
    tier = {"none": "device", "cpu": "cpu", "nvme": "nvme"}[options.get("offload_params", "none")]
    shard_bytes = torch.tensor([stats[tier]["param"]["current"]], dtype=torch.int64)
    all_shards = [torch.zeros_like(shard_bytes) for _ in range(world)]
    dist.all_gather(all_shards, shard_bytes)
    counts: dict = {}
    record_counters: dict = {}
    for rec in zinf_compile.compile_records():
        for k, v in rec.counters.items():
            record_counters[k] = record_counters.get(k, 0) + v
        for stage in ("forward", "backward"):
            snap = rec.final(stage)
            for k, v in (snap.op_counts if snap else {}).items():
                if "zinf" in k:
                    counts[f"{stage}:{k}"] = counts.get(f"{stage}:{k}", 0) + v
    transfers = dict(zinf_runtime.handle_of(next(model.parameters())).context.transfers.counters)
    full = zinf_compile.full_state_dict(model, rank0_only=True)
    # an evaluation as Lightning's validation loop runs it: the whole global batch on every rank (the
    # same collectives everywhere), under torch.inference_mode (zinf_runtime.modes)
    ex, ey = make_batch(cfg, global_batch, seed=1000)
    with torch.inference_mode():
        eval_loss = cmodel(ex, ey).item()
    # one more step, after the results above: the buckets' flat buffers come from the model's pool,
    # so a step like the earlier ones allocates none (runtime/tiers.py, flat_buffer)
    pool = zinf_runtime.handle_of(next(model.parameters())).context.pool
    before = pool.allocations
    train_on_slices(cmodel, opt, cfg, 1, global_batch)
    pool_allocations = (before, pool.allocations - before)
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "state": full, "shard_bytes": [int(s) for s in all_shards],
                    "total_param_bytes": total_param_bytes, "counts": counts, "transfers": transfers,
                    "record_counters": record_counters,
                    "pool_allocations": pool_allocations, "eval_loss": eval_loss}, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
