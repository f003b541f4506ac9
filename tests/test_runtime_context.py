"""One model's settings never leak into another's: budgets, accounting, swap engines and buffer
pools belong to the compiled model (its ``RuntimeContext``), and go away with it."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import torch.nn as nn

import zinf_compile
import zinf_runtime
from zinf_compile.models import MLP
from zinf_runtime import accounting, store, tiers
from zinf_runtime.accounting import ZinfOutOfMemoryError

W_BYTES = 64 * 512 * 4  # one Linear(64, 512) weight, fp32


@pytest.fixture(autouse=True)
def _strict_comm(monkeypatch):
    monkeypatch.setenv("ZINF_STRICT_COMM", "1")


def _two_linear() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 512, bias=False), nn.GELU(), nn.Linear(512, 64, bias=False))


def _untiled(budget):
    return {"compiler": "eager", "device_memory_budget": budget, "disabled_passes": ("plan_tiling",)}


def _process_currents() -> dict:
    return {(t, k): v["current"] for t, d in zinf_compile.memory_stats().items() for k, v in d.items()}


def test_two_models_keep_their_own_budgets():
    """B (no budget) is compiled and trained first, then A with a budget below one weight: A must
    refuse, and B must still train afterwards (a process-wide budget made the last compile win)."""
    torch.manual_seed(0)
    b, a = _two_linear(), _two_linear()
    ref_b = copy.deepcopy(b)
    cb = torch.compile(b, backend="zinf", options=_untiled(None))
    ca = torch.compile(a, backend="zinf", options=_untiled(W_BYTES // 2))
    opt_b = zinf_compile.optim.SGD(b.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref_b.parameters(), lr=0.1)
    x = torch.randn(4, 64)

    def step_b():
        cb(x).pow(2).mean().backward(); opt_b.step(); opt_b.zero_grad()
        ref_b(x).pow(2).mean().backward(); ropt.step(); ropt.zero_grad()

    step_b()
    with pytest.raises(ZinfOutOfMemoryError, match=rf"{W_BYTES} bytes.*device_memory_budget={W_BYTES // 2}"):
        ca(x)
    step_b()  # A's compile did not change B's budget
    with pytest.raises(ZinfOutOfMemoryError):
        ca(x)  # and B's runs did not change A's
    full = zinf_compile.full_state_dict(b)
    for k, v in ref_b.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-7)
    assert zinf_runtime.contexts_of(a)[0].device_memory_budget == W_BYTES // 2
    assert zinf_runtime.contexts_of(b)[0].device_memory_budget is None


def test_graphs_of_one_compile_share_one_context():
    """A graph break splits a model into two graphs; one torch.compile call: one context."""

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            x = self.l1(x)
            torch._dynamo.graph_break()
            return self.l2(x)

    m = Broken()
    cm = torch.compile(m, backend="zinf", options={"compiler": "eager", "device_memory_budget": 1 << 20})
    cm(torch.randn(2, 8)).sum().backward()
    assert len(zinf_compile.compile_records()) >= 2
    ctxs = zinf_runtime.contexts_of(m)
    assert len(ctxs) == 1 and ctxs[0].device_memory_budget == 1 << 20


def test_memory_stats_per_model_and_process_wide():
    gc.collect()
    base = zinf_compile.memory_stats()["device"]["param"]["current"]
    m1, m2 = MLP((16, 64, 8)), MLP((16, 32, 8))
    bytes1 = sum(p.numel() * 4 for p in m1.parameters())
    bytes2 = sum(p.numel() * 4 for p in m2.parameters())
    for m in (m1, m2):
        torch.compile(m, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 16)).sum().backward()
    assert zinf_compile.memory_stats(m1)["device"]["param"]["current"] == bytes1
    assert zinf_compile.memory_stats(m2)["device"]["param"]["current"] == bytes2
    assert zinf_compile.memory_stats(m1)["device"]["grad"]["current"] == bytes1
    assert zinf_compile.memory_stats()["device"]["param"]["current"] - base == bytes1 + bytes2
    # the per-model peak of gathered bytes is this model's own, not the process's
    zinf_compile.reset_peak_memory_stats()
    torch.compile(m2, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 16))
    assert zinf_compile.memory_stats(m1)["device"]["gathered"]["peak"] == 0
    # dp 1 in memory: m2's fetches read its shards in place, so it gathers nothing either (the
    # per-model gathered peak of a model that gathers: tests/test_features.py, NVMe parameters)
    assert zinf_compile.memory_stats(m2)["device"]["gathered"]["peak"] == 0


def test_compiled_tiled_model_is_freed_with_its_shards():
    """Deleting a compiled, tiled, trained model frees every handle, tile and slot: the store and
    the process-wide accounting are back where they started, the context is gone."""
    gc.collect()
    handles0, bytes0 = len(store.handles()), _process_currents()

    def build_and_train():
        m = MLP((16, 64, 8))
        cm = torch.compile(m, backend="zinf", options={"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 1000})
        opt = zinf_compile.optim.SGD(m.parameters(), lr=0.1)  # plain SGD: no optimizer state
        cm(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step(); opt.zero_grad()
        cm(torch.randn(4, 16)).pow(2).mean().backward()  # leave gradient shards allocated
        h = zinf_runtime.handle_of(m.layers[0].weight)
        assert h.tiles is not None and len(h.tiles) == 3
        assert len(store.handles()) > handles0
        return weakref.ref(m), weakref.ref(zinf_runtime.contexts_of(m)[0])

    model_ref, ctx_ref = build_and_train()  # Dynamo's cache still holds the compiled graphs
    gc.collect()
    assert model_ref() is None
    assert len(store.handles()) == handles0
    assert ctx_ref() is None
    assert _process_currents() == bytes0


def test_swap_folder_removed_when_model_deleted(tmp_path):
    def build_and_train():
        m = MLP((16, 64, 8))
        cm = torch.compile(m, backend="zinf", options={
            "compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)})
        opt = zinf_compile.optim.AdamW(m.parameters(), lr=1e-2)
        cm(torch.randn(4, 16)).sum().backward()
        opt.step(); opt.zero_grad()
        (eng,) = zinf_runtime.contexts_of(m)[0].engines()
        assert os.path.isdir(eng.dir) and os.listdir(eng.dir)
        return eng.dir

    folder = build_and_train()
    gc.collect()
    assert not os.path.exists(folder)
    assert not [d for d in os.listdir(tmp_path) if d.startswith("zinf-")]


def test_swap_folders_removed_at_interpreter_exit(tmp_path):
    """A process that exits while its model (and writes) are alive leaves no swap folder behind."""
    script = textwrap.dedent(f"""
        import os, sys, torch, zinf_compile
        from zinf_compile.models import MLP
        model = MLP((16, 64, 8))
        cm = torch.compile(model, backend="zinf", options={{"compiler": "eager", "offload_params": "nvme",
            "offload_optimizer": "nvme", "nvme_path": {str(tmp_path)!r}}})
        opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-2)
        cm(torch.randn(4, 16)).sum().backward()
        opt.step()
        cm(torch.randn(4, 16)).sum().backward()  # gradient writes may still be in flight at exit
        print(sorted(d for d in os.listdir({str(tmp_path)!r}) if d.startswith("zinf-")))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zinf-" in proc.stdout  # the folder existed while the process ran
    assert not [d for d in os.listdir(tmp_path) if d.startswith("zinf-")]


