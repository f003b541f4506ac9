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

**Failures** (an error on one rank stops every rank with that error, never a hang). A rank whose
compiled call (or zinf collective) fails posts ``rank R failed in <op>: <error>`` to the default
process group's c10d store (:func:`post_failure`). Every zinf collective on CPU tensors (gloo) is
issued with ``async_op=True`` and waited for in slices of ``ZINF_FAILURE_POLL_S`` (0.5 s): a
collective that completes within the first slice costs one ``wait`` as before; one that does not
reads the store between slices and raises :class:`RankFailedError` naming the failed rank and its
operation, or :class:`CollectiveTimeoutError` after ``ZINF_COLLECTIVE_TIMEOUT_S`` (300 s)::

    rank 1: forward raises IndexError -> post "rank 1 failed in forward of graph 'G' ..." -> re-raise
    rank 0: all_gather waits 0.5 s, reads the store -> RankFailedError("... rank 1 failed in forward ...")

CUDA tensors (NCCL) keep torch's own semantics (``wait()`` only orders the current stream, the CPU
never blocks on a hot-path collective); there the rendezvous before each compiled call polls
``work.is_completed()`` and the store, so a peer's failure surfaces at the next compiled call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]
log = logging.getLogger("zinf_runtime")


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


def _check(op: str, t: torch.Tensor, group: ProcessGroup, *, device: str, slot_ok: bool = False) -> None:
    """In strict mode, refuse a slot's memory (``slot_ok``: ``t`` is only copied, on this thread, before
    the collective starts: an exchange's shard). Refuse a tensor off the group's device when
    ``device`` is ``"always"``, or ``"strict"`` and strict mode is on (``"never"``: a mover's input,
    which is about to be staged)."""
    strict_on = strict_enabled()
    if strict_on and not slot_ok:
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
def _buffer(given: Optional[torch.Tensor], like: torch.Tensor, numel: int, what: str,
            group: ProcessGroup) -> torch.Tensor:
    """An exchange's send or receive buffer: ``given`` (checked), else a new one."""
    if given is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    if given.numel() != numel or given.dtype != like.dtype or not given.is_contiguous():
        raise RuntimeError(f"zinf comm: the exchange's {what} buffer has {given.numel()} {given.dtype} elements "
                           f"where it needs {numel} contiguous {like.dtype} ones")
    _check(f"exchange ({what})", given, group, device="always")
    return given


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                    send: Optional[torch.Tensor] = None, then: Optional[Callable[[], None]] = None) -> Any:
    """``out`` (world × shard elements) receives every rank's ``shard`` in rank order.

    ``async_op``: returns the work handle; ``out`` is valid, and ``shard`` may be reused, only
    after its ``wait()`` (which, on CUDA, orders the current stream after the collective).

    On gloo it runs as an exchange (:func:`exchanges`). At 2 ranks ``shard`` is copied now into this
    rank's row of ``out`` (no copy when it is that row already), which is sent to the peer, whose row
    is received in place: no send buffer (``send`` is not used; :func:`exchange_numel` is 0). From 3
    ranks ``shard`` is copied now into every row of ``send`` (world × shard elements, read until the
    wait; allocated when not given; ``shard`` may be its first row). Either way ``shard`` may be
    reused at once. ``then`` (exchanges only): run once the collective is done (the caller gives its
    buffers back there)."""
    exchange = exchanges(shard, group)
    _check("all_gather", shard, group, device="always", slot_ok=exchange)
    _check("all_gather (output)", out, group, device="always")
    if exchange:
        world, n = world_size(group), shard.numel()
        if world == 2:
            me = rank(group)
            rows = out.view(2, n)
            if shard.data_ptr() != rows[me].data_ptr() or not shard.is_contiguous():
                rows[me].copy_(shard.reshape(n))
            split = _pair_split(me, n)
            return _run("all_gather", out, group, lambda a: dist.all_to_all_single(
                rows[1 - me], rows[me], output_split_sizes=split, input_split_sizes=split, group=group,
                async_op=a), async_op, finish=then)
        send = _buffer(send, shard, world * n, "send", group)
        rows = send.view(world, n)
        if shard.data_ptr() == send.data_ptr() and shard.is_contiguous():  # already its first row
            rows[1:].copy_(rows[0].expand(world - 1, n))
        else:
            rows.copy_(shard.reshape(1, n).expand(world, n))
        return _run("all_gather", send, group, lambda a: dist.all_to_all_single(out, send, group=group, async_op=a),
                    async_op, finish=then)
    if then is not None:
        raise RuntimeError("zinf comm: `then` is for exchanges (comm.exchanges) only")
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return _run("all_gather", shard, group, lambda a: fn(out, shard, group=group, async_op=a), async_op)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                        recv: Optional[torch.Tensor] = None, then: Optional[Callable[[], None]] = None) -> Any:
    """``out`` receives the sum over ranks of this rank's slice of ``full`` (``async_op``: as for
    ``all_gather_flat``).

    On gloo it runs as an exchange (:func:`exchanges`): ``recv`` (:func:`exchange_numel` elements:
    the peer's slice at 2 ranks, every rank's from 3; allocated when not given) receives the other
    ranks' slices for this rank, and the wait sums them with this rank's own into ``out``, in rank
    order, then runs ``then``."""
    _check("reduce_scatter", full, group, device="always")
    _check("reduce_scatter (output)", out, group, device="always")
    if exchanges(full, group):
        world = world_size(group)
        recv = _buffer(recv, full, exchange_numel("reduce_scatter", full.numel(), world), "receive", group)
        if world == 2:
            me, n = rank(group), full.numel() // 2
            mine = full.view(2, n)[me]
            split = _pair_split(me, n)

            def finish_pair() -> None:
                torch.add(*((mine, recv) if me == 0 else (recv, mine)), out=out)  # rank order
                if then is not None:
                    then()

            return _run("reduce_scatter", full, group, lambda a: dist.all_to_all_single(
                recv, full.view(2, n)[1 - me], output_split_sizes=split, input_split_sizes=split, group=group,
                async_op=a), async_op, finish=finish_pair)
        rows = recv.view(world, -1)

        def finish() -> None:
            sum_rows(rows, out)
            if then is not None:
                then()

        return _run("reduce_scatter", full, group,
                    lambda a: dist.all_to_all_single(recv, full, group=group, async_op=a), async_op, finish=finish)
    if then is not None:
        raise RuntimeError("zinf comm: `then` is for exchanges (comm.exchanges) only")
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return _run("reduce_scatter", full, group,
                lambda a: fn(out, full, op=dist.ReduceOp.SUM, group=group, async_op=a), async_op)


