"""Prefetch across the forward -> backward boundary: the NVMe reads the backward's schedule wants
before its first operator start while the forward ends, not at the backward's top.

Why: the lookahead schedule counts operators inside one graph, so the first parameters a graph uses
(the last layers', in backward) are read at its top, with nothing to hide the reads behind. Between
the forward's end and the backward's start run the loss and autograd's setup, and the reads can run
there::

    before:  forward: ... outputs                    | backward: t = zinf.load(p9) ... (waits on the disk)
    after:   forward: ... zinf.carry(tk, outputs, key) | backward: t = zinf.load(p9)  (adopts the read)

``zinf.carry`` starts the reads of the parameters the backward compiled for graph ``key`` registered
as its heads (``Carry.heads``: the backend registers them once the backward's schedule is planned;
the compiler's passes only add the op). ``zinf.load`` adopts a carried read of its parameter instead
of starting one. Safe by construction: a carried read is used only if the slot it read was not
written since it started (``Slot.version``; an optimizer step in between makes it stale, and it is
dropped and read again), and unused reads are waited for and their buffers returned at the next
``carry`` of the same graph, at the graph's next forward, or when a graph raises. The state lives in
the model's transfer engine (one per runtime context), never in module globals.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import store


class Carry:
    """The carried reads of one transfer engine, and the head parameters of each graph's backward."""

    def __init__(self) -> None:
        self.heads: Dict[int, List[int]] = {}  # graph key -> uids of its backward's first NVMe reads
        self._reads: Dict[int, Dict[int, Tuple[Any, int, torch.Tensor, Any, Any]]] = {}
        self.counters: Dict[str, int] = {"carried": 0, "adopted": 0, "stale": 0, "dropped": 0}

    def start(self, key: int) -> None:
        """The forward of graph ``key`` ends: start the reads its backward begins with."""
        self.drop(key)
        reads = {}
        for uid in self.heads.get(key, ()):
            h = store._handles.get(uid)
            if h is None or h.tiles is not None:
                continue
            slot = h.param_copy or h._whole()
            if slot.tier != "nvme" or h.uid in reads:
                continue
            host, read = h.load_host()
            if read is not None:
                reads[h.uid] = (slot, slot.version, host, read, h.context.pool)
                self.counters["carried"] += 1
        if reads:
            self._reads[key] = reads

    def take(self, h: Any) -> Optional[Tuple[torch.Tensor, Any]]:
        """A carried read of ``h``'s shard, if one is in flight and still current (else None)."""
        for reads in self._reads.values():
            entry = reads.pop(h.uid, None)
            if entry is None:
                continue
            slot, version, host, read, pool = entry
            if (h.param_copy or h._whole()) is slot and slot.version == version:
                self.counters["adopted"] += 1
                return host, read
            self.counters["stale"] += 1
            _finish(read, host, pool)
            return None
        return None

    def drop(self, key: Optional[int] = None) -> None:
        """Wait for and discard the carried reads of graph ``key`` (all graphs: None)."""
        keys = list(self._reads) if key is None else [key]
        for k in keys:
            for _, _, host, read, pool in self._reads.pop(k, {}).values():
                self.counters["dropped"] += 1
                _finish(read, host, pool)

    @property
    def in_flight(self) -> int:
        return sum(len(r) for r in self._reads.values())


def _finish(read: Any, host: torch.Tensor, pool: Any) -> None:
    try:
        read.wait()
    except Exception:  # noqa: BLE001 - a discarded read's error is not the caller's; the real read reports it
        pass
    pool.release(host)


def carry_of(engine: Any) -> Carry:
    """The engine's ``Carry`` (made on first use)."""
    c = engine.__dict__.get("_carry")
    if c is None:
        c = engine.__dict__["_carry"] = Carry()
    return c


def op_carry_ticket(key: int) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


def op_carry(ticket: torch.Tensor, after: List[torch.Tensor], key: int, uids: List[int]) -> None:
    """End of a forward graph: start the carried reads of its backward (engines of ``uids``)."""
    engines = []
    for uid in uids:
        h = store._handles.get(uid)
        if h is not None and h.context.transfers not in engines:
            engines.append(h.context.transfers)
    for eng in engines:
        carry_of(eng).start(key)
