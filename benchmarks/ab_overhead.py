"""zinf against Inductor without offload, measured in one process with the steps interleaved.

Why: on a shared VM the same row run twice in fresh processes differs by up to 20% (README,
"How far to trust a ratio"), more than the overhead being measured. Here every variant is compiled
in one process and the rounds alternate (one step of each per round), so drift hits all alike; the
ratio is each variant's median step over the first variant's. Not a replacement for
``benchmarks/compare.py`` (fresh processes, peak RSS), a sharper tool for one ratio.

    python benchmarks/ab_overhead.py inductor zinf                       # GPT 25M, batch 4, 8 rounds
    SIZE=large ROUNDS=5 python benchmarks/ab_overhead.py inductor zinf   # GPT-2 small, 124M
    python benchmarks/ab_overhead.py inductor zinf 'zinf_serial={"disabled_passes":["plan_schedule","schedule","carry"]}'
    PROF=25 python benchmarks/ab_overhead.py inductor zinf               # + per-op self time per step

A variant is ``name`` or ``name={json options for backend="zinf"}``; a name starting with
"inductor" is ``torch.compile(model)`` with ``torch.optim.AdamW``, any other is zinf (offload off
unless the options say otherwise) with ``zinf_compile.optim.AdamW``. Same model (seed 0), same batch.
"""
import json
import os
import statistics
import sys
import time

import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig
size = os.environ.get("SIZE", "small")
cfgs = {"small": dict(vocab=10240, seq=128, layers=12, hidden=384, heads=6),
        "large": dict(vocab=50304, seq=128, layers=12, hidden=768, heads=12)}
c = cfgs[size]
B = 4
g = torch.Generator().manual_seed(1)
x = torch.randint(0, c["vocab"], (B, c["seq"]), generator=g); y = torch.randint(0, c["vocab"], (B, c["seq"]), generator=g)
variants = {}
for spec in sys.argv[1:]:
    name, _, opts = spec.partition("=")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**c))
    if name.startswith("inductor"):
        run = torch.compile(model); opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        o = dict(offload_params="none", offload_optimizer="none"); o.update(json.loads(opts or "{}"))
        run = torch.compile(model, backend="zinf", options=o); opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-4)
    variants[name] = (run, opt)
def step(run, opt):
    loss = run(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


for n, v in variants.items():
    for _ in range(2): step(*v)
times = {n: [] for n in variants}
for r in range(int(os.environ.get("ROUNDS", 8))):
    for n, v in variants.items():
        t0 = time.perf_counter(); step(*v); times[n].append(time.perf_counter() - t0)
base = statistics.median(times[next(iter(times))])
for n, ts in times.items():
    m = statistics.median(ts)
    print(f"{n:24s} median {m:.3f}  ratio {m/base:.3f}  min {min(ts):.3f}")
if os.environ.get("PROF"):
    from torch.profiler import profile, ProfilerActivity
    agg = {n: {} for n in variants}
    for r in range(3):
        for n, v in variants.items():
            with profile(activities=[ProfilerActivity.CPU]) as p:
                step(*v)
            for e in p.key_averages():
                d = agg[n].setdefault(e.key, [0.0, 0])
                d[0] += e.self_cpu_time_total / 3e3; d[1] += e.count / 3
    keys = sorted({k for n in agg for k in agg[n]}, key=lambda k: -max(agg[n].get(k, [0])[0] for n in agg))[:int(os.environ["PROF"])]
    print("op".ljust(50), *[n[:14].rjust(15) for n in agg])
    for k in keys:
        print(k[:50].ljust(50), *[(f"{agg[n].get(k,[0,0])[0]:8.1f}ms/{agg[n].get(k,[0,0])[1]:4.0f}").rjust(15) for n in agg])
    for n in agg: print(n, "total self ms", round(sum(v[0] for v in agg[n].values()),1))
