"""Pass code is generated once per stage unless someone reads every pass's (``zinf_compile.pipeline``).

The runner used to recompile the module after every pass for its snapshot; now it recompiles once, at
the end of each stage. These tests check that the graphs and numbers do not depend on it, that the
code is there whenever it is asked for, and that the per-pass recompiles are really gone.
"""

from __future__ import annotations

import re

import pytest
import torch

import zinf_compile
from zinf_compile import pipeline
from zinf_compile.models import MLP

from conftest import assert_grads_equal, train_pair

STAGES = ("dynamo", "forward", "backward")


def _compile_once(options: dict) -> pipeline.CompileRecord:
    torch.manual_seed(0)
    model = MLP()
    torch.compile(model, backend="zinf", options={"compiler": "eager", **options})(
        torch.randn(2, 16)).sum().backward()
    return zinf_compile.compile_records()[-1]


def _digitless(code: str) -> str:
    return re.sub(r"\d+", "N", code)


def _count_recompiles(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    orig = torch.fx.GraphModule.recompile

    def counting(self):  # type: ignore[no-untyped-def]
        calls.append(1)
        return orig(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counting)
    return calls


def test_by_default_each_stage_keeps_its_last_graphs_code_and_every_pass_its_counts(monkeypatch):
    calls = _count_recompiles(monkeypatch)
    rec = _compile_once({})
    lean_recompiles = len(calls)
    for stage in STAGES:
        snaps = rec.graphs(stage)
        assert len(snaps) > 2, stage  # the input and at least two passes
        assert all(s.op_counts for s in snaps), stage
        assert isinstance(rec.final(stage).code, str) and "def forward" in rec.final(stage).code
        # the stage's final code is the module's that the compiler got
        assert rec.final(stage).code == rec.final_modules[stage].code or stage == "dynamo"
        # the last graph of each runner call has code (the dynamo stage runs in two calls, around
        # the tiles' re-layout); the graphs between have counts only
        ends = [a for a, b in zip(snaps, snaps[1:] + [None]) if b is None or b.pass_name == "input"]
        assert all(isinstance(s.code, str) for s in ends), stage
        middle = [s for s in snaps if s.pass_name != "input" and not any(s is e for e in ends)]
        assert middle and all(s.code is None for s in middle), stage
    assert rec.final("forward").count("zinf.fetch_shard") > 0

    calls.clear()
    full = _compile_once({"pass_code": True})
    passes = sum(1 for s in full.snapshots if s.pass_name != "input")
    # every pass recompiled for its snapshot there; here a stage recompiles once: the saving is real
    assert len(calls) - lean_recompiles >= passes - len(full.final_modules) - 1
    assert all(isinstance(s.code, str) for s in full.snapshots)
    for stage in STAGES:
        # the same graphs either way (numbers aside: each model's parameters get their own uids)
        assert _digitless(full.final(stage).code) == _digitless(rec.final(stage).code)
        assert [s.op_counts for s in full.graphs(stage)] == [s.op_counts for s in rec.graphs(stage)]


def test_dump_dir_and_structured_trace_keep_every_pass_code(tmp_path, monkeypatch):
    rec = _compile_once({"dump_dir": str(tmp_path)})
    assert all(isinstance(s.code, str) for s in rec.snapshots)
    files = sorted(p.name for p in (tmp_path / f"graph_{rec.id:03d}_{rec.name}").glob("*.py"))
    assert len(files) == len(rec.snapshots)

    from zinf_compile import _torch_compat

    monkeypatch.setattr(_torch_compat, "structured_trace_enabled", lambda: True)
    assert pipeline.keeps_pass_code(zinf_compile.Config())
    rec = _compile_once({})
    assert all(isinstance(s.code, str) for s in rec.snapshots)


def test_pass_code_must_be_a_bool():
    with pytest.raises(ValueError, match="'pass_code': expected True or False"):
        zinf_compile.Config.from_options({"pass_code": "yes"})


@pytest.mark.parametrize("pass_code", [False, True])
def test_gradients_match_eager_with_and_without_pass_code(pass_code):
    torch.manual_seed(1)
    batches = [(torch.randn(4, 16),)]
    run = train_pair(MLP, batches, {"compiler": "eager", "pass_code": pass_code})
    assert_grads_equal(run)
