"""The parameter store: each parameter's 1/dp fp32 shard, its gradient shard and its compute copies.

A partitioned ``nn.Parameter`` keeps its full shape, dtype and ``requires_grad`` (so Dynamo's fakes and
guards see nothing new) but its storage is resized to 0 bytes: the data lives here, as the flat
parameter padded to ``dp * shard_numel`` elements, of which this rank owns one slice::

    before: p.untyped_storage() -> numel * 4 bytes on the device
    after:  p.untyped_storage() -> 0 bytes;  store[p._zinf_uid].master -> shard_numel fp32 on a tier

Graphs reach the store only through ``torch.ops.zinf.*`` ops carrying the integer ``uid``
(``zinf_runtime.ops``); the optimizer reaches it through the parameter's ``_zinf_uid`` attribute.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from . import accounting, broadcast, comm, hostsync, read_cache, tiers, triton_copy
from .context import DEFAULT, RuntimeContext, resolve_context
from .eager_access import DATA_FREE, NOT_SERVED, PartitionedDataError, eager_call  # noqa: F401 (re-exported)
from .grads import ShardedGrad
from .packed_state import PackedState
from .swap import SwapConfig, SwapHandle

UID_ATTR = "_zinf_uid"
_uids = itertools.count(1)
epoch = 0  # bumped whenever new parameters are partitioned (optimizers re-check theirs then)
_handles: Dict[int, "ParamHandle"] = {}
_lock = threading.Lock()


#: the default ``nvme_min_bytes`` of 1-D parameters (norms, biases): see ``Placement.for_param``
DEFAULT_NVME_MIN_BYTES_1D = 64 << 10


@dataclass(frozen=True)
class Placement:
    """Where a parameter's shards live and how they are reduced; fixed at partition time.

    ``tier`` holds the parameter copy that forward/backward fetch; ``optim_tier`` holds the fp32
    master, the gradient shard and the optimizer state (they are one tensor when both tiers are the
    same memory tier and the parameter is fp32). ``swap`` configures the NVMe tier. ``context`` is
    the model's ``RuntimeContext`` (budget, accounting, swap engines, buffers): not part of equality,
    ``partition`` fills it in (see ``zinf_runtime.context``).
    """

    tier: str  # "device", "cpu" or "nvme": the parameter copy
    compute_device: torch.device
    group: Optional[object] = None  # torch.distributed ProcessGroup or None (default group / dp=1)
    optim_tier: Optional[str] = None  # None: same as ``tier`` ("device"/"cpu"/"nvme")
    swap: Optional[SwapConfig] = None
    sub_group_bytes: int = 256 << 20  # NVMe optimizer: bytes of states stepped at a time
    partition: str = "bandwidth"  # "bandwidth": 1/dp per rank; "broadcast": one owner (runtime/broadcast.py)
    # a parameter whose fp32 shard is smaller stays in CPU memory (``for_param``); None: 1-D
    # parameters (norms, biases) under DEFAULT_NVME_MIN_BYTES_1D, every matrix on NVMe
    nvme_min_bytes: Optional[int] = None
    read_cache_bytes: int = read_cache.DEFAULT_CAP_BYTES  # NVMe parameter reads kept for re-reads (read_cache.py)
    param_write_back: bool = True  # stepped NVMe parameters kept in memory until evicted (ctx.kept, cap read_cache_bytes)
    context: Optional[RuntimeContext] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for t in (self.tier, self.optim_tier):
            if t not in (None, "device", "cpu", "nvme"):
                raise ValueError(f"zinf: unknown tier {t!r}; choose 'device', 'cpu' or 'nvme'")
        if self.partition not in broadcast.SCHEMES:
            raise ValueError(f"zinf: unknown partition {self.partition!r}; choose one of {list(broadcast.SCHEMES)}")
        if "nvme" in (self.tier, self.optim_tier) and self.swap is None:
            raise ValueError("zinf: the nvme tier needs a swap configuration (option nvme_path)")

    @property
    def master_tier(self) -> str:
        return self.optim_tier or self.tier

    def for_param(self, numel: int, ndim: int) -> "Placement":
        """The placement of a parameter of ``numel`` elements and ``ndim`` dimensions: this one, except
        that an NVMe tier becomes CPU memory when the parameter's fp32 shard (1/dp of it, as under
        the bandwidth scheme, so every rank decides alike) is under the threshold:
        ``nvme_min_bytes`` for every parameter when set; by default (None)
        ``DEFAULT_NVME_MIN_BYTES_1D`` for 1-D parameters only.

        Why: each NVMe state of a parameter is its own file and request per step (moments read and
        written, master and gradient when not kept in memory), whose fixed cost (open, queue
        hand-off, thread wake-ups, checksum call) does not shrink with its size. Norms and biases
        are most of a transformer's parameters and a fraction of a percent of its bytes (on the 25M
        GPT at dp 2: 98 of 148 parameters, 0.2% of the bytes); kept in host memory they cost 16
        bytes of RAM per element and skip those requests, as DeepSpeed's persistence threshold
        (1e5 elements) keeps small parameters out of its offload. Measured on the 25M GPT's all-NVMe
        step at dp 2: 0.982 -> 0.915 s, medians of 7 alternating fresh runs (README, Options).
        Only 1-D parameters by default: a matrix under 64 KiB exists only in a toy model, whose
        states should still exercise the disk; ``nvme_min_shard_bytes`` sets a threshold for every
        parameter (0: all on NVMe).
        """
        if "nvme" not in (self.tier, self.master_tier):
            return self
        threshold = self.nvme_min_bytes
        if threshold is None:
            threshold = DEFAULT_NVME_MIN_BYTES_1D if ndim <= 1 else 0
        if not threshold:
            return self
        world = comm.world_size(self.group)
        if 4 * -(-numel // world) >= threshold:
            return self
        return replace(self, tier="cpu" if self.tier == "nvme" else self.tier,
                       optim_tier="cpu" if self.master_tier == "nvme" else self.optim_tier)

    def device_of(self, tier: str) -> torch.device:
        return self.compute_device if tier == "device" else torch.device("cpu")

    def storage_device(self) -> torch.device:
        return self.device_of(self.master_tier)


def master_home(tier: str, master_tier: str, dtype: torch.dtype) -> Tuple[str, bool]:
    """``(tier of the fp32 master slot, whether it is also the parameter copy)`` of a parameter of
    ``dtype`` whose copy lives on ``tier`` and whose optimizer state lives on ``master_tier``.

    One slot serves as both when they would hold the same bits in the same place: the same memory
    tier and an fp32 parameter, or both on NVMe (one file, cast on fetch). Parameters in CPU memory
    with the optimizer on NVMe (``offload_params="cpu", offload_optimizer="nvme"``) keep an fp32
    master in the CPU copy too: the copy is in host memory anyway and equals the master bit for bit,
    so a separate master file would add a write and a read of every master byte per step (a third
    of the optimizer's NVMe traffic) and the disk space for nothing. Gradients and moments stay on
    NVMe.
    """
    if tier == master_tier and (tier == "nvme" or dtype == torch.float32):
        return master_tier, True
    if tier == "cpu" and master_tier == "nvme" and dtype == torch.float32:
        return "cpu", True
    return master_tier, False


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ParamHandle:
    """One partitioned parameter: fp32 master shard, gradient shard, parameter copy, each in a slot."""

    def __init__(self, name: str, shape: Sequence[int], dtype: torch.dtype, requires_grad: bool,
                 placement: Placement, flat: torch.Tensor, param: Optional[torch.nn.Parameter] = None):
        self.uid = next(_uids)
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.numel = flat.numel()
        self.placement = placement
        self.context: RuntimeContext = placement.context or DEFAULT
        self.world = comm.world_size(placement.group)
        self.rank = comm.rank(placement.group)
        # partition="broadcast" (dp > 1): one owner holds the whole parameter, the others nothing
        self.owner: Optional[int] = None
        if placement.partition == "broadcast" and self.world > 1:
            self.owner = broadcast.assign_owner(self.context, 4 * self.numel, self.world)
        if self.owner is None:
            self.shard_numel = -(-self.numel // self.world)
            self.padded_numel = self.shard_numel * self.world
        else:
            self.shard_numel = self.numel if self.rank == self.owner else 0
            self.padded_numel = self.numel
        self.requires_grad = requires_grad
        self._param_ref = weakref.ref(param) if param is not None else (lambda: None)
        self._compute: Dict[torch.dtype, torch.Tensor] = {}
        self._lock = threading.Lock()
        # set when the parameter is re-partitioned as tiles, each its own unit (memory-centric tiling)
        self.tiles: Optional[List["ParamHandle"]] = None
        self.tile_dim = 0
        self.tile_bounds: Tuple[Tuple[int, int], ...] = ()
        self.parent: Optional["ParamHandle"] = None  # set on a tile: the handle it was split from
        self.tile_index = 0
        self._tile_inputs: Optional[List[torch.nn.Parameter]] = None
        self._grad_view: Optional[ShardedGrad] = None  # param.grad while it holds this handle's gradient
        # bumped on every change of the gradient shard / of the master or optimizer state: work started
        # on a copy (``zinf_runtime.optim_overlap``) is valid only while the versions it saw still hold
        self.grad_version = 0
        self.state_version = 0
        self.grad_listener: Optional[Callable[["ParamHandle", Optional[torch.Tensor]], None]] = None
        pl = placement
        home, shared = master_home(pl.tier, pl.master_tier, dtype)
        self.master: Optional[tiers.Slot] = self._slot(home, "param", torch.float32, "master")
        # the copy forward/backward fetch; None: the master serves (see ``master_home``)
        self.param_copy: Optional[tiers.Slot] = None if shared else self._slot(pl.tier, "param", dtype, "param")
        if (self.param_copy or self.master).tier == "nvme":
            self.context.read_cache.cap_bytes = pl.read_cache_bytes
        if "nvme" in (self.master.tier, (self.param_copy or self.master).tier):
            self.context.kept.cap_bytes = pl.read_cache_bytes  # stepped parameters kept unwritten (write-back)
        self.grad_slot: tiers.Slot = self._slot(pl.master_tier, "grad", torch.float32, "grad")
        if self.grad_slot.tier == "nvme":  # NVMe gradients kept in memory: up to what the optimizer streams
            self.context.dirty.cap_bytes = pl.sub_group_bytes
        # optimizer moments of an NVMe optimizer tier live here, packed in one file (memory tiers use
        # optimizer.state); scalar entries (Adam's ``step``) stay in memory
        self.optim_state = PackedState(self)
        self.optim_small: Dict[str, torch.Tensor] = {}
        lo = self.shard_lo
        own = flat[lo : min(lo + self.shard_numel, self.numel)]
        shard = torch.zeros(self.shard_numel, dtype=torch.float32)
        shard[: own.numel()].copy_(own)
        self.master.set(shard, donate=True)  # a private temporary: NVMe writes need no second copy
        self._refresh_param_copy(shard)

    @property
    def shard_lo(self) -> int:
        """Flat index of this rank's first element (bandwidth: rank * shard_numel; broadcast: 0)."""
        return self.rank * self.shard_numel if self.owner is None else 0

    def _slot(self, tier: str, kind: str, dtype: torch.dtype, what: str) -> tiers.Slot:
        pl = self.placement
        if self.shard_numel == 0 and tier == "nvme":
            tier = "cpu"  # a non-owner's empty shard (partition="broadcast"): no file, no IO
        swap = self.context.engine(pl.swap, self.rank) if tier == "nvme" else None
        pin = tier != "device" and pl.compute_device.type == "cuda"
        return tiers.Slot(tier, kind, self.shard_numel, dtype, pl.device_of(tier), swap, f"u{self.uid}.{what}", pin,
                          self.context)

    @property
    def grad(self) -> Optional[torch.Tensor]:
        """The fp32 gradient shard (read from disk on the NVMe tier), or None."""
        return self.grad_slot.get() if self.grad_slot.present else None

    def units(self) -> List["ParamHandle"]:
        """What the optimizer steps: the tiles of a tiled parameter, else the parameter itself."""
        return list(self.tiles) if self.tiles is not None else [self]

    def split_into_tiles(self, bounds: Sequence[Tuple[int, int]], dim: int) -> List["ParamHandle"]:
        """Re-partition as one unit per ``[lo, hi)`` slice along ``dim`` (collective when dp > 1).

        Afterwards fetching tile i moves only tile i's bytes, and each tile has its own gradient
        shard. Tiling again with the same bounds is a no-op; with other bounds it is an error.
        """
        bounds = tuple((int(lo), int(hi)) for lo, hi in bounds)
        if self.tiles is not None:
            if (bounds, dim) != (self.tile_bounds, self.tile_dim):
                raise ValueError(f"zinf: {self.name} is already tiled as {self.tile_bounds} along dim "
                                 f"{self.tile_dim}; cannot re-tile as {bounds} along {dim}")
            return self.tiles
        if self.grad_slot.present:
            raise RuntimeError(f"zinf: cannot tile {self.name} while it holds an accumulated gradient")
        if self.optim_state.present or self.optim_small:  # re-tiling would drop the NVMe moments silently
            raise RuntimeError(f"zinf: cannot tile {self.name}: it already holds optimizer state (stepped, or "
                               "loaded from a checkpoint before its first call); load after the first call")
        full = self._full_flat().view(self.shape)
        tiles = []
        for i, (lo, hi) in enumerate(bounds):
            part = full.narrow(dim, lo, hi - lo).contiguous()
            t = ParamHandle(f"{self.name}[tile {i}/{len(bounds)}]", part.shape, self.dtype, self.requires_grad,
                            self.placement, part.reshape(-1))
            t.parent, t.tile_index = self, i
            _handles[t.uid] = t
            tiles.append(t)
        self._drop_data()
        self.tiles, self.tile_dim, self.tile_bounds = tiles, dim, bounds
        return tiles

    def tile_inputs(self) -> List[torch.nn.Parameter]:
        """0-byte stand-ins of the tiles' shapes: the graph inputs through which tiles are fetched."""
        if self.tiles is None:
            raise RuntimeError(f"zinf: {self.name} is not tiled")
        if self._tile_inputs is None:
            device = self.placement.compute_device
            stand_ins = []
            for t in self.tiles:
                x = PartitionedParameter(torch.empty(t.shape, dtype=t.dtype, device=device),
                                         requires_grad=t.requires_grad)
                x.untyped_storage().resize_(0)
                setattr(x, UID_ATTR, t.uid)
                stand_ins.append(x)
            self._tile_inputs = stand_ins
        return self._tile_inputs

    # -- parameter data ------------------------------------------------------------------------
    def param(self) -> Optional[torch.nn.Parameter]:
        return self._param_ref()

    def _whole(self) -> tiers.Slot:
        if self.master is None:
            raise RuntimeError(f"zinf: {self.name} is tiled; fetch its tiles, not the whole parameter")
        return self.master

    def shard_in(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard in ``dtype`` on the parameter tier (NVMe: read into CPU memory);
        compute-dtype copies of memory tiers are cached until the next optimizer step."""
        slot = self.param_copy or self._whole()
        if slot.tier == "nvme":
            return slot.get().to(dtype)
        src = slot.resident_for_device()  # read-only here, and no device work writes a parameter slot
        if dtype == src.dtype:
            return src
        with self._lock:
            cached = self._compute.get(dtype)
            if cached is None:
                cached = src.to(dtype)
                self._compute[dtype] = cached
                self.context.accounting.add(slot.tier, "param", _nbytes(cached))
            return cached

    def master_updated(self, value: Optional[torch.Tensor] = None) -> None:
        """After the optimizer changed the master (``value``, if the caller has it in memory): drop
        compute copies, refresh the parameter copy (an NVMe one kept in memory until evicted, as the
        optimizer's master is: ``Placement.param_write_back``)."""
        for t in self.tiles or ():
            t.master_updated()
        self.state_version += 1
        self._drop_compute()
        if self.param_copy is not None and self.master is not None:
            self._refresh_param_copy(value if value is not None else self.master.get(),
                                     defer=self.placement.param_write_back)

    def _refresh_param_copy(self, master: torch.Tensor, defer: bool = False) -> None:
        if self.param_copy is not None:
            copy = master.to(self.param_copy.dtype)
            owned = copy.data_ptr() != master.data_ptr()
            self.param_copy.set(copy, donate=owned, defer=defer and self.param_copy.tier == "nvme")

    def _drop_compute(self) -> None:
        tier = (self.param_copy or self.master).tier if (self.param_copy or self.master) else "device"
        with self._lock:
            for t in self._compute.values():
                self.context.accounting.sub(tier, "param", _nbytes(t))
            self._compute.clear()

    def fetch_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard on the compute device: the slot itself where fetching would only copy
        memory to the same memory (``shard_in_place``), else a private copy via ``load_host`` then
        ``upload``, waiting for each (the serial path; graphs split it into start/wait ops,
        ``zinf_runtime.transfer``)."""
        alias = self.shard_in_place(dtype)
        if alias is not None:
            return alias
        host, read = self.load_host()
        if read is not None:
            read.wait()
        return self.upload(dtype, host)

    def shard_in_place(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The shard's own memory, to be read in place, when a fetch would only copy it within the
        compute device's memory: at dp = 1, a memory-tier slot on the compute device already in
        ``dtype`` (or its cached compute-dtype copy). None where a fetch moves bytes (NVMe, another
        device). At dp > 1 the shard feeds an all-gather, and strict comm never lets a collective read
        a slot: a bucketed gather copies its members into the bucket anyway (``zinf.gather_bucket``'s
        ``cat``), and a parameter gathered alone is copied right before its collective
        (``collective_input``). Either way the upload's own copy, a lane-thread hand-off per
        parameter, is saved: on the CPU with CPU offload at dp 2 that was every parameter copied
        twice a step.

        Why: at dp = 1 without offload (and with CPU offload on a CPU-only machine) the "upload" was
        a full memcpy of every parameter, in forward and again in backward, plus an allocation and
        its first-touch page faults, for nothing. Why it is safe to read the slot itself: nothing
        writes a parameter slot while a graph runs. The optimizer steps after backward (its
        overlapped step writes new tensors or shadow slots, never the committed master:
        ``zinf_runtime.optim_overlap``), a graph writing a parameter falls back to eager, and
        ``release`` of an in-place shard frees nothing. Inductor never reuses a fallback kernel's
        output buffer for another tensor (its multi-output buffers alias their kernel), and
        ``release`` keeps the shard live past its last reader, so no kernel writes into it in place.
        On CUDA the shard is read on the current stream, in order with the optimizer's step there.
        """
        if not self.reads_in_place():
            return None
        src = (self.param_copy or self._whole()).resident_for_device()
        if src.dtype != dtype:
            src = self.shard_in(dtype)
        _in_place[src.untyped_storage().data_ptr()] = weakref.ref(src)
        self.context.transfers.counters["in_place"] = self.context.transfers.counters.get("in_place", 0) + 1
        return src

    def reads_in_place(self) -> bool:
        """Whether a fetch reads the slot where it is (``shard_in_place``); the memory plan asks too.
        Not under a ``device_memory_budget`` (below), nor with ``partition="broadcast"`` at dp > 1
        (the owner's shard is the whole parameter, copied into the broadcast buffer)."""
        if (self.master is None and self.param_copy is None) or self.owner is not None:
            return False
        if self.context.accounting.budget is not None:
            # under a device_memory_budget the user asked for fetched working memory bounded and
            # accounted: each fetch stays a buffer of its own, counted against the budget and freed
            # by its release
            return False
        slot = self.param_copy or self.master
        if slot.tier == "nvme" or slot.numel != self.shard_numel:
            return False
        if slot.tier == "cpu" and os.environ.get("ZINF_FUSED_COPY") == "1":
            return False  # the tests' stand-in for pinned host -> device: copied through the Triton kernels
        src = slot.resident_for_device()
        return src is not None and _same_device(src.device, self.placement.compute_device)

    def load_host(self) -> Tuple[Optional[torch.Tensor], Optional[SwapHandle]]:
        """NVMe tier: start reading this rank's shard into a pooled host buffer; returns the buffer
        and the read's handle (wait before ``upload``; None when the read cache held the shard and
        nothing is read). Memory tiers: ``(None, None)``. The buffer goes back through ``upload`` or
        ``keep_read``."""
        slot = self.param_copy or self._whole()
        if slot.tier != "nvme":
            return None, None
        return slot.read_owned(keep=True)

    def keep_read(self, host: torch.Tensor, fence: Optional[hostsync.Fence] = None) -> None:
        """Done with a host buffer ``load_host`` filled (``fence``: device work still reading it): kept
        as the slot's clean copy for its next reader, backward's fetch or the optimizer's master read
        (``zinf_runtime.read_cache``), else back to the pool."""
        (self.param_copy or self._whole()).keep_read(host, fence)

    def new_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty shard-sized buffer on the compute device, accounted as gathered at dp = 1 (where
        the shard is the whole parameter, and what ``release`` frees)."""
        out = torch.empty(self.shard_numel, dtype=dtype, device=self.placement.compute_device)
        if self.world == 1:
            _track_gathered(out, self.name, self.context.accounting)
        return out

    def upload(self, dtype: torch.dtype, host: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None,
               give_back: Optional[Callable[[torch.Tensor, hostsync.Fence], None]] = None) -> torch.Tensor:
        """Copy this rank's shard to the compute device, casting to ``dtype``: from ``host`` (a
        pooled buffer ``load_host`` filled; handed back here, to the read cache or the pool, by
        ``keep_read``) or the memory-tier slot.

        From host memory on CUDA, one fused Triton kernel reads the pinned shard and casts it while
        copying (``triton_copy.gather_cast``), instead of a host-side cast plus a copy.

        Ordering (CUDA; see ``zinf_runtime.hostsync``): the kernel, or the ``non_blocking`` upload
        from pinned memory, is still reading the host shard when this returns, on the current
        stream. The slot's fence records it, so the optimizer's in-place step on the master, a
        refresh of the parameter copy, or freeing the slot waits for the read first. A pooled NVMe
        read buffer goes back with that fence (``keep_read``): the read cache keeps it and a taker
        waits for it, or the pool waits for it first, so no next read overwrites it under the copy. ``out`` is only used on the current stream, after the copy, by stream order.
        ``give_back(host, fence)``, if given, takes over returning the pooled buffer (a caller that
        must not block on the copy here, e.g. a side-stream upload, returns it at its wait).
        """
        slot = self.param_copy or self._whole()
        if out is None:
            out = self.new_shard(dtype)
        pooled = host is not None
        pool = self.context.pool
        if pooled:
            fence = hostsync.Fence()
        else:
            host = slot.resident_for_device()
            fence = slot.fence
        try:
            if fused_copy_enabled(host, out):
                triton_copy.gather_cast([host], out)
                fence.record(out.device, host)
                fused_copies["gather_cast"] += 1
                return out
            src = host.to(dtype) if pooled else self.shard_in(dtype)
            non_blocking = src.is_pinned() and out.is_cuda
            out.copy_(src, non_blocking=non_blocking)
            if non_blocking:  # src is the slot's pinned memory, or the pooled buffer itself
                fence.record(out.device, src)
            return out
        finally:
            if pooled:
                (give_back or self.keep_read)(host, fence)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The full parameter from every rank's shard; accounted as gathered bytes until released."""
        if self.world == 1:
            return shard.view(self.shape)  # for eager callers; graphs use a view node instead
        buf, work = self.start_all_gather(self.collective_input(shard), async_op=False)
        return self.gathered_view(buf)

    def collective_input(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` as a collective may read it: a private copy when it is a slot's memory read in
        place (``shard_in_place``), so no collective ever reads a slot (strict comm); else itself. An
        exchange (``comm.exchanges``) copies its shard into a buffer of its own (its output's row at
        2 ranks, its send buffer from 3) as it starts: itself."""
        if _is_in_place(shard.untyped_storage()) and not comm.exchanges(shard, self.placement.group):
            return shard.clone()
        return shard

    def start_all_gather(self, shard: torch.Tensor, async_op: bool = True) -> Tuple[torch.Tensor, Any]:
        """Start gathering every rank's shard into a new (padded) buffer; returns it and the
        collective's work handle (wait on it before reading the buffer, and keep ``shard`` alive
        until then: the collective reads it)."""
        buf = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        _track_gathered(buf, self.name, self.context.accounting)
        if self.owner is not None:  # partition="broadcast": the owner's whole shard to every rank
            if self.rank == self.owner:
                buf.copy_(shard)
            return buf, comm.broadcast_flat(buf, self.owner, self.placement.group, async_op=async_op)
        extra = comm.exchange_numel("all_gather", shard.numel(), self.world)
        if comm.exchanges(shard, self.placement.group) and extra:
            send, give_back = self._exchange_buffer(extra, shard)
            work = comm.all_gather_flat(buf, shard, self.placement.group, async_op=async_op, send=send,
                                        then=give_back)
        else:
            work = comm.all_gather_flat(buf, shard, self.placement.group, async_op=async_op)
        return buf, work

    def _exchange_buffer(self, numel: int, like: torch.Tensor) -> Tuple[torch.Tensor, Callable[[], None]]:
        """An exchange's send or receive buffer (``comm.exchanges``) of ``numel`` elements of ``like``'s
        dtype from the model's pool, as a bucket's (``tiers.flat_buffer``), and the call that gives it
        back once the collective is done."""
        raw = tiers.flat_buffer(self.context.pool, numel, like.dtype, like.device)
        return raw[:numel], lambda: self.context.pool.release(raw)

    def gathered_view(self, buf: torch.Tensor) -> torch.Tensor:
        """The parameter's shape over a gathered buffer (its padding cut off, when it has any: one
        aten call fewer per gather otherwise, which costs ~10 us inside a step)."""
        return (buf if self.padded_numel == self.numel else buf[: self.numel]).view(self.shape)

    @staticmethod
    def release(full: torch.Tensor) -> None:
        """Free a gathered parameter's storage now, whoever still holds a reference (a shard read
        in place, ``shard_in_place``, is the slot's memory: nothing to free)."""
        storage = full.untyped_storage()
        if _is_in_place(storage):
            return
        token = _live_gathered.pop(storage.data_ptr(), None)
        drop_storage(full)
        if token is not None and token[0]:
            token[1].released(token[0])
            token[0] = 0

    def full_data(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full parameter (collective when dp > 1), as a fresh tensor on the compute device."""
        if self.tiles is not None:
            return torch.cat([t.full_data(dtype) for t in self.tiles], dim=self.tile_dim)
        gathered = self.all_gather(self.fetch_shard(dtype))
        full = gathered.clone()
        self.release(gathered)
        return full

    def _full_flat(self) -> torch.Tensor:
        """Every rank's fp32 master shards joined, on the master's tier device: a one-time re-layout
        (for tiling), outside the budget. The all-gather runs on a copy staged on the process
        group's device (NCCL refuses the CPU master; a slot's memory is never a collective's buffer)."""
        master = self._whole().get()
        if self.world == 1:
            return master[: self.numel].clone()
        if self.owner is not None:
            return self._from_owner(master)
        return comm.all_gather_to(master, self.placement.group)[: self.numel]

    def _from_owner(self, local: torch.Tensor) -> torch.Tensor:
        """partition="broadcast": the owner's whole ``local`` (master or gradient) on every rank, as a
        fresh tensor on ``local``'s device (staged through the group's device by ``comm.broadcast``)."""
        out = (local.clone() if self.rank == self.owner else
               torch.empty(self.numel, dtype=local.dtype, device=local.device))
        comm.broadcast(out, self.placement.group, src=self.owner)
        return out

    def load_full(self, full: torch.Tensor) -> None:
        """Overwrite this rank's master shard from a full tensor (same values on every rank)."""
        if self.tiles is not None:
            for t, (lo, hi) in zip(self.tiles, self.tile_bounds):
                t.load_full(full.detach().narrow(self.tile_dim, lo, hi - lo))
            return
        flat = full.detach().reshape(-1)
        lo = self.shard_lo
        own = flat[lo : min(lo + self.shard_numel, self.numel)]
        shard = torch.zeros(self.shard_numel, dtype=torch.float32)
        shard[: own.numel()].copy_(own)
        self._whole().set(shard)
        self.master_updated()

    # -- gradients -----------------------------------------------------------------------------
    # ``param.grad`` is the source of truth, as for any tensor: the shards accumulate while it holds
    # this handle's ``ShardedGrad``; once the user sets it to None (``zero_grad``), the next reduction
    # starts from zero. The gradient slots are only the storage behind that view.
    def _owner(self) -> "ParamHandle":
        return self.parent or self

    def grad_live(self) -> bool:
        """Whether the parameter's ``.grad`` is this handle's sharded gradient (else: no gradient)."""
        owner = self._owner()
        p = owner.param()
        view = owner._grad_view
        return view is not None and p is not None and p.grad is view

    def _begin_grad(self) -> None:
        """Before accumulating: start from zero unless ``param.grad`` still holds our sharded view."""
        owner = self._owner()
        p = owner.param()
        if p is None or self.grad_live():
            return
        current = p.grad
        for u in owner.units():
            if u.grad_slot.present:
                u._grad_changed(None)
            u.grad_slot.drop(keep_file=True)  # the next backward rewrites it: its file is overwritten
        owner._grad_view = ShardedGrad(p, owner)
        if current is not None:  # a full tensor the user assigned: it is the starting value
            owner._load_full_grad(current.detach())
        p.grad = owner._grad_view

    def _load_full_grad(self, full: torch.Tensor) -> None:
        if self.tiles is not None:
            for t, (lo, hi) in zip(self.tiles, self.tile_bounds):
                t._load_full_grad(full.narrow(self.tile_dim, lo, hi - lo))
            return
        flat = full.reshape(-1).to(torch.float32)
        lo = self.shard_lo
        shard = torch.zeros(self.shard_numel, dtype=torch.float32)
        own = flat[lo : min(lo + self.shard_numel, self.numel)]
        shard[: own.numel()].copy_(own)
        self.grad_slot.set(shard)
        self._grad_changed(None)

    def reduce_grad(self, grad: torch.Tensor, donated: bool = False) -> None:
        """Reduce-scatter (mean over dp) ``grad``; accumulate the fp32 shard on the optimizer's tier.

        ``donated``: the caller hands ``grad`` over (nothing else reads or writes it afterwards; the
        ``donate_grads`` pass proves it for a compiled graph), so at dp = 1 its memory may become the
        gradient slot instead of being copied there."""
        self._begin_grad()
        acct, nbytes = self.context.accounting, _nbytes(grad)
        acct.gradient_buffer_start(nbytes, self.name)
        try:
            if self.tiles is not None:
                for t, (lo, hi) in zip(self.tiles, self.tile_bounds):
                    t._reduce(grad.narrow(self.tile_dim, lo, hi - lo))
            else:
                self._reduce(grad, donated)
        finally:
            acct.gradient_buffer_end(nbytes)

    def _reduce(self, grad: torch.Tensor, donated: bool = False) -> None:
        shard = self.finish_reduce(*self.start_reduce(grad, async_op=False))
        self.accumulate_grad(shard, owned=donated or not shares_storage(shard, grad))

    def start_reduce(self, grad: torch.Tensor, async_op: bool = True) -> Tuple[torch.Tensor, Any]:
        """Start the reduce-scatter of a full gradient: returns the fp32 shard buffer it fills and
        the work handle (dp = 1: the flat fp32 gradient itself and None). The collective reads the
        flat fp32 gradient (a private copy when padded or cast), which the caller keeps alive through
        the returned tuple until ``finish_reduce``, which frees a private copy."""
        flat = grad.detach().reshape(-1).to(torch.float32)
        if self.world == 1:
            return flat, None
        if self.owner is not None:  # partition="broadcast": reduce to the owner, which keeps it whole
            flat = flat.clone()  # dist.reduce writes its buffer (on every rank, with gloo)
            work = comm.reduce_flat(flat, self.owner, self.placement.group, async_op=async_op)
            shard = flat if self.rank == self.owner else flat[:0]
            return shard, (work, flat, False)  # the owner's shard is ``flat``
        if self.padded_numel != self.numel:
            flat = torch.nn.functional.pad(flat, (0, self.padded_numel - self.numel))
        flat = flat.contiguous()
        shard = self.new_grad_shard(flat.device)
        if comm.exchanges(flat, self.placement.group):
            recv, give_back = self._exchange_buffer(comm.exchange_numel("reduce_scatter", flat.numel(), self.world),
                                                    flat)
            work = comm.reduce_scatter_flat(shard, flat, self.placement.group, async_op=async_op, recv=recv,
                                            then=give_back)
        else:
            work = comm.reduce_scatter_flat(shard, flat, self.placement.group, async_op=async_op)
        return shard, (work, flat, not shares_storage(flat, grad))

    def new_grad_shard(self, device: torch.device) -> torch.Tensor:
        """An empty fp32 gradient shard on ``device`` for a reduction to fill. On the host with an NVMe
        gradient tier it is a buffer of the context's pool: it starts on a page, so its write goes
        straight from it to the file with no bounce copy (``SwapEngine._zero_copy``), and it goes back
        to the pool when the slot drops or writes it (``accumulate_grad``). A fresh allocation per
        step instead cost every gradient byte a page fault and a page clear (the 25M GPT at dp 2:
        124 new buffers, 50 MB a step; ``perf`` put ``clear_page_erms`` at 4% of a rank's samples,
        under load, and at none after; the step time did not move measurably).
        Elsewhere a plain tensor, which an empty memory-tier slot can adopt whole (``Slot.adopt``)."""
        if self.grad_slot.tier == "nvme" and torch.device(device).type == "cpu":
            return self.context.pool.acquire(self.shard_numel, torch.float32)
        return torch.empty(self.shard_numel, dtype=torch.float32, device=device)

    def finish_reduce(self, shard: torch.Tensor, pending: Any) -> torch.Tensor:
        """Wait for ``start_reduce``'s collective; the mean over dp of this rank's gradient shard.

        A padded or cast input copy is freed here, on the waiting thread: the ``Work`` still
        references it, and gloo's worker thread drops that reference only after signalling
        completion (see ``zinf_runtime.bucket``), so the copy must not wait for its refcount."""
        if pending is None:
            return shard
        work, flat, private = pending
        if work is not None:
            work.wait()
        if private:
            drop_storage(flat)
        return shard.div_(self.world)

    def accumulate_grad(self, shard: torch.Tensor, owned: bool = False) -> None:
        """Add a reduced fp32 gradient shard into the gradient slot (device -> optimizer tier).

        ``owned``: nothing else reads or writes ``shard`` afterwards (a reduce-scatter's output, a
        cast, a donated gradient), so an empty memory-tier slot takes its memory (``Slot.adopt``)
        and an NVMe write reads it directly, without a copy."""
        slot = self.grad_slot
        if slot.present and slot.tier == "cpu" and fused_copy_enabled(slot.resident_for_device(), shard):
            # device -> pinned host, accumulating; still running on return: the fence makes every
            # host read of the gradient (optimizer, clipping, zero_grad) wait for it
            triton_copy.scatter_accumulate(shard, [slot.resident_for_device()])
            slot.fence.record(shard.device)
            fused_copies["scatter_accumulate"] += 1
            self._grad_changed(None)
        elif not slot.present:
            if owned and slot.adopt(shard):
                counters = self.context.transfers.counters
                counters["grad_adopted"] = counters.get("grad_adopted", 0) + 1
            else:  # on NVMe kept in memory until evicted: the step usually reads it, zero_grad drops it;
                # an owned shard (new_grad_shard's pool buffer) goes back to the pool then
                slot.set(shard, donate=owned, recycle=owned, defer=True)
            if slot.tier == "nvme":  # the slot's own deferred value, if kept, which a listener may borrow
                self._grad_changed(slot.dirty if slot.dirty is not None else shard)
            else:
                self._grad_changed(slot.resident())
        elif slot.tier != "nvme":
            slot.resident().add_(shard.to(slot.device))
            self._grad_changed(slot.resident())
        else:  # read-modify-write: accumulation across micro-batches survives offload
            acc = _read_into(slot)
            acc.add_(shard.to("cpu"))
            self._grad_changed(acc)  # before the set: were acc written back at once, a flush recycles it
            slot.set(acc, donate=True, recycle=True, defer=True)

    def _grad_changed(self, value: Optional[torch.Tensor]) -> None:
        """The gradient shard changed; ``value``: its new content in memory (the listener may copy it
        now, nothing after), or None (changed some other way: work started on an older value is void)."""
        self.grad_version += 1
        listener = self.grad_listener
        if listener is not None:
            listener(self, value)

    def grad_shard(self) -> Optional[torch.Tensor]:
        """What the optimizer steps with: the fp32 gradient shard (padded; zeros after ``zero_()``),
        or None when the parameter has no gradient (``param.grad is None``)."""
        if not self.grad_live():
            return None
        if not self.grad_slot.present:
            return torch.zeros(self.shard_numel, dtype=torch.float32, device=self.placement.storage_device())
        return self.grad_slot.get()

    def grad_values(self) -> torch.Tensor:
        """This rank's gradient values without the padding (zeros when none was reduced yet)."""
        lo = self.shard_lo
        valid = max(0, min(self.shard_numel, self.numel - lo))
        if not self.grad_slot.present:
            return torch.zeros(valid, dtype=torch.float32, device=self.placement.storage_device())
        return self.grad_slot.get()[:valid]

    def full_grad(self) -> torch.Tensor:
        """The full fp32 gradient (collective when dp > 1), on the optimizer tier's device."""
        if self.tiles is not None:
            return torch.cat([t.full_grad() for t in self.tiles], dim=self.tile_dim)
        shard = (self.grad_slot.get() if self.grad_slot.present else
                 torch.zeros(self.shard_numel, dtype=torch.float32, device=self.placement.storage_device()))
        if self.world == 1:
            return shard[: self.numel].clone().view(self.shape)
        if self.owner is not None:
            return self._from_owner(shard).view(self.shape)
        buf = comm.all_gather_to(shard, self.placement.group)  # staged on the group's device
        return buf[: self.numel].view(self.shape)

    def scale_grad(self, factor: float) -> None:
        """Multiply the gradient shard in place on its tier (clipping, unscaling)."""
        slot = self.grad_slot
        if not slot.present or factor == 1.0:
            return
        self._grad_changed(None)
        if slot.tier != "nvme":
            slot.resident().mul_(factor)
        else:
            acc = _read_into(slot)
            acc.mul_(factor)
            slot.set(acc, donate=True, recycle=True, defer=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.tiles or ():
            t.zero_grad(set_to_none)
        if not self.grad_slot.present:
            return
        self._grad_changed(None)
        if set_to_none or self.grad_slot.tier == "nvme":
            # an absent slot under a live view reads as zeros; the next backward overwrites the file kept
            self.grad_slot.drop(keep_file=True)
        else:
            self.grad_slot.resident().zero_()
        if set_to_none and self.parent is None:
            p = self.param()
            if p is not None and self.grad_live():
                p.grad = None

    def _drop_data(self) -> None:
        self._drop_compute()
        for slot in (self.master, self.param_copy, self.grad_slot):
            if slot is not None:
                slot.drop()
        self.master = self.param_copy = None
        self.optim_state.drop()

    def _free(self) -> None:
        self._drop_data()
        for t in self.tiles or ():
            _handles.pop(t.uid, None)
            t._free()


# -- fused Triton host<->device copies -------------------------------------------------------------
fused_copies: Dict[str, int] = {"gather_cast": 0, "scatter_accumulate": 0}


def _read_into(slot: tiers.Slot) -> torch.Tensor:
    """An NVMe slot's value in a pool buffer of the caller's (read, or copied from memory), waited for."""
    acc, handle = slot.read_owned()
    if handle is not None:
        handle.wait()
    return acc


def drop_storage(t: torch.Tensor) -> None:
    """Free ``t``'s memory now, whoever else still references it (a collective's ``Work``, a ticket):
    for buffers zinf made and no reader needs any more, so their bytes end where the schedule and the
    accounting say, not when the last reference happens to go."""
    storage = t.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` may share memory with ``b`` (same storage; empty tensors count as shared)."""
    pa = a.untyped_storage().data_ptr()
    return pa == 0 or pa == b.untyped_storage().data_ptr()


def fused_copy_enabled(host: torch.Tensor, device_t: torch.Tensor) -> bool:
    """Whether a copy between ``host`` and ``device_t`` goes through the fused Triton kernels.

    ``ZINF_FUSED_COPY``: ``auto`` (default) uses them for pinned host <-> CUDA copies when Triton is
    available; ``0`` never; ``1`` also between CPU tensors under ``TRITON_INTERPRET=1`` (tests).
    """
    mode = os.environ.get("ZINF_FUSED_COPY", "auto")
    if mode == "0" or not triton_copy.available():
        return False
    if device_t.is_cuda:
        return host.device.type == "cpu" and host.is_pinned() and host.is_contiguous()
    return mode == "1" and host.device.type == "cpu" and device_t.device.type == "cpu"


# gathered buffers not yet released, by storage address: a graph that raises half-way drops its
# buffers without reaching their release nodes, and the accounting must follow the memory
_live_gathered: Dict[int, list] = {}  # ptr -> [nbytes, Accounting]


# shards handed out to be read in place (``shard_in_place``), by storage address -> the slot tensor;
# an address counts only while that very tensor is alive with that storage (no stale match)
_in_place: Dict[int, "weakref.ref[torch.Tensor]"] = {}


def _is_in_place(storage: torch.UntypedStorage) -> bool:
    ptr = storage.data_ptr()
    ref = _in_place.get(ptr)
    t = ref() if ref is not None else None
    if t is None:
        if ref is not None:
            _in_place.pop(ptr, None)
        return False
    return t.untyped_storage().data_ptr() == ptr and storage.nbytes() > 0


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` (the current device) are the same memory."""
    if a.type != b.type:
        return False
    if a.index is None or b.index is None:
        cur = torch.cuda.current_device() if a.type == "cuda" else 0
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index


def _track_gathered(buf: torch.Tensor, name: str, acct: accounting.Accounting) -> None:
    """Account ``buf`` in its model's ``acct`` (budget-checked) until released or freed."""
    nbytes = _nbytes(buf)
    acct.materialize(nbytes, name)
    token = [nbytes, acct]
    _live_gathered[buf.untyped_storage().data_ptr()] = token
    weakref.finalize(buf, _dropped, buf.untyped_storage().data_ptr(), token)


def _dropped(ptr: int, token: list) -> None:
    if token[0]:
        token[1].released(token[0])
        token[0] = 0
        if _live_gathered.get(ptr) is token:
            del _live_gathered[ptr]


def resolve(param: torch.Tensor, uid: int) -> ParamHandle:
    """The handle a graph node compiled for ``uid`` must use for the tensor it was given now.

    A compiled graph is reused by Dynamo for every model instance of the same class, so the ``uid``
    baked into a node is a template: the parameter actually passed decides. A parameter the graph
    has not seen yet is partitioned here, like the template; a tile node given the whole weight
    tiles it like the template's parent.
    """
    own = getattr(param, UID_ATTR, None)
    if own == uid:
        return _handles[uid]
    template = get(uid)
    whole = template.parent or template  # what the passed tensor stands for when it is a whole weight
    if own is None:
        if not isinstance(param, torch.nn.Parameter):
            raise RuntimeError(f"zinf: graph input for {template.name} is not a parameter; cannot partition it")
        partition([(whole.name, param)], whole.placement)
        own = getattr(param, UID_ATTR)
    h = get(own)
    if template.parent is not None and h.parent is None:  # a tile node given the whole weight
        h = h.split_into_tiles(template.parent.tile_bounds, template.parent.tile_dim)[template.tile_index]
    if (h.shape, h.shard_numel, h.world) != (template.shape, template.shard_numel, template.world):
        raise RuntimeError(f"zinf: parameter {h.name} {h.shape} does not match the compiled graph's "
                           f"{template.name} {template.shape}; recompile (torch._dynamo.reset())")
    return h


def handle_of(param: torch.Tensor) -> Optional[ParamHandle]:
    uid = getattr(param, UID_ATTR, None)
    return None if uid is None else _handles.get(uid)


def get(uid: int) -> ParamHandle:
    try:
        return _handles[uid]
    except KeyError:
        raise RuntimeError(
            f"zinf: no partitioned parameter with uid {uid}; the parameter was garbage-collected or the "
            "graph was compiled in another process. Recompile the model (torch._dynamo.reset())."
        ) from None


def handles() -> List[ParamHandle]:
    return list(_handles.values())


def is_partitioned(param: torch.Tensor) -> bool:
    return handle_of(param) is not None


def _forget(uid: int) -> None:
    h = _handles.pop(uid, None)
    if h is not None:
        h._free()


class PartitionedParameter(torch.nn.Parameter):
    """The class a partitioned ``nn.Parameter`` takes: same tensor, safe to print, copy, pickle and use.

    Its storage is 0 bytes, so torch's own ``repr`` (and ``copy.deepcopy``, ``pickle``) would read
    freed memory. ``repr`` says where the data is; ``deepcopy`` and pickling materialize the full
    value as a plain ``nn.Parameter`` (collective when dp > 1), which is what a copy of a model means.
    Any other eager call goes to ``eager_access`` (``state_dict``, ``load_state_dict``, no-op moves
    served; the rest refused with ``PartitionedDataError``).
    """

    def _has_data(self) -> bool:
        with torch._C.DisableTorchFunctionSubclass():
            return self.untyped_storage().nbytes() >= (self.storage_offset() + self.numel()) * self.element_size()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        """Serve or refuse a torch call that would read or write a parameter whose data lives in the shards.

        The parameter keeps its shape over 0 bytes of storage, so an eager kernel reading it would read
        unmapped memory and kill the process. ``eager_access.eager_call`` serves the calls whose eager
        meaning it can keep (``state_dict``, ``load_state_dict``, no-op moves) and turns the rest into a
        ``PartitionedDataError`` naming the parameter and the way to reach its values. Metadata calls,
        zinf's own ops, calls traced by Dynamo and parameters whose storage holds data (inside
        ``gathered``) pass through untouched, exactly as ``nn.Parameter`` does.
        """
        if kwargs is None:
            kwargs = {}
        # cheapest tests first: a compiled graph's zinf ops come here once per parameter use (~2 us
        # each on top of nn.Parameter's own dispatch); Dynamo, tracing this, sees only the first
        if not (torch.compiler.is_compiling() or getattr(func, "namespace", None) == "zinf" or func in DATA_FREE):
            caller = sys._getframe(1).f_code if func is torch.Tensor.detach else None
            out = eager_call(PartitionedParameter, func, args, kwargs, caller)
            if out is not NOT_SERVED:
                return out
        return super().__torch_function__(func, types, args, kwargs)

    def __repr__(self) -> str:
        if self._has_data():
            return super().__repr__()
        h = handle_of(self)
        where = f"{h.name!r}, uid {h.uid}, 1/{h.world} per rank on {h.placement.tier}" if h else "no handle"
        return (f"PartitionedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, {where}; "
                "read it with zinf_compile.gathered(model) or full_state_dict(model))")

    __str__ = __repr__

    def _plain(self) -> torch.nn.Parameter:
        """The full value in the parameter's class before partitioning (``nn.Parameter``, or the user's
        own subclass), made as ``Parameter.__deepcopy__`` makes a copy: ``cls(data, requires_grad)``."""
        h = handle_of(self)
        data = self.detach().clone() if self._has_data() or h is None else h.full_data(self.dtype)
        cls = getattr(type(self), "_zinf_user_class", torch.nn.Parameter)
        return cls(data.to(self.device), self.requires_grad)

    def __deepcopy__(self, memo: dict) -> torch.nn.Parameter:
        if id(self) not in memo:
            memo[id(self)] = self._plain()
        return memo[id(self)]

    def __reduce_ex__(self, proto: int):  # type: ignore[override]
        return self._plain().__reduce_ex__(proto)


def _free_storage(params: Sequence[torch.nn.Parameter], retype: bool = True) -> None:
    """Resize each parameter's storage to 0 bytes, after every shard was copied out.

    A parameter that shares its storage with other tensors (a view into a flat buffer) first gets a
    private storage, so resizing cannot destroy data still owned by someone else.
    """
    for p in params:
        storage = p.untyped_storage()
        if p.storage_offset() != 0 or storage.nbytes() != p.numel() * p.element_size():
            p.data = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device=p.device)
        p.untyped_storage().resize_(0)
    if retype:
        retype_partitioned(params)


def retype_partitioned(params: Iterable[torch.Tensor]) -> None:
    """Give each partitioned plain ``nn.Parameter`` the class ``PartitionedParameter``.

    The backend partitions while Dynamo compiles, and calls this only once its compile succeeded:
    Dynamo may restart the analysis from inside the backend (``dynamic=True``), and a retrace that
    finds the parameters' class changed inlines ``PartitionedParameter.__torch_function__`` where the
    first trace did not, which Dynamo refuses (``SpeculationLogDivergence``).

    A user's own ``nn.Parameter`` subclass ``C`` becomes ``partitioned_class(C)``, a subclass of both,
    so ``isinstance(p, C)`` and ``C``'s methods still hold and eager reads are guarded too (before,
    such a parameter kept ``C`` and an eager read of its 0-byte storage killed the process). Should
    Python refuse the ``__class__`` change (none seen: a ``__slots__`` subclass is accepted, the new
    class inherits its slots), the parameter keeps ``C``, with a warning.
    """
    for p in params:
        cls = type(p)
        if handle_of(p) is None or issubclass(cls, PartitionedParameter) or not issubclass(cls, torch.nn.Parameter):
            continue
        try:
            p.__class__ = PartitionedParameter if cls is torch.nn.Parameter else partitioned_class(cls)
        except TypeError as e:
            warnings.warn(f"zinf: parameter {handle_of(p).name!r} of class {cls.__name__} cannot be guarded "
                          f"against eager reads ({e}): reading it outside a compiled graph reads freed memory. "
                          "Read it with zinf_compile.gathered(model) or full_state_dict(model).", stacklevel=2)


_partitioned_classes: Dict[type, type] = {}
_classes_lock = threading.Lock()  # not _lock: partition() may hold that when it retypes


def partitioned_class(cls: type) -> type:
    """The class a partitioned parameter of the user's ``nn.Parameter`` subclass ``cls`` takes: one per
    ``cls``, ``PartitionedParameter`` first in its MRO (its guard runs before ``cls``'s own
    ``__torch_function__``, which it then defers to), ``cls`` after."""
    with _classes_lock:
        out = _partitioned_classes.get(cls)
        if out is None:
            out = type(f"Partitioned{cls.__name__}", (PartitionedParameter, cls),
                       {"__module__": __name__, "_zinf_user_class": cls})
            _partitioned_classes[cls] = out
        return out


def partition(
    params: Iterable[tuple[str, torch.nn.Parameter]], placement: Placement, sync_from_rank0: bool = True,
    retype: bool = True,
) -> List[int]:
    """Move each parameter's data into the store (idempotent); return the uids in order.

    With dp > 1 the values of the group's rank 0 win (as in DDP), so ranks that initialised
    differently still train one model. New parameters join ``placement.context`` or, if it names
    none, the context chosen by ``zinf_runtime.context.resolve_context`` (their model's). With
    ``retype=False`` the parameters keep their class until ``retype_partitioned`` (the backend's case).
    """
    items = list(params)
    new: List[tuple[str, torch.nn.Parameter]] = []
    with _lock:
        seen: set[int] = set()
        existing: Optional[RuntimeContext] = None
        for name, p in items:
            h = handle_of(p)
            if h is not None:
                if h.placement != placement.for_param(p.numel(), p.dim()):
                    raise ValueError(
                        f"zinf: parameter {name!r} is already partitioned with {h.placement}, not "
                        f"{placement}; compile every graph of a model with the same options."
                    )
                existing = existing or h.context
            elif id(p) not in seen:
                seen.add(id(p))
                new.append((name, p))
        if new and placement.context is None:
            placement = replace(placement, context=resolve_context(existing))
        for name, p in new:
            if p.untyped_storage().nbytes() < p.numel() * p.element_size():
                raise RuntimeError(f"zinf: parameter {name!r} has no data (storage freed elsewhere)")
            flat = p.detach().reshape(-1)
            if comm.world_size(placement.group) > 1 and sync_from_rank0:
                flat = flat.clone()
                comm.broadcast(flat, placement.group)  # staged through the group's device if needed
            h = ParamHandle(name, p.shape, p.dtype, p.requires_grad, placement.for_param(p.numel(), p.dim()), flat,
                            param=p)
            _handles[h.uid] = h
            setattr(p, UID_ATTR, h.uid)
            weakref.finalize(p, _forget, h.uid)
            del flat
            _free_storage([p], retype)  # one at a time: the whole model never exists twice
    if new:
        global epoch
        epoch += 1
        install_optimizer_guard()
    return [getattr(p, UID_ATTR) for _, p in items]


def sync_buffers(buffers: Iterable[torch.Tensor], group: Optional[object]) -> None:
    """Broadcast each buffer from the group's rank 0 once, when its graph's parameters are partitioned:
    buffers are replicated state (BatchNorm statistics, masks), so ranks start from rank 0's, as in DDP."""
    if comm.world_size(group) == 1:
        return
    for b in buffers:
        if getattr(b, "_zinf_synced", False):
            continue
        dev = comm.group_device(group)
        data = b.detach().to(dev).contiguous()
        comm.broadcast(data, group)
        with torch.no_grad():
            b.copy_(data.to(b.device))
        b._zinf_synced = True


# -- any torch.optim optimizer steps partitioned parameters (runtime/optim_adapt.py) --------------
_hooks_installed = False


def install_optimizer_guard() -> None:
    """Register the global optimizer step hooks once: they act only on optimizers that hold partitioned
    parameters (converting them to step the shards); any other optimizer is left as it is.

    ``zinf_compile`` registers them on import, before any model is partitioned: torch reads the hook
    list when a step begins, and Lightning's first ``optimizer.step(closure)`` runs the first forward,
    which partitions, inside that step. Partitioning registers them too, for runtime-only users."""
    global _hooks_installed
    if not _hooks_installed:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from . import optim_adapt

        register_optimizer_step_pre_hook(optim_adapt.pre_step)
        register_optimizer_step_post_hook(optim_adapt.post_step)
        _hooks_installed = True


def iter_handles(params: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ParamHandle]]:
    for p in params:
        h = handle_of(p)
        if h is not None:
            yield p, h
