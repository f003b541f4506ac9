"""Fused Triton copy kernels for host<->device parameter and gradient transfers.

ZeRO-Infinity keeps fp32 master shards in (pinned) host memory and needs them
on the device as one flat low-precision buffer before a layer runs, and needs
the flat low-precision gradient buffer folded back into fp32 host shards after
it. Doing that with one ``copy_`` + ``.to()`` per shard costs a launch and an
intermediate fp32 device copy per shard. The two kernels here do the whole
transfer in ONE launch each:

* :func:`gather_cast` reads N 1-D sources (device tensors, or on CUDA pinned
  host tensors read directly over PCIe via UVA zero-copy) and writes them,
  converted to fp32 / fp16 / bf16, into one flat destination at given offsets.
* :func:`scatter_accumulate` reads slices of a flat fp32 / fp16 / bf16 buffer
  and does ``dst += scale * slice`` (in fp32) into N fp32 destinations.

How one launch serves many tensors: Triton cannot take a list of tensors, so
the host builds one small int64 table ``[data_ptr x N | numel x N |
offset x N | block_start x (N+1)]``. The grid is flat over all blocks of all
segments; each program finds its segment by a binary search over the
block-start column (``ceil(log2 N)`` scalar loads) and turns the table's
integer address into a typed pointer with ``tl.pointer_type``. This works both
compiled and under ``TRITON_INTERPRET=1`` (the interpreter's memory is the
process's own, so raw ``data_ptr()`` values are valid there too), so there is
no per-segment fallback path. On CUDA, pinned host memory is addressed with
its host pointer, which is valid on the device under UVA for memory from
``cudaHostAlloc`` (what ``pin_memory()`` uses).

When every address is 16-byte aligned and every length / offset a multiple
of 16 elements (checked on the host), an ``ALIGNED`` variant tells the compiler
so and gets 16-byte vector loads and stores; otherwise accesses are 4 bytes.

Numerics, identical compiled and interpreted: fp32 -> bf16 is rounded to
nearest-even on the bit pattern rather than with ``x.to(tl.bfloat16)``, since
the interpreter's cast truncates; NaN stays NaN (a quiet NaN with the input's
sign; torch's own NaN bits differ between its scalar and vectorised paths).
bf16 -> fp32 is also done on the bits (the interpreter mangles bf16
subnormals); fp16 uses Triton's casts, which round to nearest-even everywhere.
The gradient update is an explicit ``tl.fma``, as torch's CPU
``add_(alpha=)`` computes it.

Kernels are wrapped with ``triton.jit`` lazily, on first use, because
``triton.jit`` reads ``TRITON_INTERPRET`` when it runs; setting the variable
any time before the first call is therefore enough. The module imports without
Triton; the kernel entry points then raise a ``RuntimeError`` naming the fix.
"""

import contextlib
import functools
import os
from collections import OrderedDict
from typing import Sequence

import torch

try:  # Triton is optional: the rest of the runtime must import without it.
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: "Exception | None" = None
except Exception as _exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = _exc

__all__ = [
    "available",
    "gather_cast",
    "scatter_accumulate",
    "gather_cast_reference",
    "scatter_accumulate_reference",
    "DEFAULT_BLOCK",
]

DEFAULT_BLOCK = 4096  # elements per program; 16 KiB of fp32 per block
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_OUT_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TABLE_CACHE_SIZE = 256


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    """True when the Triton kernels can run here (CUDA, or the CPU interpreter)."""
    return triton is not None and (torch.cuda.is_available() or _interpret())


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "zinf_runtime.triton_copy needs Triton (import failed: "
            f"{_TRITON_IMPORT_ERROR!r}); install it with `pip install triton` "
            "(or `pip install zinf_compile[triton]`), or use "
            "gather_cast_reference / scatter_accumulate_reference instead"
        )
    if not available():
        raise RuntimeError(
            "zinf_runtime.triton_copy kernels need a CUDA device, or "
            "TRITON_INTERPRET=1 to run them on CPU in the Triton interpreter; "
            "otherwise use gather_cast_reference / scatter_accumulate_reference"
        )


