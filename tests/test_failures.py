"""Failures leave the user whole: a compile that fails after partitioning, a graph the passes cannot
rewrite, the uncompiled module called after partitioning, dtypes the store cannot hold.

Numerics: the gather-all fallback runs the Dynamo graph eagerly with the gathered parameters, which
calls the same kernels in the same order as eager PyTorch on the same module; at dp = 1 the gathered
parameter is the fp32 master itself, and the gradient shard is the full gradient. So gradients after
one step are compared bitwise, and training (SGD with momentum) with conftest's tight tolerances.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import warnings
from typing import Callable, List, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile
import zinf_runtime
from zinf_runtime.grads import ShardedGrad
from zinf_compile import _torch_compat, backend, fallback
from zinf_compile.models import MLP

from conftest import assert_same_training, train_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp_batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 16, generator=g),) for _ in range(n)]


def _raising(tag: str, when: Optional[Callable[[int], bool]] = None):
    calls = [0]

    def boom(gm, example_inputs, *, ctx):
        calls[0] += 1
        if when is None or when(calls[0]):
            raise RuntimeError(f"deliberate failure in {tag}")
        return gm

    return boom


def _break_pass(monkeypatch, stage: str, name: str, fn) -> None:
    """Replace pass ``name`` in the backend's pass list ``stage`` (e.g. ``"JOINT_PASSES"``), for this test."""
    passes = getattr(backend, stage)
    assert name in [n for n, _ in passes], f"no pass {name} in {stage}"
    monkeypatch.setattr(backend, stage, [(n, fn if n == name else f) for n, f in passes])


def _next_record_id() -> int:
    return max((r.id for r in zinf_compile.compile_records()), default=-1) + 1


def _fallback_warnings(record: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in record if "gather-all fallback" in str(w.message)]


# -- 1 & 2: a compile that fails after partitioning runs the gather-all fallback ------------------

FAILURES = [  # (pass list, pass, compiler): a failure in every stage after partitioning
    ("DYNAMO_PASSES", "tile_matmul", "eager"),
    ("JOINT_PASSES", "insert_fetch", "eager"),
    ("BACKWARD_PASSES", "reduce_grad", "eager"),  # the backward compiles with the forward: still caught
    ("FORWARD_PASSES", "insert_release", "inductor"),
]


@pytest.mark.parametrize("stage,name,compiler", FAILURES)
def test_failing_pass_falls_back_and_trains_like_eager(monkeypatch, stage, name, compiler):
    _break_pass(monkeypatch, stage, name, _raising(name))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run = train_pair(lambda: MLP(), mlp_batches(3), {"compiler": compiler}, opt="sgd", lr=0.1)
    msgs = _fallback_warnings(rec)
    assert msgs, "no fallback warning"
    assert f"deliberate failure in {name}" in msgs[0] and "layers.0.weight" in msgs[0]  # names graph and reason
    assert_same_training(run, exact=False)
    ref, m = run.ref, run.model
    for p in m.parameters():  # still partitioned: the shards serve any other graph (the loop zeroed grads)
        assert zinf_runtime.handle_of(p) is not None and p.untyped_storage().nbytes() == 0 and p.grad is None
    assert sum(r.counters["gather_all_fallback"] for r in zinf_compile.compile_records()) >= 1


def test_inductor_failure_falls_back(monkeypatch):
    """Inductor itself raising (code generation), not one of zinf's passes."""
    def broken_inner(*args, **kwargs):
        raise RuntimeError("deliberate Inductor failure")

    monkeypatch.setattr(_torch_compat, "inductor_compile_fx_inner", broken_inner)
    with pytest.warns(UserWarning, match="gather-all fallback.*deliberate Inductor failure"):
        run = train_pair(lambda: MLP(), mlp_batches(3), {}, opt="sgd", lr=0.1)
    assert_same_training(run, exact=False)
    ref, m = run.ref, run.model


def test_fallback_gradients_after_one_step_are_eager_bitwise(monkeypatch):
    _break_pass(monkeypatch, "JOINT_PASSES", "insert_fetch", _raising("insert_fetch"))
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    (x,) = mlp_batches(1)[0]
    ref(x).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="gather-all fallback"):
        cmodel(x).pow(2).mean().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        h = zinf_runtime.handle_of(q)
        assert isinstance(q.grad, ShardedGrad) and h.grad is not None, name
        assert torch.equal(h.grad[: p.numel()].view(p.shape), p.grad), name  # same kernels, same order
        assert torch.equal(q.grad.full_tensor(), p.grad), name


# two graphs sharing the parameter ``scale``: one may compile while the other falls back
from test_parity import BreakModel  # noqa: E402


