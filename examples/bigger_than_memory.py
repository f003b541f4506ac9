"""Train a GPT-style model whose fp32 model states are larger than this machine's RAM.

    python examples/bigger_than_memory.py                        # 2.2e9 params: 33 GiB of model states
    python examples/bigger_than_memory.py --layers 1 --hidden 512 --steps 2   # a quick smoke run
    nice -n 10 python examples/bigger_than_memory.py --dir /work/tmp-big      # swap files there

Model states = fp32 parameters + gradients + the two Adam moments = 16 bytes per parameter. With
the defaults (hidden 4096, 11 blocks, vocabulary 256) that is 2.21e9 parameters and 33 GiB, more than
the 24 GiB of RAM of the 2-core machine this project is developed on; eager PyTorch could not hold
them. Here:

- the model is built under ``zinf_compile.init(offload_params="nvme", offload_optimizer="nvme")``:
  every submodule is partitioned to NVMe (files under ``--dir``) as its ``__init__`` returns, so the
  whole model never exists in memory (GPT's re-initialization of its children gathers one parameter
  at a time);
- ``torch.compile(model, backend="zinf", options=zi.options)`` then trains it with plain
  ``torch.optim.AdamW``: forward and backward fetch one weight at a time from NVMe, gradients are
  written to NVMe as soon as they are reduced, and the optimizer steps master weights, gradients and
  moments from NVMe in sub-groups;
- ``malloc_mmap_threshold`` = 1 MiB: glibc returns freed IO buffers to the OS instead of keeping them
  in its heap (benchmarks/init_rss.py: it halves the peak RSS of an NVMe build).

It reports the loss of each step (finite: the goal), the time per step, the bytes the swap engines
read and wrote (their own counters), and the memory plan's predicted host memory of a step
(``zinf_compile.memory_plan.build_plan`` over the graphs this very run compiled: the plan is derived
from the graphs, not measured) beside the measured peak RSS (``VmHWM``). ``zinf_compile.memory_plan()``
itself is not called: it compiles a private deep copy of the model, i.e. gathers the whole model into
memory, which is what this example must never do. On this CPU-only machine the "device" is host
memory too, so the host figure is the plan's device + cpu tiers. The swap folder is removed at exit.
Not run by CI.

Measured here (``nice -n 10 python examples/bigger_than_memory.py --dir /work/tmp-big``, the 2-core VM
shared with other jobs, load average 10-17): 2.2162e9 parameters, 33.02 GiB of model states = 1.40x
RAM; build 563 s; steps 1605 s (compile included) and 1162 s; loss 5.83, 34.68 (AdamW's first update
at width 4096: eager gives the same rise on 2 blocks); NVMe read 123.8 GiB, written 99.1 GiB, peak
disk 33.3 GiB; plan's host peak 8.81 GiB (every gradient write buffer held to the end of the step),
predicted 10.22 GiB; **measured peak RSS 2.50 GiB = 10.6% of RAM**.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

import zinf_compile
import zinf_runtime
from zinf_compile.memory_plan import MemoryPlan, build_plan
from zinf_compile.models import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import fmt_bytes, get_batch, nvme_io, stdlib_corpus  # noqa: E402


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmHWM``: peak RSS, ``VmRSS``: current) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (this example needs Linux)")


def ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def n_params_of(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)`` without building it (the head is tied to the token embedding)."""
    h = cfg.hidden
    block = 2 * 2 * h + 3 * h * h + h * h + (4 * h * h + 4 * h if cfg.mlp_bias else 4 * h * h) + \
        (4 * h * h + h if cfg.mlp_bias else 4 * h * h)
    if cfg.attn_bias:
        block += 3 * h + h
    return cfg.vocab * h + cfg.seq * h + cfg.layers * block + 2 * h


def host_peak(plan: MemoryPlan) -> tuple[int, str]:
    """The plan's peak of host bytes (device + cpu tiers: the device is the host here) and where."""
    dev, cpu = plan.timeline("device"), plan.timeline("cpu")
    line = [int(a) + int(b) for a, b in zip(dev, cpu)]
    i = max(range(len(line)), key=lambda k: line[k])
    s = plan.steps[i]
    return line[i], f"{s.stage} {s.node}"


