"""Decide which matmuls to tile, and into how many tiles (planning only: tags, no rewrite).

Runs on the Dynamo graph. A partitioned weight ``W`` qualifies when every use of it is the weight
operand of a matmul (``F.linear``, ``@``/``matmul``/``mm``/``bmm``, directly or through one
transpose) and its bytes exceed ``tile_threshold_bytes``, or its working memory (weight tile +
gradient tile) would not fit in half of ``device_memory_budget``::

    before: W (placeholder);  y = linear(x, W, b)
    after:  W.meta["zinf"] = {"kind": "tile_plan", "tiles": T, "dim": 0, "bounds": [(0, r1), ...]}
            y.meta["zinf"] = {"kind": "tile_use", "mode": "linear", "transpose": False}

``tile_matmul`` then rewrites exactly the tagged nodes; without tags it does nothing.
"""

from __future__ import annotations

import math
import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from ..pipeline import CompileContext

LINEAR = (torch._C._nn.linear, F.linear)
MATMUL = (operator.matmul, torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm)
ADDMM = (torch.addmm, torch.Tensor.addmm)  # addmm(bias, x, W): the weight is the third operand


def _is_transpose(n: torch.fx.Node) -> bool:
    """``W.t()``, ``W.T``, ``torch.t(W)``, ``W.transpose(0, 1)`` of a 2-D ``W``."""
    if n.op == "call_method" and n.target == "t":
        return True
    if n.op == "call_function" and n.target is torch.t:
        return True
    if n.op == "call_function" and n.target is getattr and n.args[1] in ("T", "mT"):
        return True
    if n.op == "call_method" and n.target == "transpose":
        return sorted(int(a) % 2 for a in n.args[1:3]) == [0, 1]
    return False


def _weight_arg(use: torch.fx.Node) -> Optional[torch.fx.Node]:
    if use.op != "call_function":
        return None
    if use.target in LINEAR:
        return use.args[1] if len(use.args) > 1 else use.kwargs.get("weight")
    if use.target in MATMUL and len(use.args) == 2 and not use.kwargs:
        return use.args[1]
    if use.target in ADDMM and len(use.args) == 3 and not use.kwargs:
        return use.args[2]
    return None


def classify(w: torch.fx.Node, ndim: int) -> Optional[List[Tuple[torch.fx.Node, str, bool, int]]]:
    """Every use of ``w`` as ``(matmul node, mode, transpose tile, tile dim of W)``, or None."""
    uses = []
    for u in w.users:
        transpose = False
        node = u
        if _is_transpose(u) and ndim == 2:
            if len(u.users) != 1:
                return None
            node, transpose = next(iter(u.users)), True
        if _weight_arg(node) is not (u if transpose else w):
            return None
        mode = "linear" if node.target in LINEAR else "addmm" if node.target in ADDMM else "matmul"
        if mode == "linear":
            dim = 1 if transpose else 0  # the weight's rows are the output features
        else:
            dim = 0 if transpose else ndim - 1  # the right operand's last dim is the output
        uses.append((node, mode, transpose, dim))
    dims = {d for *_, d in uses}
    return uses if uses and len(dims) == 1 else None


def tile_count(nbytes: int, extent: int, cfg: Any) -> int:
    """The tile count for a weight of ``nbytes`` whose tiled dimension has ``extent`` entries."""
    budget = cfg.device_memory_budget
    over = nbytes > cfg.tile_threshold_bytes
    if cfg.tiles is not None:
        t = cfg.tiles if over else 1
    else:
        t = math.ceil(nbytes / max(cfg.tile_threshold_bytes, 1)) if over else 1
        if budget is not None:  # weight tile + gradient tile within half of the budget
            t = max(t, math.ceil(2 * nbytes / max(budget // 2, 1)))
    return max(1, min(t, extent))


def split_bounds(extent: int, tiles: int) -> List[Tuple[int, int]]:
    """``tiles`` contiguous ranges covering ``[0, extent)``, sizes differing by at most one."""
    base, extra = divmod(extent, tiles)
    out, lo = [], 0
    for i in range(tiles):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def plan_tiling_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, ctx: CompileContext) -> torch.fx.GraphModule:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for idx, info in ctx.params.items():
        w = phs[idx]
        nbytes = math.prod(info.shape) * info.dtype.itemsize
        if not w.users or len(info.shape) < 2:
            continue
        uses = classify(w, len(info.shape))
        if uses is None:
            if nbytes > ctx.cfg.tile_threshold_bytes:
                ctx.record.warnings.append(f"zinf: {info.name} exceeds tile_threshold_bytes but is used other "
                                           "than as a matmul weight; not tiled")
            continue
        dim = uses[0][3]
        t = tile_count(nbytes, info.shape[dim], ctx.cfg)
        if t <= 1:
            continue
        w.meta["zinf"] = {"kind": "tile_plan", "uid": info.uid, "param": info.name, "tiles": t, "dim": dim,
                          "bounds": split_bounds(info.shape[dim], t), "bytes": nbytes}
        for node, mode, transpose, _ in uses:
            node.meta["zinf"] = {"kind": "tile_use", "uid": info.uid, "mode": mode, "transpose": transpose}
        ctx.record.counters["tiles_planned"] += t
        ctx.record.counters["operators_tiled"] += len(uses)
    return gm
