"""dp = 2 memory-plan worker, launched by torchrun from tests/test_memory_plan.py.

Every rank plans one training step of the GPT model (``zinf_compile.memory_plan``: compiled and run on
a private copy), then runs the same step on the real model twice, the second time under the CPU
allocator's profiler. Rank 0 writes the plan's figures beside the runtime's accounting and the
allocator's measured peak, so the test can hold the plan to both at dp > 1, where the small
parameters' collectives are coalesced (``bucket_bytes``) into flat buffers of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_memory_plan import _allocation_peak, _step_peak_plan  # noqa: E402


def _peak(ivs: list) -> int:
    """Largest sum of ``ivs`` live at one step."""
    ends = [(iv.start, int(iv.nbytes)) for iv in ivs] + [(iv.end + 1, -int(iv.nbytes)) for iv in ivs]
    cur = peak = 0
    for _, d in sorted(ends, key=lambda e: (e[0], e[1])):
        cur += d
        peak = max(peak, cur)
    return peak


def measure(cfg: GPTConfig, options: dict) -> dict:
    """Plan one step under ``options``, then run it on the real model and measure it."""
    torch._dynamo.reset()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = make_batch(cfg, 2, seed=rank)
    plan = zinf_compile.memory_plan(model, (x, y), **options)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", **options})
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.0)
    cm(x, y).backward()  # compile
    opt.zero_grad()  # no gradient shard at the start of the measured step, as the plan assumes
    zinf_compile.reset_peak_memory_stats()
    base = {k: zinf_compile.memory_stats(model)["device"][k]["current"] for k in ("gathered", "comm")}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cm(x, y)
        loss.backward()
        del loss
    stats = zinf_compile.memory_stats(model)["device"]
    roles: dict = {}
    for iv in plan.intervals:
        if iv.kind == "comm":
            roles.setdefault(iv.role, []).append(iv)
    return {
        "plan_bucket": _peak(roles.get("bucket", [])),  # what zinf allocates itself, as the runtime books it
        "runtime_bucket": stats["comm"]["peak"] - base["comm"],
        "comm_after": stats["comm"]["current"],
        "plan_gathered": int(plan.peak("device", "gathered")),
        "runtime_gathered": stats["gathered"]["peak"] - base["gathered"],
        "measured_step": _allocation_peak(prof),
        "plan_step": _step_peak_plan(plan),
        "plan_step_without_comm": _step_peak_plan(dataclasses.replace(
            plan, intervals=[iv for iv in plan.intervals if iv.kind != "comm"])),
        "comm_intervals": {r: len(v) for r, v in roles.items()},
    }


def main(out_path: str, options_json: str, cfg_json: str) -> None:
    """``options_json``: a list of option dicts, each measured in turn (one launch for all)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    cfg = GPTConfig(**json.loads(cfg_json))
    rows = [measure(cfg, options) for options in json.loads(options_json)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
