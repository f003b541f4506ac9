"""Small FX helpers shared by the passes: node order, aliasing, op counts, fake values."""

from __future__ import annotations

import operator
from collections import Counter
from typing import Dict, List, Set

import torch
import torch.fx

_ALIASING_WITHOUT_ANNOTATION = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
}


def may_alias_input(node: torch.fx.Node) -> bool:
    """Whether ``node``'s output may share storage with a tensor input (views and view-likes)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if target in _ALIASING_WITHOUT_ANNOTATION:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None for r in schema.returns) and not schema.is_mutable


def alias_closure(root: torch.fx.Node) -> List[torch.fx.Node]:
    """``root`` and every node that may alias it, transitively through view-like ops."""
    seen: Set[torch.fx.Node] = {root}
    order = [root]
    stack = [root]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and may_alias_input(u):
                seen.add(u)
                order.append(u)
                stack.append(u)
    return order


def positions(graph: torch.fx.Graph) -> Dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def op_counts(graph: torch.fx.Graph) -> Dict[str, int]:
    """How many call_function nodes of each target (by readable name) a graph holds."""
    c: Counter = Counter()
    for n in graph.nodes:
        if n.op == "call_function":
            c[getattr(n.target, "__name__", str(n.target)) if not hasattr(n.target, "_schema") else str(n.target)] += 1
    return dict(sorted(c.items()))


def placeholders(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]
