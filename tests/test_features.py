"""Options, mixed precision, memory release, graphs, eager access to parameters, misuse errors."""

from __future__ import annotations

import copy

import pytest
import torch

import zinf_compile
import zinf_runtime
from zinf_compile.models import GPT, MLP, GPTConfig, make_batch

from conftest import assert_grads_equal, assert_same_training, train_pair

SMALL = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


@pytest.mark.parametrize("options, key", [
    ({"offload_parms": "cpu"}, "offload_parms"),
    ({"offload_params": "disk"}, "offload_params"),
    ({"mixed_precision": "fp8"}, "mixed_precision"),
    ({"compiler": "aot_eager"}, "compiler"),
    ({"sync_module_states": "yes"}, "sync_module_states"),
    ({"disabled_passes": ("keep_alive", "keepalive")}, "disabled_passes"),  # a typo would be ignored
])
def test_bad_option_names_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        zinf_compile.Config.from_options(options)
    model = MLP()
    cm = torch.compile(model, backend="zinf", options=options)
    with pytest.raises(Exception, match=key):
        cm(torch.randn(2, 16))
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # nothing partitioned


def test_bad_value_lists_choices():
    with pytest.raises(ValueError, match=r"'cpu'"):
        zinf_compile.Config(offload_params="gpu")


def test_entry_point_backend_is_registered():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "zinf" in list_backends(exclude_tags=())
    assert lookup_backend("zinf") is zinf_compile.zinf_backend


@pytest.mark.parity
def test_bf16_matches_eager_autocast():
    """The autocast pass traces the casts eager autocast makes, the bf16 all-gather rounds each weight
    as autocast's cast does (round to nearest even), and eager graphs keep eager's op order: so zinf
    under bf16 is bitwise eager under torch.autocast (tiled bf16, where it cannot be, is held to a
    bound from bf16's unit roundoff: tests/test_offload.py)."""
    batches = [make_batch(SMALL, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(SMALL), batches, {"compiler": "eager", "mixed_precision": "bf16"},
                     autocast=torch.bfloat16, opt="sgd", lr=0.05)
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    full = zinf_compile.full_state_dict(run.model)
    assert all(v.dtype == torch.float32 for v in full.values())  # fp32 master weights
    rec = zinf_compile.compile_records()[-1]
    assert rec.counters["gathered_in_compute_dtype"] > 0  # linear weights all-gathered in bf16
    fwd = rec.final("forward")
    # dp = 1 without offload: nothing moves, so the fetch stays one op (not a start and a wait) and
    # reads the cached bf16 copy in place
    assert "torch.bfloat16" in fwd.code and "zinf.fetch_shard" in fwd.code and "zinf.wait_upload" not in fwd.code
    assert rec.counters["fetch_in_place"] > 0


def test_graphs_hold_zinf_nodes_and_gathered_peak_is_bounded(tmp_path):
    """Parameters on NVMe, so every fetch moves bytes into a buffer of its own (at dp = 1 in memory a
    fetch reads the shard in place: test_dp1_in_memory_fetches_read_in_place)."""
    cfg = GPTConfig(vocab=64, seq=16, layers=6, hidden=64, heads=4)
    model = GPT(cfg)
    total = sum(p.numel() * 4 for p in model.parameters())
    emb = model.tok.weight.numel() * 4 + model.pos.weight.numel() * 4
    assert emb <= 0.15 * total
    # every parameter on NVMe (norms and biases too, nvme_min_shard_bytes=0): each fetch is an upload
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_params": "nvme",
                                                       "nvme_path": str(tmp_path), "nvme_min_shard_bytes": 0})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = make_batch(cfg, 2, seed=0)
    cm(x, y).backward(); opt.step(); opt.zero_grad()  # compile
    zinf_compile.reset_peak_memory_stats()
    base = zinf_compile.memory_stats()["device"]["gathered"]["current"]  # other tests' leftovers
    cm(x, y).backward(); opt.step(); opt.zero_grad()
    gathered = zinf_compile.memory_stats()["device"]["gathered"]
    assert gathered["current"] == base
    assert 0 < gathered["peak"] - base <= 0.40 * total, (gathered, base, total)
    snaps = zinf_compile.last_graphs()
    fwd = [s for s in snaps if s.stage == "forward"][-1]
    bwd = [s for s in snaps if s.stage == "backward"][-1]
    n_params = len(list(model.parameters()))
    # scheduled: each fetch is a read + upload start + wait; the gradients stay on the device (the
    # optimizer's tier), so each reduction is one op
    assert fwd.count("zinf.load") == fwd.count("zinf.wait_upload") == n_params
    assert fwd.count("zinf.release") == n_params
    assert bwd.count("zinf.reduce_grad") == n_params and bwd.count("zinf.wait_offload") == 0
    assert bwd.count("zinf.wait_upload") == bwd.count("zinf.release") > 0
    # the forward saves no gathered parameter for backward: only 0-byte placeholders
    assert zinf_compile.compile_records()[-1].counters["gathered_escaped"] == 0


