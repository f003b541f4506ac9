"""Reduce-scatter parameter gradients inside the backward graph, as soon as each is computed.

Runs on the backward graph after partitioning; acts on the ``grad_of`` markers ``mark_grads`` put
on the joint graph's outputs (a no-op without them)::

    before: g = t(mm(dy, x)); ...; m = zinf.grad_of(g, p, uid); return (m, db, dx)
    after:  g = t(mm(dy, x)); zinf.reduce_grad(g, p, uid); ...; return (None, ..., dx)

So autograd never accumulates a full gradient into ``param.grad`` (it stays ``None``); the runtime
accumulates the fp32 shard of the parameter actually passed instead, across micro-batches, until
``zero_grad``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..ops import GRAD_OF, REDUCE_GRAD, is_zinf, tag
from ..pipeline import CompileContext


def reduce_grad_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    markers = [n for n in graph.nodes if is_zinf(n, GRAD_OF)]
    if not markers:
        if ctx.params and any(isinstance(o, torch.fx.Node) for o in outs):
            raise RuntimeError("zinf: backward graph returns gradients but carries no grad_of markers "
                               "(mark_grads did not run on the joint graph)")
        return gm
    for m in markers:
        g, param, uid = m.args
        anchor = g if g.op != "placeholder" else [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            red = graph.call_function(REDUCE_GRAD, (g, param, uid))
        tag(red, "reduce_grad", uid, param=m.meta.get("zinf", {}).get("param"))
        outs = [None if o is m else o for o in outs]
        if any(u is not out for u in m.users):
            raise RuntimeError(f"zinf: gradient marker {m.name} is used inside the backward graph")
        out.args = (tuple(outs),) + tuple(out.args[1:])
        graph.erase_node(m)
        ctx.record.counters["reduce_grad_inserted"] += 1
    return gm
