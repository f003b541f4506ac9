"""Offload tiers: every combination of offload_params x offload_optimizer trains like eager.

Moving shards between tiers copies bits and the optimizer runs torch's kernels on the fp32 shards,
so with eager graphs the training is bitwise eager's (Adam included) on any CPU.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch

from conftest import (assert_grads_equal, assert_grads_within_reduction_bound,
                      assert_mixed_precision_matches_autocast, assert_same_training, train_pair)

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
TIERS = ("none", "cpu", "nvme")


def opts(params, optim, path, **kw):
    return {"compiler": "eager", "offload_params": params, "offload_optimizer": optim, "nvme_path": str(path),
            "optimizer_sub_group_bytes": 64 << 10, **kw}


@pytest.mark.parity
@pytest.mark.parametrize("params, optim", list(itertools.product(TIERS, TIERS)))
def test_all_offload_combinations_match_eager(params, optim, tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(CFG), batches, opts(params, optim, tmp_path))
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    m = run.model
    h = zinf_runtime.handle_of(m.blocks[0].fc.weight)
    want = {"none": "device", "cpu": "cpu", "nvme": "nvme"}
    assert (h.placement.tier, h.placement.master_tier) == (want[params], want[optim])
    # fp32 parameters in CPU memory are also the master of an NVMe optimizer (store.master_home)
    master_in_copy = (params, optim) == ("cpu", "nvme")
    assert h.master.tier == ("cpu" if master_in_copy else want[optim])
    assert (h.param_copy is None) == (params == optim or master_in_copy)
    nvme = zinf_compile.memory_stats(m)["nvme"]  # this model's: another test's may not be collected yet
    assert (nvme["param"]["current"] > 0) == ("nvme" in (params, optim) and not master_in_copy)
    if optim == "nvme":  # the swap folder holds master files only where the master is not in memory
        assert bool(list(tmp_path.rglob("k_*master*"))) == (not master_in_copy)
    if optim == "nvme":
        assert nvme["optim"]["current"] > 0  # Adam moments live on disk, not in optimizer.state
        assert h.optim_state.names == ("exp_avg", "exp_avg_sq")  # packed in one file: one read, one write
        assert not list(tmp_path.rglob("k_*exp_avg*"))
        assert len(list(tmp_path.rglob(f"k_u{h.uid}%2Eoptim.[ab]"))) == 2  # the current file and its spare


@pytest.mark.parity
@pytest.mark.parametrize("params, optim", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "none")])
def test_small_shards_kept_in_memory_train_like_eager(params, optim, tmp_path):
    """``nvme_min_shard_bytes``: small parameters' NVMe states stay in CPU memory; the training is
    still bitwise eager's, and only the big parameters have swap files."""
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(CFG), batches, opts(params, optim, tmp_path, nvme_min_shard_bytes=1024))
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    want = {"none": "device", "cpu": "cpu", "nvme": "nvme"}
    small = {n for n, p in run.model.named_parameters() if p.numel() * 4 < 1024}
    assert small and len(small) < len(list(run.model.parameters()))
    for name, p in run.model.named_parameters():
        pl = zinf_runtime.handle_of(p).placement
        if name in small:  # NVMe became CPU memory, the other tier is kept
            assert (pl.tier, pl.master_tier) == tuple("cpu" if t == "nvme" else t
                                                      for t in (want[params], want[optim])), name
        else:
            assert (pl.tier, pl.master_tier) == (want[params], want[optim]), name
    # the schedule goes by each parameter's own tiers: a parameter kept in memory is fetched in
    # place (one fetch_shard, no start/wait pair) and its gradient added where it lives
    rec = zinf_compile.compile_records()[-1]
    pls = [zinf_runtime.handle_of(p).placement for p in run.model.parameters()]
    assert rec.final("forward").code.count("zinf.fetch_shard") == sum(pl.tier != "nvme" for pl in pls)
    assert rec.counters["reduce_in_place"] == sum(pl.master_tier != "nvme" for pl in pls)


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_steady_state_nvme_io_has_no_bounce_copies(params, tmp_path):
    """From the second optimizer step on, every NVMe read and write moves straight between the file
    and a page-aligned pool buffer: only tails of tensors that are not a whole page go through a
    bounce slot. torch's first Adam states and the first masters are not the pool's; once written
    they must not join it (they did: 31% of the third step's bytes were still copied)."""
    from zinf_runtime.context import contexts_of

    cfg = GPTConfig(vocab=512, seq=16, layers=2, hidden=128, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    # sub-groups big enough that every gradient stays in memory (tiers.DirtyTracker's cap): written
    # back past it, some parameters would move a gradient and others not
    cm = torch.compile(model, backend="zinf", options=opts(params, "nvme", tmp_path,
                                                           optimizer_sub_group_bytes=64 << 20))
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-4)
    before = eng = None
    for step in range(3):
        if step == 2:
            (eng,) = [e for c in contexts_of(model) for e in c.engines()]
            before = eng.stats()
        cm(*make_batch(cfg, 2, seed=step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = eng.stats()
    moved = sum(after[k] - before[k] for k in ("bytes_written", "bytes_read"))
    copied = moved - (after["zero_copy_bytes"] - before["zero_copy_bytes"])
    # the parameters that are not whole pages are small (one block each), and every parameter moves
    # the same states each step, so they are exactly the share of the bytes that may be copied
    sizes = [4 * p.numel() for p in model.parameters()]
    assert all(b <= 1 << 20 for b in sizes if b % 4096)
    share = sum(b for b in sizes if b % 4096) / sum(sizes)
    assert moved > 0 and copied <= share * moved, (copied, share * moved)


@pytest.mark.parity
@pytest.mark.parametrize("params", ["cpu", "nvme"])
@pytest.mark.parametrize("cap", ["all", "tiny"])
def test_nvme_gradients_are_written_back_only_past_the_cap(params, cap, tmp_path):
    """Write-back gradients (``tiers.DirtyTracker``): with sub-groups that hold every gradient, none
    is written to the swap folder, the step reads them from memory; with a cap under one gradient,
    each is written back and read from disk. Eager's numbers, bitwise, either way."""
    from zinf_runtime.context import contexts_of

    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    sub_group = 64 << 20 if cap == "all" else 256
    run = train_pair(lambda: GPT(CFG), batches, opts(params, "nvme", tmp_path, optimizer_sub_group_bytes=sub_group))
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    (ctx,) = contexts_of(run.model)
    grad_files = list(tmp_path.rglob("k_*grad*"))
    if cap == "all":
        assert ctx.dirty.written_back == 0 and ctx.dirty.peak_bytes > 0 and not grad_files
    else:
        assert ctx.dirty.written_back > 0 and grad_files


def test_placement_for_param_rule():
    """The rule every rank applies alike: the bandwidth scheme's shard, 4 bytes an element, against
    the threshold; only NVMe tiers change; 0 turns it off; the default (None) keeps 1-D parameters
    under 64 KiB in memory and leaves every matrix on NVMe."""
    cpu = torch.device("cpu")
    swap = zinf_runtime.swap.SwapConfig(nvme_path="/tmp")
    nn = zinf_runtime.Placement(tier="nvme", compute_device=cpu, optim_tier="nvme", swap=swap, nvme_min_bytes=1024)
    assert nn.for_param(255, 2).tier == "cpu" and nn.for_param(255, 1).master_tier == "cpu"
    assert nn.for_param(256, 1) is nn  # 1024 bytes: not under
    dn = zinf_runtime.Placement(tier="device", compute_device=cpu, optim_tier="nvme", swap=swap, nvme_min_bytes=1024)
    assert (dn.for_param(10, 2).tier, dn.for_param(10, 2).master_tier) == ("device", "cpu")
    off = zinf_runtime.Placement(tier="nvme", compute_device=cpu, optim_tier="nvme", swap=swap, nvme_min_bytes=0)
    assert off.for_param(1, 1) is off and off.for_param(1, 2) is off
    default = zinf_runtime.Placement(tier="nvme", compute_device=cpu, optim_tier="nvme", swap=swap)
    limit = zinf_runtime.store.DEFAULT_NVME_MIN_BYTES_1D // 4  # elements of a 1-D shard at the threshold
    assert default.for_param(limit - 1, 1).tier == "cpu" and default.for_param(limit - 1, 0).tier == "cpu"
    assert default.for_param(limit, 1) is default  # not under
    assert default.for_param(1, 2) is default  # a matrix: on NVMe however small
    mem = zinf_runtime.Placement(tier="cpu", compute_device=cpu, nvme_min_bytes=1 << 20)
    assert mem.for_param(1, 1) is mem
    for bad in (-1, True, 1.5, "1k"):
        with pytest.raises(ValueError, match="nvme_min_shard_bytes"):
            zinf_compile.Config.from_options({"nvme_min_shard_bytes": bad})


@pytest.mark.parity
def test_gradient_accumulation_with_nvme(tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(6)]
    run = train_pair(lambda: GPT(CFG), batches, opts("nvme", "nvme", tmp_path), accum=2)
    assert_grads_equal(run)  # accumulated by read-modify-write on disk
    assert_same_training(run, exact=True)


@pytest.mark.parity
def test_nvme_streaming_uses_several_sub_groups(tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(2)]
    run = train_pair(lambda: GPT(CFG), batches, opts("cpu", "nvme", tmp_path, optimizer_sub_group_bytes=16 << 10))
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    m = run.model
    engine = zinf_runtime.handle_of(m.tok.weight).grad_slot.swap
    assert engine.stats()["reads"] > 0 and engine.stats()["writes"] > 0
    assert engine.dir.startswith(str(tmp_path)) and oct(os.stat(engine.dir).st_mode & 0o777) == "0o700"


@pytest.mark.parity
@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_nvme_step_in_slices_matches_eager(params, tmp_path, monkeypatch):
    """The streamed step runs torch's step on a loaded sub-group a slice at a time
    (``STEP_SLICE_BYTES``), so a slice's writes go out while the next one steps. One unit per slice
    still trains bitwise like eager."""
    import zinf_runtime.optim as zoptim

    real, seen = zoptim._slices, []

    def spy(items, nbytes):
        seen.append(real(items, nbytes))
        return seen[-1]

    monkeypatch.setattr(zoptim, "STEP_SLICE_BYTES", 1)
    monkeypatch.setattr(zoptim, "_slices", spy)
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(CFG), batches, opts(params, "nvme", tmp_path, optimizer_sub_group_bytes=64 << 20))
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    # the streamed units: the parameters on NVMe (the default keeps norms and biases in memory)
    n_units = sum(zinf_runtime.handle_of(p).placement.master_tier == "nvme" for p in run.model.parameters())
    assert 0 < n_units < len(list(run.model.parameters()))
    assert len(seen) == 3 and all(len(r) == n_units and all(len(s) == 1 for s in r) for r in seen)


def test_bad_nvme_path_fails_at_compile_naming_it(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(ValueError, match="absent"):
        zinf_compile.Config(offload_params="nvme", nvme_path=str(missing))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="file"):
        zinf_compile.Config(offload_optimizer="nvme", nvme_path=str(a_file))
    with pytest.raises(ValueError, match="nvme_path"):
        zinf_compile.Config(offload_optimizer="nvme")


@pytest.mark.parity
def test_fused_triton_copies_in_the_training_path(tmp_path, monkeypatch):
    """The fetch and gradient-offload paths through the Triton kernels (interpreted on CPU) train
    exactly like eager, gradient accumulation included."""
    pytest.importorskip("triton", reason="triton is a declared dependency; the Makefile installs it")
    from zinf_runtime import store

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("ZINF_FUSED_COPY", "1")
    before = dict(store.fused_copies)
    batches = [make_batch(CFG, 2, seed=i) for i in range(4)]
    run = train_pair(lambda: GPT(CFG), batches, opts("cpu", "cpu", tmp_path), accum=2)
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    assert store.fused_copies["gather_cast"] > before["gather_cast"]
    assert store.fused_copies["scatter_accumulate"] > before["scatter_accumulate"]  # 2nd micro-batch


def test_disk_full_during_optimizer_step_names_path_and_keeps_state(tmp_path):
    import errno

    from zinf_runtime.swap import SwapSpaceError

    torch.manual_seed(0)
    model = GPT(CFG)
    cm = torch.compile(model, backend="zinf", options=opts("cpu", "nvme", tmp_path))
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = make_batch(CFG, 2, seed=0)
    cm(x, y).backward(); opt.step(); opt.zero_grad()
    good = zinf_compile.full_state_dict(model)
    engine = zinf_runtime.handle_of(model.tok.weight).grad_slot.swap

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = engine._sys_pwritev
    engine._sys_pwritev = full
    try:
        cm(x, y).backward()
        with pytest.raises(SwapSpaceError, match=str(tmp_path)) as err:
            opt.step()
        assert "bytes" in str(err.value)
    finally:
        engine._sys_pwritev = real
    # the master weights read back are whole versions (old or, for sub-groups written before the
    # failure, new), never torn: every parameter equals either its value before or a finite update
    after = zinf_compile.full_state_dict(model)
    for k, v in good.items():
        assert torch.isfinite(after[k]).all(), k
    untouched = [k for k in good if torch.equal(after[k], good[k])]
    assert untouched, "the failed step left previously written state readable"


@pytest.mark.parity
def test_nvme_offload_through_inductor(tmp_path):
    from zinf_compile.models import MLP

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 16, generator=g),) for _ in range(3)]
    o = opts("nvme", "nvme", tmp_path)
    o["compiler"] = "inductor"
    run = train_pair(lambda: MLP(), batches, o, opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)  # Inductor reorders reductions
    assert_same_training(run, exact=False)


@pytest.mark.parity
def test_bf16_tiling_and_split_offload_tiers_combine(tmp_path):
    """Mixed precision + tiling + parameters on NVMe with the optimizer on CPU, against eager autocast.

    Tiling reorders fp32 accumulations that are then rounded to bf16, so a bf16 output can land on
    the neighbouring value: compared with the bound from bf16's unit roundoff (tests/conftest.py)."""
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    o = opts("nvme", "cpu", tmp_path, mixed_precision="bf16", tiles=2, tile_threshold_bytes=10_000)
    run = train_pair(lambda: GPT(CFG), batches, o, autocast=torch.bfloat16, opt="sgd", lr=0.05)
    assert_mixed_precision_matches_autocast(run, torch.bfloat16, lr=0.05, steps=3)
    rec = zinf_compile.compile_records()[-1]
    assert rec.counters["tiled_weights"] > 0 and rec.counters["gathered_in_compute_dtype"] > 0
