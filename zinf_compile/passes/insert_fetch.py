"""Turn each use of a partitioned parameter into fetch-own-shard -> all-gather, in the joint graph.

Runs on AOTAutograd's joint graph (training) or inference graph, before partitioning::

    before: primals_1 (0-byte param) -> t(primals_1) -> addmm(b, x, t)
    after:  shard = zinf.fetch_shard(primals_1, uid, n, f32)    # recompute: MUST_RECOMPUTE
            w     = zinf.all_gather(shard, uid, [o, i])          # recompute: MUST_RECOMPUTE
            t(w)  -> addmm(b, x, t)                              # t tagged MUST_RECOMPUTE too

At dp = 1 the own shard is the whole parameter: ``w = aten.view(shard, [o, i])`` replaces the
all-gather (a collective over one rank would only copy); the node is still tagged ``all_gather``.

Tagging the fetch and every node computed from gathered parameters alone as must-recompute makes
the min-cut partitioner save only the 0-byte placeholders for backward: the backward re-gathers
instead of keeping full parameters alive between forward and backward (which would silently undo
ZeRO-3). With mixed precision, a parameter whose every use is a cast to the compute dtype is
gathered directly in that dtype and the casts disappear.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Set

import torch
import torch.fx

from .. import _torch_compat
from ..ops import ALL_GATHER, FETCH_SHARD, is_zinf, tag
from ..pipeline import CompileContext
from ._graph import placeholders

_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _cast_dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    """The dtype ``node`` casts its only input to, if it is a pure same-device dtype cast."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]
    allowed = {"dtype", "layout", "device"}
    if set(node.kwargs) - allowed or len(node.args) != 1:
        return None
    val = node.meta.get("val")
    src = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if val is None or src is None or val.device != src.device or val.layout != src.layout:
        return None
    return node.kwargs.get("dtype")


def _is_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def insert_fetch_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    if any(is_zinf(n, FETCH_SHARD) for n in graph.nodes):
        return gm  # already rewritten (idempotent)
    must = _torch_compat.must_recompute_tag()
    phs = placeholders(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    derived: Set[torch.fx.Node] = set()
    for idx, info in ctx.params.items():
        if idx >= len(phs):
            raise RuntimeError(f"zinf: graph has {len(phs)} inputs, expected parameter {info.name} at {idx}")
        ph = phs[idx]
        val = ph.meta.get("val")
        if val is not None and tuple(val.shape) != info.shape:
            raise RuntimeError(
                f"zinf: graph input {idx} ({ph.name}) has shape {tuple(val.shape)}, expected parameter "
                f"{info.name} of shape {info.shape}; AOTAutograd's input order is not what zinf assumes"
            )
        users = sorted(ph.users, key=order.__getitem__)
        if not users:
            continue
        dtype = info.dtype
        casts = []
        if ctx.cfg.compute_dtype is not None and all(_cast_dtype(u) == ctx.cfg.compute_dtype for u in users):
            dtype = ctx.cfg.compute_dtype
            casts = users
        if info.parts:  # tiled by an earlier compile, used whole here: gather each tile, concatenate
            full = _fetch_tiles(graph, ph, users[0], info, dtype, val, must)
            ph.replace_all_uses_with(full, delete_user_cb=lambda u: u.meta.get("zinf", {}).get("kind") != "fetch_shard")
            derived.add(full)
            ctx.record.counters["fetch_inserted"] += len(info.parts)
            continue
        with graph.inserting_before(users[0]):
            shard = graph.call_function(FETCH_SHARD, (ph, info.uid, info.shard_numel, dtype))
            if info.world > 1:
                full = graph.call_function(ALL_GATHER, (shard, info.uid, list(info.shape)))
            else:  # the own shard is the whole parameter: no collective, a view gives it its shape
                full = graph.call_function(torch.ops.aten.view.default, (shard, list(info.shape)))
        if val is not None:
            shard.meta["val"] = val.new_empty((info.shard_numel,), dtype=dtype)
            full.meta["val"] = (
                val.new_empty(info.shape, dtype=dtype) if info.world > 1 else shard.meta["val"].view(info.shape)
            )
        for n in (shard, full):
            n.meta["recompute"] = must
        # ``owns_full``: the node whose storage is the full parameter, the one ``release`` frees
        tag(shard, "fetch_shard", info.uid, param=info.name, dtype=str(dtype), owns_full=info.world == 1)
        tag(full, "all_gather", info.uid, param=info.name, dtype=str(dtype), owns_full=info.world > 1)
        if casts:
            for c in casts:
                c.replace_all_uses_with(full)
                graph.erase_node(c)
            ctx.record.counters["gathered_in_compute_dtype"] += 1
        else:
            ph.replace_all_uses_with(full, delete_user_cb=lambda u: u is not shard)
        derived.add(full)
        ctx.record.counters["fetch_inserted"] += 1

    # Anything computed from gathered parameters alone (views, casts, ...) is recomputed, not saved.
    for n in graph.nodes:
        if n.op != "call_function" or n in derived or is_zinf(n) or _is_random(n):
            continue
        ins = n.all_input_nodes
        if ins and all(i in derived for i in ins):
            derived.add(n)
            n.meta["recompute"] = must
            n.meta.setdefault("zinf", {"kind": "param_derived", "uid": -1})
    return gm


def _fetch_tiles(graph: torch.fx.Graph, ph: torch.fx.Node, before: torch.fx.Node, info: Any,
                 dtype: torch.dtype, val: Any, must: Any) -> torch.fx.Node:
    """``cat([gather(tile_0), ...], tile_dim)``: each tile released right after the copy."""
    pieces = []
    with graph.inserting_before(before):
        for uid, shard_numel, shape in info.parts:
            shard = graph.call_function(FETCH_SHARD, (ph, uid, shard_numel, dtype))
            if info.world > 1:
                piece = graph.call_function(ALL_GATHER, (shard, uid, list(shape)))
            else:
                piece = graph.call_function(torch.ops.aten.view.default, (shard, list(shape)))
            if val is not None:
                shard.meta["val"] = val.new_empty((shard_numel,), dtype=dtype)
                piece.meta["val"] = (val.new_empty(shape, dtype=dtype) if info.world > 1
                                     else shard.meta["val"].view(shape))
            for n in (shard, piece):
                n.meta["recompute"] = must
            tag(shard, "fetch_shard", uid, param=info.name, dtype=str(dtype), owns_full=info.world == 1)
            tag(piece, "all_gather", uid, param=info.name, dtype=str(dtype), owns_full=info.world > 1)
            pieces.append(piece)
        full = graph.call_function(torch.ops.aten.cat.default, (pieces, info.tile_dim))
    if val is not None:
        full.meta["val"] = val.new_empty(info.shape, dtype=dtype)
    full.meta["recompute"] = must
    full.meta["zinf"] = {"kind": "param_derived", "uid": info.uid, "param": info.name}
    return full
