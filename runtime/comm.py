"""Collectives used by the runtime, in one place so torch-version and backend differences stay here.

``all_gather_into_tensor`` / ``reduce_scatter_tensor`` exist from torch 1.13 and work on gloo and
NCCL; newer torch warns that they are deprecated in favour of ``all_gather_single`` /
``reduce_scatter_single``, which torch 2.11 lacks, so we use the newer names when present.

**Devices.** A process group's backend decides where its tensors must live: gloo takes CPU tensors,
NCCL only CUDA tensors (it refuses CPU ones). :func:`group_device` derives that device from
``dist.get_backend(group)``. Two kinds of helpers:

* hot-path collectives on compute tensors (:func:`all_gather_flat`, :func:`reduce_scatter_flat`: the
  graph's fetch and gradient reduction) require their tensors on the group's device and raise a
  clear error otherwise: a silent host round trip per parameter would hide a performance bug;
* movers for tensors that live elsewhere by design (:func:`all_reduce_sum` for the CPU scalar of
  ``clip_grad_norm_``, :func:`broadcast` of CPU parameters at partition time,
  :func:`all_gather_to` of CPU masters when a weight is re-laid out as tiles) copy to the group's
  device, run the collective there and copy the result back::

      t (cpu) --.to(cuda)--> staged --dist.all_reduce(nccl)--> staged --copy_--> t (cpu)

**Strict mode** (env ``ZINF_STRICT_COMM=1``, or ``with comm.strict():``; on in the test suite)
checks every tensor handed to ``torch.distributed`` here: it must be on the group's device, and it
must come from the compute path, never be the memory of a store slot (``tiers.Slot`` tags its
tensors with :func:`tag_slot`): a collective on a slot's pinned host memory races with the CPU
optimizer and, on NCCL, is refused anyway. The slot check runs even at dp = 1, where the
collectives themselves are skipped, so single-process tests exercise it.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup) -> int:
    if not _initialized():
        return 1
    return dist.get_world_size(group)


def rank(group: ProcessGroup) -> int:
    if not _initialized():
        return 0
    return dist.get_rank(group)


def group_src_rank(group: ProcessGroup) -> int:
    """Global rank of the group's rank 0 (what ``broadcast(src=...)`` wants)."""
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


# -- devices ----------------------------------------------------------------------------------------
def _backend_device_types(backend: str) -> Tuple[str, ...]:
    """Device types a backend string accepts: ``"gloo"``, ``"nccl"``, or ``"cpu:gloo,cuda:nccl"``."""
    backend = backend.lower()
    if ":" in backend:  # a per-device mapping
        return tuple(part.split(":", 1)[0].strip() for part in backend.split(",") if ":" in part)
    if backend == "nccl":
        return ("cuda",)
    if backend == "gloo":
        return ("cpu",)
    return ()  # mpi, ucc, custom: unknown, not checked


def group_device(group: ProcessGroup, like: Optional[torch.device] = None) -> torch.device:
    """The device the group's collectives take tensors on (``like`` when it is accepted, or when
    ``torch.distributed`` is not initialized / the backend is unknown)."""
    like = torch.device("cpu") if like is None else torch.device(like)
    if not _initialized():
        return like
    types = _backend_device_types(str(dist.get_backend(group)))
    if not types or like.type in types:
        return like
    if types[0] == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(types[0])


# -- strict mode ------------------------------------------------------------------------------------
_strict_local = threading.local()
_slot_tags: Dict[int, Tuple["weakref.ref[torch.Tensor]", str]] = {}
_tags_lock = threading.Lock()


