"""Clean NVMe reads kept in host memory for the next reader of the same slot (one cache per model).

Why: with parameters on NVMe, one step reads every parameter shard three times: forward's fetch,
backward's fetch, and the optimizer reading it as its fp32 master (one file serves both,
``store.master_home``). The three reads return the same bytes; the file changes only when the
optimizer writes the stepped master. On the 25M GPT at dp 2 those were 290 of the step's 483 MiB
read (``benchmarks/compare.py``'s disk column), and on a GPU box the NVMe step is disk-bound. A fetch
that is done with its host buffer therefore hands it to its slot instead of to the pool, and so does
the optimizer's write of a master once the disk has it (write-through)::

    before:  forward   read u7 -> buf -> upload -> pool                  (disk)
             backward  read u7 -> buf -> upload -> pool                  (disk)
             step      read u7 -> buf -> AdamW -> write u7 -> pool       (disk)
    after:   forward   cache[u7] -> buf -> upload -> cache[u7]           (no IO, if still cached)
             backward  cache[u7] -> buf -> upload -> cache[u7]           (no IO, if still cached)
             step      cache[u7] -> buf -> AdamW -> write u7 -> cache[u7] (write-through, once written)

With ``nvme_param_write_back`` (the default) the step's write does not happen while the stepped
value fits its own cap: the slot keeps the value itself (``tiers.Slot``'s write-back, ``ctx.kept``)
and fetches borrow it, so such a parameter never passes through this cache. The cache serves the
parameters past that cap, whose evicted values are written (and then kept here), and every
parameter with ``nvme_param_write_back=False``.

A buffer is kept only if its slot was not written while it was read (``Slot.version``); a write or
a drop of the slot discards it, and a parameter slot's own write puts the written buffer back once
the disk has it (``Slot.flush``; a failed write keeps nothing), so a cached value always equals the
file, and the file always holds the current value. The oldest entries go back to the pool once the
cache holds over ``cap_bytes`` (the option ``nvme_read_cache_bytes``). The last parameters of
forward are the first of backward, and a unit's master is read a few operators after its backward
fetch, so a cache of a few units catches most re-reads; a model whose shards all fit reads no
parameter from disk in steady training (it still writes every stepped master). A taker owns the
buffer (it may step it in place); a reader that only wants a copy puts it back.

Ordering on CUDA: an entry keeps the fence of the device copy still reading it; a taker waits for
it before the host writes the buffer, eviction hands it to the pool with it (``BufferPool``), and a
dropped entry waits for it before letting the buffer go.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from . import hostsync

if TYPE_CHECKING:
    from .tiers import BufferPool, Slot

DEFAULT_CAP_BYTES = 64 << 20


class ReadCache:
    """Clean host copies of NVMe slots, oldest first; see the module docstring."""

    def __init__(self, pool: "BufferPool", cap_bytes: int = DEFAULT_CAP_BYTES):
        self.pool = pool
        self.cap_bytes = cap_bytes
        self._held: Dict["Slot", Tuple[torch.Tensor, Optional[hostsync.Fence], int]] = {}  # + its bytes
        self.bytes = 0
        self.peak_bytes = 0
        self.hits = 0  # reads served from here (no IO)
        self.kept = 0  # buffers handed in and kept
        # re-entrant: a garbage collection inside a locked section can run a parameter's finalizer,
        # which drops its slots here on the same thread
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, slot: "Slot", buf: torch.Tensor, fence: Optional[hostsync.Fence], version: int) -> bool:
        """Keep ``buf`` (a pool buffer holding ``slot``'s whole value as of ``version``) as ``slot``'s
        clean copy. False (nothing kept, the caller still owns ``buf``): the slot changed since
        (checked under the lock, so a concurrent write either sees the entry and drops it or makes
        this refuse), caching off, larger than the cap, or the slot already has one (two readers of
        one slot at once)."""
        nbytes = buf.numel() * buf.element_size()
        evicted = []
        with self._lock:
            if slot.version != version or nbytes > self.cap_bytes or slot in self._held:
                return False
            self._held[slot] = (buf, fence, nbytes)
            self.bytes += nbytes
            self.kept += 1
            while self.bytes > self.cap_bytes:
                old = next(iter(self._held))
                evicted.append(self._pop(old))
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        for old_buf, old_fence in evicted:
            self.pool.release(old_buf, old_fence)
        return True

    def buffers(self) -> list:
        """The held buffers, oldest first (a snapshot; for checks such as "all pinned on CUDA")."""
        with self._lock:
            return [buf for buf, _, _ in self._held.values()]

    def take(self, slot: "Slot") -> Optional[torch.Tensor]:
        """``slot``'s cached value, removed from the cache: the caller owns it (may write it) and
        hands it back with ``Slot.keep_read`` or to the pool. Device work still reading it is waited
        for first. None when nothing is cached."""
        with self._lock:
            if slot not in self._held:
                return None
            buf, fence = self._pop(slot)
            self.hits += 1
        if fence is not None:
            fence.wait()
        return buf

    def drop(self, slot: "Slot") -> None:
        """Forget ``slot``'s copy (it is being written or dropped: bump ``slot.version`` first).

        Its buffer is let go, not given to the pool: a slot is also dropped by its parameter's
        finalizer, which can run in the middle of another model's compile, and a tensor op there
        (the pool's ``view``) would run under that compile's fake-tensor mode and fail, leaving the
        slot's accounting behind. Device work still reading the buffer (its fence) is waited for
        first."""
        with self._lock:
            entry = self._pop(slot) if slot in self._held else None
        if entry is not None and entry[1] is not None:
            entry[1].wait()

    def clear(self) -> None:
        with self._lock:
            entries = [self._pop(s) for s in list(self._held)]
        for _, fence in entries:
            if fence is not None:
                fence.wait()

    def _pop(self, slot: "Slot") -> Tuple[torch.Tensor, Optional[hostsync.Fence]]:
        buf, fence, nbytes = self._held.pop(slot)
        self.bytes -= nbytes
        return buf, fence
