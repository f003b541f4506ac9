"""Any ``torch.optim`` optimizer steps partitioned parameters, unchanged.

A training script builds ``torch.optim.AdamW(groups, ...)`` over the model's parameters; after zinf
partitions them their data live in 1/dp fp32 shards. The optimizer keeps its class, arguments,
``param_groups``, hooks and schedulers; on its first step it becomes the sharded twin of its class
(``ShardedOptimizerMixin`` + the class itself, still an instance of it), whose ``step`` runs the class's
own update on the shards::

    before: torch.optim.AdamW(...).step()  -> error: cannot step a partitioned parameter
    after:  first step: probe (is the update elementwise?) -> swap shards in -> the class's step -> swap out
            later steps: type(opt) is the twin (isinstance(opt, torch.optim.AdamW) still holds)

Stepping shards is exact only for updates that treat each element on its own. That is decided from
behaviour, not from names: before the first step the optimizer's own step runs on a 4x6 probe tensor
and, separately, on its two flat halves; an optimizer whose halves move differently (a trust ratio from
a norm, an orthogonalized matrix, a factored moment) or that refuses 1-D tensors is refused by name.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections import defaultdict
from typing import Any, Dict, Optional

import torch

from . import comm, store, transfer
from .modes import outside_inference_mode
from .optim import (SGD, Adam, AdamW, NOT_OURS, ShardedOptimizerMixin, average_over_dp, partitioned_group,
                    register_average_hooks, unregister_average_hooks)

_TWINS: Dict[type, type] = {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam, torch.optim.SGD: SGD}
_CHECKED: Dict[tuple, None] = {}
_WITHOUT: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def register_twin(cls: type, twin: type) -> None:
    _TWINS[cls] = twin


def sharded_class(cls: type) -> type:
    """The class with the mixin in front (created once per class)."""
    if issubclass(cls, ShardedOptimizerMixin):
        return cls
    twin = _TWINS.get(cls)
    if twin is None:
        twin = type(cls.__name__, (ShardedOptimizerMixin, cls), {"__module__": cls.__module__,
                                                                  "__qualname__": cls.__qualname__})
        _TWINS[cls] = twin
    return twin


def _unhooked_step(cls: type) -> Any:
    fn = cls.step
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _refuse(cls: type, why: str) -> RuntimeError:
    return RuntimeError(
        f"zinf: {cls.__module__}.{cls.__name__} cannot step partitioned parameters: zinf steps each rank's "
        f"flat 1/dp shard of a parameter, so the update must treat each element on its own, and {why}. "
        "Such optimizers need whole-tensor statistics (a norm, a matrix shape, a factored moment). Use an "
        "elementwise optimizer (AdamW, Adam, SGD, Adagrad, RMSprop, ...) for partitioned parameters.")


def _constructor_state(cls: type, defaults: dict, params: list) -> defaultdict:
    """The state ``cls``'s constructor makes for ``params`` (empty for most optimizers). Why: some
    create it there and expect it in ``step`` (torch 2.11's Adagrad makes ``sum`` only in
    ``__init__``), so the elementwise probe must start as a real instance would. Built with the
    plain torch class (not the twin) from the optimizer's ``defaults``; a class whose constructor
    does not take its defaults back gets an empty state, as before."""
    plain = next((c for c in cls.__mro__ if issubclass(c, torch.optim.Optimizer)
                  and not issubclass(c, ShardedOptimizerMixin)), cls)
    try:
        return plain(params, **defaults).state
    except Exception:  # noqa: BLE001 - a constructor we cannot replay: the lazy-state case
        return defaultdict(dict)


def check_elementwise(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Refuse, by behaviour, an optimizer whose update of a tensor is not elementwise (see module doc).
    ``optimizer`` is the torch optimizer itself, not a framework's wrapper (``sharded`` unwraps)."""
    cls = type(optimizer)
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    key = (cls, repr(hparams), str(device))
    if key in _CHECKED:
        return
    if cls.__name__ == "LBFGS" or isinstance(optimizer, torch.optim.LBFGS):
        raise _refuse(cls, "it is a quasi-Newton method over all parameters at once (it needs a closure and "
                           "the whole flattened gradient)")
    step = _unhooked_step(cls)
    gen = torch.Generator().manual_seed(0)
    for hp in hparams:
        # halves of very different scales: a per-tensor statistic (norm, trust ratio, even a clamped one)
        # then differs between the halves and the whole, while an elementwise update cannot tell
        w = torch.randn(4, 6, generator=gen)
        w.view(-1)[12:] *= 1e-3
        grads = [torch.randn(4, 6, generator=gen) for _ in range(3)]
        for g in grads:
            g.view(-1)[12:] *= 1e3

        def run(parts: int) -> torch.Tensor:
            params = [torch.nn.Parameter(c.clone().to(device)) for c in
                      ([w] if parts == 1 else list(w.reshape(-1).chunk(parts)))]
            # a copy whose own attributes are replaced, never written through a property to the original
            probe = copy.copy(optimizer)
            probe.__dict__["state"] = _constructor_state(cls, optimizer.defaults, params)
            probe.__dict__["param_groups"] = [dict(hp, params=params)]
            for g in grads:
                pieces = [g] if parts == 1 else list(g.reshape(-1).chunk(parts))
                for p, gp in zip(params, pieces):
                    p.grad = gp.clone().to(device)
                step(probe)
            return torch.cat([p.detach().reshape(-1).cpu() for p in params])

        try:
            whole, halves = run(1), run(2)
        except Exception as exc:
            raise _refuse(cls, f"its step failed on flat shards ({type(exc).__name__}: {exc})") from exc
        moved = (whole - w.reshape(-1)).abs().max()
        diff = (whole - halves).abs().max()
        if not torch.isfinite(diff) or diff > 1e-3 * moved:
            raise _refuse(cls, f"stepping a 4x6 tensor and its two flat halves gave different updates (max "
                               f"difference {float(diff):.3g} for updates of {float(moved):.3g})")
    _CHECKED[key] = None


