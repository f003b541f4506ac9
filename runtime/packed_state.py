"""A unit's per-element optimizer states on NVMe, packed into one file: one read and one write a step.

Before (one slot per state, each its own swap key)::

    u7.optim.exp_avg     [n x fp32]   read, stepped, written
    u7.optim.exp_avg_sq  [n x fp32]   read, stepped, written        -> 2 reads + 2 writes per step

After (``PackedState``: one slot of raw bytes, the states are views of one buffer)::

    u7.optim  [exp_avg | exp_avg_sq]  read into one pool buffer; torch's step updates the views in
                                      place; the same buffer is written back  -> 1 read + 1 write

Why: on two cores an NVMe step is CPU-bound, and its cost is per request more than per byte. The
swap engine spends 120-280 µs of CPU on a request (open, close, a handle, thread hand-offs) against
20 µs for the bare ``pwritev``, and the optimizer's bookkeeping (slots, handles, pool buffers) is
per request too. Adam's two moments in one request halve both. DeepSpeed's swapper goes further and
swaps a whole sub-group's flat buffer; per unit keeps the optimizer prefetch, which starts a unit's
read as soon as its gradient is final during backward.

The layout is what the optimizer's state dict says after a step (its per-element tensors, in its
order); a changed set of states (``amsgrad`` switched on, a state loaded from a checkpoint) gets a
new layout. Scalar entries (Adam's ``step``) stay in memory (``ParamHandle.optim_small``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch

from . import tiers
from .swap import SwapHandle

if TYPE_CHECKING:
    from .store import ParamHandle

__all__ = ["Layout", "PackedField", "PackedState", "is_per_element", "split_state"]


def is_per_element(v: object, numel: int) -> bool:
    """A state with one entry per element of the unit's shard (a moment), as opposed to a scalar."""
    return torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel  # type: ignore[union-attr]


def split_state(state: Dict[str, object], numel: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, object]]:
    """``(per-element states, the rest)`` of one unit's optimizer state: what is packed on NVMe, and
    what stays in memory (``ParamHandle.optim_small``: Adam's ``step``)."""
    per_el: Dict[str, torch.Tensor] = {}
    small: Dict[str, object] = {}
    for name, v in state.items():
        if is_per_element(v, numel):
            per_el[name] = v  # type: ignore[assignment]
        else:
            small[name] = v
    return per_el, small


