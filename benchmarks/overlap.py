"""Overlap benchmark: a ~70M-parameter GPT with params and optimizer on NVMe, serial vs scheduled.

Why: issue 9's acceptance point. Every zinf transfer used to block at its use, so an NVMe step
costs compute *plus* disk time. With the lookahead schedule (``prefetch_depths``,
``reduce_depths``) transfers run behind compute, and the step should approach
max(compute, transfer). This script measures every term of that statement in one run:

    serial     offload nvme/nvme, prefetch_depths=(0, 0, 0), reduce_depths=(0, 0),
               optimizer_prefetch=False (nothing runs ahead of its use)
    scheduled  offload nvme/nvme, the Config defaults (prefetch (3, 2, 1), reduce (1, 2);
               the optimizer's NVMe state read during backward within optimizer_sub_group_bytes;
               ``--optimizer-prefetch on|off`` overrides that option for this row and overlap_opt)
    overlap_opt  the scheduled row plus overlap_optimizer_step=True: each unit whose gradient is
               final is stepped in a background thread during backward, ``step()`` commits
    memory     offload none/none: the in-memory step = the compute term of the bound
    transfer   no model: the NVMe bytes one step of the serial row read and wrote (the swap
               engines' own counters), read and written again through ``zinf_runtime.swap.SwapEngine``
               with the Config's swap settings, all requests queued at once = the transfer term

and prints each row's median step after warm-up, its first step (compile included) and peak RSS,
the bound max(compute, transfer), and the ratios serial/scheduled (goal >= 1.5) and
scheduled/bound (goal <= 1.2). Every row runs in a fresh subprocess (this file, ``--row NAME``),
with its own empty Inductor cache, so compile caches and allocator state cannot leak between rows.

Model (default): GPTConfig(vocab=8192, seq=128, layers=21, hidden=512, heads=8) = 70.4M
parameters (tied head), batch 2 x 128 tokens, ``zinf_compile.optim.AdamW``, compiler "inductor"
(``--compiler eager`` runs the rewritten FX graphs as they are). A step is zero_grad + forward +
backward + optimizer step.

Page cache: the swap engine opens its files with O_DIRECT (reported per row: ``direct_io``); the
transfer row also calls ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file before its timed
reads and reports whether that was done and what the block device moved meanwhile
(``/proc/diskstats``), so a read served by a cache shows up as "device moved" well below 1.

Shared machine: each row reports the share of all cores other processes used while it ran
(/proc/stat minus this row's process tree, as benchmarks/overhead.py) and the load average;
a WARNING flags rows above 10%.

Where the goals can be met: overlap saves at most min(compute, transfer) of serial's sum, so serial /
scheduled is at most (c + t) / max(c, t), which reaches 1.5 only while t / c is between 0.5 and 2.
``--balance`` first times the memory, serial and transfer rows at ``--batch``, picks the batch at which
compute equals transfer (timing the memory row once more there, since compute is not linear in the
batch where per-operator overhead dominates), and runs the rows at that batch.

    python benchmarks/overlap.py --out benchmarks/results                 # all rows
    python benchmarks/overlap.py --balance --rows serial,scheduled,memory,transfer   # at the balanced batch
    python benchmarks/overlap.py --rows serial,memory,transfer --steps 3
    python benchmarks/overlap.py --trace /tmp/overlap-trace.json           # scheduled row writes a trace
    python benchmarks/overlap.py --trace /tmp/t.json --trace-row overlap_opt  # ... or another NVMe row
    python benchmarks/overlap.py --quick --compiler eager --out /tmp/ob    # tiny model (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _procmem import reset_hwm  # noqa: E402
from overhead import busy_cpu_s, own_cpu_s  # noqa: E402  (load reporting, shared with overhead.py)

ROWS = ("serial", "scheduled", "overlap_opt", "memory", "transfer")
MODEL_ROWS = ("serial", "scheduled", "overlap_opt", "memory")
SPEEDUP_GOAL, BOUND_GOAL = 1.5, 1.2  # serial/scheduled >= 1.5, scheduled/bound <= 1.2
FULL = dict(vocab=8192, seq=128, layers=21, hidden=512, heads=8, batch=2)
QUICK = dict(vocab=256, seq=32, layers=2, hidden=64, heads=4, batch=2)


def row_options(row: str, args: argparse.Namespace, nvme_path: str) -> Dict[str, Any]:
    """The zinf options of a model row (a fresh dict per compile: one runtime context per model)."""
    opts: Dict[str, Any] = {"compiler": args.compiler}
    if row == "memory":
        return dict(opts, offload_params="none", offload_optimizer="none")
    opts.update(offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    if row == "serial":
        opts.update(prefetch_depths=(0, 0, 0), reduce_depths=(0, 0), optimizer_prefetch=False)
    else:
        if args.prefetch_depths:  # scheduled and overlap_opt: other lookahead depths than the defaults
            opts["prefetch_depths"] = tuple(int(d) for d in args.prefetch_depths.split(","))
            opts["reduce_depths"] = tuple(int(d) for d in args.reduce_depths.split(","))
    if row != "serial" and args.optimizer_prefetch is not None:  # default: the Config's (on)
        opts["optimizer_prefetch"] = args.optimizer_prefetch == "on"
    if args.read_cache_bytes is not None:  # every NVMe row (default: the Config's)
        opts["nvme_read_cache_bytes"] = args.read_cache_bytes
    if args.sub_group_bytes is not None:  # every NVMe row: the optimizer's sub-group and prefetch cap
        opts["optimizer_sub_group_bytes"] = args.sub_group_bytes
    if row == "overlap_opt":
        opts["overlap_optimizer_step"] = True
    if row == args.trace_row and args.trace:  # the defaults (+ overlap_optimizer_step), plus the trace
        opts["trace"] = os.path.abspath(args.trace)
        opts["trace_step"] = args.warmup + 1  # the first timed step (0 compiles, then the warm-up)
    return opts


def vm_hwm_mib() -> float:
    """This process's peak RSS since the last ``reset_hwm`` (VmHWM), else since start (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def engine_totals(model: Any) -> Dict[str, Any]:
    """Sum of the model's swap engines' counters (every NVMe transfer goes through them)."""
    import zinf_runtime

    out: Dict[str, Any] = {"bytes_read": 0, "bytes_written": 0, "reads": 0, "writes": 0, "peak_disk_bytes": 0,
                           "direct_io": True, "engines": 0, "file_sizes": []}
    for ctx in zinf_runtime.contexts_of(model):
        for eng in ctx.engines():
            st = eng.stats()
            out["engines"] += 1
            out["direct_io"] = out["direct_io"] and bool(st["direct_io"])
            for k in ("bytes_read", "bytes_written", "reads", "writes", "peak_disk_bytes"):
                out[k] += st[k]
            d = st["dir"]
            for name in os.listdir(d) if os.path.isdir(d) else ():
                if name.startswith("k_") and not name.endswith(".tmp"):
                    try:
                        out["file_sizes"].append(os.path.getsize(os.path.join(d, name)))
                    except OSError:
                        pass
    return out


