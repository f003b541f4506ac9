"""Mixed precision by tracing the whole graph as if it ran under ``torch.autocast``.

Runs on the Dynamo graph, before AOTAutograd, only with ``mixed_precision`` set::

    before: x = placeholder; ...; return (out,)
    after:  x = placeholder; ctx = _enter_autocast(dev, bf16, True, None); ...;
            _exit_autocast(ctx); return (out,)

AOTAutograd then traces the casts autocast would insert in eager mode, so the result equals eager
under ``torch.autocast``; ``insert_fetch`` later all-gathers a parameter directly in bf16 when
every use of it is such a cast.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..pipeline import CompileContext


def autocast_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    dtype = ctx.cfg.compute_dtype
    if dtype is None:
        return gm
    graph = gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    out = graph.find_nodes(op="output")[0]
    anchor = phs[-1].next if phs else next(iter(graph.nodes))
    with graph.inserting_before(anchor):
        enter = graph.call_function(
            torch.amp.autocast_mode._enter_autocast, (ctx.device_type, dtype, True, None)
        )
    with graph.inserting_before(out):
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    ctx.record.counters["autocast_regions"] += 1
    return gm
