"""The optimizer overlapped with backward: state prefetch and a speculative step, committed by ``step()``.

A unit's gradient shard is final for this backward once its reduce-scatter + offload ran
(``ParamHandle.accumulate_grad``). Its optimizer step needs nothing else but the master and the
moments, which nothing changes during backward, so that work can start right there instead of after
the last gradient::

    before: backward ........................| step: read m,g,v,s | torch step | write | ... (NVMe)
    after (prefetch, NVMe optimizer tier):
            backward ..[copy g, read m,v,s]..|  step: torch step on the prefetched buffers | write
    after (overlap_optimizer_step=True):
            backward ..[copy g, read, step, write to *shadow* slots]..| step(): commit = swap the slots

Why a copy of the gradient: the grad slot is written (NVMe) or accumulated into (CPU) by the very
call that makes it final; keeping a copy of that in-memory value saves re-reading it from disk, and
makes the work independent of what later happens to the slot.

Exactness, by construction: every piece of started work records what it saw (the unit's
``grad_version`` and ``state_version``, bumped by ``ParamHandle`` on every change of the gradient
resp. of the master/optimizer state, and a snapshot of its param group's hyper-parameters). ``step()``
uses it only if all three still hold, and if the parameter's ``.grad`` is still its sharded gradient;
otherwise the work is dropped and that unit is stepped the ordinary way. What this covers:

- clipping that changes a gradient (``mul_`` by a factor != 1: a new grad_version) -> the ordinary
  step (rollback); clipping whose factor is exactly 1.0 changes nothing (zinf skips the multiply) ->
  committed. GradScaler's unscale (factor 1/scale) -> always the ordinary step: correct, no overlap.
- gradient accumulation: every micro-batch's accumulate is a new version and restarts the unit's work
  with the accumulated value; the last micro-batch's work is what ``step()`` finds. (The earlier ones
  are wasted work: with accumulation, prefer the plain step; see README.)
- ``zero_grad`` without step, ``p.grad = None``: new version / not live -> dropped.
- lr or other hyper-parameters changed between backward and step (an LR scheduler stepped before
  ``optimizer.step()``, a manual change) -> the snapshot differs -> the ordinary step.
- checkpoint loads of master or state (``master_updated``, ``_adopt_state``) -> a new state_version.

Why speculate-and-verify rather than refuse: the conditions are only known at ``step()`` (whether the
loop clips, accumulates or changes lr is the loop's business), and the verification costs a few
integer compares. A speculative step never writes the committed state: CPU-tier results are new
tensors held in memory; NVMe results go to shadow slots (new swap keys) that become the unit's
slots at commit, the old ones being dropped then. Rolling back is dropping the shadows.

Memory: every host byte this module holds (gradient copies, prefetched or speculatively stepped
master and moments in memory) is counted in ``held_bytes`` under a cap (the placement's
``sub_group_bytes``, option ``optimizer_sub_group_bytes``): a unit that does not fit is left to the
ordinary step. ``peak_held_bytes`` records the maximum for tests. NVMe speculation releases its
buffers once the shadows are written, so the cap bounds only what is in flight there; CPU-tier
speculation holds its results until ``step()``, so at most a cap's worth of the model is overlapped.

Numerics: torch's own step of the optimizer's class runs on the same values (master, gradient,
state, hyper-parameters) through a private copy of the optimizer object (its ``param_groups`` and
``state`` are never touched from the worker thread), one unit at a time. For elementwise optimizers
on CPU (torch's per-tensor loop) that is bitwise what the ordinary step computes.
Device-tier (GPU) optimizer state is never speculated on: a background thread would race the
compute stream; only ``cpu`` and ``nvme`` optimizer tiers take part.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

import torch

from . import packed_state, tiers
from .transfer import Job, Lane

#: optimizer tiers each feature applies to
PREFETCH_TIERS = ("nvme",)
STEP_TIERS = ("cpu", "nvme")


def settings_of(h: Any) -> tuple[bool, bool]:
    """(prefetch, overlap_step) of the model a handle belongs to: options ``optimizer_prefetch``
    (default True) and ``overlap_optimizer_step`` (default False), set on its context by the backend."""
    ctx = h.context
    return bool(getattr(ctx, "optimizer_prefetch", True)), bool(getattr(ctx, "overlap_optimizer_step", False))


def _snapshot(group: dict) -> Dict[str, Any]:
    """A param group's hyper-parameters, tensors copied (a scheduler may change a tensor lr in place)."""
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in group.items() if k != "params"}


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return a is b


