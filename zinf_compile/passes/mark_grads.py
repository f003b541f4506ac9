"""Mark, in the joint graph, which outputs are the gradients of partitioned parameters.

Runs after ``insert_fetch`` on AOTAutograd's joint graph (a no-op on inference graphs). The last
``len(inputs)`` outputs of a joint graph are the gradients of its inputs, in order::

    before: return (loss, ..., g_w, g_b, None)
    after:  return (loss, ..., zinf.grad_of(g_w, primals_1, uid_w), zinf.grad_of(g_b, primals_2, uid_b), None)

``grad_of`` computes nothing: it makes the partitioner keep each parameter's (0-byte) placeholder
for the backward, so that ``reduce_grad`` there can name the parameter actually passed at run time
(Dynamo reuses a compiled graph for every instance of a model class), not only the one compiled for.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..ops import GRAD_OF, is_zinf, tag
from ..pipeline import CompileContext
from ._graph import placeholders


def mark_grads_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    phs = placeholders(graph)
    if not any(p.name.startswith("tangents") for p in phs) or any(is_zinf(n, GRAD_OF) for n in graph.nodes):
        return gm
    out = graph.find_nodes(op="output")[0]
    outs = list(out.args[0])
    n_inputs = ctx.record.counters["graph_inputs"]
    first = len(outs) - n_inputs
    if first < 0:
        raise RuntimeError(f"zinf: joint graph has {len(outs)} outputs for {n_inputs} inputs; cannot find gradients")
    for idx, info in ctx.params.items():
        g = outs[first + idx]
        if not isinstance(g, torch.fx.Node):
            continue
        with graph.inserting_before(out):
            marker = graph.call_function(GRAD_OF, (g, phs[idx], info.uid))
        if "val" in g.meta:
            marker.meta["val"] = g.meta["val"]
        tag(marker, "grad_of", info.uid, param=info.name)
        outs[first + idx] = marker
        ctx.record.counters["grads_marked"] += 1
    out.args = (tuple(outs),) + tuple(out.args[1:])
    return gm
