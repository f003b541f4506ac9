"""Optimizer step time on zinf's CPU shards: torch.optim.AdamW default vs ``fused=True``.

Why: any torch.optim optimizer steps zinf's shards unchanged (runtime/optim_adapt.py), so the flags a
user passes are honoured; on CPU ``fused=True`` is torch's fast AdamW kernel (foreach is not
CPU-enabled). This measures what that flag buys on the optimizer-tier shards, with eager PyTorch's
step on the full parameters beside it as the baseline of the same run.

One process; the rows are interleaved round-robin (``--repeat``) so a change of machine load hits every
row alike, and each row keeps its median over all timed steps. Only ``optimizer.step()`` is timed (the
gradients stay in place between steps, so every step does the same work). Load average is printed:
the figures are a ratio measured in one run, not clean absolute times on a shared machine.

    python benchmarks/optimizer_step.py --hidden 512 --layers 8 --steps 5 --repeat 3
    python benchmarks/optimizer_step.py --hidden 384 --layers 12 --profile "zinf fused"

``--profile ROW`` runs that row's steps under cProfile instead and prints where its time goes, by
function (cumulative), e.g. what zinf does around the class's own step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch


def build(args: argparse.Namespace):
    cfg = GPTConfig(vocab=8192, seq=64, layers=args.layers, hidden=args.hidden, heads=8, init_std=None)
    torch.manual_seed(0)
    base = GPT(cfg)
    rows = {}
    for name, fused, zinf in (("eager default", None, False), ("eager fused", True, False),
                              ("zinf default", None, True), ("zinf fused", True, True)):
        model = copy.deepcopy(base)
        run = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_optimizer": "cpu"}) \
            if zinf else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        run(*make_batch(cfg, 2, seed=0)).backward()  # gradients in place (shards for zinf)
        opt.step()  # state created; zinf converts the optimizer on this first step
        rows[name] = opt
    n = sum(p.numel() for p in base.parameters())
    return rows, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", default=None, help="profile this row's steps (e.g. 'zinf fused') instead")
    args = ap.parse_args()
    rows, n = build(args)
    if args.profile is not None:
        return profile(rows, args)
    times = {k: [] for k in rows}
    load0 = os.getloadavg()[0]
    for _ in range(args.repeat):
        for name, opt in rows.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"AdamW step over {n / 1e6:.1f}M parameters, {torch.get_num_threads()} threads, "
          f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| row | median step ms | x eager default |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1e3:.1f} | {v / med['eager default']:.2f} |")
    print(f"zinf fused / zinf default: {med['zinf fused'] / med['zinf default']:.2f}")


def profile(rows: dict, args: argparse.Namespace) -> None:
    """cProfile of ``args.steps`` steps of one row, by cumulative time: where the step goes."""
    import cProfile
    import pstats

    if args.profile not in rows:
        raise SystemExit(f"--profile {args.profile!r}: rows are {', '.join(rows)}")
    opt = rows[args.profile]
    opt.step()  # warm
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        opt.step()
    prof.disable()
    print(f"{args.profile}: {args.steps} steps under cProfile (its overhead included), by cumulative time")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
