"""Collectives used by the runtime, in one place so torch-version differences stay here.

``all_gather_into_tensor`` / ``reduce_scatter_tensor`` exist from torch 1.13 and work on gloo and
NCCL; newer torch warns that they are deprecated in favour of ``all_gather_single`` /
``reduce_scatter_single``, which torch 2.11 lacks, so we use the newer names when present.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def world_size(group: ProcessGroup) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_src_rank(group: ProcessGroup) -> int:
    """Global rank of the group's rank 0 (what ``broadcast(src=...)`` wants)."""
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> None:
    """``out`` (world × shard elements) receives every rank's ``shard`` in rank order."""
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(out, shard, group=group)
    else:
        dist.all_gather_into_tensor(out, shard, group=group)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup) -> None:
    """``out`` receives the sum over ranks of this rank's slice of ``full``."""
    fn = getattr(dist, "reduce_scatter_single", None)
    if fn is not None:
        fn(out, full, op=dist.ReduceOp.SUM, group=group)
    else:
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group)


def broadcast(t: torch.Tensor, group: ProcessGroup) -> None:
    dist.broadcast(t, src=group_src_rank(group), group=group)


def all_reduce_sum(t: torch.Tensor, group: ProcessGroup) -> None:
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def all_reduce_max(t: torch.Tensor, group: ProcessGroup) -> None:
    if world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
