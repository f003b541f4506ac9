"""Predicted (``zinf_compile.memory_plan``) vs measured memory of one training step of the GPT model.

Why: a memory plan is only useful if it is right, so each figure of the plan is set beside what the
runtime did, under both compilers (``compiler="eager"``: the graphs run as FX code; ``"inductor"``: the
compute between zinf ops is compiled). Every figure says what it is:

* ``step (plan)`` vs ``step (allocator)``: the plan's peak over the step of everything allocated in
  the device and cpu tiers (not the resident parameter/optimizer shards, not NVMe files) against a
  **measurement**: the CPU allocator's peak during one forward+backward, from
  ``torch.profiler.profile(profile_memory=True)`` (largest running sum of its allocation events; on
  this CPU-only host the "device" is the CPU), plus the host buffers idle in the model's pool or kept
  by its read cache at the step's start: the step reuses those with no allocation the profiler could
  see, and the plan books them (NVMe read and write buffers, kept reads). The measured step follows
  an optimizer step (lr 0), as in training. Under Inductor the plan reads the graphs before
  Inductor fuses and reuses buffers, so it is an upper bound there.
* ``gathered``, ``shards``: the plan's gathered-parameter peak and its shard bytes per tier
  (param + grad + optim) against the runtime's own **accounting** (``zinf_compile.memory_stats()``):
  bookkeeping of the tensors zinf creates, exact by construction if the plan is right.
* ``nvme files``: ``plan.nvme_file_bytes()`` against a **measurement**: the sizes of the files in the
  swap folder after the step (each shard's file is padded to 4096 bytes for O_DIRECT, which the
  runtime's accounting does not count), measured after the step, one optimizer step (lr 0) and
  one more backward, so that every master has been rewritten and keeps its spare file
  (``nvme_reuse_files``), as in steady training. The plan's figure is the peak of steady training with gradient accumulation, where each
  gradient keeps a spare too; with one backward per step and ``zero_grad`` between, the swap engine
  overwrites the gradient's one file, so the disk must hold exactly the plan less one file per
  gradient (``plan.nvme_file_bytes("grad") / 2``).
* ``RSS delta``: the process's resident-set high-water mark during the step (``VmHWM``, reset through
  /proc/self/clear_refs) minus its resident set before. Printed for completeness only: glibc keeps and
  reuses freed heap, so it is noisy and usually below the allocator figure; never compare it exactly.

    python benchmarks/memory_plan_accuracy.py                       # both compilers, four configs
    python benchmarks/memory_plan_accuracy.py --compilers inductor --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

import zinf_compile
import zinf_runtime
from zinf_compile.analytic import human_bytes
from zinf_compile.memory_plan import MemoryPlan, memory_plan
from zinf_compile.models import GPT, GPTConfig, make_batch
from _procmem import reset_hwm  # noqa: E402

STEP_TOLERANCE = 0.10  # eager: predicted step peak within +-10% of the allocator's


def configs(nvme_dir: str) -> Dict[str, Dict[str, Any]]:
    """The four configurations of the accuracy check (the NVMe one swaps under ``nvme_dir``)."""
    return {
        "no offload": {"offload_params": "none"},
        "offload cpu/cpu": {"offload_params": "cpu", "offload_optimizer": "cpu"},
        "offload nvme/nvme": {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": nvme_dir},
        "tiled, 1 MiB budget": {"device_memory_budget": 1 << 20},
    }


def allocation_peak(prof: profile) -> int:
    """Largest running sum of the profiler's CPU allocation events (bytes above the start).

    Uses the profiler's event tree (``kineto_results.experimental_event_tree``), whose allocation
    events carry their size; the public ``prof.events()`` only attributes allocations to ops.
    """
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    cur = peak = 0
    for _, size in sorted(events, key=lambda t: t[0]):
        cur += size
        peak = max(peak, cur)
    return peak


def predicted_step_peak(plan: MemoryPlan) -> int:
    """Peak of the bytes allocated in memory during the step (device + cpu tiers: what the CPU
    allocator sees here). Resident shards and the graph inputs predate the step; NVMe files are disk."""
    diff = [0] * (len(plan.steps) + 1)
    for iv in plan.intervals:
        if iv.tier == "nvme" or iv.role == "input" or (iv.role in ("shard", "scalar", "param_copy")
                                                       and iv.kind in ("param", "optim")):
            continue
        diff[iv.start] += int(iv.nbytes)
        diff[iv.end + 1] -= int(iv.nbytes)
    cur = peak = 0
    for d in diff[:-1]:
        cur += d
        peak = max(peak, cur)
    return peak


def rss_kib() -> Dict[str, int]:
    out = {"VmRSS": 0, "VmHWM": 0}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in out:
                out[key] = int(val.split()[0])
    return out




def swap_files(folder: str, settle_s: float = 30.0) -> Dict[str, int]:
    """Bytes of the swap engine's files under ``folder`` once no write is in flight (no ``*.tmp``)."""
    deadline = time.monotonic() + settle_s
    while True:
        sizes: Dict[str, int] = {}
        pending = False
        for root, _, names in os.walk(folder):
            for n in names:
                if n.endswith(".tmp"):
                    pending = True
                elif n.startswith("k_"):
                    sizes[os.path.join(root, n)] = os.path.getsize(os.path.join(root, n))
        if not pending or time.monotonic() > deadline:
            return sizes
        time.sleep(0.05)