def _pair_split(me: int, n: int) -> list:
    """The split sizes of a 2-rank exchange: ``n`` elements to and from the peer, none to itself (gloo
    would copy that chunk locally, for nothing)."""
    split = [n, n]
    split[me] = 0
    return split


def exchange_numel(op: str, numel: int, world: int) -> int:
    """Elements of the buffer of its own an exchange (:func:`exchanges`) needs beside its input and
    output: for ``"all_gather"`` (``numel``: the shard's) the send buffer, none at 2 ranks (the shard
    goes out from its row of the output) and the shard once per rank from 3; for
    ``"reduce_scatter"`` (``numel``: the full input's) the receive buffer, the peer's slice at 2 ranks
    and every rank's slice from 3.

    Why 2 ranks differ: an exchange there needs no chunk to itself, which gloo copies locally and an
    all-gather first replicates. Without it, on this 2-core host (``benchmarks/collective_algorithms.py``,
    ``results/collective-algorithms-pair.json``, per call, two runs): a 7 MiB all-gather (a GPT
    block's bucket) took 4.2-4.6 ms and 2.3-3.6 ms of CPU against 5.4-6.3 ms and 3.6-4.6 ms with it,
    a 7 MiB reduce-scatter 3.6-3.9 ms against 5.5-6.0 ms, 64 MiB 1.1-1.3x; at 1 MiB both forms took
    0.9-1.2 ms. From 3 ranks a middle rank's peers' rows are not one contiguous block (and an
    all-gather must send its shard once per peer), so they keep the form with a chunk to itself."""
    if op == "all_gather":
        return 0 if world == 2 else world * numel
    if op == "reduce_scatter":
        return numel // 2 if world == 2 else numel
    raise ValueError(f"zinf comm: no exchange for {op!r}")


