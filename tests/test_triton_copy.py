"""Bitwise tests of zinf_runtime.triton_copy against its plain-torch references.

They run the Triton kernels on CPU through the Triton interpreter. The brief
for this module sets ``TRITON_INTERPRET=1`` before triton is imported; since
triton_copy wraps its kernels with ``triton.jit`` lazily (``triton.jit`` reads
the variable when it runs), what matters is the value at call time, so the
variable is restored right after the imports (no leak into other test modules
collected in the same process) and set again per test by an autouse fixture.
"""

import os

_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from zinf_runtime import triton_copy as tc  # noqa: E402

if _PREV_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET

# numpy warns when the interpreter casts large fp32 to fp16 (the result, inf, is right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

SIZES = [1, 7, 1000, 4097, 65537]
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _values(n: int, seed: int) -> torch.Tensor:
    """Random fp32 of many magnitudes, with specials and exact rounding ties mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=g).float())
    hi = torch.randint(0, 1 << 16, (64,), generator=g)
    bf16_ties = (hi << 16) | 0x8000  # lower half exactly 0x8000: halfway between two bf16
    fp16_exp = torch.randint(103, 143, (64,), generator=g)  # fp16 subnormal .. overflow range
    fp16_ties = (torch.randint(0, 2, (64,), generator=g) << 31) | (fp16_exp << 23)
    fp16_ties |= (torch.randint(0, 1 << 10, (64,), generator=g) << 13) | 0x1000
    special = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF,  # quiet/signalling NaNs
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # near FLT_MAX: rounds to inf or not
        0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00008000, 0x00018000,  # subnormals
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,  # bf16 ties (even/odd) and neighbours
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # fp16 max / overflow boundary
        0x33800000, 0x33000000, 0x33000001, 0x387FC000,  # fp16 subnormal boundary and ties
    ]
    pool = torch.cat([_from_bits(special), bf16_ties.to(torch.int32).view(torch.float32),
                      fp16_ties.to(torch.int32).view(torch.float32)])
    k = min(n, pool.numel())
    pos = torch.randperm(n, generator=g)[:k]
    x[pos] = pool[torch.randperm(pool.numel(), generator=g)[:k]]
    if n >= pool.numel():
        x[: pool.numel()] = pool  # every special appears in the larger tensors
    return x


def _assert_bitwise(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Same bits except NaN payloads (torch itself differs between code paths there)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan_got, nan_ref = torch.isnan(got), torch.isnan(ref)
    assert torch.equal(nan_got, nan_ref), "NaN positions differ"
    iv = _INT_VIEW[got.dtype]
    g, r = got.view(iv)[~nan_ref], ref.view(iv)[~nan_ref]
    bad = (g != r).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, first at {bad[:5].flatten().tolist()}"


def _layout(sizes: list[int], gap: int = 3) -> tuple[list[int], int]:
    """Offsets with odd gaps (never a multiple of the block) and the total length."""
    offs, pos = [], 5
    for n in sizes:
        offs.append(pos)
        pos += n + gap
    return offs, pos + 11


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_cast_sizes_offsets_specials(out_dtype):
    srcs = [_values(n, seed=i) for i, n in enumerate(SIZES)]
    offs, total = _layout(SIZES)
    sentinel = torch.full((total,), 42.0).to(out_dtype)
    out, ref = sentinel.clone(), sentinel.clone()
    assert tc.gather_cast(srcs, out, offs, block_size=2048) is out
    tc.gather_cast_reference(srcs, ref, offs)
    _assert_bitwise(out, ref)
    assert (out[:5] == 42).all() and (out[-11:] == 42).all()  # gaps untouched


def test_bf16_rounding_is_nearest_even_not_truncation():
    bits = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0xBF808000, 0x7F7FFFFF]
    out = torch.empty(len(bits), dtype=torch.bfloat16)
    tc.gather_cast([_from_bits(bits)], out)
    assert out.view(torch.int16).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x3F81, -0x4080, 0x7F80]


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_cast_many_segments_default_offsets(out_dtype):
    g = torch.Generator().manual_seed(7)
    sizes = [int(v) for v in torch.randint(0, 300, (37,), generator=g)] + [0, 1, 64]
    srcs = [_values(n, seed=100 + i) for i, n in enumerate(sizes)]
    out = torch.zeros(sum(sizes) + 9, dtype=out_dtype)
    ref = out.clone()
    tc.gather_cast(srcs, out, block_size=64)  # packed back to back, 2-D sources allowed
    tc.gather_cast_reference(srcs, ref)
    _assert_bitwise(out, ref)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gather_cast_low_precision_sources(src_dtype, out_dtype):
    srcs = [_values(n, seed=n).to(src_dtype) for n in (33, 4097, 16)]
    srcs.append(_values(48, seed=1).to(src_dtype).view(3, 16))  # flattened like .reshape(-1)
    offs, total = [4100, 1, 8300, 9000], 9100
    out = torch.zeros(total, dtype=out_dtype)
    ref = out.clone()
    tc.gather_cast(srcs, out, offs, block_size=1024)
    tc.gather_cast_reference(srcs, ref, offs)
    _assert_bitwise(out, ref)


def test_gather_cast_aligned_and_unaligned_views():
    base = _values(8192 + 64, seed=3)
    aligned = [base[0:4096], base[4096:8192]]  # 16-byte aligned, numel % 16 == 0
    assert tc._aligned([t.data_ptr() for t in aligned], [4096, 4096], [0, 4096])
    unaligned = [base[1:4098], base[4099:8195]]
    assert not tc._aligned([t.data_ptr() for t in unaligned], [4097, 4096], [0, 4097])
    for srcs in (aligned, unaligned):
        out = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
        ref = out.clone()
        tc.gather_cast(srcs, out)
        tc.gather_cast_reference(srcs, ref)
        _assert_bitwise(out, ref)


def _interpreter_fma_is_exact() -> bool:
    """Whether this Triton's interpreter rounds ``tl.fma`` once, as the GPU does (Triton 3.9's does;
    3.6's multiplies and adds with two roundings). Probed with a kernel of its own, not with
    ``scatter_accumulate``, so a kernel that stopped using ``tl.fma`` still fails the test below
    wherever the interpreter is exact (CI)."""
    import triton.language as tl

    @triton.jit
    def fma_kernel(a, b, c, out):
        tl.store(out, tl.fma(tl.load(a), tl.load(b), tl.load(c)))

    x = torch.tensor([1.0 + 2.0 ** -12])
    c = torch.tensor([-(1.0 + 2.0 ** -11)])
    out = torch.empty(1)
    fma_kernel[(1,)](x, x, c, out)  # x*x = 1 + 2^-11 + 2^-24: fma keeps the 2^-24, mul then add loses it
    return float(out) == 2.0 ** -24


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.5, -3.0, 0.37, 1.0 / 3.0])
def test_scatter_accumulate_matches_reference(src_dtype, scale):
    """Bitwise against torch's ``add_(x, alpha=scale)`` (one fp32 FMA). Under an interpreter whose
    ``tl.fma`` rounds twice (Triton 3.6; the GPU kernel is checked bitwise by benchmarks/gpu_check.py),
    against ``dst + x * scale`` rounded twice instead: the data movement is still checked to the bit."""
    g = torch.Generator().manual_seed(11)
    sizes = SIZES + [16, 0, 33]
    src = (torch.randn(80000, generator=g) * 4).to(src_dtype)
    offs = [10, 3, 100, 2001, 7000, 0, 5, 79900]  # source slices may overlap; dsts may not
    dsts = [torch.randn(n, generator=g) * 100 for n in sizes]  # nonzero: accumulate, not copy
    refs = [d.clone() for d in dsts]
    tc.scatter_accumulate(src, dsts, offs, scale=scale, block_size=2048)
    if _interpreter_fma_is_exact():
        tc.scatter_accumulate_reference(src, refs, offs, scale=scale)
    else:
        flat = src.reshape(-1).float()
        for r, o in zip(refs, offs):
            r.add_(flat[o : o + r.numel()] * scale)
    for d, r in zip(dsts, refs):
        _assert_bitwise(d, r)


def test_scatter_accumulate_default_offsets_specials_and_2d():
    sizes = [7, 1000, 4097]
    src = _values(sum(sizes), seed=5).to(torch.bfloat16)
    dsts = [_values(7, seed=6), torch.ones(1000) * 1e30, torch.zeros(4097).view(17, 241)]
    refs = [d.clone() for d in dsts]
    tc.scatter_accumulate(src, dsts, block_size=512)
    tc.scatter_accumulate_reference(src, refs)
    for d, r in zip(dsts, refs):
        _assert_bitwise(d, r)


def test_round_trip_gather_then_scatter():
    shards = [_values(n, seed=n) for n in (100, 2500, 37)]
    flat = torch.empty(sum(s.numel() for s in shards), dtype=torch.float32)
    tc.gather_cast(shards, flat)
    acc = [torch.zeros_like(s) for s in shards]
    tc.scatter_accumulate(flat, acc, scale=1.0)
    for a, s in zip(acc, shards):
        _assert_bitwise(a, s + 0.0)  # 0 + (-0) is +0, as in torch


def test_empty_inputs_are_noops():
    out = torch.full((4,), 2.0)
    assert tc.gather_cast([], out) is out
    tc.gather_cast([torch.empty(0)], out)
    tc.scatter_accumulate(torch.ones(4), [])
    assert (out == 2.0).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: tc.gather_cast([torch.ones(4), torch.ones(4)], torch.zeros(8), [0, 3]), "overlap"),
        (lambda: tc.gather_cast([torch.ones(4)], torch.zeros(8), [5]), "outside"),
        (lambda: tc.gather_cast([torch.ones(4)], torch.zeros(8), [0, 4]), "offsets"),
        (lambda: tc.gather_cast([torch.ones(4)], torch.zeros(8), block_size=100), "power of two"),
        (lambda: tc.gather_cast([torch.ones(4, 4).t()], torch.zeros(16)), "contiguous"),
        (lambda: tc.scatter_accumulate(torch.ones(8), [torch.ones(8)], [1]), "outside"),
        (lambda: tc.scatter_accumulate(torch.ones(8), [torch.ones(4).half()]), "fp32"),
        (lambda: tc.gather_cast([torch.ones(4), torch.ones(4).half()], torch.zeros(8)), "one dtype"),
        (lambda: tc.gather_cast([torch.ones(4)], torch.zeros(8, dtype=torch.int32)), "dtype"),
    ],
)
def test_invalid_arguments_raise(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_aliasing_destinations_rejected():
    buf = torch.zeros(10)
    with pytest.raises(ValueError, match="overlap"):
        tc.scatter_accumulate(torch.ones(10), [buf[0:6], buf[4:10]], [0, 0])


def test_available_and_missing_triton(monkeypatch):
    assert tc.available()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert tc.available() == torch.cuda.is_available()
    monkeypatch.setattr(tc, "triton", None)
    assert not tc.available()
    with pytest.raises(RuntimeError, match="pip install triton"):
        tc.gather_cast([torch.ones(2)], torch.zeros(2))


def test_module_imports_without_triton(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    spec = importlib.util.spec_from_file_location("_tc_no_triton", tc.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.available()
    with pytest.raises(RuntimeError, match="Triton"):
        mod.scatter_accumulate(torch.ones(2), [torch.zeros(2)])
    out = torch.zeros(3, dtype=torch.bfloat16)
    mod.gather_cast_reference([torch.tensor([1.0, 2.0, 3.0])], out)  # references still work
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_compiles_for_cuda_without_a_gpu(monkeypatch):
    """Compile the real (non-interpreted) kernels to PTX for sm_90 with Triton's bundled
    ptxas: catches code the interpreter accepts but the compiler rejects, and checks
    that the ALIGNED hints produce 16-byte vector loads and stores."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget AOT API")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gather, scatter = tc._kernels(False)
    target = GPUTarget("cuda", 90, 32)
    opts = {"num_warps": 8, "enable_fp_fusion": False}
    div16 = [["tt.divisibility", 16]]
    sig = {"table": "*i64", "nseg": "i64", "out_ptr": "*bf16", "SRC_DTYPE": "constexpr",
           "OUT_KIND": "constexpr", "SEARCH_STEPS": "constexpr", "ALIGNED": "constexpr",
           "BLOCK": "constexpr"}
    for aligned in (True, False):
        consts = {"SRC_DTYPE": triton.language.float32, "OUT_KIND": 2, "SEARCH_STEPS": 6,
                  "ALIGNED": aligned, "BLOCK": 4096}
        try:
            k = triton.compile(ASTSource(gather, sig, consts, {(0,): div16, (2,): div16}),
                               target=target, options=opts)
        except RuntimeError as exc:  # e.g. no ptxas shipped with this build
            if "ptxas" in str(exc).lower():
                pytest.skip(f"cannot run ptxas here: {exc}")
            raise
        assert ("ld.global.v4.b32" in k.asm["ptx"]) == aligned
    sig = {"table": "*i64", "nseg": "i32", "src_ptr": "*bf16", "scale": "fp32", "SRC_BF16": "constexpr",
           "SEARCH_STEPS": "constexpr", "ALIGNED": "constexpr", "BLOCK": "constexpr"}
    consts = {"SRC_BF16": True, "SEARCH_STEPS": 0, "ALIGNED": True, "BLOCK": 1024}
    k = triton.compile(ASTSource(scatter, sig, consts, {(0,): div16, (2,): div16}),
                       target=target, options=opts)
    assert "fma.rn.f32" in k.asm["ptx"] and "st.global.v4.b32" in k.asm["ptx"]
