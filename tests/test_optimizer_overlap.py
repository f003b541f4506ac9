"""The optimizer overlapped with backward (``zinf_runtime.optim_overlap``): exact, or rolled back.

Each test trains the same model from the same data twice (or three times) with zinf: once with the
optimizer stepped after backward (``optimizer_prefetch=False, overlap_optimizer_step=False``), once
with the feature under test. Same kernels on the same values, so parameters must be *bitwise* equal
(``torch.equal``): no tolerance. The counters of the overlap object say which path ran (committed,
rolled back, prefetched and consumed), so a test cannot pass by never overlapping.
"""

from __future__ import annotations

import json

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
import zinf_runtime
from zinf_runtime import optim_overlap

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, init_std=None)
PLAIN = dict(optimizer_prefetch=False, overlap_optimizer_step=False)
OVERLAP = dict(optimizer_prefetch=True, overlap_optimizer_step=True)
PREFETCH = dict(optimizer_prefetch=True, overlap_optimizer_step=False)
OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
}


def train(tier, tmp_path, features, make_opt=OPTIMIZERS["AdamW"], steps=3, accum=1, clip=None,
          between=None, extra=None, model=None):
    """Train with zinf; ``between(opt, i)`` runs after backward, before the step. Returns the full
    parameters, the overlap's counters and the optimizer."""
    torch.manual_seed(0)
    model = model if model is not None else GPT(CFG)
    # "cpunvme": parameters in CPU memory, optimizer on NVMe; the master is the CPU copy (store.master_home)
    params, optim = ("cpu", "nvme") if tier == "cpunvme" else (tier, tier)
    opts = {"compiler": "eager", "offload_params": params, "offload_optimizer": optim, **features, **(extra or {})}
    if optim == "nvme":
        folder = tmp_path / f"nvme{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        opts["nvme_path"] = str(folder)
    cmodel = torch.compile(model, backend="zinf", options=opts)
    opt = make_opt(model.parameters())
    for i in range(steps * accum):
        (cmodel(*make_batch(CFG, 4, seed=i)) / accum).backward()
        if (i + 1) % accum:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if between is not None:
            between(opt, i // accum)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ov = optim_overlap.of(opt)
    return zinf_compile.full_state_dict(model), dict(ov.stats), opt


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max().item():.3g}"


