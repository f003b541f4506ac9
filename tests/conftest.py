"""Shared fixtures and the eager-vs-zinf parity harness.

What a parity test may compare, and how tightly, follows from the arithmetic, never from one CPU:

* **Gradients after one step.** Where zinf runs the same aten ops in the same order as eager
  (``compiler="eager"``, no tiling, dp = 1) they are compared bitwise. Where tiling, the dp
  reduce-scatter (mean over dp) or Inductor changes the order in which a reduction adds its terms,
  they are compared with a bound derived from floating-point summation, computed from the actual
  model and batch (:func:`assert_grads_within_reduction_bound`).
* **Parameters after several steps** with SGD (momentum included): its update is linear in the
  gradient, so gradient rounding differences stay rounding differences.
* **Adam over several steps** only where it is bitwise (same order of operations) or on a model
  whose gradients are far from zero: Adam's update ``m / (sqrt(v) + eps)`` is ``~sign(g)`` at small
  ``|g|``, so reduction-order noise on a near-zero gradient becomes a ``±lr`` parameter change.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch

# every collective the runtime issues is checked: on the group's device, never a tier slot's memory
os.environ.setdefault("ZINF_STRICT_COMM", "1")
import torch.nn.functional as F

import zinf_compile
from zinf_compile.models import GPT

sys.path.insert(0, os.path.dirname(__file__))

# Multi-step parameter comparisons where the reduction order differs (SGD only, see above).
RTOL, ATOL = 1e-5, 1e-6
# Unit roundoff u = 2^-p of each format (p = significand bits incl. the implicit one): a correctly
# rounded result x̂ of x satisfies |x̂ - x| <= u |x|.
U_FP32 = 2.0 ** -24
U_BF16 = 2.0 ** -8
U_FP16 = 2.0 ** -11


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "parity: compares zinf against eager numerics; CI reruns these with ATEN_CPU_CAPABILITY=default")
    config.addinivalue_line(
        "markers", "slow: outside CI's 30 minutes on 2 cores; `make test-slow` runs them (README: Tests)")


@pytest.fixture(scope="module")
def compare():
    """``benchmarks/compare.py`` as a module, loaded by path (``benchmarks/`` is not a package); it
    imports no torch and runs nothing on import."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("zinf_bench_compare", os.path.join(root, "benchmarks", "compare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models: no recompile limits or caches leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def default_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    out = model(*batch)
    return out if out.dim() == 0 else out.pow(2).mean()


def default_loss_terms(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    """The terms whose sum is :func:`default_loss`: one per token (GPT) or per output element.

    The gradient is the sum of these terms' gradients; that sum is the reduction whose order tiling,
    dp and Inductor change.
    """
    if isinstance(model, GPT) and len(batch) == 2:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1), reduction="none") / y.numel()
    out = model(*batch)
    if out.dim() == 0:
        raise TypeError("default_loss_terms needs a per-element output; pass loss_terms= for this model")
    return (out.pow(2) / out.numel()).reshape(-1)