# --------------------------------------------------------------------------- kernels
# Plain functions here, wrapped by triton.jit in _kernels() on first use.
if triton is not None:

    def _gather_cast_kernel(
        table,  # int64 [ptr x n | numel x n | dst offset x n | block start x (n+1)]
        nseg,
        out_ptr,
        SRC_DTYPE: tl.constexpr,
        OUT_KIND: tl.constexpr,  # 0 fp32, 1 fp16, 2 bf16
        SEARCH_STEPS: tl.constexpr,  # ceil(log2(nseg))
        ALIGNED: tl.constexpr,  # every address 16 B aligned, every numel/offset % 16 == 0
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        starts = table + 3 * nseg
        # Largest seg with starts[seg] <= pid; invariant starts[lo] <= pid < starts[hi].
        lo = pid * 0
        hi = lo + nseg
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(starts + mid) <= pid
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seg = lo
        src_addr = tl.load(table + seg)
        n = tl.load(table + nseg + seg)
        dst_off = tl.load(table + 2 * nseg + seg)
        src = src_addr.to(tl.pointer_type(SRC_DTYPE))
        if ALIGNED:  # host-checked hints; without them every access is 4 bytes wide.
            src = tl.multiple_of(src, 16)  # (on the pointer: a hint on the int is lost in the cast)
            n = tl.multiple_of(n, 16)
            dst_off = tl.multiple_of(dst_off, 16)
        offs = (pid - tl.load(starts + seg)) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        raw = tl.load(src + offs, mask=mask, other=0.0)
        if SRC_DTYPE == tl.bfloat16:
            # Widen exactly on the bits: the interpreter's bf16 -> fp32 cast mangles subnormals.
            x = (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = raw.to(tl.float32)
        if OUT_KIND == 2:
            # Round-to-nearest-even on the bits (the interpreter's cast truncates).
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            quiet_nan = (bits >> 16) | 0x40
            y = tl.where(x != x, quiet_nan, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        elif OUT_KIND == 1:
            y = x.to(tl.float16)
        else:
            y = x
        tl.store(out_ptr + dst_off + offs, y, mask=mask)

    def _scatter_accumulate_kernel(
        table,  # int64 [dst ptr x n | numel x n | src offset x n | block start x (n+1)]
        nseg,
        src_ptr,
        scale,
        SRC_BF16: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,
        ALIGNED: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        starts = table + 3 * nseg
        lo = pid * 0
        hi = lo + nseg
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(starts + mid) <= pid
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        seg = lo
        dst_addr = tl.load(table + seg)
        n = tl.load(table + nseg + seg)
        src_off = tl.load(table + 2 * nseg + seg)
        dst = dst_addr.to(tl.pointer_type(tl.float32))
        if ALIGNED:  # as in _gather_cast_kernel
            dst = tl.multiple_of(dst, 16)
            n = tl.multiple_of(n, 16)
            src_off = tl.multiple_of(src_off, 16)
        offs = (pid - tl.load(starts + seg)) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        raw = tl.load(src_ptr + src_off + offs, mask=mask, other=0.0)
        if SRC_BF16:  # exact widening on the bits, as in _gather_cast_kernel
            x = (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = raw.to(tl.float32)
        acc = tl.load(dst + offs, mask=mask, other=0.0)
        # Explicit single-rounding FMA: torch's CPU add_(alpha=) uses fmadd too, and Triton 3.9's
        # interpreter implements tl.fma exactly, so results match bitwise (3.6's rounds twice).
        tl.store(dst + offs, tl.fma(x, scale, acc), mask=mask)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """JIT-wrap the kernels; keyed on the interpreter flag triton.jit reads."""
    del interpret  # only part of the cache key
    return triton.jit(_gather_cast_kernel), triton.jit(_scatter_accumulate_kernel)


# --------------------------------------------------------------------------- host side
_table_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def _table_tensor(values: tuple, device: torch.device) -> torch.Tensor:
    """Segment table on ``device``, cached: same integers -> same table, always valid.

    The upload is ``non_blocking`` from a temporary pinned tensor freed at return: safe, since
    ``copy_`` records the copy on the caching host allocator, which reuses the block only after it.
    """
    key = (str(device), values)
    hit = _table_cache.get(key)
    if hit is not None:
        _table_cache.move_to_end(key)
        return hit
    if device.type == "cuda":
        host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
        table = host.to(device, non_blocking=True)
    else:
        table = torch.tensor(values, dtype=torch.int64, device=device)
    _table_cache[key] = table
    if len(_table_cache) > _TABLE_CACHE_SIZE:
        _table_cache.popitem(last=False)
    return table


def _build_table(ptrs: Sequence[int], lens: Sequence[int], offs: Sequence[int], block: int) -> tuple:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + -(-n // block))
    return tuple(ptrs) + tuple(lens) + tuple(offs) + tuple(starts)


def _aligned(ptrs: Sequence[int], lens: Sequence[int], offs: Sequence[int]) -> bool:
    """Whether the kernel's ALIGNED hints are true (they must be: they drive masked vector I/O)."""
    return all(p % 16 == 0 for p in ptrs) and all(n % 16 == 0 for n in lens) and all(o % 16 == 0 for o in offs)


def _check_block(block: int) -> int:
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block}")
    return block


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _flat_numel(t: torch.Tensor, what: str) -> int:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (it is read as a flat 1-D buffer)")
    return t.numel()


def _resolve_offsets(lens: Sequence[int], offsets: "Sequence[int] | None", what: str) -> list[int]:
    if offsets is None:
        out, pos = [], 0
        for n in lens:
            out.append(pos)
            pos += n
        return out
    if len(offsets) != len(lens):
        raise ValueError(f"{what}: got {len(offsets)} offsets for {len(lens)} tensors")
    return [int(o) for o in offsets]


def _check_ranges(
    ranges: list[tuple[int, int]], limit: "int | None", what: str, *, may_overlap: bool = False
) -> None:
    """Reject out-of-bounds [start, end) ranges and, for written ranges, overlaps (they would race)."""
    prev_end, prev = None, None
    for start, end in sorted(ranges):
        if start < 0 or (limit is not None and end > limit):
            raise ValueError(f"{what}: range [{start}, {end}) is outside [0, {limit})")
        if not may_overlap and prev_end is not None and start < prev_end:
            raise ValueError(f"{what}: ranges {prev} and [{start}, {end}) overlap")
        prev_end, prev = end, f"[{start}, {end})"


def _check_placement(device_t: torch.Tensor, others: Sequence[torch.Tensor], what: str) -> None:
    """Interpreter: everything on CPU. CUDA: same device, or pinned host (UVA)."""
    if _interpret():
        for t in (device_t, *others):
            if t.device.type != "cpu":
                raise ValueError(f"{what}: under TRITON_INTERPRET=1 all tensors must be on CPU")
        return
    if device_t.device.type != "cuda":
        raise ValueError(f"{what}: the flat buffer must be a CUDA tensor (got {device_t.device})")
    for t in others:
        if t.device == device_t.device:
            continue
        if t.device.type == "cpu" and t.is_pinned():
            continue
        raise ValueError(
            f"{what}: tensors must live on {device_t.device} or in pinned host memory "
            f"(got {t.device}{', not pinned' if t.device.type == 'cpu' else ''})"
        )


def gather_cast(
    srcs: list[torch.Tensor],
    out: torch.Tensor,
    offsets: "list[int] | None" = None,
    *,
    block_size: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Copy ``srcs`` (flattened) into flat ``out`` at element ``offsets``, casting, in one launch.

    ``offsets`` defaults to packing back to back from 0. Sources share one dtype
    (fp32/fp16/bf16); ``out`` is fp32/fp16/bf16. On CUDA the sources may be
    pinned host tensors, read in place over PCIe; like a ``non_blocking`` copy,
    they must not be modified until the current stream has passed this kernel,
    nor freed: torch's caching host allocator tracks ``copy_`` uses of pinned
    blocks, not this kernel's, and could hand a freed source out again while it
    is read. Record a ``zinf_runtime.hostsync.Fence`` right after the call and
    wait on it before touching the sources (``store.fetch_shard`` does; its
    slots' host accessors wait). Returns ``out``.
    """
    _require_triton()
    block = _check_block(block_size)
    if out.dtype not in _SUPPORTED:
        raise TypeError(f"gather_cast: out dtype {out.dtype} not in {_SUPPORTED}")
    out_numel = _flat_numel(out, "gather_cast: out")
    if not srcs:
        return out
    src_dtype = srcs[0].dtype
    if src_dtype not in _SUPPORTED or any(s.dtype != src_dtype for s in srcs):
        raise TypeError(f"gather_cast: sources must share one dtype from {_SUPPORTED}")
    lens = [_flat_numel(s, "gather_cast: sources") for s in srcs]
    offs = _resolve_offsets(lens, offsets, "gather_cast")
    _check_ranges([(o, o + n) for o, n in zip(offs, lens)], out_numel, "gather_cast: out")
    _check_placement(out, srcs, "gather_cast")
    keep = [i for i, n in enumerate(lens) if n > 0]
    if not keep:
        return out
    ptrs, lens, offs = [srcs[i].data_ptr() for i in keep], [lens[i] for i in keep], [offs[i] for i in keep]
    table = _build_table(ptrs, lens, offs, block)
    nseg = len(keep)
    kernel, _ = _kernels(_interpret())
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        t = _table_tensor(table, out.device)
        kernel[(table[-1],)](
            t,
            nseg,
            out,
            SRC_DTYPE=_tl_dtype(src_dtype),
            OUT_KIND=_OUT_KIND[out.dtype],
            SEARCH_STEPS=(nseg - 1).bit_length(),
            ALIGNED=_aligned(ptrs, lens, offs),
            BLOCK=block,
            num_warps=_num_warps(block),
            enable_fp_fusion=False,  # nothing to fuse; pins behaviour across Triton versions
        )
    return out


def scatter_accumulate(
    src: torch.Tensor,
    dsts: list[torch.Tensor],
    offsets: "list[int] | None" = None,
    scale: float = 1.0,
    *,
    block_size: int = DEFAULT_BLOCK,
) -> None:
    """``dst += scale * src[off:off+dst.numel()]`` in fp32 for every fp32 ``dst``, in one launch.

    ``src`` is a flat fp32/fp16/bf16 buffer; ``offsets`` default to back to
    back. On CUDA the destinations may be pinned host shards, updated in place
    over PCIe; they must not alias each other. The update is one fp32 FMA,
    ``fma(x, scale, dst)``, like torch's ``dst.add_(x, alpha=scale)``.

    On CUDA this returns while the kernel may still be writing the host shards:
    the host must not read, write or free them before the current stream has
    passed it. Record a ``zinf_runtime.hostsync.Fence`` right after the call and
    wait on it first (``store`` records it on the gradient slot, whose host
    accessors, used by the optimizer, clipping and ``zero_grad``, wait). ``src``
    needs no keep-alive: the device caching allocator reuses its block only in
    stream order, after the kernel.
    """
    _require_triton()
    block = _check_block(block_size)
    if src.dtype not in _SUPPORTED:
        raise TypeError(f"scatter_accumulate: src dtype {src.dtype} not in {_SUPPORTED}")
    src_numel = _flat_numel(src, "scatter_accumulate: src")
    if not dsts:
        return
    if any(d.dtype != torch.float32 for d in dsts):
        raise TypeError("scatter_accumulate: destinations must be fp32")
    lens = [_flat_numel(d, "scatter_accumulate: destinations") for d in dsts]
    offs = _resolve_offsets(lens, offsets, "scatter_accumulate")
    _check_ranges(
        [(o, o + n) for o, n in zip(offs, lens) if n], src_numel, "scatter_accumulate: src", may_overlap=True
    )
    _check_ranges(
        [(d.data_ptr(), d.data_ptr() + 4 * n) for d, n in zip(dsts, lens) if n],
        None,
        "scatter_accumulate: destination memory",
    )
    _check_placement(src, dsts, "scatter_accumulate")
    keep = [i for i, n in enumerate(lens) if n > 0]
    if not keep:
        return
    ptrs, lens, offs = [dsts[i].data_ptr() for i in keep], [lens[i] for i in keep], [offs[i] for i in keep]
    table = _build_table(ptrs, lens, offs, block)
    nseg = len(keep)
    _, kernel = _kernels(_interpret())
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        t = _table_tensor(table, src.device)
        kernel[(table[-1],)](
            t,
            nseg,
            src,
            float(scale),
            SRC_BF16=src.dtype == torch.bfloat16,
            SEARCH_STEPS=(nseg - 1).bit_length(),
            ALIGNED=_aligned(ptrs, lens, offs),
            BLOCK=block,
            num_warps=_num_warps(block),
            enable_fp_fusion=False,  # nothing to fuse; pins behaviour across Triton versions
        )


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


# --------------------------------------------------------------------------- references
def gather_cast_reference(
    srcs: list[torch.Tensor], out: torch.Tensor, offsets: "list[int] | None" = None
) -> torch.Tensor:
    """Plain-torch :func:`gather_cast` (one copy per source): the ground truth and fallback."""
    lens = [s.numel() for s in srcs]
    flat = out.view(-1)
    for s, o, n in zip(srcs, _resolve_offsets(lens, offsets, "gather_cast_reference"), lens):
        flat[o : o + n].copy_(s.reshape(-1).to(device=out.device, dtype=out.dtype))
    return out


def scatter_accumulate_reference(
    src: torch.Tensor, dsts: list[torch.Tensor], offsets: "list[int] | None" = None, scale: float = 1.0
) -> None:
    """Plain-torch :func:`scatter_accumulate`: the ground truth and fallback."""
    lens = [d.numel() for d in dsts]
    flat = src.reshape(-1)
    for d, o, n in zip(dsts, _resolve_offsets(lens, offsets, "scatter_accumulate_reference"), lens):
        d.view(-1).add_(flat[o : o + n].to(device=d.device, dtype=torch.float32), alpha=scale)
