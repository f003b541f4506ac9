"""Drop-in: any elementwise ``torch.optim`` optimizer steps partitioned parameters, unchanged.

Tolerances: at dp = 1 the gradients are the same values as eager's (same kernels, compiler="eager"),
and an elementwise update of a flat shard does per element what it does on the 2-D tensor; only the
vectorised/scalar split of a kernel can differ (last bit). Optimizers that divide by the root of a
second moment get ``eps=1e-3``: their update then moves by at most ``lr/eps`` times a gradient
difference, so last-bit noise in near-zero gradients stays ~1e-9 instead of becoming ``±lr``; with that,
every optimizer is held to the same ``rtol=1e-5, atol=1e-6`` as SGD.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime.optim import ShardedOptimizerMixin

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
TOL = dict(rtol=1e-5, atol=1e-6)
OPTIMIZERS = {
    "Adam": dict(eps=1e-3), "AdamW": dict(eps=1e-3), "SGD": dict(momentum=0.9, nesterov=True),
    "Adagrad": dict(eps=1e-3), "RMSprop": dict(eps=1e-3, momentum=0.5), "Adamax": dict(eps=1e-3),
    "NAdam": dict(eps=1e-3), "RAdam": dict(eps=1e-3), "ASGD": dict(t0=1.0),
}


def setup(options, make_opt):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager", **options})
    return ref, model, cmodel, make_opt(ref), make_opt(model)


def train(ref, model, cmodel, ropt, zopt, steps=3, clip=None, accum=1):
    for i in range(steps * accum):
        b = make_batch(CFG, 4, seed=i)
        (ref(*b) / accum).backward()
        (cmodel(*b) / accum).backward()
        if (i + 1) % accum:
            continue
        if clip is not None:
            torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), clip),
                                       torch.nn.utils.clip_grad_norm_(ref.parameters(), clip), **TOL)
        ropt.step(); zopt.step()
        ropt.zero_grad(set_to_none=True); zopt.zero_grad(set_to_none=True)


def assert_params_close(ref, model):
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **TOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torch_optimizer_unchanged(name, tier, tmp_path):
    cls = getattr(torch.optim, name)
    make = lambda m: cls(m.parameters(), lr=1e-2, **OPTIMIZERS[name])  # noqa: E731
    # 16 KiB sub-groups: the NVMe tier steps the model in several sub-groups per logical step
    ref, model, cmodel, ropt, zopt = setup({"offload_optimizer": tier, "nvme_path": str(tmp_path),
                                            "optimizer_sub_group_bytes": 16 << 10}, make)
    calls = []
    zopt.register_step_pre_hook(lambda *a: calls.append("pre"))
    zopt.register_step_post_hook(lambda *a: calls.append("post"))
    train(ref, model, cmodel, ropt, zopt)
    assert isinstance(zopt, cls) and isinstance(zopt, ShardedOptimizerMixin)
    assert calls == ["pre", "post"] * 3  # once per logical step, however many NVMe sub-groups
    assert_params_close(ref, model)


@pytest.mark.parametrize("name", ["Adagrad", "AdamW"])
def test_optimizer_built_over_partitioned_parameters(name):
    """An optimizer made after the parameters are partitioned (a model built under
    ``zinf_compile.init``): Adagrad's constructor asks ``torch.is_complex(p)`` and makes its state with
    ``torch.full_like(p)``; both read only metadata, so they work as on an ``nn.Parameter`` (the
    full-shaped state is cut to the shard at the first step) and the training is eager's."""
    cls = getattr(torch.optim, name)
    with zinf_compile.init(offload_params="cpu", offload_optimizer="cpu", compiler="eager") as zi:
        model = GPT(CFG)
    ref = GPT(CFG)
    ref.load_state_dict(zinf_compile.full_state_dict(model))
    w = model.blocks[0].fc.weight
    assert torch.is_complex(w) is False and torch.numel(w) == w.numel()
    z = torch.full_like(w, 0.5)
    assert type(z) is torch.Tensor and z.shape == w.shape and bool((z == 0.5).all())
    make = lambda m: cls(m.parameters(), lr=1e-2, **OPTIMIZERS[name])  # noqa: E731
    cmodel = torch.compile(model, backend="zinf", options=zi.options)
    train(ref, model, cmodel, make(ref), make(model))
    assert_params_close(ref, model)


