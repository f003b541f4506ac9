#!/usr/bin/env python
"""The one prepared GPU check of zinf: run it when a CUDA machine is lent (CI never runs CUDA).

    python benchmarks/gpu_check.py --out gpu_check.json           # on a GPU: < 5 minutes on one H200
    python benchmarks/gpu_check.py --dry-run --out /tmp/dry.json  # anywhere: the same checks on CPU,
                                                                  # tiny, gloo for NCCL, Triton interpreted

Every check runs in its own try/except, so one failure never hides the others; each verdict
(``pass`` / ``fail`` / ``skip``, the figures measured, the error and traceback) goes to the JSON
file given by ``--out``, which is rewritten after every check (a run killed half-way still leaves
its verdicts). Exit status: 0 when nothing failed.

Checks, in order (``--only name,name`` picks some):

* ``env``: torch, CUDA, Triton versions, device name, TF32 flags (turned off for the parity checks).
* ``triton_kernels``: ``gather_cast`` / ``scatter_accumulate`` between pinned host memory and the
  device, bitwise against the plain-torch references (``benchmarks/gpu_copy_check.py``'s
  correctness part). GPU only.
* ``fence_ordering``: the host is ordered after asynchronous copies (``zinf_runtime.hostsync``): a
  fused gradient accumulate of 64 Mi elements into a pinned shard, then at once a host read of the
  gradient, must give exactly g1 + g2 (without the fence the read races the kernel); a fused fetch
  of a pinned master, then at once a host write to the master, must leave the fetched copy equal to
  the old value; a pooled buffer is only reused once idle.
* ``parity_<params>_<optim>``: a GPT (2 layers, hidden 128) trained on the device under zinf
  (``compiler="eager"``) against eager PyTorch on the same device, SGD with momentum, 3 steps, for
  offload none/none, cpu/cpu and nvme/nvme: gradients after step 1 (rtol 1e-5: the same kernels in
  the same order, only the device/host placement of the shards differs) and parameters after step 3.
  With parameters on NVMe, every copy the read cache holds at the end must be pinned (on CUDA).
* ``accumulation_4``: cpu offload with the fused copies, gradient accumulation over 4 micro-batches
  (the 2nd-4th go through ``scatter_accumulate`` into pinned memory), against eager.
* ``bf16``: ``mixed_precision="bf16"`` against eager under ``torch.autocast(bfloat16)``: the same
  bf16 matmuls from the same fp32 masters, so the loss after the first step matches to 2 bf16
  roundings (2 * 2^-8 relative), parameters after 3 SGD steps to 2e-2.
* ``inductor``: one cpu-offload run through Inductor on the device, against eager (rtol 1e-4:
  Inductor fuses and reorders reductions).
* ``init_cpu``: a model built under ``zinf_compile.init`` on the device (partitioned as it is made)
  against eager from the same values (the path that failed on torch 2.11, 2026-12-04).
* ``overlap_opt_nvme``: ``overlap_optimizer_step=True`` on NVMe against eager (units stepped during
  backward give the numbers of stepping after it); fails if no unit was stepped early.
* ``dynamic_seq``: ``dynamic=True`` over 3 sequence lengths with parameters on NVMe: one graph, no
  fallback, eager's numbers at each length.
* ``nccl_1proc``: ``init_process_group("nccl")`` with one process (env ``MASTER_ADDR``, ``RANK``,
  ``WORLD_SIZE=1``), then in comm's strict mode: ``all_reduce_sum`` / ``broadcast`` /
  ``all_gather_to`` of CPU tensors (each must reach NCCL as a CUDA tensor and come back with the
  right value), a CPU tensor and a slot's memory passed to a hot-path collective (both refused with
  a clear error), and a training step with cpu offload on the NCCL group with
  ``optimizer.clip_grad_norm_`` (its all-reduce of a CPU scalar), against eager's norm.

``--dry-run`` runs all of it on CPU at small sizes (gloo instead of NCCL, recording events instead
of CUDA events, Triton's interpreter): it proves the script itself, not the GPU path.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Skip(Exception):
    """A check that cannot run here (says why)."""


# -------------------------------------------------------------------------------------------- helpers
def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max()) if a.numel() else 0.0


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool(torch.allclose(got.detach().cpu().double(), want.detach().cpu().double(), rtol=rtol, atol=atol))


def _gpt(device: torch.device, small: bool):
    from zinf_compile.models import GPT, GPTConfig

    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4) if small else \
        GPTConfig(vocab=256, seq=64, layers=2, hidden=128, heads=4)
    torch.manual_seed(0)
    return cfg, GPT(cfg).to(device)


def _batches(cfg: Any, n: int, device: torch.device, bsz: int = 4) -> List[tuple]:
    from zinf_compile.models import make_batch

    return [tuple(t.to(device) for t in make_batch(cfg, bsz, seed=i)) for i in range(n)]


def _full_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient as one full tensor (zinf's fp32 shards, world size 1)."""
    import zinf_runtime

    out = {}
    for name, p in model.named_parameters():
        h = zinf_runtime.handle_of(p)
        if h is None:
            continue
        if h.tiles is not None:
            parts = [u.grad[: u.numel].view(u.shape) for u in h.tiles]
            out[name] = torch.cat(parts, dim=h.tile_dim)
        elif h.grad is not None:
            out[name] = h.grad[: h.numel].view(h.shape)
    return out


