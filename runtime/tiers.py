"""Slots: one fixed-size tensor kept on one memory tier (device, CPU, or NVMe through the swap engine).

The store keeps each shard (fp32 master, parameter copy, gradient, optimizer moments) in a slot, so
the same code serves every combination of ``offload_params`` and ``offload_optimizer``::

    memory tier:  slot.get() -> the resident tensor (mutable in place); slot.set(t) copies into it
    nvme tier:    slot.get() -> a fresh CPU tensor read from disk;      slot.set(t) writes a new version
                  slot.set(t, defer=True) keeps t in host memory, written only if evicted (write-back);
                  a fetch reads that value where it is (``read_owned(keep=True)`` lends it, no copy)

A slot belongs to one model's ``RuntimeContext`` (``zinf_runtime.context``): its bytes are counted
in that model's accounting, its NVMe IO goes through that context's swap engine (one per settings
and rank, with its own 0700 folder under ``nvme_path``, removed when the context is freed or at
exit) and its host buffers come from that context's pool.

Host memory of a slot may be read or written by asynchronous device work (CUDA copies and Triton
kernels): ``slot.fence`` orders the host after it, and every host accessor waits on it
(``zinf_runtime.hostsync``). Slot memory is also tagged so ``comm``'s strict mode can refuse it as
a collective's buffer.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from . import accounting, comm, hostsync
from .swap import ALIGN, SwapConfig, SwapEngine, SwapHandle

if TYPE_CHECKING:
    from .context import RuntimeContext

def engine(cfg: SwapConfig, rank: int) -> SwapEngine:
    """The default context's swap engine for these settings and rank (direct runtime users)."""
    from .context import DEFAULT

    return DEFAULT.engine(cfg, rank)


#: every live swap engine of every context, by (context id, settings, rank): a view for reports
_engines: "weakref.WeakValueDictionary[Tuple[int, SwapConfig, int], SwapEngine]" = weakref.WeakValueDictionary()

_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
_malloc_threshold: Optional[int] = None


def set_malloc_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (option ``malloc_mmap_threshold``; off by default).

    Why it is an option: glibc's threshold is *dynamic*. It starts at 128 KiB and rises to the size
    of each mmapped block freed, up to 32 MiB. Host buffers over 32 MiB therefore always get a fresh
    mmap (zero-filled, one page fault per 4 KiB on first touch, munmap on free): every fetch or NVMe
    read of such a shard pays that again. Buffers below end up in glibc's heap, which keeps freed
    blocks: streaming NVMe state through 4-64 MiB buffers then left peak RSS at 0.5-1.1x the model
    states meant to stay on disk (measured, benchmarks/nvme_rss.py), against ~0.34x with a fixed 1 MiB
    threshold (every large buffer its own mmap, returned to the OS on free; zinf's ``BufferPool``
    reuses them, which keeps the page faults low). Fixing it is a process-wide glibc setting, which
    changes every other library's allocations too, so zinf never does it unless asked, and never
    undoes it (glibc cannot restore the dynamic behaviour). Returns whether glibc accepted it.
    """
    global _malloc_threshold
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 < nbytes <= _GLIBC_MMAP_THRESHOLD_MAX:
        raise ValueError(f"malloc_mmap_threshold must be an int in 1..{_GLIBC_MMAP_THRESHOLD_MAX} bytes "
                         f"(glibc's limit), got {nbytes!r}")
    if _malloc_threshold == nbytes:
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(-3, nbytes))  # M_MMAP_THRESHOLD (glibc); fixed, so no dynamic raising
    except (OSError, AttributeError):  # not glibc: nothing to tune
        ok = False
    if ok:
        _malloc_threshold = nbytes
    else:
        warnings.warn(f"zinf: could not set glibc's mmap threshold to {nbytes} (not glibc?); "
                      "option malloc_mmap_threshold has no effect here", RuntimeWarning, stacklevel=2)
    return ok


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """``nbytes`` of uninitialised host memory (uint8) starting on a page boundary (pinned if ``pin``):
    a view into an allocation one page larger, which it keeps alive."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)  # pinned in place: no copy
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


