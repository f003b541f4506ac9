"""Prefetch across graph boundaries: the NVMe reads a graph stage's schedule wants before its first
operator start while the stage before it ends, not at its own top.

Why: the lookahead schedule counts operators inside one graph, so the first parameters a graph uses
are read at its top, with nothing to hide the reads behind. Two boundaries have work between them
that the reads can run under: the forward's end and the backward's start (the loss, autograd's
setup), and, after a graph break, one graph's end and the next one's start (the eager code between,
in forward and in backward)::

    before:  graph A fwd: ... outputs                     | graph B fwd: t = zinf.load(p5) (waits on the disk)
    after:   graph A fwd: ... zinf.carry(tk, outputs, A, "forward") | graph B fwd: t = zinf.load(p5) (adopts)

``zinf.carry`` at the end of stage ``(A, "forward")`` starts the reads of the stage that ended after
it last time (``Carry.next``, learned as the stages end: ``A fwd -> B fwd -> B bwd -> A bwd``); before
anything is learned, a forward's own backward. The heads of each stage are registered by the
backend once its schedule is planned (the compiler's passes only add the op). Never from a backward
into a forward: an optimizer step usually runs between them and would make every read stale.
``zinf.load`` adopts a carried read of its parameter instead of starting one. Safe by construction:
a carried read is used only if the slot it read was not written since it started (``Slot.version``;
an optimizer step in between makes it stale, and it is dropped and read again); a wrong guess of
the next stage costs reads, never numbers. Unused reads are waited for and their buffers returned at
the same stage's next end, at the carrying graph's next forward, or when a graph raises. The state
lives in the model's transfer engine (one per runtime context), never in module globals.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import store


Stage = Tuple[int, str]  # (graph key, "forward" | "backward" | "inference")


class Carry:
    """The carried reads of one transfer engine, the head parameters of each compiled graph stage,
    and the order the stages ran in last time (which stage follows which)."""

    def __init__(self) -> None:
        self.heads: Dict[Stage, List[int]] = {}  # stage -> uids of its first NVMe reads, in use order
        self.next: Dict[Stage, Stage] = {}  # stage -> the stage that ended after it last time
        self._last: Optional[Stage] = None
        self._reads: Dict[Stage, Dict[int, Tuple[Any, int, torch.Tensor, Any]]] = {}
        self.counters: Dict[str, int] = {"carried": 0, "adopted": 0, "stale": 0, "dropped": 0,
                                         "across_graphs": 0}

    def target(self, here: Stage) -> Optional[Stage]:
        """The stage whose reads ``here``'s end starts: the one that followed it last time (a
        forward's own backward before anything is known). Never from a backward into a forward or
        an inference: an optimizer step usually runs between them and would make every read stale."""
        nxt = self.next.get(here)
        if nxt is None and here[1] == "forward":
            nxt = (here[0], "backward")
        if nxt is None or (here[1] == "backward" and nxt[1] != "backward"):
            return None
        return nxt

    def end(self, key: int, stage: str) -> None:
        """Stage ``(key, stage)`` ends: learn that it followed the last stage to end, and start the
        reads of the stage expected next."""
        here = (key, stage)
        if self._last is not None:
            self.next[self._last] = here
        self._last = here
        self._drop_stage(here)  # this stage's reads of last time that nobody adopted
        nxt = self.target(here)
        if nxt is None:
            return
        busy = {uid for r in self._reads.values() for uid in r}
        reads = {}
        for uid in self.heads.get(nxt, ()):
            h = store._handles.get(uid)
            if h is None or h.tiles is not None or uid in busy or uid in reads:
                continue
            slot = h.param_copy or h._whole()
            if slot.tier != "nvme":
                continue
            host, read = h.load_host()
            if read is None:  # in the read cache already: nothing to carry
                h.keep_read(host)
                continue
            reads[uid] = (slot, slot.version, host, read)
            self.counters["carried"] += 1
            self.counters["across_graphs"] += nxt[0] != key
        if reads:
            self._reads[here] = reads

    def take(self, h: Any) -> Optional[Tuple[torch.Tensor, Any]]:
        """A carried read of ``h``'s shard, if one is in flight and still current (else None)."""
        for reads in self._reads.values():
            entry = reads.pop(h.uid, None)
            if entry is None:
                continue
            slot, version, host, read = entry
            if (h.param_copy or h._whole()) is slot and slot.version == version:
                self.counters["adopted"] += 1
                return host, read
            self.counters["stale"] += 1
            _finish(slot, read, host)
            return None
        return None

    def drop(self, key: Optional[int] = None) -> None:
        """Wait for and discard the reads the stages of graph ``key`` carried (all graphs: None)."""
        for here in [s for s in self._reads if key is None or s[0] == key]:
            self._drop_stage(here)

    def _drop_stage(self, here: Stage) -> None:
        for slot, _, host, read in self._reads.pop(here, {}).values():
            self.counters["dropped"] += 1
            _finish(slot, read, host)

    @property
    def in_flight(self) -> int:
        return sum(len(r) for r in self._reads.values())


def _finish(slot: Any, read: Any, host: torch.Tensor) -> None:
    """A carried read nobody takes: its buffer goes to the read cache (if the slot did not change
    since and the read succeeded) or to the pool (``Slot.keep_read``)."""
    try:
        read.wait()
    except Exception:  # noqa: BLE001 - a discarded read's error is not the caller's; the real read reports it
        slot.pool.release(host)
        return
    slot.keep_read(host)


def carry_of(engine: Any) -> Carry:
    """The engine's ``Carry`` (made on first use)."""
    c = engine.__dict__.get("_carry")
    if c is None:
        c = engine.__dict__["_carry"] = Carry()
    return c


def op_carry_ticket(key: int) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64)


def op_carry(ticket: torch.Tensor, after: List[torch.Tensor], key: int, stage: str, uids: List[int]) -> None:
    """End of a graph stage: start the reads of the stage expected next (engines of ``uids``)."""
    engines = []
    for uid in uids:
        h = store._handles.get(uid)
        if h is not None and h.context.transfers not in engines:
            engines.append(h.context.transfers)
    for eng in engines:
        carry_of(eng).end(key, stage)
