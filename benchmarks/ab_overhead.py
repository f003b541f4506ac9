"""Variants of one training step measured in one process (per rank), with their steps interleaved.

Why: on a shared VM the same row run twice in fresh processes differs by up to 25% (README,
"How far to trust a ratio"), more than the differences being measured. Here every variant is built
in one process and the rounds alternate (one step of each per round), so drift hits all alike; the
ratio is each variant's median step over the first variant's. Not a replacement for
``benchmarks/compare.py`` (fresh processes, peak RSS), a sharper tool for one ratio.

    python benchmarks/ab_overhead.py inductor zinf                       # GPT 25M, batch 4, 8 rounds
    SIZE=large ROUNDS=5 python benchmarks/ab_overhead.py inductor zinf   # GPT-2 small, 124M
    python benchmarks/ab_overhead.py inductor zinf 'zinf_serial={"disabled_passes":["plan_schedule","schedule","carry"]}'
    PROF=25 python benchmarks/ab_overhead.py inductor zinf               # + per-op self time per step
    PROF=25 PROF_SORT=diff python benchmarks/ab_overhead.py inductor zinf  # the ops that differ most
    torchrun --nproc-per-node 2 benchmarks/ab_overhead.py fsdp2-cpu \\
        'zinf-cpu={"offload_params":"cpu","offload_optimizer":"cpu"}'    # dp 2 on gloo, global batch 4

``SIZE`` is one of ``compare.py``'s sizes (quick, small, large); ``JSON=path`` also writes the figures
below as JSON (``compare.py --interleave`` reads them).

A variant is ``name`` or ``name={json options for backend="zinf"}``:
- a name starting with "inductor" is ``torch.compile(model)`` with ``torch.optim.AdamW``;
- "eager" is the model itself with ``torch.optim.AdamW``;
- "fsdp2" / "fsdp2-cpu" are ``fully_shard`` on each block and the root, without / with
  ``CPUOffloadPolicy`` (dp > 1 only), built as ``benchmarks/compare.py`` builds them;
- any other name is zinf (offload off unless the options say otherwise) with ``zinf_compile.optim.AdamW``.
Same model (seed 0), same global batch and the same AdamW settings as ``compare.py`` (``ADAM=fused``
for its ``--adam fused``); under torchrun each rank takes its contiguous slice, a step
starts after a barrier and its time is the slowest rank's (as in ``compare.py``). Threads: THREADS,
default the machine's cores divided by the ranks.
"""
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _compare_worker import adamw_kwargs  # noqa: E402  (compare.py's optimizer settings, every variant)
from compare import SIZES  # noqa: E402  (compare.py's model sizes; that module imports no torch)
from step_phases import thread_cpu  # noqa: E402  (per-thread CPU from /proc/self/task)

ADAM = os.environ.get("ADAM", "default")
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
if world > 1:
    dist.init_process_group("gloo")
