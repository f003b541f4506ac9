"""Gradient donation: a slot takes the memory of a gradient the backward graph made (``donate_grads``).

The risk is memory shared with something else: a gradient also returned to autograd (another
input's gradient), or memory a compiler reuses for a later result. Each test trains with two
micro-batches, so a slot that shared memory would be changed by the second one (or change it), and
compares every gradient with eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import zinf_compile
import zinf_runtime
from zinf_compile.models import MLP
from zinf_compile.pipeline import compile_records
from zinf_runtime import tiers

from conftest import (assert_grads_equal, assert_grads_within_reduction_bound, assert_same_training, train_pair,
                      zinf_full_grads)
from test_keep_alive import SameShape


def _slot(n: int = 8) -> tiers.Slot:
    return tiers.Slot("cpu", "grad", n, torch.float32, torch.device("cpu"), key="t.grad")


def test_adopt_takes_the_tensor_memory_and_books_it_like_set():
    s, ref = _slot(), _slot()
    acct = s.accounting
    before = acct.current("cpu", "grad")
    t = torch.arange(8, dtype=torch.float32)
    assert s.adopt(t)
    assert s.resident().data_ptr() == t.data_ptr()
    assert s.present and s.version == 1
    assert acct.current("cpu", "grad") == before + 32
    ref.set(torch.arange(8, dtype=torch.float32))
    assert acct.current("cpu", "grad") == before + 64
    assert torch.equal(s.get(), ref.get())
    s.drop()
    ref.drop()
    assert acct.current("cpu", "grad") == before


@pytest.mark.parametrize("case", ["view_into_larger", "strided", "dtype", "size", "present", "nvme"])
def test_adopt_refuses_what_the_slot_cannot_own_and_changes_nothing(case, tmp_path):
    s = _slot()
    t = torch.ones(8)
    if case == "view_into_larger":
        t = torch.ones(16)[:8]
    elif case == "strided":
        t = torch.ones(16)[::2]
    elif case == "dtype":
        t = torch.ones(8, dtype=torch.float64)
    elif case == "size":
        t = torch.ones(9)
    elif case == "present":
        s.set(torch.zeros(8))
    else:
        from zinf_runtime.swap import SwapConfig

        s = tiers.Slot("nvme", "grad", 8, torch.float32, torch.device("cpu"),
                       swap=tiers.engine(SwapConfig(str(tmp_path)), 0), key="t.nvme")
    version = s.version
    assert not s.adopt(t)
    assert s.version == version
    if case == "present":
        assert torch.equal(s.get(), torch.zeros(8))
    elif case != "nvme":
        assert not s.present


def _counters(model: nn.Module) -> dict:
    return zinf_runtime.handle_of(next(model.parameters())).context.transfers.counters


def _graph_counters() -> dict:
    return compile_records()[-1].counters


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_gradient_also_returned_to_autograd_is_not_donated(compiler):
    """In ``lin(tanh(x + w))`` the gradient of ``w`` is also ``x``'s. If ``w``'s slot took the
    tensor returned as ``x.grad``, the second micro-batch's accumulation into either would change
    the other; eager's numbers catch that."""
    torch.manual_seed(0)
    ref = SameShape()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": compiler})
    xr = torch.randn(6, 16, requires_grad=True)
    xz = xr.detach().clone().requires_grad_()
    for _ in range(2):
        ref(xr).pow(2).sum().backward()
        cm(xz).pow(2).sum().backward()
    zw = zinf_full_grads(model)["w"]
    if compiler == "eager":  # eager's aten ops in eager's order: bitwise
        assert torch.equal(xz.grad, xr.grad)
        assert torch.equal(zw, ref.w.grad)
    else:  # elementwise (tanh's backward) and one 16-term dot per value: a few ulps each
        torch.testing.assert_close(xz.grad, xr.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(zw, ref.w.grad, rtol=1e-5, atol=1e-6)
    c = _graph_counters()
    assert c["grads_not_donated"] >= 1  # w's (the bias's view too)
    assert c["grads_donated"] >= 1  # lin.weight's: an mm of its own


def test_donated_gradients_are_marked_and_kept_to_the_graph_end():
    run = train_pair(lambda: MLP(), [(torch.randn(6, 16),) for _ in range(4)], {"compiler": "eager"}, accum=2,
                     opt="sgd")
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    rec = compile_records()[-1]
    assert rec.counters["grads_donated"] >= 1
    bw = [s for s in zinf_compile.last_graphs(all_graphs=True) if s.stage == "backward"][-1].code
    lines = [ln.strip() for ln in bw.splitlines() if ln.strip()]
    donated = [ln.split(".default(")[1].split(",")[0] for ln in lines
               if "reduce_grad.default(" in ln and "donated = True" in ln]
    assert len(donated) == rec.counters["grads_donated"]
    keep = [ln for ln in lines if "zinf.keep.default(" in ln]
    assert len(keep) == 1 and lines[-1].startswith("return")
    assert lines.index(keep[0]) == len(lines) - 2  # the last op
    assert all(name in keep[0] for name in donated)
    # once per parameter and step the slot is empty (zero_grad(set_to_none)): adopted, not copied
    assert _counters(run.model)["grad_adopted"] >= rec.counters["grads_donated"]


class Chain(nn.Module):
    """Square bias-free layers at batch = width: every weight gradient, activation and activation
    gradient has the same size, so Inductor can reuse a weight gradient's buffer for a later result
    as soon as nothing in the graph reads it any more."""

    def __init__(self, width: int = 24, depth: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_inductor_does_not_reuse_a_donated_gradient():
    run = train_pair(lambda: Chain(), [(torch.randn(24, 24),) for _ in range(6)], {}, accum=2, opt="sgd")
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)
    assert compile_records()[-1].counters["grads_donated"] == 5
