"""Ordering host access to host memory that asynchronous device work reads or writes.

On CUDA three runtime copies return before the device has done them:

* ``triton_copy.gather_cast`` reading a pinned host shard in place (UVA) into a device buffer;
* ``out.copy_(pinned, non_blocking=True)`` uploading a pinned host shard;
* ``triton_copy.scatter_accumulate`` adding a device gradient into a pinned host fp32 shard.

Each is enqueued on the current CUDA stream, so the device orders them against the graph's own
kernels (every zinf op and every compiled kernel runs on that one stream). The *host* is not
ordered: the CPU optimizer writing a master shard that an upload still reads, ``zero_grad`` or
the optimizer reading a gradient shard that ``scatter_accumulate`` still writes, a pooled pinned
buffer handed to the next NVMe read while a kernel still reads it, or pinned memory freed and
re-allocated by torch's caching host allocator (which tracks ``copy_`` uses, but not a Triton
kernel's UVA reads) would all race. A :class:`Fence` closes each of those holes::

    enqueue async work touching host buffer h      ->  fence.record(device, h)     (CUDA event)
    host reads / writes / frees / re-pools h       ->  fence.wait()                (event.synchronize)

``tiers.Slot`` owns one fence per host slot; its host accessors (``resident()``, ``get()``, ``set()``,
``drop()``) wait on it, so every caller (optimizer, clipping, ``zero_grad``) is ordered by
construction, and only the store's device-copy code uses the non-waiting ``resident_for_device()``.
Device tensors read by these copies need no keep-alive: torch's caching allocator reuses a freed
block only in stream order, after the copy. Host tensors given to ``record`` are kept alive until
``wait``.

On CPU (no CUDA device involved) every copy is synchronous and a fence is a no-op. Tests on CPU
swap in a recording event with :func:`recording_events`, which makes fences record on CPU too,
so the ordering logic itself is unit-tested without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

EventFactory = Callable[[torch.device], Any]
_fake_factory: Optional[EventFactory] = None


def _cuda_event(device: torch.device) -> Any:
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def needs_fence(device: torch.device) -> bool:
    """Whether work on ``device`` can still be running when the host gets control back."""
    return device.type == "cuda" or _fake_factory is not None


class Fence:
    """Events of asynchronous device work on one host buffer; see the module docstring."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: List[Tuple[Any, Tuple[torch.Tensor, ...]]] = []  # (event, host tensors it reads)

    @property
    def pending(self) -> bool:
        return bool(self._events)

    def record(self, device: torch.device, *keep: torch.Tensor) -> None:
        """Device work touching this buffer was just enqueued on ``device``'s current stream;
        ``keep`` (host tensors it uses) stay alive until it finished."""
        if not needs_fence(device):
            return
        factory = _fake_factory or _cuda_event
        if len(self._events) >= 4:  # repeated fetches without a host access (inference): drop done ones
            self._events = [(e, k) for e, k in self._events if not e.query()]
        self._events.append((factory(device), keep))

    def absorb(self, other: "Fence") -> None:
        """Take over ``other``'s pending events (two readers of one buffer: wait for both)."""
        if other is not self and other._events:
            self._events.extend(other._events)
            other._events = []

    def wait(self) -> None:
        """Block the host until every recorded device use of the buffer has finished."""
        if not self._events:
            return
        events, self._events = self._events, []
        for ev, _ in events:
            ev.synchronize()


class RecordingEvent:
    """A stand-in for ``torch.cuda.Event`` on CPU: it logs when it is recorded and waited on."""

    def __init__(self, log: List[Tuple[str, int]], device: torch.device):
        self.log, self.done = log, False
        self.id = sum(1 for kind, _ in log if kind == "record")  # 0, 1, 2... in record order
        log.append(("record", self.id))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
        self.log.append(("wait", self.id))


@contextlib.contextmanager
def recording_events(log: List[Tuple[str, int]]) -> Iterator[List[Tuple[str, int]]]:
    """Make fences record :class:`RecordingEvent` s even for CPU work (tests)."""
    global _fake_factory
    prev = _fake_factory
    _fake_factory = lambda device: RecordingEvent(log, device)  # noqa: E731
    try:
        yield log
    finally:
        _fake_factory = prev