torch.set_num_threads(int(os.environ.get("THREADS", max(1, (os.cpu_count() or 1) // world))))
size = os.environ.get("SIZE", "small")
if size not in SIZES:
    raise SystemExit(f"SIZE={size!r}: use one of {', '.join(SIZES)} (benchmarks/compare.py's sizes)")
c = SIZES[size]
B = int(os.environ.get("BATCH", 4))
if B % world:
    raise SystemExit(f"BATCH={B} is not divisible by the {world} ranks")
per = B // world
g = torch.Generator().manual_seed(1)
x = torch.randint(0, c["vocab"], (B, c["seq"]), generator=g)
y = torch.randint(0, c["vocab"], (B, c["seq"]), generator=g)
x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
Step = Callable[[], float]


def build(name: str, opts: str) -> Step:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**c))
    if name.startswith("fsdp2"):
        from _compare_worker import _fsdp2
        if world < 2:
            raise SystemExit(f"variant {name!r} needs torchrun with --nproc-per-node >= 2")
        inner, _ = _fsdp2(model, offload=name == "fsdp2-cpu", adam=ADAM)
        return lambda: float(inner(x, y).detach())
    if name.startswith("inductor") or name == "eager":
        run = torch.compile(model) if name != "eager" else model
        opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs(ADAM))
    else:
        o = dict(offload_params="none", offload_optimizer="none")
        o.update(json.loads(opts or "{}"))
        if "nvme" in (o["offload_params"], o["offload_optimizer"]) and "nvme_path" not in o:
            import tempfile
            o["nvme_path"] = tempfile.mkdtemp(prefix=f"zinf-ab-{name}-r{rank}-")
        run = torch.compile(model, backend="zinf", options=o)
        opt = zinf_compile.optim.AdamW(model.parameters(), **adamw_kwargs(ADAM))

    def step() -> float:
        loss = run(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def zinf_threads_cpu() -> float:
    """CPU seconds so far of this process's zinf threads (IO, copy lanes, optimizer overlap: their names
    start with "zinf"), from ``step_phases.thread_cpu``. Why: interleaved with a peer, work zinf left
    running after its step returned would slow the peer's step and flatter zinf's ratio; ``timed``
    books it to the step it ran in."""
    return sum(cpu for name, (cpu, _, _) in thread_cpu().items() if name.startswith("zinf"))


def timed(step: Step) -> Tuple[float, float, float, float]:
    """(slowest rank's seconds, CPU seconds of all ranks' threads, loss, CPU seconds of zinf's threads
    on all ranks) of one step started after a barrier. The CPU figure tells a step bound by the cores
    (CPU s / wall s near the core count) from one waiting for the disk or a peer; it includes what IO
    threads still did for the step before."""
    if world > 1:
        dist.barrier()
    z0 = zinf_threads_cpu()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = step()
    t = torch.tensor([time.perf_counter() - t0])
    cpu = torch.tensor([time.process_time() - c0, zinf_threads_cpu() - z0])
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
    return float(t), float(cpu[0]), loss, float(cpu[1])


variants: Dict[str, Step] = {}
for spec in sys.argv[1:]:
    name, _, opts = spec.partition("=")
    variants[name] = build(name, opts)
for n, v in variants.items():
    for _ in range(2):
        v()
times: Dict[str, List[float]] = {n: [] for n in variants}
cpus: Dict[str, List[float]] = {n: [] for n in variants}
zinf_cpus: Dict[str, List[float]] = {n: [] for n in variants}  # zinf's threads' CPU s in each variant's steps
losses: Dict[str, float] = {}
for r in range(int(os.environ.get("ROUNDS", 8))):
    # odd rounds run the variants in reverse order (ABBA): a variant that always ran right after
    # another would inherit its cache and allocator state, a bias the same in every round
    for n, v in (variants.items() if r % 2 == 0 else reversed(list(variants.items()))):
        t, cpu, losses[n], zcpu = timed(v)
        times[n].append(t)
        cpus[n].append(cpu)
        zinf_cpus[n].append(zcpu)
first = next(iter(times))
base = statistics.median(times[first])


def quartiles(xs: List[float]) -> Tuple[float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


if rank == 0:
    print(f"SIZE={size} BATCH={B} dp={world} threads/rank={torch.get_num_threads()} rounds={len(times[n])}")
    summary: Dict[str, Dict[str, object]] = {}
    for n, ts in times.items():
        m = statistics.median(ts)
        # the paired ratio: each round's step over the first variant's step of the same round, so
        # drift between rounds cancels; its quartiles say how far one run's ratio can be trusted
        paired = [t / b for t, b in zip(ts, times[first])]
        lo, hi = quartiles(paired)
        print(f"{n:24s} median {m:.3f}  ratio {m/base:.3f}  paired {statistics.median(paired):.3f} "
              f"(IQR {lo:.3f}-{hi:.3f})  min {min(ts):.3f}  max {max(ts):.3f}  "
              f"cpu s {statistics.median(cpus[n]):.3f} (zinf threads {sum(zinf_cpus[n]) / len(ts):.3f})  "
              f"last loss {losses[n]:.4f}")
        summary[n] = {"median_step_s": m, "step_s": ts, "paired": paired, "paired_median": statistics.median(paired),
                      "paired_iqr": [lo, hi], "cpu_per_step_s": statistics.median(cpus[n]),
                      "zinf_threads_cpu_per_step_s": sum(zinf_cpus[n]) / len(ts), "last_loss": losses[n]}
    if os.environ.get("JSON"):  # for benchmarks/compare.py's interleaved goals (benchmarks/_interleaved.py)
        with open(os.environ["JSON"], "w") as f:
            json.dump({"size": size, "global_batch": B, "dp": world, "threads_per_rank": torch.get_num_threads(),
                       "adam": ADAM, "rounds": len(times[first]), "baseline": first, "variants": summary}, f, indent=1)
if os.environ.get("PROF"):
    from torch.profiler import profile, ProfilerActivity
    agg: Dict[str, Dict[str, List[float]]] = {n: {} for n in variants}
    for r in range(3):
        for n, v in variants.items():
            with profile(activities=[ProfilerActivity.CPU]) as p:
                v()
            for e in p.key_averages():
                d = agg[n].setdefault(e.key, [0.0, 0])
                d[0] += e.self_cpu_time_total / 3e3
                d[1] += e.count / 3
    if rank == 0:
        # PROF_SORT=diff ranks ops by the spread of their self time across variants (where an overhead
        # hides), the default by the largest self time (where the step goes)
        spread = os.environ.get("PROF_SORT") == "diff"

        def rank_key(k: str) -> float:
            t = [agg[n].get(k, [0.0])[0] for n in agg]
            return -(max(t) - min(t)) if spread else -max(t)
        keys = sorted({k for n in agg for k in agg[n]}, key=rank_key)[:int(os.environ["PROF"])]
        print("op".ljust(50), *[n[:14].rjust(15) for n in agg])
        for k in keys:
            print(k[:50].ljust(50), *[(f"{agg[n].get(k, [0, 0])[0]:8.1f}ms/{agg[n].get(k, [0, 0])[1]:4.0f}").rjust(15)
                                       for n in agg])
        for n in agg:
            print(n, "total self ms", round(sum(v[0] for v in agg[n].values()), 1))
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