def test_dp1_in_memory_fetches_read_in_place():
    """dp = 1, parameters in the compute device's memory: a fetch hands out the shard itself (no
    copy, no gathered bytes), the graph keeps one op per fetch and per gradient (nothing to
    overlap), a release frees nothing, and the numbers are eager's (test_parity runs this setting)."""
    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    x, y = make_batch(cfg, 2, seed=0)
    zinf_compile.reset_peak_memory_stats()
    base = zinf_compile.memory_stats()["device"]["gathered"]["current"]
    cm(x, y).backward()
    ref(x, y).backward()
    assert zinf_compile.memory_stats()["device"]["gathered"]["peak"] == base  # nothing was gathered
    rec = zinf_compile.compile_records()[-1]
    n_params = len(list(model.parameters()))
    assert rec.counters["fetch_in_place"] > 0 and rec.counters["reduce_in_place"] == n_params
    for stage in ("forward", "backward"):
        code = rec.final(stage).code
        assert "zinf.upload" not in code and "zinf.wait_upload" not in code and "zinf.reduce.default" not in code
    assert rec.final("forward").code.count("zinf.fetch_shard") == n_params
    full = zinf_compile.full_state_dict(model)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        h = zinf_runtime.handle_of(p)
        assert h.reads_in_place(), name
        assert h.master.resident().untyped_storage().nbytes() > 0  # the releases freed nothing
        assert torch.equal(full[name], q.detach()), name
        # eager graphs keep eager's op order: bitwise (tests/conftest.py assert_grads_equal)
        assert torch.equal(h.grad_values().view(p.shape), q.grad), name


@pytest.mark.slow  # CI time (54 s of Inductor compile); test_graphs_hold_zinf_nodes_and_gathered_peak_is_bounded
def test_inductor_releases_every_gathered_parameter(tmp_path):  # checks the releases in the eager graphs
    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)
    model = GPT(cfg)
    # on NVMe, so each fetch has a buffer of its own to release (in memory at dp 1 it reads in place)
    cm = torch.compile(model, backend="zinf", options={"offload_params": "nvme", "nvme_path": str(tmp_path)})
    x, y = make_batch(cfg, 2, seed=0)
    zinf_compile.reset_peak_memory_stats()
    base = zinf_compile.memory_stats()["device"]["gathered"]["current"]
    cm(x, y).backward()
    stats = zinf_compile.memory_stats()["device"]["gathered"]
    assert stats["current"] == base and stats["peak"] > base


@pytest.mark.parity
def test_eval_no_grad_and_train_switch():
    torch.manual_seed(0)
    ref = GPT(SMALL)
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    x, y = make_batch(SMALL, 2, seed=1)
    model.eval(); ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-6)
    model.train(); ref.train()
    torch.testing.assert_close(cm(x, y), ref(x, y), rtol=1e-5, atol=1e-6)
    assert any(s.stage == "inference" for s in zinf_compile.last_graphs(all_graphs=True))


def test_gathered_reads_and_writes_back():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    x = torch.randn(3, 16)
    cm(x)
    with zinf_compile.gathered(model):
        torch.testing.assert_close(model.layers[0].weight, ref.layers[0].weight)
        with torch.no_grad():
            model.layers[0].weight.mul_(2.0)
            ref.layers[0].weight.mul_(2.0)
    assert model.layers[0].weight.untyped_storage().nbytes() == 0
    torch.testing.assert_close(cm(x), ref(x), rtol=1e-5, atol=1e-6)
    full = zinf_compile.full_state_dict(model)
    assert set(full) == set(ref.state_dict())
    torch.testing.assert_close(full["layers.0.weight"], ref.layers[0].weight)


