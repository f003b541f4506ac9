"""What ``PartitionedParameter.__torch_function__`` costs a compiled training step.

Every torch call that takes a partitioned parameter outside Dynamo goes through it, including the
zinf ops a compiled graph runs, which return at its first test. It is what turns an eager read of
0-byte storage into ``PartitionedDataError`` instead of a crash (``runtime/eager_access.py``). One
process, one model; the steps alternate between the hook and ``nn.Parameter``'s own (disabled)
``__torch_function__``, so drift hits both alike. Prints the calls per step, the median steps and
their ratio.

    python benchmarks/eager_access_overhead.py                 # 4-layer, 128-wide GPT, Inductor
    python benchmarks/eager_access_overhead.py --hidden 512 --layers 8 --compiler eager
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime.store import PartitionedParameter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    a = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=64, layers=a.layers, hidden=a.hidden, heads=4)
    model = GPT(cfg)
    cm = torch.compile(model, backend="zinf", options={"compiler": a.compiler})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(cfg, a.batch, seed=0)

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad()
        cm(x, y).backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(3):
        step()
    hook = PartitionedParameter.__dict__["__torch_function__"]
    calls = [0]

    def counting(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return hook.__func__(cls, func, types, args, kwargs)

    PartitionedParameter.__torch_function__ = classmethod(counting)  # type: ignore[assignment]
    step()
    per_step = calls[0]
    on, off = [], []
    try:
        for _ in range(a.rounds):
            PartitionedParameter.__torch_function__ = hook  # type: ignore[assignment]
            on.append(step())
            PartitionedParameter.__torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore
            off.append(step())
    finally:
        PartitionedParameter.__torch_function__ = hook  # type: ignore[assignment]
    t_on, t_off = statistics.median(on), statistics.median(off)
    n = sum(p.numel() for p in model.parameters())
    print(f"GPT {a.layers}x{a.hidden} ({n / 1e6:.2f}M params), {a.compiler}, batch {a.batch}x64, {a.rounds} rounds")
    print(f"__torch_function__ calls per step: {per_step}")
    print(f"median step with the hook {t_on * 1e3:.2f} ms, without {t_off * 1e3:.2f} ms, ratio {t_on / t_off:.3f} "
          f"({(t_on - t_off) / max(per_step, 1) * 1e6:.1f} us per call)")


if __name__ == "__main__":
    main()
