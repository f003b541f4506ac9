#!/usr/bin/env python
"""The measuring parts of ``benchmarks/gpu.sh``: the device's bf16 peak and zinf's offloaded step.

    python benchmarks/gpu_step.py peak --out peak.json                  # big bf16 matmuls: TFLOP/s
    python benchmarks/gpu_step.py step --offload cpu --peak-json peak.json --out step_cpu.json
    python benchmarks/gpu_step.py step --offload nvme --nvme-path /tmp --out step_nvme.json
    python benchmarks/gpu_step.py merge --dir PARTS --out gpu.json      # gpu.sh's report
    ... --dry-run                                                       # on CPU, tiny: checks the script

``peak``: the best of ``torch.mm`` on square bf16 matrices (8192 and 16384 on a GPU), 2 n^3 FLOPs
per product, timed with CUDA events after a warm-up: the **measured** dense bf16 peak that the
step's TFLOP/s are set against (not the datasheet's).

``step``: a GPT-style model of ~1.07e9 parameters (hidden 2048, 20 blocks, vocabulary 32000,
context 1024, batch 8) built under ``zinf_compile.init`` (each block partitioned to the offload
tier as it is built, so the host never holds the whole model twice), compiled with
``backend="zinf"`` and ``mixed_precision="bf16"`` (bf16 compute, fp32 masters/gradients/Adam),
params and optimizer both on ``--offload`` (cpu: pinned host memory; nvme: files under
``--nvme-path``), ``torch.optim.AdamW`` (``--adamw fused``: its one-pass kernel). One warm-up step (compile), then
``--steps`` timed steps;
the figure is their median. Model TFLOP/s = (6 N + 12 L h s) tokens / step time (the usual
estimate: matmul FLOPs of forward + backward, attention scores included), against the peak.
Also: tokens/s, first-step time, the device's peak allocated memory and the runtime's accounting
of gathered parameters, and the swap engines' NVMe byte counters.

``--dry-run``: the same code on CPU at toy sizes (GPT hidden 64, 2 blocks, one timed step); its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _device(dry: bool) -> torch.device:
    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step: no CUDA device here; pass --dry-run to check the script on CPU")
    return torch.device("cuda", torch.cuda.current_device())


def peak(args: argparse.Namespace) -> Dict[str, Any]:
    dev = _device(args.dry_run)
    sizes = [256] if args.dry_run else [8192, 16384]
    rows = []
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.mm(a, b, out=c)
        _sync(dev)
        iters = 3 if args.dry_run else max(5, int(2e15 / (2 * n ** 3)))  # ~2 PFLOP per size: a few seconds
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                torch.mm(a, b, out=c)
            end.record()
            torch.cuda.synchronize(dev)
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                torch.mm(a, b, out=c)
            seconds = time.perf_counter() - t0
        rows.append({"n": n, "iters": iters, "seconds": seconds, "tflops": 2 * n ** 3 * iters / seconds / 1e12})
        del a, b, c
    best = max(rows, key=lambda r: r["tflops"])
    return {"device": _name(dev), "dtype": "bfloat16", "rows": rows, "peak_tflops": best["tflops"],
            "dry_run": args.dry_run}


def _name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def step(args: argparse.Namespace) -> Dict[str, Any]:
    import zinf_compile
    import zinf_runtime
    from zinf_compile.models import GPT, GPTConfig

    dev = _device(args.dry_run)
    if args.dry_run:
        cfg, batch = GPTConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4), 2
    else:
        cfg, batch = GPTConfig(vocab=32000, seq=1024, layers=20, hidden=2048, heads=16), 8
    tmp = tempfile.mkdtemp(prefix="zinf-gpu-step-", dir=args.nvme_path) if args.offload == "nvme" else None
    opts: Dict[str, Any] = {"mixed_precision": "bf16", "compiler": args.compiler}
    if tmp:
        opts["nvme_path"] = tmp
    if args.trace:
        opts["trace"] = os.path.abspath(args.trace)
    pk = None
    if args.peak_json and os.path.exists(args.peak_json):
        with open(args.peak_json) as f:
            pk = json.load(f)["peak_tflops"]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zinf_compile.init(offload_params=args.offload, offload_optimizer=args.offload, device=dev, **opts) as zi:
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    tokens = batch * cfg.seq
    flops = (6 * n + 12 * cfg.layers * cfg.hidden * cfg.seq) * tokens
    res: Dict[str, Any] = {
        "device": _name(dev), "offload": args.offload, "compiler": args.compiler, "mixed_precision": "bf16",
        "params": n, "layers": cfg.layers, "hidden": cfg.hidden, "vocab": cfg.vocab, "seq": cfg.seq,
        "batch": batch, "build_s": time.perf_counter() - t0, "flops_per_step": flops, "dry_run": args.dry_run,
        "adamw": args.adamw, "trace": opts.get("trace"),
        "losses": [], "step_s": [],
    }

    def record(times: List[float]) -> None:
        """Figures so far, written at once: a part killed at its timeout still leaves its steps."""
        res["first_step_s"] = times[0]
        res["step_s"] = times[1:]
        med = statistics.median(times[1:]) if len(times) > 1 else None
        res.update(median_step_s=med, tokens_per_s=tokens / med if med else None,
                   model_tflops=flops / med / 1e12 if med else None)
        if pk is not None and med:
            res["peak_tflops"], res["fraction_of_peak"] = pk, res["model_tflops"] / pk
        stats = zinf_compile.memory_stats(model)
        res["gathered_peak_bytes"] = stats["device"]["gathered"]["peak"]
        if dev.type == "cuda":
            res["max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
        io = {"bytes_read": 0, "bytes_written": 0}
        for ctx in zinf_runtime.contexts_of(model):
            for eng in ctx.engines():
                st = eng.stats()
                for k in io:
                    io[k] += st[k]
        res["nvme"] = io
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    cmodel = torch.compile(model, backend="zinf", options=zi.options)
    fused = {"fused": True} if args.adamw == "fused" else {}  # torch's one-pass kernel (CPU too)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    g = torch.Generator().manual_seed(0)
    times: List[float] = []
    try:
        for i in range(1 + (1 if args.dry_run else args.steps)):
            idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g).to(dev)
            x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
            _sync(dev)
            t = time.perf_counter()
            loss = cmodel(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            model.zero_grad()
            res["losses"].append(loss.item())  # synchronizes
            _sync(dev)
            times.append(time.perf_counter() - t)
            record(times)
            print(f"step {i}: {times[-1]:.2f} s, loss {res['losses'][-1]:.4f}", flush=True)
        return res
    finally:
        if tmp:
            import shutil

            for ctx in zinf_runtime.contexts_of(model):
                for eng in ctx.engines():
                    eng.wait_all()
            shutil.rmtree(tmp, ignore_errors=True)


_COPY_ROW = re.compile(r"^\s{2}(\S.*?)\s{2,}([0-9.]+)\s+([0-9.]+)\s*$")


def parse_copy_log(text: str) -> Dict[str, Any]:
    """``gpu_copy_check.py``'s printed bandwidth table as ``{method: {"ms", "GB/s"}}`` plus its verdict."""
    rows = {}
    for line in text.splitlines():
        m = _COPY_ROW.match(line)
        if m and not line.strip().startswith("method"):
            rows[m.group(1).strip()] = {"ms": float(m.group(2)), "GB/s": float(m.group(3))}
    out: Dict[str, Any] = {"bandwidth": rows}
    for line in text.splitlines():
        if "speedup vs" in line or "scatter_accumulate bf16" in line or line.startswith(("PASS", "FAIL")):
            out.setdefault("summary", []).append(line.strip())
        if "no CUDA device here" in line:
            out["skipped"] = line.strip()
    return out


