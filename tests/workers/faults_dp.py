"""dp = 2 fault worker (torchrun, gloo) for tests/test_faults_dp.py.

Scenarios (argv: out_path scenarios options_json; scenarios comma-separated, run in order in one
process group: the mismatch scenarios leave it usable, a failed step does not, so it comes last):
* ``bad_input``: step 0 trains on both ranks; at step 1 rank 1's batch holds a token id past the
  vocabulary, so its forward raises (IndexError in the embedding) between two all-gathers;
* ``io_error``: parameters on NVMe; at step 1 rank 1's swap reads fail with EIO (a dying disk);
* ``shape_mismatch`` / ``shape_mismatch_init``: rank 1's model has one layer one unit wider; the
  parameters are partitioned at compile / by ``zinf_compile.init``;
* ``extra_layer``: rank 1's model has one more layer (two more parameters, the others equal):
  partitioning would broadcast two parameters rank 0 never sends.

Each rank writes ``out_path.<scenario>.<rank>`` (json): the error it got (type, text) and the seconds from the
start of the failing step to that error. A rank that failed first stays alive (it would in a
notebook, or while its launcher tears down), so its peers must learn of it from zinf, not from a
closed connection.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.models import GPT, MLP, GPTConfig, make_batch

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def write(out_path: str, rank: int, result: dict) -> None:
    with open(f"{out_path}.{rank}.tmp", "w") as f:
        json.dump(result, f)
    os.replace(f"{out_path}.{rank}.tmp", f"{out_path}.{rank}")


def gpt_steps(out_path: str, scenario: str, options: dict, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {"error": None, "type": None, "seconds": None, "steps": 0}
    for step in range(3):
        x, y = make_batch(CFG, 4, seed=10 * step + rank)
        if step == 1 and rank == 1:
            if scenario == "bad_input":
                x[1, 3] = CFG.vocab + 5  # a token id past the vocabulary: the embedding raises
            else:
                from zinf_runtime.swap import SwapEngine

                def dying_disk(self, fd, bufs, off):
                    raise OSError(errno.EIO, "Input/output error (injected on rank 1)")
                SwapEngine._sys_preadv = dying_disk
        t0 = time.time()
        try:
            loss = cmodel(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        except Exception as exc:  # noqa: BLE001 - the worker reports whatever it got
            result.update(error=str(exc), type=type(exc).__name__, seconds=time.time() - t0)
            return result
        result["steps"] += 1
    return result


def mismatch(scenario: str, rank: int) -> dict:
    dims = (16, 32, 32 + rank, 8)  # rank 1: layers.1 has 33 outputs, layers.2 33 inputs
    if scenario == "extra_layer":
        dims = (16, 32, 32, 8) + (8,) * rank
    torch.manual_seed(0)
    opts = {"compiler": "eager"}
    if scenario == "shape_mismatch_init":
        with zinf_compile.init(offload_params="cpu", compiler="eager") as zi:
            model = MLP(dims)
        opts = zi.options
    else:
        model = MLP(dims)
    cmodel = torch.compile(model, backend="zinf", options=opts)
    t0 = time.time()
    try:
        cmodel(torch.randn(4, 16)).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return {"error": str(exc), "type": type(exc).__name__, "seconds": time.time() - t0}
    return {"error": None, "type": None, "seconds": time.time() - t0}


def main(out_path: str, scenarios: str, options: dict) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FAULTS_PG_TIMEOUT", "90"))))
    rank = dist.get_rank()
    for scenario in scenarios.split(","):
        if scenario.startswith("shape_mismatch") or scenario == "extra_layer":
            result = mismatch(scenario, rank)
        else:
            result = gpt_steps(out_path, scenario, options, rank)
        write(f"{out_path}.{scenario}", rank, result)
    if rank == 1:  # stay alive until rank 0 has its answer (or give up): no closed connection tells it
        deadline = time.time() + 100
        while not os.path.exists(f"{out_path}.{scenario}.0") and time.time() < deadline:
            time.sleep(0.2)
    sys.stdout.flush()
    os._exit(0)  # the process group may be mid-collective: no destroy_process_group


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
