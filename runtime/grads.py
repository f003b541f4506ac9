"""``param.grad`` of a partitioned parameter: a sharded gradient that torch's own utilities understand.

zinf reduce-scatters a partitioned parameter's gradient inside the backward graph into fp32 shards on
the optimizer's tier; the full gradient never exists. Training loops still look at ``param.grad``:
HF ``Trainer`` calls ``model.zero_grad()``, ``torch.nn.utils.clip_grad_norm_(model.parameters())``,
``GradScaler.unscale_``. So, as FSDP2 does with DTensor, ``param.grad`` is a tensor of the parameter's
shape whose data are this rank's shards::

    before: p.grad is None, the shards accumulate until zinf's own zero_grad, clip sees nothing
    after:  p.grad = ShardedGrad(p)             (full shape and dtype, 0 bytes of its own)
            p.grad = None / p.grad.zero_()      -> the next backward starts from zero, like autograd
            torch.linalg.vector_norm(p.grad)    -> a _PartialNorm (this rank's share, no collective)
            torch.stack([partial norms...])     -> one all-reduce for every norm, then plain tensors
            p.grad.mul_(coef)                   -> scales the shards in place on their tier
            torch._amp_foreach_non_finite_check_and_unscale_([grads], found_inf, inv_scale)
                                                -> unscales the shards; found_inf is max-reduced over dp
            anything else (p.grad.sum(), ...)   -> computed on the full gradient (collective when dp > 1)

Replicated gradients (parameters no graph partitions) are plain tensors: their norms are the same on
every rank, so ``torch.stack`` counts them once. An in-place op that is not a scaling or zeroing raises:
writing into the shards through an arbitrary op would need the full gradient on every rank.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch.utils._pytree import tree_map

from . import comm

aten = torch.ops.aten


class ShardedGrad(torch.Tensor):
    """The gradient of a partitioned parameter; its data are the handle's gradient shards."""

    _zinf_handle: Any

    @staticmethod
    def __new__(cls, param: torch.Tensor, handle: Any) -> "ShardedGrad":
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device,
                                                requires_grad=False)
        t._zinf_handle = handle
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        h = self._zinf_handle
        return (f"ShardedGrad(shape={tuple(self.shape)}, {h.name!r}, 1/{h.world} per rank on "
                f"{h.placement.master_tier}; full value: .full_tensor())")

    # -- reading -------------------------------------------------------------------------------
    def local_shards(self) -> List[torch.Tensor]:
        """This rank's fp32 gradient shard of each unit (one, or one per tile), padding excluded."""
        return [u.grad_values() for u in self._zinf_handle.units()]

    def full_tensor(self) -> torch.Tensor:
        """The full gradient on the parameter's device (collective when dp > 1: call on every rank)."""
        h = self._zinf_handle
        return h.full_grad().to(device=self.device, dtype=self.dtype)

    # -- writing -------------------------------------------------------------------------------
    def _scale(self, factor: torch.Tensor | float) -> None:
        f = factor.item() if torch.is_tensor(factor) else float(factor)
        for u in self._zinf_handle.units():
            u.scale_grad(f)

    def _zero(self) -> None:
        for u in self._zinf_handle.units():
            u.zero_grad(set_to_none=False)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if _is_inplace(func):
            raise RuntimeError(
                f"zinf: {func} writes into the gradient of a partitioned parameter, whose data are sharded "
                "across ranks and tiers. Supported in-place ops: mul_/div_ by a scalar (clipping, "
                "unscaling), zero_(). Assign a full tensor to param.grad instead, or read the value with "
                "param.grad.full_tensor(). A DistributedDataParallel (or FSDP) wrapper around a zinf model "
                "ends here too, its reducer writing every gradient: remove the wrapper, since zinf "
                "reduce-scatters the gradients itself over torch.distributed's default group (option "
                "process_group); with Lightning, pass Trainer(strategy=zinf_compile.lightning.ZinfStrategy()), "
                "which runs the processes without the wrapper; with accelerate, leave the model out of "
                "accelerator.prepare(...) and prepare the rest (optimizer, scheduler, data loaders). The "
                "Hugging Face Trainer (through accelerate) wraps the model in DistributedDataParallel "
                "whenever more than one process runs: use zinf_compile.hf.ZinfTrainer, the Trainer without "
                "the wrapper and with sharded checkpoints.")
        return func(*tree_map(_materialize, args), **tree_map(_materialize, kwargs))


