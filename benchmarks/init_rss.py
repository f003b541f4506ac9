"""Peak host memory (RSS) of building a >= 4 GiB GPT under ``zinf_compile.init(offload_params="nvme")``.

Without init the model exists whole in host memory before ``torch.compile`` partitions it, so peak
RSS >= its parameter bytes. Under init each submodule is partitioned to NVMe as soon as its
``__init__`` returns, and GPT's re-initialization of its children afterwards gathers one parameter at
a time: the peak should be a small fraction of the parameter bytes (goal <= 15%).

The build runs in a FRESH subprocess (nothing of this process leaks in). It reports the parameter
bytes, ``VmHWM`` (the kernel's peak RSS) after the imports and after the build, ``VmRSS`` at the end,
their ratios to the parameter bytes, the build time, and the swap folder's size on disk; then it
checks a few parameters against eager construction with the same seed (a slice of each, read back
from NVMe). The swap files are removed when the child exits (and the temporary folder after).

    .venv/bin/python benchmarks/init_rss.py                       # ~1.1G params, 4.2 GiB fp32
    .venv/bin/python benchmarks/init_rss.py --mmap-threshold 1048576  # option malloc_mmap_threshold=1 MiB
    .venv/bin/python benchmarks/init_rss.py --layers 2 --hidden 512   # a quick smoke run

Measured (2-core CPU VM, /tmp on virtio disk, GPT hidden 2048 x 22 layers, vocab 8192, init_std 0.02;
VmHWM after imports 0.32 GiB): peak 0.604 GiB = 14.4% of the 4.19 GiB of parameters with
``--mmap-threshold 1048576``; 1.196 GiB = 28.5% with glibc's dynamic threshold (the default: freed
4-64 MiB buffers stay in glibc's heap, see ``zinf_runtime.tiers.set_malloc_mmap_threshold``). Of the
rest, the swap engine's bounce buffers are 256 MiB (``swap_buffer_count * swap_buffer_size``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def child(args: argparse.Namespace) -> None:
    import torch

    import zinf_compile
    from zinf_compile.models import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    hwm_import = _status("VmHWM")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    init_std=0.02)
    extra = {"malloc_mmap_threshold": args.mmap_threshold} if args.mmap_threshold else {}
    if args.swap_buffer_size:
        extra["swap_buffer_size"] = args.swap_buffer_size
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with zinf_compile.init(offload_params="nvme", nvme_path=args.nvme_path, offload_optimizer="nvme",
                           progress=True, **extra) as zi:
        model = GPT(cfg)
    build_s = time.perf_counter() - t0
    for eng in zi.context.engines():
        eng.wait_all()
    hwm_build = _status("VmHWM")
    rss_end = _status("VmRSS")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    on_disk = _du(args.nvme_path)
    # spot check against eager construction (bitwise): the first block's qkv and the head/embedding
    import zinf_runtime

    h_qkv = zinf_runtime.handle_of(model.blocks[0].qkv.weight)
    h_tok = zinf_runtime.handle_of(model.tok.weight)
    got_qkv, got_tok = h_qkv.full_data().reshape(-1)[:4096].clone(), h_tok.full_data().reshape(-1)[:4096].clone()
    print(json.dumps({
        "params": sum(p.numel() for p in model.parameters()), "param_bytes": param_bytes,
        "param_GiB": param_bytes / 2**30, "hwm_after_import_bytes": hwm_import, "hwm_after_build_bytes": hwm_build,
        "rss_end_bytes": rss_end, "peak_rss_fraction": hwm_build / param_bytes,
        "peak_rss_above_import_fraction": (hwm_build - hwm_import) / param_bytes, "build_s": build_s,
        "swap_bytes_on_disk": on_disk, "partitioned": zi.partitioned,
    }), flush=True)
    del model
    if args.check:  # eager construction of the same model (whole, in memory): only for small runs
        torch.manual_seed(0)
        ref = GPT(cfg)
        ok = torch.equal(ref.blocks[0].qkv.weight.reshape(-1)[:4096], got_qkv) and torch.equal(
            ref.tok.weight.reshape(-1)[:4096], got_tok)
        print(json.dumps({"equals_eager": ok}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="option malloc_mmap_threshold (bytes; 0: leave glibc's dynamic threshold alone)")
    ap.add_argument("--swap-buffer-size", type=int, default=0,
                    help="option swap_buffer_size (bytes; the swap engine keeps swap_buffer_count of them; 0: default)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the swap folder goes (a fast local disk)")
    ap.add_argument("--check", action="store_true", help="also build eagerly and compare (needs the model in RAM)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nvme-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    swap = tempfile.mkdtemp(prefix="zinf_init_rss_", dir=args.dir)
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--nvme-path", swap] + [
            f"--{k}={getattr(args, k)}" for k in ("vocab", "seq", "layers", "hidden", "heads", "threads")] + [
            f"--mmap-threshold={args.mmap_threshold}", f"--swap-buffer-size={args.swap_buffer_size}"]
        if args.check:
            cmd.append("--check")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"init_rss: child failed with status {proc.returncode}\n{proc.stdout}")
        res = {}
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                res.update(json.loads(line))
        gib = 2**30
        print(f"parameters: {res['params']:,} ({res['param_GiB']:.2f} GiB fp32), built in {res['build_s']:.1f} s; "
              f"swap on disk {res['swap_bytes_on_disk'] / gib:.2f} GiB")
        print(f"peak RSS (VmHWM): after imports {res['hwm_after_import_bytes'] / gib:.3f} GiB, after the build "
              f"{res['hwm_after_build_bytes'] / gib:.3f} GiB = {100 * res['peak_rss_fraction']:.1f}% of the parameter "
              f"bytes ({100 * res['peak_rss_above_import_fraction']:.1f}% above the imports); goal <= 15%")
        print(f"RSS at the end: {res['rss_end_bytes'] / gib:.3f} GiB")
        if "equals_eager" in res:
            print(f"spot check vs eager construction: {'equal' if res['equals_eager'] else 'DIFFERENT'}")
        print(json.dumps(res))
    finally:
        shutil.rmtree(swap, ignore_errors=True)


if __name__ == "__main__":
    main()