def test_plain_torch_optimizer_on_partitioned_params_steps_the_shards():
    # it used to raise; any elementwise torch.optim optimizer now steps zinf's shards unchanged
    # (tests/test_any_optimizer.py covers every one); here: the same numbers as eager, exactly
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    x = torch.randn(2, 16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    for m, opt in ((ref, opts[0]), (cm, opts[1])):
        m(x).sum().backward()
        opt.step()
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k


def test_clip_grad_norm_matches_torch():
    batches = [(torch.randn(4, 16),)]
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = zinf_compile.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cm(*batches[0]).pow(2).mean().backward()
    ref(*batches[0]).pow(2).mean().backward()
    n = opt.clip_grad_norm_(0.01)
    rn = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.testing.assert_close(n, rn, rtol=1e-5, atol=1e-7)
    opt.step(); ropt.step()
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)


def test_optimizer_state_dict_and_state_accounting():
    import gc

    gc.collect()  # handles of earlier tests' models are freed (and unaccounted) now, not mid-test
    before = zinf_compile.memory_stats()["device"]
    model = MLP()
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager"})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    cm(torch.randn(2, 16)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert len(sd["state"]) == len(list(model.parameters()))
    assert all("exp_avg" in s for s in sd["state"].values())
    after = zinf_compile.memory_stats()["device"]
    params = after["param"]["current"] - before["param"]["current"]
    optim = after["optim"]["current"] - before["optim"]["current"]
    n = len(list(model.parameters()))  # exp_avg + exp_avg_sq in fp32, plus a 4-byte step per parameter
    assert params == sum(p.numel() * 4 for p in model.parameters())
    assert optim == 2 * params + 4 * n
    opt.step()  # a second step adds nothing: state is re-counted, not re-added
    assert zinf_compile.memory_stats()["device"]["optim"]["current"] - before["optim"]["current"] == optim


@pytest.mark.parity
@pytest.mark.parametrize("options", [{"compiler": "eager"},
                                     {"compiler": "eager", "tiles": 3, "tile_threshold_bytes": 1000}])
def test_two_instances_of_one_class_share_compiled_graphs_correctly(options):
    """Dynamo reuses one compiled graph for every instance of a class: each instance must still
    train its own parameters (the runtime resolves the tensors actually passed)."""
    torch.manual_seed(0)
    models = [MLP((16, 64, 8)), MLP((16, 64, 8))]
    refs = [copy.deepcopy(m) for m in models]
    compiled = [torch.compile(m, backend="zinf", options=options) for m in models]
    opts = [zinf_compile.optim.SGD(m.parameters(), lr=0.1) for m in models]
    ropts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    for step in range(2):
        x = torch.randn(4, 16)
        for cm, ref, opt, ropt in zip(compiled, refs, opts, ropts):
            out, want = cm(x), ref(x)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
            out.pow(2).mean().backward(); want.pow(2).mean().backward()
            opt.step(); opt.zero_grad(); ropt.step(); ropt.zero_grad()
    for m, ref in zip(models, refs):
        full = zinf_compile.full_state_dict(m)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)


def test_partitioned_parameter_prints_copies_and_pickles_safely():
    import io
    import pickle

    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    torch.compile(model, backend="zinf", options={"compiler": "eager"})(torch.randn(2, 16))
    w = model.layers[0].weight
    assert w.untyped_storage().nbytes() == 0
    text = repr(w)
    assert "PartitionedParameter" in text and "layers.0.weight" in text and "gathered" in text
    clone = copy.deepcopy(model)  # a plain, full copy: not tied to the original's shards
    assert type(clone.layers[0].weight) is torch.nn.Parameter
    assert not hasattr(clone.layers[0].weight, "_zinf_uid")
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(clone.state_dict()[k], v)
    buf = io.BytesIO()
    torch.save(model.layers[0].weight, buf)
    buf.seek(0)
    torch.testing.assert_close(torch.load(buf, weights_only=False), ref.layers[0].weight)
    assert pickle.loads(pickle.dumps(w)).untyped_storage().nbytes() == w.numel() * 4


