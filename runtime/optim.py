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
        moved: List[tuple[torch.Tensor, torch.Tensor]] = []
        touched: List[store.ParamHandle] = []
        try:
            for group in self.param_groups:
                originals = group["params"]
                shadows = []
                for p in originals:
                    h = store.handle_of(p)
                    if h is None:
                        shadows.append(p)
                        continue
                    shadow = h.master
                    shadow.grad = h.grad
                    if p in self.state:
                        self.state[shadow] = self.state.pop(p)
                    moved.append((p, shadow))
                    shadows.append(shadow)
                    if h.grad is not None:
                        touched.append(h)
                swapped.append((group, originals))
                group["params"] = shadows
            super().step()  # type: ignore[misc]
        finally:
            for group, originals in swapped:
                group["params"] = originals
            for p, shadow in moved:
                shadow.grad = None
                if shadow in self.state:
                    self.state[p] = self.state.pop(shadow)
        for h in touched:
            h.master_updated()
        self._account_state()
        return loss

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
                    if h.grad is not None:
                        grads.append(h.grad)
                        group_of_grads = h.placement.group
                elif p.grad is not None:
                    grads.append(p.grad)
        total = torch.zeros((), dtype=torch.float64)
        for g in grads:
            total += g.detach().double().pow(2).sum().cpu()
        comm.all_reduce_sum(total, group_of_grads)
        norm = total.sqrt().float()
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0 and math.isfinite(coef):
            for g in grads:
                g.mul_(coef)
        return norm

    def _account_state(self) -> None:
        per_tier: Dict[str, int] = {}
        for p, st in self.state.items():
            h = store.handle_of(p)
            tier = h.placement.tier if h is not None else "device"
            n = sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
            per_tier[tier] = per_tier.get(tier, 0) + n
        for tier, n in per_tier.items():
            accounting.set_bytes(tier, "optim", n)


class AdamW(ShardedOptimizerMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` on zinf's fp32 parameter shards."""


class SGD(ShardedOptimizerMixin, torch.optim.SGD):
    """``torch.optim.SGD`` on zinf's fp32 parameter shards."""


class Adam(ShardedOptimizerMixin, torch.optim.Adam):
    """``torch.optim.Adam`` on zinf's fp32 parameter shards."""
