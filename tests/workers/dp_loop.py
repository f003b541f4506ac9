"""dp = 2 worker for training-loop semantics (launched by tests/test_dp_loop.py under torchrun).

Scenario ``train``: a model whose parameters have odd sizes (uneven shards, odd tiles), a buffer that
differs per rank before compile, and a parameter used only in eager code (replicated). Each rank takes
its half of the global batch; the loop clips with ``clip_grad_norm_(model.parameters())`` and steps SGD;
then ``model.state_dict()`` on every rank, and ``load_state_dict`` of the initial values.
Scenario ``plain``: the same loop with a plain ``torch.optim.SGD`` and no clipping.
Scenarios ``eval_alone`` / ``eval_vs_train``: rank 0 evaluates while rank 1 is idle / training.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import zinf_compile


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)  # weight 91 elements, bias 13: odd, so shards are padded
        self.fc2 = nn.Linear(13, 5)
        self.register_buffer("shift", torch.zeros(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x + self.shift)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))  # used only outside the compiled graph


def data(steps: int, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 7, generator=g), torch.randn(batch, 5, generator=g)) for _ in range(steps)]


def loss_of(net_out: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((net_out * scale - y) ** 2).mean()


def main(out_path: str, scenario: str, options_json: str, steps: int) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Outer()
    if rank == 1:
        with torch.no_grad():
            model.net.shift.fill_(1.0)  # rank 0's buffer must win
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cnet = torch.compile(model.net, backend="zinf", options=json.loads(options_json))
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result: dict = {"losses": [], "norms": []}
    batches = data(steps)
    if scenario == "plain":
        # a plain torch optimizer: zinf converts it at its first step, after the first backward, which
        # ran without the hook that averages the replicated `scale`; no clipping (it would have seen
        # rank-local values: the warning says so)
        import warnings
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in batches:
                lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
                loss_of(cnet(x[lo:hi]), model.scale, y[lo:hi]).backward()
                opt.step()
                model.zero_grad()
        result["warnings"] = [str(w.message) for w in seen if "replicated" in str(w.message)]
        result["state"] = zinf_compile.full_state_dict(model)
        result["scale_rank"] = model.scale.detach().clone()
    elif scenario == "train":
        for x, y in batches:
            lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
            loss = loss_of(cnet(x[lo:hi]), model.scale, y[lo:hi])
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            model.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            result["losses"].append(mean.item() / world)
            result["norms"].append(norm.item())
        result["state"] = zinf_compile.full_state_dict(model)
        result["shift"] = model.net.shift.clone()
        # collective: every rank gathers the full values (cloned: eager's entries alias the parameters)
        result["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(initial)  # each rank writes its own shard: back to the start
        result["reloaded"] = zinf_compile.full_state_dict(model)
        result["scale_rank"] = model.scale.detach().clone()
        # the optimizer's state is this rank's shards: its own state dict loads back; rank 0's, as a loop
        # that saves on rank 0 only would hand it to every rank, is refused on rank 1, changing nothing
        osd = opt.state_dict()
        result["shards_key"] = osd.get("zinf_shards")
        rank0 = [osd if rank == 0 else None]
        dist.broadcast_object_list(rank0, src=0)
        before = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(osd)
        try:
            opt.load_state_dict(rank0[0])
            result["rank0_load_error"] = None
        except ValueError as exc:
            result["rank0_load_error"] = str(exc)
        after = opt.state_dict()
        result["opt_state_unchanged"] = all(
            torch.equal(v, after["state"][i][k]) for i, st in before["state"].items() for k, v in st.items()
            if torch.is_tensor(v))
    elif scenario == "scaler":
        # rank 1's gradient shard overflows (as an fp16 overflow lands in whichever rank owns the element):
        # GradScaler must skip the step on every rank, or the replicas diverge
        import zinf_runtime
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i, (x, y) in enumerate(batches):
            lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
            scaler.scale(loss_of(cnet(x[lo:hi]), model.scale, y[lo:hi])).backward()
            if i == 0 and rank == 1:
                zinf_runtime.handle_of(model.net.fc2.bias).grad_slot.resident()[0] = float("inf")
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            model.zero_grad()
            result["norms"].append(scaler.get_scale())
        result["state"] = zinf_compile.full_state_dict(model)
    else:
        x, y = batches[0]
        loss_of(cnet(x), model.scale, y).backward()  # every rank compiles and trains once
        opt.step(); model.zero_grad()
        t0 = time.time()
        try:
            if rank == 0 and scenario == "state_dict_alone":
                model.state_dict()  # collective at dp > 1, called on rank 0 only (rank 1 trains on)
            elif rank == 0:
                with torch.no_grad():
                    cnet(x)
            elif scenario in ("eval_vs_train", "state_dict_alone"):
                loss_of(cnet(x), model.scale, y).backward()
            else:
                time.sleep(float(sys.argv[5]))
            result["error"] = None
        except RuntimeError as exc:
            result["error"] = str(exc)
        result["seconds"] = time.time() - t0
    torch.save(result, f"{out_path}.{rank}")
    if scenario in ("train", "scaler", "plain"):
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
