"""``keep_alive``: no compiler may reuse memory the runtime owns (a fetch read in place is the parameter).

Before the pass, Inductor computed ``tanh(x + w)`` in place over ``w``'s buffer when ``x`` and ``w``
had one shape: a dp-1 shard read in place is the parameter's slot, so the first step overwrote the
parameter and the second forward's loss was wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zinf_compile
from zinf_compile.pipeline import compile_records

from conftest import zinf_full_grads


class SameShape(nn.Module):
    """A parameter with the shape of the activation it is added to: a pointwise kernel may write its
    result over either input's buffer once nothing reads it any more."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(x + self.w))


def same_shape_batches(steps: int, accum: int, world: int) -> list:
    """``[step][micro][rank]`` inputs of ``SameShape`` (each rank its own full-shape micro-batch)."""
    g = torch.Generator().manual_seed(0)
    return [[[torch.randn(6, 16, generator=g) for _ in range(world)] for _ in range(accum)] for _ in range(steps)]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_parameters_survive_their_forward_and_backward(compiler):
    torch.manual_seed(0)
    ref = SameShape()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": compiler})
    x = torch.randn(6, 16)
    with torch.no_grad():
        want = ref(x).pow(2).sum()
    for _ in range(3):  # no optimizer step: every forward must give the same loss
        loss = cm(x).pow(2).sum()
        torch.testing.assert_close(loss.detach(), want, rtol=1e-6, atol=0)  # one 16-term dot per output
        loss.backward()
    assert torch.equal(zinf_compile.full_state_dict(model)["w"], ref.w.detach())  # no step: untouched
    rec = compile_records()[-1]
    assert rec.counters["kept_to_end"] >= 1
    grads = zinf_full_grads(model)
    assert grads["w"] is not None


def test_keep_is_the_last_op_and_reads_every_fetch():
    torch.manual_seed(0)
    model = SameShape()
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    cm(torch.randn(6, 16)).sum().backward()
    for stage in ("forward", "backward"):
        code = [s for s in zinf_compile.last_graphs(all_graphs=True) if s.stage == stage][-1].code
        lines = [ln.strip() for ln in code.splitlines() if ln.strip()]
        fetched = [ln.split(" = ")[0] for ln in lines if "zinf.fetch_shard.default(" in ln]
        assert fetched, stage
        keep = lines[-2]
        assert lines[-1].startswith("return") and "zinf.keep.default(" in keep, stage
        assert all(name in keep for name in fetched), stage


def _modes(tmp_path) -> dict:
    return {
        "in_memory": {},  # fetches read in place: the parameter's slot is the graph's buffer
        "cpu": {"offload_params": "cpu", "offload_optimizer": "cpu"},
        "nvme": {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)},
        "budget": {"device_memory_budget": 1 << 20},  # fetches copy and are released: freed storage
    }


@pytest.mark.parametrize("mode", ["in_memory", "cpu", "nvme", "budget"])
def test_same_shape_parameters_train_like_eager_under_inductor(mode, tmp_path):
    """Every offload mode at dp 1 through Inductor, on the model whose parameter has an activation's
    shape: two micro-batches per step and three SGD steps, so a parameter, gradient or released
    buffer that Inductor reused would show in the gradients or the parameters."""
    from conftest import assert_grads_within_reduction_bound, assert_same_training, train_pair

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 16, generator=g),) for _ in range(6)]
    run = train_pair(lambda: SameShape(), batches, _modes(tmp_path)[mode], accum=2, opt="sgd")
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)


@pytest.mark.slow  # CI time: make test-slow runs it (one torchrun, three Inductor compiles per rank)
def test_same_shape_parameters_train_like_eager_at_dp2(tmp_path):
    """dp = 2 on gloo through Inductor, in memory, with CPU offload and on NVMe: the parameter is
    all-gathered into a runtime-owned buffer, released after its last reader, and its gradient
    reduce-scattered asynchronously, so a buffer Inductor reused would show in the losses or in the
    parameters after three SGD steps of two micro-batches. Against single-process eager on the mean
    of both ranks' losses (the reduce-scatter's mean over dp): another summation order, so the fp32
    tolerance of tests/test_dp.py. In memory and with CPU offload the fetched shard is the slot's own
    memory here too (read in place, then copied into the collective's buffer), so ``keep_alive``
    guards it as at dp 1; the test also guards the other dp-2 buffers against a compiler that starts
    reusing them."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from conftest import ATOL, RTOL

    steps, accum, world = 3, 2, 2
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    modes = {name: {"compiler": "inductor", **opts} for name, opts in _modes(nvme).items() if name != "budget"}
    out = tmp_path / "same_shape.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(port), os.path.join(os.path.dirname(__file__), "workers", "same_shape_dp.py"),
           str(out), json.dumps(modes), str(steps), str(accum)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = torch.load(out)

    torch.manual_seed(0)
    ref = SameShape()
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    want = []
    for step_batches in same_shape_batches(steps, accum, world):
        for per_rank in step_batches:
            loss = sum(ref(x).pow(2).mean() for x in per_rank) / world
            (loss / accum).backward()
            want.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert set(results) == set(modes)
    for name, res in results.items():
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{name}: {m}")
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(res["state"][k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {k}: {m}")