def test_nanogpt_style_configure_optimizers_loop():
    # two param groups (decay on 2-D tensors only), the optimizer built by the model's own code, gradient
    # accumulation, clip_grad_norm_ and zero_grad(set_to_none=True): the loop of a single-file GPT script
    def configure_optimizers(m):
        params = [p for p in m.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-3)

    ref, model, cmodel, ropt, zopt = setup({"offload_optimizer": "cpu"}, configure_optimizers)
    sched = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4) for o in (ropt, zopt)]
    for _ in range(2):
        train(ref, model, cmodel, ropt, zopt, steps=1, clip=0.5, accum=2)
        for s in sched:
            s.step()
    assert sched[1].get_last_lr() == sched[0].get_last_lr()
    assert [g["weight_decay"] for g in zopt.param_groups] == [0.1, 0.0]
    assert_params_close(ref, model)


def test_fused_adamw_on_cpu_and_state_dict(tmp_path):
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3, fused=True)  # noqa: E731
    ref, model, cmodel, ropt, zopt = setup({}, make)
    train(ref, model, cmodel, ropt, zopt, steps=2)
    assert_params_close(ref, model)
    sd = zopt.state_dict()
    assert sd["param_groups"][0]["fused"] is True and len(sd["state"]) == len(list(model.parameters()))
    zopt.load_state_dict(copy.deepcopy(sd))
    train(ref, model, cmodel, ropt, zopt, steps=1)
    assert_params_close(ref, model)


def test_subclass_and_add_param_group():
    class ScaledSGD(torch.optim.SGD):  # a user subclass with its own step around torch's
        def step(self, closure=None):
            for g in self.param_groups:
                g["lr"] = g["base"] * 0.5
            return super().step(closure)

    def make(m):
        params = list(m.parameters())
        opt = ScaledSGD(params[:3], lr=0.1, momentum=0.9)
        opt.param_groups[0]["base"] = 0.2
        opt.add_param_group({"params": params[3:], "base": 0.4})
        return opt

    ref, model, cmodel, ropt, zopt = setup({}, make)
    train(ref, model, cmodel, ropt, zopt)
    assert type(zopt).__name__ == "ScaledSGD" and isinstance(zopt, ScaledSGD)
    assert_params_close(ref, model)


class LambLike(torch.optim.Optimizer):
    """A trust-ratio optimizer (LAMB/LARS style): the update of a tensor is scaled by ||w|| / ||update||."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                upd = p.grad / (p.grad.norm() + 1e-6)
                trust = p.norm() / (upd.norm() + 1e-6)
                p.add_(upd, alpha=-g["lr"] * float(trust))


class MuonLike(torch.optim.Optimizer):
    """A matrix-shaped update: orthogonalize the 2-D gradient (one Newton-Schulz step)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.dim() != 2:
                    raise ValueError("MuonLike only steps 2-D parameters")
                x = p.grad / (p.grad.norm() + 1e-7)
                x = 1.5 * x - 0.5 * x @ x.T @ x
                p.add_(x, alpha=-g["lr"])


class LambAdam(torch.optim.Adam):
    """An unknown subclass of a known elementwise optimizer that adds a per-tensor trust ratio."""

    @torch.no_grad()
    def step(self, closure=None):
        before = [p.detach().clone() for g in self.param_groups for p in g["params"]]
        super().step(closure)
        for p, b in zip((p for g in self.param_groups for p in g["params"]), before):
            p.copy_(b + (p - b) * (b.norm() / ((p - b).norm() + 1e-6)).clamp(max=10))


@pytest.mark.parametrize("cls,why", [(LambLike, "gave different updates"), (MuonLike, "failed on flat shards"),
                                     (LambAdam, "gave different updates")])
def test_non_elementwise_optimizers_are_refused_by_name(cls, why):
    model = GPT(CFG)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = cls([p for p in model.parameters() if p.dim() == 2], lr=1e-2)
    cmodel(*make_batch(CFG, 4, seed=0)).backward()
    before = zinf_compile.full_state_dict(model)
    with pytest.raises(RuntimeError, match=f"{cls.__name__} cannot step partitioned parameters.*{why}"):
        opt.step()
    after = zinf_compile.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before touching anything


def test_lbfgs_is_refused():
    model = GPT(CFG)
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = torch.optim.LBFGS(model.parameters())
    b = make_batch(CFG, 4, seed=0)

    def closure():
        opt.zero_grad()
        loss = cmodel(*b)
        loss.backward()
        return loss

    cmodel(*b).backward()
    with pytest.raises(RuntimeError, match="LBFGS cannot step partitioned parameters"):
        opt.step(closure)


