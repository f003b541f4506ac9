"""``copy_escaping``: a compiled forward that returns a view of a partitioned parameter gives a copy of
its value, with eager's values and gradients, and a warning (writes to it do not reach the parameter).

Before the pass, AOTAutograd handed the caller a view regenerated from the 0-byte placeholder, and
reading it crashed the process (segmentation fault), so this file has no "without the pass" case.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from zinf_compile.pipeline import compile_records

from conftest import ATOL, RTOL, zinf_full_grads


class ReturnsViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor):
        return torch.tanh(x @ self.w + self.b), self.w.t(), self.b.view(2, 2)


def _loss(outs) -> torch.Tensor:
    y, wt, bv = outs
    return y.sum() + (wt * wt).sum() + (bv * 3).sum()


@pytest.mark.parametrize("mode,compiler", [("in_memory", "eager"), ("in_memory", "inductor"), ("cpu", "eager"),
                                           ("nvme", "eager")])
def test_returned_parameter_views_are_copies_with_eager_values_and_grads(mode, compiler, tmp_path):
    opts = {"in_memory": {}, "cpu": {"offload_params": "cpu", "offload_optimizer": "cpu"},
            "nvme": {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}}[mode]
    torch.manual_seed(0)
    ref = ReturnsViews()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": compiler, **opts})
    x = torch.randn(3, 4)
    for i in range(2):  # two micro-batches: the second call runs the compiled graph again
        if i == 0:  # the compile warns, once per parameter
            with pytest.warns(UserWarning, match=r"returns partitioned parameter (w|b).*copy"):
                outs = cm(x)
        else:
            outs = cm(x)
        want = ref(x)
        for got, exp in zip(outs, want):
            assert got.untyped_storage().nbytes() > 0
            if compiler == "eager":
                assert torch.equal(got.detach(), exp.detach())
            else:  # a 4-term dot and tanh per value: a few ulps
                torch.testing.assert_close(got.detach(), exp.detach(), rtol=RTOL, atol=ATOL)
        _loss(outs).backward()
        _loss(want).backward()
    grads = zinf_full_grads(model)
    for name, p in ref.named_parameters():
        if compiler == "eager":
            assert torch.equal(grads[name], p.grad), name
        else:
            torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    assert compile_records()[-1].counters["escaping_params_copied"] == 2
    with torch.no_grad():  # a copy: writing into it leaves the parameter alone
        outs[2].zero_()
    assert torch.equal(cm(x)[2].detach(), ref(x)[2].detach())
