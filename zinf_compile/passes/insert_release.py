"""Release every gathered parameter right after its last use (views included).

Runs on the forward, backward and inference graphs after partitioning::

    before: w = zinf.all_gather(s, uid, shape); t = aten.t(w); y = addmm(b, x, t); z = relu(y)
    after:  w = zinf.all_gather(s, uid, shape); t = aten.t(w); y = addmm(b, x, t)
            zinf.release(w, uid, [y]); z = relu(y)

At dp = 1 the fetched shard is the full parameter (``w`` is a view of it) and is what gets released,
unless the fetch reads the shard where it lives (no budget, the shard in the compute device's
memory: ``ParamHandle.shard_in_place``, ``schedule.in_place_uids``): such a release frees nothing,
and its ``after`` list would only force the readers' results into buffers of their own, so none is
inserted (counter ``release_skipped_in_place``); ``keep_alive`` then holds it to the graph's end, so
no compiler reuses the parameter's memory for a result. Where the compile-time guess is wrong (a
fetch that copied after all), the copy is still freed, when the graph drops it at its end.
The last use is taken over ``w`` and everything that may alias it, so freeing the storage can never
pull data from under a view; the readers' results are passed to ``release`` so that no scheduler
can move a read (Inductor inlines pointwise reads into later kernels) past the release. A gathered parameter that escapes through the graph's outputs (saved
for backward, or returned) is not released; that is recorded as a warning, since it means a full
parameter stays resident.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Sequence

import torch
import torch.fx

from ..ops import RELEASE, is_zinf, tag
from ..pipeline import CompileContext
from ._graph import alias_closure, positions
from .schedule import in_place_uids


def insert_release_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    if any(is_zinf(n, RELEASE) for n in graph.nodes):
        return gm
    pos = positions(graph)
    gathers = [n for n in graph.nodes if n.meta.get("zinf", {}).get("owns_full")]
    in_place = in_place_uids(ctx)[0]
    for g in gathers:
        closure = alias_closure(g)
        readers = {u for a in closure for u in a.users if u not in closure}
        if any(u.op == "output" for u in readers):
            uid = g.meta["zinf"]["uid"]
            msg = (f"zinf: gathered parameter {g.meta['zinf'].get('param', uid)} escapes graph "
                   f"{ctx.record.name} through its outputs; it stays resident (not released)")
            ctx.record.warnings.append(msg)
            ctx.record.counters["gathered_escaped"] += 1
            warnings.warn(msg)
            continue
        if g.meta["zinf"]["uid"] in in_place:
            # a shard read where it lives (dp = 1, in the compute device's memory) frees nothing on
            # release, and the release's ``after`` list would force its readers' results into
            # buffers of their own, cutting Inductor's fusion there
            ctx.record.counters["release_skipped_in_place"] += 1
            continue
        deps = [d for r in sorted(readers, key=pos.__getitem__) for d in _tensor_results(r)]
        last = max(list(readers) + deps + closure, key=pos.__getitem__)
        with graph.inserting_after(last):
            rel = graph.call_function(RELEASE, (g, g.meta["zinf"]["uid"], deps))
        tag(rel, "release", g.meta["zinf"]["uid"], param=g.meta.get("zinf", {}).get("param"), after=last.name)
        ctx.record.counters["release_inserted"] += 1
    return gm


def _tensor_results(node: torch.fx.Node) -> List[torch.fx.Node]:
    """The tensor-valued nodes that carry ``node``'s results (itself, or its getitem users)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [node]
    if isinstance(val, (tuple, list)):
        return [u for u in node.users if isinstance(u.meta.get("val"), torch.Tensor)]
    return []