def test_torch_logs_zinf_alias_from_the_environment():
    """``TORCH_LOGS="+zinf_compile"`` logs each pass on every torch; the alias ``+zinf`` too where torch
    loads the ``torch.backends`` entry points before it parses ``TORCH_LOGS`` (2.13; 2.11 parses first)."""
    import subprocess
    import sys

    code = ("import torch, zinf_compile\n"
            "m = torch.nn.Linear(4, 4)\n"
            "torch.compile(m, backend='zinf', options={'compiler': 'eager'})(torch.randn(2, 4)).sum().backward()\n")
    settings = ["+zinf_compile"]
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):
        settings.append("+zinf")
    for setting in settings:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env={**__import__("os").environ, "TORCH_LOGS": setting})
        assert proc.returncode == 0, (setting, proc.stderr[-3000:])
        assert "zinf: forward pass insert_release took" in proc.stderr, setting


def test_dump_dir_holds_every_graph_and_the_memory_plan(tmp_path):
    import json as _json
    import os

    model = MLP()
    torch.compile(model, backend="zinf", options={"compiler": "eager", "dump_dir": str(tmp_path)})(
        torch.randn(2, 16)).sum().backward()
    folders = [f for f in os.listdir(tmp_path) if f.startswith("graph_")]
    assert len(folders) == 1
    folder = tmp_path / folders[0]
    index = _json.loads((folder / "index.json").read_text())
    stages = {(g["stage"], g["pass"]) for g in index["graphs"]}
    assert ("forward", "insert_release") in stages and ("backward", "reduce_grad") in stages
    code = (folder / next(g["file"] for g in index["graphs"] if g["pass"] == "insert_release")).read_text()
    # dp = 1 in memory: each fetch reads its shard in place, so there is nothing to release
    assert "torch.ops.zinf.fetch_shard.default" in code and "torch.ops.zinf.release.default" not in code
    plan = _json.loads((folder / "plan.json").read_text())
    assert plan["peaks"]["device"]["kinds"]["param"] > 0
    assert plan["peaks"]["device"]["kinds"]["gathered"] == 0  # dp = 1 in memory: fetches read in place


@pytest.mark.parity
def test_batchnorm_buffers_are_mutated_like_eager():
    """Running statistics (buffers mutated in the graph) come before the gradients among the joint
    graph's outputs: zinf must still find each parameter's gradient."""
    import torch.nn as nn

    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g),) for _ in range(3)]
    run = train_pair(make, batches, {"compiler": "eager"}, opt="sgd", lr=0.1)
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    assert torch.equal(run.model[1].running_var, run.ref[1].running_var)


@pytest.mark.parity
def test_cnn_with_batchnorm_and_dropout_trains_like_eager(tmp_path):
    """A CNN: 4-D convolution weights, BatchNorm2d running statistics, and dropout that draws masks.
    With eager graphs zinf runs eager's aten ops in eager's order and draws no random numbers of its
    own, so from the same seed the masks are eager's and so is the whole training, bitwise (SGD with
    momentum, parameters in CPU memory, optimizer state on NVMe, ``fullgraph=True``)."""
    import torch.nn as nn
    import torch.nn.functional as F

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 16, 3, stride=2), nn.BatchNorm2d(16)
            self.drop, self.fc = nn.Dropout(0.2), nn.Linear(16 * 7 * 7, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))))
            return F.cross_entropy(self.fc(self.drop(x.flatten(1))), y)

    torch.manual_seed(0)
    ref = CNN()
    model = copy.deepcopy(ref)
    cm = torch.compile(model, backend="zinf", fullgraph=True, options={
        "compiler": "eager", "offload_params": "cpu", "offload_optimizer": "nvme", "nvme_path": str(tmp_path)})
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    zopt = zinf_compile.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
        losses = []
        for run, opt in ((ref, ropt), (cm, zopt)):
            torch.manual_seed(100 + step)  # the same dropout masks, if both draw alike
            loss = run(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    full = zinf_compile.full_state_dict(model)
    for k, v in ref.state_dict().items():  # parameters and running statistics
        assert torch.equal(v, full[k]), k
    drop_off = copy.deepcopy(ref)
    drop_off.drop.p = 0.0  # the masks mattered: without them the loss differs
    torch.manual_seed(0)
    assert drop_off(x, y).item() != ref(x, y).item()


def test_dump_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ZINF_DUMP_DIR", str(tmp_path))
    assert zinf_compile.Config().dump_dir == str(tmp_path)
    assert zinf_compile.Config.from_options({"dump_dir": None}).dump_dir is None  # an explicit option wins