@pytest.mark.parametrize("tier", ["cpu", "nvme", "cpunvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_overlapped_step_is_bitwise_the_plain_step(tier, name, tmp_path):
    ref, _, _ = train(tier, tmp_path, PLAIN, OPTIMIZERS[name])
    got, stats, _ = train(tier, tmp_path, OVERLAP, OPTIMIZERS[name])
    assert_bitwise(got, ref)
    # steps 2 and 3 (the optimizer is known after step 1): every unit committed, none rolled back
    assert stats.get("committed", 0) > 0 and not stats.get("rolled_back"), stats


def test_overlapped_nvme_steps_overwrite_their_swap_files(tmp_path):
    """Shadows alternate between two keys per state and dropped ones keep their file, so once every
    key has its file, a step creates no file (the same inodes: every write overwrites, nvme_reuse_files)."""
    seen = []

    def inodes(opt, i):
        seen.append({(f.name, f.stat().st_ino) for f in tmp_path.rglob("k_*")})

    ref, _, _ = train("nvme", tmp_path, PLAIN, steps=6)
    got, stats, _ = train("nvme", tmp_path, OVERLAP, steps=6, between=inodes)
    assert_bitwise(got, ref)
    assert stats.get("committed", 0) > 0 and not stats.get("rolled_back"), stats
    assert seen[3] == seen[4] == seen[5], [len(x) for x in seen]


def test_committed_nvme_masters_join_the_models_context_and_read_cache(tmp_path):
    """A committed shadow becomes the unit's slot in the model's context, and a shadow master's
    written value is the model's read cache's copy: the next forward reads no parameter file, as
    after the plain step (which keeps the stepped masters in memory). Before, committed shadows kept
    a private context with the cache off, and every forward and backward read every master from
    disk again (on the 70M GPT of ``benchmarks/overlap.py``: 1341 against 981 MiB read a step)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opts = dict(compiler="eager", offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path), **OVERLAP)
    cmodel = torch.compile(model, backend="zinf", options=opts)
    opt = OPTIMIZERS["AdamW"](model.parameters())
    forward_reads = []
    for i in range(4):
        before = zinf_compile.io_stats(model)["nvme"]["bytes_read"] if i else 0
        loss = cmodel(*make_batch(CFG, 4, seed=i))
        forward_reads.append(zinf_compile.io_stats(model)["nvme"]["bytes_read"] - before)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stats = optim_overlap.of(opt).stats
    assert stats.get("committed", 0) > 0 and not stats.get("rolled_back"), stats
    assert forward_reads[0] > 0  # the first forward reads the partitioned parameters
    assert forward_reads[2:] == [0, 0], forward_reads  # after the commits of steps 2 and 3
    units = [u for p in model.parameters() for u in zinf_runtime.handle_of(p).units()]
    assert all(u.master.ctx is u.context for u in units)
    assert all(u.optim_state.slot.ctx is u.context for u in units if u.optim_state.slot is not None)


@pytest.mark.parametrize("tier", ["nvme", "cpunvme"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_prefetched_state_is_bitwise_the_plain_step(name, tier, tmp_path):
    ref, _, _ = train(tier, tmp_path, PLAIN, OPTIMIZERS[name])
    got, stats, _ = train(tier, tmp_path, PREFETCH, OPTIMIZERS[name])
    assert_bitwise(got, ref)
    assert stats.get("consumed", 0) > 0 and not stats.get("committed"), stats


@pytest.mark.parametrize("tier", ["cpu", "nvme", "cpunvme"])
def test_clipping_that_clips_rolls_back(tier, tmp_path):
    """max_norm far below the gradient norm: every gradient is scaled after the speculative step ran
    on the unclipped one, which must be dropped; the result is the plain step's, and eager's."""
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-1)  # noqa: E731  (SGD: eager's numbers, tightly)
    ref, _, _ = train(tier, tmp_path, PLAIN, clip=1e-3)
    got, stats, _ = train(tier, tmp_path, OVERLAP, clip=1e-3)
    assert_bitwise(got, ref)
    assert stats.get("speculated", 0) > 0 and not stats.get("committed"), stats  # all rolled back
    got_sgd, stats, _ = train(tier, tmp_path, OVERLAP, sgd, clip=1e-3)
    assert stats.get("speculated", 0) > 0 and not stats.get("committed"), stats  # all rolled back
    torch.manual_seed(0)
    eager = GPT(CFG)
    opt = sgd(eager.parameters())
    for i in range(3):
        eager(*make_batch(CFG, 4, seed=i)).backward()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(got_sgd[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_clipping_that_does_not_clip_commits(tmp_path):
    """max_norm above the gradient norm: the scale factor is exactly 1, the gradients are untouched,
    the speculative steps are committed."""
    ref, _, _ = train("nvme", tmp_path, PLAIN, clip=1e6)
    got, stats, _ = train("nvme", tmp_path, OVERLAP, clip=1e6)
    assert_bitwise(got, ref)
    assert stats.get("committed", 0) > 0 and not stats.get("rolled_back"), stats


@pytest.mark.parametrize("tier", ["cpu", "nvme", "cpunvme"])
def test_accumulation_over_two_micro_batches(tier, tmp_path):
    """The first micro-batch's speculation used half the gradient; the second restarts it with the sum."""
    ref, _, _ = train(tier, tmp_path, PLAIN, accum=2)
    got, stats, _ = train(tier, tmp_path, OVERLAP, accum=2)
    assert_bitwise(got, ref)
    assert stats.get("committed", 0) > 0, stats
    pre, pstats, _ = train("nvme", tmp_path, PREFETCH, accum=2) if tier == "nvme" else (ref, {"consumed": 1}, None)
    assert_bitwise(pre, ref)
    assert pstats.get("consumed", 0) > 0


@pytest.mark.parametrize("tier", ["cpu", "nvme", "cpunvme"])
def test_lr_changed_between_backward_and_step_rolls_back(tier, tmp_path):
    def lower_lr(opt, i):
        for g in opt.param_groups:
            g["lr"] = g["lr"] * 0.5

    ref, _, _ = train(tier, tmp_path, PLAIN, between=lower_lr)
    got, stats, _ = train(tier, tmp_path, OVERLAP, between=lower_lr)
    assert_bitwise(got, ref)
    # a speculation still queued when lr changed reads the new lr and may commit: correct either way
    assert stats.get("rolled_back", 0) > 0, stats


@pytest.mark.parametrize("tier", ["nvme", "cpunvme"])
def test_commits_and_rollbacks_alternate(tier, tmp_path):
    """A unit committed at one step (its shadows now its slots, in the model's context) is stepped the
    plain way at the next (lr changed: rolled back; the plain step keeps its master in memory), then
    speculated and committed again: every step bitwise the plain step's."""
    def lower_lr_every_other_step(opt, i):
        if i % 2:
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.5

    ref, _, _ = train(tier, tmp_path, PLAIN, between=lower_lr_every_other_step, steps=6)
    got, stats, _ = train(tier, tmp_path, OVERLAP, between=lower_lr_every_other_step, steps=6)
    assert_bitwise(got, ref)
    assert stats.get("committed", 0) > 0 and stats.get("rolled_back", 0) > 0, stats


def test_lr_scheduler_after_step_commits(tmp_path):
    """The usual order (scheduler.step() after optimizer.step()) sets the next lr before the next
    backward: the speculation sees it and commits."""
    scheds = []

    def make(ps):
        opt = torch.optim.AdamW(ps, lr=1e-2)
        scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
        return opt

    def sched_step(opt, i):  # runs before opt.step(): so step the scheduler of the previous step here
        if i:
            scheds[-1].step()

    ref, _, _ = train("cpu", tmp_path, PLAIN, make, steps=4)
    got, stats, _ = train("cpu", tmp_path, OVERLAP, make, steps=4)
    assert_bitwise(got, ref)
    assert stats.get("committed", 0) > 0


def test_zero_grad_without_step_drops_the_work(tmp_path):
    """A backward whose gradients are thrown away (zero_grad, no step): its speculation is void."""
    torch.manual_seed(0)
    results = []
    for features in (PLAIN, OVERLAP):
        torch.manual_seed(0)
        model = GPT(CFG)
        cmodel = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_params": "cpu",
                                                                "offload_optimizer": "cpu", **features})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(3):
            cmodel(*make_batch(CFG, 4, seed=100 + i)).backward()
            opt.zero_grad(set_to_none=True)  # discarded
            cmodel(*make_batch(CFG, 4, seed=i)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        results.append(zinf_compile.full_state_dict(model))
        stats = optim_overlap.of(opt).stats
    assert_bitwise(results[1], results[0])
    assert stats.get("committed", 0) > 0 and stats.get("invalidated", 0) > 0


@pytest.mark.parametrize("tier, features", [("cpu", OVERLAP), ("nvme", OVERLAP), ("nvme", PREFETCH),
                                            ("cpunvme", OVERLAP), ("cpunvme", PREFETCH)],
                         ids=["cpu-overlap", "nvme-overlap", "nvme-prefetch", "cpunvme-overlap",
                              "cpunvme-prefetch"])  # prefetch: NVMe only
def test_held_bytes_never_exceed_the_cap(tier, features, tmp_path):
    cap = 20_000  # bytes: a few of the small units fit, most do not
    ref, _, _ = train(tier, tmp_path, PLAIN, extra={"optimizer_sub_group_bytes": cap})
    got, stats, opt = train(tier, tmp_path, features, extra={"optimizer_sub_group_bytes": cap})
    assert_bitwise(got, ref)
    ov = optim_overlap.of(opt)
    assert ov.cap_bytes == cap
    assert 0 < ov.peak_held_bytes <= cap, (ov.peak_held_bytes, stats)
    assert stats.get("over_cap", 0) > 0, stats
    assert ov.held_bytes == 0  # everything released after the step


def test_trace_shows_the_optimizer_under_backward(tmp_path):
    path = tmp_path / "trace.json"
    train("nvme", tmp_path, OVERLAP, extra={"trace": str(path)}, steps=3)
    events = json.loads(path.read_text())["traceEvents"]
    spec = [e for e in events if e.get("cat") == "optimizer" and e["name"].startswith("speculative step")]
    assert spec, "no speculative step in the optimizer lane"


@pytest.mark.parametrize("key", ["optimizer_prefetch", "overlap_optimizer_step"])
def test_option_is_validated(key):
    with pytest.raises(ValueError, match=key):
        zinf_compile.config.Config(**{key: "yes"})


@pytest.mark.slow
def test_dp2_overlapped_step_is_bitwise_the_plain_step(tmp_path):
    """dp = 2 on gloo (torchrun, tests/test_dp.py's launcher): each rank speculates on its own shards;
    the result is the plain step's, bitwise. The rank-0 trace shows speculative steps ran."""
    from test_dp import run_dp

    res = {}
    for name, features in (("plain", PLAIN), ("overlap", OVERLAP)):
        d = tmp_path / name
        (d / "nvme").mkdir(parents=True)
        opts = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme",
                "nvme_path": str(d / "nvme"), **features}
        if name == "overlap":
            opts["trace"] = str(d / "trace.json")
        res[name] = run_dp(d, opts)
    assert res["overlap"]["losses"] == res["plain"]["losses"]
    assert_bitwise(res["overlap"]["state"], res["plain"]["state"])
    events = json.loads((tmp_path / "overlap" / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "optimizer" and e["name"].startswith("speculative step") for e in events)
