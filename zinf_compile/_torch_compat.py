"""Every private torch API zinf uses, wrapped in one place (and tested in tests/test_torch_compat.py).

zinf needs no monkey-patching of Dynamo: parameters keep their shape with 0-byte storage. What it
does need from torch's internals is AOTAutograd's hooks (partition function, forward/backward
compilers), the min-cut partitioner, and Inductor's compile entry points with its joint-graph
custom-pass hook. When a torch release moves one of them, this file is the only one to change.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx


def aot_autograd(**kwargs: Any) -> Callable:
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def min_cut_partition(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def make_boxed(fn: Callable) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(fn)


def inductor_compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable) -> Any:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=inner_compile)


def inductor_compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def custom_graph_pass(fn: Callable[[torch.fx.Graph], None], uuid: str) -> Any:
    """Wrap ``fn(graph)`` as Inductor's ``CustomGraphPass`` (what its joint-graph hook accepts)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> Any:
            return uuid

    return _Pass()


@contextlib.contextmanager
def inductor_patches(joint_pre_pass: Any) -> Iterator[None]:
    """Install our joint-graph pass for one compile; disable caches that would skip our passes.

    The AOTAutograd cache would replay compiled graphs without running our passes (which register
    per-compile state), so it is off for zinf compiles; Inductor's own FX-graph cache stays on (it
    keys on the final graph, zinf nodes and their constant uids included). The backward is
    compiled with the forward (see ``eager_patches``). CUDA graphs are off for zinf compiles even
    where a user turned them on globally: zinf's ops do host work (IO, collectives, the store) that a
    replay would skip, and a replay rewrites its output pool, which a gradient slot may own
    (``passes/donate_grads.py``).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor = inductor_config.patch({"joint_custom_pre_pass": joint_pre_pass, "triton.cudagraphs": False})
    functorch = functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True)
    with inductor, functorch:
        yield


@contextlib.contextmanager
def eager_patches() -> Iterator[None]:
    """AOTAutograd settings of a zinf compile with the eager compiler.

    ``force_non_lazy_backward_lowering``: AOTAutograd normally compiles the backward at the first
    ``loss.backward()``; zinf compiles it with the forward, so a backward its passes cannot rewrite
    fails inside the backend, which can still fall back, rather than half-way through a step.
    """
    import torch._functorch.config as functorch_config

    with functorch_config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
        yield


def must_recompute_tag() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE



def detach_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that our passes may change (Dynamo keeps reading the original's
    placeholders after the backend returns), with the metadata AOTAutograd reads on Dynamo graphs:
    ``gm.meta``, ``_param_name_to_source`` and each placeholder's ``_dynamo_source``."""
    graph = torch.fx.Graph()
    val_map: dict = {}
    out = graph.graph_copy(gm.graph, val_map)
    old_out = gm.graph.find_nodes(op="output")[0]
    new_out = graph.output(out)
    new_out.meta = dict(old_out.meta)
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = torch.fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm


def static_fake_like(t: torch.Tensor, example_inputs: Sequence[Any]) -> torch.Tensor:
    """``t`` as a fake tensor of the compile's fake mode with static shapes.

    An input a pass adds has no Dynamo source, so AOTAutograd would fakeify it with symbolic
    sizes; a tile's shape is a constant of the rewrite, and symbolic sizes would make the backward
    read them (fetching every tile up front) and blur Inductor's code.
    """
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    if mode is None:
        return t
    return mode.from_tensor(t, static_shapes=True)


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s StorageImpl, shared by every alias (views, ``.data``, ``detach()``) and
    stable across ``resize_`` (unlike ``data_ptr()``, which is 0 for a 0-byte storage)."""
    return t.untyped_storage()._cdata


def is_dynamo_restart(exc: BaseException) -> bool:
    """Whether ``exc`` is Dynamo's own "restart the analysis" signal (e.g. AOTAutograd's scalar
    tensorification under ``dynamic=True``): control flow Dynamo catches and retries, not a
    failure, so a backend must let it through instead of falling back."""
    from torch._dynamo.exc import RestartAnalysis

    return isinstance(exc, RestartAnalysis)


def default_store() -> Optional[Any]:
    """The default process group's c10d store (``torch.distributed.distributed_c10d._get_default_store``,
    private; torch 2.13 has no public accessor), or None when there is none. zinf posts a failed rank's
    error there so the other ranks stop instead of waiting (``zinf_runtime.comm.post_failure``)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:  # pragma: no cover - torch moved it: failures then end in the collective timeout
        return None
    try:
        return _get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def compile_options_of(module: Any) -> Any:
    """``(backend, options)`` that ``torch.compile(module, backend=..., options=...)`` (an
    ``OptimizedModule``) or ``module.compile(...)`` (in place) was given, or None if uncompiled.

    Checkpoint loading needs them before the first call, when nothing is partitioned yet: the options
    say where the shards go. Dynamo keeps the backend wrapper (``_TorchCompileWrapper``, holding
    ``kwargs["options"]``) at the end of the ``_torchdynamo_orig_backend`` chain of its context's
    callback; an in-place compile keeps that context in the closure of ``_compiled_call_impl``.
    """
    from torch._dynamo.eval_frame import innermost_backend

    ctx = getattr(module, "dynamo_ctx", None)
    if ctx is None:
        fn = getattr(module, "_compiled_call_impl", None)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if hasattr(value, "callback"):
                ctx = value
                break
    callback = getattr(ctx, "callback", None)
    if callback is None or not callable(callback):
        return None
    backend = innermost_backend(callback)
    name = getattr(backend, "compiler_name", None)
    kwargs = getattr(backend, "kwargs", None)
    if name is None or kwargs is None:
        return None
    return name, kwargs.get("options")


def in_compile_session() -> bool:
    """Whether a ``torch.compile`` compilation is under way on this thread, traced code or not.

    ``torch.compiler.is_compiling()`` says so for the whole session from torch 2.13 (Dynamo holds its
    flag while it converts a frame). On torch 2.11 it is True only inside Dynamo-traced code, so
    Dynamo's own metadata reads of a real parameter (``describe_tensor``: ``is_conj``, ``is_neg``...)
    and a backend's work look like eager calls there. Dynamo's ``CompileContext`` (private, in
    ``torch._guards`` since 2.0) is set for the whole conversion of a frame on every version.
    """
    if torch.compiler.is_compiling():
        return True
    from torch._guards import CompileContext

    return CompileContext.try_get() is not None


def structured_trace_enabled() -> bool:
    """Whether ``TORCH_TRACE`` (or ``TORCH_COMPILE_DEBUG``) structured logging writes a file, so a
    ``trace_structured`` payload is read by someone.

    torch has no public query. Its trace logger (``torch._logging._internal.trace_log``, private) always
    holds a ``LazyTraceHandler``; without a trace folder that handler drops the first record and removes
    itself, and other handlers on the logger (pytest's log capture lands there) never see a payload,
    which travels in the record's ``extra``. So: on when a ``LazyTraceHandler`` has a folder or an open
    file. If torch moves these, say True (the payload is then made and maybe dropped: slower, never
    lost).
    """
    try:
        from torch._logging._internal import LazyTraceHandler, trace_log
    except ImportError:  # pragma: no cover - torch moved it
        return True
    return any(isinstance(h, LazyTraceHandler) and (h.root_dir is not None or h.stream is not None)
               for h in trace_log.handlers)


def ddp_ignore(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Mark ``names`` (parameter and buffer ``state_dict`` keys of ``module``) for
    DistributedDataParallel, and the code that copies its conventions, to leave alone.

    Lightning's DDP strategy broadcasts every parameter from rank 0 before ``validate``/``test``
    (``_sync_module_states``); it honours DDP's ignore list, which
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (private, since torch 1.8)
    stores on the module. A partitioned parameter has no data to broadcast: each rank holds its own shard.
    """
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))