def host_peak_write_capped(plan: MemoryPlan, cap: int) -> int:
    """The plan's host peak with the gradient write buffers limited to ``cap`` bytes in flight.

    The plan keeps every gradient's host write buffer (``staging``/``write_buffer``) alive from its
    ``reduce_grad`` to the end of the step, which for an NVMe optimizer is the whole fp32 gradient;
    the runtime waits for writes once ``cap`` bytes are in flight (``ZINF_NVME_WRITE_INFLIGHT``,
    zinf_runtime.tiers.WRITE_INFLIGHT_CAP), so at most ``cap`` of them are live at any point.
    """
    diff = [0] * (len(plan.steps) + 1)
    for iv in plan.intervals:
        if iv.role == "write_buffer":
            diff[iv.start] += int(iv.nbytes)
            diff[iv.end + 1] -= int(iv.nbytes)
    wb, cur = [], 0
    for d in diff[:-1]:
        cur += d
        wb.append(cur)
    dev, cpu = plan.timeline("device"), plan.timeline("cpu")
    return max(int(a) + int(b) - w + min(w, cap) for a, b, w in zip(dev, cpu, wb))


def optimizer_bound(model: torch.nn.Module, sub_group_bytes: int) -> int:
    """The NVMe optimizer's resident bytes by the runtime's rule (zinf_runtime.optim._step_streamed):
    about three sub-groups (stepping one, reading the next, writing the last); a shard larger than a
    sub-group is a sub-group of its own. 16 bytes per parameter: master, gradient, two moments."""
    largest = max(16 * p.numel() for p in model.parameters())
    return min(3 * max(sub_group_bytes, largest), 16 * sum(p.numel() for p in model.parameters()))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=11)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32, help="context in bytes (default: 32)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default: 2)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the swap folder goes (a local disk)")
    ap.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="option malloc_mmap_threshold in bytes (0: leave glibc's dynamic threshold)")
    ap.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = GPTConfig(vocab=256, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    init_std=0.02)
    n = n_params_of(cfg)
    states, ram = 16 * n, ram_bytes()
    free = shutil.disk_usage(args.dir).free
    need = int(1.1 * states)  # master, gradient, two moments on disk (+ 4 KiB padding per file, IO slack)
    print(f"GPT-style model: {n:.3e} parameters ({cfg.layers} blocks, hidden {cfg.hidden}, vocab 256, "
          f"context {cfg.seq}); fp32 model states {fmt_bytes(states)} = {states / ram:.2f}x this machine's RAM "
          f"({fmt_bytes(ram)})", flush=True)
    if free < need:
        raise SystemExit(f"bigger_than_memory: {args.dir} has {fmt_bytes(free)} free, the swap files need about "
                         f"{fmt_bytes(need)}; pass --dir on a disk with room, or fewer --layers")
    data, source = stdlib_corpus(1 << 20)
    swap = tempfile.mkdtemp(prefix="zinf-big-", dir=args.dir)
    figures: Dict[str, Any] = {"params": n, "model_state_bytes": states, "ram_bytes": ram,
                               "hwm_after_import": status_bytes("VmHWM")}
    extra = {"malloc_mmap_threshold": args.mmap_threshold} if args.mmap_threshold else {}
    model = None
    try:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with zinf_compile.init(offload_params="nvme", offload_optimizer="nvme", nvme_path=swap,
                               compiler=args.compiler, **extra) as zi:
            model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == n
        figures["build_s"] = time.perf_counter() - t0
        figures["hwm_after_build"] = status_bytes("VmHWM")
        print(f"built under zinf_compile.init in {figures['build_s']:.0f} s (swap folder {swap}); "
              f"peak RSS so far {fmt_bytes(figures['hwm_after_build'])}", flush=True)
        cmodel = torch.compile(model, backend="zinf", options=zi.options)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        g = torch.Generator().manual_seed(0)
        losses: List[float] = []
        times: List[float] = []
        plan = None
        for step in range(args.steps):
            x, y = get_batch(data, args.batch, args.seq, g)
            t0 = time.perf_counter()
            loss = cmodel(x, y)
            loss.backward()
            t_fb = time.perf_counter() - t0
            if plan is None:  # the plan of the graphs just compiled (parameters alive: their shard sizes)
                plan = build_plan(zinf_compile.compile_records(), optimizer="adamw")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            model.zero_grad()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            figures[f"hwm_after_step{step}"] = status_bytes("VmHWM")
            print(f"step {step}: loss {losses[-1]:.4f}, {times[-1]:.1f} s (forward+backward {t_fb:.1f} s)"
                  + (" incl. compile" if step == 0 else "") + f"; peak RSS so far {fmt_bytes(status_bytes('VmHWM'))}",
                  flush=True)
        for ctx in zinf_runtime.contexts_of(model):
            for eng in ctx.engines():
                eng.wait_all()
        io = nvme_io(model)
        assert plan is not None
        plan_host, plan_where = host_peak(plan)
        cap = zinf_runtime.tiers.WRITE_INFLIGHT_CAP
        plan_capped = host_peak_write_capped(plan, cap)
        sub_group = zinf_compile.Config.from_options(zi.options).optimizer_sub_group_bytes
        opt_bound = optimizer_bound(model, sub_group)
        swap_buffers = zinf_compile.Config.from_options(zi.options)
        swap_buffers = swap_buffers.swap_buffer_count * swap_buffers.swap_buffer_size
        hwm = status_bytes("VmHWM")
        figures.update(losses=losses, step_s=times, nvme=io, plan_host_peak=plan_host, plan_host_peak_at=plan_where,
                       plan_host_peak_write_capped=plan_capped, write_inflight_cap=cap,
                       plan_device_peak=int(plan.peak("device")), plan_cpu_peak=int(plan.peak("cpu")),
                       plan_gathered_peak=int(plan.peak("device", "gathered")),
                       optimizer_step_bound=opt_bound, swap_buffer_bytes=swap_buffers, peak_rss=hwm,
                       peak_rss_fraction_of_ram=hwm / ram, loss_finite=all(math.isfinite(v) for v in losses),
                       mmap_threshold=args.mmap_threshold, batch=args.batch, seq=args.seq, compiler=args.compiler,
                       text=source)
        base = figures["hwm_after_build"]
        rows = [
            ("parameters", f"{n:.4e}"),
            ("fp32 model states (16 B/param)", f"{fmt_bytes(states)} ({states / ram:.2f}x RAM)"),
            ("loss per step", ", ".join(f"{v:.4f}" for v in losses) + f" (ln 256 = {math.log(256):.3f})"),
            ("time per step", ", ".join(f"{t:.0f} s" for t in times) + " (the first includes compile)"),
            ("NVMe bytes read / written", f"{fmt_bytes(io['bytes_read'])} / {fmt_bytes(io['bytes_written'])}"),
            ("NVMe peak disk use", fmt_bytes(io["peak_disk_bytes"])),
            ("plan: host peak of forward+backward", f"{fmt_bytes(plan_host)} (at {plan_where}; of which gathered "
                                                     f"{fmt_bytes(figures['plan_gathered_peak'])})"),
            ("  same, write buffers capped in flight", f"{fmt_bytes(plan_capped)} (ZINF_NVME_WRITE_INFLIGHT = "
                                                        f"{fmt_bytes(cap)}: the plan holds every gradient's)"),
            ("runtime rule: NVMe optimizer step", f"<= ~{fmt_bytes(opt_bound)} (3 sub-groups of "
                                                   f"max({fmt_bytes(sub_group)}, largest shard x16))"),
            ("swap engine bounce buffers", fmt_bytes(swap_buffers)),
            ("RSS after imports / after init", f"{fmt_bytes(figures['hwm_after_import'])} / {fmt_bytes(base)}"),
            ("predicted host peak", f"{fmt_bytes(base + max(plan_host, opt_bound) + swap_buffers)} "
                                    "(after-init RSS + max(plan, optimizer) + bounce buffers)"),
            ("  with the write cap", f"{fmt_bytes(base + max(plan_capped, opt_bound) + swap_buffers)}"),
            ("MEASURED peak RSS (VmHWM)", f"{fmt_bytes(hwm)} = {hwm / ram:.1%} of RAM (goal <= 35%)"),
        ]
        figures["predicted_host_peak"] = base + max(plan_host, opt_bound) + swap_buffers
        figures["predicted_host_peak_write_capped"] = base + max(plan_capped, opt_bound) + swap_buffers
        w = max(len(r[0]) for r in rows)
        print()
        for k, v in rows:
            print(f"{k:<{w}}  {v}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
        print(json.dumps(figures))
        return 0 if figures["loss_finite"] else 1
    finally:
        if model is not None:
            for ctx in zinf_runtime.contexts_of(model):
                for eng in ctx.engines():
                    eng.wait_all()
        shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