def convert(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` the sharded twin of its class, in place (state, groups and hooks kept).

    A replicated parameter's gradient from a backward before this first step was accumulated
    without the averaging hook: it is averaged now, with a warning, since a ``clip_grad_norm_`` in
    between saw each rank's own value (``_warn_late_average``)."""
    optimizer.__class__ = sharded_class(type(optimizer))
    optimizer._patch_step_function()  # torch's hook wrapper around the twin's step: hooks fire once
    fresh = register_average_hooks(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
    late = [p for p in fresh if p.grad is not None and store.handle_of(p) is None]
    group = partitioned_group(optimizer)
    if late and group is not NOT_OURS and comm.world_size(group) > 1:  # type: ignore[arg-type]
        _warn_late_average(optimizer, late)
        for p in late:
            average_over_dp(p.grad, group)
    for p, h in list(store.iter_handles([p for g in optimizer.param_groups for p in g["params"]])):
        if p in optimizer.state:  # loaded before the first step: onto the optimizer's tier
            optimizer._adopt_state(p, h, optimizer.state.pop(p))  # type: ignore[attr-defined]


def _warn_late_average(optimizer: torch.optim.Optimizer, late: list) -> None:
    import warnings

    shapes = [tuple(p.shape) for p in late][:4]
    warnings.warn(
        f"zinf: {type(optimizer).__name__} became zinf's sharded optimizer at its first step, after a backward: "
        f"the gradients of {len(late)} replicated parameter(s) (used outside the compiled graph, shapes "
        f"{shapes}) were averaged over dp only now. A clip_grad_norm_ before this step saw each rank's own "
        "values. Convert before the first backward with zinf_compile.optim.sharded(optimizer), or build it "
        "from zinf_compile.optim (AdamW, Adam, SGD)", RuntimeWarning, stacklevel=3)


# torch's own elementwise classes, whose ``step(closure)`` calls the closure once, first, under
# ``enable_grad``, and returns its value: calling it before their step and handing them a closure that
# returns the same value changes nothing they do
_CLOSURE_FIRST = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                            torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
                            torch.optim.ASGD, torch.optim.Adadelta, torch.optim.Rprop})


def _closure_of(args: tuple, kwargs: dict) -> Optional[Any]:
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _run_closure(args: tuple, kwargs: dict) -> tuple:
    """Call the step's closure now; the step gets one that returns its value (``step`` returns it, as
    eager's does) instead of running the forward and backward again."""
    with torch.enable_grad():
        loss = _closure_of(args, kwargs)()

    def done() -> Any:
        return loss

    if len(args) > 1:
        return (args[0], done) + tuple(args[2:]), kwargs
    return args, {**kwargs, "closure": done}


@outside_inference_mode
def pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Optional[tuple]:
    """Global step pre-hook, for optimizers holding partitioned parameters only.

    A plain optimizer is checked and converted on its first step. A step that comes through the twin's
    own ``step`` swaps the shards in itself; one that comes through the *plain* class's ``step`` (an LR
    scheduler made before the first step holds a reference to it, so do subclasses calling
    ``super().step()``) is swapped here, closure first, and swapped back in ``post_step``.

    With a closure on an optimizer none of whose parameters is partitioned yet, the closure may be
    what partitions them: Lightning's automatic optimization runs the first forward (and compile)
    inside ``optimizer.step(closure)``. For torch's own classes, which call the closure first anyway,
    it is called here and the parameters looked at again.
    """
    if _WITHOUT.get(optimizer) == store.epoch:
        return None
    if optimizer.__dict__.get("_zinf_in_twin_step"):
        return None  # the twin's step swaps the shards itself
    if "_zinf_plan" in optimizer.__dict__:  # a nested super().step() inside a step swapped here
        optimizer._zinf_plan_depth += 1  # type: ignore[attr-defined]
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    first = next((h for _, h in store.iter_handles(params)), None)
    result = None
    if first is None and _closure_of(args, kwargs) is not None and type(optimizer) in _CLOSURE_FIRST:
        # the closure's backward may be the first over partitioned parameters: the replicated ones
        # must be averaged in it, before a clip_grad_norm_ inside the closure reads them (Lightning)
        register_average_hooks(optimizer, params)
        result = args, kwargs = _run_closure(args, kwargs)
        first = next((h for _, h in store.iter_handles(params)), None)
        if first is None:  # not zinf's optimizer: its backward needs no hook of ours
            unregister_average_hooks(optimizer, params)
    if first is None:  # not ours: remembered until more parameters are partitioned anywhere
        _WITHOUT[optimizer] = store.epoch
        return result
    if not isinstance(optimizer, ShardedOptimizerMixin):
        check_elementwise(optimizer, first.placement.storage_device())
        convert(optimizer)
    if result is None and _closure_of(args, kwargs) is not None:  # before the swap: its backward
        result = _run_closure(args, kwargs)                          # must see the real parameters
    optimizer._zinf_t0 = time.perf_counter()  # type: ignore[attr-defined]
    optimizer._zinf_plan = optimizer._swap_in()  # type: ignore[attr-defined]
    optimizer._zinf_plan_depth = 0  # type: ignore[attr-defined]
    return result


@outside_inference_mode
def post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if optimizer.__dict__.get("_zinf_in_twin_step") or "_zinf_plan" not in optimizer.__dict__:
        return
    if optimizer._zinf_plan_depth:  # type: ignore[attr-defined]
        optimizer._zinf_plan_depth -= 1  # type: ignore[attr-defined]
        return
    plan = optimizer.__dict__.pop("_zinf_plan")
    optimizer._swap_out(plan)  # type: ignore[attr-defined]
    optimizer._finish(plan)  # type: ignore[attr-defined]
    transfer.optimizer_step_done(optimizer, optimizer.__dict__.pop("_zinf_t0", time.perf_counter()))


def unwrap_optimizer(optimizer: Optional[torch.optim.Optimizer]) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer under a training framework's wrapper: accelerate's ``AcceleratedOptimizer``
    (``.optimizer``), Lightning's ``LightningOptimizer`` (``._optimizer``); ``optimizer`` itself when
    it wraps nothing (None stays None).

    Why: such a wrapper forwards ``param_groups`` and ``state`` to the optimizer it wraps, setters
    included, and its ``step`` calls that optimizer's. Converted or probed in its place, the wrapper
    had its class changed, and the elementwise probe, built as a copy of it, wrote its 4x6 test
    tensor's halves into the user's ``param_groups`` (seen as ``zinf_compile.load(..., optimizer)``
    with accelerate's prepared optimizer: the optimizer then held two (12,) tensors)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def sharded(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Convert now (checked like a first step) instead of at the first step; returns ``optimizer`` (a
    framework's wrapper as given: the optimizer it wraps is the one converted)."""
    real = unwrap_optimizer(optimizer)
    first = next((h for _, h in store.iter_handles([p for g in real.param_groups for p in g["params"]])), None)
    check_elementwise(real, first.placement.storage_device() if first else torch.device("cpu"))
    if not isinstance(real, ShardedOptimizerMixin):
        convert(real)
    return optimizer
