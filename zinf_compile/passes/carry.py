"""Carry the next graph stage's first NVMe reads into this stage's end (``zinf_runtime.carry`` says why).

Runs last on the forward, backward and inference graphs, after ``schedule``; ``stage`` is bound with
``functools.partial``. A no-op unless some parameter lives on NVMe and the NVMe lookahead is on::

    before:  ...; return (loss, saved...)
    after:   ...; tk = zinf.carry_ticket(key); zinf.carry(tk, [loss, saved...], key, "forward", uids); return (...)

``carry`` takes every output as an input, so any compiler runs it after the forward's last result;
it writes its ticket (a fresh one-element tensor), so no compiler drops it as dead code. Which reads
to start is the runtime's: the backend registers each stage's heads (``graph_heads``) once its
schedule is planned, and the runtime learns which stage follows which.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch
import torch.fx

from ..ops import tag
from ..pipeline import CompileContext

Z = torch.ops.zinf


def carry_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext,
               stage: str = "forward") -> torch.fx.GraphModule:
    nvme = ctx.cfg.offload_params == "nvme" or any(info.tier == "nvme" for info in ctx.params.values())
    scheduled = not {"plan_schedule", "schedule"} & set(ctx.cfg.disabled_passes)
    if not nvme or not scheduled or ctx.cfg.prefetch_depths[0] == 0 or not ctx.params:
        return gm  # no lookahead, no carrying: the graph stays as it was
    graph = gm.graph
    out = graph.find_nodes(op="output")[0]
    flat: List[Any] = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    after = [n for n in flat if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    key = ctx.record.id
    uids = sorted({info.uid for info in ctx.params.values()})
    with graph.inserting_before(out):
        tk = graph.call_function(Z.carry_ticket.default, (key,))
        node = graph.call_function(Z.carry.default, (tk, after, key, stage, uids))
    tk.meta["val"] = torch.empty(1, dtype=torch.int64)
    tag(tk, "carry_ticket", uids[0])
    tag(node, "carry", uids[0], graph=key, stage=stage)
    ctx.record.counters["carry_ops"] += 1
    return gm


def graph_heads(gm: torch.fx.GraphModule) -> List[int]:
    """The uids whose NVMe reads the graph's schedule wants before its first operator, in use order."""
    heads = []
    for n in gm.graph.nodes:
        z = n.meta.get("zinf") or {}
        if z.get("kind") == "load_start" and z.get("at", 0) < 0:
            heads.append((z["op"], z["uid"]))
    return [uid for _, uid in sorted(heads)]
