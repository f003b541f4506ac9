"""dp = 2 worker for tests/test_hf_models.py, launched by torchrun: trains Hugging Face models under zinf.

``hf_dp.py OUT CASES_JSON STEPS``: CASES_JSON maps a model name (tests/workers/hf_common.py) to its
zinf options. The models train one after another in this process pair (one launch: the import of
torch and transformers is paid once). Each rank takes its half of every global batch, steps
``zinf_compile.optim.SGD`` with momentum (tests/conftest.py says why not Adam across dp), and rank 0
writes, per model: the global losses (mean over ranks: equal label counts per half), the first
step's full gradients (gathered from every rank's shards before the step: a collective), the full
state dict and the bytes of this rank's parameter shards, to ``OUT`` (``torch.save``). A model that
fails records its error instead, and the others still run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import zinf_compile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import zinf_full_grads  # noqa: E402
from hf_common import batches, loss_fn, make_model  # noqa: E402

SGD = dict(lr=0.1, momentum=0.9)
GLOBAL_ROWS = 4
_TIER = {"none": "device", "cpu": "cpu", "nvme": "nvme"}


def train(name: str, options: dict, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = make_model(name)
    cmodel = torch.compile(model, backend="zinf", options=options)
    opt = zinf_compile.optim.SGD(model.parameters(), **SGD)
    per = GLOBAL_ROWS // world
    losses, grads = [], {}
    for step, b in enumerate(batches(name, steps, rows=GLOBAL_ROWS)):
        mine = tuple(t[rank * per:(rank + 1) * per] for t in b)
        loss = loss_fn(cmodel, mine)
        loss.backward()
        if step == 0:
            grads = zinf_full_grads(model)  # collective: every rank
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    stats = zinf_compile.memory_stats(model)
    shard = stats[_TIER[options.get("offload_params", "none")]]["param"]["current"]
    full = zinf_compile.full_state_dict(model, rank0_only=True)
    return {"losses": losses, "grads": grads, "state": full, "param_shard_bytes": shard,
            "param_bytes": sum(4 * p.numel() for p in model.parameters())}


def main(out: str, cases_json: str, steps: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for name, options in json.loads(cases_json).items():
        torch._dynamo.reset()
        nvme = options.get("nvme_path")
        if nvme:  # one folder per model and rank pair; the runtime makes each rank's own inside
            os.makedirs(nvme, exist_ok=True)
        try:
            results[name] = train(name, options, steps)
        except Exception as e:  # noqa: BLE001 - one model's failure must not hide the others'
            results[name] = {"error": f"{e!r}\n{traceback.format_exc()[-4000:]}"}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
