"""``zinf_compile.init``: models built straight into the store equal eager construction, and train like it.

Construction under init runs the modules' own initializers on the same RNG in the same order, so the
values are bitwise those of eager code with the same seed (no tolerance: nothing is reordered).
Training compares against eager with SGD: at dp = 1 with the eager compiler the ops are eager's, at
dp = 2 the gradient reduction runs in another order (tests/test_dp.py says why RTOL/ATOL apply).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch

from conftest import ATOL, RTOL

HERE = os.path.dirname(__file__)
CFG = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _eager(cfg: dict = CFG, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


def _assert_equal_state(model: nn.Module, ref_state: dict) -> None:
    full = zinf_compile.full_state_dict(model)
    assert full.keys() == ref_state.keys()
    for k, v in ref_state.items():
        assert torch.equal(full[k], v), k


def _train(model, cmodel, steps=3, batch=8):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = make_batch(GPTConfig(**CFG), batch, seed=step)
        loss = cmodel(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("init_std", [0.02, None])  # 0.02: GPT re-initializes its children after building them
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_init_equals_eager_and_trains_like_it(offload, init_std):
    cfg = dict(CFG, init_std=init_std)
    ref = _eager(cfg)
    ref_init = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(0)
    with zinf_compile.init(offload_params=offload, compiler="eager") as zi:
        model = GPT(GPTConfig(**cfg))
    # every parameter, plus the head's own weight, partitioned before GPT ties it to the embedding's
    assert zi.partitioned == len(list(model.parameters())) + 1
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    _assert_equal_state(model, ref_init)
    # compile uses the init's shards as they are (no re-partition, no broadcast)
    uids = [zinf_runtime.handle_of(p).uid for p in model.parameters()]
    cmodel = torch.compile(model, backend="zinf", options=zi.options)
    ref_losses = _train(ref, ref)
    losses = _train(model, cmodel)
    assert [zinf_runtime.handle_of(p).uid for p in model.parameters()] == uids
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    full, want = zinf_compile.full_state_dict(model), ref.state_dict()
    for k in want:
        torch.testing.assert_close(full[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def test_at_most_one_submodule_whole():
    """While a Block is built, every earlier Block's parameters are already 0-byte shards."""
    seen = []

    class Probe(nn.Module):
        def __init__(self, others):
            super().__init__()
            seen.append(sum(p.untyped_storage().nbytes() for o in others for p in o.parameters()))
            self.lin = nn.Linear(8, 8)

    with zinf_compile.init():
        blocks = []
        for _ in range(3):
            blocks.append(Probe(list(blocks)))
    assert seen == [0, 0, 0]
    assert all(p.untyped_storage().nbytes() == 0 for b in blocks for p in b.parameters())


def test_dtype_and_late_registered_parameters():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    extra_ref = torch.randn(3)
    torch.manual_seed(0)
    with zinf_compile.init(dtype=torch.bfloat16):
        m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        m.extra = nn.Parameter(torch.randn(3))  # registered after construction: partitioned on registration
    assert all(p.dtype == torch.bfloat16 and p.untyped_storage().nbytes() == 0 for p in m.parameters())
    full = zinf_compile.full_state_dict(m)
    want = dict(ref.to(torch.bfloat16).state_dict(), extra=extra_ref.to(torch.bfloat16))
    for k, v in want.items():
        assert torch.equal(full[k], v), k
    # a parameter added after the block is partitioned by torch.compile's own path
    m.late = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    assert zinf_runtime.handle_of(m.late) is None


def test_parameter_added_after_init_partitioned_at_compile():
    torch.manual_seed(0)
    with zinf_compile.init(compiler="eager") as zi:
        m = nn.Linear(4, 3)
    m.scale = nn.Parameter(torch.full((3,), 2.0))

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * self.inner.scale

    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    out = torch.compile(Wrap(m), backend="zinf", options=zi.options)(x)
    assert zinf_runtime.handle_of(m.scale) is not None and m.scale.untyped_storage().nbytes() == 0
    torch.testing.assert_close(out, ref(x) * 2.0, rtol=0, atol=0)


def test_compile_options_differing_from_init_name_both():
    with zinf_compile.init(offload_params="cpu", compiler="eager"):
        m = nn.Linear(4, 3)
    with pytest.raises(Exception, match=r"already partitioned with Placement\(tier='cpu'.*not Placement\(tier='device'"):
        torch.compile(m, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 4))


