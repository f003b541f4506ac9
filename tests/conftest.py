"""Shared fixtures: a clean Dynamo per test, and the eager-vs-zinf training parity harness."""

from __future__ import annotations

import copy
import os
import sys
from typing import Callable, List, Optional, Sequence

import pytest
import torch

import zinf_compile

sys.path.insert(0, os.path.dirname(__file__))

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models: no recompile limits or caches leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def default_loss(model: torch.nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    out = model(*batch)
    return out if out.dim() == 0 else out.pow(2).mean()


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
):
    """Train an eager model with torch.optim and its zinf copy with zinf_compile.optim, side by side.

    Returns (eager losses, zinf losses, eager model, zinf model). ``batches`` holds ``steps * accum``
    micro-batches; losses are per micro-batch. Comparisons against Inductor-compiled zinf use a larger
    Adam ``eps``: Inductor's fused kernels round differently (~1e-9), and on elements whose true
    gradient is ~0 Adam divides that noise by its own square root, which is amplification, not error.
    """
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    kw = dict(lr=lr, weight_decay=0.1, eps=eps) if opt == "adamw" else dict(lr=lr, momentum=0.9)
    ropt = (torch.optim.AdamW if opt == "adamw" else torch.optim.SGD)(
        [p for p in ref.parameters() if p.requires_grad], **kw)
    zopt = (zinf_compile.optim.AdamW if opt == "adamw" else zinf_compile.optim.SGD)(
        [p for p in model.parameters() if p.requires_grad], **kw)
    cmodel = torch.compile(model, backend="zinf", options=dict(options or {}))
    rl, zl = [], []
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
            ropt.step(); ropt.zero_grad()
            zopt.step(); zopt.zero_grad()
    return rl, zl, ref, model


def assert_same_training(rl, zl, ref, model, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.tensor(zl), torch.tensor(rl), rtol=rtol, atol=atol)
    full = zinf_compile.full_state_dict(model)
    want = ref.state_dict()
    assert full.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(full[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
