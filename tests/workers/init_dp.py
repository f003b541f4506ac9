"""dp worker (torchrun, gloo) for tests/test_init.py: every rank builds the GPT under zinf_compile.init with
the same seed, keeps its shard, trains a few SGD steps; rank 0 writes the initial full state dict, per-rank
shard bytes, losses and the final full state dict. Then (before training) a second copy built on the meta
device (init_std=None) and materialized by ``zi.materialize``: its full state dict and per-rank shard bytes."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig

from dp_common import train_on_slices


def main(out_path: str, cfg_json: str, steps: int, global_batch: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**json.loads(cfg_json))
    torch.manual_seed(0)
    with zinf_compile.init(offload_params="cpu", compiler="eager") as zi:
        model = GPT(cfg)
    no_storage = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    shard = sum(zinf_compile.memory_stats(model)["cpu"]["param"]["current"] for _ in [0])
    shards = [None] * world
    dist.all_gather_object(shards, shard)
    initial = zinf_compile.full_state_dict(model, rank0_only=True)
    torch.manual_seed(0)
    with zinf_compile.init(offload_params="cpu", compiler="eager") as zm:
        with torch.device("meta"):
            meta_model = GPT(GPTConfig(**dict(json.loads(cfg_json), init_std=None)))
        zm.materialize(meta_model)
    meta_no_storage = all(p.untyped_storage().nbytes() == 0 for p in meta_model.parameters())
    meta_shards = [None] * world
    dist.all_gather_object(meta_shards, zinf_compile.memory_stats(meta_model)["cpu"]["param"]["current"])
    meta_initial = zinf_compile.full_state_dict(meta_model, rank0_only=True)
    del meta_model
    cmodel = torch.compile(model, backend="zinf", options=zi.options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = train_on_slices(cmodel, opt, cfg, steps, global_batch)
    final = zinf_compile.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save({"initial": initial, "final": final, "losses": losses, "shards": shards,
                    "no_storage": no_storage, "partitioned": zi.partitioned, "meta_initial": meta_initial,
                    "meta_shards": meta_shards, "meta_no_storage": meta_no_storage}, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