def shard_bytes(stats: Dict[str, Any], tier: str) -> int:
    return sum(stats[tier][k]["current"] for k in ("param", "grad", "optim"))


def plan_shards(plan: MemoryPlan, tier: str) -> int:
    return sum(int(plan.peak(tier, k)) for k in ("param", "grad", "optim"))


def run(cfg: GPTConfig, batch: int, compiler: str, options: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = make_batch(cfg, batch, seed=0)
    plan = memory_plan(model, (x, y), compiler=compiler, **options)
    cm = torch.compile(model, backend="zinf", options={"compiler": compiler, **options})
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.0)
    cm(x, y).backward()  # compile
    # an optimizer step (lr 0: the same values) writes every master, as in training, so the read
    # cache (runtime/read_cache.py) starts the measured step empty, as the plan assumes
    opt.step()
    opt.zero_grad()  # gradient shards are None at the start of the measured step, as the plan assumes
    nvme_dir = options.get("nvme_path")
    if nvme_dir:
        swap_files(nvme_dir)
    gc.collect()
    zinf_compile.reset_peak_memory_stats()
    # host buffers from earlier steps, idle in the model's pool or kept by its read cache, are memory
    # this step uses with no allocation the profiler could see (the plan books them: NVMe read
    # buffers, kept reads, write buffers): counted as held, as tests/workers/plan_dp.py does
    ctx = zinf_runtime.contexts_of(model)[0]
    pooled = ctx.pool.idle_bytes + ctx.read_cache.bytes
    hwm = reset_hwm()
    rss0 = rss_kib()["VmRSS"]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cm(x, y)
        loss.backward()
        del loss
    rss_delta = (rss_kib()["VmHWM"] - rss0) * 1024 if hwm else None
    stats = zinf_compile.memory_stats()
    if nvme_dir:  # steady training's files: a step rewrites each master (its spare stays), then a backward
        opt.step()
        opt.zero_grad()
        cm(x, y).backward()
    files = swap_files(nvme_dir) if nvme_dir else {}
    measured = allocation_peak(prof) + pooled
    predicted = predicted_step_peak(plan)
    rec = zinf_compile.compile_records()[-1]
    return {
        "compiler": compiler, "tiles": rec.counters.get("tiles_planned", 0),
        "predicted_step": predicted, "measured_step": measured, "ratio": measured / predicted,
        "pooled_at_start": pooled,
        "rss_delta": rss_delta,
        "device_peak_plan": int(plan.peak("device")), "cpu_peak_plan": int(plan.peak("cpu")),
        "cpu_staging_plan": int(plan.peak("cpu", "staging")),
        "gathered_plan": int(plan.peak("device", "gathered")),
        "gathered_runtime": stats["device"]["gathered"]["peak"],
        "shards_plan": {t: plan_shards(plan, t) for t in ("device", "cpu", "nvme")},
        "shards_runtime": {t: shard_bytes(stats, t) for t in ("device", "cpu", "nvme")},
        "nvme_files_plan": int(plan.nvme_file_bytes()), "nvme_files_disk": sum(files.values()),
        "nvme_grad_spares_plan": int(plan.nvme_file_bytes("grad")) // 2,
        "nvme_file_count": len(files),
    }


