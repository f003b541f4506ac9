"""fp32 training parity with eager PyTorch + torch.optim.

Eager graphs (``compiler="eager"``) run eager's aten ops in eager's order: gradients, losses and
parameters are bitwise equal, Adam included, on any CPU. Inductor reorders reductions: gradients are
held to the fp32 summation bound (tests/conftest.py), parameters compared after SGD steps, and Adam
only where its ``eps`` caps how much gradient noise it can amplify (test_mlp_inductor).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile
from zinf_compile.models import GPT, MLP, GPTConfig, make_batch

from conftest import (assert_grads_equal, assert_grads_within_reduction_bound, assert_same_training,
                      reduction_bound_ratios, train_pair)

pytestmark = pytest.mark.parity

SMALL = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def mlp_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 16, generator=g),) for _ in range(n)]


def gpt_batches(n, cfg=SMALL, batch=4):
    return [make_batch(cfg, batch, seed=i) for i in range(n)]


def test_mlp_eager_graphs():
    run = train_pair(lambda: MLP(), mlp_batches(3), {"compiler": "eager"})
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    for p in run.model.parameters():
        assert p.grad is None and p.untyped_storage().nbytes() == 0


def test_mlp_inductor():
    """The well-conditioned Adam parity test across a reduction-order change (Inductor's kernels).

    Adam's update lr·m̂/(sqrt(v̂) + eps) changes by at most ~lr·|Δg|/eps for a gradient change Δg,
    whatever |g| is. Inductor's gradients differ from eager's by ≤ ~4e-9 here (within the fp32
    summation bound, checked below), so with eps = 1e-4 three steps move a parameter by ≤ ~1e-6 even
    at g ≈ 0 (measured: 6e-8). With eps = 1e-8 nothing would bound that at a near-zero gradient
    (MLPs have some, by chance).
    """
    run = train_pair(lambda: MLP(), mlp_batches(3), {}, eps=1e-4)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)


def test_gradient_bound_catches_a_small_error():
    """The fp32 summation bound is ~1e-5 of ‖g‖: gradients 1e-4 off (relative), or one element off by
    1e-3 of the largest, fail it; the unperturbed ones pass."""
    # a tiled MLP in eager graphs (tiling changes the reduction order; compiles in seconds)
    run = train_pair(lambda: MLP((16, 8, 64)), mlp_batches(1), {"compiler": "eager", "tiles": 4,
                                                              "tile_threshold_bytes": 1000}, opt="sgd")
    assert_grads_within_reduction_bound(run)
    for name, g in run.zinf_grads.items():
        scaled = dict(run.zinf_grads, **{name: g * (1 + 1e-4)})
        assert reduction_bound_ratios(run, grads=scaled)[name][0] > 1, name
        one = g.clone().view(-1)
        one[one.abs().argmin()] += 1e-3 * g.abs().max()
        assert reduction_bound_ratios(run, grads=dict(run.zinf_grads, **{name: one.view_as(g)}))[name][0] > 1, name


def test_mlp_sgd_momentum_cpu_offload():
    run = train_pair(lambda: MLP(bias=False), mlp_batches(3), {"compiler": "eager", "offload_params": "cpu"},
                     opt="sgd")
    assert_grads_equal(run)
    assert_same_training(run, exact=True)


def test_gpt_tied_embedding_eager_graphs():
    # GPT-2's small init gives near-zero attention gradients; Adam is fine here because nothing reorders
    run = train_pair(lambda: GPT(SMALL), gpt_batches(3), {"compiler": "eager"})
    assert run.model.head.weight is run.model.tok.weight
    assert_grads_equal(run)
    assert_same_training(run, exact=True)


def test_gpt_inductor():
    # SGD: Inductor's fused kernels reorder reductions; AdamW would amplify that on near-zero
    # gradients (see tests/conftest.py). The AdamW path is bitwise in the eager-graph tests.
    run = train_pair(lambda: GPT(SMALL), gpt_batches(3), {"compiler": "inductor"}, opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)


class BreakModel(nn.Module):
    """A graph break in forward, and a parameter used outside its module in both graphs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = F.gelu(self.a(x)) * self.scale.mean()
        torch._dynamo.graph_break()
        return self.b(h) * self.scale


def test_graph_break():
    run = train_pair(BreakModel, mlp_batches(3), {"compiler": "eager"})
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    recs = zinf_compile.compile_records()
    assert sum(r.counters["partitioned_inputs"] > 0 for r in recs) >= 2  # two graphs, both rewritten


class FrozenBase(nn.Module):
    """A frozen base with trainable adapters (LoRA-style), plus a buffer."""

    def __init__(self):
        super().__init__()
        self.base = MLP((16, 32, 16))
        self.base.requires_grad_(False)
        self.adapter_a = nn.Linear(16, 4, bias=False)
        self.adapter_b = nn.Linear(4, 16, bias=False)
        self.register_buffer("offset", torch.linspace(-1, 1, 16))

    def forward(self, x):
        return self.base(x) + self.adapter_b(self.adapter_a(x)) + self.offset


def test_frozen_submodule_and_buffer():
    run = train_pair(FrozenBase, mlp_batches(3), {"compiler": "eager"})
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    full = zinf_compile.full_state_dict(run.model)
    assert torch.equal(full["base.layers.0.weight"], run.init.base.layers[0].weight)  # unchanged, frozen
    assert "base.layers.0.weight" not in run.zinf_grads


def test_gradient_accumulation_two_micro_batches():
    run = train_pair(lambda: GPT(SMALL), gpt_batches(6), {"compiler": "eager"}, accum=2)
    assert_grads_equal(run)  # the sum of both micro-batches' gradients
    assert_same_training(run, exact=True)
