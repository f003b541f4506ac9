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

import math
from typing import Callable, Dict, List, Optional

import torch

from . import accounting, comm, store
from .tiers import Slot


class ShardedOptimizerMixin:
    """Mixed into a ``torch.optim`` class; see the module docstring."""

    _zinf_sharded = True
    param_groups: List[dict]
    state: Dict

    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        swapped: List[tuple[dict, list]] = []
        moved: List[tuple[torch.Tensor, List[torch.Tensor]]] = []
        touched: List[store.ParamHandle] = []
        streamed: List[tuple[int, store.ParamHandle]] = []
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
                        streamed.extend((gi, u) for u in units if u.grad_slot.present)
                        continue
                    moved.append((p, [u.master.resident() for u in units]))
                    states = self._unit_states(p, len(units))
                    for unit, st in zip(units, states):
                        shadow = unit.master.resident()
                        shadow.grad = unit.grad_slot.resident()
                        if st:
                            self.state[shadow] = st
                        shadows.append(shadow)
                        if unit.grad_slot.present:
                            touched.append(unit)
                swapped.append((group, originals))
                group["params"] = shadows
            super().step()  # type: ignore[misc]
        finally:
            for group, originals in swapped:
                group["params"] = originals
            for p, shadows_of_p in moved:
                states = []
                for shadow in shadows_of_p:
                    shadow.grad = None
                    states.append(self.state.pop(shadow, {}))
                if len(shadows_of_p) == 1:
                    if states[0]:
                        self.state[p] = states[0]
                elif any(states):
                    self.state[p] = {"tiles": states}
        for h in touched:
            h.master_updated()
        if streamed:
            self._step_streamed(streamed)
        self._account_state()
        return loss

    def _step_streamed(self, items: List[tuple[int, store.ParamHandle]]) -> None:
        """Step units whose master, gradient and moments live on NVMe, a sub-group at a time.

        Reads of sub-group k+1 are in flight while torch's kernels step sub-group k; writes of
        sub-group k go out asynchronously. Resident bytes stay within about three sub-groups.
        """
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
            return slot.get_async(out=slot.pool.acquire(slot.numel, slot.dtype))

        def load(group: List[tuple[int, store.ParamHandle]]) -> list:
            out = []
            for gi, u in group:
                master, hm = read(u.master)
                grad, hg = read(u.grad_slot)
                st = {k: read(slot) for k, slot in u.optim_slots.items()}
                out.append((gi, u, master, grad, st, [h for h in (hm, hg, *(h for _, h in st.values())) if h]))
            return out

        pending = load(groups[0])
        written: List[store.ParamHandle] = []
        originals = [g["params"] for g in self.param_groups]
        try:
            for k in range(len(groups)):
                current, pending = pending, (load(groups[k + 1]) if k + 1 < len(groups) else [])
                lists: List[list] = [[] for _ in self.param_groups]
                for gi, u, master, grad, st, handles in current:
                    for h in handles:
                        h.wait()
                    master.grad = grad
                    state = {name: t for name, (t, _) in st.items()}
                    state.update(u.optim_small)
                    if state:
                        self.state[master] = state
                    lists[gi].append(master)
                for g, lst in zip(self.param_groups, lists):
                    g["params"] = lst
                super().step()  # type: ignore[misc]
                for gi, u, master, grad, st, _ in current:
                    master.grad = None
                    u.grad_slot.pool.release(grad)
                    u.master_updated(master)
                    u.master.set(master, donate=True, recycle=True)  # buffers return once written
                    for name, value in self.state.pop(master, {}).items():
                        if torch.is_tensor(value) and value.numel() == u.shard_numel:
                            if name not in u.optim_slots:
                                u.optim_slots[name] = u._slot("nvme", "optim", value.dtype, f"optim.{name}")
                            u.optim_slots[name].set(value, donate=True, recycle=True)
                        else:
                            u.optim_small[name] = value
                    written.append(u)
        finally:
            for g, lst in zip(self.param_groups, originals):
                g["params"] = lst
        for u in written:  # surface write errors (e.g. a full disk) here, naming the path
            for slot in (u.master, u.param_copy, *u.optim_slots.values()):
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

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        for group in self.param_groups:
            for _, h in store.iter_handles(group["params"]):
                h.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradient shards (and plain ``.grad``s).

        ``clip_grad_norm_(model.parameters())`` sees ``param.grad is None`` for partitioned
        parameters; this one reduces the norm over every rank's shards instead.
        """
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_: only norm_type=2.0 is supported, got {norm_type}")
        grads: List[torch.Tensor] = []
        group_of_grads = None
        for group in self.param_groups:
            for p in group["params"]:
                h = store.handle_of(p)
                if h is not None:
                    for unit in h.units():
                        if unit.grad_slot.present:
                            grads.append(unit.grad_slot)
                            group_of_grads = h.placement.group
                elif p.grad is not None:
                    grads.append(p.grad)
        def value(g: object) -> torch.Tensor:
            return g.get() if isinstance(g, Slot) else g  # type: ignore[return-value]

        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            total += value(g).detach().double().pow(2).sum().cpu()
        comm.all_reduce_sum(total, group_of_grads)
        norm = total.sqrt().float()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0 and math.isfinite(coef):
            for g in grads:
                t = value(g)
                t.mul_(coef)
                if isinstance(g, Slot) and g.tier == "nvme":
                    g.set(t)
        return norm

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


class AdamW(ShardedOptimizerMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` on zinf's fp32 parameter shards."""


class SGD(ShardedOptimizerMixin, torch.optim.SGD):
    """``torch.optim.SGD`` on zinf's fp32 parameter shards."""


class Adam(ShardedOptimizerMixin, torch.optim.Adam):
    """``torch.optim.Adam`` on zinf's fp32 parameter shards."""