def _is_inplace(func: Any) -> bool:
    schema = func._schema
    return func.__name__.split(".")[0].endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                                            for a in schema.arguments)


def _materialize(x: Any) -> Any:
    if isinstance(x, ShardedGrad):
        return x.full_tensor()
    if isinstance(x, _PartialNorm):
        return reduce_norms([x])[0]
    return x


class _PartialNorm(torch.Tensor):
    """A 0-dim p-norm whose reduction over the dp group is still pending.

    ``local`` holds this rank's norm; the group's norm is ``(sum over ranks of local**p)**(1/p)`` (max for
    ``p = inf``). Reducing waits until the norms are stacked, so clipping costs one collective.
    """

    local: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor, ord: float, group: Any, world: int) -> "_PartialNorm":
        t = torch.Tensor._make_wrapper_subclass(cls, (), dtype=local.dtype, device=local.device)
        t.local, t.ord, t.group, t.world = local, ord, group, world
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"_PartialNorm(ord={self.ord}, local={self.local.item():.6g}, pending reduction over {self.world})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None):
        kwargs = kwargs or {}
        pending = [x for x in _flat(args) + _flat(list(kwargs.values())) if isinstance(x, _PartialNorm)]
        done = dict(zip(map(id, pending), reduce_norms(pending)))
        swap = lambda x: done[id(x)] if isinstance(x, _PartialNorm) else x  # noqa: E731
        return func(*tree_map(swap, args), **tree_map(swap, kwargs))


def _flat(xs: Sequence[Any]) -> List[Any]:
    out: List[Any] = []
    for x in xs:
        out.extend(_flat(x) if isinstance(x, (list, tuple)) else [x])
    return out


def reduce_norms(norms: Sequence[_PartialNorm]) -> List[torch.Tensor]:
    """Finish several pending norms with one collective per (group, ord) (none at dp = 1)."""
    out: Dict[int, torch.Tensor] = {}
    by_key: Dict[tuple, List[_PartialNorm]] = {}
    for n in norms:
        by_key.setdefault((id(n.group), n.ord, n.world), []).append(n)
    for (_, ord, world), items in by_key.items():
        locals_ = torch.stack([n.local.detach().to(torch.float64).reshape(()) for n in items])
        if world > 1:
            if math.isinf(ord):
                comm.all_reduce_max(locals_, items[0].group)
                total = locals_
            else:
                powered = locals_.pow(ord) if ord != 0 else locals_
                comm.all_reduce_sum(powered, items[0].group)
                total = powered.pow(1.0 / ord) if ord != 0 else powered
        else:
            total = locals_
        for n, v in zip(items, total):
            out[id(n)] = n.local if world == 1 else v.to(n.local.dtype)
    return [out[id(n)] for n in norms]


def _norm_of(g: ShardedGrad, ord: float, dtype: Optional[torch.dtype]) -> _PartialNorm:
    h = g._zinf_handle
    if ord < 0 or math.isnan(ord):
        raise ValueError(f"zinf: norm of order {ord} of a sharded gradient is not supported (use ord >= 0 or inf)")
    shards = g.local_shards()
    # an empty shard (a rank that owns none of the parameter: partition="broadcast", or numel < dp)
    # contributes 0, the identity of every norm's reduction; torch refuses the inf norm of an empty tensor
    parts = [torch.linalg.vector_norm(s, ord, dtype=dtype) if s.numel() else
             torch.zeros((), dtype=dtype or s.dtype, device=s.device) for s in shards]
    local = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), ord)
    local = local.to(device=g.device, dtype=dtype or g.dtype)
    return _PartialNorm(local, float(ord), h.placement.group, h.world)