def test_other_optimizers_are_left_alone():
    # an optimizer over plain tensors in the same process is never converted or re-scanned per step
    w = torch.nn.Parameter(torch.ones(3))
    model = GPT(CFG)
    torch.compile(model, backend="zinf", options={"compiler": "eager"})(*make_batch(CFG, 2, seed=0)).backward()
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones(3)
    opt.step()
    assert type(opt) is torch.optim.SGD
    torch.testing.assert_close(w.detach(), torch.full((3,), 0.9))


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_first_step_whose_closure_partitions_returns_the_loss(name):
    """Lightning's automatic optimization: the optimizer is built before the first forward, and that
    forward (the compile, which partitions) runs inside ``optimizer.step(closure)``. Each step must
    update the shards and return the closure's loss, as eager's does."""
    make = lambda m: getattr(torch.optim, name)(m.parameters(), lr=0.1, **OPTIMIZERS[name])  # noqa: E731
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ropt, zopt = make(ref), make(model)  # before anything is partitioned
    cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    calls = []
    for step in range(3):
        b = make_batch(CFG, 4, seed=step)

        def closure(run=cmodel, opt=zopt):
            calls.append(step)
            opt.zero_grad()
            loss = run(*b)
            loss.backward()
            return loss

        def ref_closure():
            ropt.zero_grad()
            loss = ref(*b)
            loss.backward()
            return loss

        got, want = zopt.step(closure), ropt.step(ref_closure)
        assert got is not None and torch.equal(got, want), step
    assert calls == [0, 1, 2]  # once a step, as torch's classes call it
    assert isinstance(zopt, ShardedOptimizerMixin)
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **TOL)


def test_first_closure_step_in_a_fresh_process():
    """torch reads its step hooks when a step begins: in a fresh process, before any model is
    partitioned, zinf's must already be there (``import zinf_compile`` registers them)."""
    import subprocess
    import sys

    code = (
        "import torch, zinf_compile\n"
        "from zinf_compile.models import GPT, GPTConfig, make_batch\n"
        "cfg = GPTConfig(vocab=64, seq=16, layers=1, hidden=32, heads=4)\n"
        "model = GPT(cfg); opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "cmodel = torch.compile(model, backend='zinf', options={'compiler': 'eager'})\n"
        "b = make_batch(cfg, 2, seed=0)\n"
        "def closure():\n"
        "    opt.zero_grad(); loss = cmodel(*b); loss.backward(); return loss\n"
        "print(float(opt.step(closure)), float(opt.step(closure)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = map(float, out.stdout.split())
    assert second < first  # the first step moved the shards


def test_closure_of_an_optimizer_over_plain_tensors_runs_once_and_returns_its_loss():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    losses = [opt.step(closure).item() for _ in range(2)]  # each step: w -= 0.1 * 2w
    assert losses == pytest.approx([3.0, 3 * 0.8 ** 2])
    assert len(calls) == 2 and type(opt) is torch.optim.SGD
    torch.testing.assert_close(w.detach(), torch.full((3,), 0.64))


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_every_optimizer_at_dp2(tier, tmp_path):
    # dp = 2 averages two half-batch gradients instead of one mean over 8 rows: a reassociated sum of
    # <= 8 terms, a few fp32 eps relative; with eps=1e-3 no optimizer amplifies it past TOL in 3 steps
    import json
    import os
    import socket
    import subprocess
    import sys

    out = tmp_path / "res.pt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = dict(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
    options = {"compiler": "eager", "offload_optimizer": tier, "nvme_path": str(tmp_path)}
    worker = os.path.join(os.path.dirname(__file__), "workers", "dp_optimizers.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), worker, str(out), json.dumps(options), json.dumps(cfg),
           json.dumps(OPTIMIZERS), "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(out)
    c = GPTConfig(**cfg)
    for name, kw in OPTIMIZERS.items():
        torch.manual_seed(0)
        ref = GPT(c)
        opt = getattr(torch.optim, name)(ref.parameters(), lr=1e-2, **kw)
        for step in range(3):
            ref(*make_batch(c, 8, seed=step)).backward()
            opt.step()
            opt.zero_grad()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[name][k], v, **TOL, msg=lambda m: f"{name} {k}: {m}")
