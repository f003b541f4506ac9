"""Eager code on a partitioned parameter gets eager's meaning or ``PartitionedDataError``, never a crash.

A partitioned parameter keeps its shape over 0 bytes of storage (its values live in zinf's shards).
Training loops touch parameters outside the compiled module: an EMA update, a weight-norm log,
``parameters_to_vector``, ``state_dict``. Before ``PartitionedParameter.__torch_function__`` each of
those read unmapped memory and killed the process (segmentation fault). Now
(``runtime/eager_access.py``):

- ``model.state_dict()`` gives full CPU tensors with eager's values and keys, and ``torch.save`` works;
- ``model.load_state_dict(sd)`` and ``p.copy_(v)`` under ``no_grad`` write through to the shards;
- ``model.to(d)``, ``.cpu()``, ``.float()`` to what the parameters already are return them;
- every other read or write raises an error naming the parameter and ``zinf_compile.gathered``;

and nothing is lost: the model trains on exactly as eager does.

The reads run in a subprocess, so a regression fails this test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from conftest import ATOL, RTOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the two models a worker compares, defined after its ``class M``: eager ``ref`` and ``model`` (compiled
# lazily as ``cmodel``: its first call partitions it), trained together by ``step(i)`` with SGD
_TWINS = textwrap.dedent("""
    torch.manual_seed(0)
    ref = M()
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    xs = [torch.randn(4, 8) for _ in range(3)]

    def step(i):
        for m, opt in zip((ref, cmodel), opts):
            opt.zero_grad()
            m(xs[i]).pow(2).sum().backward()
            opt.step()
""")

_WORKER = textwrap.dedent("""
    import copy, io, json
    import torch, torch.nn as nn
    import zinf_compile
    from zinf_compile import PartitionedDataError

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

        def forward(self, x):
            return torch.tanh(self.lin(x) * self.scale)