def _train_pair(device: torch.device, small: bool, options: dict, *, steps: int = 3, accum: int = 1,
                autocast: Optional[torch.dtype] = None, lr: float = 0.05, clip: Optional[float] = None,
                models: Optional[tuple] = None, dynamic: Optional[bool] = None,
                lengths: Optional[List[int]] = None) -> dict:
    """Eager PyTorch and zinf on the same device, same model and data; SGD with momentum.
    ``models``: (cfg, ref, model) built by the caller (default: ``model`` a deep copy of ``ref``);
    ``lengths``: batch ``i`` keeps its first ``lengths[i]`` tokens (with ``dynamic=True``)."""
    import zinf_compile

    cfg, ref, model = models if models is not None else (*_gpt(device, small), None)
    model = model if model is not None else copy.deepcopy(ref)
    ropt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    cm = torch.compile(model, backend="zinf", options=options, dynamic=dynamic)
    ac = (lambda: torch.autocast(device.type, autocast)) if autocast is not None else contextlib.nullcontext
    rl, zl, grads, norms = [], [], None, []
    batches = _batches(cfg, steps * accum, device)
    if lengths is not None:
        batches = [(x[:, :n].contiguous(), y[:, :n].contiguous()) for (x, y), n in zip(batches, lengths)]
    for i, (x, y) in enumerate(batches):
        with ac():
            loss = ref(x, y)
        (loss / accum).backward()
        zloss = cm(x, y)
        (zloss / accum).backward()
        rl.append(loss.item())
        zl.append(zloss.item())
        if (i + 1) % accum == 0:
            if grads is None:
                grads = ({n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None},
                         {n: g.clone() for n, g in _full_grads(model).items()})
            if clip is not None:
                norms.append((float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)),
                              float(zopt.clip_grad_norm_(clip))))
            ropt.step(); ropt.zero_grad()
            zopt.step(); zopt.zero_grad()
    full = zinf_compile.full_state_dict(model)
    return {"ref_losses": rl, "zinf_losses": zl, "ref_state": {k: v.detach() for k, v in ref.state_dict().items()},
            "zinf_state": full, "grads": grads, "norms": norms, "model": model, "optimizer": zopt}


