"""Sharded checkpoints (``zinf_compile.save`` / ``load`` / ``export``): resume, reshard, faults, leaks.

Training runs in worker processes (tests/workers/ckpt_worker.py) so they can be killed; dp = 2 runs under
torchrun on gloo. A checkpoint is read back in this process by loading it into an eager model and an
eager optimizer (``read_ckpt``), which gives full tensors whatever dp wrote it.

Why bitwise: resuming at the same dp replays the same ops in the same order on the same fp32 values
(masters, moments, ``step``), so anything but equality is a lost or altered state. Across dp the
reduction order would change, so dp = 1 replays dp = 2's arithmetic with two accumulated micro-batches
(``test_kill_and_resume_across_dp_is_bitwise`` says why that is exact), and the reshard is checked
where it must be exact too: the state loaded at dp' and saved again equals the state saved at dp.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
from workers.ckpt_worker import CFG, LR

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "ckpt_worker.py")


def run_worker(job: dict, nproc: int = 1, timeout: int = 400) -> subprocess.CompletedProcess:
    """Run one worker job (under torchrun when nproc > 1); a hang fails at ``timeout``."""
    if nproc == 1:
        cmd = [sys.executable, WORKER, json.dumps(job)]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(port), WORKER, json.dumps(job)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def read_ckpt(path) -> dict:
    """Everything in a checkpoint as full tensors: load it into an eager GPT and an eager AdamW."""
    torch.manual_seed(1)  # other values than any run's: every tensor must come from the file
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), **LR["adamw"])
    extra = zinf_compile.load(path, model, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}/{k}": v for p, st in opt.state.items() for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"params": dict(model.state_dict()), "optim": state, "groups": groups, "extra": extra}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def nvme_job(tmp_path, **kw) -> dict:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return dict(tier="nvme", nvme_path=str(swap), **kw)


@pytest.mark.slow  # the same machinery at one dp; test_kill_and_resume_across_dp_is_bitwise runs in CI
def test_kill_and_resume_nvme_is_bitwise(tmp_path):
    """6 steps straight == 3 steps, save, SIGKILL, fresh process loads before its first call, 3 steps."""
    ck = str(tmp_path / "ck")
    ok(run_worker(nvme_job(tmp_path, start=0, stop=6, out=str(tmp_path / "straight.pt"))))
    killed = run_worker(nvme_job(tmp_path, start=0, stop=3, save=ck, kill_after_save=True))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ok(run_worker(nvme_job(tmp_path, start=3, stop=6, load=ck, out=str(tmp_path / "resumed.pt"))))
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert resumed["losses"] == straight["losses"][3:]  # python floats of fp32 losses: bitwise
    assert_same(resumed["params"], straight["params"])
    assert read_ckpt(ck)["extra"] == {"step": 3}


@pytest.mark.parametrize("saver,loader", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])  # CI time
def test_kill_and_resume_across_dp_is_bitwise(tmp_path, saver, loader):
    """dp=2 -> dp=1 (and, in make test-slow, dp=1 -> dp=2), params and optimizer on NVMe: 3 steps, save,
    SIGKILL; a fresh process at the other dp loads, saves at once (the reshard must give the saved state
    element for element) and trains 3 more: losses of steps 4-6 and final parameters bitwise those of 6 steps straight at dp=2.

    Why bitwise across dp: dp=1 runs each step as the 2 micro-batches dp=2's ranks take, each backward of
    loss / 2, accumulated. The per-micro-batch gradients are the same ops on the same values; dp=2 sums
    the two in its reduce-scatter and halves, dp=1 adds the two halves: (g0 + g1) / 2 == g0/2 + g1/2
    exactly in binary floating point (halving is exact, away from underflow), and the optimizer is
    elementwise on the shards. So every step of the two runs is the same arithmetic."""
    first, again = str(tmp_path / "a"), str(tmp_path / "b")
    dp1 = dict(accum=2)
    ok(run_worker(nvme_job(tmp_path, start=0, stop=6, out=str(tmp_path / "straight.pt")), nproc=2))
    straight = torch.load(tmp_path / "straight.pt")
    kw_save, kw_load = (dp1 if saver == 1 else {}), (dp1 if loader == 1 else {})
    killed = run_worker(nvme_job(tmp_path, start=0, stop=3, save=first, kill_after_save=True, **kw_save),
                        nproc=saver)
    if saver == 1:
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    else:  # torchrun reports its killed workers and exits 1
        assert killed.returncode == 1 and "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    out = str(tmp_path / f"resumed-{saver}-{loader}.pt")
    ok(run_worker(nvme_job(tmp_path, start=3, stop=6, load=first, save_after_load=again, out=out, **kw_load),
                  nproc=loader))
    resumed = torch.load(out)
    saved, resaved = read_ckpt(first), read_ckpt(again)
    assert_same(resaved["params"], saved["params"])  # the reshard is exact ...
    assert_same(resaved["optim"], saved["optim"])
    assert resaved["groups"] == saved["groups"]
    assert {float(v) for k, v in saved["optim"].items() if k.endswith("/step")} == {3.0}
    assert resumed["losses"] == straight["losses"][3:], (saver, loader)  # ... and so is the training
    assert_same(resumed["params"], straight["params"])


@pytest.mark.slow  # CI time: make test-slow runs it
def test_failed_save_keeps_previous_checkpoint(tmp_path):
    """A save killed half-way, or hitting a full disk, leaves the previous checkpoint complete and loadable."""
    ck = str(tmp_path / "ck")
    ok(run_worker(dict(tier="cpu", start=0, stop=2, save=ck, out=str(tmp_path / "first.pt"))))
    before = read_ckpt(ck)
    for fault in ("kill", "enospc"):
        second = run_worker(dict(tier="cpu", start=0, stop=3, save=ck, out=str(tmp_path / "second.pt"),
                                 fault={"kind": fault, "after_bytes": 100_000}))
        if fault == "kill":
            assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
            assert os.path.isdir(ck + ".tmp")  # the torn write is there, and is never read
        else:
            ok(second)
            err = torch.load(tmp_path / "second.pt")["error"]
            assert err is not None and "ENOSPC" in err and ck in err and ".distcp" in err, err
            assert not os.path.exists(ck + ".tmp")
        assert zinf_compile.checkpoint_exists(ck)
        after = read_ckpt(ck)
        assert_same(after["params"], torch.load(tmp_path / "first.pt")["params"])
        assert_same(after["params"], before["params"])
        assert_same(after["optim"], before["optim"])
        assert after["extra"] == {"step": 2}
    model = GPT(GPTConfig(**CFG))
    os.makedirs(ck + ".tmp")  # as a killed save leaves it
    zinf_compile.save(ck, model)  # the next save replaces a stale .tmp and the old checkpoint
    assert not os.path.exists(ck + ".tmp") and not os.path.exists(ck + ".old")
    assert zinf_compile.load(ck, GPT(GPTConfig(**CFG))) is None  # saved without an optimizer, no extra


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(zinf_compile.CheckpointError, match="no complete checkpoint at .*nothing"):
        zinf_compile.load(tmp_path / "nothing", GPT(GPTConfig(**CFG)))


def _trained_zinf(steps: int = 2):
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = GPT(cfg)
    cmodel = torch.compile(model, backend="zinf", options={"offload_params": "cpu", "compiler": "eager"})
    opt = torch.optim.AdamW(model.parameters(), **LR["adamw"])
    for s in range(steps):
        x, y = make_batch(cfg, 4, seed=s)
        cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, cmodel, opt


def test_load_into_a_trained_model_restores_the_saved_state(tmp_path):
    """Loading into a model that trained on (its shards exist, the optimizer is the sharded twin) puts back
    the parameters, moments, steps and learning rate of the save."""
    model, cmodel, opt = _trained_zinf(2)
    zinf_compile.save(tmp_path / "ck", cmodel, opt)
    saved = read_ckpt(tmp_path / "ck")
    cfg = GPTConfig(**CFG)
    for s in range(2, 4):
        x, y = make_batch(cfg, 4, seed=s)
        cmodel(x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.5
    zinf_compile.load(tmp_path / "ck", cmodel, opt)
    assert opt.param_groups[0]["lr"] == LR["adamw"]["lr"]
    zinf_compile.save(tmp_path / "again", cmodel, opt)
    again = read_ckpt(tmp_path / "again")
    assert_same(again["params"], saved["params"])
    assert_same(again["optim"], saved["optim"])
    assert_same(zinf_compile.full_state_dict(model), saved["params"])


def test_load_into_a_module_holding_a_compiled_part_partitions_that_part(tmp_path):
    """An uncompiled module whose child is zinf-compiled (a LightningModule's ``self.net``), loaded
    before its first call: the child is partitioned by the load with its own options, as its first call
    would, instead of being filled with full tensors; the next steps equal the saved model's."""
    import zinf_runtime

    cfg = GPTConfig(**CFG)
    options = {"compiler": "eager", "offload_optimizer": "cpu"}

    def outer() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.net = torch.compile(GPT(cfg), backend="zinf", options=options)
        m.scale = torch.nn.Parameter(torch.tensor(1.5))  # outside the compiled part: loaded whole
        return m

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> torch.Tensor:
        x, y = make_batch(cfg, 4, seed=seed)
        loss = m.net(x, y) * m.scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    a = outer()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    step(a, opt_a, 0)
    zinf_compile.save(tmp_path / "ck", a, opt_a)
    b = outer()
    with torch.no_grad():
        b.scale.fill_(7.0)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    zinf_compile.load(tmp_path / "ck", b, opt_b)
    assert all(zinf_runtime.handle_of(p) is not None for p in b.net.parameters())  # by the load
    assert zinf_runtime.handle_of(b.scale) is None and torch.equal(b.scale, a.scale)
    for seed in (1, 2):  # the same ops on the same values: bitwise
        assert torch.equal(step(b, opt_b, seed), step(a, opt_a, seed))
    assert_same(zinf_compile.full_state_dict(b), zinf_compile.full_state_dict(a))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_equals_full_state_dict_and_loads_eagerly(tmp_path, fmt):
    model, cmodel, _ = _trained_zinf()
    path = tmp_path / f"model.{fmt}"
    zinf_compile.export(path, cmodel, format=fmt)
    if fmt == "safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        sd = torch.load(path)
    assert_same(sd, zinf_compile.full_state_dict(model))
    eager = GPT(GPTConfig(**CFG))
    eager.load_state_dict(sd, strict=True)
    assert_same(dict(eager.state_dict()), zinf_compile.full_state_dict(model))
    with pytest.raises(ValueError, match="format must be"):
        zinf_compile.export(path, cmodel, format="npz")


@pytest.mark.slow  # CI time: make test-slow runs it
def test_repeated_saves_do_not_leak(tmp_path):
    """10 saves of an NVMe-offloaded model (benchmarks/checkpoint_soak.py, shortened: 30 steps, a save every
    3): after 3 warm-up saves the open file descriptors are exactly constant, and RSS grows by less than a
    quarter of one checkpoint per save. A leak of the moments (2/3 of the state), of the masters (1/3) or of
    DCP's write buffers (the whole state) per save would exceed that bound; allocator noise averages out
    over the 7-point fit."""
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "..", "benchmarks", "checkpoint_soak.py"), "--steps",
                           "30", "--every", "3", "--warmup", "3", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    ok(proc)
    res = json.loads(out.read_text())
    assert res["saves"] == 10
    assert len(res["fds_after_warmup"]) == 1, res["fds"]
    assert res["rss_slope_bytes_per_save"] < res["checkpoint_bytes"] / 4, res