def merge(args: argparse.Namespace) -> Dict[str, Any]:
    """One JSON from gpu.sh's parts: each part's exit status, seconds, timeout and result (or log tail)."""
    report: Dict[str, Any] = {"dry_run": args.dry_run, "parts": {}}
    with open(os.path.join(args.dir, "order")) as f:
        names = [line.split() for line in f if line.strip()]
    for name, rc, seconds, limit in names:
        part: Dict[str, Any] = {"rc": int(rc), "seconds": float(seconds), "timeout_s": int(limit),
                                "timed_out": int(rc) in (124, 137)}
        log = os.path.join(args.dir, f"{name}.log")
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        res = os.path.join(args.dir, f"{name}.json")
        if os.path.exists(res):
            with open(res) as f:
                part["result"] = json.load(f)
        elif name == "copy":
            part["result"] = parse_copy_log(text)
        part["status"] = "pass" if int(rc) == 0 else "fail"
        if int(rc) != 0 or "result" not in part:
            part["log_tail"] = text[-4000:]
        report["parts"][name] = part
    report["failed"] = [k for k, v in report["parts"].items() if v["status"] != "pass"]
    return report


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["peak", "step", "merge"])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--dry-run", action="store_true", help="on CPU at toy sizes: checks the script, measures nothing")
    ap.add_argument("--offload", choices=["cpu", "nvme"], default="cpu", help="step: tier of params and optimizer")
    ap.add_argument("--nvme-path", default=tempfile.gettempdir(), help="step: where the NVMe swap folder goes")
    ap.add_argument("--steps", type=int, default=3, help="step: timed steps after the warm-up (compile) step")
    ap.add_argument("--compiler", choices=["eager", "inductor"], default="eager",
                    help="step: zinf's code generator between its ops (default eager: no Inductor compile time "
                         "inside gpu.sh's 10 minutes; the matmuls are cuBLAS either way)")
    ap.add_argument("--adamw", choices=["default", "fused"], default="default",
                    help="step: torch.optim.AdamW's implementation on the host shards: torch's default (on CPU "
                         "tensors, one kernel per operation and tensor) or fused=True (one pass; HF Trainer's "
                         "default optimizer, adamw_torch_fused). 2026-12-04's H200 figures used the default")
    ap.add_argument("--trace", default=None, help="step: zinf option trace=PATH (a Chrome trace of the last step)")
    ap.add_argument("--peak-json", default=None, help="step: the peak part's JSON, to report the fraction of peak")
    ap.add_argument("--dir", default=None, help="merge: gpu.sh's parts folder")
    args = ap.parse_args(argv)
    res = {"peak": peak, "step": step, "merge": merge}[args.what](args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