def same_hyperparameters(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def step_on_copies(optimizer: Any, gi: int, hp: Dict[str, Any], master: torch.Tensor, grad: torch.Tensor,
                   state: Dict[str, Any]) -> Dict[str, Any]:
    """torch's step of ``optimizer``'s class on ``master`` (in place) with ``grad`` and ``state``, through
    a private copy of the optimizer object: its ``param_groups`` (group ``gi`` holds only ``master``,
    hyper-parameters ``hp``) and ``state`` are its own. Returns the new state of ``master``."""
    from .optim import base_step

    proxy = object.__new__(type(optimizer))
    proxy.__dict__.update(optimizer.__dict__)
    groups = [dict(g, params=[]) for g in optimizer.param_groups]
    groups[gi] = dict(hp, params=[master])
    proxy.param_groups = groups
    proxy.state = collections.defaultdict(dict)
    if state:
        proxy.state[master] = state
    master.grad = grad
    try:
        base_step(type(optimizer))(proxy)
    finally:
        master.grad = None
    return proxy.state.pop(master, {})


class _PrivateWrites:
    """The context a shadow slot writes through until it is committed: the model's accounting, pool
    and read cache, its own write tracker (shadows are flushed by the thread that wrote them, never
    by another thread's tracker) and no write-back (a shadow is written at once).

    The read cache is the model's: a shadow master's written value becomes its clean copy there,
    so the next forward's fetch of the committed master reads no file (as the plain step's
    write-through does). A shadow that is never committed is dropped, and its copy with it. Before
    2026-12-07 the cache here was off and a committed shadow kept this context: every master a
    speculative step had written was read from disk again by forward and backward (the 70M GPT of
    ``benchmarks/overlap.py --threads 1``, row overlap_opt, read 1341 MiB a step; 981 MiB since).
    ``ShardedOptimizerMixin._commit_shadows`` moves a committed shadow to the model's context."""

    def __init__(self, ctx: Any) -> None:
        self.accounting = ctx.accounting
        self.pool = ctx.pool
        self.writes = tiers.WriteTracker(cap_bytes=1 << 62)
        self.dirty = tiers.DirtyTracker()  # unused: shadows are written at once
        self.kept = tiers.DirtyTracker(cap_bytes=0)  # a speculative value is never kept unwritten
        self.read_cache = ctx.read_cache


class Entry:
    """The work started for one unit since its gradient became final."""

    def __init__(self, unit: Any, gi: int, nbytes: int, seq: int = 0) -> None:
        self.unit = unit
        self.gi = gi
        self.nbytes = nbytes  # host bytes reserved under the cap
        self.seq = seq  # when its gradient became final: the step takes prefetched units in this order
        self.gv = unit.grad_version
        self.sv = unit.state_version
        self.grad: Optional[torch.Tensor] = None
        self.grad_borrowed = False  # grad is the gradient slot's own deferred value (Slot.dirty), not a copy
        self.master: Optional[torch.Tensor] = None
        self.state_buf: Optional[torch.Tensor] = None  # prefetch: the packed moments' buffer ...
        self.state_read: Any = None  # ... and its read handle (runtime/packed_state.py)
        self.master_read: Any = None
        self.hp: Optional[Dict[str, Any]] = None
        self.job: Optional[Job] = None
        self.void = False  # dropped: whoever finishes last releases
        self.stepped = False
        self.new_state: Dict[str, Any] = {}  # CPU tier: the stepped state; NVMe: small entries
        self.shadows: Dict[str, tiers.Slot] = {}  # NVMe tier: "master" and "optim" (the packed moments)
        self.shadow_layout: Optional[packed_state.Layout] = None  # the "optim" shadow's layout
        self.released = False
        self.finished = False  # the worker is done with it (set under the overlap's lock)
        self.speculative = False  # handed to the worker (set before it is submitted)


class OptimizerOverlap:
    """One optimizer's prefetch / speculative step state; see the module docstring."""

    def __init__(self, optimizer: Any) -> None:
        self._opt = weakref.ref(optimizer)
        self._lock = threading.Lock()
        self._entries: Dict[int, Entry] = {}
        self._seq = itertools.count()  # Entry.seq
        self._group_of: Dict[int, int] = {}
        self._jobs: List[Job] = []
        self._lane: Optional[Lane] = None
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.cap_bytes = 0
        self.stats: collections.Counter = collections.Counter()

    # -- registration ----------------------------------------------------------------------------
    def attach(self) -> None:
        """Listen to the gradients of the optimizer's units (called after each step: the optimizer is
        known for its parameters from then on; the first backward before a step gets no overlap)."""
        from . import store

        opt = self._opt()
        if opt is None:
            return
        self._group_of.clear()
        for gi, group in enumerate(opt.param_groups):
            for _, h in store.iter_handles(group["params"]):
                prefetch, overlap = settings_of(h)
                tier = h.placement.master_tier
                if not ((overlap and tier in STEP_TIERS) or (prefetch and tier in PREFETCH_TIERS)):
                    continue
                self.cap_bytes = max(self.cap_bytes, h.placement.sub_group_bytes)
                for u in h.units():
                    if u.requires_grad:
                        self._group_of[u.uid] = gi
                        u.grad_listener = self.on_grad

    def detach(self) -> None:
        from . import store

        opt = self._opt()
        for group in (opt.param_groups if opt is not None else ()):
            for _, h in store.iter_handles(group["params"]):
                for u in h.units():
                    if u.grad_listener == self.on_grad:
                        u.grad_listener = None
        self.drain(raise_errors=False)
        self.clear()

    # -- backward side (any thread) ----------------------------------------------------------------
    def on_grad(self, u: Any, value: Optional[torch.Tensor]) -> None:
        """``u``'s gradient changed; ``value`` is its final in-memory content, or None (void)."""
        gi = self._group_of.get(u.uid)
        opt = self._opt()
        with self._lock:
            old = self._entries.pop(u.uid, None)
        if old is not None:
            self._void(old)
        if value is None or gi is None or opt is None:
            self.stats["invalidated" if value is None else "skipped"] += 1
            return
        _, overlap = settings_of(u)
        tier = u.placement.master_tier
        numel = u.shard_numel
        # a prefetch borrows a gradient the slot keeps in memory (write-back, tiers.DirtyTracker counts it)
        borrow = not overlap and tier == "nvme" and value is u.grad_slot.dirty
        if tier == "nvme":  # the gradient copy, the master's (read, or copied to step on) and the moments
            nbytes = 4 * numel * 2 + u.optim_state.nbytes
            if not overlap and (u.master.tier != "nvme" or u.master.dirty is not None):
                nbytes -= 4 * numel  # a prefetch leaves a master in memory where it is (store.master_home, write-back)
            if borrow:
                nbytes -= 4 * numel
        else:
            nbytes = 4 * numel * 2 + _state_bytes(_unit_state(opt, u))
        with self._lock:
            if self.held_bytes + nbytes > self.cap_bytes:
                self.stats["over_cap"] += 1
                return
            self.held_bytes += nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            e = Entry(u, gi, nbytes, next(self._seq))
            self._entries[u.uid] = e
        pool = u.context.pool
        if borrow:
            e.grad, e.grad_borrowed = u.grad_slot.dirty, True
        else:
            e.grad = pool.acquire(numel, torch.float32)
            e.grad.copy_(value.reshape(-1))
        if overlap:
            if self._lane is None:
                self._lane = Lane(f"{u.context.transfers.name}-optimizer")
            e.speculative = True
            e.job = self._lane.submit(lambda: self._speculate(e))
            with self._lock:
                self._jobs.append(e.job)
        else:  # prefetch (NVMe): start the reads of the master and the moments now
            # else the step uses the master in memory as it is: a memory tier, or an NVMe master the
            # last step kept in memory (write-back; ``Slot.take_for_update`` at the step)
            if u.master.tier == "nvme" and u.master.dirty is None:
                e.master, e.master_read = u.master.read_owned()  # backward's fetch may have left it cached
            if u.optim_state.present:
                e.state_buf, e.state_read = u.optim_state.read_async(pool)
            self.stats["prefetched"] += 1

    def _speculate(self, e: Entry) -> None:
        """Worker thread: step the unit on copies; results stay off the committed state."""
        try:
            self._speculate_body(e)
        finally:
            with self._lock:
                e.finished = True
                void = e.void
            if void:  # dropped while it ran: nobody else releases it
                self._release(e)

    def _speculate_body(self, e: Entry) -> None:
        u = e.unit
        opt = self._opt()
        if e.void or opt is None:
            return
        t0 = time.perf_counter()
        pool = u.context.pool
        hp = _snapshot(opt.param_groups[e.gi])
        if u.placement.master_tier == "nvme":
            on_disk = u.master.tier == "nvme"  # else a master in memory (store.master_home): stepped on a copy
            master, hm = u.master.read_owned() if on_disk else (u.master.resident().clone(), None)
            ps = u.optim_state
            buf, hs = ps.read_async(pool) if ps.present else (None, None)
            if hm is not None:
                hm.wait()
            if hs is not None:
                hs.wait()
            state: Dict[str, Any] = ps.views(buf)  # stepped in place (runtime/packed_state.py)
            state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in u.optim_small.items()})
            new = step_on_copies(opt, e.gi, hp, master, e.grad, state)
            ctx = _PrivateWrites(u.context)
            swap = u.grad_slot.swap  # the unit's NVMe engine (its master may be in memory)
            if on_disk:
                shadow = tiers.Slot("nvme", "param", u.shard_numel, torch.float32, torch.device("cpu"), swap,
                                    _other_key(u.master.key), u.master.pin, ctx)  # type: ignore[arg-type]
                shadow.set(master, donate=True, recycle=True)
                e.shadows["master"] = shadow
            else:
                e.master = master  # committed by a copy into the master (ShardedOptimizerMixin._commit_shadows)
            per_el, e.new_state = packed_state.split_state(new, u.shard_numel)
            if per_el:  # the moments, packed (in place when stepped in the read buffer) into a shadow
                layout, data = ps.pack(per_el, pool, buf)
                s = ps.new_slot(layout, _other_key(ps.slot.key) if ps.slot is not None else ps.key, ctx)
                s.set(data, donate=True, recycle=True)
                e.shadows["optim"], e.shadow_layout = s, layout
            elif buf is not None:
                pool.release(buf)
            for s in e.shadows.values():
                s.flush()  # the disk has them (errors surface here); their buffers are back in the pool
            pool.release(e.grad)
            e.grad = None
            with self._lock:  # nothing of this unit is held in memory any more, but a stepped master copy
                kept = 0 if on_disk else 4 * u.shard_numel
                self.held_bytes -= e.nbytes - kept
                e.nbytes = kept
        else:
            master = u.master.resident().clone()
            state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in _unit_state(opt, u).items()}
            new = step_on_copies(opt, e.gi, hp, master, e.grad, state)
            extra = _state_bytes(new) - _state_bytes(state)
            with self._lock:
                fits = self.held_bytes + extra <= self.cap_bytes
                if fits:
                    self.held_bytes += extra
                    e.nbytes += extra
                    self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            if not fits:  # the new state would break the cap: leave this unit to the ordinary step
                self.stats["over_cap"] += 1
                e.void = True
                return
            e.master, e.new_state = master, new
        e.hp = hp
        e.stepped = True
        self.stats["speculated"] += 1
        u.context.transfers.trace_span("optimizer", f"speculative step {u.name}", t0, time.perf_counter())

    # -- step side (main thread) -------------------------------------------------------------------
    def drain(self, raise_errors: bool = True) -> None:
        """Wait for every speculative step started so far (``step()`` commits after this)."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        error = None
        for job in jobs:
            try:
                job.wait()
            except BaseException as exc:  # noqa: BLE001 - surfaced below, after every job finished
                error = error or exc
        if error is not None and raise_errors:
            self.clear()
            raise error

    def take(self, u: Any) -> Optional[Entry]:
        """The unit's work if still valid for the step being taken now (removed), else None."""
        with self._lock:
            e = self._entries.pop(u.uid, None)
        if e is None:
            return None
        opt = self._opt()
        valid = (opt is not None and not e.void and e.gv == u.grad_version and e.sv == u.state_version
                 and u.grad_live() and u.grad_slot.present
                 and (not e.grad_borrowed or u.grad_slot.dirty is e.grad))  # evicted to disk: not ours to use
        if valid and e.speculative:
            valid = e.stepped and e.hp is not None and same_hyperparameters(
                e.hp, _snapshot(opt.param_groups[e.gi]))
        if not valid:
            self.stats["rolled_back" if e.speculative else "dropped"] += 1
            self._void(e)
            return None
        self.stats["committed" if e.speculative else "consumed"] += 1
        return e

    def consumed(self, e: Entry) -> None:
        """``e``'s buffers now belong to the step (it returns them to the pool): stop counting them."""
        with self._lock:
            self.held_bytes -= e.nbytes
            e.nbytes = 0
        e.released = True

    def clear(self) -> None:
        """Drop all work not taken by the step that just ran (its buffers and shadows go)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for e in entries:
            self._void(e)

    # -- releasing -----------------------------------------------------------------------------------
    def release(self, e: Entry) -> None:
        """A committed entry's leftovers (its gradient copy, any shadow not taken) go back."""
        self._release(e)

    def _void(self, e: Entry) -> None:
        with self._lock:
            e.void = True
            idle = not e.speculative or e.finished
        if idle:
            self._release(e)
        # else: the worker sees ``void`` when it finishes and releases then

    def _release(self, e: Entry) -> None:
        with self._lock:
            if e.released:
                return
            e.released = True
            self.held_bytes -= e.nbytes
            e.nbytes = 0
        pool = e.unit.context.pool
        for h in (e.master_read, e.state_read):
            if h is not None:
                h.wait()  # a read in flight writes into the buffer: wait before it goes back
        if e.grad is not None and not e.grad_borrowed:
            pool.release(e.grad)
        if e.master_read is not None and e.master is not None:  # pooled prefetch buffers (clones are not)
            pool.release(e.master)
        if e.state_buf is not None:
            pool.release(e.state_buf)
        for s in e.shadows.values():
            s.drop(keep_file=True)  # the unit's next speculation writes this key again: overwrite its file
        e.grad = e.master = None
        e.state_buf = e.state_read = None
        e.shadows, e.new_state = {}, {}


