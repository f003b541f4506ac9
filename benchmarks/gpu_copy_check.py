#!/usr/bin/env python
"""GPU check of zinf_runtime.triton_copy: correctness on CUDA, then bandwidth.

Run by hand when a CUDA machine is available (CI never runs it):

    python benchmarks/gpu_copy_check.py            # ~1 GiB, 64 shards, well under 2 minutes
    python benchmarks/gpu_copy_check.py --total-gib 0.25 --iters 3   # quicker

1. Correctness: gather_cast from pinned host fp32 (zero-copy over PCIe) and
   from device tensors into bf16/fp16/fp32, and scatter_accumulate from a
   device bf16/fp16/fp32 buffer into pinned host and device fp32 shards, each
   compared bitwise (NaN payloads aside) with the plain-torch references.
2. Bandwidth, pinned host fp32 -> device bf16 for N shards totalling the given
   size, in GB/s of host fp32 bytes moved:
     * gather_cast (one launch, host read in place), for a few block sizes;
     * torch.cat([s.to('cuda', non_blocking=True) for s in srcs]).to(bf16);
     * copy_ per shard into a flat fp32 device buffer, then .to(bf16);
     * one 1-shot copy_ of the same bytes (the PCIe ceiling, no cast).
   and scatter_accumulate device bf16 -> pinned host fp32 against a D2H copy
   plus a CPU add_.

Exit status: 0 if everything matches (or there is no CUDA: nothing to check),
1 on any mismatch or if Triton is missing on a CUDA machine.
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def _load_triton_copy():
    """Import the installed runtime, or the file next to this script if it is not installed."""
    try:
        from zinf_runtime import triton_copy

        return triton_copy
    except ImportError:
        path = Path(__file__).resolve().parents[1] / "runtime" / "triton_copy.py"
        spec = importlib.util.spec_from_file_location("zinf_runtime_triton_copy", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _mismatches(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Count of differing elements: bits must match, NaN must stay NaN (payload free)."""
    got, ref = got.detach().cpu().reshape(-1), ref.detach().cpu().reshape(-1)
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    bad = int((nan_got != nan_ref).sum())
    keep = ~nan_ref
    iv = _INT_VIEW[got.dtype]
    return bad + int((got.view(iv)[keep] != ref.view(iv)[keep]).sum())