def _verdict_pair(res: dict, rtol: float, atol: float, grad_rtol: Optional[float]) -> dict:
    out: Dict[str, Any] = {"ref_losses": res["ref_losses"], "zinf_losses": res["zinf_losses"]}
    ok = _close(torch.tensor(res["zinf_losses"]), torch.tensor(res["ref_losses"]), rtol, atol)
    out["loss_max_rel"] = _max_rel(torch.tensor(res["zinf_losses"]), torch.tensor(res["ref_losses"]))
    worst, bad = 0.0, []
    for k, v in res["ref_state"].items():
        got = res["zinf_state"][k]
        worst = max(worst, _max_rel(got, v))
        if not _close(got, v, rtol, atol):
            bad.append(k)
    out["param_max_rel"], out["params_off"] = worst, bad
    ok = ok and not bad
    if grad_rtol is not None and res["grads"] is not None:
        want, got = res["grads"]
        gbad = [k for k in want if k in got and not _close(got[k], want[k], grad_rtol, 1e-7)]
        out["grads_compared"], out["grads_off"] = len([k for k in want if k in got]), gbad
        out["grad_max_rel"] = max((_max_rel(got[k], want[k]) for k in want if k in got), default=0.0)
        ok = ok and not gbad and out["grads_compared"] > 0
    out["status"] = "pass" if ok else "fail"
    return out


# --------------------------------------------------------------------------------------------- checks
def check_env(dev: torch.device, small: bool, tmp: str) -> dict:
    info: Dict[str, Any] = {"torch": torch.__version__, "device": str(dev), "cuda": torch.version.cuda}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = f"missing: {e!r}"
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name(dev)
        info["tf32_matmul_was"] = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # parity checks compare fp32 to fp32
        torch.backends.cudnn.allow_tf32 = False
    info["status"] = "pass"
    return info


def check_triton_kernels(dev: torch.device, small: bool, tmp: str) -> dict:
    if dev.type != "cuda":
        raise Skip("the bitwise kernel tests on CPU are tests/test_triton_copy.py (interpreter)")
    sys.path.insert(0, HERE)
    import gpu_copy_check
    from zinf_runtime import triton_copy

    if triton_copy.triton is None:
        return {"status": "fail", "error": f"Triton not importable: {triton_copy._TRITON_IMPORT_ERROR!r}"}
    failures = gpu_copy_check.check_correctness(triton_copy, dev)
    return {"status": "pass" if failures == 0 else "fail", "failing_variants": failures}


def check_fence_ordering(dev: torch.device, small: bool, tmp: str) -> dict:
    import zinf_runtime
    from zinf_runtime import hostsync, store

    n = (1 << 12) if small else (64 << 20)
    log: List[Any] = []
    rec = hostsync.recording_events(log) if dev.type != "cuda" else contextlib.nullcontext()
    out: Dict[str, Any] = {"elements": n}
    with rec, _env(ZINF_FUSED_COPY="1" if dev.type != "cuda" else "auto",
                   TRITON_INTERPRET="1" if dev.type != "cuda" else None):
        ctx = zinf_runtime.RuntimeContext(name="gpu_check fences")
        placement = zinf_runtime.Placement(tier="cpu", compute_device=dev, context=ctx)
        g = torch.Generator().manual_seed(0)
        w0 = torch.randn(n, generator=g)
        p = torch.nn.Parameter(w0.clone().to(dev))
        zinf_runtime.partition([("fence.w", p)], placement)
        h = zinf_runtime.handle_of(p)
        out["master_pinned"] = h.master.resident().is_pinned()
        g1, g2 = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
        h.reduce_grad(g1)  # first: a blocking copy into the new pinned shard
        before = dict(store.fused_copies)
        h.reduce_grad(g2)  # fused accumulate into pinned memory: still running on return
        out["fused_accumulate"] = store.fused_copies["scatter_accumulate"] > before["scatter_accumulate"]
        out["grad_fence_pending_after_accumulate"] = h.grad_slot.fence.pending
        got = h.grad  # a host read: must wait for the kernel
        want = g1.cpu() + g2.cpu()
        out["grad_exact"] = bool(torch.equal(got[:n], want))
        fetched = h.fetch_shard(torch.bfloat16)  # fused read of the pinned master, still running
        out["master_fence_pending_after_fetch"] = h.master.fence.pending
        h.master.resident().add_(1000.0)  # the optimizer's in-place write: must wait for the read
        out["fetch_saw_old_value"] = bool(torch.equal(fetched.cpu(), w0.to(torch.bfloat16)))
        pool_buf = ctx.pool.acquire(n, torch.float32, pin=dev.type == "cuda")
        fence = hostsync.Fence()
        dst = torch.empty(n, device=dev)
        dst.copy_(pool_buf, non_blocking=True)
        fence.record(dev, pool_buf)
        ctx.pool.release(pool_buf, fence)
        out["pool_fence_waited"] = not fence.pending
        store.ParamHandle.release(fetched)
        del p, h
    if dev.type != "cuda":
        out["recorded"] = sum(1 for k, _ in log if k == "record")
        out["waited"] = sum(1 for k, _ in log if k == "wait")
    must = ["grad_exact", "fetch_saw_old_value", "pool_fence_waited", "fused_accumulate",
            "grad_fence_pending_after_accumulate", "master_fence_pending_after_fetch"]
    out["status"] = "pass" if all(out[k] for k in must) else "fail"
    return out