def check(r: Dict[str, Any]) -> List[str]:
    """What is off in a row (empty: the plan holds)."""
    bad = []
    if r["gathered_plan"] != r["gathered_runtime"]:
        bad.append("gathered")
    if r["shards_plan"] != r["shards_runtime"]:
        bad.append("shards")
    if r["nvme_files_plan"] - r.get("nvme_grad_spares_plan", 0) != r["nvme_files_disk"]:
        bad.append("nvme files")
    if r["compiler"] == "eager" and abs(r["ratio"] - 1) > STEP_TOLERANCE:
        bad.append("step")
    if r["compiler"] == "inductor" and r["ratio"] > 1 + STEP_TOLERANCE:
        bad.append("step above the plan")
    return bad


def spawn(args: argparse.Namespace, compiler: str, name: str) -> Dict[str, Any]:
    """One row in a fresh interpreter: the runtime's accounting is per process, and a model of an
    earlier row that is not yet freed would otherwise count in this row's shards."""
    cmd = [sys.executable, os.path.abspath(__file__), "--row", compiler, name] + [
        f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "heads", "seq", "vocab", "batch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"row {compiler} {name!r} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compilers", default="eager,inductor", help="comma-separated: eager, inductor")
    p.add_argument("--configs", default=None, help="comma-separated names of configs() (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per row process")
    p.add_argument("--json", action="store_true")
    p.add_argument("--row", nargs=2, metavar=("COMPILER", "CONFIG"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    if args.row:
        with tempfile.TemporaryDirectory(prefix="zinf-memplan-") as nvme_dir:
            res = run(cfg, args.batch, args.row[0], configs(nvme_dir)[args.row[1]])
        print(json.dumps(res))
        return 0
    names = list(configs("")) if args.configs is None else [c.strip() for c in args.configs.split(",") if c.strip()]
    load0 = os.getloadavg()[0]
    rows: Dict[str, Dict[str, Any]] = {}
    for compiler in [c for c in args.compilers.split(",") if c]:
        for name in names:
            t0 = time.perf_counter()
            rows[f"{compiler:<9}{name}"] = r = spawn(args, compiler, name)
            print(f"  {compiler} {name}: plan {human_bytes(r['predicted_step'])}, allocator "
                  f"{human_bytes(r['measured_step'])}, checks {check(r) or 'hold'} ({time.perf_counter() - t0:.0f} s, "
                  f"load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0 if not any(check(r) for r in rows.values()) else 1
    print(f"GPT layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} seq={cfg.seq} vocab={cfg.vocab} "
          f"batch={args.batch}; a fresh process per row; one forward+backward after a compile step; "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f} (memory figures do not depend on load)")
    h = lambda n: human_bytes(int(n))  # noqa: E731
    head = (f"{'compiler config':<30}{'step plan':>12}{'allocator':>12}{'ratio':>7}{'RSS delta':>11}"
            f"{'gathered plan/acct':>22}{'shards plan = acct (dev/cpu/nvme)':>40}{'nvme files plan/disk':>24}  ok")
    print(head)
    for name, r in rows.items():
        rss = h(r["rss_delta"]) if r["rss_delta"] is not None else "?"
        sp, sr = r["shards_plan"], r["shards_runtime"]
        shards = "/".join(h(sp[t]) for t in ("device", "cpu", "nvme")) + ("" if sp == sr else " != " +
                                                                            "/".join(h(sr[t]) for t in sr))
        files = f"{h(r['nvme_files_plan'])} / {h(r['nvme_files_disk'])}" if r["nvme_file_count"] else "-"
        bad = check(r)
        print(f"{name:<30}{h(r['predicted_step']):>12}{h(r['measured_step']):>12}{r['ratio']:>7.3f}{rss:>11}"
              f"{h(r['gathered_plan']) + ' / ' + h(r['gathered_runtime']):>22} {shards:>39}{files:>24}  "
              f"{'yes' if not bad else 'NO: ' + ', '.join(bad)}")
    print("step plan = plan's peak of device+cpu bytes allocated during the step; allocator = MEASURED CPU "
          "allocator peak (torch.profiler) + pooled host buffers at the step's start; ratio = allocator / plan (eager: within +-10%; inductor: <= 1.1, "
          "the plan is an upper bound there). RSS delta = MEASURED VmHWM during the step - VmRSS before "
          "(noisy: glibc reuses freed heap). gathered / shards: plan vs the runtime's ACCOUNTING "
          "(memory_stats()). nvme files: plan.nvme_file_bytes() vs MEASURED sizes of the swap folder's files.")
    ok = not any(check(r) for r in rows.values())
    print("all checks hold:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
