"""A full disk during training (not a checkpoint): parameters and optimizer on NVMe, the swap engine's
writes fail with ENOSPC from one point on (simulated at its ``_sys_open`` hook).

What must hold: a clear error naming the NVMe path, the key and its parameter, and the fix; nothing
already on disk lost. Where the failure lands decides what state remains (README-faults):

* a gradient write (backward, for gradients past the write-back cap, ``tiers.DirtyTracker``; the
  test sets the cap under one gradient so every gradient is written): ``optimizer.step()`` raises
  before it changes anything, so the model is exactly as before the step; after freeing space, ``zero_grad()`` and redoing the step trains on as if
  nothing happened;
* a master-weight write during ``optimizer.step()`` (write-through, ``nvme_param_write_back=False``):
  every parameter is either stepped or, for those whose write failed, at its value before the step
  (each swap file is replaced atomically, never torn); the step is partially applied, so the run
  restarts from its last checkpoint;
* the write of a stepped master kept in memory (write-back, the default) when the cap evicts it: the
  value stays in memory as the parameter's, the error is raised, and after freeing space training
  goes on as if nothing happened.
"""

from __future__ import annotations

import copy
import errno
import os

import pytest
import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import MLP
from zinf_runtime.swap import SwapEngine, SwapSpaceError

from conftest import ATOL, RTOL

DIMS = (16, 32, 32, 8)


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step))


def step_of(model, cmodel, opt, step: int) -> None:
    cmodel(batch(step)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def eager_states(steps: int) -> list[dict]:
    torch.manual_seed(0)
    model = MLP(DIMS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    states = [copy.deepcopy(model.state_dict())]
    for s in range(steps):
        step_of(model, model, opt, s)
        states.append(copy.deepcopy(model.state_dict()))
    return states


def setup(tmp_path, **extra):
    torch.manual_seed(0)
    model = MLP(DIMS)
    opts = dict(compiler="eager", offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), **extra)
    cmodel = torch.compile(model, backend="zinf", options=opts)
    return model, cmodel, torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.fixture
def disk_full(monkeypatch):
    """Set ``["kind"]``: from then on, writes of swap keys ``u<uid>.<kind>`` fail with ENOSPC (at most
    ``["limit"]`` of them, when set)."""
    real = SwapEngine._sys_open
    state = {"kind": None, "failed": 0, "limit": None}

    def open_(self, path, flags):
        if (state["kind"] and flags & os.O_WRONLY and f"%2E{state['kind']}." in os.path.basename(path)
                and (state["limit"] is None or state["failed"] < state["limit"])):
            state["failed"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, path, flags)

    monkeypatch.setattr(SwapEngine, "_sys_open", open_)
    return state


def close(full: dict, want: dict) -> bool:
    return all(torch.allclose(full[k], want[k], rtol=RTOL, atol=ATOL) for k in want)


def assert_state(model, want: dict) -> None:
    full = zinf_compile.full_state_dict(model)
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def check_message(exc: SwapSpaceError, tmp_path, kind: str) -> None:
    msg = str(exc)
    assert str(tmp_path) in msg and "fix: free space on" in msg and "larger disk" in msg, msg
    assert f".{kind}'" in msg and "of parameter 'layers." in msg, msg


@pytest.mark.parametrize("min_bytes", [0, 256], ids=["all-on-nvme", "biases-in-memory"])
def test_disk_full_writing_gradients_loses_nothing_and_training_resumes(tmp_path, disk_full, min_bytes):
    """``min_bytes`` 256 (``nvme_min_shard_bytes``) keeps the biases' states in CPU memory: the step
    must raise before it steps those too, not only before the NVMe ones."""
    want = eager_states(3)
    # every gradient written back (a cap under one gradient)
    model, cmodel, opt = setup(tmp_path, optimizer_sub_group_bytes=256, nvme_min_shard_bytes=min_bytes)
    step_of(model, cmodel, opt, 0)
    tiers = {h.name: h.placement.master_tier for h in map(zinf_runtime.handle_of, model.parameters())}
    assert {t for n, t in tiers.items() if n.endswith("weight")} == {"nvme"}, tiers
    assert {t for n, t in tiers.items() if n.endswith("bias")} == {"cpu" if min_bytes else "nvme"}, tiers
    disk_full["kind"] = "grad"
    cmodel(batch(1)).pow(2).sum().backward()
    with pytest.raises(SwapSpaceError) as ei:
        opt.step()
    assert disk_full["failed"] > 0
    check_message(ei.value, tmp_path, "grad")
    assert close(zinf_compile.full_state_dict(model), want[1])  # exactly the state before the failed step
    disk_full["kind"] = None  # space freed: redo the step, go on
    opt.zero_grad()
    step_of(model, cmodel, opt, 1)
    step_of(model, cmodel, opt, 2)
    assert_state(model, want[3])


def test_disk_full_writing_masters_leaves_each_parameter_whole(tmp_path, disk_full):
    want = eager_states(2)
    model, cmodel, opt = setup(tmp_path, nvme_param_write_back=False)  # every step writes every master
    step_of(model, cmodel, opt, 0)
    cmodel(batch(1)).pow(2).sum().backward()
    disk_full.update(kind="master", limit=1)  # one master write fails: the others of the step land
    with pytest.raises(SwapSpaceError) as ei:
        opt.step()
    check_message(ei.value, tmp_path, "master")
    disk_full["kind"] = None
    full = zinf_compile.full_state_dict(model)
    failed = zinf_runtime.store.get(int(str(ei.value).split("'u", 1)[1].split(".", 1)[0])).name
    for k in want[1]:
        before, after = close({k: full[k]}, {k: want[1][k]}), close({k: full[k]}, {k: want[2][k]})
        assert before or after, f"{k}: neither its value before nor after the step (a torn write)"
        if k == failed:
            assert before and not after, k  # its write failed: the file kept the pre-step version


def test_disk_full_writing_back_a_kept_master_loses_nothing(tmp_path, disk_full):
    """Write-back: a cap under one master (``nvme_read_cache_bytes``) evicts every kept master as
    soon as the step sets it, so each is written; the first of those writes fails. The step raises
    naming it, the value stays in memory as the parameter's, and training goes on to eager's numbers
    once space is freed."""
    want = eager_states(4)
    model, cmodel, opt = setup(tmp_path, nvme_read_cache_bytes=256)
    step_of(model, cmodel, opt, 0)
    cmodel(batch(1)).pow(2).sum().backward()
    disk_full.update(kind="master", limit=1)
    with pytest.raises(SwapSpaceError) as ei:
        opt.step()
    assert disk_full["failed"] == 1
    check_message(ei.value, tmp_path, "master")
    disk_full["kind"] = None
    assert_state(model, want[2])  # every parameter stepped, the one whose write failed too
    opt.zero_grad()
    step_of(model, cmodel, opt, 2)
    step_of(model, cmodel, opt, 3)
    assert_state(model, want[4])