def _parity(params: str, optim: str) -> Callable[[torch.device, bool, str], dict]:
    def check(dev: torch.device, small: bool, tmp: str) -> dict:
        opts = {"compiler": "eager", "offload_params": params, "offload_optimizer": optim,
                "nvme_path": tmp, "optimizer_sub_group_bytes": 1 << 16}
        res = _train_pair(dev, small, opts)
        v = _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)
        left = [d for d in os.listdir(tmp) if d.startswith("zinf-")]
        if params == "nvme":
            # every cached parameter copy is pinned where fetches upload to CUDA (a pageable one makes
            # the next fetch's upload block); the optimizer's written masters are among them
            from zinf_runtime.context import contexts_of

            held = [b for ctx in contexts_of(res["model"]) for b in ctx.read_cache.buffers()]
            v["read_cache_entries"] = len(held)
            v["read_cache_pageable"] = sum(not b.is_pinned() for b in held)
            if dev.type == "cuda" and (not held or v["read_cache_pageable"]):
                v["status"] = "fail"
        del res
        return v | {"swap_dirs_while_alive": len(left)}
    return check


def check_accumulation_4(dev: torch.device, small: bool, tmp: str) -> dict:
    from zinf_runtime import store

    before = dict(store.fused_copies)
    with _env(ZINF_FUSED_COPY="1" if dev.type != "cuda" else "auto",
              TRITON_INTERPRET="1" if dev.type != "cuda" else None):
        res = _train_pair(dev, small, {"compiler": "eager", "offload_params": "cpu", "offload_optimizer": "cpu"},
                          steps=2, accum=4)
    v = _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)
    v["fused_gather_cast"] = store.fused_copies["gather_cast"] - before["gather_cast"]
    v["fused_scatter_accumulate"] = store.fused_copies["scatter_accumulate"] - before["scatter_accumulate"]
    if v["fused_scatter_accumulate"] == 0:
        v["status"] = "fail"
        v["error"] = "the fused accumulate into pinned memory never ran (Triton missing?)"
    return v


def check_bf16(dev: torch.device, small: bool, tmp: str) -> dict:
    res = _train_pair(dev, small, {"compiler": "eager", "offload_params": "cpu", "offload_optimizer": "cpu",
                                   "mixed_precision": "bf16"}, autocast=torch.bfloat16)
    v = _verdict_pair(res, rtol=2e-2, atol=2e-2, grad_rtol=None)
    first = abs(res["zinf_losses"][0] - res["ref_losses"][0]) / abs(res["ref_losses"][0])
    v["first_loss_rel"] = first
    if first > 2 * 2.0 ** -8:
        v["status"] = "fail"
    return v


def check_inductor(dev: torch.device, small: bool, tmp: str) -> dict:
    res = _train_pair(dev, small, {"compiler": "inductor", "offload_params": "cpu", "offload_optimizer": "cpu"})
    return _verdict_pair(res, rtol=1e-4, atol=1e-5, grad_rtol=1e-4)


