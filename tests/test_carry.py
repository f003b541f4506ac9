"""Reads carried from the forward's end into the backward (``zinf_runtime.carry``).

Why bitwise: a carried read returns the same bytes as a read started at the backward's top, so a run
with carrying equals one without it exactly. Each test also checks, by the engine's counters, that
the path it is about really ran (adopted, stale, or dropped).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime.carry import carry_of

CFG = GPTConfig(vocab=64, seq=16, layers=3, hidden=32, heads=2)


def _train(tmp, options: dict, between: Optional[Callable[[torch.nn.Module, int], None]] = None,
           steps: int = 3) -> Tuple[List[float], Dict[str, torch.Tensor], Dict[str, int]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp),
            "nvme_read_cache_bytes": 0, "nvme_param_write_back": False,
            **options}  # every fetch reads the disk: the reads carry
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = make_batch(CFG, 4, seed=step)
        loss = cm(x, y)
        if between is not None:
            between(cm, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    (ctx,) = zinf_runtime.contexts_of(model)
    counters = dict(carry_of(ctx.transfers).counters) if "_carry" in ctx.transfers.__dict__ else {}
    return losses, zinf_compile.full_state_dict(model), counters


def _same(a, b) -> None:
    assert a[0] == b[0]
    for k, v in a[1].items():
        assert torch.equal(b[1][k], v), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = _train(tmp_path_factory.mktemp("ref"), {"disabled_passes": ("carry",)})
    assert ref[2] == {} or ref[2]["carried"] == 0
    return ref


def test_carried_reads_are_adopted_and_change_no_number(tmp_path, reference):
    run = _train(tmp_path, {})
    _same(reference, run)
    # the backward compiles with the forward (static shapes), so even the first step carries
    assert run[2]["adopted"] == run[2]["carried"] >= 3 and run[2]["stale"] == 0, run[2]


def test_a_slot_written_between_forward_and_backward_is_read_again(tmp_path, reference):
    """Rewriting a head parameter's NVMe slot (same values) after the forward makes its carried read
    stale: it is dropped and read afresh, never used."""
    def rewrite(model: torch.nn.Module, step: int) -> None:
        for p in model.parameters():
            h = zinf_runtime.handle_of(p)
            slot = h.param_copy or h._whole()
            slot.set(slot.get().clone())

    run = _train(tmp_path, {}, between=rewrite)
    _same(reference, run)
    assert run[2]["stale"] == run[2]["carried"] >= 3 and run[2]["adopted"] == 0, run[2]


@pytest.mark.slow
def test_a_forward_without_backward_drops_its_carried_reads(tmp_path, reference):
    def extra_forward(model: torch.nn.Module, step: int) -> None:
        x, y = make_batch(CFG, 4, seed=100 + step)
        model(x, y)  # grad enabled, never backpropagated: its reads are dropped at the next forward

    run = _train(tmp_path, {}, between=extra_forward)
    _same(reference, run)
    assert run[2]["dropped"] >= 1 and run[2]["adopted"] >= 1, run[2]


class _Broken(torch.nn.Module):
    """Three graphs in forward and three in backward: a graph break between each pair of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 32))
            for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        torch._dynamo.graph_break()  # not inside a loop: Dynamo resumes after a break, never mid-loop
        x = self.blocks[1](x)
        torch._dynamo.graph_break()
        return self.blocks[2](x).square().mean()


def _train_broken(tmp, options: dict, steps: int = 4, evals: int = 0):
    tmp.mkdir()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Broken()
    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp),
            "nvme_read_cache_bytes": 0, "nvme_param_write_back": False,
            **options}  # every fetch reads the disk: the reads carry
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = cm(torch.randn(8, 32, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        for _ in range(evals):
            losses.append(cm(torch.randn(8, 32, generator=gen)).item())
    (ctx,) = zinf_runtime.contexts_of(model)
    carry = carry_of(ctx.transfers) if "_carry" in ctx.transfers.__dict__ else None
    counters = dict(carry.counters) if carry is not None else {}
    return losses, zinf_compile.full_state_dict(model), counters, carry


def test_reads_are_carried_across_graph_breaks_in_forward_and_backward(tmp_path):
    """After the first step the stages' order is known (A fwd -> B fwd -> C fwd -> C bwd -> B bwd ->
    A bwd), and each stage's end starts the next one's first reads, across the breaks too; the
    numbers are those of a run that carries nothing."""
    ref = _train_broken(tmp_path / "ref", {"disabled_passes": ("carry",)})
    run = _train_broken(tmp_path / "run", {})
    _same(ref, run)
    c, carry = run[2], run[3]
    stages = {s for s in carry.heads}
    assert {st for _, st in stages} == {"forward", "backward"} and len(stages) == 6, stages
    order = [k for k, _ in sorted((s for s in stages if s[1] == "forward"), key=lambda s: s[0])]
    a, b, z = order
    assert carry.next[(a, "forward")] == (b, "forward") and carry.next[(b, "forward")] == (z, "forward")
    assert carry.next[(z, "backward")] == (b, "backward") and carry.next[(b, "backward")] == (a, "backward")
    assert carry.target((a, "backward")) is None  # never across the optimizer step
    # steps 2..4 each carry into B fwd, C fwd, B bwd and A bwd (4 crossings), every read adopted
    assert c["across_graphs"] >= 3 * 4 and c["adopted"] == c["carried"] and c["stale"] == 0, c


def test_kept_values_leave_nothing_to_carry_and_train_as_a_run_that_carries_nothing(tmp_path):
    """Write-back: the values the last step kept in memory need no read, so a graph's end finds
    nothing to carry for the next graph (its look-ahead borrows each kept value and hands it straight
    back, ``runtime/carry.py``); the numbers are those of a run that carries nothing."""
    kept = {"nvme_param_write_back": True, "nvme_read_cache_bytes": 64 << 20}  # the cap of kept values
    ref = _train_broken(tmp_path / "ref", {"disabled_passes": ("carry",), **kept})
    run = _train_broken(tmp_path / "run", kept)
    _same(ref, run)
    c = run[2]
    assert c["across_graphs"] == 0 and c["stale"] == 0, c


def test_an_eval_loop_carries_across_its_graphs(tmp_path):
    """Under no_grad the inference graphs carry into each other, one batch into the next too."""
    ref = _train_broken(tmp_path / "ref", {"disabled_passes": ("carry",)}, steps=1, evals=3)
    run = _train_broken(tmp_path / "run", {}, steps=1, evals=3)
    _same(ref, run)
    c, carry = run[2], run[3]
    assert any(st == "inference" for _, st in carry.heads)
    inference_crossings = [s for s, t in carry.next.items() if s[1] == t[1] == "inference" and s[0] != t[0]]
    assert len(inference_crossings) >= 2 and c["stale"] == 0 and c["adopted"] > 0, (carry.next, c)
