"""Slots: one fixed-size tensor kept on one memory tier (device, CPU, or NVMe through the swap engine).

The store keeps each shard (fp32 master, parameter copy, gradient, optimizer moments) in a slot, so
the same code serves every combination of ``offload_params`` and ``offload_optimizer``::

    memory tier:  slot.get() -> the resident tensor (mutable in place); slot.set(t) copies into it
    nvme tier:    slot.get() -> a fresh CPU tensor read from disk;      slot.set(t) writes a new version

Swap engines are per process, one per (settings, rank): each owns its own 0700 folder under
``nvme_path``, removed at exit.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from . import accounting
from .swap import SwapConfig, SwapEngine, SwapHandle

_engines: Dict[Tuple[SwapConfig, int], SwapEngine] = {}
_engines_lock = threading.Lock()


def engine(cfg: SwapConfig, rank: int) -> SwapEngine:
    """The process's swap engine for these settings and rank (created on first use)."""
    with _engines_lock:
        eng = _engines.get((cfg, rank))
        if eng is None:
            eng = SwapEngine(cfg, rank)
            _engines[(cfg, rank)] = eng
            _fix_mmap_threshold()
        return eng


_malloc_tuned = False


def _fix_mmap_threshold() -> None:
    """Serve host buffers of 1 MiB and more from mmap, so freeing them returns them to the OS.

    Streaming model states through NVMe allocates and frees many 4-64 MiB host tensors; glibc's
    default raises its mmap threshold after the first large free and then keeps such blocks in its
    heap: measured here, peak RSS reached 0.5-1.1x the model states it was meant to keep on disk,
    against ~0.34x with a fixed threshold. Buffers are reused through ``pool``, which keeps the extra
    page faults of mmap low. ``ZINF_MALLOC_MMAP_THRESHOLD=0`` leaves the allocator alone.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    threshold = int(os.environ.get("ZINF_MALLOC_MMAP_THRESHOLD", 1 << 20))
    if threshold <= 0:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD (glibc); fixed, so no dynamic raising
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


class BufferPool:
    """Reusable host buffers for NVMe reads and writes, by byte size.

    Every read wants a fresh host tensor and every write must keep its source alive until the disk
    has it; allocating those anew each time (4-64 MiB apiece) leaves glibc holding gigabytes of
    freed heap (measured: peak RSS 0.47-0.73x the model states instead of ~0.2x). Reusing buffers of
    the same sizes keeps resident memory at what is actually in flight. At most ``cap_bytes`` idle.
    """

    def __init__(self, cap_bytes: int = 512 << 20):
        self.cap_bytes = cap_bytes
        self._free: Dict[Tuple[int, bool], list] = {}
        self._idle = 0
        self._lock = threading.Lock()

    def acquire(self, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        with self._lock:
            free = self._free.get((nbytes, pin))
            if free:
                self._idle -= nbytes
                return free.pop().view(dtype)
        raw = torch.empty(nbytes, dtype=torch.uint8)
        return (raw.pin_memory() if pin else raw).view(dtype)

    def release(self, t: torch.Tensor) -> None:
        """Give back a buffer from ``acquire`` (nothing may use it afterwards)."""
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        nbytes = raw.numel()
        with self._lock:
            if self._idle + nbytes <= self.cap_bytes:
                self._free.setdefault((nbytes, raw.is_pinned()), []).append(raw)
                self._idle += nbytes


pool = BufferPool()

# NVMe writes in flight, oldest first: their source buffers stay resident until the disk has them, so
# their bytes are capped (the producer then waits for the disk, which is the real bound anyway)
_inflight: "collections.deque[Slot]" = collections.deque()
_inflight_bytes = 0
_inflight_lock = threading.Lock()
WRITE_INFLIGHT_CAP = int(os.environ.get("ZINF_NVME_WRITE_INFLIGHT", 128 << 20))


def _track_write(slot: "Slot") -> None:
    global _inflight_bytes
    with _inflight_lock:
        _inflight.append(slot)
        _inflight_bytes += slot.nbytes
    while True:
        with _inflight_lock:
            if _inflight_bytes <= WRITE_INFLIGHT_CAP or not _inflight:
                return
            oldest = _inflight[0]
        oldest.flush()


def _untrack_write(slot: "Slot") -> None:
    global _inflight_bytes
    with _inflight_lock:
        try:
            _inflight.remove(slot)
        except ValueError:
            return
        _inflight_bytes -= slot.nbytes


@dataclass
class Slot:
    """A 1-D tensor of ``numel`` x ``dtype`` on ``tier``; see the module docstring."""

    tier: str
    kind: str  # accounting kind: "param", "grad" or "optim"
    numel: int
    dtype: torch.dtype
    device: torch.device  # where a memory-tier slot lives
    swap: Optional[SwapEngine] = None
    key: str = ""
    pin: bool = False

    def __post_init__(self) -> None:
        self._mem: Optional[torch.Tensor] = None
        self._written = False
        self._pending: Optional[SwapHandle] = None
        self._pending_buffer: Optional[torch.Tensor] = None  # a pool buffer the pending write reads

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def present(self) -> bool:
        return self._mem is not None or self._written

    def resident(self) -> Optional[torch.Tensor]:
        """The in-memory tensor of a memory-tier slot (None on NVMe or when empty)."""
        return self._mem

    def set(self, value: torch.Tensor, donate: bool = False, recycle: bool = False) -> None:
        """Store ``value``. It is copied, unless ``donate``: then, on NVMe, the caller hands it over
        and must not change it; with ``recycle`` it goes back to ``pool`` once written."""
        if self.tier != "nvme":
            if self._mem is None:
                self._mem = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                if self.pin:
                    self._mem = self._mem.pin_memory()
                accounting.add(self.tier, self.kind, self.nbytes)
            self._mem.copy_(value.reshape(-1))
            return
        self.flush()  # one write in flight per slot: its buffer is recycled before the next
        data = value.detach().reshape(-1).to("cpu", self.dtype)
        if data.data_ptr() == value.data_ptr() and not donate:
            # the write is asynchronous: the caller may change value afterwards
            data = pool.acquire(self.numel, self.dtype)
            data.copy_(value.reshape(-1))
            self._pending_buffer = data
        else:
            self._pending_buffer = data if (donate and recycle and data.data_ptr() == value.data_ptr()) else None
        if not self._written:
            accounting.add("nvme", self.kind, self.nbytes)
        self._pending = self.swap.write(self.key, data)
        self._written = True
        _track_write(self)

    def get(self) -> torch.Tensor:
        """The value: the resident tensor, or a fresh CPU tensor read from disk."""
        t, h = self.get_async()
        if h is not None:
            h.wait()
        return t

    def get_async(self, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        """Start reading (NVMe) into ``out`` (default: a new tensor; take one from ``pool`` to reuse
        memory); the tensor is valid once the handle's ``wait()`` returns."""
        if self.tier != "nvme":
            if self._mem is None:
                raise RuntimeError(f"zinf: slot {self.key or self.kind} is empty")
            return self._mem, None
        self.flush()  # a failed write (disk full) surfaces here, naming the path, not as a bad read
        if not self._written:
            raise RuntimeError(f"zinf: swap key {self.key} was never written")
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype)
            if self.pin:
                out = out.pin_memory()
        return out, self.swap.read(self.key, out)

    def flush(self) -> None:
        """Wait for this slot's last write (so its error, e.g. disk full, surfaces here)."""
        if self._pending is None:
            _untrack_write(self)
        else:
            h, self._pending = self._pending, None
            _untrack_write(self)
            try:
                h.wait()
                buf, self._pending_buffer = self._pending_buffer, None
                if buf is not None:
                    pool.release(buf)
            except Exception:
                if self._written and not self.swap.exists(self.key):  # no earlier version survives
                    self._written = False
                    accounting.sub("nvme", self.kind, self.nbytes)
                raise

    def drop(self) -> None:
        """Free the slot's memory or file."""
        if self._mem is not None:
            accounting.sub(self.tier, self.kind, self.nbytes)
            self._mem = None
        if self._written:
            self._pending = None
            _untrack_write(self)
            self.swap.remove(self.key)
            accounting.sub("nvme", self.kind, self.nbytes)
            self._written = False
