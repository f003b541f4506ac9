"""Eager torch calls on a partitioned parameter: served where eager's meaning survives, refused otherwise.

A partitioned parameter keeps its shape over 0 bytes of storage (its values live in zinf's shards).
An eager kernel reading that storage reads unmapped memory and kills the process, so
``PartitionedParameter.__torch_function__`` sends every call that would touch an element here::

    before:  model.state_dict()         -> tensors over 0 bytes; reading one crashes the process
             model.load_state_dict(sd)  -> copy_ into 0 bytes
             ema.mul_(0.9).add_(p)      -> reads 0 bytes
    after:   model.state_dict()         -> full CPU tensors with eager's values (collective when dp > 1)
             model.load_state_dict(sd)  -> each rank's shard overwritten from sd (as p.copy_ does)
             model.to(p.device)         -> a no-op, as in eager
             anything else              -> PartitionedDataError naming the parameter and the fix

Served calls are the ones whose eager meaning zinf can keep exactly: ``Tensor.copy_`` into the whole
parameter (no autograd) writes through to the shards; ``detach`` called by
``Module._save_to_state_dict`` returns the full value (the state dict is a copy in eager's sense:
nobody writes through it); a move or cast to the device and dtype the parameter already has returns
the parameter itself, and so does ``p.data = p`` (``Module._apply`` after such a move); any other
``p.data = t`` is refused. Metadata calls never come here (``DATA_FREE``).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator

import torch

from .modes import normal_tensors

__all__ = ["PartitionedDataError", "DATA_FREE", "NOT_SERVED", "eager_call", "set_compile_session_probe"]


class PartitionedDataError(RuntimeError):
    """Eager code read or wrote a partitioned parameter, whose storage is 0 bytes."""


def _data_free_calls() -> frozenset:
    """Torch calls on a tensor that touch no element: sizes, flags, autograd fields, storage handles."""
    T = torch.Tensor
    methods = (T.size, T.dim, T.numel, T.nelement, T.stride, T.storage_offset, T.is_contiguous,
               T.element_size, T.untyped_storage, T.__hash__, T.requires_grad_, T.is_floating_point,
               T.is_complex, T.get_device, T.data_ptr, T.is_pinned, T.__reduce_ex__, T.__deepcopy__,
               T.__setstate__, T._is_view, T.retain_grad, T.register_hook, T.register_post_accumulate_grad_hook,
               T.dim_order, T.is_shared, T.is_signed, T.is_inference, torch._has_compatible_shallow_copy_type,
               T.is_conj, T.is_neg, T._is_zerotensor,
               # the function forms (Adagrad's constructor asks ``torch.is_complex(p)``)
               torch.is_complex, torch.is_floating_point, torch.is_conj, torch.is_neg, torch.numel)
    props = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout",
             "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "_version", "is_sparse", "is_quantized",
             "is_nested", "_base", "names", "itemsize", "nbytes", "_grad", "_grad_fn", "_backward_hooks",
             "_post_accumulate_grad_hooks", "is_mkldnn", "is_sparse_csr", "output_nr", "_cdata", "name",
             "retains_grad", "_python_dispatch")
    getters = {getattr(T, a).__get__ for a in props if hasattr(T, a) and hasattr(getattr(T, a), "__get__")}
    setters = {getattr(T, a).__set__ for a in ("requires_grad", "grad", "_grad", "_backward_hooks",
                                               "_post_accumulate_grad_hooks")
               if hasattr(getattr(T, a, None), "__set__")}  # not data: `p.data = t` rebinds the storage
    return frozenset(methods) | frozenset(getters) | frozenset(setters)


DATA_FREE = _data_free_calls()
_SAVE_TO_STATE_DICT = torch.nn.Module._save_to_state_dict.__code__
NOT_SERVED = object()
_DATA_SET = torch.Tensor.data.__set__


def _partitioned_args(cls: type, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The arguments that are ``cls`` instances, one level into lists and tuples (``torch.cat``,
    ``_foreach_*``). ``isinstance``, not ``type() is``: one call may mix ``PartitionedParameter`` with
    the partitioned class of a user's Parameter subclass, and torch calls the most derived class's
    override first: its answer must cover every partitioned argument."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, cls):
            yield a
        elif type(a) in (list, tuple):
            for t in a:
                if isinstance(t, cls):
                    yield t


def eager_call(cls: type, func: Any, args: tuple, kwargs: dict, caller: Any) -> Any:
    """What ``func(*args, **kwargs)`` gives when an argument is a data-less partitioned parameter;
    ``NOT_SERVED`` when none is (the caller then runs ``func`` as ``nn.Parameter`` does).
    ``caller`` is the code object of the Python frame that made the call."""
    empty: list = []
    for t in _partitioned_args(cls, args, kwargs):
        if not t._has_data() and not any(t is e for e in empty):
            empty.append(t)
    if not empty or _compile_session_probe():
        return NOT_SERVED  # a compile session (Dynamo, a backend) works on metadata, as nn.Parameter
    p = empty[0]
    serve = _SERVED.get(func)
    if serve is not None and len(empty) == 1 and args and args[0] is p:
        with normal_tensors():  # runtime/modes.py: e.g. state_dict() under torch.inference_mode()
            out = serve(p, args[1:], kwargs, caller)
        if out is not NOT_SERVED:
            return out
    raise PartitionedDataError(_message(p, func))


# Whether a torch.compile compilation is under way (Dynamo or a backend calling torch on a parameter).
# torch.compiler.is_compiling() says so for the whole session on torch 2.13 but only inside traced code
# on 2.11; zinf_compile installs ``_torch_compat.in_compile_session``, which covers both (private torch
# API lives there, and the runtime never imports the compiler). Asked only on calls that would otherwise
# be refused, never on the hot path.
_compile_session_probe: Callable[[], bool] = torch.compiler.is_compiling


def set_compile_session_probe(fn: Callable[[], bool]) -> None:
    global _compile_session_probe
    _compile_session_probe = fn


# -- served calls ---------------------------------------------------------------------------------


def _handle(p: torch.Tensor) -> Any:
    from .store import handle_of

    return handle_of(p)


def _state_dict_value(p: torch.Tensor, args: tuple, kwargs: dict, caller: Any) -> Any:
    """``param.detach()`` from ``Module._save_to_state_dict``: the full value on the CPU."""
    h = _handle(p)
    if caller is not _SAVE_TO_STATE_DICT or h is None or args or kwargs:
        return NOT_SERVED
    return h.full_data(p.dtype).cpu().view(p.shape).detach()


def _copy_into(p: torch.Tensor, args: tuple, kwargs: dict, caller: Any) -> Any:
    """``p.copy_(src)`` outside autograd: every element of ``p`` is overwritten, so write ``src``
    (broadcast and cast as ``copy_`` would) to this rank's shard."""
    h = _handle(p)
    src = args[0] if args else kwargs.get("src")
    if h is None or not isinstance(src, torch.Tensor) or (torch.is_grad_enabled() and p.requires_grad):
        return NOT_SERVED
    h.load_full(src.detach().to(dtype=p.dtype).expand(p.shape))
    return p