def exchanges(t: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether :func:`all_gather_flat` and :func:`reduce_scatter_flat` on ``t`` run as an exchange:
    one ``all_to_all_single``, where each rank sends every other rank a chunk and receives one from
    each (an all-gather sends its shard replicated; a reduce-scatter sends each rank its slice, then
    sums what it received in rank order). At 2 ranks no chunk goes to itself (:func:`exchange_numel`).

    Why: on gloo, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` stage through copies of
    their own. 2 ranks on this 2-core host, fp32, per call (``benchmarks/collective_algorithms.py``,
    two runs): a 7 MiB reduce-scatter (a GPT block's bucket) took 8.7-9.7 ms and 5.7-6.9 ms of CPU
    against 3.8-4.1 ms and 2.8 ms; at 64 MiB 2.2-2.4x. An all-gather gained less: 0.9-1.25x at
    1-16 MiB with about the same CPU, 1.5x at 64 MiB; it is an exchange too because it then needs
    no copy of a shard read in place (its send buffer is the copy), and the 25M GPT's dp-2 step was
    2-4% faster with it than with the reduce-scatter alone. On two cores the collectives' CPU is the
    compute's. The sum is exact to the same bits at 2 ranks (``a + b == b + a``) and, beyond, in a
    fixed rank order; an all-gather only moves bytes. On NCCL torch's collectives stay (on the
    device, in place, at link speed)."""
    return _initialized() and _sliced_wait(t, group) and world_size(group) > 1


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out = rows[0] + rows[1] + ...``, left to right (rank order), in one pass at two ranks."""
    if rows.shape[0] == 1:
        out.copy_(rows[0])
        return
    torch.add(rows[0], rows[1], out=out)
    for k in range(2, rows.shape[0]):
        out.add_(rows[k])


def _global(group: ProcessGroup, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (what ``dist.broadcast``/``dist.reduce`` want)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_flat(t: torch.Tensor, src: int, group: ProcessGroup, async_op: bool = False) -> Any:
    """``t`` (in place) takes the value of group rank ``src`` (``partition="broadcast"``'s fetch;
    ``async_op``: as for ``all_gather_flat``)."""
    _check("broadcast", t, group, device="always")
    return _run("broadcast", t, group,
                lambda a: dist.broadcast(t, src=_global(group, src), group=group, async_op=a), async_op)


def reduce_flat(t: torch.Tensor, dst: int, group: ProcessGroup, async_op: bool = False) -> Any:
    """Group rank ``dst``'s ``t`` (in place) becomes the sum over ranks; the others' ``t`` is clobbered
    (gloo reduces through it): pass a private copy (``partition="broadcast"``'s gradient reduction)."""
    _check("reduce", t, group, device="always")
    return _run("reduce", t, group,
                lambda a: dist.reduce(t, dst=_global(group, dst), op=dist.ReduceOp.SUM, group=group,
                                      async_op=a), async_op)


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


def broadcast(t: torch.Tensor, group: ProcessGroup, src: int = 0) -> None:
    """``t`` (in place) takes the value of group rank ``src`` (default 0); staged through the group's device."""
    _staged_inplace("broadcast", t, group, lambda x: _run(
        "broadcast", x, group, lambda a: dist.broadcast(x, src=_global(group, src), group=group, async_op=a)))


def all_reduce_sum(t: torch.Tensor, group: ProcessGroup) -> None:
    """``t`` (in place, any device: e.g. a CPU scalar) becomes the sum over the group's ranks.

    Without ``torch.distributed`` initialized it is left alone (dp = 1); strict mode still checks it.
    """
    if not _initialized():
        _check("all_reduce", t, group, device="never")
        return
    _staged_inplace("all_reduce", t, group, lambda x: _run(
        "all_reduce", x, group, lambda a: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group, async_op=a)))


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
    _staged_inplace("all_reduce", t, group, lambda x: _run(
        "all_reduce", x, group, lambda a: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group, async_op=a)))


def collective_timeout_s() -> float:
    """How long a zinf collective or rendezvous waits for the other ranks (``ZINF_COLLECTIVE_TIMEOUT_S``,
    300 s): a rank that runs a compiled graph alone (evaluation on rank 0 only) gets an error, not a hang."""
    return float(os.environ.get("ZINF_COLLECTIVE_TIMEOUT_S", "300"))


def failure_poll_s() -> float:
    """Seconds a waiting collective runs between reads of the failure key (``ZINF_FAILURE_POLL_S``, 0.5)."""
    return max(0.01, float(os.environ.get("ZINF_FAILURE_POLL_S", "0.5")))


# -- failures: one rank's error stops every rank -----------------------------------------------------
class RankFailedError(RuntimeError):
    """Another rank of the job failed (its message is in ``failure``); raised on the ranks waiting for it."""

    def __init__(self, message: str, failure: str):
        super().__init__(message)
        self.failure = failure


class GraphMismatchError(RuntimeError):
    """The ranks are about to run different compiled graphs; every rank raises it (nothing to post)."""


class CollectiveTimeoutError(RuntimeError):
    """A zinf collective waited ``ZINF_COLLECTIVE_TIMEOUT_S`` for its peers, and no rank posted a failure."""


# Where failures are posted: a callable returning the default process group's c10d store (or None).
# zinf_compile installs it (the accessor is private torch API, kept in zinf_compile/_torch_compat.py).
_store_provider: Optional[Callable[[], Any]] = None


def set_store_provider(fn: Optional[Callable[[], Any]]) -> None:
    global _store_provider
    _store_provider = fn


def _failure_store() -> Any:
    if _store_provider is None or not _initialized():
        return None
    try:
        return _store_provider()
    except Exception:  # noqa: BLE001 - no store: failures still end in the collective timeout
        return None


def _failure_key() -> str:
    # an elastic restart reuses the agent's store: a failure of the previous attempt must not stop this one
    return f"zinf/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:500]}"


def post_failure(op: str, exc: BaseException) -> Optional[str]:
    """Tell every rank that this one failed in ``op`` (the first failure posted wins); returns the text.

    A :class:`RankFailedError` is a consequence of another rank's failure and is not posted again; a
    :class:`GraphMismatchError` is raised by every rank at once, leaving the process group usable.
    """
    if isinstance(exc, (RankFailedError, GraphMismatchError)) or not _initialized() or dist.get_world_size() == 1:
        return None
    store = _failure_store()
    if store is None:
        return None
    text = f"rank {dist.get_rank()} failed in {op}: {_describe(exc)}"
    try:
        store.compare_set(_failure_key(), "", text)  # sets only if no failure was posted yet
    except Exception as e:  # noqa: BLE001 - posting must never hide the rank's own error
        log.warning("zinf: could not post rank failure to the store: %s", e)
        return None
    return text


def posted_failure() -> Optional[str]:
    """The failure some rank posted, or None."""
    store = _failure_store()
    if store is None:
        return None
    try:
        key = _failure_key()
        if not store.check([key]):
            return None
        return store.get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001 - the store itself is gone (rank 0 died): the collective will say so
        return None


@contextlib.contextmanager
def reporting(op: str) -> Iterator[None]:
    """Post any exception raised inside the block as this rank's failure in ``op``, then re-raise it."""
    try:
        yield
    except BaseException as exc:
        post_failure(op, exc)
        raise


def _peer_failed(op: str, group: ProcessGroup, failure: str) -> RankFailedError:
    return RankFailedError(
        f"zinf: rank {rank(group)} stopped in {op} because {failure}. Every rank stops with this error "
        "instead of waiting for the failed one; fix the failed rank's error (its own traceback has it) "
        "and restart from the last checkpoint.", failure)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def wait(work: Any, op: str, group: ProcessGroup, *, what: Optional[str] = None) -> None:
    """Wait for ``work`` (an ``async_op=True`` collective on CPU tensors) without hanging on a failed peer.

    Waits in slices of :func:`failure_poll_s`; between slices it reads the failure key (a store round
    trip, only for collectives still pending after the first slice). Raises :class:`RankFailedError`
    when a rank posted a failure, :class:`CollectiveTimeoutError` after :func:`collective_timeout_s`,
    and re-raises the backend's own error (a peer's closed connection) as RankFailedError when the
    peer posted its failure before it went.
    """
    timeout, poll = collective_timeout_s(), failure_poll_s()
    t0 = time.monotonic()
    while True:
        try:
            work.wait(timeout=timedelta(seconds=min(poll, max(timeout, 0.01))))
            return
        except RuntimeError as exc:
            # our slice ran out (the work is still pending, or it completed just as the slice ended),
            # or the work itself failed (gloo's own timeout, a peer's closed connection): then it is
            # complete and re-raises at every wait
            try:
                if not _is_timeout(exc):
                    raise
                if work.is_completed():  # a wait now returns (it succeeded) or raises its own error
                    work.wait()
                    return
            except RuntimeError as err:
                failure = posted_failure()
                if failure is not None:
                    raise _peer_failed(op, group, failure) from err
                raise
        failure = posted_failure()
        if failure is not None:
            raise _peer_failed(op, group, failure)
        waited = time.monotonic() - t0
        if waited >= timeout:
            raise CollectiveTimeoutError(
                f"zinf: rank {rank(group)} waited {waited:.0f} s in {what or op} for the other ranks of its dp "
                "group; they did not arrive and none reported a failure. With dp > 1 every rank must call the "
                "compiled model the same way (training and evaluation alike: evaluate on every rank, each on "
                "its share of the data), or evaluate an eager copy built from zinf_compile.full_state_dict(model) "
                "on one rank. Reading the model is collective too: call model.state_dict(), "
                "zinf_compile.full_state_dict and reads of param.grad on every rank (full_state_dict's "
                "rank0_only=True still needs every rank; rank 0 alone gets the tensors). "
                "(ZINF_COLLECTIVE_TIMEOUT_S sets the wait.)")


def _wait_polling_completion(work: Any, op: str, group: ProcessGroup, what: str) -> None:
    """For collectives whose ``wait()`` does not block the CPU (NCCL): poll completion and the store,
    sleeping between polls (from 50 us up to 20 ms), never spinning."""
    timeout, poll = collective_timeout_s(), failure_poll_s()
    t0 = last = time.monotonic()
    nap = 5e-5
    while not work.is_completed():
        time.sleep(nap)
        nap = min(nap * 2, 0.02)
        now = time.monotonic()
        if now - last >= poll:
            last = now
            failure = posted_failure()
            if failure is not None:
                raise _peer_failed(op, group, failure)
        if now - t0 >= timeout:
            raise CollectiveTimeoutError(
                f"zinf: rank {rank(group)} waited {now - t0:.0f} s for the other ranks of its dp group to run "
                f"{what}; they did not. With dp > 1 every rank must call the compiled model the same way, and "
                "read it (model.state_dict(), zinf_compile.full_state_dict, param.grad) on every rank. "
                "(ZINF_COLLECTIVE_TIMEOUT_S sets the wait.)")
    work.wait()


def _sliced_wait(t: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether waits on ``t``'s collective can be cut into slices: gloo's ``wait(timeout)`` leaves the work
    running; NCCL's does not block the CPU at all, MPI's refuses a timeout."""
    return t.device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower()


class Pending:
    """An ``async_op=True`` hot-path collective on gloo; ``wait()`` waits as :func:`wait` does
    (watching for a failed peer), then runs its local ``finish`` once (an exchange's sum), and posts
    this rank's failure if either fails."""

    __slots__ = ("work", "op", "group", "finish")

    def __init__(self, work: Any, op: str, group: ProcessGroup,
                 finish: Optional[Callable[[], None]] = None) -> None:
        self.work, self.op, self.group, self.finish = work, op, group, finish

    def wait(self) -> None:
        try:
            wait(self.work, self.op, self.group)
            finish, self.finish = self.finish, None
            if finish is not None:
                finish()
        except BaseException as exc:
            post_failure(self.op, exc)
            raise


def _run(op: str, t: torch.Tensor, group: ProcessGroup, issue: Callable[[bool], Any],
         async_op: bool = False, finish: Optional[Callable[[], None]] = None) -> Any:
    """Issue a collective (``issue(async_op)``) and wait for it: on gloo through :func:`wait`, watching
    for a failed peer; elsewhere (NCCL) exactly as torch's synchronous call does. ``async_op``:
    return a handle to wait on instead (NCCL's work: its ``wait()`` orders the current stream).
    ``finish`` (gloo only): local work that completes the operation once the collective is done."""
    if not _sliced_wait(t, group):
        return issue(async_op)  # NCCL: the current stream waits, the CPU does not block
    try:  # (not `with reporting(op)`: a plain try costs nothing on the hot path)
        work = issue(True)
        if async_op:
            return Pending(work, op, group, finish)
        wait(work, op, group)
        if finish is not None:
            finish()
    except BaseException as exc:
        post_failure(op, exc)
        raise
    return None


def rendezvous(fingerprint: int, what: str, group: ProcessGroup,
               describe: Optional[Callable[[], Any]] = None) -> None:
    """Check that every rank of ``group`` is about to run the same compiled graph the same way.

    One all-reduce of two int64s (max of ``fp`` and of ``-fp``) before a graph's first collective:
    ranks that disagree all raise, naming the graph (and, with ``describe``, the first difference
    between what each rank would run: every rank sees the mismatch, so all join that exchange); a
    rank whose peers never arrive raises after ``collective_timeout_s()``, or at once with a
    :class:`RankFailedError` when a peer posted its failure. Without it, one rank evaluating alone
    blocks forever in its first all-gather, or exchanges shards with a peer that is in another graph.
    """
    if world_size(group) == 1:
        return
    t = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=group_device(group))
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    op = f"the rendezvous before {what}"
    if _sliced_wait(t, group):
        wait(work, op, group, what=what)
    else:
        _wait_polling_completion(work, op, group, what)
    if int(t[0]) != fingerprint or -int(t[1]) != fingerprint:
        detail = ""
        if describe is not None:
            detail = " " + _first_difference(describe(), group)
        raise GraphMismatchError(
            f"zinf: the ranks of the dp group are running different compiled graphs (rank {rank(group)}: "
            f"{what}).{detail} With dp > 1 every rank must call the compiled model the same way, in the same "
            "order and grad mode, with the same model: evaluate on every rank, or evaluate an eager copy built "
            "from zinf_compile.full_state_dict(model) on one rank.")


def _first_difference(mine: Any, group: ProcessGroup) -> str:
    """Every rank's ``mine`` (a list), gathered; the first entry where some rank differs from rank 0."""
    every: list = [None] * world_size(group)
    dist.all_gather_object(every, mine, group=group)
    ref = every[0]
    for r, other in enumerate(every[1:], start=1):
        if other == ref:
            continue
        for i in range(max(len(ref), len(other))):
            a = ref[i] if i < len(ref) else "<nothing>"
            b = other[i] if i < len(other) else "<nothing>"
            if a != b:
                return f"First difference, at entry {i}: rank 0 has {a}, rank {r} has {b}."
    return "(their descriptions agree; the grad mode or graph name differs)"
