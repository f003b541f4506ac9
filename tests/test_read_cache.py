"""The read cache (``zinf_runtime.read_cache``): a parameter shard read from NVMe by a fetch is kept
for backward's fetch and the optimizer's master read, never served once its file changed."""

from __future__ import annotations

import pytest
import torch

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

from conftest import ATOL, RTOL, assert_grads_equal, assert_same_training, train_pair
from test_swap import small_cfg

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


def _opts(path, **kw) -> dict:
    # sub-groups that keep every gradient in memory (write-back), so a step's reads are the
    # parameters' (forward, backward, master) and the moments' only
    return {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(path),
            "optimizer_sub_group_bytes": 64 << 20, **kw}


@pytest.mark.parity
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_cached_reads_train_bitwise_like_eager(opt, tmp_path):
    batches = [make_batch(CFG, 4, seed=i) for i in range(4)]
    run = train_pair(lambda: GPT(CFG), batches, _opts(tmp_path), opt=opt)
    assert_grads_equal(run)
    assert_same_training(run, exact=True)
    from zinf_runtime.context import contexts_of

    (ctx,) = contexts_of(run.model)
    assert ctx.read_cache.hits > 0 and 0 < ctx.read_cache.peak_bytes <= ctx.read_cache.cap_bytes


def _step_reads(path, cache_bytes: int) -> tuple:
    """Bytes the swap engine read in the third step, the parameters' fp32 bytes, cache hits."""
    from zinf_runtime.context import contexts_of

    path.mkdir()
    torch.manual_seed(0)
    model = GPT(CFG)
    cm = torch.compile(model, backend="zinf", options=_opts(path, nvme_read_cache_bytes=cache_bytes))
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        if step == 2:
            (ctx,) = contexts_of(model)
            (eng,) = ctx.engines()
            before, hits = eng.stats()["bytes_read"], ctx.read_cache.hits
        cm(*make_batch(CFG, 4, seed=step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return eng.stats()["bytes_read"] - before, sum(4 * p.numel() for p in model.parameters()), \
        ctx.read_cache.hits - hits


def test_backward_and_the_optimizer_do_not_read_a_cached_parameter_again(tmp_path):
    """A model smaller than the cache: the optimizer's write of each master leaves it cached for the
    next forward, whose fetch hands it on to backward's and to the optimizer's master read. So a
    steady step reads no parameter at all, only Adam's two moments (fp32, packed in one file per
    parameter), exactly; without the cache it reads each master three times, less the parameters
    autograd saved from forward instead of fetching them again."""
    off, params, hits_off = _step_reads(tmp_path / "off", 0)
    on, params_on, hits_on = _step_reads(tmp_path / "on", 64 << 20)
    assert params == params_on and hits_off == 0
    assert on == 2 * params, (on, params)
    assert off - on > 2 * params, (off, on, params)
    n = len(list(GPT(CFG).parameters()))
    assert hits_on > 2 * n  # forward's fetch and the master read of every parameter, and backward's fetches


@pytest.mark.parity
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_cached_shard_is_copied_on_the_fetching_thread(compiler, tmp_path):
    """A fetch that finds its shard in the read cache has no read to wait for, so its copy to the
    (CPU) device runs inline: a steady step of a model that fits hands no copy to the h2d lane's
    thread, and still trains as eager does. Before, every NVMe fetch went through the lane, two
    thread wake-ups per fetch for the same copy (``runtime/transfer.py``, ``_upload``)."""
    from zinf_runtime.context import contexts_of

    torch.manual_seed(0)
    model, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(model.state_dict())
    cm = torch.compile(model, backend="zinf", options=_opts(tmp_path, compiler=compiler))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        if step == 2:
            (ctx,) = contexts_of(model)
            lane = ctx.transfers.lane("h2d")
            jobs, hits = lane.submitted, ctx.read_cache.hits
        x, y = make_batch(CFG, 4, seed=step)
        cm(x, y).backward()
        ref(x, y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    n = len(list(model.parameters()))
    assert ctx.read_cache.hits - hits >= 2 * n  # forward's and the master read of every parameter at least
    assert lane.submitted == jobs
    full = zinf_compile.full_state_dict(model)
    tol = dict(rtol=0, atol=0) if compiler == "eager" else dict(rtol=RTOL, atol=ATOL)  # Inductor fuses otherwise
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **tol, msg=lambda m: f"{k}: {m}")


def test_a_small_cache_keeps_the_newest_reads_within_its_cap(tmp_path):
    from zinf_runtime.context import contexts_of

    cap = 8 << 10  # a few of the model's shards (the largest are 8 KiB)
    batches = [make_batch(CFG, 4, seed=i) for i in range(3)]
    run = train_pair(lambda: GPT(CFG), batches, _opts(tmp_path, nvme_read_cache_bytes=cap))
    assert_same_training(run, exact=True)
    (ctx,) = contexts_of(run.model)
    assert 0 < ctx.read_cache.peak_bytes <= cap and ctx.read_cache.hits > 0


def _fetch(s) -> None:
    """What a fetch does with a slot: read it into a buffer of its own, then hand the buffer back."""
    buf, h = s.read_owned(keep=True)
    if h is not None:
        h.wait()
    s.keep_read(buf)


@pytest.fixture
def cached(tmp_path):
    """A context, its swap engine, and an NVMe slot holding ``v1`` that one fetch read: the cache
    holds its copy."""
    from zinf_runtime import tiers
    from zinf_runtime.context import RuntimeContext
    from zinf_runtime.swap import SwapEngine

    ctx = RuntimeContext(name="read cache test")
    with SwapEngine(small_cfg(tmp_path)) as eng:
        s = tiers.Slot("nvme", "param", 1024, torch.float32, torch.device("cpu"), swap=eng, key="p", ctx=ctx)
        v1 = torch.randn(1024)
        s.set(v1)
        _fetch(s)
        assert len(ctx.read_cache) == 1 and ctx.read_cache.bytes == 4096
        yield ctx, eng, s, v1
        s.drop()  # its NVMe bytes leave the process-wide accounting, which later tests check


def test_a_write_or_drop_discards_the_cached_copy(cached):
    ctx, eng, s, v1 = cached
    reads = eng.stats()["reads"]
    assert torch.equal(s.get(), v1) and eng.stats()["reads"] == reads  # served from memory, kept
    assert len(ctx.read_cache) == 1
    v2 = torch.randn(1024)
    s.set(v2)  # the file changes: the copy goes ...
    assert len(ctx.read_cache) == 0
    # ... and once the write is done, the written value is the copy (write-through): no read
    assert torch.equal(s.get(), v2) and eng.stats()["reads"] == reads and len(ctx.read_cache) == 1
    s.drop()
    assert len(ctx.read_cache) == 0 and ctx.read_cache.bytes == 0


def test_a_read_overtaken_by_a_write_is_not_kept(cached):
    """The version check: a buffer read before the slot's last write holds the old value and must
    not become the cached copy."""
    ctx, _, s, _ = cached
    buf, h = s.read_owned(keep=True)  # a fetch takes the copy ...
    assert h is None
    v2 = torch.randn(1024)
    s.set(v2)  # ... the slot is written while the fetch still uses it ...
    s.keep_read(buf)  # ... so its hand-back goes to the pool
    assert len(ctx.read_cache) == 0 and ctx.pool.holds(buf)
    assert torch.equal(s.get(), v2)


def test_a_taken_copy_belongs_to_its_taker(cached):
    """``read_owned()`` without ``keep`` (the optimizer's master) takes the cached buffer; changing
    it in place changes neither the file nor what the next reader gets."""
    ctx, _, s, v1 = cached
    mine, h = s.read_owned()
    assert h is None and len(ctx.read_cache) == 0 and torch.equal(mine, v1)
    mine.add_(1.0)
    assert torch.equal(s.get(), v1)


def test_a_slot_dropped_under_a_fake_tensor_mode_frees_its_copy_and_accounting(cached):
    """A parameter's finalizer drops its slots whenever the garbage collector runs, e.g. in the
    middle of another model's compile, under its fake-tensor mode. Dropping the cached copy there
    must run no tensor op (the pool's ``view`` failed under the mode, the finalizer's error was
    swallowed, and the slot's NVMe bytes stayed in the accounting for good)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx, _, s, _ = cached
    assert ctx.accounting.stats()["nvme"]["param"]["current"] == 4096
    with FakeTensorMode():
        s.drop()
    assert len(ctx.read_cache) == 0 and ctx.read_cache.bytes == 0
    assert ctx.accounting.stats()["nvme"]["param"]["current"] == 0


def test_cache_bytes_option_is_validated(tmp_path):
    with pytest.raises(ValueError, match="nvme_read_cache_bytes"):
        zinf_compile.Config.from_options(_opts(tmp_path, nvme_read_cache_bytes=-1))


def test_the_plan_books_kept_reads_as_the_cache_keeps_them():
    """``memory_plan._cached_reads``: three units of 4 bytes under an 8-byte cap. The step starts
    with the first-read units the last step wrote, up to the cap (a and b); a unit's read takes its
    buffer (its own interval counts it from then); the third put evicts the oldest; what is still
    held at the end lives to the end of the step."""
    from zinf_compile.memory_plan import _cached_reads

    reads = [("a", 0, 1, 4, "fwd:a", "a"), ("b", 1, 2, 4, "fwd:b", "b"), ("c", 2, 3, 4, "fwd:c", "c"),
             ("c", 5, 6, 4, "bwd:c", "c")]
    ivs = {(iv.param, iv.start): (iv.end, iv.nbytes) for iv in _cached_reads(reads, 8, 10)}
    assert ivs == {("b", 0): (0, 4),  # written last step, taken by forward's read at 1 (a's at 0: nothing held)
                   ("a", 2): (3, 4),  # evicted by c's put at 3
                   ("b", 3): (10, 4),  # never read again: to the end
                   ("c", 4): (4, 4),  # taken by backward's read at 5
                   ("c", 7): (10, 4)}
    assert _cached_reads(reads, 0, 10) == [] and _cached_reads(reads, 2, 10) == []  # off; shards over the cap



def test_io_stats_reports_the_engines_bytes_and_the_cache_hits(tmp_path):
    """``zinf_compile.io_stats(model)``: the swap engine's own counters and the read cache's, per model;
    a model zinf never partitioned gets an error naming what to pass instead of zeros."""
    from zinf_runtime.context import contexts_of

    torch.manual_seed(0)
    model = GPT(CFG)
    cm = torch.compile(model, backend="zinf", options=_opts(tmp_path))
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        cm(*make_batch(CFG, 4, seed=step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    (ctx,) = contexts_of(model)
    (eng,) = ctx.engines()
    eng.wait_all()
    st, raw = zinf_compile.io_stats(model), eng.stats()
    assert {k: st["nvme"][k] for k in ("bytes_read", "bytes_written", "reads", "writes")} == \
        {k: raw[k] for k in ("bytes_read", "bytes_written", "reads", "writes")}
    assert st["nvme"]["bytes_written"] >= 3 * sum(4 * p.numel() for p in model.parameters())  # masters + m, v
    assert st["read_cache"]["hits"] == ctx.read_cache.hits > 0
    assert st["read_cache"]["cap_bytes"] == 64 << 20 and 0 < st["read_cache"]["peak_bytes"] <= 64 << 20
    assert st["write_back"]["cap_bytes"] == 64 << 20  # optimizer_sub_group_bytes (gradients held unwritten)
    with pytest.raises(ValueError, match="no partitioned parameters"):
        zinf_compile.io_stats(GPT(CFG))


def test_on_cuda_write_through_keeps_only_pinned_copies(tmp_path):
    """Where fetches upload to CUDA (``Slot.pin``), a cached copy must be pinned, or the next fetch's
    upload would block on pageable memory. So a parameter's master is read into a pinned buffer even
    though the optimizer steps it on the host (it becomes the cached copy once written), moments are
    not, and a pageable written value (set from outside the optimizer) goes to the pool instead.

    This machine cannot pin memory, so the pool records what each read asks for and hands out
    pageable buffers; ``Slot.pin`` is what a CUDA compute device sets (``store``)."""
    from zinf_runtime import tiers
    from zinf_runtime.context import RuntimeContext
    from zinf_runtime.swap import SwapEngine

    class Recording(tiers.BufferPool):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list = []

        def acquire(self, numel, dtype, pin=False):
            self.asked.append(pin)
            return super().acquire(numel, dtype, False)

    ctx = RuntimeContext(name="pinned write-through test", pool=Recording())
    with SwapEngine(small_cfg(tmp_path)) as eng:
        slots = {kind: tiers.Slot("nvme", kind, 1024, torch.float32, torch.device("cpu"), swap=eng, key=kind,
                                  pin=True, ctx=ctx) for kind in ("param", "optim")}
        for s in slots.values():
            s.set(torch.randn(1024))
            s.flush()
        assert len(ctx.read_cache) == 0  # the written values were pageable: not kept
        for kind, want in (("param", True), ("optim", False)):
            ctx.pool.asked.clear()
            buf, h = slots[kind].read_owned()  # the optimizer's read: not a fetch
            h.wait()
            assert ctx.pool.asked == [want], kind
            ctx.pool.release(buf)
        for s in slots.values():
            s.drop()
