"""Keep tensors whose memory the runtime owns referenced to the graph's end, so no compiler reuses it.

Runs last on the forward, backward and inference graphs. Inductor (like any compiler with a memory
planner) treats a custom op's result as a buffer it may reuse once its last reader ran: it writes a
later result into that buffer (``buf2 = reinterpret_tensor(buf1, ...); del buf1  # reuse``) or
computes a pointwise kernel in place over it. That is only safe for memory the graph owns. Here it
is not:

- a fetch read in place (dp = 1, the shard in the compute device's memory) *is* the parameter's
  slot, so reusing it overwrites the parameter (a pointwise ``x + w`` with ``x`` and ``w`` of one
  shape did: measured wrong loss on the second step, before this pass);
- a released fetch or gather has had its storage freed (``resize_(0)``), so a later result written
  there would land in freed memory;
- a donated gradient (``donate_grads``) is the gradient's slot now.

So::

    before:  w = zinf.fetch_shard(p, uid, n, f32); y = add(x, view(w)); ...; return (y, ...)
    after:   w = zinf.fetch_shard(p, uid, n, f32); y = add(x, view(w)); ...; zinf.keep([w, ...]); return (...)

``keep`` does nothing at run time. It costs one call per graph and no memory: an in-place shard and
a donated gradient are slot memory anyway, a released one has none, and a fetched copy that is
never released is freed when the graph drops it, at its end (only when the compile-time guess that
it reads in place was wrong). The memory plan ignores ``keep`` as a use.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.fx

from ..ops import ALL_GATHER, FETCH_SHARD, KEEP, REDUCE_GRAD, WAIT_GATHER, WAIT_UPLOAD, is_zinf, tag
from ..pipeline import CompileContext

_RUNTIME_OWNED = (FETCH_SHARD, WAIT_UPLOAD, ALL_GATHER, WAIT_GATHER)


def keep_alive_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                    ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    if any(is_zinf(n, KEEP) for n in graph.nodes):
        return gm
    kept: List[torch.fx.Node] = []
    uids: List[int] = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _RUNTIME_OWNED and isinstance(n.meta.get("val"), torch.Tensor):
            kept.append(n)
            uids.append((n.meta.get("zinf") or {}).get("uid", -1))
        elif n.target is REDUCE_GRAD and n.kwargs.get("donated"):
            kept.append(n.args[0])
            uids.append(n.args[2])
    if not kept:
        return gm
    out = graph.find_nodes(op="output")[0]
    with graph.inserting_before(out):
        keep = graph.call_function(KEEP, (kept,))
    tag(keep, "keep", uids[0], uids=uids)
    ctx.record.counters["kept_to_end"] += len(kept)
    return gm