def check_init_cpu(dev: torch.device, small: bool, tmp: str) -> dict:
    """A model built under ``zinf_compile.init`` (each parameter partitioned as it is made, never whole
    on the device) against eager started from its values. The path of ``benchmarks/gpu_step.py``,
    which failed on the first lent GPU (torch 2.11) while every other check passed."""
    import zinf_compile
    from zinf_compile.models import GPT

    cfg, ref = _gpt(dev, small)
    torch.manual_seed(1)
    opts = {"compiler": "eager", "offload_params": "cpu", "offload_optimizer": "cpu"}
    with zinf_compile.init(device=dev, **opts) as zi:
        model = GPT(cfg)
    ref.load_state_dict(zinf_compile.full_state_dict(model))  # the values init made, whatever its RNG
    res = _train_pair(dev, small, zi.options, models=(cfg, ref, model))
    return _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)


def check_overlap_opt_nvme(dev: torch.device, small: bool, tmp: str) -> dict:
    """``overlap_optimizer_step=True`` with params and optimizer on NVMe: units stepped in a
    background thread during backward must give the numbers of stepping after backward (eager's)."""
    from zinf_runtime import optim_overlap

    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": tmp,
            "optimizer_sub_group_bytes": 1 << 20, "overlap_optimizer_step": True}
    res = _train_pair(dev, small, opts)
    v = _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)
    ov = optim_overlap.of(res["optimizer"])
    v["overlap_stats"] = dict(ov.stats) if ov is not None else {}
    if not v["overlap_stats"].get("committed"):
        v["status"], v["error"] = "fail", "no unit was stepped during backward (nothing to compare)"
    return v


def check_dynamic_seq(dev: torch.device, small: bool, tmp: str) -> dict:
    """``dynamic=True`` over 3 sequence lengths, parameters on NVMe: one graph for every length, and
    eager's numbers at each."""
    import zinf_compile

    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "cpu", "nvme_path": tmp}
    cfg, _ = _gpt(dev, small)
    lengths = [cfg.seq // 2, cfg.seq * 3 // 4, cfg.seq]
    n0 = len(zinf_compile.compile_records())
    res = _train_pair(dev, small, opts, dynamic=True, lengths=lengths)
    v = _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)
    recs = zinf_compile.compile_records()[n0:]
    v["lengths"], v["graphs_compiled"] = lengths, len(recs)
    v["fallbacks"] = sum(bool(r.counters.get("gather_all_fallback")) for r in recs)
    if len(recs) > 2 or v["fallbacks"]:  # Dynamo may restart the first compile once (a float specialized)
        v["status"] = "fail"
    return v


