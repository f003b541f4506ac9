"""Aggregate slow-memory -> compute bandwidth of fetching every parameter: bandwidth-centric vs broadcast.

Why: ZeRO-Infinity's bandwidth-centric partitioning (issue 9) has every rank read 1/dp of each
parameter from its own slow memory and all-gather the rest, so all ranks' slow-memory links work
at once; the classic single-owner scheme has one rank read the whole parameter and broadcast it,
so one link works at a time. Both are zinf's own runtime, the same parameters, the same bytes:

    bandwidth-centric  ``partition="bandwidth"`` (the default): ``ParamHandle.fetch_shard`` (this
                       rank's 1/dp shard from its tier: CPU memory, or NVMe through the swap engine
                       into a pooled host buffer, then a copy to the compute device) +
                       ``ParamHandle.all_gather`` + ``release``, for every partitioned parameter
    broadcast          ``partition="broadcast"`` (``zinf_runtime.broadcast``): each parameter has one
                       owner rank (balanced by bytes) holding it whole on its tier; the same three
                       calls read it on the owner (the others read nothing) and ``dist.broadcast`` it

Both fetch every parameter once per pass, one parameter at a time (no prefetch, as zinf's serial
schedule), and read the same bytes from slow memory in total (the model's fp32 parameters; the
bandwidth-centric shards add the padding to a multiple of dp). Reported per configuration (tier x dp
x scheme): GB/s = fp32 parameter bytes / seconds of the pass (the slowest rank's), i.e. the rate at
which every rank receives the whole model; the median of ``--repeat`` passes, the schemes
alternating; and the ratio bandwidth-centric / broadcast.

What this machine can and cannot show: dp = 2 runs two processes (torchrun, gloo) on one machine,
so both ranks share one disk, one memory bus and (here) two CPU cores. Bandwidth-centric reading
only multiplies bandwidth when each rank has its own link (one NVMe / PCIe lane per GPU); here the
ranks' 1/dp reads compete for the same disk. The figures say what zinf's scheme costs against the
single-owner scheme on this hardware, not what it gains on a DGX-2. Swap files use O_DIRECT (the
page cache is not involved; ``direct_io`` is reported).

    python benchmarks/fetch_bandwidth.py                       # cpu + nvme tiers, dp 1 and 2
    python benchmarks/fetch_bandwidth.py --tiers nvme --dp 2 --repeat 7 --out benchmarks/results
    python benchmarks/fetch_bandwidth.py --quick --dp 1        # tiny model (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
FULL = dict(vocab=8192, seq=128, layers=21, hidden=512, heads=8)  # ~70M, as benchmarks/overlap.py
QUICK = dict(vocab=256, seq=32, layers=2, hidden=64, heads=4)
SCHEMES = ("bandwidth-centric", "broadcast")
PARTITION = {"bandwidth-centric": "bandwidth", "broadcast": "broadcast"}  # the zinf option of each


# ---------------------------------------------------------------------------------------------
# worker: one process per rank
# ---------------------------------------------------------------------------------------------

def fetch_pass(handles: List[Any]) -> None:
    """zinf's own fetch of every parameter: this rank's shard (broadcast: the whole parameter on its
    owner, nothing elsewhere), all-gathered (broadcast: broadcast from the owner), then released."""
    import torch

    from zinf_runtime.store import ParamHandle

    for h in handles:
        full = h.all_gather(h.fetch_shard(torch.float32))
        ParamHandle.release(full)


def timed(fn: Any, world: int) -> float:
    """Seconds of ``fn()`` on the slowest rank (barriers around it)."""
    import torch
    import torch.distributed as dist

    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    if world > 1:
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dt = float(t.item())
    return dt


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from zinf_compile.config import Config
    from zinf_compile.models import GPT, GPTConfig
    from zinf_runtime import store
    from zinf_runtime.context import RuntimeContext
    from zinf_runtime.store import Placement

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    dims = model_dims(args)
    cfg = GPTConfig(**dims)
    d = Config()
    root = os.path.abspath(args.nvme_path or tempfile.mkdtemp(prefix="zinf-fetchbw-", dir="/tmp"))
    own_tmp = args.nvme_path is None and rank == 0
    results: List[Dict[str, Any]] = []
    try:
        for tier in args.tiers.split(","):
            from zinf_runtime.swap import SwapConfig

            swap = SwapConfig(root, block_size=d.swap_block_size, queue_depth=d.swap_queue_depth,
                              buffer_count=d.swap_buffer_count, buffer_size=d.swap_buffer_size)
            parts: Dict[str, Any] = {}
            for scheme in SCHEMES:  # the same initial values, partitioned each way, each in its own context
                torch.manual_seed(0)
                model = GPT(cfg)
                named = list(dict((id(p), (n, p)) for n, p in model.named_parameters()).values())  # tied once
                param_bytes = sum(4 * p.numel() for _, p in named)
                ctx = RuntimeContext(name=f"fetch_bandwidth {tier} {scheme}")
                pl = Placement(tier=tier, compute_device=torch.device("cpu"), group=None,
                               swap=swap if tier == "nvme" else None, context=ctx, partition=PARTITION[scheme])
                handles = [store.get(uid) for uid in store.partition(named, pl)]
                parts[scheme] = (model, handles, ctx)
                del model, named  # parts holds the only references: freed before their context closes
            with torch.no_grad():
                for s in SCHEMES:  # warm-up: pools, engine threads, gloo buffers
                    fetch_pass(parts[s][1])
                times: Dict[str, List[float]] = {s: [] for s in SCHEMES}
                for k in range(args.repeat):
                    order = SCHEMES if k % 2 == 0 else SCHEMES[::-1]
                    for s in order:
                        times[s].append(timed(lambda: fetch_pass(parts[s][1]), world))
            for s in SCHEMES:
                handles, ctx = parts[s][1:]
                med = statistics.median(times[s])
                engines = ctx.engines()
                results.append({
                    "tier": tier, "dp": world, "scheme": s, "partition": PARTITION[s], "emulated": False,
                    "param_bytes": param_bytes, "median_s": med, "min_s": min(times[s]), "times_s": times[s],
                    "gbps": param_bytes / med / 1e9,
                    "slow_read_bytes_this_rank": sum(4 * h.shard_numel for h in handles),
                    "direct_io": all(e.stats()["direct_io"] for e in engines) if engines else None,
                })
            del handles, ctx, engines
            contexts = [parts[s][2] for s in SCHEMES]
            parts.clear()  # the parameters go first (their finalizers drop swap files) ...
            gc.collect()
            leaked = [h.name for h in store.handles() if h.context in contexts]
            if leaked:
                raise RuntimeError(f"fetch_bandwidth: {len(leaked)} parameters outlive their context, e.g. {leaked[:3]}")
            for ctx in contexts:  # ... then the swap engines close
                ctx.close()
            del contexts, ctx
        if rank == 0:
            with open(args.json_out, "w") as f:
                json.dump({"results": results, "load1": os.getloadavg()[0], "torch": torch.__version__}, f)
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def model_dims(args: argparse.Namespace) -> Dict[str, int]:
    base = QUICK if args.quick else FULL
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}


def launch(args: argparse.Namespace, dp: int, tmp: str) -> Dict[str, Any]:
    out = os.path.join(tmp, f"dp{dp}.json")
    worker = [os.path.abspath(__file__), "--worker", "--json-out", out, "--tiers", args.tiers,
              "--repeat", str(args.repeat), "--threads", str(args.threads)]
    for k, v in model_dims(args).items():
        worker += [f"--{k}", str(v)]
    if args.quick:
        worker.append("--quick")
    worker += ["--nvme-path", args.nvme_path or tmp]  # one folder for every rank (each gets its own subfolder)
    if dp == 1:
        cmd = [sys.executable] + worker
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(dp),
               "--master-addr", "127.0.0.1", "--master-port", str(port)] + worker
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"[dp={dp}] running", flush=True)
    proc = subprocess.run(cmd, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"dp={dp} failed with exit code {proc.returncode}")
    with open(out) as f:
        return json.load(f)


def report(args: argparse.Namespace, runs: Dict[int, Dict[str, Any]], meta: Dict[str, Any]) -> str:
    dims = model_dims(args)
    rows = [r for dp in sorted(runs) for r in runs[dp]["results"]]
    pbytes = rows[0]["param_bytes"] if rows else 0
    lines = [f"# fetch_bandwidth.py: {meta['date']}", "",
             f"command: `{meta['command']}`  ", f"git: {meta['git']}  ",
             f"parameters: GPTConfig({', '.join(f'{k}={v}' for k, v in dims.items())}), "
             f"{pbytes / 2**20:.1f} MiB fp32 fetched per pass; median of {args.repeat} passes per scheme, "
             f"schemes alternating; {args.threads} threads per process  ",
             f"machine: {os.cpu_count()} cores, load average at start {meta['load_start']}  ", "",
             "| tier | dp | scheme | pass s (median) | min s | GB/s | slow-memory bytes read by rank 0 | O_DIRECT |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['dp']} | {r['scheme']} | {r['median_s']:.4f} | {r['min_s']:.4f} | "
                     f"{r['gbps']:.3g} | {r['slow_read_bytes_this_rank'] / 2**20:.1f} MiB | "
                     f"{'-' if r['direct_io'] is None else r['direct_io']} |")
    lines += ["", "| tier | dp | bandwidth-centric GB/s | broadcast GB/s | ratio bc/broadcast |",
              "|---|---|---|---|---|"]
    ratios: Dict[str, float] = {}
    for dp in sorted(runs):
        by = {(r["tier"], r["scheme"]): r for r in runs[dp]["results"]}
        for tier in args.tiers.split(","):
            a, b = by.get((tier, SCHEMES[0])), by.get((tier, SCHEMES[1]))
            if a and b:
                ratios[f"{tier}/dp{dp}"] = a["gbps"] / b["gbps"]
                lines.append(f"| {tier} | {dp} | {a['gbps']:.3g} | {b['gbps']:.3g} | {a['gbps'] / b['gbps']:.2f} |")
    lines += ["",
              "- GB/s = fp32 parameter bytes / seconds of one pass fetching every parameter (slowest rank): the "
              "rate at which every rank receives the whole model",
              "- both schemes are zinf's runtime: partition=\"bandwidth\" (1/dp per rank, all-gather) and "
              "partition=\"broadcast\" (one owner per parameter, balanced by bytes, reads it whole from its "
              "slow memory, then dist.broadcast)",
              "- dp = 2 is two processes on ONE machine (gloo): both ranks share one disk and one memory bus, so "
              "bandwidth-centric reading cannot add link bandwidth here as it does with one NVMe/PCIe link per GPU",
              "- at dp = 1 both schemes are the same code path (one rank owns everything): their ratio there is "
              "the harness's noise floor, not a partitioning effect",
              f"- load average at end {meta['load_end']}"]
    meta["ratios"] = ratios
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--dp", default="1,2", help="comma-separated data-parallel sizes (default 1,2)")
    p.add_argument("--tiers", default="cpu,nvme", help="comma-separated parameter tiers: cpu, nvme")
    p.add_argument("--repeat", type=int, default=None, help="timed passes per scheme (default 5; --quick 1)")
    p.add_argument("--quick", action="store_true", help="tiny model: a smoke test, not a measurement")
    for k in ("vocab", "seq", "layers", "hidden", "heads"):
        p.add_argument(f"--{k}", type=int, default=None, help=f"model size (default {FULL[k]}; --quick {QUICK[k]})")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temp dir in /tmp)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a launch is killed")
    p.add_argument("--out", default=None, metavar="DIR", help="write NAME.json and NAME.md here")
    p.add_argument("--name", default="fetch_bandwidth", help="file name stem under --out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 1 if args.quick else 5
    tiers = [t for t in args.tiers.split(",") if t]
    if not tiers or any(t not in ("cpu", "nvme") for t in tiers) or args.repeat < 1:
        p.error(f"--tiers takes cpu and/or nvme (got {args.tiers!r}); --repeat must be >= 1")
    if args.nvme_path and not os.path.isdir(args.nvme_path):
        p.error(f"--nvme-path {args.nvme_path!r} is not a directory; create it first")
    if args.worker:
        run_worker(args)
        return 0
    try:
        dps = sorted({int(v) for v in args.dp.split(",") if v.strip()})
    except ValueError:
        p.error(f"--dp takes comma-separated ints, got {args.dp!r}")
    if not dps or min(dps) < 1:
        p.error("--dp values must be >= 1")
    sys.path.insert(0, HERE)
    from overlap import git_describe

    meta: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__))] + (argv or sys.argv[1:])),
        "git": git_describe(), "load_start": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }
    tmp = tempfile.mkdtemp(prefix="zinf-fetchbw-")
    runs: Dict[int, Dict[str, Any]] = {}
    try:
        for dp in dps:
            runs[dp] = launch(args, dp, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta["load_end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    text = report(args, runs, meta)
    print("\n" + text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump({"args": vars(args), "meta": meta, "model": model_dims(args),
                       "results": [r for dp in sorted(runs) for r in runs[dp]["results"]],
                       "ratios": meta["ratios"]}, f, indent=1)
        with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