def _gpt2_init(m: nn.Module) -> None:
    """A torchtitan-style per-module init (GPT-2's normal(0, 0.02), zero biases; norms reset): it must set
    every tensor, since materialize() runs it instead of reset_parameters."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        m.reset_parameters()


def _meta_model(cfg: dict, offload: str = "cpu", init_fn=None, **opts):
    torch.manual_seed(0)
    with zinf_compile.init(offload_params=offload, compiler="eager", **opts) as zi:
        with torch.device("meta"):
            model = GPT(GPTConfig(**cfg))
        assert all(p.device.type == "meta" for p in model.parameters())
        zi.materialize(model, init_fn)
    return model, zi


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_meta_model_materialized_equals_eager_and_trains(offload):
    """to_empty + reset_parameters, one module at a time: bitwise eager construction (init_std=None: the
    modules' own reset_parameters, as their constructors ran them; the tied head's reset consumes the RNG
    on a throwaway, as GPT's head did before it was tied)."""
    cfg = dict(CFG, init_std=None)
    ref = _eager(cfg)
    ref_init = {k: v.clone() for k, v in ref.state_dict().items()}
    model, zi = _meta_model(cfg, offload)
    assert all(p.device.type == "cpu" and p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert zi.partitioned == len(list(model.parameters()))  # the tied weight once
    assert model.head.weight is model.tok.weight
    _assert_equal_state(model, ref_init)
    cmodel = torch.compile(model, backend="zinf", options=zi.options)
    ref_losses = _train(ref, ref)
    losses = _train(model, cmodel)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)


class _TiedFirst(nn.Module):
    """A tied module built before others: its constructor's reset_parameters consumed the RNG on its own
    weight, which was tied afterwards; the modules after it depend on that RNG consumption."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6, bias=False)  # only a tied parameter once tied
        self.b.weight = self.a.weight
        self.c = nn.Linear(6, 3)
        self.d = nn.Linear(4, 6)  # a tied weight and a fresh bias
        self.d.weight = self.a.weight


def test_meta_tied_modules_consume_the_rng_as_their_constructors_did():
    torch.manual_seed(0)
    ref = _TiedFirst().state_dict()
    torch.manual_seed(0)
    with zinf_compile.init(compiler="eager") as zi:
        with torch.device("meta"):
            model = _TiedFirst()
        zi.materialize(model)
    assert model.b.weight is model.a.weight is model.d.weight
    _assert_equal_state(model, ref)


def test_meta_model_with_init_fn_equals_eager_init_order():
    """init_fn per module (torchtitan's init_weights): equals eager construction followed by the same
    init_fn over model.modules() after the same seed; the tied weight gets the last write (the head's)."""
    ref = _eager(dict(CFG, init_std=None))
    torch.manual_seed(0)
    for m in ref.modules():
        _gpt2_init(m)
    model, _ = _meta_model(dict(CFG), init_fn=_gpt2_init)
    _assert_equal_state(model, ref.state_dict())


def test_meta_materialize_keeps_at_most_one_module_whole(tmp_path):
    """While one module is initialized, every other module's parameters are 0-byte shards or meta; NVMe."""
    whole = []

    def probe(m: nn.Module) -> None:
        whole.append(sum(p.untyped_storage().nbytes() for p in model.parameters()
                         if p.device.type != "meta" and all(p is not q for q in m.parameters(recurse=False))))
        _gpt2_init(m)

    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="not materialized"):
        with zinf_compile.init(offload_params="nvme", nvme_path=str(tmp_path), compiler="eager") as zi:
            with torch.device("meta"):
                model = GPT(GPTConfig(**CFG))
    zi.materialize(model, probe)  # after the block: it is re-entered for the walk
    assert len(whole) == len(list(model.modules())) and set(whole) == {0}
    ref = _eager(dict(CFG, init_std=None))
    torch.manual_seed(0)
    for m in ref.modules():
        _gpt2_init(m)
    _assert_equal_state(model, ref.state_dict())


def test_meta_parameters_left_unmaterialized_warn():
    with pytest.warns(UserWarning, match=r"not materialized.*zi\.materialize\(model\)"):
        with zinf_compile.init():
            with torch.device("meta"):
                lin = nn.Linear(4, 3)
    assert lin.weight.device.type == "meta"
    # the block cleaned up: later modules construct normally, unpartitioned
    lin = nn.Linear(2, 2)
    assert lin.weight.untyped_storage().nbytes() > 0
    assert nn.Linear.__init__ is nn.Linear.__dict__["__init__"] and not hasattr(nn.Linear.__init__, "__wrapped__")


def test_class_defined_inside_block_and_data_assignment():
    torch.manual_seed(0)
    with zinf_compile.init():
        class Late(nn.Module):  # its __init__ is not wrapped: parameters partition on registration
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.empty(5, 4))
                nn.init.normal_(self.w)  # writes a partitioned parameter: gathered, written back

        m = Late()
        with pytest.raises(RuntimeError, match=r"\.data = "):
            m.w.data = torch.zeros(5, 4)
    torch.manual_seed(0)
    want = nn.init.normal_(torch.empty(5, 4))
    assert m.w.untyped_storage().nbytes() == 0
    assert torch.equal(zinf_compile.full_state_dict(m)["w"], want)


def test_nvme_init(tmp_path):
    ref_state = _eager().state_dict()
    torch.manual_seed(0)
    with zinf_compile.init(offload_params="nvme", nvme_path=str(tmp_path), compiler="eager") as zi:
        model = GPT(GPTConfig(**CFG))
    assert zi.placement.tier == "nvme"
    _assert_equal_state(model, ref_state)


def _run_dp(tmp_path, steps=3, global_batch=8, nproc=2, timeout=300):
    out = tmp_path / "init_dp.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.join(HERE, "workers", "init_dp.py"),
           str(out), json.dumps(CFG), str(steps), str(global_batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def test_init_dp2_equals_eager_and_trains(tmp_path):
    res = _run_dp(tmp_path)
    ref = _eager()
    for k, v in ref.state_dict().items():
        assert torch.equal(res["initial"][k], v), k
    assert res["no_storage"]
    # the meta-built copy, materialized module by module on each rank, equals eager construction
    meta_ref = _eager(dict(CFG, init_std=None)).state_dict()
    assert res["meta_initial"].keys() == meta_ref.keys()
    for k, v in meta_ref.items():
        assert torch.equal(res["meta_initial"][k], v), k
    assert res["meta_no_storage"] and res["meta_shards"] == res["shards"]
    total = sum(p.numel() * 4 for p in ref.parameters())
    assert all(s <= total // 2 + 4 * len(list(ref.parameters())) for s in res["shards"]), (res["shards"], total)
    ref_losses = _train(ref, ref)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(res["final"][k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