def _set_data(p: torch.Tensor, args: tuple, kwargs: dict, caller: Any) -> Any:
    """``p.data = p`` (``Module._apply`` after a no-op move) is a no-op; any other ``p.data = t`` would
    rebind the parameter to ``t``'s storage behind the shards' back, so it is refused."""
    return None if args and args[0] is p else NOT_SERVED


_DEVICE_LIKE = (torch.device, str, int)


def _same_device(p: torch.Tensor, d: Any) -> bool:
    if isinstance(d, int):  # an ordinal names an accelerator, never the CPU
        return p.device.type not in ("cpu", "meta") and p.device.index == d
    d = torch.device(d)
    return d.type == p.device.type and (d.index is None or d.index == p.device.index)


def _to_is_noop(p: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``p.to(*args, **kwargs)`` returns ``p`` itself (no copy), by ``Tensor.to``'s rules."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    flags = []
    for a in args:
        if a is None:  # Module.to passes (device, dtype or None, non_blocking)
            continue
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, bool):
            flags.append(a)
        elif isinstance(a, _DEVICE_LIKE):
            device = a
        else:
            return False
    copy = kwargs.get("copy", flags[1] if len(flags) > 1 else False)
    return (not copy and _keeps_format(kwargs) and (dtype is None or dtype == p.dtype)
            and (device is None or _same_device(p, device)))