def test_one_graph_falls_back_while_the_other_is_compiled(monkeypatch):
    # the Dynamo-stage pass runs once per graph: fail the second graph only
    _break_pass(monkeypatch, "DYNAMO_PASSES", "plan_tiling", _raising("graph 2", when=lambda n: n == 2))
    start = _next_record_id()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run = train_pair(BreakModel, mlp_batches(3), {"compiler": "eager"}, opt="sgd", lr=0.1)
    msgs = _fallback_warnings(rec)
    assert len(msgs) == 1 and "b.weight" in msgs[0], msgs
    recs = [r for r in zinf_compile.compile_records() if r.id >= start and r.counters["partitioned_inputs"]]
    assert [r.counters["gather_all_fallback"] for r in recs] == [0, 1]
    assert_same_training(run, exact=False)
    ref, m = run.ref, run.model  # scale's gradient: one part reduced by a graph, one by the fallback


class EmaModel(nn.Module):
    """Writes a (frozen) parameter in place during forward: zinf's rewrite would lose the write."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.ema = nn.Parameter(torch.zeros(16), requires_grad=False)

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(y.mean(0))
        return (y + self.ema).pow(2).mean()


def test_in_place_parameter_write_falls_back_and_keeps_the_write():
    with pytest.warns(UserWarning, match=r"gather-all fallback: it writes partitioned parameter ema in place \(mul_\)"):
        run = train_pair(EmaModel, mlp_batches(3), {"compiler": "eager"}, opt="sgd", lr=0.1)
    assert_same_training(run, exact=False)
    ref, m = run.ref, run.model
    assert zinf_compile.full_state_dict(m)["ema"].abs().sum() > 0  # the writes reached the shards


def test_bad_setting_before_partitioning_still_raises():
    """A validation error is the user's to fix: it raises, and nothing was partitioned."""
    class TwoDevices(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4, device="meta")

        def forward(self, x):
            return self.a(x), self.b(x.to("meta"))

    model = TwoDevices()
    with pytest.raises(Exception, match="several devices"):
        torch.compile(model, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 4))
    assert zinf_runtime.handle_of(model.a.weight) is None and model.a.weight.untyped_storage().nbytes() > 0


def test_ordinary_models_compile_without_fallback():
    """The fallback is for failures only: a GPT (tied embedding, LayerNorm, attention) and a model with
    a graph break compile normally, without a fallback warning."""
    from zinf_compile.models import GPT, GPTConfig, make_batch

    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
    start = _next_record_id()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.compile(GPT(cfg), backend="zinf", options={"compiler": "eager"})(*make_batch(cfg, 2, seed=0)).backward()
        torch.compile(BreakModel(), backend="zinf", options={"compiler": "eager"})(torch.randn(4, 16)).sum().backward()
    assert not _fallback_warnings(rec)
    recs = [r for r in zinf_compile.compile_records() if r.id >= start]
    assert len(recs) == 3 and all(r.counters["partitioned_inputs"] > 0 for r in recs)
    assert all(r.counters["gather_all_fallback"] == 0 for r in recs)


# -- 3: the uncompiled module after partitioning ---------------------------------------------------

_UNCOMPILED = textwrap.dedent("""
    import torch, torch.nn as nn
    import zinf_compile

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return self.lin(x * self.scale)  # x * 0-byte storage: a segfault in eager without the guard

    model = M()
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    x = torch.randn(4, 16)
    cmodel(x).sum().backward()
    for f in (lambda: model(x), lambda: model.lin(x)):
        try:
            f()
            print("NO ERROR")
        except RuntimeError as e:
            print("ERROR", type(e).__name__, e)
    with zinf_compile.gathered(model):
        print("GATHERED", tuple(model(x).shape))
""")


def test_uncompiled_module_after_partitioning_raises_naming_the_fix():
    # a subprocess: without the guard this call segfaults, which must fail the test, not kill pytest
    proc = subprocess.run([sys.executable, "-c", _UNCOMPILED], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ERROR", "NO ERROR", "GATHERED"))]
    assert len(lines) == 3, proc.stdout
    for line in lines[:2]:
        assert line.startswith("ERROR UncompiledCallError"), line
        assert "compiled module" in line and "zinf_compile.gathered(model)" in line
    assert "M.scale" in lines[0] and "Linear.weight" in lines[1]
    assert lines[2] == "GATHERED (4, 16)"


class _OwnParameter(nn.Parameter):
    """A user's Parameter subclass; in the test below its class change is refused, so it keeps its class
    when partitioned (otherwise it becomes ``PartitionedOwnParameter``, and Dynamo's type guard then
    compiles a second instance anew, as for plain Parameters)."""


def test_guard_covers_another_instance_run_through_the_same_graph(monkeypatch):
    """Dynamo runs a second instance of the class through the graph compiled for the first, without
    compiling (the runtime partitions its parameters on that call): its modules get the guard then.
    Reached when a parameter keeps its class: a subclass whose class change is refused (warned)."""
    from zinf_runtime import store

    def refuse(cls):
        raise TypeError("__class__ assignment: layout differs")

    monkeypatch.setattr(store, "partitioned_class", refuse)

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = _OwnParameter(torch.randn(16, 16))

        def forward(self, x):
            return F.linear(x, self.weight)  # uncompiled: torch's bounds check raises (no segfault here)

    first, second = Lin(), Lin()
    c1 = torch.compile(first, backend="zinf", options={"compiler": "eager"})
    c2 = torch.compile(second, backend="zinf", options={"compiler": "eager"})
    (x,) = mlp_batches(1)[0]
    with pytest.warns(UserWarning, match=r"'weight' of class _OwnParameter cannot be guarded"):
        c1(x).sum().backward()
    n = _next_record_id()
    c2(x).sum().backward()
    assert _next_record_id() == n  # the second instance compiled nothing: it ran the first one's graph
    assert zinf_runtime.handle_of(second.weight) is not None
    for model in (first, second):
        with pytest.raises(fallback.UncompiledCallError, match=r"Lin\.weight.*compiled module"):
            model(x)
    c2(x).sum().backward()  # the compiled path still runs


def _train_counts(model_fn, guard: bool, monkeypatch, compile_in_place: bool = False):
    from torch._dynamo.utils import counters

    if not guard:
        monkeypatch.setattr(fallback, "install_call_guards", lambda params: 0)
    torch._dynamo.reset()
    counters.clear()
    model = model_fn()
    if compile_in_place:
        model.compile(backend="zinf", options={"compiler": "eager"})
        cmodel = model
    else:
        cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.1)
    start = _next_record_id()
    for (x,) in mlp_batches(4):
        cmodel(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    monkeypatch.undo()
    return {"zinf_compiles": sum(r.id >= start for r in zinf_compile.compile_records()),
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())}


