"""The read cache (``zinf_runtime.read_cache``): a parameter shard read from NVMe by a fetch is kept
for backward's fetch and the optimizer's master read, never served once its file changed; and the
write-back of stepped parameters (``nvme_param_write_back``, ``tiers.Slot``'s lends), which keeps
them out of the files while they fit."""

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
    # parameters' (forward, backward, master) and the moments' only; every parameter on NVMe (norms
    # and biases too, which the default keeps in memory), so the counts below are every parameter's
    return {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": str(path),
            "optimizer_sub_group_bytes": 64 << 20, "nvme_min_shard_bytes": 0, **kw}


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


def _step_reads(path, cache_bytes: int, write_back: bool = False) -> tuple:
    """Bytes the swap engine read in the third step, the parameters' fp32 bytes, cache hits, and
    the bytes it wrote in that step."""
    from zinf_runtime.context import contexts_of

    path.mkdir()
    torch.manual_seed(0)
    model = GPT(CFG)
    cm = torch.compile(model, backend="zinf", options=_opts(path, nvme_read_cache_bytes=cache_bytes,
                                                            nvme_param_write_back=write_back))
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        if step == 2:
            (ctx,) = contexts_of(model)
            (eng,) = ctx.engines()
            before, hits = eng.stats()["bytes_read"], ctx.read_cache.hits
            written = eng.stats()["bytes_written"]
        cm(*make_batch(CFG, 4, seed=step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return eng.stats()["bytes_read"] - before, sum(4 * p.numel() for p in model.parameters()), \
        ctx.read_cache.hits - hits, eng.stats()["bytes_written"] - written


def test_backward_and_the_optimizer_do_not_read_a_cached_parameter_again(tmp_path):
    """Write-through (``nvme_param_write_back=False``), a model smaller than the cache: the
    optimizer's write of each master leaves it cached for the next forward, whose fetch hands it on
    to backward's and to the optimizer's master read. So a steady step reads no parameter at all,
    only Adam's two moments (fp32, packed in one file per parameter), exactly; without the cache it
    reads each master three times, less the parameters autograd saved from forward instead of
    fetching them again."""
    off, params, hits_off, _ = _step_reads(tmp_path / "off", 0)
    on, params_on, hits_on, _ = _step_reads(tmp_path / "on", 64 << 20)
    assert params == params_on and hits_off == 0
    assert on == 2 * params, (on, params)
    assert off - on > 2 * params, (off, on, params)
    n = len(list(GPT(CFG).parameters()))
    assert hits_on > 2 * n  # forward's fetch and the master read of every parameter, and backward's fetches


def test_write_back_keeps_stepped_parameters_out_of_their_files(tmp_path):
    """Write-back (the default), a model whose masters fit under the cap (``nvme_read_cache_bytes``):
    each step's stepped master stays in memory as the parameter's value, the next forward and
    backward fetch it there and the next step updates it there. So a steady step reads only Adam's
    moments and writes only them; write-through writes every master too. A cap of 0 keeps nothing:
    every stepped master is written, as with write-through."""
    through, params, _, wrote_through = _step_reads(tmp_path / "through", 64 << 20)
    back, params_back, hits, wrote_back = _step_reads(tmp_path / "back", 64 << 20, write_back=True)
    assert params == params_back and hits == 0  # nothing comes from the read cache: nothing was read
    assert back == 2 * params, (back, params)
    assert wrote_back == 2 * params, (wrote_back, params)  # the moments, and no master
    assert wrote_through == 3 * params, (wrote_through, params)
    _, _, _, wrote_uncapped = _step_reads(tmp_path / "zero", 0, write_back=True)
    assert wrote_uncapped == 3 * params, (wrote_uncapped, params)


@pytest.mark.parity
@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("write_back", [False, True])
def test_a_cached_shard_is_copied_on_the_fetching_thread(compiler, write_back, tmp_path):
    """A fetch that finds its shard in the read cache, or in memory as the value the last step kept
    (write-back), has no read to wait for, so its copy to the (CPU) device runs inline: a steady
    step of a model that fits hands no copy to the h2d lane's thread, and still trains as eager
    does. Before, every NVMe fetch went through the lane, two thread wake-ups per fetch for the same
    copy (``runtime/transfer.py``, ``_upload``)."""
    from zinf_runtime.context import contexts_of

    torch.manual_seed(0)
    model, ref = GPT(CFG), GPT(CFG)
    ref.load_state_dict(model.state_dict())
    cm = torch.compile(model, backend="zinf", options=_opts(tmp_path, compiler=compiler,
                                                            nvme_param_write_back=write_back))
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
    if not write_back:  # forward's and the master read of every parameter at least
        assert ctx.read_cache.hits - hits >= 2 * n
    else:  # every value in memory: nothing read, nothing cached
        (eng,) = ctx.engines()
        assert ctx.kept.bytes == sum(4 * p.numel() for p in model.parameters()) and ctx.read_cache.hits == hits
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


def test_a_slot_moves_to_another_context_only_with_nothing_in_flight(cached):
    """``Slot.rehome`` (a committed speculative shadow joining its model's context) refuses a slot
    whose write is still in flight, whose buffer the old context's tracker would be left holding;
    once written, the slot reads and writes through the new context."""
    from zinf_runtime.context import RuntimeContext

    ctx, _, s, _ = cached
    other = RuntimeContext(name="read cache test, other")
    v2 = torch.randn(1024)
    s.set(v2)  # the write is in flight until a flush or a read waits for it
    with pytest.raises(RuntimeError, match="write in flight"):
        s.rehome(other)
    s.flush()
    assert len(ctx.read_cache) == 1  # the written value is the old context's copy (write-through) ...
    s.rehome(other)
    assert s.ctx is other and len(ctx.read_cache) == 0 and len(other.read_cache) == 0  # ... and goes with the move
    assert torch.equal(s.get(), v2) and len(other.read_cache) == 0  # no cached copy there: read from disk
    _fetch(s)
    assert len(other.read_cache) == 1  # a fetch's copy is kept in the new context's cache


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
    fp32 = sum(4 * p.numel() for p in model.parameters())  # every stepped master, held unwritten (write-back)
    assert st["kept_params"]["cap_bytes"] == 64 << 20 and st["kept_params"]["bytes"] == ctx.kept.bytes == fp32
    assert st["kept_params"]["written_back"] == 0
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


@pytest.fixture
def kept(tmp_path):
    """A context with a write-back cap of one 4 KiB value, its swap engine, and a factory of NVMe
    parameter slots of 1024 fp32 holding a value kept in memory (``set(..., defer=True)``)."""
    from zinf_runtime import tiers
    from zinf_runtime.context import RuntimeContext
    from zinf_runtime.swap import SwapEngine

    ctx = RuntimeContext(name="write-back test")
    ctx.kept.cap_bytes = 4096
    slots = []
    with SwapEngine(small_cfg(tmp_path)) as eng:
        def make(key: str, value: torch.Tensor):
            s = tiers.Slot("nvme", "param", 1024, torch.float32, torch.device("cpu"), swap=eng, key=key, ctx=ctx)
            s.set(ctx.pool.acquire(1024, torch.float32).copy_(value), donate=True, recycle=True, defer=True)
            slots.append(s)
            return s

        yield ctx, eng, make
        for s in slots:
            s.drop()


def test_a_fetch_reads_a_kept_value_where_it_is_and_a_newer_value_waits_for_it(kept):
    """A fetch borrows the kept value itself (no read, no copy). A newer value set while the fetch
    still reads it does not recycle the borrowed buffer: it goes to the pool when handed back."""
    ctx, eng, make = kept
    v1, v2 = torch.randn(1024), torch.randn(1024)
    s = make("p", v1)
    buf, h = s.read_owned(keep=True)
    assert h is None and buf.data_ptr() == s.dirty.data_ptr() and eng.stats()["reads"] == 0
    s.set(ctx.pool.acquire(1024, torch.float32).copy_(v2), donate=True, recycle=True, defer=True)
    assert not ctx.pool.holds(buf) and torch.equal(buf, v1)  # still the fetch's, unchanged
    s.keep_read(buf)
    assert ctx.pool.holds(buf)
    assert torch.equal(s.get(), v2) and eng.stats()["writes"] == 0


def test_an_evicted_kept_value_is_written_and_recycled_after_its_fetch(kept):
    ctx, eng, make = kept
    v1, v2 = torch.randn(1024), torch.randn(1024)
    a = make("a", v1)
    buf, _ = a.read_owned(keep=True)
    make("b", v2)  # over the cap: a's value is written back while the fetch reads it
    a.flush()
    assert a.dirty is None and eng.stats()["writes"] == 1
    assert not ctx.pool.holds(buf) and len(ctx.read_cache) == 0  # neither recycled nor cached while lent
    s_reads = eng.stats()["reads"]
    assert torch.equal(a.get(), v1) and eng.stats()["reads"] == s_reads + 1  # the file has it
    a.keep_read(buf)
    assert ctx.pool.holds(buf)


def test_an_update_in_place_keeps_the_kept_buffer(kept):
    """``take_for_update`` (the optimizer's master) hands over the kept buffer itself, out of the
    eviction order while it is changed; ``set`` of that buffer keeps it as the new value."""
    ctx, eng, make = kept
    v1 = torch.randn(1024)
    s = make("p", v1)
    mine, h = s.take_for_update()
    assert h is None and mine.data_ptr() == s.dirty.data_ptr() and len(ctx.kept) == 0
    make("q", torch.randn(1024))  # fills the cap: p is out of the order, so nothing is evicted
    assert eng.stats()["writes"] == 0
    mine.add_(1.0)
    s.set(mine, donate=True, recycle=True, defer=True)
    assert s.dirty.data_ptr() == mine.data_ptr() and not ctx.pool.holds(mine)
    s.flush()
    assert torch.equal(s.get(), v1 + 1.0)


def test_take_for_update_copies_a_value_a_fetch_holds(kept):
    ctx, _, make = kept
    v1 = torch.randn(1024)
    s = make("p", v1)
    buf, _ = s.read_owned(keep=True)
    mine, h = s.take_for_update()
    assert h is None and mine.data_ptr() != buf.data_ptr() and torch.equal(mine, v1)
    mine.add_(1.0)
    assert torch.equal(buf, v1)  # the fetch's view is untouched
    s.keep_read(buf)
    ctx.pool.release(mine)


def test_a_borrowed_value_is_recycled_only_after_the_device_copies_that_read_it(kept):
    """Ordering on CUDA, with recorded (fake) events: a fetch hands a borrowed value back with the
    fence of the upload still reading it; when a newer value replaces it, the pool gets the buffer
    with that fence, so no later read overwrites it under the copy."""
    from zinf_runtime import hostsync

    ctx, _, make = kept
    s = make("p", torch.randn(1024))
    log: list = []
    released = []
    real = ctx.pool.release
    ctx.pool.release = lambda t, fence=None: (released.append((t.data_ptr(), fence)), real(t, fence))[1]
    with hostsync.recording_events(log):
        buf, _ = s.read_owned(keep=True)
        fence = hostsync.Fence()
        fence.record(torch.device("cuda", 0), buf)
        s.keep_read(buf, fence)
        assert log == [("record", 0)] and not released  # handed back to the slot, which still holds it
        s.set(ctx.pool.acquire(1024, torch.float32).copy_(torch.randn(1024)), donate=True, recycle=True, defer=True)
    ((ptr, f),) = [r for r in released if r[0] == buf.data_ptr()]
    assert f is not None and log == [("record", 0), ("wait", 0)]  # the pool waited for the upload's event
