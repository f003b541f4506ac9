"""Worker for tests/test_broadcast.py (torchrun, gloo): trains the GPT-style model under zinf with
``partition="broadcast"`` (or another scheme) and writes what the test checks.

Rank 0 writes: losses; the first step's full gradients, read straight from the owner's gradient slot
and sent with a raw ``dist.broadcast`` (independent of the runtime's own collectives); the final full
state dict; per parameter unit, every rank's ``(owner, shard_numel, numel)``; the zinf op counts; and
what ``zinf_compile.save`` raised.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_common import train_on_slices  # noqa: E402
from dp_train import SGD  # noqa: E402


def owner_grads(model: torch.nn.Module) -> dict:
    """Full fp32 gradients from the owners' slots (collective): one raw broadcast per unit."""
    from zinf_runtime import store

    out = {}
    for name, p in model.named_parameters():
        h = store.handle_of(p)
        if h is None or not p.requires_grad:
            continue
        parts = []
        for u in h.units():
            src = u.owner if u.owner is not None else 0
            buf = torch.empty(u.numel)
            if u.rank == src:
                g = u.grad
                buf.copy_(torch.zeros(u.numel) if g is None else g.detach().float().cpu()[: u.numel])
            dist.broadcast(buf, src=src)
            parts.append(buf.view(u.shape))
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=h.tile_dim)
    return out


def layout(model: torch.nn.Module) -> list:
    from zinf_runtime import store

    mine = []
    seen = set()
    for name, p in model.named_parameters():
        h = store.handle_of(p)
        if h is None or id(h) in seen:
            continue
        seen.add(id(h))
        for i, u in enumerate(h.units()):
            mine.append((f"{name}#{i}", u.owner, u.shard_numel, u.numel))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def main(out_path: str, options_json: str, steps: int, global_batch: int, cfg_json: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    cfg = GPTConfig(**json.loads(cfg_json))
    options = json.loads(options_json)
    use_init = options.pop("_init", False)  # build the model inside zinf_compile.init (owners at construction)
    clip = options.pop("_clip", None)  # [max_norm, norm_type]: clip_grad_norm_ before each step
    torch.manual_seed(0)
    if use_init:
        with zinf_compile.init(**options) as zi:
            model = GPT(cfg)
        options = zi.options
    else:
        model = GPT(cfg)
        if rank == 1:  # a rank that initialised differently: rank 0's values must win
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.SGD(model.parameters(), **SGD)
    grads: dict = {}
    if clip is None:
        losses = train_on_slices(cmodel, opt, cfg, steps, global_batch,
                                 after_first_backward=lambda: grads.update(owner_grads(model)))
    else:  # [max_norm, norm_type]: clip_grad_norm_ on the sharded gradients before each step
        world, per, losses = dist.get_world_size(), global_batch // dist.get_world_size(), []
        for step in range(steps):
            x, y = make_batch(cfg, global_batch, seed=step)
            loss = cmodel(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip[0], float(clip[1]))
            grads[f"norm{step}"] = norm.detach().clone()
            opt.step()
            opt.zero_grad()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
    lay = layout(model)
    counts: dict = {}
    for rec in zinf_compile.compile_records():
        for stage in ("forward", "backward"):
            snap = rec.final(stage)
            for k, v in (snap.op_counts if snap else {}).items():
                if "zinf" in k:
                    counts[f"{stage}:{k}"] = counts.get(f"{stage}:{k}", 0) + v
    save_error = None
    try:
        zinf_compile.save(os.path.join(os.path.dirname(out_path), "ckpt"), cmodel, opt)
    except Exception as e:  # noqa: BLE001 - the test checks the type and text
        save_error = f"{type(e).__name__}: {e}"
    full = zinf_compile.full_state_dict(model, rank0_only=True)
    ex, ey = make_batch(cfg, global_batch, seed=1000)  # as dp_train.py: every rank, inference mode
    with torch.inference_mode():
        eval_loss = cmodel(ex, ey).item()
    if rank == 0:
        torch.save({"losses": losses, "grads": grads, "state": full, "layout": lay, "counts": counts,
                    "save_error": save_error, "eval_loss": eval_loss}, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
