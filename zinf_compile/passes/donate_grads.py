"""Let a gradient slot take the memory of a gradient the backward graph computed, instead of a copy.

Runs on the backward graph after ``schedule`` and before ``keep_alive``, on the ``reduce_grad``
nodes left in place there: dp = 1, the gradient's slot in the compute device's memory. Each such call copies the
whole gradient into a freshly allocated slot, every step, where eager's ``AccumulateGrad`` keeps the
tensor autograd made. A gradient nothing else can see is handed over instead::

    before:  g = mm(dy_t, x); zinf.reduce_grad(g, p, uid); ...; return (None, ..., dx)
    after:   g = mm(dy_t, x); zinf.reduce_grad(g, p, uid, donated=True); ...
             zinf.keep([..., g]); return (...)          # the keep: keep_alive, the last pass

Why both halves are needed:

- ``donated=True`` is only set where the graph proves nothing else reads or writes ``g``'s memory:
  ``g`` is made by an op that returns fresh memory (not a placeholder, not an op a compiler may
  turn into an alias of its input, such as ``clone`` or a same-dtype cast, which Inductor's
  ``remove_noop_ops`` drops), possibly through a chain of views (``t(t(mm))``, ``view(sum)``), and
  ``reduce_grad`` is the only reader of it and each view the only reader of the one before (so it
  is not also returned, say as another input's gradient).
- ``zinf.keep`` (the ``keep_alive`` pass) reads every donated gradient at the graph's end. Without
  it a compiler may reuse ``g``'s memory for a later result once ``reduce_grad`` ran (Inductor
  does: a buffer is freed or reused at its last use), and the slot would then hold whatever was
  written there.

The runtime still checks each tensor (``Slot.adopt``): contiguous, covering its whole storage, the
slot's dtype, device and size, and the slot empty; otherwise it copies as before. With gradient
accumulation only the first micro-batch's gradient is adopted; later ones are added into it.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx

from ..ops import REDUCE_GRAD, is_zinf
from ..pipeline import CompileContext
from ._graph import may_alias_input

aten = torch.ops.aten
prims = torch.ops.prims

#: ops whose result a compiler may replace by one of their inputs when it is a no-op (Inductor's
#: ``remove_noop_ops``: same-size slices and pads, repeats by 1, same-dtype casts, clones, copies)
_MAY_BECOME_ALIAS = {
    aten.slice, aten.slice_scatter, aten.repeat, aten.constant_pad_nd, aten.cat, aten.clone, aten.alias,
    aten.copy, aten._to_copy, aten.to, aten.pow, aten.ceil, aten.floor, aten.round, aten.trunc,
    aten.view, aten.reshape, aten.contiguous, aten.expand, aten.lift_fresh_copy,
    prims.convert_element_type, prims.device_put,
}


def _fresh(node: Any) -> bool:
    """Whether ``node``'s value is memory of its own: made by an op that returns a new tensor."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:  # one result of a multi-output op (layer norm's backward)
        parent = node.args[0]
        return (isinstance(parent, torch.fx.Node) and parent.op == "call_function"
                and isinstance(parent.target, torch._ops.OpOverload) and not may_alias_input(parent)
                and not parent.target._schema.is_mutable
                and getattr(parent.target, "overloadpacket", None) not in _MAY_BECOME_ALIAS)
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    if target.overloadpacket in _MAY_BECOME_ALIAS or may_alias_input(node):
        return False
    return isinstance(node.meta.get("val"), torch.Tensor)


#: views that may stand between the op that made a gradient and ``reduce_grad`` (a linear layer's
#: weight gradient is ``t(t(mm(...)))``, a bias's ``view(sum(...))``); the runtime adopts the result
#: only if it still covers its whole storage in order
_VIEWS = {aten.t, aten.permute, aten.transpose, aten.view, aten._unsafe_view, aten.reshape, aten.squeeze,
          aten.unsqueeze, aten.alias, aten.detach}


def donatable(grad: Any, reducer: torch.fx.Node) -> bool:
    """Whether ``reducer`` (a ``reduce_grad``) may take ``grad``'s memory: ``grad`` is read by
    ``reducer`` alone, and is a fresh op's result, or a chain of views of one, each read only by the
    next (so no other name for that memory exists in the graph)."""
    if not isinstance(grad, torch.fx.Node) or set(grad.users) != {reducer}:
        return False
    node = grad
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and node.target.overloadpacket in _VIEWS):
        base = node.args[0]
        if not isinstance(base, torch.fx.Node) or set(base.users) != {node}:
            return False
        node = base
    return _fresh(node)


def donate_grads_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                      ctx: CompileContext) -> torch.fx.GraphModule:
    for n in gm.graph.nodes:
        if not is_zinf(n, REDUCE_GRAD):
            continue
        if donatable(n.args[0], n):  # its only reader is n: no other reduce_grad can donate it too
            n.kwargs = {**n.kwargs, "donated": True}
            n.meta["zinf"]["donated"] = True
            ctx.record.counters["grads_donated"] += 1
        else:
            ctx.record.counters["grads_not_donated"] += 1
    return gm
