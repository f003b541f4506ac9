"""A Chrome/Perfetto trace of one training step: compute, every transfer link, the optimizer.

``options={"trace": "step.json"}`` gives the model's transfer engine a :class:`Tracer`. The ops
record spans (a transfer from its start to its completion, seen at its wait; a graph run; an
optimizer step; the time the main thread blocked in a wait), one lane each::

    compute | wait | nvme_read | nvme_write | h2d | d2h | all_gather | reduce_scatter | optimizer

Why one step, by default the second: the first includes compilation, and a whole run's trace is too
large to open. Steps end at each optimizer step; the trace of step ``record_step`` (option
``trace_step``, default 1, counted from 0) is written as soon as it ends, or at exit with whatever
was recorded if training stopped earlier. Open it in ``chrome://tracing`` or https://ui.perfetto.dev: the overlap shows as transfer
spans running under compute spans.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any, Dict, List

LANES = ("compute", "wait", "nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter",
         "optimizer")


class Tracer:
    def __init__(self, path: str, rank: int = 0, record_step: int = 1) -> None:
        self.path = str(path)
        if rank:
            root, ext = os.path.splitext(self.path)
            self.path = f"{root}.rank{rank}{ext or '.json'}"
        self.rank = rank
        self.record_step = record_step
        self.step = 0
        self.written = False
        self._events: List[Dict[str, Any]] = []
        self._previous: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._origin = time.perf_counter()
        atexit.register(self.flush)

    def span(self, lane: str, name: str, t0: float, t1: float, **args: Any) -> None:
        if self.written:
            return
        tid = LANES.index(lane) if lane in LANES else len(LANES)
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid, "ts": (t0 - self._origin) * 1e6,
              "dur": max(t1 - t0, 0.0) * 1e6, "cat": lane}
        if args:
            ev["args"] = args
        with self._lock:
            self._events.append(ev)

    def step_done(self) -> None:
        """An optimizer step ended: write the trace if this was the step to record."""
        if self.written:
            return
        if self.step >= self.record_step:
            self._write(self._events)
        else:
            with self._lock:
                self._previous, self._events = self._events, []
        self.step += 1

    def flush(self) -> None:
        """At exit: write what there is, if the recorded step was never reached."""
        if not self.written and (self._events or self._previous):
            self._write(self._events or self._previous)

    def _write(self, events: List[Dict[str, Any]]) -> None:
        self.written = True
        meta = [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": i, "args": {"name": lane}}
                for i, lane in enumerate(LANES)]
        meta.append({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}})
        if events:
            t0 = min(e["ts"] for e in events)
            events = [dict(e, ts=e["ts"] - t0) for e in events]
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms",
                       "otherData": {"step": self.step, "source": "zinf_compile"}}, f)
        os.replace(tmp, self.path)
