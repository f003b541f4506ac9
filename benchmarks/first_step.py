"""Time the first forward + backward (the compile included) of the 25M GPT, in this fresh process.

Why: the first step is what a user waits for before anything trains, and zinf adds its passes to
Dynamo's and Inductor's work. Besides the wall time this counts ``GraphModule.recompile`` calls (FX's
Python code generation, which the pass runner used to repeat after every pass: ``zinf_compile.pipeline``)
and their seconds. One run is one sample; alternate systems or commits in fresh processes::

    python benchmarks/first_step.py --backend zinf --compiler eager
    python benchmarks/first_step.py --backend zinf --compiler inductor
    python benchmarks/first_step.py --backend inductor

Each run uses a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a temporary folder) unless the
caller set one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.fx

from zinf_compile.models import GPT, GPTConfig, make_batch

SMALL = dict(vocab=10240, seq=128, layers=12, hidden=384, heads=6)  # compare.py's 25.2M size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["zinf", "inductor", "aot_eager"], default="zinf")
    ap.add_argument("--compiler", choices=["eager", "inductor"], default="inductor",
                    help="zinf's compiler option (ignored for other backends)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cfg", default="{}", help="JSON GPTConfig fields replacing the 25M model's")
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="zinf-first-step-"))

    calls = {"n": 0, "s": 0.0}
    original = torch.fx.GraphModule.recompile

    def counted(self: torch.fx.GraphModule):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            calls["n"] += 1
            calls["s"] += time.perf_counter() - t0

    torch.fx.GraphModule.recompile = counted  # this process only: a measurement, not a feature
    cfg = GPTConfig(**{**SMALL, **json.loads(args.cfg)})
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.backend == "zinf":
        run = torch.compile(model, backend="zinf", options={"compiler": args.compiler})
    else:
        run = torch.compile(model, backend=args.backend)
    x, y = make_batch(cfg, args.batch, 0)
    t0 = time.perf_counter()
    run(x, y).backward()
    wall = time.perf_counter() - t0
    what = f"zinf (compiler {args.compiler})" if args.backend == "zinf" else args.backend
    print(json.dumps({"system": what, "first_step_s": round(wall, 2), "recompiles": calls["n"],
                      "recompile_s": round(calls["s"], 2), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