# -- reading gradients ---------------------------------------------------------------------------
def zinf_full_grads(model: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """Every trainable parameter's full fp32 gradient, read from the zinf store (not ``param.grad``).

    Each unit of a parameter (the parameter, or each of its tiles) holds a padded fp32 gradient shard;
    at dp > 1 the shards are all-gathered (a collective: call it on every rank). A tiled parameter's
    gradient is its tiles' gradients concatenated along ``tile_dim``. Parameters zinf did not
    partition report ``param.grad``. Tied parameters appear once, under their first name.
    """
    import torch.distributed as dist
    from zinf_runtime import store

    out: Dict[str, Optional[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        h = store.handle_of(p)
        if h is None:
            out[name] = None if p.grad is None else p.grad.detach().clone()
            continue
        parts = []
        for u in h.units():
            shard = u.grad
            if u.world > 1:
                local = torch.zeros(u.shard_numel) if shard is None else shard.detach().float().cpu()
                flat = torch.empty(u.shard_numel * u.world)
                dist.all_gather_into_tensor(flat, local.contiguous(), group=u.placement.group)
                have = torch.tensor([float(shard is not None)])
                dist.all_reduce(have, group=u.placement.group)
                parts.append(flat[: u.numel].view(u.shape).clone() if have.item() > 0 else None)
            else:
                parts.append(None if shard is None else shard[: u.numel].detach().float().cpu().view(u.shape).clone())
        if any(g is None for g in parts):
            assert all(g is None for g in parts), f"{name}: only some tiles hold a gradient"
            out[name] = None
        else:
            out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=h.tile_dim)
    return out


def eager_grads(model: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


# -- the training pair -----------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """An eager model and its zinf copy trained side by side; gradients kept from the first step."""

    ref_losses: List[float]
    zinf_losses: List[float]
    ref: torch.nn.Module          # trained eager model
    model: torch.nn.Module        # trained zinf model (partitioned)
    init: torch.nn.Module         # eager copy of the initial model (for float64 references)
    first_batches: List[Sequence[torch.Tensor]]  # the micro-batches of the first optimizer step
    accum: int
    ref_grads: Dict[str, Optional[torch.Tensor]]
    zinf_grads: Dict[str, Optional[torch.Tensor]]


def train_pair(
    make_model: Callable[[], torch.nn.Module],
    batches: List[Sequence[torch.Tensor]],
    options: Optional[dict] = None,
    *,
    accum: int = 1,
    lr: float = 1e-2,
    opt: str = "adamw",
    loss_fn: Callable = default_loss,
    autocast: Optional[torch.dtype] = None,
    eps: float = 1e-8,
) -> Run:
    """Train an eager model with torch.optim and its zinf copy with zinf_compile.optim, side by side.

    ``batches`` holds ``steps * accum`` micro-batches; losses are per micro-batch. The gradients of
    the first optimizer step (after ``accum`` micro-batches) are recorded before that step.
    """
    torch.manual_seed(0)
    ref = make_model()
    init = copy.deepcopy(ref)
    model = copy.deepcopy(ref)
    kw = dict(lr=lr, weight_decay=0.1, eps=eps) if opt == "adamw" else dict(lr=lr, momentum=0.9)
    ropt = (torch.optim.AdamW if opt == "adamw" else torch.optim.SGD)(
        [p for p in ref.parameters() if p.requires_grad], **kw)
    zopt = (zinf_compile.optim.AdamW if opt == "adamw" else zinf_compile.optim.SGD)(
        [p for p in model.parameters() if p.requires_grad], **kw)
    cmodel = torch.compile(model, backend="zinf", options=dict(options or {}))
    rl, zl = [], []
    rg: Dict[str, Optional[torch.Tensor]] = {}
    zg: Dict[str, Optional[torch.Tensor]] = {}
    for i, batch in enumerate(batches):
        if autocast is not None:
            with torch.autocast("cpu", autocast):
                loss = loss_fn(ref, batch)
        else:
            loss = loss_fn(ref, batch)
        (loss / accum).backward()
        zloss = loss_fn(cmodel, batch)
        (zloss / accum).backward()
        rl.append(loss.item())
        zl.append(zloss.item())
        if (i + 1) % accum == 0:
            if i + 1 == accum:
                rg, zg = eager_grads(ref), zinf_full_grads(model)
            ropt.step(); ropt.zero_grad()
            zopt.step(); zopt.zero_grad()
    return Run(rl, zl, ref, model, init, list(batches[:accum]), accum, rg, zg)


# -- comparisons -----------------------------------------------------------------------------------
def _same_keys(run: Run) -> None:
    assert run.zinf_grads.keys() == run.ref_grads.keys(), (run.zinf_grads.keys(), run.ref_grads.keys())
    assert run.zinf_grads, "no gradients recorded"


def assert_grads_equal(run: Run) -> None:
    """Same ops in the same order: the first step's gradients are bitwise equal."""
    _same_keys(run)
    for k, want in run.ref_grads.items():
        got = run.zinf_grads[k]
        assert (got is None) == (want is None), k
        if want is not None:
            assert torch.equal(got, want), f"{k}: max |diff| {(got - want).abs().max().item():.3e} (want bitwise)"


def float64_reference(init: torch.nn.Module, batches: Sequence[Sequence[torch.Tensor]], accum: int,
                      loss_terms: Callable = default_loss_terms):
    """(true gradient, Σ|terms|, n) in float64 for the first step of ``init`` on ``batches``.

    The gradient is ``g = Σ_t g_t`` over the n loss terms t (tokens or output elements, of every
    micro-batch, each divided by ``accum``); ``g_t`` are computed per term in float64 (one batched
    backward), so ``Σ_t |g_t|`` is the magnitude of the sum that fp32 evaluates.
    """
    m64 = copy.deepcopy(init).double()
    names = [n for n, p in m64.named_parameters() if p.requires_grad]
    params = [p for p in m64.parameters() if p.requires_grad]
    terms = []
    for b in batches:
        b = tuple(t.double() if t.is_floating_point() else t for t in b)
        terms.append(loss_terms(m64, b).reshape(-1) / accum)
    t = torch.cat(terms)
    n = t.numel()
    jac = torch.autograd.grad(t, params, torch.eye(n, dtype=torch.float64), is_grads_batched=True,
                              allow_unused=True)
    g64, mag = {}, {}
    for name, p, j in zip(names, params, jac):
        j = torch.zeros((n, *p.shape), dtype=torch.float64) if j is None else j
        g64[name], mag[name] = j.sum(0), j.abs().sum(0)
    return g64, mag, n


def reduction_bound_ratios(run: Run, loss_terms: Callable = default_loss_terms,
                           grads: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> Dict[str, tuple]:
    """Per parameter: (‖ĝ_zinf − g‖ / B, ‖ĝ_eager − g‖ / B, B / ‖g‖) with g the float64 gradient.

    The bound B. An fp32 gradient element is a sum of n terms (:func:`float64_reference`). Summed in
    any order, the computed sum has |ŝ − s| ≤ γ_{n−1} Σ_t |g_t| ≈ (n − 1)·u·Σ_t |g_t| with
    u = 2^-24 (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2), whatever order tiling,
    the dp reduce-scatter or Inductor picks. Each g_t is itself computed through the layers in fp32,
    with relative errors of a few u except where its own terms cancel; taken element by element,
    that makes the bound fail on a few elements (the tied embedding's rows, up to 2.4× measured), so
    the bound is applied to each tensor's 2-norm: B = n·u·‖Σ_t |g_t|‖₂. Measured on x86 (AVX2 and
    ATEN_CPU_CAPABILITY=default; tiling, Inductor, dp = 2), eager's and zinf's errors are both ≤ 6 %
    of B. B itself is 1e-5 to 2e-4 of ‖g‖ (the largest for a LayerNorm bias at dp = 2), so a gradient
    off by 2e-4 (relative) fails it (tests/test_parity.py checks 1e-4 on an MLP).
    """
    g64, mag, n = float64_reference(run.init, run.first_batches, run.accum, loss_terms)
    grads = run.zinf_grads if grads is None else grads
    out = {}
    for k, want in run.ref_grads.items():
        got = grads[k]
        assert (got is None) == (want is None), k
        if want is None:
            continue
        bound = n * U_FP32 * mag[k].norm().item()
        tiny = torch.finfo(torch.float64).tiny
        out[k] = ((got.double() - g64[k]).norm().item() / max(bound, tiny),
                  (want.double() - g64[k]).norm().item() / max(bound, tiny),
                  bound / max(g64[k].norm().item(), tiny))
    return out


def assert_grads_within_reduction_bound(run: Run, loss_terms: Callable = default_loss_terms) -> Dict[str, tuple]:
    """The reduction order changed: zinf's first-step gradients lie within the fp32 summation bound
    of the true (float64) gradient, as eager's do (see :func:`reduction_bound_ratios`)."""
    _same_keys(run)
    ratios = reduction_bound_ratios(run, loss_terms)
    for k, (rz, re, _) in ratios.items():
        assert re <= 1.0, f"{k}: eager itself is {re:.2f}x the fp32 bound: the bound's derivation is wrong"
        assert rz <= 1.0, f"{k}: zinf's gradient is {rz:.2f}x the fp32 summation bound from the true gradient"
    return ratios


def assert_same_training(run: Run, *, exact: bool) -> None:
    """Losses of every micro-batch and parameters after the last step.

    ``exact``: same ops in the same order, so bitwise. Otherwise the optimizer must be SGD (see the
    module docstring) and RTOL/ATOL apply.
    """
    tol = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(run.zinf_losses), torch.tensor(run.ref_losses), **tol)
    full = zinf_compile.full_state_dict(run.model)
    want = run.ref.state_dict()
    assert full.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(full[k], want[k], **tol, msg=lambda m: f"{k}: {m}")


def assert_mixed_precision_matches_autocast(run: Run, dtype: torch.dtype, *, lr: float, steps: int,
                                            momentum: float = 0.9) -> None:
    """zinf under ``mixed_precision`` against eager under ``torch.autocast``, with a bf16/fp16 bound.

    For use where the runs are not bitwise equal (tiling reorders a matmul's fp32 accumulation, which
    can move a bf16 output to the neighbouring value). The bound, with u the format's unit roundoff
    (2^-8 bf16, 2^-11 fp16): under autocast every gradient term g_t (:func:`float64_reference`) is a
    product whose two matmul operands (dY and X in dW = dYᵀX, and likewise for the activation
    gradients) are each rounded once to the low format, |δ| <= u each, so |ĝ_t − g_t| <= 2u|g_t| to
    first order; the fp32 accumulation adds only n·2^-24 (negligible). Roundings further upstream are
    independent and mean zero, so in a tensor's 2-norm they average out instead of adding up
    (Higham & Mary, SIAM J. Sci. Comput. 2019): ‖ĝ − g‖ <= 2u·‖Σ_t |g_t|‖ for either run, against the
    float64 gradient g. Measured here (bf16 GPT, tiles 2 and 3, AVX2 and ATEN_CPU_CAPABILITY=default):
    eager autocast and zinf both within 0.22 of the bound, parameters within 0.05 of theirs. The bound is 2–6 % of ‖g‖: a missing tile or a mis-scaled gradient fails it.
    Eager autocast is held to the same bound, which checks the bound's own premise.
    Losses (positive cross-entropy terms): |Δℓ| <= 2u·ℓ. Parameters after ``steps`` SGD steps with
    momentum μ move by lr·Σ_{j<steps} Σ_{i<=j} μ^i times a gradient difference, which each step is
    at most the two runs' bounds added (4u‖Σ|g_t|‖, the first step's magnitudes).
    """
    u = {torch.bfloat16: U_BF16, torch.float16: U_FP16}[dtype]
    for zl, rl in zip(run.zinf_losses, run.ref_losses):
        assert abs(zl - rl) <= 2 * u * abs(rl), (zl, rl, 2 * u * abs(rl))
    g64, mag, _ = float64_reference(run.init, run.first_batches, run.accum)
    amp = lr * sum(sum(momentum ** i for i in range(j + 1)) for j in range(steps))
    full = zinf_compile.full_state_dict(run.model)
    ref_sd = run.ref.state_dict()
    _same_keys(run)
    for name, want in run.ref_grads.items():
        got = run.zinf_grads[name]
        assert (got is None) == (want is None), name
        if want is None:
            continue
        bound = 2 * u * mag[name].norm().item()
        e_ref = (want.double() - g64[name]).norm().item()
        e_z = (got.double() - g64[name]).norm().item()
        assert e_ref <= bound, f"{name}: eager autocast is {e_ref / bound:.2f}x the bound: its derivation is wrong"
        assert e_z <= bound, f"{name}: ‖ĝ_zinf − g‖ = {e_z:.3e} > 2u‖Σ|g_t|‖ = {bound:.3e}"
        assert full[name].dtype == torch.float32  # fp32 master weights
        perr = (full[name].double() - ref_sd[name].double()).norm().item()
        assert perr <= amp * 2 * bound, f"{name}: ‖Δparam‖ {perr:.3e} > {amp * 2 * bound:.3e}"
