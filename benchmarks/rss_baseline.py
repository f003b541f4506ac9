"""What a process weighs before any model state: peak RSS of each system's software stack.

Why: ``benchmarks/compare.py`` sums each row's peak RSS over its ranks, and on the 25M model the
model states are small beside the code and caches a process loads (torch, the compiler stack,
DeepSpeed). This measures that floor, a fresh process per row, with a toy model (two 64 x 64
linears: 33 KB of parameters) so the stack is all there is::

    python benchmarks/rss_baseline.py            # every row
    python benchmarks/rss_baseline.py torch zinf # some rows

Rows:
- ``torch``: ``import torch``;
- ``fsdp2``: ``fully_shard`` imported and one eager training step of the toy (what an FSDP2 row loads);
- ``inductor``: one training step of the toy under ``torch.compile`` (Dynamo, AOTAutograd, Inductor;
  Dynamo imports Triton when it is installed, at import);
- ``zinf``: one training step of the toy under ``backend="zinf"`` (the same stack, plus zinf);
- ``deepspeed``: ``import deepspeed`` (skipped with the reason when it is not installed).

Each row prints its ``VmHWM`` and ``VmRSS`` in MiB and whether Triton was imported. A row is one
process at dp 1: multiply by the ranks for a dp-2 row's share of compare.py's sum.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Dict, List

TOY = "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))\n"


def _step(wrap: str = "") -> str:
    """The toy's one training step, ``wrap`` (e.g. a compile) applied to it first."""
    return TOY + wrap + "m(torch.randn(8, 64)).sum().backward()"


ROWS: Dict[str, str] = {
    "torch": "import torch",
    "fsdp2": "import torch\nfrom torch.distributed.fsdp import fully_shard\n" + _step(),
    "inductor": "import torch\n" + _step("m = torch.compile(m)\n"),
    "zinf": "import torch, zinf_compile\n" + _step("m = torch.compile(m, backend='zinf')\n"),
    "deepspeed": "import torch, deepspeed",
}

REPORT = """
import sys, json
d = dict(l.split(":", 1) for l in open("/proc/self/status") if l.startswith(("VmHWM", "VmRSS")))
print(json.dumps({k: int(v.split()[0]) // 1024 for k, v in d.items()} | {"triton": "triton" in sys.modules}))
"""


def code_of(row: str) -> str:
    return ROWS[row] + "\n" + REPORT


def main(rows: List[str]) -> None:
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {list(ROWS)}")
    print("| stack | peak RSS MiB (VmHWM) | RSS at end MiB | Triton imported |")
    print("|---|---|---|---|")
    for row in rows:
        p = subprocess.run([sys.executable, "-c", code_of(row)], capture_output=True, text=True)
        if p.returncode != 0:
            why = (p.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"| {row} | - | - | did not run: {why[:120]} |")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"| {row} | {r['VmHWM']} | {r['VmRSS']} | {r['triton']} |")


if __name__ == "__main__":
    main(sys.argv[1:] or list(ROWS))
