"""Rewrite each tagged matmul into a loop over weight tiles, each tile its own partitioned input.

Runs on the Dynamo graph after ``plan_tiling``; a no-op without its tags. Between the two, the
backend's partition step (``backend.relayout_tiles``) re-lays the weight in the store as T units
(``ParamHandle.split_into_tiles``, collective when dp > 1); this pass only rewrites the graph: each
unit becomes a graph input of its own (a 0-byte tensor of the tile's shape), so AOTAutograd gives
every tile its own gradient::

    before: y = linear(x, W, b)                              # W: [out, in], one unit
    after:  y = cat([linear(x, W_0, b[0:r1]),                # W_i: [r_{i+1} - r_i, in], unit i
                     linear(x, W_1, b[r1:r2]), ...], -1)

Later passes then fetch each tile just before its matmul and release it right after, in forward and
backward; each tile's gradient is reduce-scattered alone; the input gradient is the sum over tiles
(autograd's accumulation of the T uses of ``x``). The loop is ordinary eager code (``tiled_matmul``)
traced onto the graph through FX proxies, as Inductor's ``decompose_mm`` writes its replacements.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn.functional as F

import zinf_runtime

from ..pipeline import CompileContext, ParamInfo


def tiled_matmul(x: torch.Tensor, tiles: Sequence[torch.Tensor], bounds: Sequence[Tuple[int, int]], *,
                 op: Callable, transpose: bool, bias: Optional[torch.Tensor] = None,
                 bias_first: bool = False) -> torch.Tensor:
    """The replacement, as eager code: one matmul per weight tile, outputs concatenated.

    ``bias`` (sliced along the output dimension) is ``op``'s third argument (``F.linear``) or, with
    ``bias_first``, its first (``addmm(bias, x, w)``).
    """
    outs = []
    for w, (lo, hi) in zip(tiles, bounds):
        w = w.t() if transpose else w
        if bias is None:
            outs.append(op(x, w))
        elif bias_first:
            outs.append(op(bias[..., lo:hi], x, w))
        else:
            outs.append(op(x, w, bias[..., lo:hi]))
    return torch.cat(outs, dim=-1)


def tile_matmul_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    plans = [(i, n) for i, n in enumerate(phs) if n.meta.get("zinf", {}).get("kind") == "tile_plan"]
    last = phs[-1] if phs else None
    n_inputs = len(phs)
    for idx, w in plans:
        plan = w.meta["zinf"]
        handle = zinf_runtime.store.get(plan["uid"])
        tiles = handle.tiles
        if tiles is None or (handle.tile_dim, handle.tile_bounds) != (plan["dim"], tuple(map(tuple, plan["bounds"]))):
            raise RuntimeError(f"zinf: tile_matmul found {plan['param']} not re-laid as planned (tiles along "
                               f"dim {plan['dim']} at {plan['bounds']}); the backend's relayout_tiles step "
                               "must run between plan_tiling and tile_matmul")
        tile_nodes: List[torch.fx.Node] = []
        for k, (th, tensor) in enumerate(zip(tiles, handle.tile_inputs())):
            with graph.inserting_after(last):
                node = graph.placeholder(f"{w.name}_zinf_tile{k}")
            node.meta["zinf"] = {"kind": "tile_input", "uid": th.uid, "param": th.name, "of": plan["param"]}
            node._dynamo_source = None  # AOTAutograd reads it on Dynamo graphs; None = no user source
            last = node
            new_idx = n_inputs + len(ctx.extra_inputs)
            ctx.extra_inputs.append(tensor)
            ctx.extra_specs.append((idx, th.uid))
            ctx.params[new_idx] = ParamInfo(new_idx, th.uid, th.name, tuple(th.shape), th.dtype,
                                            th.shard_numel, th.requires_grad, th.world,
                                            tier=th.placement.tier, optim_tier=th.placement.master_tier)
            tile_nodes.append(node)
        for use in [u for u in _uses(w)]:
            _rewrite_use(graph, use, w, tile_nodes, plan["bounds"])
        ctx.record.counters["tiled_weights"] += 1
    return gm


def _uses(w: torch.fx.Node) -> List[torch.fx.Node]:
    out = []
    for u in w.users:
        if u.meta.get("zinf", {}).get("kind") == "tile_use":
            out.append(u)
        else:  # a transpose whose single user is the tagged matmul
            out.extend(v for v in u.users if v.meta.get("zinf", {}).get("kind") == "tile_use")
    return out


def _rewrite_use(graph: torch.fx.Graph, use: torch.fx.Node, w: torch.fx.Node,
                 tile_nodes: List[torch.fx.Node], bounds: Sequence[Tuple[int, int]]) -> None:
    tag = use.meta["zinf"]
    x = use.args[0]
    bias = None
    if tag["mode"] == "linear":
        bias = use.args[2] if len(use.args) > 2 else use.kwargs.get("bias")
        op: Callable = F.linear
    elif tag["mode"] == "addmm":
        bias, x = use.args[0], use.args[1]
        op = use.target
    else:
        op = use.target
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    with graph.inserting_before(use):
        out = tiled_matmul(
            torch.fx.Proxy(x, tracer), [torch.fx.Proxy(t, tracer) for t in tile_nodes], bounds,
            op=op, transpose=tag["transpose"],
            bias=torch.fx.Proxy(bias, tracer) if isinstance(bias, torch.fx.Node) else None,
            bias_first=tag["mode"] == "addmm",
        )
    out.node.meta["zinf"] = {**tag, "kind": "tile_loop", "tiles": len(tile_nodes)}
    old_weight = use.args[2] if tag["mode"] == "addmm" else (use.args[1] if len(use.args) > 1 else use.kwargs.get("weight"))
    use.replace_all_uses_with(out.node)
    graph.erase_node(use)
    if isinstance(old_weight, torch.fx.Node) and old_weight is not w and not old_weight.users:
        graph.erase_node(old_weight)  # the transpose that fed it