@pytest.mark.parametrize("in_place", [False, True], ids=["torch.compile", "module.compile"])
def test_guard_adds_no_recompile_or_graph_break(monkeypatch, in_place):
    """The guard is a forward pre-hook registered after the first graph was traced: Dynamo does not
    guard on hooks (no recompile), and traces it as a no-op in later graphs (no graph break)."""
    with_guard = _train_counts(BreakModel, True, monkeypatch, in_place)
    without = _train_counts(BreakModel, False, monkeypatch, in_place)
    assert with_guard == without == {"zinf_compiles": 2, "unique_graphs": 2, "graph_breaks": 1, "recompiles": 0}


# -- 4: dtypes the fp32 master shards cannot hold --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_fp64_and_complex_parameters_are_refused_by_name(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh() if not dtype.is_complex else nn.Identity(), nn.Linear(8, 4))
    model.to(dtype)
    x = torch.randn(6, 16).to(dtype)
    want = model(x).detach().clone()
    with pytest.raises(Exception, match=rf"parameter '0\.weight' is {dtype}.*fp32 master"):
        torch.compile(model, backend="zinf", options={"compiler": "eager"})(x)
    for p in model.parameters():  # refused before anything was partitioned: the model is intact
        assert zinf_runtime.handle_of(p) is None and p.untyped_storage().nbytes() == p.numel() * p.element_size()
    assert torch.equal(model(x), want)


def test_one_fp64_parameter_in_an_fp32_model_is_refused_by_name():
    model = BreakModel()
    model.scale.data = model.scale.data.double()
    with pytest.raises(Exception, match=r"parameter 'scale' is torch.float64"):
        torch.compile(model, backend="zinf", options={"compiler": "eager"})(torch.randn(4, 16))
    assert all(zinf_runtime.handle_of(p) is None for p in model.parameters())


# -- the fallback at dp = 2 (collective gathers and reduce-scatters in the same order on every rank) --

_DP_WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import zinf_compile
    from zinf_compile import backend
    from zinf_compile.models import GPT, GPTConfig
    from dp_common import train_on_slices  # tests/workers, on PYTHONPATH

    def boom(gm, example_inputs, *, ctx):
        raise RuntimeError("deliberate failure in insert_fetch")

    backend.JOINT_PASSES = [(n, boom if n == "insert_fetch" else f) for n, f in backend.JOINT_PASSES]
    out, cfg, steps, global_batch = sys.argv[1], GPTConfig(**json.loads(sys.argv[2])), int(sys.argv[3]), 8
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(cfg)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = train_on_slices(cmodel, opt, cfg, steps, global_batch)
    fallbacks = sum(r.counters["gather_all_fallback"] for r in zinf_compile.compile_records())
    full = zinf_compile.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save({"losses": losses, "state": full, "fallbacks": fallbacks}, out)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_fallback_at_dp2_matches_single_process_eager(tmp_path):
    import json
    import socket

    from zinf_compile.models import GPT, GPTConfig, make_batch

    cfg = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
    steps = 3
    worker = tmp_path / "fallback_dp_worker.py"
    worker.write_text(_DP_WORKER)
    out = tmp_path / "result.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(worker), str(out), json.dumps(cfg), str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1",
                                   PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "workers"),
                                                               os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = torch.load(out)
    assert res["fallbacks"] >= 1
    c = GPTConfig(**cfg)
    torch.manual_seed(0)
    ref = GPT(c)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):  # one process on the global batch: what dp = 2 must reproduce
        x, y = make_batch(c, 8, seed=step)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(res["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
