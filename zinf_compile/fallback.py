"""What zinf does when it cannot run a graph as compiled: the user is never left with 0-byte parameters.

Two safety nets, both for the moment after a graph's parameters were partitioned (their storage is
0 bytes, the data lives in the store):

1. **Gather-all fallback.** When anything after partitioning fails (a pass raises, AOTAutograd or
   Inductor raises, or the graph does something zinf's rewrite does not support), the backend
   returns ``gather_all(gm, ...)`` instead of an error. Other graphs may already use the shards, so
   restoring the parameters is not an option; instead each call gathers the full parameters the
   graph takes, runs the original Dynamo graph eagerly with them, and sends the parameters'
   gradients into the store's reduce path, so the optimizer sees them as usual::

       compiled:  fetch_shard -> all_gather -> use -> release ... reduce_grad (inside the graphs)
       fallback:  full = ParamHandle.full_data()  for every partitioned input    (per call)
                  out  = dynamo_graph(*inputs with full substituted)              (eager autograd)
                  backward: d full -> ParamHandle.reduce_grad(d full); param.grad stays None

   The gathered copies live as long as autograd needs them (until backward, or the call's end
   without grad): a gather-all graph holds all its parameters at once, like DDP, which is why it
   is a fallback with a warning and not a mode.

2. **Uncompiled-call guard.** ``model(x)`` on the original module after its parameters were
   partitioned would read 0-byte storage (a segfault for some kernels). A forward pre-hook on each
   module that owns a partitioned parameter raises a clear error instead. Inside compiled code the
   hook is a no-op: Dynamo traces it with ``torch.compiler.is_compiling()`` true (no graph break,
   and Dynamo does not guard on hooks, so registering it causes no recompile).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.fx

import zinf_runtime
from zinf_runtime.store import ParamHandle

from .pipeline import ParamInfo

__all__ = ["gather_all", "mutated_param_inputs", "install_call_guards", "guard_other_instances",
           "UncompiledCallError"]


class _Gathered(torch.autograd.Function):
    """``param`` (0 bytes) -> its full value; the gradient goes to the store, not to ``param.grad``.

    ``param`` is an input only so autograd links the output to it (``requires_grad``); its storage
    is never read. Returning ``None`` as its gradient keeps ``param.grad`` unset, exactly like the
    compiled graphs, which return ``None`` for reduce-scattered gradients.
    """

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, handle: ParamHandle) -> torch.Tensor:  # type: ignore[override]
        ctx.handle = handle
        return handle.full_data(param.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.handle.reduce_grad(grad)
        return None, None


def _handle_for(arg: Any, info: Optional[ParamInfo]) -> Optional[ParamHandle]:
    """The handle of a graph input: the compiled-for template decides for a parameter Dynamo passes
    from another instance of the model (partitioned here on first use, like the compiled path)."""
    if not isinstance(arg, torch.nn.Parameter):
        return None
    if info is not None:
        return zinf_runtime.store.resolve(arg, info.uid)
    return zinf_runtime.handle_of(arg)


def mutated_param_inputs(gm: torch.fx.GraphModule, params: Dict[int, ParamInfo]) -> Dict[int, str]:
    """Partitioned parameters the Dynamo graph writes in place (index -> the op that writes).

    zinf's rewrite gathers a parameter into a temporary; an in-place write (an EMA update, weight
    clipping under ``no_grad``) would land in that temporary and be lost. Such graphs run through
    the gather-all fallback, which writes the changed values back to the shards.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: Dict[int, str] = {}
    for idx in params:
        if idx >= len(phs):
            continue
        seen: Set[torch.fx.Node] = set()
        todo = [phs[idx]]
        while todo:  # the parameter and every view taken of it
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                name = _op_name(u)
                if u.args and u.args[0] is n and _writes_first_arg(u, name):
                    out.setdefault(idx, name)
                elif name in _VIEW_OPS:
                    todo.append(u)
    return out


def _writes_first_arg(node: torch.fx.Node, name: str) -> bool:
    schema = getattr(node.target, "_schema", None)  # an aten/custom op overload: its schema says
    if schema is not None and schema.arguments:
        alias = schema.arguments[0].alias_info
        return bool(alias is not None and alias.is_write)
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


_VIEW_OPS = {"view", "reshape", "t", "transpose", "permute", "__getitem__", "getitem", "narrow", "select",
             "expand", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided", "detach", "data",
             "view_as", "chunk", "split", "unbind"}


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return schema.name.split("::")[-1]
        return getattr(node.target, "__name__", str(node.target)).split(".")[-1]
    return ""


