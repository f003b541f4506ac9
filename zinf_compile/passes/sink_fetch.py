"""Move each fetch chain to just before its first use, after partitioning.

The partitioner copies recomputed nodes into the backward in joint-graph order, which puts every
re-gather at the top of the backward graph: all parameters would be gathered at once. This pass
moves each fetch (and nodes computed from gathered parameters alone) down to its first user::

    before: fetch(w1); fetch(w2); fetch(w3); mm(.., w3); mm(.., w2); mm(.., w1)
    after:  fetch(w3); mm(.., w3); fetch(w2); mm(.., w2); fetch(w1); mm(.., w1)

Later prefetch scheduling (lookahead) moves them up again by a bounded distance, on purpose.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..pipeline import CompileContext


def _movable(n: torch.fx.Node) -> bool:
    z = n.meta.get("zinf")
    return n.op == "call_function" and z is not None and z["kind"] in ("fetch_shard", "all_gather", "param_derived")


def sink_fetch_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    moved = 0
    for n in reversed(list(graph.nodes)):
        if not _movable(n) or not n.users:
            continue
        # the first user in graph order: walk forward from n
        users = set(n.users)
        cur = n.next
        while cur.op != "root" and cur not in users:
            cur = cur.next
        if cur is not n.next:
            cur.prepend(n)
            moved += 1
    ctx.record.counters["fetch_sunk"] += moved
    return gm
