"""Memory-centric tiling: oversized matmuls become tile loops, each tile fetched and released alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zinf_compile
from zinf_compile.models import GPT, MLP, GPTConfig, make_batch
from zinf_runtime.accounting import ZinfOutOfMemoryError

from conftest import assert_grads_within_reduction_bound, assert_same_training, train_pair

# Tiling splits each matmul, so the order of its reductions (and the kernel's blocking) changes:
# gradients are held to the fp32 summation bound, parameters compared after SGD steps (tests/conftest.py).
CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)


def gpt_batches(n, batch=4):
    return [make_batch(CFG, batch, seed=i) for i in range(n)]


def final_counts(stage):
    snap = zinf_compile.compile_records()[-1].final(stage)
    return snap.op_counts


@pytest.mark.parity
@pytest.mark.parametrize("tiles", [2, 4, 7])
def test_gpt_tiled_matches_eager(tiles):
    # qkv (12 KiB), fc and out (16 KiB each) are over the threshold; proj (4 KiB) is not;
    # the tied embedding/LM head is used by an embedding lookup, so it stays whole.
    opts = {"compiler": "eager", "tiles": tiles, "tile_threshold_bytes": 10_000}
    # SGD, not Adam: rows of absent tokens get LM-head gradients of ~1e-6 that are sums of ~1e-2
    # terms; tiling reorders rounding upstream (~1e-9), which Adam's m/sqrt(v) turns into ±lr updates
    run = train_pair(lambda: GPT(CFG), gpt_batches(3), opts, opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)
    rec = zinf_compile.compile_records()[-1]
    assert rec.counters["tiled_weights"] == 3 * CFG.layers
    assert rec.counters["tiles_planned"] == 3 * CFG.layers * tiles
    plans = {z["param"] for s in rec.graphs("dynamo") for z in s.zinf_nodes if z["kind"] == "tile_plan"}
    assert "tok.weight" not in plans and "blocks.0.proj.weight" not in plans and "blocks.1.fc.weight" in plans


@pytest.mark.parity
def test_gpt_tiled_without_bias_inductor():
    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, mlp_bias=False)
    batches = [make_batch(cfg, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(cfg), batches, {"tiles": 3, "tile_threshold_bytes": 10_000}, opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)
    assert zinf_compile.compile_records()[-1].counters["tiled_weights"] == 3 * cfg.layers


@pytest.mark.parity
def test_only_the_large_matmul_tiles():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 16, generator=g),) for _ in range(3)]
    # 16x8 weight (512 B) stays whole, 8x64 (2 KiB) is tiled
    run = train_pair(lambda: MLP((16, 8, 64)), batches, {"compiler": "eager", "tiles": 4, "tile_threshold_bytes": 1000},
                     opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)
    rec = zinf_compile.compile_records()[-1]
    assert rec.counters["tiled_weights"] == 1 and rec.counters["tiles_planned"] == 4
    plans = [z for s in rec.graphs("dynamo") for z in s.zinf_nodes if z["kind"] == "tile_plan"]
    assert {p["param"] for p in plans} == {"layers.1.weight"}


@pytest.mark.parametrize("opts", [{"tiles": 1, "tile_threshold_bytes": 0}, {"tiles": 4}])
def test_t1_and_sub_threshold_leave_graphs_unchanged(opts):
    x = torch.randn(4, 16)
    counts = []
    for o in ({}, opts):
        torch._dynamo.reset()
        model = MLP()
        torch.compile(model, backend="zinf", options={"compiler": "eager", **o})(x).sum().backward()
        rec = zinf_compile.compile_records()[-1]
        assert rec.counters["tiled_weights"] == 0
        counts.append((final_counts("forward"), final_counts("backward")))
    assert counts[0] == counts[1]


class MatmulForms(nn.Module):
    """Weights used as addmm(b, x, W), x @ W, mm(x, W.t()), linear(x, W.T), and a batched bmm weight."""

    def __init__(self):
        super().__init__()
        self.e = nn.Parameter(torch.randn(16, 16) * 0.2)   # addmm(bias, x, e): tiles along dim 1
        self.e_bias = nn.Parameter(torch.randn(16) * 0.1)
        self.a = nn.Parameter(torch.randn(16, 24) * 0.2)   # x @ a: tiles along dim 1
        self.b = nn.Parameter(torch.randn(20, 24) * 0.2)   # mm(h, b.t()): tiles along dim 0
        self.c = nn.Parameter(torch.randn(20, 12) * 0.2)   # linear(h, c.T): tiles along dim 1
        self.d = nn.Parameter(torch.randn(2, 12, 10) * 0.2)  # bmm(h, d): tiles along dim 2

    def forward(self, x):
        x = torch.tanh(torch.addmm(self.e_bias, x, self.e))
        h = torch.tanh(x @ self.a)
        h = torch.tanh(torch.mm(h, self.b.t()))
        h = torch.tanh(F.linear(h, self.c.T))
        return torch.bmm(h.unsqueeze(0).expand(2, -1, -1), self.d)


@pytest.mark.parity
def test_matmul_forms():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 16, generator=g),) for _ in range(3)]
    run = train_pair(MatmulForms, batches, {"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 0},
                     opt="sgd", lr=0.1)
    assert_grads_within_reduction_bound(run)
    assert_same_training(run, exact=False)
    plans = {z["param"]: z for s in zinf_compile.compile_records()[-1].graphs("dynamo")
             for z in s.zinf_nodes if z["kind"] == "tile_plan"}
    assert {k: v["dim"] for k, v in plans.items()} == {"e": 1, "a": 1, "b": 0, "c": 1, "d": 2}


@pytest.mark.parametrize("depths,ahead", [((0, 0, 0), 0), ((3, 2, 1), 2)], ids=["serial", "lookahead"])
def test_each_tile_is_its_own_unit_and_working_memory_shrinks(depths, ahead, tmp_path):
    peaks = {}
    for tiles in (1, 4):
        torch._dynamo.reset()
        torch.manual_seed(0)
        lin = nn.Linear(32, 256, bias=False)
        # the weight on NVMe, so each tile's fetch is a buffer of its own (in memory at dp 1 it is read in place)
        cm = torch.compile(lin, backend="zinf", options={"compiler": "eager", "tiles": tiles, "tile_threshold_bytes": 0,
                                                         "prefetch_depths": depths, "offload_params": "nvme",
                                                         "nvme_path": str(tmp_path)})
        zinf_compile.reset_peak_memory_stats()
        base = zinf_compile.memory_stats()["device"]["gathered"]["current"]
        cm(torch.randn(8, 32)).sum().backward()
        peaks[tiles] = zinf_compile.memory_stats()["device"]["gathered"]["peak"] - base
        if tiles == 4:
            h = zinf_compile.compile_records()[-1]
            tile_inputs = [z for s in h.graphs("dynamo") for z in s.zinf_nodes if z["kind"] == "tile_input"]
            assert len(tile_inputs) == 4
            from zinf_runtime import handle_of
            units = handle_of(lin.weight).units()
            assert [u.numel for u in units] == [64 * 32] * 4
            assert all(u.grad is not None and u.grad.numel() == 64 * 32 for u in units)
    assert peaks[1] == 256 * 32 * 4
    # one tile at a time in forward and backward, plus the tiles uploaded ahead of their use (the
    # upload depth: the device buffer exists from the upload's start)
    assert peaks[4] == (1 + ahead) * 64 * 32 * 4


def test_budget_chooses_tiles_and_runtime_refuses_to_exceed_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512, bias=False), nn.GELU(), nn.Linear(512, 64, bias=False))
    w_bytes = 64 * 512 * 4  # 128 KiB each
    budget = 96 * 1024
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "device_memory_budget": budget})
    cm(torch.randn(4, 64)).sum().backward()
    rec = zinf_compile.compile_records()[-1]
    # weight tile + gradient tile within half the budget: 2 * 128 KiB / T <= 48 KiB -> T = 6
    assert rec.counters["tiles_planned"] == 12
    assert zinf_compile.memory_stats()["device"]["gathered"]["peak"] <= budget

    torch._dynamo.reset()
    torch.manual_seed(0)
    untiled = nn.Sequential(nn.Linear(64, 512, bias=False))
    cm = torch.compile(untiled, backend="zinf", options={
        "compiler": "eager", "device_memory_budget": budget, "tile_threshold_bytes": 1 << 30,
        "disabled_passes": ("plan_tiling",)})
    base = zinf_compile.memory_stats()["device"]["gathered"]["current"]
    try:
        with pytest.raises(ZinfOutOfMemoryError, match=rf"0\.weight.*{w_bytes} bytes.*device_memory_budget={budget}"):
            cm(torch.randn(4, 64))
    finally:
        zinf_runtime_budget_reset()
    import gc

    gc.collect()  # buffers of the failed step are gone, and so is their accounting
    assert zinf_compile.memory_stats()["device"]["gathered"]["current"] == base


def zinf_runtime_budget_reset():
    from zinf_runtime.accounting import set_device_memory_budget

    set_device_memory_budget(None)


@pytest.mark.parity
def test_tiled_weight_used_whole_in_a_later_graph():
    """Tiled in the training graph, then read whole by eval and by full_state_dict."""
    torch.manual_seed(0)
    model = MLP((16, 64, 8))
    ref = MLP((16, 64, 8))
    ref.load_state_dict(model.state_dict())
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 1000})
    x = torch.randn(4, 16)
    torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-6)
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v)
    with zinf_compile.gathered(model):
        torch.testing.assert_close(model.layers[0].weight, ref.layers[0].weight)


def test_the_store_is_re_laid_by_the_backend_not_by_the_pass(monkeypatch):
    """tile_matmul only rewrites the graph: without the backend's relayout step between plan_tiling and
    it, it finds the weight whole and the graph falls back (with a warning naming why), untiled."""
    import zinf_compile.backend as backend
    import zinf_runtime

    calls = []
    monkeypatch.setattr(backend, "relayout_tiles", lambda gm: calls.append(gm))
    torch.manual_seed(0)
    model = MLP((16, 8, 64))
    cmodel = torch.compile(model, backend="zinf",
                           options={"compiler": "eager", "tiles": 4, "tile_threshold_bytes": 1000})
    with pytest.warns(UserWarning, match="gather-all fallback.*not re-laid as planned"):
        cmodel(torch.randn(6, 16)).sum().backward()
    assert len(calls) == 1
    assert all(zinf_runtime.handle_of(p).tiles is None for p in model.parameters())
