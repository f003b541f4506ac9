"""The standard training-loop idioms on partitioned parameters give eager's numbers.

``param.grad`` of a partitioned parameter is a ``ShardedGrad`` (runtime/grads.py); these tests drive it
the way HF Trainer, accelerate and Lightning do. At dp = 1 with ``compiler="eager"`` zinf runs the same
aten kernels on the same values in the same order as eager, so gradients are compared exactly
(``rtol=0, atol=0``) and SGD parameters after several steps too; clipping multiplies by a coefficient
computed from the same norm, so it stays exact.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime.grads import ShardedGrad

pytestmark = pytest.mark.parity  # run again under ATEN_CPU_CAPABILITY=default by make test

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
EXACT = dict(rtol=0.0, atol=0.0)


def pair(options=None, opt="sgd", lr=0.1, **okw):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager", **(options or {})})
    if opt == "sgd":
        kw = dict(lr=lr, momentum=0.9, **okw)
        ropt, zopt = torch.optim.SGD(ref.parameters(), **kw), zinf_compile.optim.SGD(model.parameters(), **kw)
    else:
        kw = dict(lr=lr, **okw)
        ropt, zopt = torch.optim.AdamW(ref.parameters(), **kw), zinf_compile.optim.AdamW(model.parameters(), **kw)
    return ref, model, cmodel, ropt, zopt


def batches(n):
    return [make_batch(CFG, 4, seed=i) for i in range(n)]


def assert_grads_equal(ref, model, **tol):
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert isinstance(q.grad, ShardedGrad), name
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, **(tol or EXACT), msg=lambda m: f"{name}: {m}")


def assert_params_equal(ref, model, **tol):
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **(tol or EXACT), msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("zero", ["model_none", "model_zero", "opt_none", "opt_zero"])
def test_zero_grad_idioms(zero):
    # Without ShardedGrad, model.zero_grad() left zinf's shards alone and they piled up across steps.
    ref, model, cmodel, ropt, zopt = pair()
    set_to_none = zero.endswith("none")
    for b in batches(3):
        ref(*b).backward()
        cmodel(*b).backward()
        assert_grads_equal(ref, model)
        ropt.step(); zopt.step()
        if zero.startswith("model"):
            ref.zero_grad(set_to_none=set_to_none); model.zero_grad(set_to_none=set_to_none)
        else:
            ropt.zero_grad(set_to_none=set_to_none); zopt.zero_grad(set_to_none=set_to_none)
        for p in model.parameters():
            assert (p.grad is None) == set_to_none
    assert_params_equal(ref, model)


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_clip_grad_norm_model_parameters(offload, tmp_path):
    # clip_grad_norm_(model.parameters()) as HF / accelerate / Lightning call it; max_norm is below the
    # gradient norm, so clipping applies at every step
    opts = {} if offload == "none" else {"offload_params": offload, "offload_optimizer": offload,
                                         "nvme_path": str(tmp_path)}
    ref, model, cmodel, ropt, zopt = pair(opts)
    for b in batches(3):
        ref(*b).backward(); cmodel(*b).backward()
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        n_zinf = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert n_ref.item() > 0.5
        torch.testing.assert_close(n_zinf, n_ref, **EXACT)
        assert_grads_equal(ref, model)  # clipped in place on every tier
        ropt.step(); zopt.step(); ref.zero_grad(); model.zero_grad()
    assert_params_equal(ref, model)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("foreach", [None, True])
def test_clip_norm_types_and_foreach(norm_type, foreach):
    ref, model, cmodel, *_ = pair()
    b = batches(1)[0]
    ref(*b).backward(); cmodel(*b).backward()
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=norm_type, foreach=foreach)
    n_zinf = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type, foreach=foreach)
    # the total is a norm of per-parameter norms: same values, same reduction, so exact
    torch.testing.assert_close(n_zinf, n_ref, **EXACT)
    assert_grads_equal(ref, model)


def test_tiled_parameter_gradients_and_clip():
    # a tiled weight's norm is the norm of its tiles' norms: another summation order than eager's
    # single reduction, so relative error ~ (number of terms) * fp32 eps, far below 1e-5
    ref, model, cmodel, ropt, zopt = pair({"tiles": 3, "tile_threshold_bytes": 10_000})
    b = batches(1)[0]
    ref(*b).backward(); cmodel(*b).backward()
    bound = dict(rtol=64 * torch.finfo(torch.float32).eps, atol=1e-7)
    assert_grads_equal(ref, model, **bound)
    n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    n_zinf = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    torch.testing.assert_close(n_zinf, n_ref, **bound)
    assert_grads_equal(ref, model, **bound)


def test_gradient_accumulation_then_zero_grad_by_model():
    ref, model, cmodel, ropt, zopt = pair()
    data = batches(4)
    for i, b in enumerate(data):
        (ref(*b) / 2).backward(); (cmodel(*b) / 2).backward()
        if i % 2 == 1:
            assert_grads_equal(ref, model)
            ropt.step(); zopt.step(); ref.zero_grad(); model.zero_grad()
    assert_params_equal(ref, model)


def test_reading_and_assigning_grad():
    ref, model, cmodel, *_ = pair()
    b = batches(1)[0]
    ref(*b).backward(); cmodel(*b).backward()
    p_ref, p = next(ref.parameters()), next(model.parameters())
    assert "ShardedGrad" in repr(p.grad)
    torch.testing.assert_close(p.grad.sum(), p_ref.grad.sum(), **EXACT)  # any read: the full gradient
    torch.testing.assert_close(p.grad.data.full_tensor(), p_ref.grad, **EXACT)
    with pytest.raises(RuntimeError, match="writes into the gradient of a partitioned parameter"):
        p.grad.add_(1.0)
    # a full tensor assigned to .grad is where the next backward accumulates, as in eager
    p_ref.grad = torch.ones_like(p_ref.grad)
    p.grad = torch.ones(p.shape)
    ref(*b).backward(); cmodel(*b).backward()
    assert isinstance(p.grad, ShardedGrad)
    torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, **EXACT)


def test_lr_scheduler():
    ref, model, cmodel, ropt, zopt = pair()
    rs = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.5)
    zs = torch.optim.lr_scheduler.StepLR(zopt, step_size=1, gamma=0.5)
    for b in batches(3):
        ref(*b).backward(); cmodel(*b).backward()
        ropt.step(); zopt.step(); rs.step(); zs.step()
        ropt.zero_grad(); zopt.zero_grad()
        assert zs.get_last_lr() == rs.get_last_lr()
    assert_params_equal(ref, model)


def test_grad_scaler_fp16_skips_overflow_steps():
    # fp16 autocast with loss scaling: a large init_scale overflows fp16 gradients, so the first steps
    # are skipped and the scale backs off until steps apply, exactly as torch.amp.GradScaler does in
    # eager (zinf runs the same fp16 kernels on the same values: exact, NaNs included)
    ref, model, cmodel, ropt, zopt = pair({"mixed_precision": "fp16"})
    assert not any(p.grad is not None for p in model.parameters())
    rsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    zsc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    scales = []
    for b in batches(8):
        with torch.autocast("cpu", torch.float16):
            lr_ = ref(*b)
        rsc.scale(lr_).backward()
        zl = cmodel(*b)
        zsc.scale(zl).backward()
        rsc.unscale_(ropt); zsc.unscale_(zopt)
        torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                                   torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), rtol=0, atol=0, equal_nan=True)
        rsc.step(ropt); zsc.step(zopt); rsc.update(); zsc.update()
        ropt.zero_grad(); zopt.zero_grad()
        scales.append((rsc.get_scale(), zsc.get_scale()))
    assert [a for a, _ in scales] == [b for _, b in scales]
    assert scales[0][0] < 2.0 ** 24  # an overflow was seen and its step skipped
    assert scales[-1][0] == scales[-2][0]  # later steps applied
    assert_params_equal(ref, model)
    torch.manual_seed(0)
    assert not torch.equal(zinf_compile.full_state_dict(model)["tok.weight"], GPT(CFG).tok.weight)  # stepped


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_optimizer_state_dict_round_trip(tier, tmp_path):
    # train 2 steps, save the optimizer state, keep training 2 steps; then reload the saved state into
    # a fresh optimizer at the saved point and train the same 2 steps: same parameters
    # every parameter's state on the tier (nvme_min_shard_bytes=0: norms' and biases' too)
    opts = {"offload_optimizer": tier, "nvme_path": str(tmp_path), "nvme_min_shard_bytes": 0}
    ref, model, cmodel, ropt, zopt = pair(opts, opt="sgd")
    data = batches(4)
    for b in data[:2]:
        cmodel(*b).backward(); zopt.step(); zopt.zero_grad()
    saved_opt = copy.deepcopy(zopt.state_dict())
    saved_params = zinf_compile.full_state_dict(model)
    assert all(torch.is_tensor(st["momentum_buffer"]) for st in saved_opt["state"].values())
    for b in data[2:]:
        cmodel(*b).backward(); zopt.step(); zopt.zero_grad()
    straight = zinf_compile.full_state_dict(model)
    with zinf_compile.gathered(model):
        model.load_state_dict(saved_params)
    zopt2 = zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    zopt2.load_state_dict(saved_opt)
    for p in model.parameters():  # the state lives on the optimizer tier, not the compute device
        h = zinf_compile.state.zinf_runtime.handle_of(p)
        if tier == "cpu":
            assert zopt2.state[p]["momentum_buffer"].device.type == "cpu"
        else:
            assert p not in zopt2.state and h.optim_state.names == ("momentum_buffer",)
    for b in data[2:]:
        cmodel(*b).backward(); zopt2.step(); zopt2.zero_grad()
    resumed = zinf_compile.full_state_dict(model)
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], **EXACT)


def test_optimizer_state_from_another_dp_size_is_refused():
    ref, model, cmodel, ropt, zopt = pair()
    b = batches(1)[0]
    cmodel(*b).backward(); zopt.step()
    sd = zopt.state_dict()
    sd["state"][0]["momentum_buffer"] = torch.zeros(3)
    with pytest.raises(ValueError, match="saved with another dp size"):
        zopt.load_state_dict(sd)