def run_model_row(args: argparse.Namespace) -> Dict[str, Any]:
    """Body of a model row's subprocess: compile, time the first step, warm up, time ``--steps``."""
    import torch

    import zinf_compile
    import zinf_runtime
    from zinf_compile.models import GPT, GPTConfig, make_batch

    torch.set_num_threads(args.threads)
    m = model_dims(args)
    cfg = GPTConfig(vocab=m["vocab"], seq=m["seq"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"])
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="zinf-overlap-nvme-", dir="/tmp")
    own_tmp = args.nvme_path is None
    try:
        torch.manual_seed(0)
        dev = torch.device(args.device)
        model = GPT(cfg).to(dev)
        n_params = sum(p.numel() for p in model.parameters())
        opts = row_options(args.row, args, nvme)
        cmodel = torch.compile(model, backend="zinf", options=opts)
        opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-4)
        batches = [tuple(t.to(dev) for t in make_batch(cfg, m["batch"], seed)) for seed in range(4)]

        def step(i: int) -> float:
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = cmodel(x, y)
            loss.backward()
            opt.step()
            return float(loss.detach())

        busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
        losses = [step(0)]
        first = time.perf_counter() - t0
        foreign_first = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / (first * (os.cpu_count() or 1))
        peak_first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for i in range(1, args.warmup + 1):
            losses.append(step(i))
        hwm_reset = reset_hwm()
        io0 = engine_totals(model)
        times: List[float] = []
        cpu_times: List[float] = []  # CPU seconds of this process's threads: less sensitive to other load
        busy0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
        load0 = os.getloadavg()[0]
        for i in range(args.warmup + 1, args.warmup + 1 + args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(step(i))
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        wall = time.perf_counter() - wall0
        foreign = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
        io1 = engine_totals(model)
        for ctx in zinf_runtime.contexts_of(model):
            for eng in ctx.engines():
                eng.wait_all()
        from zinf_runtime import optim_overlap

        ov = optim_overlap.of(opt)
        overlap_stats = {**dict(ov.stats), "peak_held_bytes": ov.peak_held_bytes, "cap_bytes": ov.cap_bytes} if ov else {}
        res: Dict[str, Any] = {
            "row": args.row, "params": n_params, "optimizer_overlap": overlap_stats, "options": {k: v for k, v in opts.items() if k != "nvme_path"},
            "first_step_s": first, "median_step_s": statistics.median(times), "min_step_s": min(times),
            "step_times_s": times, "median_step_cpu_s": statistics.median(cpu_times), "step_cpu_s": cpu_times,
            "losses": losses, "warmup": args.warmup, "steps": args.steps,
            "foreign_cpu_first": foreign_first, "foreign_cpu": foreign, "load1_start": load0,
            "load1_end": os.getloadavg()[0], "threads": torch.get_num_threads(), "torch": torch.__version__,
            "peak_rss_mib": max(peak_first, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "peak_rss_first_step_mib": peak_first,
            "peak_rss_steady_mib": vm_hwm_mib() if hwm_reset else None,
            "graphs": len(zinf_compile.compile_records()),
        }
        if args.row != "memory":
            n = max(1, args.steps)
            res["nvme"] = {
                "bytes_read_per_step": (io1["bytes_read"] - io0["bytes_read"]) / n,
                "bytes_written_per_step": (io1["bytes_written"] - io0["bytes_written"]) / n,
                "reads_per_step": (io1["reads"] - io0["reads"]) / n,
                "writes_per_step": (io1["writes"] - io0["writes"]) / n,
                "peak_disk_bytes": io1["peak_disk_bytes"], "direct_io": io1["direct_io"],
                "engines": io1["engines"], "file_sizes": sorted(io1["file_sizes"]),
            }
        if args.trace and args.row == args.trace_row:
            res["trace_path"] = os.path.abspath(args.trace)
        del cmodel, opt, model
        return res
    finally:
        if own_tmp:
            shutil.rmtree(nvme, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the transfer row: the same bytes through the swap engine, nothing else
# ---------------------------------------------------------------------------------------------

def drop_cache(paths: List[str]) -> int:
    """``posix_fadvise(DONTNEED)`` on each file; the count of files it was done for."""
    done = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done += 1
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    return done


def schedule(sizes: List[int], total: float) -> List[int]:
    """Indices into ``sizes``, cycling in order, until their bytes reach ``total``."""
    out: List[int] = []
    acc = 0
    while acc < total and sizes:
        i = len(out) % len(sizes)
        out.append(i)
        acc += sizes[i]
    return out


def run_transfer_row(args: argparse.Namespace) -> Dict[str, Any]:
    """Write, then read, the serial row's per-step NVMe bytes through one SwapEngine: every request
    queued at once (the engine's queue depth is the only limit), files of the sizes the model's
    engines held, page cache dropped before the reads. Best case for the disk work of one step."""
    import torch

    from swap_bandwidth import block_device, disk_counters
    from zinf_compile.config import Config
    from zinf_runtime.swap import SwapConfig, SwapEngine

    spec = json.loads(args.transfer_spec)
    read_bytes, write_bytes = float(spec["bytes_read_per_step"]), float(spec["bytes_written_per_step"])
    sizes = [int(s) for s in spec["file_sizes"]] or [1 << 20]
    d = Config()
    root = args.nvme_path or tempfile.mkdtemp(prefix="zinf-overlap-xfer-", dir="/tmp")
    own_tmp = args.nvme_path is None
    cfg = SwapConfig(os.path.abspath(root), block_size=d.swap_block_size, queue_depth=d.swap_queue_depth,
                     buffer_count=d.swap_buffer_count, buffer_size=d.swap_buffer_size,
                     reuse_files=d.nvme_reuse_files)
    dev = block_device(root)
    # one source and a few read targets per distinct size: memory stays small, IO sizes stay real
    distinct = sorted(set(sizes))
    src = {s: torch.empty(s, dtype=torch.uint8).random_(0, 256) for s in distinct}
    dst = {s: [torch.zeros(s, dtype=torch.uint8) for _ in range(2)] for s in distinct}
    eng = SwapEngine(cfg)
    busy0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    load0 = os.getloadavg()[0]
    runs: List[Dict[str, Any]] = []
    try:
        for _ in range(2):  # every key exists, and (nvme_reuse_files) has its spare: steady training's rewrites
            for h in [eng.write(f"f{i}", src[s]) for i, s in enumerate(sizes)]:
                h.wait()
        files = [os.path.join(eng.stats()["dir"], n) for n in os.listdir(eng.stats()["dir"]) if n.startswith("k_")]
        w_idx, r_idx = schedule(sizes, write_bytes), schedule(sizes, read_bytes)
        for _ in range(args.transfer_repeat):
            dropped_w = drop_cache(files)
            c0 = disk_counters(dev)
            t0 = time.perf_counter()
            hs = [eng.write(f"f{i}", src[sizes[i]]) for i in w_idx]
            for h in hs:
                h.wait()
            tw = time.perf_counter() - t0
            c1 = disk_counters(dev)
            dropped_r = drop_cache(files)
            t0 = time.perf_counter()
            hs = [eng.read(f"f{i}", dst[sizes[i]][k % 2]) for k, i in enumerate(r_idx)]
            for h in hs:
                h.wait()
            tr = time.perf_counter() - t0
            c2 = disk_counters(dev)
            wb, rb = sum(sizes[i] for i in w_idx), sum(sizes[i] for i in r_idx)
            runs.append({"write_s": tw, "read_s": tr, "total_s": tw + tr, "write_bytes": wb, "read_bytes": rb,
                         "write_gbps": wb / tw / 1e9 if tw else 0.0, "read_gbps": rb / tr / 1e9 if tr else 0.0,
                         "files_fadvised_before_reads": dropped_r, "files_fadvised_before_writes": dropped_w,
                         "device_written_share": (c1[1] - c0[1]) / wb if dev and wb else None,
                         "device_read_share": (c2[0] - c1[0]) / rb if dev and rb else None})
        st = eng.stats()
    finally:
        eng.close()
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - wall0
    foreign = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
    best = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]  # the median run by total time
    return {
        "row": "transfer", "median_step_s": best["total_s"], "first_step_s": runs[0]["total_s"],
        "min_step_s": min(r["total_s"] for r in runs), "runs": runs, "median_run": best,
        "read_bytes": best["read_bytes"], "write_bytes": best["write_bytes"], "files": len(sizes),
        "swap_config": {"block_size": cfg.block_size, "queue_depth": cfg.queue_depth,
                        "buffer_count": cfg.buffer_count, "buffer_size": cfg.buffer_size},
        "direct_io": bool(st["direct_io"]), "zero_copy_bytes": st["zero_copy_bytes"],
        "page_cache_dropped": all(r["files_fadvised_before_reads"] == len(files) for r in runs),
        "block_device": dev, "foreign_cpu": foreign, "foreign_cpu_first": foreign, "load1_start": load0,
        "load1_end": os.getloadavg()[0], "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "bytes_source": spec.get("source", "?"),
    }


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def model_dims(args: argparse.Namespace) -> Dict[str, int]:
    base = QUICK if args.quick else FULL
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}


def row_command(args: argparse.Namespace, row: str, out: str, extra: List[str]) -> List[str]:
    """The command line of ``row``'s subprocess: every option that shapes a row is passed on
    (``tests/test_overlap_args.py`` parses it back and compares the row's options)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--row", row, "--json-out", out,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--compiler", args.compiler, "--transfer-repeat", str(args.transfer_repeat), "--device", args.device]
    for k, v in model_dims(args).items():
        cmd += [f"--{k}", str(v)]
    if args.quick:
        cmd.append("--quick")
    if args.nvme_path:
        cmd += ["--nvme-path", args.nvme_path]
    if args.trace:
        cmd += ["--trace", args.trace, "--trace-row", args.trace_row]
    if args.optimizer_prefetch:
        cmd += ["--optimizer-prefetch", args.optimizer_prefetch]
    if args.read_cache_bytes is not None:
        cmd += ["--read-cache-bytes", str(args.read_cache_bytes)]
    if args.sub_group_bytes is not None:
        cmd += ["--sub-group-bytes", str(args.sub_group_bytes)]
    if args.prefetch_depths:
        cmd += ["--prefetch-depths", args.prefetch_depths, "--reduce-depths", args.reduce_depths]
    return cmd + extra


def spawn(args: argparse.Namespace, row: str, extra: List[str], tmp: str) -> Dict[str, Any]:
    out = os.path.join(tmp, f"{row}.json")
    cache = os.path.join(tmp, f"inductor-{row}")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(args.threads))
    cmd = row_command(args, row, out, extra)
    print(f"[{row}] running", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, timeout=args.row_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"row {row} failed with exit code {proc.returncode}")
    with open(out) as f:
        res = json.load(f)
    res["process_s"] = time.perf_counter() - t0
    rss = f", peak RSS {res['peak_rss_mib']:.0f} MiB"
    print(f"[{row}] median {res['median_step_s']:.3f} s, first {res['first_step_s']:.2f} s{rss}, "
          f"other processes' CPU {res['foreign_cpu']:.0%}, load {res['load1_start']:.1f}", flush=True)
    return res


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summarize(results: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    step = {r: results[r]["median_step_s"] for r in results}
    compute, transfer = step.get("memory"), step.get("transfer")
    bound = max(compute, transfer) if compute is not None and transfer is not None else None
    s = {"compute_s": compute, "transfer_s": transfer, "bound_s": bound,
         "serial_over_scheduled": ratio(step.get("serial"), step.get("scheduled")),
         "scheduled_over_bound": ratio(step.get("scheduled"), bound),
         "serial_over_bound": ratio(step.get("serial"), bound),
         "scheduled_over_overlap_opt": ratio(step.get("scheduled"), step.get("overlap_opt")),
         "serial_over_overlap_opt": ratio(step.get("serial"), step.get("overlap_opt")),
         "overlap_opt_over_bound": ratio(step.get("overlap_opt"), bound)}
    s["speedup_goal_met"] = None if s["serial_over_scheduled"] is None else s["serial_over_scheduled"] >= SPEEDUP_GOAL
    s["bound_goal_met"] = None if s["scheduled_over_bound"] is None else s["scheduled_over_bound"] <= BOUND_GOAL
    return s


def fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def report(args: argparse.Namespace, results: Dict[str, Dict[str, Any]], summary: Dict[str, Any],
           meta: Dict[str, Any]) -> str:
    """The markdown report (also printed): setup, the table, bound and ratios, notes."""
    m = model_dims(args)
    p = next((r["params"] for r in results.values() if "params" in r), None)
    lines = [f"# overlap.py: {meta['date']}", "",
             f"command: `{meta['command']}`  ", f"git: {meta['git']}  ",
             f"model: GPTConfig(vocab={m['vocab']}, seq={m['seq']}, layers={m['layers']}, hidden={m['hidden']}, "
             f"heads={m['heads']}) = {fmt(p / 1e6 if p else None, '.2f')}M params, batch {m['batch']}x{m['seq']}, "
             f"zinf_compile.optim.AdamW, compiler {args.compiler}, device {args.device}, {args.threads} threads  ",
             f"timing: first step (compile included), then {args.warmup} warm-up step(s), then the median of "
             f"{args.steps} steps; each row a fresh process with an empty Inductor cache  ",
             f"machine: {os.cpu_count()} cores, load average at start {meta['load_start']}  "]
    cal = meta.get("calibration")
    if cal:
        lines.append(f"batch chosen by --balance: at batch {cal['batch']} the memory row took {cal['memory_s']:.3f} s, "
                     f"serial {cal['serial_s']:.3f} s and transfer {cal['transfer_s']:.3f} s (median of "
                     f"{cal['steps']} steps)"
                     + "".join(f"; at batch {r['batch']} memory took {r['memory_s']:.3f} s" for r in cal["refined"])
                     + f", so compute equals transfer near batch {cal['balanced_batch']}  ")
    lines += ["",
              "| row | options | median step s | min s | CPU s/step | first step s | peak RSS MiB | NVMe read/step | "
              "NVMe written/step | other procs' CPU | load1 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        r = results.get(row)
        if r is None:
            continue
        if row == "transfer":
            opt = (f"SwapEngine, block {r['swap_config']['block_size'] >> 10} KiB, queue depth "
                   f"{r['swap_config']['queue_depth']}, {r['files']} files")
            rd, wr = r["read_bytes"], r["write_bytes"]
        else:
            o = r["options"]
            opt = (f"{o.get('offload_params')}/{o.get('offload_optimizer')}"
                   + (f", prefetch {tuple(o['prefetch_depths'])}, reduce {tuple(o['reduce_depths'])}"
                      if "prefetch_depths" in o else (", default depths" if row != "memory" else ""))
                   + (", optimizer_prefetch off" if o.get("optimizer_prefetch") is False else "")
                   + (f", read cache {o['nvme_read_cache_bytes'] >> 20} MiB" if "nvme_read_cache_bytes" in o else "")
                   + (f", sub-group {o['optimizer_sub_group_bytes'] >> 20} MiB" if "optimizer_sub_group_bytes" in o else "")
                   + (", defaults + overlap_optimizer_step" if o.get("overlap_optimizer_step") else ""))
            rd = r.get("nvme", {}).get("bytes_read_per_step")
            wr = r.get("nvme", {}).get("bytes_written_per_step")
        mib = lambda b: "-" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
        cpu = fmt(r.get("median_step_cpu_s"), ".2f")
        lines.append(f"| {row} | {opt} | {r['median_step_s']:.3f} | {r['min_step_s']:.3f} | {cpu} | "
                     f"{r['first_step_s']:.2f} | {r['peak_rss_mib']:.0f} | {mib(rd)} | {mib(wr)} | "
                     f"{r['foreign_cpu']:.0%} | {r['load1_start']:.1f} |")
    s = summary
    verdict = lambda ok: "" if ok is None else (" PASS" if ok else " MISS")  # noqa: E731
    lines += ["",
              f"- compute (memory row) {fmt(s['compute_s'])} s, transfer {fmt(s['transfer_s'])} s -> "
              f"bound max(compute, transfer) = {fmt(s['bound_s'])} s",
              f"- serial / scheduled = {fmt(s['serial_over_scheduled'], '.2f')} (goal >= {SPEEDUP_GOAL})"
              f"{verdict(s['speedup_goal_met'])}",
              f"- scheduled / bound = {fmt(s['scheduled_over_bound'], '.2f')} (goal <= {BOUND_GOAL})"
              f"{verdict(s['bound_goal_met'])}",
              f"- serial / bound = {fmt(s['serial_over_bound'], '.2f')}"]
    if results.get("overlap_opt") is not None:
        lines.append(f"- overlap_optimizer_step: scheduled / overlap_opt = {fmt(s['scheduled_over_overlap_opt'], '.2f')}, "
                     f"serial / overlap_opt = {fmt(s['serial_over_overlap_opt'], '.2f')}, "
                     f"overlap_opt / bound = {fmt(s['overlap_opt_over_bound'], '.2f')}")
    t = results.get("transfer")
    if t is not None:
        mr = t["median_run"]
        share = lambda v: "unknown (no block device)" if v is None else f"{v:.2f}"  # noqa: E731
        lines += [f"- transfer row: {t['bytes_source']}; write {mr['write_s']:.3f} s ({mr['write_gbps']:.2f} GB/s) "
                  f"+ read {mr['read_s']:.3f} s ({mr['read_gbps']:.2f} GB/s), median of {len(t['runs'])} runs; "
                  f"O_DIRECT {'on' if t['direct_io'] else 'OFF (buffered IO)'}; page cache "
                  f"{'dropped' if t['page_cache_dropped'] else 'NOT dropped on every file'} before the reads "
                  f"(posix_fadvise DONTNEED on every file); block device {t['block_device']} moved "
                  f"{share(mr['device_read_share'])} of the read payload and {share(mr['device_written_share'])} "
                  "of the written payload (device-wide counters: other processes' IO adds to them)"]
    for row in ("serial", "scheduled", "overlap_opt"):
        r = results.get(row)
        if r is not None and "nvme" in r:
            if r.get("optimizer_overlap"):
                lines.append(f"- {row}: optimizer overlap counters over all steps {r['optimizer_overlap']}")
            lines.append(f"- {row}: swap engines used O_DIRECT: {r['nvme']['direct_io']}; "
                         f"{r['nvme']['reads_per_step']:.0f} reads + {r['nvme']['writes_per_step']:.0f} writes "
                         f"per step; peak disk {r['nvme']['peak_disk_bytes'] / 2**20:.0f} MiB")
    if "serial" in results and "scheduled" in results:
        a, b = results["serial"].get("nvme", {}), results["scheduled"].get("nvme", {})
        if a and b and (a["bytes_read_per_step"], a["bytes_written_per_step"]) != \
                (b["bytes_read_per_step"], b["bytes_written_per_step"]):
            lines.append("- NOTE: serial and scheduled moved different NVMe bytes per step (see the table)")
    if args.trace:
        sched = results.get(args.trace_row)
        if sched is None:
            lines.append(f"- trace: --trace {args.trace} given, but the {args.trace_row} row did not run")
        elif meta.get("trace_exists"):
            lines.append(f"- trace: written by the runtime to {args.trace} ({meta['trace_bytes']} bytes)")
        else:
            lines.append(f"- trace: option trace={args.trace} was passed to the {args.trace_row} row, but NO file "
                         "appeared (the runtime does not write traces yet)")
    busy = [r for r, v in results.items() if max(v["foreign_cpu"], v.get("foreign_cpu_first", 0)) > 0.10]
    if busy:
        lines.append(f"- WARNING: other processes used >10% of the cores during {busy}: those wall times are "
                     "inflated and noisy")
    lines += ["- CPU s/step: median CPU time of the row's process per timed step, all its threads (wall time "
              "minus waiting, plus parallel threads; less sensitive to other load than wall time)",
              "- other procs' CPU: share of all cores used by other processes during the timed steps "
              "(/proc/stat minus this row's process tree); load1: 1-minute load average at the row's start"]
    return "\n".join(lines) + "\n"


def git_describe() -> str:
    try:
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        branch = subprocess.run(["git", "-C", HERE, "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        return f"{branch} @ {rev}" + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {ROWS}")
    p.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 1; --quick 0)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps: a smoke test, not a measurement")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--device", default="cpu", help="compute device of the model rows (cuda: a lent GPU; the "
                   "optimizer and the swap stay on the host). A step ends with the loss's .item(), a sync")
    for k in ("vocab", "seq", "layers", "hidden", "heads", "batch"):
        p.add_argument(f"--{k}", type=int, default=None, help=f"model size (default {FULL[k]}; --quick {QUICK[k]})")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1, help="torch threads, same in every row (default: all usable cores)")
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temp dir in /tmp)")
    p.add_argument("--prefetch-depths", default=None, metavar="NC,CG,GG",
                   help="the scheduled rows' prefetch_depths (default: the Config's, 3,2,1)")
    p.add_argument("--reduce-depths", default="1,2", metavar="RS,OFF",
                   help="the scheduled rows' reduce_depths, with --prefetch-depths (default 1,2)")
    p.add_argument("--optimizer-prefetch", choices=["on", "off"], default=None,
                   help="optimizer_prefetch of the scheduled and overlap_opt rows (default: the Config's)")
    p.add_argument("--read-cache-bytes", type=int, default=None, metavar="N",
                   help="nvme_read_cache_bytes of every NVMe row (default: the Config's, 64 MiB; 0: off)")
    p.add_argument("--balance", action="store_true",
                   help="first run the memory, serial and transfer rows at --batch, then run the rows at the batch "
                        "where compute equals transfer (see balanced_batch); the report gives both")
    p.add_argument("--max-batch", type=int, default=256, help="--balance: the largest batch it may pick")
    p.add_argument("--sub-group-bytes", type=int, default=None, metavar="N",
                   help="option optimizer_sub_group_bytes of every NVMe row: the bytes the streamed step holds and "
                        "the cap of the optimizer's prefetch during backward (default: the Config's, 256 MiB)")
    p.add_argument("--trace", default=None, metavar="PATH", help="pass option trace=PATH to the --trace-row row")
    p.add_argument("--trace-row", default="scheduled", choices=("serial", "scheduled", "overlap_opt"),
                   help="the row --trace traces (default scheduled)")
    p.add_argument("--transfer-repeat", type=int, default=3, help="write+read runs of the transfer row (median)")
    p.add_argument("--row-timeout", type=float, default=3600, help="seconds before a row's process is killed")
    p.add_argument("--out", default=None, metavar="DIR", help="write NAME.json and NAME.md here")
    p.add_argument("--name", default="overlap", help="file name stem under --out (default: overlap)")
    p.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # subprocess mode
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    p.add_argument("--transfer-spec", help=argparse.SUPPRESS)
    return p


def balanced_batch(batch: int, compute_s: float, transfer_s: float, max_batch: int) -> int:
    """The batch at which the in-memory step's compute equals the step's transfer time.

    Why: overlap hides at most min(compute, transfer) of serial's compute + transfer, so serial /
    scheduled is at most (c + t) / max(c, t): 2 where they balance, 1.3 where one is three times the
    other. The transfer (parameter and optimizer bytes) does not depend on the batch and compute grows
    with it, so the batch that balances them is the one where the goal of 1.5 is reachable at all. It
    is rounded to the nearest whole batch, at least 1 and at most ``max_batch``."""
    return max(1, min(max_batch, round(batch * transfer_s / compute_s)))


def calibrate(args: argparse.Namespace, tmp: str) -> Dict[str, Any]:
    """``--balance``: the memory, serial and transfer rows at the given batch (2 timed steps), then the
    batch that balances compute and transfer (``balanced_batch``); the measured rows then run at it."""
    probe = argparse.Namespace(**vars(args))
    probe.steps, probe.trace = min(args.steps, 2), None
    here = os.path.join(tmp, "calibrate")  # its own row files and Inductor caches
    os.makedirs(here)
    res: Dict[str, Dict[str, Any]] = {}
    for row in ("memory", "serial", "transfer"):
        extra: List[str] = []
        if row == "transfer":
            spec = dict(res["serial"]["nvme"], source="the serial row's per-step NVMe bytes")
            extra = ["--transfer-spec", json.dumps(spec)]
        res[row] = spawn(probe, row, extra, here)
    batch = model_dims(args)["batch"]
    c, t = res["memory"]["median_step_s"], res["transfer"]["median_step_s"]
    out: Dict[str, Any] = {"batch": batch, "memory_s": c, "serial_s": res["serial"]["median_step_s"],
                           "transfer_s": t, "steps": probe.steps, "refined": []}
    guess = balanced_batch(batch, c, t, args.max_batch)
    print(f"[calibrate] batch {batch}: compute {c:.3f} s, transfer {t:.3f} s -> batch {guess}", flush=True)
    # compute is not linear in the batch where per-operator overhead dominates (a GPU at a small batch):
    # time the memory row once more at the guess and correct it
    if guess != batch:
        probe.batch = guess
        again = os.path.join(here, f"batch{guess}")
        os.makedirs(again)
        c2 = spawn(probe, "memory", [], again)["median_step_s"]
        out["refined"].append({"batch": guess, "memory_s": c2})
        guess = balanced_batch(guess, c2, t, args.max_batch)
        print(f"[calibrate] batch {probe.batch}: compute {c2:.3f} s -> batch {guess}", flush=True)
    out["balanced_batch"] = guess
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.quick else 5
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.max_batch < 1:
        p.error(f"--max-batch must be >= 1 (the largest batch --balance may pick), got {args.max_batch}")
    if args.nvme_path and not os.path.isdir(args.nvme_path):
        p.error(f"--nvme-path {args.nvme_path!r} is not a directory; create it first")

    if args.row:  # subprocess mode
        res = run_transfer_row(args) if args.row == "transfer" else run_model_row(args)
        with open(args.json_out, "w") as f:
            json.dump(res, f)
        return 0

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    if "transfer" in rows and not {"serial", "scheduled"} & set(rows):
        p.error("the transfer row needs the NVMe bytes of the serial or the scheduled row: add one of them")
    rows = [r for r in ROWS if r in rows]  # transfer last: it needs the bytes measured by a model row
    if args.trace and os.path.exists(args.trace):
        os.unlink(args.trace)  # a stale file must not pass for this run's trace
    meta: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__))] + (argv or sys.argv[1:])),
        "git": git_describe(), "load_start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }
    tmp = tempfile.mkdtemp(prefix="zinf-overlap-")
    results: Dict[str, Dict[str, Any]] = {}
    try:
        if args.balance:
            meta["calibration"] = calibrate(args, tmp)
            args.batch = meta["calibration"]["balanced_batch"]
        for row in rows:
            extra: List[str] = []
            if row == "transfer":
                src = "serial" if "serial" in results else "scheduled"
                spec = dict(results[src]["nvme"], source=f"the {src} row's per-step NVMe bytes")
                extra = ["--transfer-spec", json.dumps(spec)]
            results[row] = spawn(args, row, extra, tmp)
            if args.out:  # partial results survive a later row's failure or a kill
                save(args, meta, results, partial=row != rows[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.trace:
        meta["trace_exists"] = os.path.exists(args.trace)
        meta["trace_bytes"] = os.path.getsize(args.trace) if meta["trace_exists"] else 0
    meta["load_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    summary = summarize(results)
    text = report(args, results, summary, meta)
    print("\n" + text)
    if args.out:
        save(args, meta, results, partial=False, text=text)
    return 0


def save(args: argparse.Namespace, meta: Dict[str, Any], results: Dict[str, Dict[str, Any]], partial: bool,
         text: Optional[str] = None) -> None:
    """NAME.json (and NAME.md) under ``--out``; ``partial``: written after a row, more rows to come."""
    os.makedirs(args.out, exist_ok=True)
    if args.trace:
        meta["trace_exists"] = os.path.exists(args.trace)
        meta["trace_bytes"] = os.path.getsize(args.trace) if meta["trace_exists"] else 0
    summary = summarize(results)
    if text is None:
        text = report(args, results, summary, meta)
    if partial:
        text = "**PARTIAL: not every row has run yet**\n\n" + text
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"args": vars(args), "meta": meta, "model": model_dims(args), "summary": summary,
                   "results": results, "partial": partial}, f, indent=1)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