class BufferPool:
    """Reusable host buffers for NVMe reads and writes and for the buckets' flat buffers
    (``flat_buffer``), by byte size (one pool per model context).

    Every read wants a fresh host tensor and every write must keep its source alive until the disk
    has it; allocating those anew each time (4-64 MiB apiece) leaves glibc holding gigabytes of
    freed heap (measured: peak RSS 0.47-0.73x the model states instead of ~0.2x). Reusing buffers of
    the same sizes keeps resident memory at what is actually in flight. At most ``cap_bytes`` idle.

    Every buffer starts on a page (``swap.ALIGN``): O_DIRECT IO needs page-aligned memory, and the
    swap engine moves an aligned tensor's whole blocks straight between the file and the tensor
    (``SwapEngine._zero_copy``). ``torch.empty`` is only 64-byte aligned, so an unaligned buffer
    cost one more memcpy of every byte read or written, on IO threads that share the cores with
    compute; on two cores an NVMe step is CPU-bound (README, "NVMe steps on two cores"). The price
    is up to one page per buffer.
    """

    def __init__(self, cap_bytes: int = 512 << 20):
        self.cap_bytes = cap_bytes
        self._free: Dict[Tuple[int, bool], list] = {}
        self._idle = 0
        self.allocations = 0  # acquires that found no idle buffer of their size (tests: reuse across steps)
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        return self._idle

    def acquire(self, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        with self._lock:
            free = self._free.get((nbytes, pin))
            if free:
                self._idle -= nbytes
                return free.pop().view(dtype)
            self.allocations += 1
        return aligned_empty(nbytes, pin).view(dtype)

    def release(self, t: torch.Tensor, fence: Optional[hostsync.Fence] = None) -> None:
        """Give back a buffer from ``acquire`` (nothing may use it afterwards). ``fence``: device work
        still reading or writing it, waited for first, so the next ``acquire`` gets an idle buffer."""
        if fence is not None:
            fence.wait()
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        if raw.data_ptr() % ALIGN:
            # not one of ours (a donated tensor: torch's first optimizer states, an autograd
            # gradient): kept, it would hand out an unaligned buffer on every later acquire, and
            # each of that buffer's reads and writes would go through the engine's bounce copy
            return
        nbytes = raw.numel()
        with self._lock:
            if self._idle + nbytes <= self.cap_bytes:
                self._free.setdefault((nbytes, raw.is_pinned()), []).append(raw)
                self._idle += nbytes

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is one of the idle buffers (given back, not handed out again)."""
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            return any(b.untyped_storage().data_ptr() == ptr for free in self._free.values() for b in free)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle = 0


def flat_buffer(pool: Optional[BufferPool], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A collective's private flat buffer (a bucket's, an exchange's receive buffer) of at least
    ``numel`` elements (callers view its first ``numel``).

    On the host it comes from the model context's pool, its size rounded up to a power of two, so
    buckets of different sizes share a few buffers. Why: each bucket used to allocate its packed input
    and its output (4-8 MiB at the default ``bucket_bytes``) and free them at its last wait, several
    dozen times a step. Those sizes sit under glibc's dynamic mmap threshold, so the freed chunks stayed
    in the heaps, fragmented: at dp 2 on the 25M GPT a rank's RSS grew ~30 MiB a step and levelled off
    near 1.4 GiB after a dozen steps, against ~1.0 GiB with ``bucket_bytes=0``, while the live tensors
    stayed at 144 MiB (``malloc_trim`` gave the difference back). On an accelerator the caching
    allocator already reuses device memory in stream order: a plain ``torch.empty``."""
    if pool is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return pool.acquire(flat_nbytes(numel * dtype.itemsize, device) // dtype.itemsize, dtype)


def flat_nbytes(nbytes: int, device: torch.device) -> int:
    """The bytes ``flat_buffer`` holds for a request of ``nbytes`` (the memory plan books the same)."""
    if device.type != "cpu":
        return nbytes
    return max(ALIGN, 1 << (nbytes - 1).bit_length())


WRITE_INFLIGHT_CAP = int(os.environ.get("ZINF_NVME_WRITE_INFLIGHT", 128 << 20))


class WriteTracker:
    """NVMe writes in flight, oldest first (one tracker per model context): their source buffers stay
    resident until the disk has them, so their bytes are capped (the producer then waits for the
    disk, which is the real bound anyway).

    An insertion-ordered dict keyed by the slot itself (slots compare by identity): ``untrack`` is
    O(1). A deque's ``remove`` compared the slot field by field with every write in flight, on every
    flush: about 110 000 compares and 0.1 s of the main thread (under cProfile) per NVMe step of a
    25M model at dp 1."""

    def __init__(self, cap_bytes: int = WRITE_INFLIGHT_CAP):
        self.cap_bytes = cap_bytes
        self._inflight: Dict["Slot", None] = {}
        self.bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._inflight)

    def track(self, slot: "Slot") -> None:
        with self._lock:
            if slot in self._inflight:  # tracked twice without an untrack (Slot.set flushes first): count it once
                self.bytes -= slot.nbytes
                del self._inflight[slot]  # re-inserted below: it is now the newest
            self._inflight[slot] = None
            self.bytes += slot.nbytes
        while True:
            with self._lock:
                if self.bytes <= self.cap_bytes or not self._inflight:
                    return
                oldest = next(iter(self._inflight))
            oldest.flush()

    def untrack(self, slot: "Slot") -> None:
        with self._lock:
            if self._inflight.pop(slot, False) is False:
                return
            self.bytes -= slot.nbytes


class DirtyTracker:
    """NVMe values held in host memory and not written yet (``Slot.set(..., defer=True)``), oldest
    first (one tracker per model context). Over ``cap_bytes`` the oldest is written back.

    Why: a gradient shard on an NVMe tier is usually read once, by the optimizer step that follows
    the backward, and then dropped by ``zero_grad``. Writing it to disk and reading it back costs a
    write and a read of every gradient byte per step, on IO threads that share the cores with
    compute; kept in memory up to the cap (the sub-group the optimizer streams, by default), most
    gradients never touch the disk. The cap bounds the host memory this holds."""

    def __init__(self, cap_bytes: int = 256 << 20):
        self.cap_bytes = cap_bytes
        self._dirty: Dict["Slot", None] = {}
        self.bytes = 0
        self.peak_bytes = 0
        self.written_back = 0  # values evicted to disk (for tests and reports)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._dirty)

    def track(self, slot: "Slot") -> None:
        """``slot`` holds a deferred value now; write back the oldest ones while over the cap."""
        with self._lock:
            if slot not in self._dirty:
                self._dirty[slot] = None
                self.bytes += slot.nbytes
        while True:
            with self._lock:
                if self.bytes <= self.cap_bytes or not self._dirty:
                    self.peak_bytes = max(self.peak_bytes, self.bytes)
                    return
                oldest = next(iter(self._dirty))
                self.written_back += 1
            oldest.write_back()  # untracks it

    def untrack(self, slot: "Slot") -> None:
        with self._lock:
            if self._dirty.pop(slot, False) is False:
                return
            self.bytes -= slot.nbytes


pool = BufferPool()  # the default context's pool (direct runtime users)
_default_writes = WriteTracker()


#: guards every slot's lend bookkeeping (``Slot._lent``): a fetch may hand a value back on a copy lane's
#: thread while the main thread replaces or evicts it; held for dict and counter updates only
_LEND_LOCK = threading.Lock()


class _Lend:
    """A slot's write-back value lent to fetches (``Slot.read_owned(keep=True)``), by its buffer.

    Why it is counted: a fetch reads the value where it is instead of copying it, and may still
    be reading it (a carried read, a side-stream upload on CUDA) when the slot lets go of it (a new
    value replaced it, or it was written back). The buffer goes to the read cache or the pool only
    once the last borrower handed it back, after the device work its fences record."""

    __slots__ = ("count", "fence", "pooled")

    def __init__(self) -> None:
        self.count = 0  # fetches that have it and have not handed it back
        self.fence = hostsync.Fence()  # device work of those fetches still reading it (CUDA)
        self.pooled: Optional[bool] = None  # set once the slot let go: whether it goes to the pool then


@dataclass(eq=False)
class Slot:
    """A 1-D tensor of ``numel`` x ``dtype`` on ``tier``; see the module docstring.

    ``eq=False``: a slot is a resource, equal only to itself (and hashable). Field equality made two
    slots of the same shape and key interchangeable in containers, and cost a field-by-field compare
    per element in every search."""

    tier: str
    kind: str  # accounting kind: "param", "grad" or "optim"
    numel: int
    dtype: torch.dtype
    device: torch.device  # where a memory-tier slot lives
    swap: Optional[SwapEngine] = None
    key: str = ""
    pin: bool = False
    ctx: Optional["RuntimeContext"] = None  # None: the default context

    def __post_init__(self) -> None:
        if self.ctx is None:
            from .context import DEFAULT

            self.ctx = DEFAULT
        self._mem: Optional[torch.Tensor] = None
        self._written = False
        self._pending: Optional[SwapHandle] = None
        self._pending_buffer: Optional[torch.Tensor] = None  # the buffer the pending write reads
        self._pending_pooled = False  # ... a pool buffer: back to the pool (or the read cache) once written
        self._pending_deferred = False  # ... a write-back value evicted: kept in memory again if the write fails
        self._lent: Dict[int, _Lend] = {}  # the write-back value as fetches borrow it, by data_ptr
        self._dirty: Optional[torch.Tensor] = None  # write-back: the value in host memory, not on disk yet
        self._dirty_pooled = False  # _dirty is a pool buffer: back to the pool when discarded or written
        self.fence = hostsync.Fence()  # device work in flight on _mem
        self.version = 0  # bumped by every write and drop: a read started earlier is stale (runtime/carry.py)
        self._reads: Dict[int, int] = {}  # read_owned(keep=True) buffers out: data_ptr -> version read
        self._pending_version = 0  # the version the write in flight stores

    @property
    def accounting(self) -> accounting.Accounting:
        return self.ctx.accounting

    @property
    def _tracker(self) -> "DirtyTracker":
        """Where this slot's write-back value is counted: a parameter's (its stepped master or copy,
        ``ctx.kept``, capped by ``nvme_read_cache_bytes``) apart from a gradient's (``ctx.dirty``,
        capped by ``optimizer_sub_group_bytes``). Why apart: a stepped master evicted a consumed
        gradient from a shared cap, writing bytes that ``zero_grad`` drops next."""
        return self.ctx.kept if self.kind == "param" else self.ctx.dirty

    @property
    def pool(self) -> BufferPool:
        """The host buffer pool of this slot's context (take NVMe read buffers from here)."""
        return self.ctx.pool

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def present(self) -> bool:
        return self._mem is not None or self._written or self._dirty is not None

    @property
    def dirty(self) -> Optional[torch.Tensor]:
        """The deferred value in host memory (``set(..., defer=True)``) or None. The slot owns it: a
        reader may use it until the slot changes (its ``version``), and must not change or free it."""
        return self._dirty

    def resident(self) -> Optional[torch.Tensor]:
        """The in-memory tensor of a memory-tier slot, safe for the host to read and write (None on
        NVMe or when empty): device work still using it is waited for first."""
        self.fence.wait()
        return self._mem

    def resident_for_device(self) -> Optional[torch.Tensor]:
        """The in-memory tensor *without* waiting: only to enqueue device work on it (then
        ``fence.record`` it), or for host reads of memory no device work writes (parameter slots)."""
        return self._mem

    def _alloc(self) -> None:
        self._mem = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self.pin:
            self._mem = self._mem.pin_memory()
        comm.tag_slot(self._mem, self.key or self.kind)
        self.accounting.add(self.tier, self.kind, self.nbytes)

    def adopt(self, value: torch.Tensor) -> bool:
        """Make ``value``'s memory this empty memory-tier slot's, instead of allocating and copying.

        Why: a gradient shard the runtime made itself (a reduce-scatter's output, a cast) or a
        gradient the compiled graph hands over (``reduce_grad(..., donated=True)``) is read by
        nothing else, so copying it into a fresh slot costs an allocation and a copy of every
        gradient byte per step, which eager's ``AccumulateGrad`` does not pay either. The caller must
        own ``value``: nothing else may read or write its storage afterwards.

        Returns False, changing nothing, unless ``value`` is exactly what the slot would hold: the
        slot empty and in memory, same dtype, device and numel, contiguous, covering its whole
        storage (not a view into a larger buffer), and pinned where the slot must be.
        """
        if self.tier == "nvme" or self._mem is not None:
            return False
        if (value.dtype != self.dtype or value.device != self.device or value.numel() != self.numel
                or value.requires_grad or not value.is_contiguous() or value.storage_offset() != 0
                or value.untyped_storage().nbytes() != self.nbytes or (self.pin and not value.is_pinned())):
            return False
        self.version += 1
        self._mem = value.view(-1)
        comm.tag_slot(self._mem, self.key or self.kind)
        self.accounting.add(self.tier, self.kind, self.nbytes)
        return True

    def set(self, value: torch.Tensor, donate: bool = False, recycle: bool = False, defer: bool = False) -> None:
        """Store ``value``. It is copied, unless ``donate``: then, on NVMe, the caller hands it over
        and must not change it; with ``recycle`` it goes back to the pool once written (or discarded).

        ``defer`` (NVMe): keep the value in host memory and write it only when the context's
        ``DirtyTracker`` evicts it; a ``drop`` first discards it unwritten (write-back)."""
        self.version += 1
        if self.tier != "nvme":
            if self._mem is None:
                self._alloc()
            self.fence.wait()  # an upload may still read, or an accumulate still write, _mem
            self._mem.copy_(value.reshape(-1))
            return
        self.ctx.read_cache.drop(self)  # after the version bump (ReadCache.put checks it)
        self.flush()  # one write in flight per slot: its buffer is recycled before the next
        data = value.detach().reshape(-1)
        if self._dirty is not None and data.data_ptr() == self._dirty.data_ptr():
            # the write-back value itself, updated in place (``take_for_update``): kept, not recycled
            data, pooled = self._dirty, self._dirty_pooled
            self._dirty = None
            self._tracker.untrack(self)
            if defer:
                self._dirty, self._dirty_pooled = data, pooled
                self._tracker.track(self)
            else:
                self._write(data, pooled)
            return
        # a value kept in memory for fetches to upload must be pinned where they upload from pinned memory
        unpinned_kept = defer and self.pin and not data.is_pinned()
        if donate and data.device.type == "cpu" and data.dtype == self.dtype and not unpinned_kept:
            # written from the caller's memory (or reshape's private copy, which is not recycled)
            pooled = recycle and data.data_ptr() == value.data_ptr()
        else:
            # into a pooled (page-aligned, so written without a bounce copy) buffer: the write is
            # asynchronous and the caller may change value afterwards, or value needs a move or a cast
            pin = self.pin and data.device.type != "cpu"  # a device -> host copy runs faster into pinned memory
            data = self.pool.acquire(self.numel, self.dtype, pin).copy_(data)
            pooled = True
        if not self.present:
            self.accounting.add("nvme", self.kind, self.nbytes)
        self._discard_dirty()
        if defer:
            self._dirty, self._dirty_pooled = data, pooled
            self._tracker.track(self)
            return
        self._write(data, pooled)

    def _write(self, data: torch.Tensor, pooled: bool, deferred: bool = False) -> None:
        self._pending_buffer, self._pending_pooled, self._pending_deferred = data, pooled, deferred
        self._pending_version = self.version
        self._pending = self.swap.write(self.key, data)
        self._written = True
        self.ctx.writes.track(self)

    def rehome(self, ctx: "RuntimeContext") -> None:
        """Read and write through ``ctx`` from now on: a committed speculative shadow
        (``runtime/optim_overlap.py``) joins its model's context, so its later writes are tracked,
        kept in memory (write-back) and cached there like any other slot's. Nothing may be in
        flight or held unwritten: the shadow's write was waited for before its commit."""
        if self._pending is not None or self._dirty is not None:
            raise RuntimeError(f"zinf: slot {self.key} moved to another context with a write in flight")
        if ctx.read_cache is not self.ctx.read_cache:
            self.ctx.read_cache.drop(self)  # a copy the old cache holds would never be read again
        self.ctx = ctx

    def write_back(self) -> None:
        """Start writing the deferred value (the dirty tracker evicts it); a no-op without one."""
        data, pooled = self._dirty, self._dirty_pooled
        self._dirty = None
        self._tracker.untrack(self)
        if data is not None:
            self._write(data, pooled, deferred=True)

    def _discard_dirty(self) -> None:
        data, pooled = self._dirty, self._dirty_pooled
        self._dirty = None
        self._tracker.untrack(self)
        if data is not None:
            self._let_go(data, pooled)

    def _let_go(self, buf: torch.Tensor, pooled: bool, cache_version: Optional[int] = None) -> None:
        """The slot no longer holds ``buf`` (a replaced or written value): it goes to the read cache
        as the slot's clean copy (``cache_version``: the version it holds), else to the pool if
        ``pooled``, but only once every fetch it was lent to handed it back (``keep_read``)."""
        fence = None
        with _LEND_LOCK:
            lend = self._lent.get(buf.data_ptr()) if self._lent else None
            if lend is not None:
                if lend.count > 0:
                    lend.pooled = pooled  # the last borrower gives it to the pool (a newer value may be cached by then)
                    return
                del self._lent[buf.data_ptr()]
                fence = lend.fence
        if cache_version is not None and self.ctx.read_cache.put(self, buf, fence, cache_version):
            return
        if pooled:
            self.pool.release(buf, fence)
        elif fence is not None:
            fence.wait()  # not ours to recycle; device work may still read it

    def get(self) -> torch.Tensor:
        """The value: the resident tensor, or a fresh CPU tensor read from disk."""
        t, h = self.get_async()
        if h is not None:
            h.wait()
        return t

    def get_async(self, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        """Start reading (NVMe) into ``out`` (default: a new tensor; take one from ``pool`` to reuse
        memory); the tensor is valid once the handle's ``wait()`` returns. The handle is None when
        nothing is read: a memory tier (the resident tensor itself), a deferred value or a value in
        the read cache (``zinf_runtime.read_cache``; both copied)."""
        if self.tier != "nvme":
            if self._mem is None:
                raise RuntimeError(f"zinf: slot {self.key or self.kind} is empty")
            return self.resident(), None
        self.flush()  # a failed write (disk full) surfaces here, naming the path, not as a bad read
        if self._dirty is not None:  # a deferred value: served from memory, no read
            if out is None:
                return self._dirty.clone(), None
            return out.copy_(self._dirty), None
        version = self.version
        cached = self.ctx.read_cache.take(self)
        if cached is not None:  # copied, then put back for the next reader
            value = cached.clone() if out is None else out.copy_(cached)
            if not self.ctx.read_cache.put(self, cached, None, version):
                self.pool.release(cached)
            return value, None
        if not self._written:
            raise RuntimeError(f"zinf: swap key {self.key} was never written")
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype)
            if self.pin:
                out = out.pin_memory()
        return out, self.swap.read(self.key, out)

    def read_owned(self, keep: bool = False) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        """NVMe: the whole value in a pool buffer the caller owns (valid after the handle's wait; the
        handle is None when nothing is read): the read cache's copy when it holds one, else a read
        into a new pool buffer. ``keep``: the caller will hand the buffer, unchanged, to
        ``keep_read`` when done (a fetch); without it the caller may change the buffer and gives it to
        the pool or to ``set`` (the optimizer's master).

        Why: forward, backward and the optimizer each read a parameter's file, and between them it
        does not change; the cache saves the re-reads (``zinf_runtime.read_cache``)."""
        if self.tier == "nvme":
            self.flush()  # a finished write leaves its value in the cache; a failed one raises here
            data = self._dirty
            if keep and data is not None:  # the write-back value, lent where it is: a fetch only reads it
                with _LEND_LOCK:
                    lend = self._lent.get(data.data_ptr())
                    if lend is None:
                        lend = self._lent[data.data_ptr()] = _Lend()
                    lend.count += 1
                return data, None
        version = self.version
        buf = self.ctx.read_cache.take(self)
        handle = None
        if buf is None:
            # pinned (on CUDA) for a fetch, which uploads it, and for a parameter's master, which the
            # optimizer steps on the host: once written it stays as the cached copy the next fetch
            # uploads (write-through), and from pageable memory that upload would block and run slower
            pin = self.pin and (keep or self.kind == "param")
            buf, handle = self.get_async(out=self.pool.acquire(self.numel, self.dtype, pin))
        if keep:
            self._reads[buf.data_ptr()] = version
        return buf, handle

    def take_for_update(self) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        """NVMe: the value in a buffer the caller changes in place and hands back with
        ``set(buf, donate=True, recycle=True, ...)`` (the optimizer's master). A write-back value is
        handed over itself, with no copy, unless a fetch still holds it; it stays the slot's value,
        out of the dirty tracker (never evicted half-updated) until that ``set``. Otherwise as
        ``read_owned()``: the read cache's copy or a read into a new pool buffer.

        Why: with write-back (``Placement.param_write_back``) the master a step produced is the one
        the next step updates; copying it out first cost a memcpy of every master byte per step."""
        data = self._dirty
        if self.tier == "nvme" and data is not None:
            with _LEND_LOCK:
                lend = self._lent.get(data.data_ptr())
                free = lend is None or lend.count == 0
            if free:
                if lend is not None:
                    lend.fence.wait()  # device copies that read it are done before the host writes it
                self._tracker.untrack(self)
                return data, None
        return self.read_owned()

    def keep_read(self, buf: torch.Tensor, fence: Optional[hostsync.Fence] = None) -> None:
        """Done with a buffer from ``read_owned(keep=True)``, unchanged (``fence``: device work still
        reading it): it becomes the read cache's copy of this slot, unless the slot was written or
        dropped since that read started (then, or when the cache refuses it, it goes to the pool).
        A lent write-back value goes back to the slot (or, if the slot let go of it meanwhile, to the
        pool once no other fetch reads it)."""
        lent = last = False
        with _LEND_LOCK:
            lend = self._lent.get(buf.data_ptr()) if self._lent else None
            if lend is not None and lend.count > 0:
                lent = True
                lend.count -= 1
                if fence is not None:
                    lend.fence.absorb(fence)
                last = lend.count == 0 and lend.pooled is not None  # the slot let go of it while it was out
                if last:
                    del self._lent[buf.data_ptr()]
        if lent:
            if last:
                if lend.pooled:
                    self.pool.release(buf, lend.fence)
                else:
                    lend.fence.wait()
            return
        version = self._reads.pop(buf.data_ptr(), None)
        if version is None or not self.ctx.read_cache.put(self, buf, fence, version):
            self.pool.release(buf, fence)

    def flush(self) -> None:
        """Wait for this slot's last write (so its error, e.g. disk full, surfaces here)."""
        if self._pending is None:
            self.ctx.writes.untrack(self)
        else:
            h, self._pending = self._pending, None
            self.ctx.writes.untrack(self)
            try:
                h.wait()
            except Exception:
                restored = self._keep_failed_write_back()
                if self._written and not self.swap.exists(self.key):  # no earlier version survives
                    self._written = False
                    if not restored:
                        self.accounting.sub("nvme", self.kind, self.nbytes)
                raise
            buf, self._pending_buffer = self._pending_buffer, None
            if buf is not None:
                # a parameter's written value stays as its clean copy for the next fetch (write-through,
                # zinf_runtime.read_cache); anything else, a copy the cache refuses, or a pageable one
                # where fetches upload from pinned memory (a value set from outside the optimizer: a
                # checkpoint load), goes to the pool
                cacheable = self._pending_pooled and self.kind == "param" and (not self.pin or buf.is_pinned())
                self._let_go(buf, self._pending_pooled, self._pending_version if cacheable else None)

    def _keep_failed_write_back(self) -> bool:
        """A write-back value whose write failed (a full disk) is the slot's value again, held in
        memory as before its eviction, so the error loses nothing; True if so. It stays out of the
        dirty tracker (over its cap, until the value is replaced or dropped): tracked, it would be
        evicted again at once, into the same full disk, and fail some unrelated later access. Any
        other failed write leaves the slot's previous version (the file not overwritten) and the
        caller's error."""
        buf, self._pending_buffer = self._pending_buffer, None
        if buf is None:
            return False
        if not self._pending_deferred or self._dirty is not None or self.version != self._pending_version:
            if self._pending_pooled:
                self._let_go(buf, True)
            return False
        self._dirty, self._dirty_pooled = buf, self._pending_pooled
        return True

    def drop(self, keep_file: bool = False) -> None:
        """Free the slot's memory or file (after device work still using the memory). ``keep_file``: the
        value is gone, but the swap engine keeps its file for the slot's next write to overwrite
        (``SwapEngine.remove``), for a slot rewritten soon with the same size (a gradient)."""
        self.version += 1
        if self.tier == "nvme":
            self.ctx.read_cache.drop(self)
        if self._mem is not None:
            self.fence.wait()  # pinned memory freed under a running kernel could be handed out again
            self.accounting.sub(self.tier, self.kind, self.nbytes)
            self._mem = None
        if self._dirty is not None and not self._written:  # deferred, never written: nothing on disk
            self.accounting.sub("nvme", self.kind, self.nbytes)
        self._discard_dirty()
        with _LEND_LOCK:  # fetches still holding a lent value drop it when done
            idle = [self._lent.pop(ptr) for ptr, lend in list(self._lent.items()) if lend.count == 0]
            for lend in self._lent.values():
                lend.pooled = False
        for lend in idle:
            lend.fence.wait()
        if self._written:
            self._pending = None
            self._pending_buffer = None
            self.ctx.writes.untrack(self)
            self.swap.remove(self.key, keep_file=keep_file)
            self.accounting.sub("nvme", self.kind, self.nbytes)
            self._written = False