def _other_key(key: str) -> str:
    """The swap key of a shadow of the slot keyed ``key``: the unit's slots alternate between two keys
    per state (``u7.master`` and ``u7.master.s``), so a shadow never writes the current version's key,
    and with ``nvme_reuse_files`` each write overwrites a file the key already owns (a dropped
    shadow or a committed-over slot keeps its file, ``Slot.drop(keep_file=True)``). The lane runs a
    unit's speculations one after another, and a voided one is released before the next starts, so
    two live shadows never share a key."""
    return key[:-2] if key.endswith(".s") else key + ".s"


def _unit_state(opt: Any, u: Any) -> Dict[str, Any]:
    """A memory-tier unit's optimizer state as kept between steps (keyed by the real parameter)."""
    owner = u.parent or u
    p = owner.param()
    st = opt.state.get(p) if p is not None else None
    if not st:
        return {}
    if u.parent is not None:
        tiles = st.get("tiles")
        return tiles[u.tile_index] if tiles is not None and u.tile_index < len(tiles) else {}
    return st


def _state_bytes(st: Dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))


def of(optimizer: Any, create: bool = False) -> Optional[OptimizerOverlap]:
    ov = optimizer.__dict__.get("_zinf_overlap")
    if ov is None and create:
        ov = optimizer.__dict__["_zinf_overlap"] = OptimizerOverlap(optimizer)
    return ov
