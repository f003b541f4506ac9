"""The pass runner and the record of every graph each pass produced.

A pass is a plain function ``x_pass(gm, example_inputs, *, ctx) -> GraphModule``; settings are bound
with ``functools.partial``. ``run_passes`` names, logs, times, can disable (``Config.disabled_passes``)
and snapshots each pass, and writes before/after code into ``dump_dir``. The snapshots of one compiled
Dynamo graph form a ``CompileRecord``; ``last_graphs()`` returns the latest one's.

The bounded history below is introspection only (like ``torch._dynamo.utils.counters``): no compile
or run ever reads it back.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from .config import Config
from .passes._graph import op_counts

log = logging.getLogger("zinf_compile")

Pass = Callable[..., torch.fx.GraphModule]


@dataclass(frozen=True)
class ParamInfo:
    """A partitioned parameter as one graph input sees it."""

    index: int  # position among the graph's inputs
    uid: int
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    shard_numel: int
    requires_grad: bool
    world: int = 1  # dp size of its group: at 1 the shard is the whole parameter, no all-gather


@dataclass
class GraphSnapshot:
    """One graph after one pass."""

    stage: str  # "dynamo" | "joint" | "forward" | "backward" | "inference"
    pass_name: str
    code: str
    op_counts: Dict[str, int]
    seconds: float
    zinf_nodes: List[Dict[str, Any]]

    def count(self, op_name: str) -> int:
        """Nodes whose target name contains ``op_name`` (e.g. ``"zinf.release"``)."""
        return sum(v for k, v in self.op_counts.items() if op_name in k)


@dataclass
class CompileRecord:
    """Everything one compile of one Dynamo graph produced."""

    id: int
    name: str
    config: Config
    snapshots: List[GraphSnapshot] = field(default_factory=list)
    counters: collections.Counter = field(default_factory=collections.Counter)
    warnings: List[str] = field(default_factory=list)
    # the last GraphModule of each stage, as handed to the code generator (for memory plans)
    final_modules: Dict[str, torch.fx.GraphModule] = field(default_factory=dict)

    def graphs(self, stage: Optional[str] = None) -> List[GraphSnapshot]:
        return [s for s in self.snapshots if stage is None or s.stage == stage]

    def final(self, stage: str) -> Optional[GraphSnapshot]:
        g = self.graphs(stage)
        return g[-1] if g else None

    def dump_folder(self) -> Optional[str]:
        if not self.config.dump_dir:
            return None
        return os.path.join(str(self.config.dump_dir), f"graph_{self.id:03d}_{self.name}")


@dataclass
class CompileContext:
    """What the passes of one compile share: options, the partitioned inputs, the record."""

    cfg: Config
    params: Dict[int, ParamInfo]
    record: CompileRecord
    device_type: str = "cpu"


_ids = itertools.count()
_history: Deque[CompileRecord] = collections.deque(maxlen=64)


def new_record(name: str, cfg: Config) -> CompileRecord:
    rec = CompileRecord(id=next(_ids), name=name, config=cfg)
    _history.append(rec)
    return rec


def last_graphs(all_graphs: bool = False) -> List[GraphSnapshot]:
    """Every graph of the last compile after each pass (``all_graphs``: of every recent compile)."""
    if not _history:
        return []
    if all_graphs:
        return [s for r in _history for s in r.snapshots]
    return list(_history[-1].snapshots)


def compile_records() -> List[CompileRecord]:
    """Recent compile records, oldest first (bounded history)."""
    return list(_history)


def _zinf_nodes(gm: torch.fx.GraphModule) -> List[Dict[str, Any]]:
    return [{"node": n.name, **n.meta["zinf"]} for n in gm.graph.nodes if "zinf" in n.meta]


def snapshot(ctx: CompileContext, stage: str, pass_name: str, gm: torch.fx.GraphModule, seconds: float) -> None:
    rec = ctx.record
    snap = GraphSnapshot(stage, pass_name, gm.code, op_counts(gm.graph), seconds, _zinf_nodes(gm))
    idx = len(rec.snapshots)
    rec.snapshots.append(snap)
    folder = rec.dump_folder()
    if folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    fname = f"{idx:02d}_{stage}_{pass_name}.py"
    with open(os.path.join(folder, fname), "w") as f:
        f.write(f"# zinf graph {rec.name} ({stage}) after pass {pass_name!r} ({seconds * 1e3:.1f} ms)\n")
        f.write(f"# op counts: {json.dumps(snap.op_counts)}\n")
        for z in snap.zinf_nodes:
            f.write(f"# zinf node: {json.dumps(z, default=str)}\n")
        f.write(gm.code)
    index_path = os.path.join(folder, "index.json")
    entries = []
    if os.path.exists(index_path):
        with open(index_path) as f:
            entries = json.load(f)["graphs"]
    entries.append({"index": idx, "stage": stage, "pass": pass_name, "file": fname,
                    "seconds": seconds, "op_counts": snap.op_counts, "zinf_nodes": snap.zinf_nodes})
    with open(index_path, "w") as f:
        json.dump({"graph": rec.name, "id": rec.id, "graphs": entries,
                   "counters": dict(rec.counters), "warnings": rec.warnings}, f, indent=1, default=str)


def run_passes(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    passes: Sequence[Tuple[str, Pass]],
    *,
    ctx: CompileContext,
    stage: str,
) -> torch.fx.GraphModule:
    """Run ``passes`` in order on ``gm``, recording the input graph and each pass's output."""
    snapshot(ctx, stage, "input", gm, 0.0)
    for name, fn in passes:
        if name in ctx.cfg.disabled_passes:
            log.info("zinf: pass %s disabled (%s)", name, stage)
            continue
        t0 = time.perf_counter()
        gm = fn(gm, example_inputs, ctx=ctx)
        gm.graph.lint()
        gm.recompile()
        dt = time.perf_counter() - t0
        log.debug("zinf: %s pass %s took %.1f ms", stage, name, dt * 1e3)
        snapshot(ctx, stage, name, gm, dt)
    ctx.record.final_modules[stage] = gm
    return gm