""") + _TWINS + textwrap.dedent("""
    step(0)
    w, s = model.lin.weight, model.scale
    reads = {
        "sum": lambda: w.sum(),
        "mul": lambda: s * 2,
        "norm": lambda: torch.linalg.vector_norm(w),
        "cat": lambda: torch.cat([s, s]),
        "detach": lambda: w.detach(),
        "data": lambda: w.data,
        "data_set": lambda: setattr(w, "data", torch.zeros(8, 8)),
        "view": lambda: w.view(-1),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "ema_mul_": lambda: torch.no_grad()(lambda: w.mul_(0.9))(),
        "foreach": lambda: torch._foreach_norm([w, s]),
        "item": lambda: s[0].item(),
    }
    out = {"errors": {}}
    for name, f in reads.items():
        try:
            f()
            out["errors"][name] = None
        except PartitionedDataError as e:
            out["errors"][name] = str(e)
    # metadata and autograd fields touch no element: they work as on any parameter
    out["meta"] = [list(w.shape), w.numel(), str(w.dtype), str(w.device), w.requires_grad, w.is_leaf,
                   w.grad is None, w.dim(), w.element_size(), "PartitionedParameter" in repr(w)]
    w.requires_grad_(True)

    # served, with eager's meaning: state_dict gives full CPU values under eager's keys (and saves)
    sd, rsd = model.state_dict(), ref.state_dict()
    out["sd_keys"] = list(sd) == list(rsd)
    out["sd_diff"] = {k: float((sd[k] - v).abs().max()) for k, v in rsd.items()}
    out["sd_scale"] = {k: float(v.abs().max()) for k, v in rsd.items()}
    out["sd_plain"] = all(type(v) is torch.Tensor and v.device.type == "cpu" and not v.requires_grad
                          for v in sd.values())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    out["saved_equal"] = all(torch.equal(v, sd[k]) for k, v in torch.load(buf).items())
    # moves and casts to what the parameters already are return them, as in eager
    for f in (lambda: model.to("cpu"), model.cpu, model.float, lambda: model.to(torch.float32),
              lambda: model.to(torch.device("cpu"), torch.float32), lambda: model.to(torch.zeros(1))):
        f()
    out["same_objects"] = model.lin.weight is w and model.scale is s
    # real moves and casts are refused before anything changed
    out["moves"] = {}
    for name, f in {"to_double": lambda: model.to(torch.float64), "half": model.half,
                    "copy": lambda: w.to("cpu", copy=True)}.items():
        try:
            f()
            out["moves"][name] = None
        except PartitionedDataError as e:
            out["moves"][name] = str(e)
    # load_state_dict and copy_ outside autograd write through to the shards (ref does the same)
    torch.manual_seed(1)
    other = M().state_dict()
    out["load"] = str(model.load_state_dict(other))
    ref.load_state_dict(other)
    with torch.no_grad():
        for m in (model, ref):
            m.scale.copy_(torch.full((8,), 0.75))
    out["loaded_diff"] = max(float((zinf_compile.full_state_dict(model)[k] - v).abs().max())
                             for k, v in ref.state_dict().items())
    try:  # an in-place write to a leaf that requires grad is an error in eager too
        model.scale.copy_(torch.ones(8))
        out["copy_under_grad"] = None
    except RuntimeError as e:
        out["copy_under_grad"] = str(e)
    step(1)
    step(2)
    sd = zinf_compile.full_state_dict(model)
    out["diff"] = {k: float((sd[k] - v).abs().max()) for k, v in ref.state_dict().items()}
    out["scale_rel"] = {k: float(v.abs().max()) for k, v in ref.state_dict().items()}
    with zinf_compile.gathered(model):
        out["gathered_sum"] = float(model.lin.weight.sum())
    out["ref_sum"] = float(ref.lin.weight.sum())

    # a forward returning the parameter object itself: Dynamo hands the caller the module attribute
    class R(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.w, self.w

    r = torch.compile(R(), backend="zinf", options={"compiler": "eager"})
    y, w_out = r(torch.randn(2, 4))
    try:
        float(w_out.sum())
        out["returned_param"] = None
    except PartitionedDataError as e:
        out["returned_param"] = str(e)
    # load_state_dict(assign=True) replaces the parameter object: the compiled module uses the new one
    lin = nn.Linear(4, 1, bias=False)
    clin = torch.compile(lin, backend="zinf", options={"compiler": "eager"})
    clin(torch.ones(1, 4))
    lin.load_state_dict({"weight": torch.full((1, 4), 0.5)}, assign=True)
    out["assign_out"] = clin(torch.ones(1, 4)).item()
    print("RESULT " + json.dumps(out))
""")


def test_eager_reads_of_partitioned_parameters_raise_and_lose_nothing():
    proc = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode} (a segfault is -11): {proc.stderr[-3000:]}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    for name, msg in out["errors"].items():
        assert msg is not None, f"{name}: no error on a 0-byte parameter"
        assert "zinf_compile.gathered" in msg, (name, msg)
        assert ("'lin.weight'" in msg or "'scale'" in msg or "'weight'" in msg), (name, msg)
    assert out["meta"] == [[8, 8], 64, "torch.float32", "cpu", True, True, False, 2, 4, True]
    assert out["sd_keys"] and out["sd_plain"] and out["saved_equal"], out
    for k, d in out["sd_diff"].items():  # one SGD step
        assert d <= ATOL + RTOL * out["sd_scale"][k], (k, d)
    assert out["same_objects"]
    for name, msg in out["moves"].items():
        assert msg is not None and "before its first compiled call" in msg, (name, msg)
    assert out["load"] == "<All keys matched successfully>", out["load"]
    assert out["loaded_diff"] == 0.0  # the loaded values exactly, in fp32
    assert out["copy_under_grad"] is not None
    assert out["assign_out"] == 2.0  # 4 x 0.5, as eager
    for k, d in out["diff"].items():  # three SGD steps, one of them after every refused call
        assert d <= ATOL + RTOL * out["scale_rel"][k], (k, d)
    assert out["returned_param"] is not None and "'w'" in out["returned_param"], out["returned_param"]
    assert abs(out["gathered_sum"] - out["ref_sum"]) <= ATOL * 64 + RTOL * abs(out["ref_sum"])


_SUBCLASS_WORKER = textwrap.dedent("""
    import copy, json
    import torch, torch.nn as nn
    import zinf_compile
    from zinf_compile import PartitionedDataError

    class Tagged(nn.Parameter):  # a user's own Parameter subclass, with a method and an attribute
        def doubled_shape(self):
            return [2 * d for d in self.shape]

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = Tagged(torch.randn(8, 8))

        def forward(self, x):
            return torch.tanh(self.lin(x) @ self.w)

""") + _TWINS + textwrap.dedent("""
    model.w.tag = "mine"  # set before the first call partitions it: the attribute survives the class change
    step(0)
    w = model.w
    out = {"isinstance": isinstance(w, Tagged), "method": w.doubled_shape(), "tag": w.tag, "errors": {}}
    for name, f in {"sum": lambda: w.sum(), "mixed_foreach": lambda: torch._foreach_norm([model.lin.weight, w]),
                    "mixed_cat": lambda: torch.cat([w.new_zeros(0), model.lin.bias])}.items():
        try:
            f()
            out["errors"][name] = None
        except PartitionedDataError as e:
            out["errors"][name] = str(e)
    c = copy.deepcopy(w)  # eager's meaning: Tagged(values, requires_grad), no attributes (torch's deepcopy)
    out["copy"] = [type(c).__name__, getattr(c, "tag", None), c.requires_grad,
                   float((c.detach() - ref.w.detach()).abs().max())]
    sd = model.state_dict()
    out["sd_diff"] = max(float((sd[k] - v).abs().max()) for k, v in ref.state_dict().items())
    step(1)
    out["diff"] = max(float((v - ref.state_dict()[k]).abs().max())
                      for k, v in zinf_compile.full_state_dict(model).items())
    print("RESULT " + json.dumps(out))
""")


def test_user_parameter_subclass_is_guarded_and_keeps_its_class():
    """A user's ``nn.Parameter`` subclass becomes a partitioned class derived from it: ``isinstance``, its
    methods and attributes hold, ``deepcopy`` gives the user's class with eager's values (as torch's
    ``Parameter.__deepcopy__`` does: no attributes), and an eager
    read raises ``PartitionedDataError`` (also mixed with plain partitioned parameters in one call).
    Before, such a parameter kept its class unguarded and ``w.sum()`` killed the process (SIGSEGV)."""
    proc = subprocess.run([sys.executable, "-c", _SUBCLASS_WORKER], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode} (a segfault is -11): {proc.stderr[-3000:]}"
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert out["isinstance"] and out["method"] == [16, 16] and out["tag"] == "mine", out
    for name, msg in out["errors"].items():
        assert msg is not None and "zinf_compile.gathered" in msg, (name, msg)
    assert out["copy"][:3] == ["Tagged", None, True] and out["copy"][3] <= ATOL + RTOL * 3, out["copy"]
    assert out["sd_diff"] <= ATOL + RTOL * 3 and out["diff"] <= ATOL + RTOL * 3, out
