"""dp = 2 memory-plan worker, launched by torchrun from tests/test_memory_plan.py.

Every rank plans one training step of the GPT model (``zinf_compile.memory_plan``: compiled and run on
a private copy), then runs the same step on the real model: once to compile, then ``REPEATS`` times
under the CPU allocator's profiler. Rank 0 writes the plan's figures beside the runtime's accounting and
the allocator's measured peak, so the test can hold the plan to both at dp > 1, where the small
parameters' collectives are coalesced (``bucket_bytes``) into flat buffers of their own.

Why several profiled steps and their least peak: the profiler records an allocator event only on a
thread that runs with its thread-local state (the main one; gloo's worker while it runs a collective,
which it runs under the caller's state): a tensor made under the profiler and dropped by a second
Python thread shows its allocation and no free. A gloo ``Work`` references the tensors it was given,
and gloo's worker thread drops that reference just after it marks the work complete, outside that
state. When that thread is
descheduled in the window, the tensor's last reference goes on the worker thread and the profile never
sees the free: its running sum keeps the bytes to the end of the step, though the memory was freed.
zinf frees what it allocates for a collective at the wait or the release, whoever still holds it (a
bucket's buffers, ``BucketBuffers``; a reduce-scatter's padded or cast input, ``finish_reduce``; a
gathered parameter, ``ParamHandle.release``), but gloo's own copy of a reduce-scatter's input is
gloo's. Before the bucket's buffers were freed so, 6 of 72 single profiled steps on 2 cores showed the
missed free (+2 to +163 KiB, up to 1.24x the plan where the others gave 1.04x and 0.99x), and the
runtime's own ``comm`` peak doubled in 1 of 5 steps; since, the steps without buckets still show gloo's
copy (up to 1.12x in 30 steps). A missed free only adds, so the least of ``REPEATS`` peaks is the
step's peak.

The last step runs with every tensor given to a collective kept referenced (gloo's worker thread at its
slowest): the runtime's ``comm`` accounting must not move, and no all-gather output may keep memory.
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
import zinf_runtime
from zinf_runtime import comm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_memory_plan import _allocation_peak, _step_peak_plan  # noqa: E402

REPEATS = 5  # profiled steps per configuration (see the module docstring)


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
    peaks, accounts = [], []
    for _ in range(REPEATS):
        opt.zero_grad()  # no gradient shard at the start of the measured step, as the plan assumes
        zinf_compile.reset_peak_memory_stats()
        base = {k: zinf_compile.memory_stats(model)["device"][k]["current"] for k in ("gathered", "comm")}
        # the buckets' buffers from earlier steps, idle in the model's pool, are memory this step uses
        # with no allocation the profiler could see (runtime/tiers.py, flat_buffer): counted as held
        pooled = zinf_runtime.contexts_of(model)[0].pool.idle_bytes
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = cm(x, y)
            loss.backward()
            del loss
        stats = zinf_compile.memory_stats(model)["device"]
        peaks.append(_allocation_peak(prof) + pooled)
        accounts.append((stats["comm"]["peak"] - base["comm"], stats["comm"]["current"],
                         stats["gathered"]["peak"] - base["gathered"]))
    assert len(set(accounts)) == 1, accounts  # the runtime's own accounting does not race: every step books the same
    runtime_bucket, comm_after, runtime_gathered = accounts[0]
    # gloo's worker thread at its slowest: every tensor given to a collective stays referenced after
    # the step. The runtime frees a bucket's buffers at its last wait anyway, and books them so.
    held: list = []
    real = (comm.all_gather_flat, comm.reduce_scatter_flat)

    def holding(kind, fn):
        return lambda out, inp, *a, **k: (held.append((kind, out, inp)), fn(out, inp, *a, **k))[1]

    comm.all_gather_flat, comm.reduce_scatter_flat = holding("gather", real[0]), holding("reduce", real[1])
    try:
        opt.zero_grad()
        zinf_compile.reset_peak_memory_stats()
        base_comm = zinf_compile.memory_stats(model)["device"]["comm"]["current"]
        cm(x, y).backward()
    finally:
        comm.all_gather_flat, comm.reduce_scatter_flat = real
    stats = zinf_compile.memory_stats(model)["device"]
    held_account = (stats["comm"]["peak"] - base_comm, stats["comm"]["current"])
    assert held, "no collective ran"
    # every all-gather's output is given up however many references remain: a gathered parameter's
    # buffer is freed (released after its last use), a bucket's output goes back to the model's pool
    # (at its last member's wait), idle there for the next bucket (runtime/tiers.py, flat_buffer)
    pool = zinf_runtime.contexts_of(model)[0].pool
    gather_bytes_left = sum(out.untyped_storage().nbytes() for kind, out, _ in held
                            if kind == "gather" and not pool.holds(out))
    pooled_outputs = sum(1 for kind, out, _ in held if kind == "gather" and pool.holds(out))
    del held
    roles: dict = {}
    for iv in plan.intervals:
        if iv.kind == "comm":
            roles.setdefault(iv.role, []).append(iv)
    return {
        "plan_bucket": _peak(roles.get("bucket", [])),  # what zinf allocates itself, as the runtime books it
        "runtime_bucket": runtime_bucket,
        "comm_after": comm_after,
        "runtime_bucket_held": held_account[0],
        "comm_after_held": held_account[1],
        "gather_bytes_left_held": gather_bytes_left,
        "pooled_outputs_held": pooled_outputs,
        "plan_gathered": int(plan.peak("device", "gathered")),
        "runtime_gathered": runtime_gathered,
        "measured_step": min(peaks),
        "measured_steps": peaks,
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
