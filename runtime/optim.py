"""Optimizers that step partitioned parameters on their fp32 shards with torch's own kernels.

``AdamW`` and ``SGD`` *are* ``torch.optim.AdamW`` / ``torch.optim.SGD`` (same arguments, same
``param_groups``, LR schedulers work), with one change: during ``step`` each partitioned parameter in
``param_groups`` is swapped for its fp32 master shard, whose ``.grad`` is the reduce-scattered
gradient shard, and torch's step runs on those. Elementwise optimizers therefore give bitwise the
same numbers as on the full parameter::

    before: group["params"] = [p (0-byte storage, grad None), ...]
    during: group["params"] = [master shard (fp32, .grad = grad shard), ...]

Optimizer state is keyed by the real parameter between steps, so ``state_dict()`` works (it holds
this rank's shards).
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from . import accounting, comm, optim_overlap, store, transfer
from .modes import outside_inference_mode
from .packed_state import split_state
from .tiers import Slot


@dataclass
class _StepPlan:
    """What one step swapped in: groups' original params, shadows per parameter, units to refresh/stream."""

    swapped: List[tuple[dict, list]] = field(default_factory=list)
    moved: List[tuple[torch.Tensor, List[torch.Tensor]]] = field(default_factory=list)
    touched: List[store.ParamHandle] = field(default_factory=list)
    streamed: List[tuple[int, store.ParamHandle]] = field(default_factory=list)


#: the optimizer state_dict entry that names whose shards the state holds (``ShardedOptimizerMixin.state_dict``)
SHARDS_KEY = "zinf_shards"


def base_step(cls: type) -> Callable:
    """The ``step`` of the torch optimizer class under the mixin, without torch's hook wrapper: hooks fire
    once per logical step (around the mixin's ``step``), not once per NVMe sub-group."""
    mro = cls.__mro__
    for klass in mro[mro.index(ShardedOptimizerMixin) + 1:]:
        if "step" in klass.__dict__:
            fn = klass.__dict__["step"]
            while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
                fn = fn.__wrapped__
            return fn
    raise TypeError(f"zinf: {cls.__name__} has no step() to run on the shards")


