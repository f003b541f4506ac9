"""Reduce-scatter parameter gradients inside the backward graph, as soon as each is computed.

Runs on the backward graph after partitioning. Output ``i`` of the backward is the gradient of
input ``i``; for a partitioned parameter it becomes a ``reduce_grad`` node and the output ``None``::

    before: g = t(mm(dy, x)); ...; return (g, db, dx)
    after:  g = t(mm(dy, x)); zinf.reduce_grad(g, uid); ...; return (None, db_or_None, dx)

So autograd never accumulates a full gradient into ``param.grad`` (it stays ``None``); the runtime
accumulates the fp32 shard instead, across micro-batches, until ``zero_grad``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..ops import REDUCE_GRAD, is_zinf, tag
from ..pipeline import CompileContext


def reduce_grad_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    if any(is_zinf(n, REDUCE_GRAD) for n in graph.nodes):
        return gm
    out = graph.find_nodes(op="output")[0]
    grads = list(out.args[0])
    n_inputs = ctx.record.counters.get("graph_inputs", len(grads))
    if len(grads) != n_inputs:
        raise RuntimeError(
            f"zinf: backward graph returns {len(grads)} gradients for {n_inputs} inputs; cannot map them to parameters"
        )
    for idx, info in ctx.params.items():
        g = grads[idx]
        if not isinstance(g, torch.fx.Node):
            continue
        anchor = g if g.op != "placeholder" else _last_placeholder(graph)
        with graph.inserting_after(anchor):
            red = graph.call_function(REDUCE_GRAD, (g, info.uid))
        tag(red, "reduce_grad", info.uid, param=info.name)
        grads[idx] = None
        ctx.record.counters["reduce_grad_inserted"] += 1
    out.args = (tuple(grads),) + tuple(out.args[1:])
    return gm


def _last_placeholder(graph: torch.fx.Graph) -> torch.fx.Node:
    return [n for n in graph.nodes if n.op == "placeholder"][-1]