def _vector_norm(x: Any, ord: float = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    if dim is not None and not (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return aten.linalg_vector_norm.default(_materialize(x), ord, dim, keepdim, dtype=dtype)
    if keepdim:
        return aten.linalg_vector_norm.default(_materialize(x), ord, dim, keepdim, dtype=dtype)
    return _norm_of(x, float(ord), dtype)


def _foreach_norm(tensors: Sequence[Any], ord: float = 2, dtype: Any = None) -> List[Any]:
    out = []
    for t in tensors:
        out.append(_norm_of(t, float(ord), dtype) if isinstance(t, ShardedGrad)
                   else torch.linalg.vector_norm(t, ord, dtype=dtype))
    return out


def _scalar(x: Any, what: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise RuntimeError(f"zinf: {what} of a sharded gradient by a tensor of {x.numel()} elements; "
                               "only scalars are supported")
        x = _materialize(x)
        return float(x.item())
    return float(x)


def _mul_(g: ShardedGrad, other: Any) -> ShardedGrad:
    g._scale(_scalar(other, "mul_"))
    return g


def _div_(g: ShardedGrad, other: Any, **kw: Any) -> ShardedGrad:
    if kw.get("rounding_mode") is not None:
        raise RuntimeError("zinf: div_ with a rounding mode on a sharded gradient is not supported")
    g._scale(1.0 / _scalar(other, "div_"))
    return g


def _zero_(g: ShardedGrad) -> ShardedGrad:
    g._zero()
    return g


def _fill_(g: ShardedGrad, value: Any) -> ShardedGrad:
    if _scalar(value, "fill_") != 0.0:
        raise RuntimeError("zinf: fill_ of a sharded gradient supports only 0 (zero_grad)")
    g._zero()
    return g


def _foreach_scale(op: Callable[[ShardedGrad, Any], Any], plain_op: Any) -> Callable[..., None]:
    def run(tensors: Sequence[Any], other: Any) -> None:
        others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
        for t, o in zip(tensors, others):
            if isinstance(t, ShardedGrad):
                op(t, o)
            else:
                plain_op(t, _materialize(o))

    return run


def _unscale(grads: Sequence[Any], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's check-and-unscale: shards are checked and scaled; ``found_inf`` agrees across dp."""
    plain = [g for g in grads if not isinstance(g, ShardedGrad)]
    sharded = [g for g in grads if isinstance(g, ShardedGrad)]
    if plain:
        torch._amp_foreach_non_finite_check_and_unscale_(plain, found_inf, inv_scale)
    inv = float(inv_scale.item())
    bad = False
    groups = {}
    for g in sharded:
        for s in g.local_shards():
            bad = bad or not bool(torch.isfinite(s).all())
        g._scale(inv)
        h = g._zinf_handle
        if h.world > 1:
            groups[id(h.placement.group)] = h.placement.group
    if bad:
        found_inf.fill_(1.0)
    for group in groups.values():
        comm.all_reduce_max(found_inf, group)


def _detach(g: ShardedGrad) -> ShardedGrad:
    return ShardedGrad(g, g._zinf_handle)  # another view of the same shards


_HANDLERS: Dict[Any, Callable[..., Any]] = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten.mul_.Tensor: _mul_,
    aten.mul_.Scalar: _mul_,
    aten.div_.Tensor: _div_,
    aten.div_.Scalar: _div_,
    aten.div_.Tensor_mode: _div_,
    aten.zero_.default: _zero_,
    aten.fill_.Scalar: _fill_,
    aten.fill_.Tensor: _fill_,
    aten._foreach_mul_.Tensor: _foreach_scale(_mul_, lambda t, o: t.mul_(o)),
    aten._foreach_mul_.Scalar: _foreach_scale(_mul_, lambda t, o: t.mul_(o)),
    aten._foreach_mul_.ScalarList: _foreach_scale(_mul_, lambda t, o: t.mul_(o)),
    aten._foreach_div_.Tensor: _foreach_scale(_div_, lambda t, o: t.div_(o)),
    aten._foreach_div_.Scalar: _foreach_scale(_div_, lambda t, o: t.div_(o)),
    aten._foreach_zero_.default: lambda ts: [(_zero_(t) if isinstance(t, ShardedGrad) else t.zero_()) for t in ts]
    and None,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale,
    aten.detach.default: _detach,
    aten.alias.default: _detach,
}
