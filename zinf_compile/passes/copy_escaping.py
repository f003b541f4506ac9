"""Return a copy of a partitioned parameter that the graph returns itself (or a view of it).

Runs on the Dynamo graph, before AOTAutograd::

    before: w = placeholder; b = placeholder; ...; v = b.view(2, 2); return (y, w, v)
    after:  w = placeholder; b = placeholder; ...; v = b.view(2, 2)
            w_copy = zinf.copy_out(w); v_copy = zinf.copy_out(v); return (y, w_copy, v_copy)

Why: once partitioned, a parameter is a 0-byte placeholder whose values live in the store. An output
that aliases a graph input is not computed by the compiled graph: AOTAutograd hands the input (or a
view regenerated from it) straight back to the caller, so the caller got the 0-byte placeholder and
reading it read freed memory (a segmentation fault; measured before this pass). With the copy, the
value is computed from the fetched parameter like any other use, and its gradient reaches the
parameter's shards through ``reduce_grad``. The copy is the opaque ``zinf.copy_out``, not
``torch.clone``: Inductor drops a clone of what it takes for a temporary, which at dp 1 in memory is
the parameter's own slot, so the caller got the parameter's memory there and a copy elsewhere. What differs from eager: the caller holds a copy, not the
parameter, so writing into it does not change the parameter; a warning says so, once per parameter
and graph (counter ``escaping_params_copied``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..ops import COPY_OUT
from ..pipeline import CompileContext


def _storage(node: Any) -> Optional[StorageWeakRef]:
    val = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # no storage (a functional or sparse wrapper): nothing to alias
        return None


def copy_escaping_params_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                              ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    owners: Dict[StorageWeakRef, str] = {}
    for i, info in ctx.params.items():
        ref = _storage(phs[i]) if i < len(phs) else None
        if ref is not None:
            owners[ref] = info.name
    if not owners:
        return gm
    out = graph.find_nodes(op="output")[0]
    copies: Dict[torch.fx.Node, torch.fx.Node] = {}

    def copy_of(a: torch.fx.Node) -> torch.fx.Node:
        ref = _storage(a)
        name = owners.get(ref) if ref is not None else None
        if name is None:
            return a
        if a not in copies:
            with graph.inserting_before(out):
                c = graph.call_function(COPY_OUT, (a,))
            c.meta.update({k: v for k, v in a.meta.items() if k != "example_value"})
            val = a.meta["example_value"]
            with val.fake_mode if getattr(val, "fake_mode", None) is not None else contextlib.nullcontext():
                c.meta["example_value"] = torch.empty_like(val)
            copies[a] = c
            msg = (f"zinf: graph {ctx.record.name} returns partitioned parameter {name} (or a view of it); "
                   f"zinf returns a copy of its value, so writes to the returned tensor do not change the "
                   f"parameter (in eager they would). Gradients through it reach the parameter as in eager.")
            ctx.record.warnings.append(msg)
            ctx.record.counters["escaping_params_copied"] += 1
            warnings.warn(msg)
        return copies[a]

    out.args = torch.fx.node.map_arg(out.args, copy_of)
    if copies:
        graph.lint()
        gm.recompile()
    return gm

