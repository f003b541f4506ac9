"""Step-time and compile-time overhead of the zinf backend against Inductor, on CPU.

Why: with dp = 1 and no offload, zinf should cost almost nothing on top of plain Inductor. The
issue's goals: zinf's median training step within 1.10x of Inductor's, and its first step (which
includes compilation) within 1.5x of Inductor's. This script measures both, plus reference rows:

    eager              plain model, torch.optim.AdamW
    inductor           torch.compile(model) (default backend), torch.optim.AdamW
    zinf               backend="zinf", offload_params="none", zinf_compile.optim.AdamW
    zinf-cpu-offload   backend="zinf", offload_params="cpu"
    zinf-eager-graphs  backend="zinf", compiler="eager" (rewritten FX graphs run as they are)

Every row runs in a fresh subprocess (this file, ``--row NAME``) so in-memory compile caches and
allocator state cannot leak from one row into the next. A step is zero_grad + forward + backward +
optimizer step on a GPT-style model of about 20M parameters. By default each row gets a fresh,
empty ``TORCHINDUCTOR_CACHE_DIR`` (cold compile, comparable across rows); ``--warm-cache`` shares one
directory between rows, ``--cold-and-warm`` runs each compiled row twice on its own directory
(cold, then warm). ``--profile K`` adds a torch.profiler summary of K steady-state steps per row.

Timing on a shared machine: each row also reports the share of the cores that *other* processes
used while it ran (from /proc/stat, minus this row's process tree) and warns above 10%; two OpenMP
threads on two cores slow down several-fold when a third process competes. ``--repeat R`` runs the
rows round-robin R times and keeps each row's best, ``--wait-idle S`` waits for a quiet machine.

    python benchmarks/overhead.py                       # all rows, table on stdout
    python benchmarks/overhead.py --rows inductor,zinf --steps 20 --json results.json
    python benchmarks/overhead.py --rows inductor,zinf --cold-and-warm   # also a warm-cache compile
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

ROWS = ("eager", "inductor", "zinf", "zinf-cpu-offload", "zinf-eager-graphs")
ZINF_OPTIONS: Dict[str, Dict[str, str]] = {
    "zinf": {"offload_params": "none"},
    "zinf-cpu-offload": {"offload_params": "cpu"},
    "zinf-eager-graphs": {"offload_params": "none", "compiler": "eager"},
}
STEP_GOAL, COMPILE_GOAL = 1.10, 1.5  # zinf vs inductor: median step, first step


def model_config(args: argparse.Namespace) -> Any:
    from zinf_compile.models import GPTConfig

    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)


def build(row: str, cfg: Any) -> tuple[Callable[..., Any], Any, int]:
    """(callable model, optimizer, parameter count) for one row, from seed 0."""
    import torch

    from zinf_compile.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # tied weight counted once
    if row == "eager":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), n_params
    if row == "inductor":
        return torch.compile(model), torch.optim.AdamW(model.parameters(), lr=1e-4), n_params
    import zinf_compile

    cmodel = torch.compile(model, backend="zinf", options=ZINF_OPTIONS[row])
    return cmodel, zinf_compile.optim.AdamW(model.parameters(), lr=1e-4), n_params


def busy_cpu_s() -> float:
    """Seconds of non-idle CPU time of the whole machine, all cores (Linux /proc/stat; else 0)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its descendants (Inductor's compile workers are children)."""
    stats: Dict[int, List[str]] = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stats[int(pid)] = f.read().rsplit(")", 1)[1].split()  # fields after "(comm)"
        except (OSError, ValueError, IndexError):
            continue
    if os.getpid() not in stats:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, f in stats.items() if int(f[1]) == parent and pid not in tree]
        tree.update(kids)
        frontier.extend(kids)
    # utime, stime, cutime, cstime are fields 14-17 of /proc/PID/stat, i.e. 11-14 after the comm
    return sum(sum(int(v) for v in stats[pid][11:15]) for pid in tree) / os.sysconf("SC_CLK_TCK")