def check_nccl_1proc(dev: torch.device, small: bool, tmp: str) -> dict:
    import torch.distributed as dist

    import zinf_runtime
    from zinf_runtime import comm

    backend = "nccl" if dev.type == "cuda" else "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: Dict[str, Any] = {"backend": backend}
    with _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"):
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, **kw)
        seen: List[str] = []
        real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast")}

        def spy(name: str) -> Callable:
            def f(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                seen.append(f"{name}:{t.device.type}")
                return real[name](t, *a, **k)
            return f

        try:
            with comm.strict():
                for name in real:
                    setattr(dist, name, spy(name))
                try:
                    t = torch.tensor([3.0, 4.0], dtype=torch.float64)
                    comm.all_reduce_sum(t, None)
                    out["all_reduce_cpu_value"] = t.tolist()
                    b = torch.arange(5.0)
                    comm.broadcast(b, None)
                    out["broadcast_cpu_value"] = b.tolist()
                finally:
                    for name, fn in real.items():
                        setattr(dist, name, fn)
                out["collective_devices"] = seen
                gathered = comm.all_gather_to(torch.arange(6.0), None)
                out["all_gather_to"] = [gathered.device.type, gathered.tolist()]
                errors = {}
                if dev.type == "cuda":  # a CPU tensor to a hot-path NCCL collective
                    try:
                        comm.all_gather_flat(torch.empty(4), torch.ones(4), None)
                        errors["cpu_to_nccl"] = "not refused"
                    except comm.CollectiveDeviceError:
                        errors["cpu_to_nccl"] = "refused"
                placement = zinf_runtime.Placement(tier="cpu", compute_device=dev,
                                                   context=zinf_runtime.RuntimeContext(name="gpu_check strict"))
                p = torch.nn.Parameter(torch.ones(8, device=dev))
                zinf_runtime.partition([("strict.p", p)], placement)
                slot_t = zinf_runtime.handle_of(p).master.resident()
                try:
                    comm.all_gather_flat(torch.empty(8, device=slot_t.device), slot_t, None)
                    errors["slot_memory"] = "not refused"
                except comm.StrictCommError:
                    errors["slot_memory"] = "refused"
                out["refusals"] = errors
            res = _train_pair(dev, small, {"compiler": "eager", "offload_params": "cpu", "offload_optimizer": "cpu"},
                              steps=2, clip=0.05)
            v = _verdict_pair(res, rtol=1e-5, atol=1e-6, grad_rtol=1e-5)
            out["clip_norms_eager_zinf"] = res["norms"]
            norms_ok = all(abs(a - b) <= 1e-5 * abs(a) + 1e-7 for a, b in res["norms"])
        finally:
            dist.destroy_process_group()
    want_dev = "cuda" if dev.type == "cuda" else "cpu"
    ok = (out["all_reduce_cpu_value"] == [3.0, 4.0] and out["broadcast_cpu_value"] == [0, 1, 2, 3, 4]
          and all(s.endswith(want_dev) for s in seen) and len(seen) == 2
          and out["all_gather_to"] == ["cpu", [0, 1, 2, 3, 4, 5]]
          and all(r == "refused" for r in out["refusals"].values())
          and v["status"] == "pass" and norms_ok)
    return out | {"training": v, "status": "pass" if ok else "fail"}


CHECKS: Dict[str, Callable[[torch.device, bool, str], dict]] = {
    "env": check_env,
    "triton_kernels": check_triton_kernels,
    "fence_ordering": check_fence_ordering,
    "parity_none_none": _parity("none", "none"),
    "parity_cpu_cpu": _parity("cpu", "cpu"),
    "parity_nvme_nvme": _parity("nvme", "nvme"),
    "accumulation_4": check_accumulation_4,
    "bf16": check_bf16,
    "inductor": check_inductor,
    "init_cpu": check_init_cpu,
    "overlap_opt_nvme": check_overlap_opt_nvme,
    "dynamic_seq": check_dynamic_seq,
    "nccl_1proc": check_nccl_1proc,
}


@contextlib.contextmanager
def _env(**values: Optional[str]):
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(names: List[str], dev: torch.device, small: bool, out_path: str) -> dict:
    import gc

    report: Dict[str, Any] = {"device": str(dev), "dry_run": small, "checks": {}}
    nvme_root = tempfile.mkdtemp(prefix="zinf-gpu-check-")
    for name in names:
        t0 = time.perf_counter()
        torch._dynamo.reset()
        tmp = tempfile.mkdtemp(dir=nvme_root)
        try:
            verdict = CHECKS[name](dev, small, tmp)
        except Skip as e:
            verdict = {"status": "skip", "why": str(e)}
        except Exception as e:  # noqa: BLE001 - one failure must not hide the others
            verdict = {"status": "fail", "error": repr(e), "traceback": traceback.format_exc()[-4000:]}
        gc.collect()
        verdict["seconds"] = round(time.perf_counter() - t0, 2)
        verdict["swap_dirs_left_after_check"] = sorted(d for d in os.listdir(tmp) if d.startswith("zinf-"))
        report["checks"][name] = verdict
        print(f"{name:>18}: {verdict['status']:4} ({verdict['seconds']} s)", flush=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    report["failed"] = [n for n, v in report["checks"].items() if v["status"] == "fail"]
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="zinf's prepared GPU check (see the module docstring)")
    parser.add_argument("--out", default="gpu_check.json", help="JSON file for the verdicts")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every check on CPU at small sizes (gloo, interpreted Triton): tests the script")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    if args.dry_run:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu_check: no CUDA device; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("ZINF_STRICT_COMM", "1")
    if dev.type == "cuda":  # eager and zinf must run the same deterministic kernels to compare tightly
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    report = run(names, dev, args.dry_run, args.out)
    print(f"verdicts in {args.out}; failed: {report['failed'] or 'none'}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