class ShardedOptimizerMixin:
    """Mixed into a ``torch.optim`` class; see the module docstring."""

    _zinf_sharded = True
    param_groups: List[dict]
    state: Dict

    def add_param_group(self, param_group: dict) -> None:  # type: ignore[override]
        super().add_param_group(param_group)  # type: ignore[misc]
        register_average_hooks(self, self.param_groups[-1]["params"])

    def _dp_group(self) -> object:
        """The dp group of this optimizer's partitioned parameters (None: the default group)."""
        group = partitioned_group(self)
        return None if group is NOT_OURS else group

    @outside_inference_mode  # runtime/modes.py: its buffers outlive the call
    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        """torch's step of the class under the mixin, run on the shards (hooks: see ``_hooked_once``)."""
        stale = self.__dict__.pop("_zinf_plan", None)  # a step through the plain class that raised
        if stale is not None:
            self._swap_out(stale)
        t0 = time.perf_counter()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_nvme_gradients()
        plan = self._swap_in()
        try:
            base_step(type(self))(self)
        finally:
            self._swap_out(plan)
        self._finish(plan)
        transfer.optimizer_step_done(self, t0)
        return loss

    def _check_nvme_gradients(self) -> None:
        """Raise a failed gradient write (a full disk) of any NVMe unit before the step changes anything.

        Why here, before ``_swap_in``: with ``nvme_min_shard_bytes`` some parameters step in memory
        (and ``_swap_in`` commits their speculative steps) before the NVMe units stream; checked only
        in ``_step_streamed``, a failed NVMe gradient left those stepped and the rest not, half a step
        with no way back. It waits for those writes once, for the streamed step too (which needs them
        done); the flush raises even where the optimizer prefetched a copy of the gradient in memory
        during backward, which would otherwise hide the failed write."""
        for group in self.param_groups:
            for p in group["params"]:
                h = store.handle_of(p)
                if h is not None and h.placement.master_tier == "nvme":
                    for u in h.units():
                        if u.grad_live():
                            u.grad_slot.flush()

    def _patch_step_function(self) -> None:
        """torch wraps ``type(self).step`` with its hook runner; the twin marks calls that came through it,
        so ``optim_adapt.pre_step`` leaves them to ``step`` (it swaps only for a plain class's step)."""
        cls = type(self)
        if not getattr(cls.__dict__.get("step"), "hooked", False):
            hooked = torch.optim.Optimizer.profile_hook_step(cls.step)

            @functools.wraps(hooked)
            def step(opt: "ShardedOptimizerMixin", *args: Any, **kwargs: Any) -> Any:
                depth = opt.__dict__.get("_zinf_in_twin_step", 0)
                opt._zinf_in_twin_step = depth + 1
                try:
                    return hooked(opt, *args, **kwargs)
                finally:
                    opt._zinf_in_twin_step = depth

            step.hooked = True  # type: ignore[attr-defined]
            cls.step = step  # type: ignore[method-assign]
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{cls.__name__}.zero_grad"

    def _swap_in(self) -> "_StepPlan":
        """Put each memory-tier unit's fp32 master shard (its ``.grad`` the gradient shard) in place of the
        partitioned parameter in ``param_groups``; NVMe units are left out, to be streamed after."""
        plan = _StepPlan()
        ov = optim_overlap.of(self)
        if ov is not None:
            ov.drain()  # speculative steps started during backward: finished before any is committed
        try:
            for gi, group in enumerate(self.param_groups):
                originals = group["params"]
                shadows = []
                for p in originals:
                    h = store.handle_of(p)
                    if h is None:
                        shadows.append(p)
                        continue
                    units = h.units()
                    if h.placement.master_tier == "nvme":
                        plan.streamed.extend((gi, u) for u in units if u.grad_live())
                        continue
                    plan.moved.append((p, [u.master.resident() for u in units]))
                    states = self._unit_states(p, len(units))
                    for unit, st in zip(units, states):
                        shadow = unit.master.resident()
                        e = ov.take(unit) if ov is not None else None
                        if e is not None:  # stepped during backward and still valid: commit its result
                            unit.master.set(e.master)
                            st = e.new_state
                            ov.release(e)
                            plan.touched.append(unit)
                            shadow.grad = None  # torch skips it
                            if st:
                                self.state[shadow] = st
                            shadows.append(shadow)
                            continue
                        shadow.grad = unit.grad_shard()  # None: param.grad is None, torch skips it
                        if st:
                            self.state[shadow] = st
                        shadows.append(shadow)
                        if shadow.grad is not None:
                            plan.touched.append(unit)
                plan.swapped.append((group, originals))
                group["params"] = shadows
        except BaseException:
            self._swap_out(plan)
            raise
        return plan

    def _swap_out(self, plan: "_StepPlan") -> None:
        """Undo ``_swap_in``: the real parameters back in ``param_groups``, state keyed by them again."""
        for group, originals in plan.swapped:
            group["params"] = originals
        for p, shadows_of_p in plan.moved:
            states = []
            for shadow in shadows_of_p:
                shadow.grad = None
                states.append(self.state.pop(shadow, {}))
            if len(shadows_of_p) == 1:
                if states[0]:
                    self.state[p] = states[0]
            elif any(states):
                self.state[p] = {"tiles": states}
        plan.swapped, plan.moved = [], []

    def _finish(self, plan: "_StepPlan") -> None:
        """After the memory-tier step: refresh parameter copies, stream the NVMe units, account state."""
        for h in plan.touched:
            h.master_updated()
        if plan.streamed:
            self._step_streamed(plan.streamed)
        self._account_state()
        ov = optim_overlap.of(self, create=True)
        ov.clear()  # work no step took (a unit without gradient now): dropped
        ov.attach()  # the optimizer is known for these parameters now: overlap the next backward

    def _commit_shadows(self, u: store.ParamHandle, e: "optim_overlap.Entry") -> None:
        """Make a unit's speculatively stepped NVMe shadows its master and moment slots (a master in
        memory, ``store.master_home``, takes the stepped copy's values)."""
        if "master" in e.shadows:
            old = u.master
            u.master = e.shadows.pop("master")
            u.master.rehome(old.ctx)  # the model's trackers and cache from now on
            old.drop(keep_file=True)  # the next shadow takes this key again (optim_overlap._other_key)
        else:
            u.master.set(e.master)
            e.master = None
        slot = e.shadows.pop("optim", None)
        if slot is not None:
            slot.rehome(u.context)
            u.optim_state.adopt(slot, e.shadow_layout)
        e.shadows = {}
        u.optim_small.update(e.new_state)
        e.new_state = {}
        u.master_updated()

    def _step_streamed(self, items: List[tuple[int, store.ParamHandle]]) -> None:
        """Step units whose master, gradient and moments live on NVMe, a sub-group at a time.

        Reads of sub-group k+1 are in flight while torch's kernels step sub-group k, a slice
        (``STEP_SLICE_BYTES``) at a time; each slice's writes go out asynchronously while the next
        steps. Resident bytes stay within about three sub-groups.
        """
        # a failed gradient write (a full disk) has already raised: ``step`` checks first
        # (``_check_nvme_gradients``), before any parameter changes
        ov = optim_overlap.of(self)
        ready: Dict[int, optim_overlap.Entry] = {}
        written: List[store.ParamHandle] = []
        if ov is not None:  # work started during backward: commit speculative steps, use prefetched reads
            first, rest = [], []
            for gi, u in items:
                e = ov.take(u)
                if e is None:
                    rest.append((gi, u))
                elif e.speculative:
                    self._commit_shadows(u, e)
                    ov.release(e)
                    written.append(u)
                else:
                    ready[u.uid] = e
                    first.append((gi, u))
            # prefetched units first, their data in memory or on its way, and in the order their
            # gradients became final, which is the order their reads started: the last unit's read
            # (on a GPT, the tied embedding's, final at the very end of backward) then finishes while
            # the others step, instead of first in line (9-19 ms of a 25M dp-2 step's optimizer waited for it)
            first.sort(key=lambda item: ready[item[1].uid].seq)
            items = first + rest
            if not items:
                return
        budget = items[0][1].placement.sub_group_bytes
        groups: List[List[tuple[int, store.ParamHandle]]] = [[]]
        size = 0
        for gi, u in items:
            b = 16 * u.shard_numel
            if groups[-1] and size + b > budget:
                groups.append([])
                size = 0
            groups[-1].append((gi, u))
            size += b

        def read(slot: Slot) -> tuple:
            return slot.read_owned()  # a master backward's fetch left in the read cache: no IO

        def load(group: List[tuple[int, store.ParamHandle]]) -> list:
            out = []
            for gi, u in group:
                e = ready.pop(u.uid, None)
                if e is not None:  # prefetched during backward; its buffers are the step's from here
                    ov.consumed(e)  # type: ignore[union-attr]
                    handles = [h for h in (e.master_read, e.state_read) if h]
                    if e.master is not None:
                        master = e.master
                    elif u.master.tier == "nvme":  # kept in memory (write-back): the prefetch left it there
                        master, hm = u.master.take_for_update()
                        handles += [hm] if hm is not None else []
                    else:
                        master = u.master.resident()
                    grad = e.grad if not e.grad_borrowed else _Borrowed(e.grad)
                    out.append((gi, u, master, grad, e.state_buf, handles))
                    continue
                # a master in memory (store.master_home) is stepped in place: no read, no write
                # an NVMe master kept in memory (write-back) is stepped where it is, else read
                master, hm = u.master.take_for_update() if u.master.tier == "nvme" else (u.master.resident(), None)
                if u.grad_slot.dirty is not None:  # kept in memory (write-back): stepped from there
                    grad, hg = _Borrowed(u.grad_slot.dirty), None
                elif u.grad_slot.present:
                    grad, hg = read(u.grad_slot)
                else:  # zeroed in place (zero_grad(set_to_none=False)): step with zeros, as eager does
                    grad, hg = u.grad_slot.pool.acquire(u.grad_slot.numel, u.grad_slot.dtype).zero_(), None
                # the moments: one packed read (runtime/packed_state.py)
                buf, hs = u.optim_state.read_async(u.context.pool) if u.optim_state.present else (None, None)
                out.append((gi, u, master, grad, buf, [h for h in (hm, hg, hs) if h]))
            return out

        pending = load(groups[0])
        originals = [g["params"] for g in self.param_groups]
        try:
            for k in range(len(groups)):
                loaded, pending = pending, (load(groups[k + 1]) if k + 1 < len(groups) else [])
                for current in _slices(loaded, STEP_SLICE_BYTES):  # its writes go out while the next slice steps
                    lists: List[list] = [[] for _ in self.param_groups]
                    for gi, u, master, grad, buf, handles in current:
                        _wait_reads(handles, u.context.transfers)
                        master.grad = grad.t if isinstance(grad, _Borrowed) else grad
                        state = u.optim_state.views(buf)  # torch steps these views of the read buffer in place
                        state.update(u.optim_small)
                        if state:
                            self.state[master] = state
                        lists[gi].append(master)
                    for g, lst in zip(self.param_groups, lists):
                        g["params"] = lst
                    base_step(type(self))(self)
                    for gi, u, master, grad, buf, _ in current:
                        master.grad = None
                        if not isinstance(grad, _Borrowed):  # the slot's own value stays the slot's
                            u.grad_slot.pool.release(grad)
                        u.master_updated(master)
                        if u.master.tier == "nvme":  # buffers return once written; with write-back, kept
                            # in memory as the slot's value until ctx.kept evicts it (the next
                            # fetches read it there: no write, no read while it stays)
                            u.master.set(master, donate=True, recycle=True, defer=u.placement.param_write_back)
                        per_el, small = split_state(self.state.pop(master, {}), u.shard_numel)
                        u.optim_small.update(small)
                        u.optim_state.store(per_el, u.context.pool, buf)  # buf (stepped in place) is written
                        written.append(u)
        finally:
            for g, lst in zip(self.param_groups, originals):
                g["params"] = lst
        for u in written:  # surface write errors (e.g. a full disk) here, naming the path
            for slot in (u.master, u.param_copy, u.optim_state.slot):
                if slot is not None:
                    slot.flush()

    def _unit_states(self, p: torch.Tensor, n: int) -> List[dict]:
        """The optimizer state of each unit of ``p`` (one, or one per tile under key ``"tiles"``)."""
        st = self.state.pop(p, None) if p in self.state else None
        if not st:
            return [{} for _ in range(n)]
        if n == 1:
            return [st]
        tiles = st.get("tiles")
        if tiles is None or len(tiles) != n:
            raise RuntimeError(
                f"zinf: optimizer state of a parameter does not match its {n} tiles; the parameter was "
                "re-tiled after optimizer steps. Keep tiling options fixed across compiles of one model."
            )
        return list(tiles)

    @outside_inference_mode  # runtime/modes.py: its buffers outlive the call
    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """torch's ``zero_grad`` (``param.grad`` of a partitioned parameter is its ``ShardedGrad``:
        set to None or zeroed in place on its tier); with ``set_to_none`` the shards' memory goes too."""
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        if set_to_none:
            for group in self.param_groups:
                for _, h in store.iter_handles(group["params"]):
                    h.zero_grad(True)

    @outside_inference_mode  # runtime/modes.py: its buffers outlive the call
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters (kept for old callers:
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` itself works on zinf gradients)."""
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    # -- checkpoints ---------------------------------------------------------------------------
    def _indexed_params(self) -> List[tuple[int, torch.Tensor]]:
        """(index in ``state_dict()["state"]``, param), numbered as ``torch.optim.Optimizer`` does."""
        out, seen, start = [], set(), 0
        for group in self.param_groups:
            for i, p in enumerate(group["params"], start):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((i, p))
            start += len(group["params"])
        return out

    def _shards_held(self) -> Optional[Dict[str, int]]:
        """Whose shards this optimizer's state holds: the rank and size of its partitioned parameters'
        dp group (None: it holds no partitioned parameter)."""
        for group in self.param_groups:
            for _, h in store.iter_handles(group["params"]):
                return {"rank": h.rank, "world": h.world}
        return None

    @outside_inference_mode  # runtime/modes.py: its buffers outlive the call
    def state_dict(self) -> Dict:  # type: ignore[override]
        """torch's state dict; NVMe-resident moments are read into it (this rank's shards). Entry
        ``SHARDS_KEY`` says whose shards they are, so that ``load_state_dict`` can refuse another
        rank's: every rank's moments have the same shapes, and a loop that saves on rank 0 only (the
        usual ``if rank == 0: torch.save(opt.state_dict(), f)``, accelerate's ``save_state``) would
        otherwise give rank 1 rank 0's moments without a word."""
        sd = super().state_dict()  # type: ignore[misc]
        held = self._shards_held()
        if held is not None:
            sd[SHARDS_KEY] = held
        memory_states = bool(sd["state"])
        added = False
        for idx, p in self._indexed_params():
            h = store.handle_of(p)
            if h is None or h.placement.master_tier != "nvme":
                continue
            states = []
            for u in h.units():
                st = {k: v.clone() for k, v in u.optim_state.get().items()}  # each its own storage, as eager's
                st.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in u.optim_small.items()})
                states.append(st)
            if any(states):
                sd["state"][idx] = states[0] if len(states) == 1 else {"tiles": states}
                added = True
        if added and memory_states:
            # some parameters step in memory (``nvme_min_shard_bytes``), the rest from NVMe: the NVMe
            # states went in after all memory ones; in parameter order, as eager's first step makes them
            sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    @outside_inference_mode  # runtime/modes.py: its buffers outlive the call
    def load_state_dict(self, state_dict: Dict) -> None:  # type: ignore[override]
        """torch's ``load_state_dict``; a partitioned parameter's state goes back onto its optimizer tier
        (fp32 moments on the master's device, or into its NVMe slots), not onto the compute device.
        A state dict of another rank's shards (``SHARDS_KEY``) is refused before anything changes."""
        theirs, here = state_dict.get(SHARDS_KEY), self._shards_held()
        if theirs is not None and here is not None and theirs != here:
            raise ValueError(
                f"zinf: this optimizer state_dict holds the shards of rank {theirs['rank']} of {theirs['world']}, "
                f"but this is rank {here['rank']} of {here['world']}: each rank's optimizer state is its own "
                "shard of every moment. Save optimizer.state_dict() on every rank, each to a file of its own, "
                "and load each rank's file on that rank at the same dp size; or checkpoint with "
                "zinf_compile.save / zinf_compile.load, which reload at any dp size. Nothing was loaded.")
        state_dict = {k: v for k, v in state_dict.items() if k != SHARDS_KEY}
        saved = dict(state_dict["state"])
        mine: Dict[int, tuple[torch.Tensor, store.ParamHandle, dict]] = {}
        for idx, p in self._indexed_params():
            h = store.handle_of(p)
            if h is not None and idx in saved:
                mine[idx] = (p, h, saved.pop(idx))
        super().load_state_dict({**state_dict, "state": saved})  # type: ignore[misc]
        for idx, (p, h, st) in mine.items():
            self._adopt_state(p, h, st)
        self._account_state()

    def _adopt_state(self, p: torch.Tensor, h: store.ParamHandle, st: dict) -> None:
        """Take ``st`` (a saved state of ``p``: one dict, or ``{"tiles": [...]}``) onto ``p``'s tier."""
        units = h.units()
        per_unit = st.get("tiles") if len(units) > 1 else [st]
        if per_unit is None and h.tiles is not None:  # full-shaped state (made at construction): split
            per_unit = [{k: (v.narrow(h.tile_dim, lo, hi - lo) if torch.is_tensor(v) and tuple(v.shape) == h.shape
                             else v) for k, v in st.items()} for lo, hi in h.tile_bounds]
        if per_unit is None or len(per_unit) != len(units):
            raise ValueError(f"zinf: saved optimizer state of {h.name!r} does not match its {len(units)} "
                             "tile(s); load with the same tiling options it was saved with")
        placed = [self._place_state(u, dict(s)) for u, s in zip(units, per_unit)]
        if h.placement.master_tier != "nvme":
            self.state[p] = placed[0] if len(units) == 1 else {"tiles": placed}

    def _place_state(self, u: store.ParamHandle, st: dict) -> dict:
        """One unit's state on its tier: per-element tensors must be this rank's shard size."""
        device = u.placement.storage_device()
        u.state_version += 1  # work started on the old state (optim_overlap) is void
        out = {}
        for name, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == u.shape and u.shape != (u.shard_numel,):
                # a full-shaped state, created over the whole parameter (Adagrad's ``sum`` at construction):
                # this rank's slice of it, padded like the shards
                flat = v.detach().reshape(-1)
                lo = u.shard_lo
                own = torch.zeros(u.shard_numel, dtype=v.dtype, device=v.device)
                piece = flat[lo : min(lo + u.shard_numel, u.numel)]
                own[: piece.numel()].copy_(piece)
                v = own
            if torch.is_tensor(v) and v.dim() > 0:
                if v.numel() != u.shard_numel:
                    raise ValueError(
                        f"zinf: optimizer state {name!r} of {u.name!r} has {v.numel()} elements, but this "
                        f"rank's shard has {u.shard_numel}: it was saved with another dp size or model")
                v = v.detach().reshape(-1).to(device=device,
                                              dtype=torch.float32 if v.is_floating_point() else v.dtype)
            out[name] = v
        if u.placement.master_tier == "nvme":
            per_el, small = split_state(out, u.shard_numel)  # tensors of dim > 0 have shard_numel (checked)
            u.optim_small.clear()
            u.optim_small.update(small)
            u.optim_state.store(per_el, u.context.pool)  # packed into one file (runtime/packed_state.py)
            return {}
        return out

    def _account_state(self) -> None:
        """Add this optimizer's state bytes per tier to the accounting (as a delta: several coexist)."""
        per_tier: Dict[str, int] = {}
        for p, st in self.state.items():
            h = store.handle_of(p)
            tier = h.placement.master_tier if h is not None else "device"
            n = sum(v.numel() * v.element_size() for d in st.get("tiles", [st]) for v in d.values() if torch.is_tensor(v))
            per_tier[tier] = per_tier.get(tier, 0) + n
        before: Dict[str, int] = getattr(self, "_zinf_state_bytes", {})
        for tier in set(per_tier) | set(before):
            accounting.add(tier, "optim", per_tier.get(tier, 0) - before.get(tier, 0))
        self._zinf_state_bytes = per_tier


STEP_SLICE_BYTES = 16 << 20  # state bytes (16 per element) torch steps at once in a streamed sub-group


def _slices(items: list, nbytes: int) -> List[list]:
    """``items`` (``(gi, unit, ...)`` tuples of a loaded sub-group) in runs of about ``nbytes`` of state.

    Why: the streamed step writes a unit's results once torch has stepped it. Stepped as one call, a
    sub-group (256 MiB by default: all of a small model's state) sent all its writes after all its
    math, and the step then waited for the whole tail (62 of the optimizer's 155 ms on the 25M GPT at
    dp 2; 13 ms in slices, README "Moments in one file"); in slices, each slice's writes go out while
    the next one steps. Same math:
    torch's optimizers step each parameter on its own (so do the sub-groups).
    """
    out: List[list] = [[]]
    size = 0
    for it in items:
        b = 16 * it[1].shard_numel
        if out[-1] and size + b > nbytes:
            out.append([])
            size = 0
        out[-1].append(it)
        size += b
    return out if out[0] else []


def _wait_reads(handles: list, transfers: "transfer.TransferEngine") -> None:
    """Wait for a unit's optimizer reads (master, gradient, moments); with a step trace, record each
    read in the ``nvme_read`` lane (submitted to finished) and the time blocked in the ``wait`` lane.

    Why here: a fetch's read is traced by its transfer ticket, but the optimizer reads its state with
    the swap engine directly, so before this an NVMe step's trace showed none of the reads its
    optimizer waited for."""
    if transfers.tracer is None:
        for h in handles:
            h.wait()
        return
    for h in handles:
        t0 = time.perf_counter()
        h.wait()
        t1 = time.perf_counter()
        transfers.trace_span("nvme_read", h.key, h.t_start, h.t_done, nbytes=h.nbytes)
        if t1 - t0 > 20e-6:  # as transfer.finish: shorter is the wait call itself
            transfers.trace_span("wait", f"wait nvme_read {h.key}", t0, t1)


class _Borrowed:
    """A gradient the streamed step uses in place of a copy: the slot's deferred value (``Slot.dirty``),
    still the slot's afterwards (``zero_grad`` frees it). Like a memory tier's, and like eager's
    ``p.grad``, it is what the optimizer sees."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


NOT_OURS = object()  # partitioned_group's answer for an optimizer holding no partitioned parameter


def partitioned_group(optimizer: torch.optim.Optimizer) -> object:
    """The dp group of the optimizer's partitioned parameters (None: the default group), or
    ``NOT_OURS`` when it holds none."""
    for group in optimizer.param_groups:
        for _, h in store.iter_handles(group["params"]):
            return h.placement.group
    return NOT_OURS


def average_over_dp(grad: torch.Tensor, group: object) -> None:
    """``grad`` (a replicated parameter's) becomes its mean over the dp group, in place."""
    world = comm.world_size(group)  # type: ignore[arg-type]
    if world > 1:
        comm.all_reduce_sum(grad, group)  # type: ignore[arg-type]
        grad.div_(world)


class _Owners:
    """The optimizers a replicated parameter's averaging hook serves (weakly), and that hook's handle.

    Kept on the parameter; it pickles empty and unhooked (``torch.save`` of a module pickles its
    parameters' attributes; a loaded parameter has neither optimizer nor hook, and gets both anew)."""

    def __init__(self) -> None:
        self.refs: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.handle: Any = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


def register_average_hooks(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> List[torch.Tensor]:
    """Make ``optimizer`` one of the owners whose dp group ``_average_replicated`` averages each of
    ``params`` over (the hook itself is registered once per parameter). Returns the parameters that
    no zinf optimizer owned until now: their gradient so far, if any, was accumulated unaveraged.

    The owners are weak: an optimizer made again for the same model (a second ``Trainer.fit``, a
    re-created optimizer) joins them, and one that is gone stops counting; a hook tied to the first
    optimizer alone stopped averaging once that optimizer was collected."""
    fresh = []
    ours: Dict[int, bool] = {}  # per owner, asked once per call (a scan of its parameters)
    for p in params:
        if not p.requires_grad:
            continue
        owners = p.__dict__.get("_zinf_average_owners")
        if owners is None:
            owners = p._zinf_average_owners = _Owners()
        if owners.handle is None:
            owners.handle = p.register_post_accumulate_grad_hook(_average_replicated)
        if optimizer not in owners.refs:
            if not any(ours.setdefault(id(o), partitioned_group(o) is not NOT_OURS) for o in list(owners.refs)):
                fresh.append(p)
            owners.refs.add(optimizer)
    return fresh


def unregister_average_hooks(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> None:
    """Undo ``register_average_hooks`` for ``optimizer`` (the hook goes with its last owner)."""
    for p in params:
        owners = p.__dict__.get("_zinf_average_owners")
        if owners is None:
            continue
        owners.refs.discard(optimizer)
        if not owners.refs and owners.handle is not None:
            owners.handle.remove()
            owners.handle = None


def _average_replicated(p: torch.Tensor) -> None:
    """A post-accumulate-grad hook: a parameter no compiled graph partitions (used only in eager code)
    is replicated on every rank, so its gradient is averaged over dp as DDP does. Averaging the
    accumulated ``.grad`` after each backward is exact: mean(mean(g1) + g2) = mean(g1) + mean(g2).

    Over the dp group of the first live owner (``register_average_hooks``) that holds partitioned
    parameters. It may be registered before anything is partitioned (a plain optimizer whose first
    step runs the first forward in its closure: ``optim_adapt.pre_step``), so it asks at each call; an
    optimizer that holds none is not zinf's to average for."""
    if store.handle_of(p) is not None or p.grad is None:
        return
    owners = p.__dict__.get("_zinf_average_owners")
    for opt in list(owners.refs) if owners is not None else ():
        group = partitioned_group(opt)
        if group is not NOT_OURS:
            average_over_dp(p.grad, group)
            return


class AdamW(ShardedOptimizerMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` on zinf's fp32 parameter shards."""


class SGD(ShardedOptimizerMixin, torch.optim.SGD):
    """``torch.optim.SGD`` on zinf's fp32 parameter shards."""


class Adam(ShardedOptimizerMixin, torch.optim.Adam):
    """``torch.optim.Adam`` on zinf's fp32 parameter shards."""
