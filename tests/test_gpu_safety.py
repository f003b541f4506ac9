"""The GPU path is safe by construction, checked on CPU.

* Every host access to a slot's memory is ordered after asynchronous device work on it
  (``zinf_runtime.hostsync``): recording events stand in for CUDA events, so the ordering logic runs
  here even though every CPU copy is synchronous.
* Every collective gets tensors on its process group's device and never a slot's memory
  (``comm``'s strict mode, on for this module and, through the environment, its subprocesses).
* ``benchmarks/gpu_check.py`` imports, answers ``--help`` and runs its checks on CPU (``--dry-run``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_runtime import comm, hostsync, store, tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(ROOT, "benchmarks", "gpu_check.py")
CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


@pytest.fixture(autouse=True)
def _strict_comm(monkeypatch):
    monkeypatch.setenv("ZINF_STRICT_COMM", "1")


@pytest.fixture
def gloo_world1(tmp_path):
    """A real one-process gloo group in this process, torn down afterwards."""
    assert not dist.is_initialized()
    store_ = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store_, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _slot(n: int = 16) -> tiers.Slot:
    s = tiers.Slot("cpu", "param", n, torch.float32, torch.device("cpu"), key="t.slot")
    s.set(torch.arange(float(n)))
    return s


# -- comm strict mode ------------------------------------------------------------------------------
def test_strict_mode_refuses_a_slots_memory_even_at_dp1():
    s = _slot()
    for t in (s.resident(), s.resident()[2:9], s.resident().view(4, 4)):
        with pytest.raises(comm.StrictCommError, match="t.slot"):
            comm.all_reduce_sum(t, None)
    with pytest.raises(comm.StrictCommError):
        comm.all_gather_flat(torch.empty(16), s.resident(), None)
    comm.all_reduce_sum(s.resident().clone(), None)  # a compute-path copy is fine
    with comm.strict(False):
        comm.all_reduce_sum(s.resident(), None)  # strict mode off: not checked (dp = 1: no-op)


def test_slot_tags_follow_the_memory():
    s = _slot()
    t = s.resident()
    assert comm.slot_of(t) == "t.slot"
    s.drop()
    assert comm.slot_of(t) == "t.slot"  # still the slot's storage while someone holds it
    del t
    import gc

    gc.collect()
    fresh = torch.empty(16)
    assert comm.slot_of(fresh) is None


def test_strict_mode_checks_the_groups_device(gloo_world1):
    with pytest.raises(comm.CollectiveDeviceError, match="gloo.*cpu"):
        comm.all_gather_flat(torch.empty(4, device="meta"), torch.empty(4, device="meta"), None)
    t = torch.tensor([1.0, 2.0])
    comm.all_reduce_sum(t, None)  # gloo, CPU: runs (world 1: the sum is t)
    assert t.tolist() == [1.0, 2.0]
    s = _slot()
    got = comm.all_gather_to(s.resident(), None)  # a slot's master may be gathered: through a copy
    assert torch.equal(got, torch.arange(16.0)) and comm.slot_of(got) is None
    with pytest.raises(comm.StrictCommError):
        comm.broadcast(s.resident(), None)


def test_group_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for backend, like, want in (("nccl", cpu, cuda), ("nccl", cuda, cuda), ("gloo", cpu, cpu), ("gloo", cuda, cpu),
                                ("cpu:gloo,cuda:nccl", cpu, cpu), ("cpu:gloo,cuda:nccl", cuda, cuda)):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert comm.group_device(None, like) == want, (backend, like)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(comm.CollectiveDeviceError, match="nccl.*cuda"):  # NCCL refuses CPU tensors
        comm.reduce_scatter_flat(torch.empty(2), torch.empty(4), None)


def test_movers_hand_collectives_a_private_contiguous_copy(gloo_world1, monkeypatch):
    """all_reduce_sum / broadcast of a tensor that is not collective-ready (here non-contiguous)
    run on a staged copy and write the result back."""
    seen = []
    real = dist.all_reduce

    def spy(t, *a, **k):
        seen.append((t.is_contiguous(), t.device.type))
        t.mul_(2)  # stands in for other ranks' contributions
        return real(t, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", spy)
    base = torch.arange(12.0).view(3, 4)
    view = base.t()
    comm.all_reduce_sum(view, None)
    assert seen == [(True, "cpu")]
    assert torch.equal(base, torch.arange(12.0).view(3, 4) * 2)


def test_movers_stage_a_tensor_off_the_groups_device(monkeypatch):
    """In strict mode, a CPU tensor given to all_reduce_sum / broadcast of a group whose backend
    takes another device (NCCL: CUDA) is staged there, not refused. A backend taking "meta" tensors
    stands in for NCCL on this CUDA-less machine."""
    monkeypatch.setattr(comm, "_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "meta:fake")
    monkeypatch.setattr(comm, "group_src_rank", lambda group: 0)
    seen, back = [], []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(("all_reduce", t.device.type)))
    monkeypatch.setattr(dist, "broadcast", lambda t, *a, **k: seen.append(("broadcast", t.device.type)))
    monkeypatch.setattr(comm, "_unstage", lambda t, staged: back.append((t.device.type, staged.device.type)))
    comm.all_reduce_sum(torch.ones(3, dtype=torch.float64), None)
    comm.broadcast(torch.ones(3), None)
    assert seen == [("all_reduce", "meta"), ("broadcast", "meta")]
    assert back == [("cpu", "meta"), ("cpu", "meta")]
    with pytest.raises(comm.CollectiveDeviceError, match="meta"):  # the hot path never stages
        comm.all_gather_flat(torch.empty(6), torch.ones(3), None)


@pytest.mark.slow
def test_dp2_tiled_cpu_offload_runs_under_strict_mode(tmp_path):
    """dp = 2 on gloo, strict mode on in both workers (inherited env): the partition-time
    broadcast, the all-gather of CPU masters when weights are tiled (it used to hand the master
    slot's own memory to the collective), the graph's all-gathers and reduce-scatters all pass the
    checks, and the losses match eager. (Parameters are not compared: the worker steps AdamW, which
    turns the all-gather's reduction-order rounding in near-zero gradients into +-lr updates;
    parameter parity at dp = 2 is tests/test_dp.py's.)"""
    from test_dp import eager_reference, run_dp

    res = run_dp(tmp_path, {"compiler": "eager", "offload_params": "cpu", "offload_optimizer": "cpu",
                            "tiles": 3, "tile_threshold_bytes": 10_000})
    losses = eager_reference()[0]
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert res["counts"]["forward:zinf.wait_gather.default"] > 0


# -- host access ordered after device work ---------------------------------------------------------
def test_slot_host_accessors_wait_for_recorded_device_work():
    log: list = []
    with hostsync.recording_events(log):
        s = _slot()
        s.fence.record(torch.device("cpu"), s.resident_for_device())
        assert s.fence.pending and log == [("record", 0)]
        s.resident_for_device()  # enqueueing more device work does not wait
        assert s.fence.pending
        s.resident()  # the host does
        assert not s.fence.pending and log == [("record", 0), ("wait", 0)]
        s.fence.record(torch.device("cpu"))
        s.set(torch.zeros(16))  # host write
        assert log[-1] == ("wait", 1)
        s.fence.record(torch.device("cpu"))
        assert s.get() is not None and log[-1] == ("wait", 2)
        s.fence.record(torch.device("cpu"))
        s.drop()  # freeing pinned memory under a running kernel would hand it out again
        assert log[-1] == ("wait", 3)
        pool = tiers.BufferPool()
        buf = pool.acquire(16, torch.float32)
        f = hostsync.Fence()
        f.record(torch.device("cpu"), buf)
        pool.release(buf, f)
        assert log[-1] == ("wait", 4) and pool.idle_bytes == 64


def test_fence_is_a_noop_for_cpu_work_without_recording():
    f = hostsync.Fence()
    f.record(torch.device("cpu"), torch.empty(4))
    assert not f.pending
    f.wait()


def test_optimizer_and_zero_grad_never_touch_shards_with_pending_device_work(monkeypatch, tmp_path):
    """CPU-offloaded training with the fused copies (Triton interpreter) and recording events: the
    fetches record on the masters and the accumulates on the gradient shards, and by the time
    torch's SGD step (the CPU optimizer) runs, every one of them was waited for. Parity with eager."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZINF_FUSED_COPY", "1")
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_params": "cpu",
                                                       "offload_optimizer": "cpu"})
    slots = []
    checked = []
    real_step = torch.optim.SGD.step

    def guarded_step(self, *a, **k):
        if self is zopt:
            if not slots:
                for p in model.parameters():
                    for u in zinf_runtime.handle_of(p).units():
                        slots.extend(s for s in (u.master, u.grad_slot) if s is not None)
            pending = [s.key for s in slots if s.fence.pending]
            assert not pending, f"the CPU optimizer would read/write shards with device work in flight: {pending}"
            checked.append(True)
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", guarded_step)
    log: list = []
    before = dict(store.fused_copies)
    with hostsync.recording_events(log):
        for step in range(2):
            for micro in range(2):
                x, y = make_batch(CFG, 2, seed=2 * step + micro)
                (ref(x, y) / 2).backward()
                (cm(x, y) / 2).backward()
            ropt.step(); ropt.zero_grad()
            zopt.step(); zopt.zero_grad(set_to_none=False)
    assert checked == [True, True]
    assert store.fused_copies["scatter_accumulate"] > before["scatter_accumulate"]
    records = {i for kind, i in log if kind == "record"}
    waits = {i for kind, i in log if kind == "wait"}
    assert records and records == waits, "every recorded device use was waited for"
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


# -- the prepared GPU script -----------------------------------------------------------------------
def test_gpu_check_imports_and_answers_help():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert {"parity_cpu_cpu", "parity_nvme_nvme", "accumulation_4", "bf16", "nccl_1proc", "triton_kernels",
            "fence_ordering", "init_cpu", "overlap_opt_nvme", "dynamic_seq"} <= set(mod.CHECKS)
    proc = subprocess.run([sys.executable, GPU_CHECK, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "--out" in proc.stdout


@pytest.mark.slow  # CI time: make test-slow runs it
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "verdicts.json"
    proc = subprocess.run([sys.executable, GPU_CHECK, "--dry-run", "--out", str(out),
                           "--only", "env,triton_kernels,fence_ordering,parity_cpu_cpu,nccl_1proc,init_cpu,"
                           "overlap_opt_nvme,dynamic_seq"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    status = {k: v["status"] for k, v in report["checks"].items()}
    assert status == {"env": "pass", "triton_kernels": "skip", "fence_ordering": "pass", "parity_cpu_cpu": "pass",
                      "nccl_1proc": "pass", "init_cpu": "pass", "overlap_opt_nvme": "pass",
                      "dynamic_seq": "pass"}, report
    assert report["checks"]["fence_ordering"]["recorded"] == report["checks"]["fence_ordering"]["waited"] > 0