@dataclass(frozen=True)
class Layout:
    """Where each state sits in the packed bytes: ``(name, dtype, byte offset)``, ``numel`` each."""

    fields: Tuple[Tuple[str, torch.dtype, int], ...]
    numel: int
    nbytes: int

    @staticmethod
    def of(states: Dict[str, torch.Tensor], numel: int) -> "Layout":
        fields, off = [], 0
        for name, v in states.items():
            size = v.dtype.itemsize
            off = (off + size - 1) // size * size  # each view starts on its element size
            fields.append((name, v.dtype, off))
            off += numel * size
        return Layout(tuple(fields), numel, off)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(f[0] for f in self.fields)

    def view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        return self.views(buf)[name]

    def views(self, buf: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The states as views of ``buf`` (uint8, ``nbytes``): changing a view changes the buffer."""
        return {n: buf[off:off + self.numel * dtype.itemsize].view(dtype) for n, dtype, off in self.fields}

    def holds(self, buf: torch.Tensor, states: Dict[str, torch.Tensor]) -> bool:
        """Whether ``states`` are exactly this layout's views of ``buf`` (an in-place step left them)."""
        if tuple(states) != self.names:
            return False
        base = buf.data_ptr()
        return all(v.dtype == dtype and v.numel() == self.numel and v.is_contiguous() and v.data_ptr() == base + off
                   for (_, dtype, off), v in zip(self.fields, states.values()))


class PackedField:
    """One state of a packed unit, readable on its own (``zinf_compile.save`` reads state by state).

    The states of one ``PackedState.fields()`` call share a single read of the file: the first
    ``get_async`` starts it, the others get views of the same buffer, and the buffer is let go once
    each field has been started (so a checkpoint holds one unit's bytes per field in flight)."""

    def __init__(self, shared: dict, name: str) -> None:
        self._shared, self.name = shared, name

    def get_async(self) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        sh = self._shared
        if "buf" not in sh:
            sh["buf"], sh["handle"] = sh["slot"].get_async()
        buf, handle = sh["buf"], sh["handle"]
        sh["left"] -= 1
        if sh["left"] == 0:  # every field has its view: the buffer lives as long as they do
            del sh["buf"]
        return sh["layout"].view(buf, self.name), handle


class PackedState:
    """The per-element optimizer states of one unit whose optimizer tier is NVMe (see the module
    docstring). Owns one slot (``u<uid>.optim``, raw bytes) and its layout."""

    def __init__(self, unit: "ParamHandle") -> None:
        self._unit = unit
        self.slot: Optional[tiers.Slot] = None
        self.layout: Optional[Layout] = None

    @property
    def key(self) -> str:
        return f"u{self._unit.uid}.optim"

    @property
    def present(self) -> bool:
        return self.slot is not None and self.slot.present

    @property
    def names(self) -> Tuple[str, ...]:
        return self.layout.names if self.present else ()  # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes if self.present else 0  # type: ignore[union-attr]

    def new_slot(self, layout: Layout, key: str, ctx: object = None) -> tiers.Slot:
        """An empty slot for ``layout``'s bytes under ``key`` (on the unit's swap engine; ``ctx``: the
        context it writes through, default the unit's)."""
        u = self._unit
        pl = u.placement
        tier = "nvme" if layout.nbytes else "cpu"  # an empty shard (partition="broadcast"): no file
        swap = u.context.engine(pl.swap, u.rank) if tier == "nvme" else None
        return tiers.Slot(tier, "optim", layout.nbytes, torch.uint8, torch.device("cpu"), swap, key,
                          u.grad_slot.pin, ctx or u.context)  # type: ignore[arg-type]

    def read_async(self, pool: tiers.BufferPool) -> Tuple[torch.Tensor, Optional[SwapHandle]]:
        """Start reading the packed bytes into a pool buffer (the caller gives it back)."""
        assert self.slot is not None and self.layout is not None
        return self.slot.get_async(out=pool.acquire(self.layout.nbytes, torch.uint8))

    def views(self, buf: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {} if buf is None else self.layout.views(buf)  # type: ignore[union-attr]

    def pack(self, states: Dict[str, torch.Tensor], pool: tiers.BufferPool,
             buf: Optional[torch.Tensor] = None) -> Tuple[Layout, torch.Tensor]:
        """``states`` as ``(layout, packed buffer)``. When they are the current layout's views of
        ``buf`` (torch stepped them in place) that is ``buf`` itself, with no copy; else a pool
        buffer they are copied into (``buf``, if given, goes back to the pool)."""
        if buf is not None and self.layout is not None and self.layout.holds(buf, states):
            return self.layout, buf
        layout = Layout.of(states, self._unit.shard_numel)
        out = pool.acquire(layout.nbytes, torch.uint8)
        for name, view in layout.views(out).items():
            view.copy_(states[name].detach().reshape(-1))
        if buf is not None:
            pool.release(buf)
        return layout, out

    def store(self, states: Dict[str, torch.Tensor], pool: tiers.BufferPool,
              buf: Optional[torch.Tensor] = None) -> None:
        """Write ``states`` (per-element tensors) as the unit's new packed state; the buffer goes back
        to the pool once written. ``buf``: the buffer they were read into and stepped in (see ``pack``)."""
        if not states:
            if buf is not None:
                pool.release(buf)
            self.drop()
            return
        layout, data = self.pack(states, pool, buf)
        if self.slot is None or self.slot.numel != layout.nbytes:
            self.drop()
            self.slot = self.new_slot(layout, self.key)
        self.layout = layout
        self.slot.set(data, donate=True, recycle=True)

    def adopt(self, slot: tiers.Slot, layout: Layout) -> None:
        """Make ``slot`` (a speculative step's shadow, already written) the unit's packed state; the
        old slot keeps its file for the next shadow to overwrite (``optim_overlap._other_key``)."""
        old, self.slot, self.layout = self.slot, slot, layout
        if old is not None:
            old.drop(keep_file=True)

    def get(self) -> Dict[str, torch.Tensor]:
        """The states as fresh tensors (views of one buffer read from disk)."""
        if not self.present:
            return {}
        buf = self.slot.get()  # type: ignore[union-attr]
        return self.layout.views(buf)  # type: ignore[union-attr]

    def fields(self) -> Dict[str, PackedField]:
        """Each state as a ``PackedField`` (one shared read; see there)."""
        if not self.present:
            return {}
        names = self.layout.names  # type: ignore[union-attr]
        shared = {"slot": self.slot, "layout": self.layout, "left": len(names)}
        return {n: PackedField(shared, n) for n in names}

    def flush(self) -> None:
        if self.slot is not None:
            self.slot.flush()

    def drop(self, keep_file: bool = False) -> None:
        if self.slot is not None:
            self.slot.drop(keep_file=keep_file)
        self.slot, self.layout = None, None


def reader(v: object) -> Callable[[], Tuple[torch.Tensor, Optional[SwapHandle]]]:
    """``get_async`` of a slot or a packed field; a tensor as it is."""
    if isinstance(v, (tiers.Slot, PackedField)):
        return v.get_async
    return lambda: (v, None)  # type: ignore[return-value]