def test_mmap_threshold_changed_only_by_option(tmp_path, monkeypatch):
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(tiers.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.setattr(tiers, "_malloc_threshold", None)
    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}
    m = MLP((16, 32, 8))
    torch.compile(m, backend="zinf", options=opts)(torch.randn(2, 16)).sum().backward()
    assert calls == []  # NVMe offload alone leaves glibc alone
    m = MLP((16, 32, 8))
    torch.compile(m, backend="zinf", options={**opts, "malloc_mmap_threshold": 1 << 20})(torch.randn(2, 16))
    assert calls == [(-3, 1 << 20)]  # M_MMAP_THRESHOLD


@pytest.mark.parametrize("value", [0, -1, 64 << 20, True, "1MiB", 1.5])
def test_mmap_threshold_option_validated(value):
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        zinf_compile.Config(malloc_mmap_threshold=value)


def test_pools_and_write_trackers_are_per_model(tmp_path):
    opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)}
    models = [MLP((16, 32, 8)), MLP((16, 32, 8))]
    for m in models:
        torch.compile(m, backend="zinf", options=dict(opts))(torch.randn(2, 16)).sum().backward()
    (c1,), (c2,) = (zinf_runtime.contexts_of(m) for m in models)
    assert c1 is not c2 and c1.pool is not c2.pool and c1.writes is not c2.writes
    (e1,), (e2,) = c1.engines(), c2.engines()
    assert e1 is not e2 and e1.dir != e2.dir
    s1 = zinf_runtime.handle_of(models[0].layers[0].weight).master
    assert s1.pool is c1.pool and s1.swap is e1 and s1.accounting is c1.accounting


def test_default_context_budget_is_separate_from_compiled_models():
    """``accounting.set_device_memory_budget`` only sets the default context's budget (direct
    runtime users); a compiled model keeps its own."""
    accounting.set_device_memory_budget(16)
    try:
        m = MLP((16, 64, 8))
        torch.compile(m, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 16)).sum().backward()
        p = nn.Parameter(torch.randn(64))
        zinf_runtime.partition([("direct", p)], zinf_runtime.Placement(tier="device", compute_device=torch.device("cpu")))
        with pytest.raises(ZinfOutOfMemoryError):
            zinf_runtime.handle_of(p).fetch_shard(torch.float32)
    finally:
        accounting.set_device_memory_budget(None)


def test_add_kinds_books_like_one_add_per_kind_in_every_parent() -> None:
    """``add_kinds`` (the runtime's hot path) must leave exactly what per-kind ``add`` calls leave:
    current and peak bytes per kind, in the accounting and in its parent, and refuse unknown kinds."""
    from zinf_runtime import accounting

    ref_parent, ref = accounting.Accounting(name="ref parent"), None
    ref = accounting.Accounting(parent=ref_parent, name="ref")
    new_parent = accounting.Accounting(name="new parent")
    new = accounting.Accounting(parent=new_parent, name="new")
    for nbytes in (100, 50, -120, 30, -60):
        for kind in ("grad_buffer", "materialized"):
            ref.add("device", kind, nbytes)
        new.add_kinds("device", ("grad_buffer", "materialized"), nbytes)
    assert new.stats() == ref.stats() and new_parent.stats() == ref_parent.stats()
    for acc in (new, new_parent):
        for kind in ("grad_buffer", "materialized"):
            assert acc.stats()["device"][kind] == {"current": 0, "peak": 150}, (acc.name, kind)
    with pytest.raises(ValueError, match="unknown memory tier/kind"):
        new.add_kinds("device", ("grad_buffer", "bogus"), 1)
    assert new.current("device", "grad_buffer") == 0  # refused before booking anything
