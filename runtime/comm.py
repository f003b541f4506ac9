"""Collectives used by the runtime, in one place so torch-version differences stay here.

``all_gather_into_tensor`` / ``reduce_scatter_tensor`` exist from torch 1.13 and work on gloo and
NCCL; newer torch warns that they are deprecated in favour of ``all_gather_single`` /
``reduce_scatter_single``, which torch 2.11 lacks, so we use the newer names when present.
"""

from __future__ import annotations

import os
from datetime import timedelta
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


def group_device(group: ProcessGroup) -> torch.device:
    """The device a collective of ``group`` takes its tensors on (NCCL refuses CPU tensors)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_timeout_s() -> float:
    """How long a zinf rendezvous waits for the other ranks (``ZINF_COLLECTIVE_TIMEOUT_S``, 300 s):
    a rank that runs a compiled graph alone (evaluation on rank 0 only) gets an error, not a hang."""
    return float(os.environ.get("ZINF_COLLECTIVE_TIMEOUT_S", "300"))


def rendezvous(fingerprint: int, what: str, group: ProcessGroup) -> None:
    """Check that every rank of ``group`` is about to run the same compiled graph the same way.

    One all-reduce of two int64s (max of ``fp`` and of ``-fp``) before a graph's first collective:
    ranks that disagree all raise, naming the graph; a rank whose peers never arrive raises after
    ``collective_timeout_s()``. Without it, one rank evaluating alone blocks forever in its first
    all-gather, or exchanges shards with a peer that is in another graph.
    """
    if world_size(group) == 1:
        return
    t = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=group_device(group))
    timeout = collective_timeout_s()
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise RuntimeError(
            f"zinf: rank {rank(group)} waited {timeout:.0f} s for the other ranks of its dp group to run "
            f"{what}; they did not. With dp > 1 every rank must call the compiled model the same way "
            "(training and evaluation alike: evaluate on every rank, each on its share of the data), or "
            "evaluate an eager copy built from zinf_compile.full_state_dict(model) on one rank. "
            "(ZINF_COLLECTIVE_TIMEOUT_S sets the wait.)") from exc
    if ok is False:
        raise RuntimeError(f"zinf: rank {rank(group)}: rendezvous for {what} timed out after {timeout:.0f} s")
    if int(t[0]) != fingerprint or -int(t[1]) != fingerprint:
        raise RuntimeError(
            f"zinf: the ranks of the dp group are running different compiled graphs (rank {rank(group)}: "
            f"{what}). With dp > 1 every rank must call the compiled model the same way, in the same "
            "order and grad mode: evaluate on every rank, or evaluate an eager copy built from "
            "zinf_compile.full_state_dict(model) on one rank.")