def profile_steps(step: Callable[[int], float], k: int, top: int) -> Dict[str, Any]:
    """Profile ``k`` steps; print the top ops by self CPU time and return zinf-op totals."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(k):
            step(1000 + i)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
    wall_us = sum(e.self_cpu_time_total for e in events)
    summary: Dict[str, Any] = {"profiled_steps": k, "self_cpu_ms_per_step_total": wall_us / 1e3 / k}
    for e in events:
        if e.key.startswith("zinf::") or e.key in ("aten::copy_", "aten::empty", "aten::to", "aten::_to_copy",
                                                   "aten::add_", "aten::resize_", "Optimizer.step#AdamW.step"):
            summary[e.key] = {"calls_per_step": e.count / k, "self_ms_per_step": e.self_cpu_time_total / 1e3 / k,
                              "total_ms_per_step": e.cpu_time_total / 1e3 / k}
    return summary


def run_row(args: argparse.Namespace) -> Dict[str, Any]:
    """Body of the ``--row`` subprocess: build, time the first step and ``--steps`` more."""
    import torch

    from zinf_compile.models import make_batch

    torch.set_num_threads(args.threads)
    cfg = model_config(args)
    model, opt, n_params = build(args.row, cfg)
    batches = [make_batch(cfg, args.batch, seed) for seed in range(4)]

    def step(i: int) -> float:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    busy0, own0, t0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    losses = [step(0)]
    first = time.perf_counter() - t0
    first_cpu = own_cpu_s() - own0  # includes Inductor's compile worker processes
    foreign_first = max(0.0, (busy_cpu_s() - busy0) - first_cpu) / (first * (os.cpu_count() or 1))
    times: List[float] = []
    cpu_times: List[float] = []  # CPU seconds of this process's threads: less sensitive to other load
    busy0, own0, wall0 = busy_cpu_s(), own_cpu_s(), time.perf_counter()
    for i in range(1, args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    foreign = (busy_cpu_s() - busy0) - (own_cpu_s() - own0)
    foreign_share = max(0.0, foreign) / ((time.perf_counter() - wall0) * (os.cpu_count() or 1))
    result: Dict[str, Any] = {
        "row": args.row, "params": n_params, "first_step_s": first, "median_step_s": statistics.median(times),
        "min_step_s": min(times), "step_times_s": times, "first_step_cpu_s": first_cpu,
        "median_step_cpu_s": statistics.median(cpu_times), "step_cpu_s": cpu_times, "foreign_cpu": foreign_share,
        "foreign_cpu_first": foreign_first, "losses": losses, "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    from torch._dynamo.utils import counters

    result["caches"] = {  # fxgraph_cache_hit/miss/bypass, autograd_cache_*: what a warm cache dir saved
        f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items() if "cache" in k
    }
    if args.row.startswith("zinf"):
        import zinf_compile

        recs = zinf_compile.compile_records()
        result["zinf_graphs"] = len(recs)
        result["zinf_counters"] = dict(sum((r.counters for r in recs), collections.Counter()))
    if args.profile:
        result["profile"] = profile_steps(step, args.profile, args.profile_top)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return result


def wait_idle(max_s: float, threshold: float = 0.15) -> None:
    """Wait (at most ``max_s``) until the machine's cores are busy less than ``threshold`` over 2 s."""
    deadline = time.monotonic() + max_s
    while True:
        b0, t0 = busy_cpu_s(), time.perf_counter()
        time.sleep(2.0)
        share = (busy_cpu_s() - b0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        if share < threshold or time.monotonic() >= deadline:
            if share >= threshold:
                print(f"  (machine still {share:.0%} busy after waiting {max_s:.0f} s; running anyway)", flush=True)
            return


def spawn(args: argparse.Namespace, row: str, cache_dir: str, label: str) -> Dict[str, Any]:
    fresh = not os.path.isdir(cache_dir) or not os.listdir(cache_dir)
    fd, out = tempfile.mkstemp(prefix=f"overhead-{row}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, os.path.abspath(__file__), "--row", row, "--json-out", out,
           "--steps", str(args.steps), "--threads", str(args.threads), "--batch", str(args.batch),
           "--vocab", str(args.vocab), "--seq", str(args.seq), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--profile", str(args.profile), "--profile-top", str(args.profile_top)]
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    print(f"[{label}] running (cache dir {'fresh' if fresh else 'reused'}: {cache_dir})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"row {label} failed with exit code {proc.returncode}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    res.update(label=label, cache_fresh=fresh, process_s=time.perf_counter() - t0)
    print(f"[{label}] first {res['first_step_s']:.2f} s, median {res['median_step_s'] * 1e3:.1f} ms, "
          f"min {res['min_step_s'] * 1e3:.1f} ms, peak RSS {res['peak_rss_mib']:.0f} MiB, "
          f"other processes' CPU {res['foreign_cpu_first']:.0%} (first) {res['foreign_cpu']:.0%} (rest)", flush=True)
    if res["caches"]:
        print(f"[{label}] compile caches: {res['caches']}", flush=True)
    return res


def best_of(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row from repeated runs: the fastest first step and fastest median step (other load only adds time)."""
    by_first = min(runs, key=lambda r: r["first_step_s"])
    by_median = min(runs, key=lambda r: r["median_step_s"])
    out = dict(by_median)
    out.update(first_step_s=by_first["first_step_s"], foreign_cpu_first=by_first["foreign_cpu_first"],
               first_step_cpu_s=by_first["first_step_cpu_s"],
               cache_fresh=all(r["cache_fresh"] for r in runs), min_step_s=min(r["min_step_s"] for r in runs),
               peak_rss_mib=max(r["peak_rss_mib"] for r in runs), runs=len(runs))
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """Ratios are against the inductor row of the same cache state (a warm zinf vs a warm inductor)."""
    bases = {r["cache_fresh"]: r for r in results if r["row"] == "inductor"}

    def ratio(r: Dict[str, Any], key: str) -> float:
        base = bases.get(r["cache_fresh"] or r["row"] == "eager") or next(iter(bases.values()), None)
        return r[key] / base[key] if base else float("nan")

    def mark(value: float, goal: float, row: str) -> str:
        return ("PASS" if value <= goal else "MISS") if row == "zinf" and value == value else ""

    head = (f"{'row':<25}{'params':>11}{'cache':>6}{'first s':>9}{'first x':>8}{'':>5}{'1st cpu s':>10}"
            f"{'median ms':>10}{'step x':>7}{'':>5}{'min ms':>8}{'cpu ms':>8}{'cpu x':>6}{'RSS MiB':>8}{'loss':>8}"
            f"{'other':>10}")
    lines = [head, "-" * len(head)]
    for r in results:
        first_x, step_x, cpu_x = ratio(r, "first_step_s"), ratio(r, "median_step_s"), ratio(r, "median_step_cpu_s")
        cache = "-" if r["row"] == "eager" else ("cold" if r["cache_fresh"] else "warm")
        lines.append(f"{r['label']:<25}{r['params']:>11,}{cache:>6}{r['first_step_s']:>9.2f}{first_x:>8.2f}"
                     f"{mark(first_x, COMPILE_GOAL, r['row']):>5}{r['first_step_cpu_s']:>10.1f}"
                     f"{r['median_step_s'] * 1e3:>10.1f}{step_x:>7.2f}{mark(step_x, STEP_GOAL, r['row']):>5}"
                     f"{r['min_step_s'] * 1e3:>8.1f}"
                     f"{r['median_step_cpu_s'] * 1e3:>8.0f}{cpu_x:>6.2f}{r['peak_rss_mib']:>8.0f}"
                     f"{r['losses'][-1]:>8.4f}{r['foreign_cpu_first']:>5.0%}/{r['foreign_cpu']:<4.0%}")
    lines += [
        f"goals (zinf vs inductor): median step <= {STEP_GOAL}x, first step (includes compile) <= {COMPILE_GOAL}x",
        "first: wall time of step 1 (compile + run); 1st cpu: its CPU time incl. compile workers;\n"
        "median/min: wall time of the later steps; cpu: median CPU time of this process per step (all threads);\n"
        "x: ratio to the inductor row of the same cache state (cold/warm);\n"
        "other: share of all cores used by other processes during the first / the later steps",
    ]
    busy = [r["label"] for r in results if max(r["foreign_cpu"], r["foreign_cpu_first"]) > 0.1]
    if busy:
        lines.append(f"WARNING: other processes used >10% of the cores during {busy}; wall times there are "
                     "inflated and noisy (see min ms / cpu ms, or rerun on an idle machine)")
    return "\n".join(lines)


def save(path: str, args: argparse.Namespace, runs: List[Dict[str, Any]], results: List[Dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": results, "runs": runs}, f, indent=1)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {ROWS}")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the first (median reported)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                   else os.cpu_count() or 1, help="torch threads, same in every row (default: all usable cores)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--warm-cache", metavar="DIR", nargs="?", const="", default=None,
                       help="share one Inductor cache dir between rows (default: a new temp dir)")
    cache.add_argument("--cold-and-warm", action="store_true", help="run each compiled row cold, then warm")
    p.add_argument("--profile", type=int, default=0, metavar="K", help="profile K steady-state steps per row")
    p.add_argument("--profile-top", type=int, default=25, help="ops listed in each profile table")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run every row R times (round-robin, fresh process each) and report the best of R")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each row, wait up to S seconds for other processes to leave the cores idle")
    p.add_argument("--json", metavar="PATH", help="write all results here")
    p.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # subprocess mode
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.row:
        res = run_row(args)
        with open(args.json_out, "w") as f:
            json.dump(res, f)
        return

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {ROWS}")
    tmp = tempfile.mkdtemp(prefix="zinf-overhead-")
    shared = None
    if args.warm_cache is not None:
        shared = args.warm_cache or os.path.join(tmp, "shared")
    runs: List[Dict[str, Any]] = []
    try:
        for rep in range(args.repeat):  # round-robin, so slow phases of a busy machine hit every row
            for row in rows:
                cache_dir = shared or os.path.join(tmp, f"{row}-{rep}")
                runs.append(spawn(args, row, cache_dir, row))
                if args.cold_and_warm and row != "eager":
                    runs.append(spawn(args, row, cache_dir, f"{row} (warm)"))
                if args.json:  # partial results survive a later failure
                    save(args.json, args, runs, [])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    labels = dict.fromkeys(r["label"] for r in runs)  # first-seen order
    results = [best_of([r for r in runs if r["label"] == label]) for label in labels]
    r0 = results[0]
    print(f"\nGPT vocab {args.vocab}, seq {args.seq}, layers {args.layers}, hidden {args.hidden}, heads {args.heads}, "
          f"batch {args.batch}, {r0['params']:,} parameters, "
          f"{r0['threads']} threads, torch {r0['torch']}, {args.steps} timed steps after the first"
          + (f", best of {args.repeat} runs per row" if args.repeat > 1 else ""))
    print(table(results))
    if args.json:
        save(args.json, args, runs, results)


if __name__ == "__main__":
    main()