def _move(check: Callable[[torch.Tensor, tuple, dict], bool]) -> Callable[..., Any]:
    def serve(p: torch.Tensor, args: tuple, kwargs: dict, caller: Any) -> Any:
        return p if check(p, args, kwargs) else NOT_SERVED
    return serve


def _like(factory: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """``torch.zeros_like(p)`` and the other ``*_like`` factories read only ``p``'s metadata, so they
    give what they give for an ``nn.Parameter``: a new tensor of ``p``'s full shape, dtype and device
    (an optimizer that makes its state in its constructor, such as Adagrad, does this; the state is
    cut to this rank's shard at the first step, ``ShardedOptimizerMixin._place_state``)."""
    def serve(p: torch.Tensor, args: tuple, kwargs: dict, caller: Any) -> Any:
        stand_in = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
        return factory(stand_in, *args, **kwargs)
    return serve


def _keeps_format(kwargs: dict) -> bool:
    return kwargs.get("memory_format", torch.preserve_format) is torch.preserve_format


def _cast_to(dtype: torch.dtype) -> Callable[[torch.Tensor, tuple, dict], bool]:
    return lambda p, args, kwargs: p.dtype == dtype and _keeps_format(kwargs)


T = torch.Tensor
_SERVED: Dict[Any, Callable[..., Any]] = {
    T.detach: _state_dict_value,
    T.copy_: _copy_into,
    T.data.__set__: _set_data,
    T.to: _move(_to_is_noop),
    T.cpu: _move(lambda p, args, kwargs: p.device.type == "cpu" and _keeps_format(kwargs)),
    T.cuda: _move(lambda p, args, kwargs: p.device.type == "cuda" and _keeps_format(kwargs) and _same_device(
        p, kwargs.get("device", args[0] if args and not isinstance(args[0], bool) else "cuda"))),
    T.float: _move(_cast_to(torch.float32)),
    T.double: _move(_cast_to(torch.float64)),
    T.half: _move(_cast_to(torch.float16)),
    T.bfloat16: _move(_cast_to(torch.bfloat16)),
    **{f: _like(f) for f in (torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like)},
}
del T


def _message(p: torch.Tensor, func: Any) -> str:
    h = _handle(p)
    name = repr(h.name) if h is not None else "(a tile or stand-in)"
    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if func == _DATA_SET:  # a fresh method-wrapper per lookup: equal, not identical
        return (f"zinf: `.data = ...` on partitioned parameter {name}, whose data lives in zinf's shards: it "
                "would rebind the parameter behind them. Write its values with `with torch.no_grad(): "
                "p.copy_(value)` (written through to the shards), or inside `with zinf_compile.gathered(model):`.")
    if func in _SERVED and func not in (torch.Tensor.detach, torch.Tensor.copy_):
        return (f"zinf: {what} on partitioned parameter {name} would move or cast it, and zinf keeps its "
                "shards where the compile options put them. Move or cast the model before its first "
                "compiled call, or copy it out with zinf_compile.full_state_dict(model).")
    return (f"zinf: {what} on partitioned parameter {name}, whose data lives in zinf's shards (its own "
            "storage is 0 bytes). Read or change it inside `with zinf_compile.gathered(model):`, or take "
            "a copy with zinf_compile.full_state_dict(model); the compiled module reads it for you.")