def strict_enabled() -> bool:
    forced = getattr(_strict_local, "value", None)
    if forced is not None:
        return forced
    return os.environ.get("ZINF_STRICT_COMM", "0") not in ("", "0")


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Turn strict checking on (or off) for collectives called in this block, on this thread."""
    prev = getattr(_strict_local, "value", None)
    _strict_local.value = enabled
    try:
        yield
    finally:
        _strict_local.value = prev


def tag_slot(t: torch.Tensor, name: str) -> None:
    """Mark ``t``'s storage as a store slot's memory (not a collective's buffer); untagged when the
    tensor is freed."""
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return
    ref = weakref.ref(t)
    with _tags_lock:
        _slot_tags[ptr] = (ref, name)
    weakref.finalize(t, _untag, ptr, ref)


def _untag(ptr: int, ref: "weakref.ref[torch.Tensor]") -> None:
    with _tags_lock:
        if _slot_tags.get(ptr, (None,))[0] is ref:  # not a newer tag of reused memory
            del _slot_tags[ptr]


def slot_of(t: torch.Tensor) -> Optional[str]:
    """The name of the slot whose memory ``t`` is (or views), else None."""
    if not _slot_tags:
        return None
    ent = _slot_tags.get(t.untyped_storage().data_ptr())
    if ent is None or ent[0]() is None:
        return None
    return ent[1]


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor on a device its process group's backend does not take."""


class StrictCommError(RuntimeError):
    """Strict mode: a collective got a tensor that is a store slot's memory."""


def _check(op: str, t: torch.Tensor, group: ProcessGroup, *, device: str) -> None:
    """In strict mode, refuse a slot's memory. Refuse a tensor off the group's device when
    ``device`` is ``"always"``, or ``"strict"`` and strict mode is on (``"never"``: a mover's input,
    which is about to be staged)."""
    strict_on = strict_enabled()
    if strict_on:
        name = slot_of(t)
        if name is not None:
            raise StrictCommError(
                f"zinf comm (strict): {op} was given the memory of store slot {name!r}; collectives must "
                "run on compute-path tensors. Fix: pass a copy staged on the process group's device "
                "(e.g. comm.all_gather_to / comm.all_reduce_sum do this), never a slot's tensor.")
    if (device == "always" or (device == "strict" and strict_on)) and _initialized():
        want = group_device(group, t.device)
        if t.device.type != want.type:
            backend = dist.get_backend(group)
            raise CollectiveDeviceError(
                f"zinf comm: {op} got a tensor on {t.device}, but the process group's backend "
                f"{backend!r} takes {want.type} tensors. Fix: move it to {want} first, or use the moving "
                "helpers comm.all_reduce_sum / comm.broadcast / comm.all_gather_to.")


# -- hot-path collectives: tensors already on the group's device ------------------------------------
def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Any:
    """``out`` (world × shard elements) receives every rank's ``shard`` in rank order.

    ``async_op``: returns the work handle; ``out`` is valid, and ``shard`` may be reused, only
    after its ``wait()`` (which, on CUDA, orders the current stream after the collective)."""
    _check("all_gather", shard, group, device="always")
    _check("all_gather (output)", out, group, device="always")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Any:
    """``out`` receives the sum over ranks of this rank's slice of ``full`` (``async_op``: as for
    ``all_gather_flat``)."""
    _check("reduce_scatter", full, group, device="always")
    _check("reduce_scatter (output)", out, group, device="always")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


# -- movers: tensors that live off the group's device by design -------------------------------------
def _staged_inplace(op: str, t: torch.Tensor, group: ProcessGroup, run: Callable[[torch.Tensor], None]) -> None:
    """Run the in-place collective ``run`` on ``t`` through a copy on the group's device if needed."""
    _check(op, t, group, device="never")  # slot memory is refused before anything moves
    dev = group_device(group, t.device)
    if dev == t.device and t.is_contiguous():
        _check(op, t, group, device="strict")
        run(t)
        return
    staged = t.detach().to(dev, copy=True).contiguous()
    _check(op, staged, group, device="strict")
    run(staged)
    _unstage(t, staged)


def _unstage(t: torch.Tensor, staged: torch.Tensor) -> None:
    """Write a staged collective's result back into ``t``: a blocking copy, so ``t`` is valid on
    return whatever its device."""
    with torch.no_grad():
        t.copy_(staged)


def broadcast(t: torch.Tensor, group: ProcessGroup) -> None:
    """``t`` (in place) takes the value of the group's rank 0; staged through the group's device."""
    _staged_inplace("broadcast", t, group, lambda x: dist.broadcast(x, src=group_src_rank(group), group=group))


def all_reduce_sum(t: torch.Tensor, group: ProcessGroup) -> None:
    """``t`` (in place, any device: e.g. a CPU scalar) becomes the sum over the group's ranks.

    Without ``torch.distributed`` initialized it is left alone (dp = 1); strict mode still checks it.
    """
    if not _initialized():
        _check("all_reduce", t, group, device="never")
        return
    _staged_inplace("all_reduce", t, group, lambda x: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group))


def all_gather_to(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` joined in rank order (``world * t.numel()`` elements), on ``t``'s device.

    ``t`` may be a slot's memory (a CPU master): it is copied to the group's device first, so the
    collective only ever sees a private staged tensor.
    """
    dev = group_device(group, t.device)
    staged = t.detach().reshape(-1).to(dev, copy=True)
    out = torch.empty(world_size(group) * staged.numel(), dtype=staged.dtype, device=dev)
    all_gather_flat(out, staged, group)
    return out if out.device == t.device else out.to(t.device)


def all_reduce_max(t: torch.Tensor, group: ProcessGroup) -> None:
    """``t`` (in place) becomes the elementwise max over the group's ranks (GradScaler's found_inf)."""
    if not _initialized():
        _check("all_reduce", t, group, device="never")
        return
    _staged_inplace("all_reduce", t, group, lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group))


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
