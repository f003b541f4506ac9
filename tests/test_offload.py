"""Offload tiers: every combination of offload_params x offload_optimizer trains like eager."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, GPTConfig, make_batch

from conftest import assert_same_training, train_pair

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
TIERS = ("none", "cpu", "nvme")


def opts(params, optim, path, **kw):
    return {"compiler": "eager", "offload_params": params, "offload_optimizer": optim, "nvme_path": str(path),
            "optimizer_sub_group_bytes": 64 << 10, **kw}


@pytest.mark.parametrize("params, optim", list(itertools.product(TIERS, TIERS)))
def test_all_offload_combinations_match_eager(params, optim, tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    rl, zl, ref, m = train_pair(lambda: GPT(CFG), batches, opts(params, optim, tmp_path))
    assert_same_training(rl, zl, ref, m)
    h = zinf_runtime.handle_of(m.blocks[0].fc.weight)
    want = {"none": "device", "cpu": "cpu", "nvme": "nvme"}
    assert (h.placement.tier, h.placement.master_tier) == (want[params], want[optim])
    assert h.master.tier == want[optim]
    nvme = zinf_compile.memory_stats()["nvme"]
    if "nvme" in (params, optim):
        assert nvme["param"]["current"] > 0
    if optim == "nvme":
        assert nvme["optim"]["current"] > 0  # Adam moments live on disk, not in optimizer.state
        assert len(h.optim_slots) == 2


def test_gradient_accumulation_with_nvme(tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(6)]
    rl, zl, ref, m = train_pair(lambda: GPT(CFG), batches, opts("nvme", "nvme", tmp_path), accum=2)
    assert_same_training(rl, zl, ref, m)


def test_nvme_streaming_uses_several_sub_groups(tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(2)]
    rl, zl, ref, m = train_pair(lambda: GPT(CFG), batches,
                                opts("cpu", "nvme", tmp_path, optimizer_sub_group_bytes=16 << 10))
    assert_same_training(rl, zl, ref, m)
    engine = zinf_runtime.handle_of(m.tok.weight).master.swap
    assert engine.stats()["reads"] > 0 and engine.stats()["writes"] > 0
    assert engine.dir.startswith(str(tmp_path)) and oct(os.stat(engine.dir).st_mode & 0o777) == "0o700"


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