def gather_all(gm: torch.fx.GraphModule, params: Dict[int, ParamInfo], compute_dtype: Optional[torch.dtype],
               device_type: str, write_back: Sequence[int] = ()) -> Callable:
    """A callable with ``gm``'s calling convention that runs ``gm`` eagerly on gathered parameters.

    ``params``: the graph inputs partitioned at compile time (any other input that is a partitioned
    parameter is gathered too: a failure can interrupt partitioning half-way). ``write_back``: inputs
    the graph mutates; their new values are loaded into the shards after each call.
    """
    infos = dict(params)
    back = tuple(write_back)

    def call(*args: Any) -> Any:
        new_args = list(args)
        gathered: Dict[int, torch.Tensor] = {}
        for i, a in enumerate(args):
            h = _handle_for(a, infos.get(i))
            if h is None:
                continue
            full = _Gathered.apply(a, h)
            gathered[i] = full
            new_args[i] = full
        ctx = (torch.autocast(device_type, dtype=compute_dtype) if compute_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            out = gm(*new_args)
        for i in back:
            h = _handle_for(args[i], infos.get(i))
            if h is not None and i in gathered:
                h.load_full(gathered[i].detach())
        return out

    return call


# -- the uncompiled-call guard --------------------------------------------------------------------


class UncompiledCallError(RuntimeError):
    """The original module was called after zinf partitioned its parameters."""


def _uncompiled_call_guard(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: raise if ``module`` is about to read partitioned (0-byte) parameters."""
    if torch.compiler.is_compiling():
        return  # traced by Dynamo (the compiled path): a no-op, no graph break
    for name, p in module._parameters.items():
        if p is None or zinf_runtime.handle_of(p) is None:
            continue
        if p.untyped_storage().nbytes() < (p.storage_offset() + p.numel()) * p.element_size():
            raise UncompiledCallError(
                f"zinf: {type(module).__name__}.{name} is partitioned by the zinf backend (its storage is "
                "0 bytes; the data lives in zinf's shards), so this uncompiled module cannot run. Call the "
                "compiled module (the one torch.compile returned, or use model.compile(backend='zinf') to "
                "compile in place), or run eager code inside `with zinf_compile.gathered(model):`."
            )


def _candidate_roots(frame: Any) -> List[torch.nn.Module]:
    """``nn.Module`` objects held by the frames on the call stack (the module being compiled and
    whatever the user's code holds it as). Dynamo does not hand the backend the module it traces."""
    roots: List[torch.nn.Module] = []
    seen: Set[int] = set()
    while frame is not None:
        try:
            values = list(frame.f_locals.values())
        except Exception:  # a frame whose locals cannot be read: skip it
            values = []
        for v in values:
            if isinstance(v, torch.nn.Module) and id(v) not in seen:
                seen.add(id(v))
                roots.append(v)
        frame = frame.f_back
    return roots


def install_call_guards(params: Sequence[torch.nn.Parameter]) -> int:
    """Register the uncompiled-call guard on every module (reachable from the call stack) that owns
    one of ``params``; returns how many modules got it. Idempotent per module."""
    wanted = {id(p) for p in params}
    if not wanted:
        return 0
    added = 0
    visited: Set[int] = set()
    for root in _candidate_roots(sys._getframe(1)):
        for mod in root.modules():
            if id(mod) in visited:
                continue
            visited.add(id(mod))
            if any(h is _uncompiled_call_guard for h in mod._forward_pre_hooks.values()):
                continue  # guarded already (or a deep copy of a guarded module)
            if any(p is not None and id(p) in wanted for p in mod._parameters.values()):
                mod.register_forward_pre_hook(_uncompiled_call_guard)
                added += 1
    return added


def graph_label(gm: torch.fx.GraphModule, record_id: int, params: Dict[int, ParamInfo]) -> str:
    """How a warning names a graph: zinf's record id (``last_graphs``/``dump_dir``), Dynamo's compile id
    (``[0/0]`` in ``TORCH_LOGS``) and the first parameters it takes."""
    names = [p.name for p in params.values()]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    dynamo_id = gm.meta.get("dynamo_compile_id") if hasattr(gm, "meta") else None
    where = f", Dynamo frame {dynamo_id}" if dynamo_id is not None else ""
    return f"{record_id}{where}" + (f", parameters {shown}" if names else "")


def fallback_warning(graph_name: str, reason: str) -> str:
    return (f"zinf: graph {graph_name} runs with the gather-all fallback: {reason}. Each call gathers every "
            "partitioned parameter the graph takes (held at once, not counted against device_memory_budget, "
            "no tiling), runs the graph eagerly and reduce-scatters the gradients into zinf's shards: eager "
            "PyTorch's numbers, slower and with more memory. Please report it (traceback with "
            "TORCH_LOGS=+zinf_compile; graphs in zinf_compile.last_graphs()).")


def guard_other_instances(compiled: Callable, params: Dict[int, ParamInfo], example_inputs: Sequence[Any]) -> Callable:
    """Give the uncompiled-call guard to other instances of the model that Dynamo runs through this graph.

    Dynamo reuses a compiled graph for every instance of a model class without compiling again, so
    the guard installed at compile time covers only the instance compiled. The first call with
    another instance's parameters installs it for that instance (found on the call stack, as at
    compile time); later calls cost one identity check.
    """
    if not params:
        return compiled
    first = min(params)
    template = weakref.ref(example_inputs[first])  # Dynamo's cache must not keep the model alive
    seen: Set[int] = set()

    def call(*args: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], list):  # boxed: graph inputs are never lists
            given = args[0]
        else:
            given = args
        p = given[first]
        if p is not template():
            uid = getattr(p, zinf_runtime.store.UID_ATTR, None)
            if uid is None or uid not in seen:
                # a boxed call clears its list; tiles (indices past the Dynamo inputs) are not the user's
                mine = [given[i] for i in params if i < len(given) and isinstance(given[i], torch.nn.Parameter)]
                out = compiled(*args)  # clears its list; partitions the new instance's parameters (resolve)
                install_call_guards(mine)
                uid = getattr(p, zinf_runtime.store.UID_ATTR, None)
                if uid is not None:
                    seen.add(uid)
                return out
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call