def _values(n: int, seed: int) -> torch.Tensor:
    """fp32 of many magnitudes with inf/NaN/subnormals and exact bf16/fp16 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=g).float())
    hi = torch.randint(0, 1 << 16, (256,), generator=g)
    bf16_ties = ((hi << 16) | 0x8000).to(torch.int32).view(torch.float32)
    exp = torch.randint(103, 143, (256,), generator=g)
    fp16_ties = ((exp << 23) | (torch.randint(0, 1 << 10, (256,), generator=g) << 13) | 0x1000)
    fp16_ties = fp16_ties.to(torch.int32).view(torch.float32)
    special = torch.tensor(
        [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F7FFFFF, 0x00000001, 0x80008000, 0x477FF000],
        dtype=torch.int64,
    ).to(torch.int32).view(torch.float32)
    pool = torch.cat([special, bf16_ties, fp16_ties])
    k = min(n, pool.numel())
    x[torch.randperm(n, generator=g)[:k]] = pool[:k]
    return x


# --------------------------------------------------------------------------- correctness
def check_correctness(tc, device: torch.device) -> int:
    """Run every kernel variant against its reference; returns the number of failures."""
    failures = 0
    sizes = [1, 7, 1000, 4097, 65537, 1 << 20]

    def report(name: str, bad: int) -> None:
        nonlocal failures
        failures += bad > 0
        print(f"  {'OK  ' if bad == 0 else 'FAIL'} {name}" + (f": {bad} mismatching elements" if bad else ""))

    print("correctness (bitwise vs plain-torch reference):")
    host = [_values(n, seed=i).pin_memory() for i, n in enumerate(sizes)]
    offs, pos = [], 5
    for n in sizes:
        offs.append(pos)
        pos += n + 3
    total = pos + 11
    aligned_sizes = [16, 4096, 65536, 1 << 20]
    aligned_host = [_values(n, seed=50 + i).pin_memory() for i, n in enumerate(aligned_sizes)]
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for label, srcs, o in (
            ("pinned host, odd offsets", host, offs),
            ("device, odd offsets", [h.to(device) for h in host], offs),
            ("pinned host, aligned", aligned_host, None),
        ):
            n_out = total if o is not None else sum(aligned_sizes)
            out = torch.full((n_out,), 42.0, device=device).to(out_dtype)
            ref = out.clone()
            tc.gather_cast(srcs, out, o)
            tc.gather_cast_reference(srcs, ref, o)
            torch.cuda.synchronize(device)
            report(f"gather_cast fp32 {label} -> {str(out_dtype)[6:]}", _mismatches(out, ref))
    for src_dtype in (torch.bfloat16, torch.float16):
        srcs = [h.to(device=device, dtype=src_dtype) for h in host]
        out = torch.zeros(total, device=device, dtype=torch.float32)
        ref = out.clone()
        tc.gather_cast(srcs, out, offs)
        tc.gather_cast_reference(srcs, ref, offs)
        report(f"gather_cast {str(src_dtype)[6:]} device -> float32", _mismatches(out, ref))

    flat_n = sum(sizes) + 100
    g = torch.Generator().manual_seed(3)
    for src_dtype in (torch.bfloat16, torch.float16, torch.float32):
        src = (torch.randn(flat_n, generator=g) * 4).to(device=device, dtype=src_dtype)
        # random source slices (they may overlap; only destinations must not)
        off_list = [int(torch.randint(0, flat_n - n + 1, (1,), generator=g)) for n in sizes]
        for place in ("pinned host", "device"):
            for scale in (1.0, 0.37):
                init = [torch.randn(n, generator=g) * 100 for n in sizes]
                if place == "pinned host":
                    dsts = [d.clone().pin_memory() for d in init]
                else:
                    dsts = [d.to(device) for d in init]
                refs = [d.clone() for d in init]  # reference on CPU (FMA, like the kernel)
                tc.scatter_accumulate(src, dsts, off_list, scale=scale)
                tc.scatter_accumulate_reference(src.cpu(), refs, off_list, scale=scale)
                torch.cuda.synchronize(device)
                bad = sum(_mismatches(d, r) for d, r in zip(dsts, refs))
                report(f"scatter_accumulate {str(src_dtype)[6:]} -> fp32 {place}, scale={scale}", bad)
    return failures


# --------------------------------------------------------------------------- bandwidth
def _time_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median wall time of fn in ms, measured with CUDA events after two warm-up runs."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _time_host_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median wall time for work that ends on the host (CPU add_), synchronising around it."""
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench(tc, device: torch.device, total_gib: float, shards: int, iters: int) -> int:
    """Print the bandwidth table; returns 1 if the fast path disagrees with the baseline."""
    per = int(total_gib * (1 << 30) / 4 / shards) // 16 * 16
    n = per * shards
    nbytes = n * 4
    print(f"\nbandwidth: {shards} pinned fp32 shards x {per} elements = {nbytes / 2**30:.2f} GiB "
          f"(GB/s = host fp32 bytes / time, median of {iters})")
    t0 = time.perf_counter()
    srcs = [torch.empty(per, dtype=torch.float32).pin_memory() for _ in range(shards)]
    for i, s in enumerate(srcs):
        s.normal_(generator=torch.Generator().manual_seed(i))
    one_shot = torch.empty(n, dtype=torch.float32).pin_memory()
    print(f"  (allocated pinned memory in {time.perf_counter() - t0:.1f} s)")
    out = torch.empty(n, device=device, dtype=torch.bfloat16)
    flat32 = torch.empty(n, device=device, dtype=torch.float32)

    rows: list[tuple[str, float]] = []
    for block in (1024, 2048, 4096, 8192):
        ms = _time_ms(lambda: tc.gather_cast(srcs, out, block_size=block), iters, device)
        rows.append((f"gather_cast (1 launch, zero-copy), BLOCK={block}", ms))
    best_name, best_ms = min(rows, key=lambda r: r[1])

    def cat_baseline():
        return torch.cat([s.to(device, non_blocking=True) for s in srcs]).to(torch.bfloat16)

    def copy_baseline():
        pos = 0
        for s in srcs:
            flat32[pos : pos + s.numel()].copy_(s, non_blocking=True)
            pos += s.numel()
        return flat32.to(torch.bfloat16)

    cat_ms = _time_ms(cat_baseline, iters, device)
    copy_ms = _time_ms(copy_baseline, iters, device)
    ceil_ms = _time_ms(lambda: flat32.copy_(one_shot, non_blocking=True), iters, device)
    rows += [
        ("torch.cat([s.to(cuda, non_blocking)]).to(bf16)", cat_ms),
        ("copy_ per shard into flat fp32 + .to(bf16)", copy_ms),
        ("one 1-shot H2D copy_ fp32 (PCIe ceiling, no cast)", ceil_ms),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"  {'method'.ljust(width)}  {'ms':>8}  {'GB/s':>7}")
    for name, ms in rows:
        print(f"  {name.ljust(width)}  {ms:8.2f}  {nbytes / ms / 1e6:7.1f}")
    print(f"  best gather_cast: {best_name}")
    print(f"  speedup vs torch.cat baseline: {cat_ms / best_ms:.2f}x; vs copy_ per shard: "
          f"{copy_ms / best_ms:.2f}x; fraction of 1-shot copy bandwidth: {ceil_ms / best_ms:.2f}")

    tc.gather_cast(srcs, out)
    bad = _mismatches(out, cat_baseline())
    print(f"  {'OK  ' if bad == 0 else 'FAIL'} 1 GiB-scale gather_cast equals the torch.cat baseline"
          + (f" ({bad} mismatches)" if bad else ""))

    grad = torch.randn(n, device=device).to(torch.bfloat16)
    staging = torch.empty(n, dtype=torch.float32).pin_memory()

    def scatter_baseline():
        staging.copy_(grad.float(), non_blocking=True)
        torch.cuda.synchronize(device)
        pos = 0
        for s in srcs:
            s.add_(staging[pos : pos + s.numel()], alpha=0.5)
            pos += s.numel()

    s_ms = _time_ms(lambda: tc.scatter_accumulate(grad, srcs, scale=0.5), iters, device)
    b_ms = _time_host_ms(scatter_baseline, iters, device)
    print(f"  scatter_accumulate bf16 device -> pinned fp32 (+=): {s_ms:8.2f} ms "
          f"{nbytes / s_ms / 1e6:7.1f} GB/s; D2H fp32 copy + CPU add_: {b_ms:8.2f} ms "
          f"{nbytes / b_ms / 1e6:7.1f} GB/s; ratio {b_ms / s_ms:.2f}x")
    return int(bad > 0)


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="bandwidth test size")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--skip-bench", action="store_true", help="correctness only")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_copy_check: no CUDA device here; nothing to check (the CPU interpreter "
              "tests are tests/test_triton_copy.py). Exiting 0.")
        return 0
    tc = _load_triton_copy()
    if tc.triton is None:
        print(f"gpu_copy_check: CUDA is present but Triton is not importable "
              f"({tc._TRITON_IMPORT_ERROR!r}); `pip install triton`.")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; "
          f"triton {tc.triton.__version__}")
    t0 = time.perf_counter()
    failures = check_correctness(tc, device)
    print(f"  ({time.perf_counter() - t0:.1f} s including kernel compilation)")
    if not args.skip_bench:
        failures += bench(tc, device, args.total_gib, args.shards, args.iters)
    print(f"\n{'PASS' if failures == 0 else f'FAIL ({failures} checks)'} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
