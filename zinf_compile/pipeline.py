"""The pass runner and the record of every graph each pass produced.

A pass is a plain function ``x_pass(gm, example_inputs, *, ctx) -> GraphModule``; settings are bound
with ``functools.partial``. ``run_passes`` names, logs, times, can disable (``Config.disabled_passes``)
and snapshots each pass, and writes before/after code into ``dump_dir``. The snapshots of one compiled
Dynamo graph form a ``CompileRecord``; ``last_graphs()`` returns the latest one's.

Every snapshot keeps its op counts and zinf tags. Its generated code is kept for the last graph of each
stage, and for every pass only where someone reads it (``dump_dir``, ``TORCH_TRACE``, or the option
``pass_code=True``)::

    before: pass -> lint -> recompile -> snapshot(code)     (one Python codegen + exec per pass)
    after:  pass -> lint -> snapshot(counts, tags)         ... -> recompile once -> the stage's code

Why: no pass runs the module it is given, so the per-pass recompile served the snapshot alone, and
FX's code generation is slow on large graphs. On the 25M GPT (dp 1, no offload) the first step went
from 6.3-6.4 s to 5.5-5.75 s with the eager compiler (27 recompiles, 0.9 s, down to 10, 0.3 s) and
from 46-48 s to 43-44.6 s with Inductor (A/B runs alternating).

The bounded history below is introspection only (like ``torch._dynamo.utils.counters``): no compile
or run ever reads it back.

Observability: the ``zinf_compile`` and ``zinf_runtime`` loggers are registered with torch's logging
under the alias ``zinf`` (``torch._logging.set_logs(modules={"zinf": logging.DEBUG})``). From the
environment ``TORCH_LOGS="+zinf_compile"`` always works; ``TORCH_LOGS="+zinf"`` needs the alias
registered before ``import torch`` parses the variable (a ``torch.backends`` entry point), which torch
2.13 does and 2.11 does not (it parses ``TORCH_LOGS`` first and rejects ``+zinf`` at import). Each pass's
time is logged at DEBUG, a per-stage summary at INFO::

    V... pipeline.py:...] [0/0] zinf: forward pass insert_release took 0.5 ms
    I... pipeline.py:...] [0/0] zinf: graph 0 GraphModule forward: 2 passes in 0.6 ms, ops +14 zinf.release.default

Each snapshot is also a torch structured-trace artifact named ``zinf_<id>_<NN>_<stage>_<pass>``
(its code, with op counts and zinf tags as a header), so ``TORCH_TRACE=dir`` + ``tlparse`` shows them.
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

from . import _torch_compat
from .config import Config
from .passes._graph import op_counts

log = logging.getLogger("zinf_compile")


def register_torch_logs() -> bool:
    """Let torch's logging control zinf's loggers under the alias ``zinf`` (idempotent).

    Private torch API (``torch._logging._internal.register_log``; torch 2.13 has no public one): kept
    to this one function. Returns False if this torch lacks it (logging then works as plain
    ``logging``).
    """
    try:
        from torch._logging._internal import log_registry, register_log
    except ImportError:  # pragma: no cover - torch moved it
        return False
    if not log_registry.is_log("zinf"):
        register_log("zinf", ["zinf_compile", "zinf_runtime"])
    return True


register_torch_logs()


def _trace_snapshot(rec: "CompileRecord", idx: int, snap: "GraphSnapshot") -> None:
    """Emit one snapshot as a structured-trace artifact (a no-op unless ``TORCH_TRACE`` is set)."""
    name = f"zinf_{rec.id:03d}_{idx:02d}_{snap.stage}_{snap.pass_name}"

    def payload() -> str:
        head = [f"# zinf graph {rec.name} (id {rec.id}, {snap.stage}) after pass {snap.pass_name!r} "
                f"({snap.seconds * 1e3:.1f} ms)", f"# op counts: {json.dumps(snap.op_counts)}"]
        head += [f"# zinf node: {json.dumps(z, default=str)}" for z in snap.zinf_nodes]
        return "\n".join(head) + "\n" + snap.code

    try:
        torch._logging.trace_structured(
            "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload)
    except Exception as exc:  # tracing must never break a compile
        log.debug("zinf: structured trace of %s failed: %s", name, exc)


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
    # a parameter tiled by an earlier compile: (uid, shard_numel, shape) of each tile, along tile_dim
    parts: Tuple[Tuple[int, int, Tuple[int, ...]], ...] = ()
    tile_dim: int = 0
    tier: str = "device"  # where the fetched copy lives: "device", "cpu" or "nvme" (NVMe adds a read)
    optim_tier: str = "device"  # where its fp32 gradient shard accumulates (the optimizer's tier)


@dataclass
class GraphSnapshot:
    """One graph after one pass."""

    stage: str  # "dynamo" | "joint" | "forward" | "backward" | "inference"
    pass_name: str
    code: Optional[str]  # None for a graph before a stage's last unless pass code is kept (see above)
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
        root = dump_root(self.config)
        return None if root is None else os.path.join(root, f"graph_{self.id:03d}_{self.name}")


def dump_root(cfg: Config) -> Optional[str]:
    """Where this process writes ``dump_dir``'s files: ``dump_dir`` itself, or ``dump_dir/rank<R>``
    (global rank) when ``torch.distributed`` runs several processes. Why: every rank compiles the same
    graphs under the same names, so one shared folder had two processes rewriting one ``index.json``,
    and a rank that read it half-written failed its compile (JSONDecodeError) and fell back alone,
    which its peers then refused as a different graph."""
    if not cfg.dump_dir:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return os.path.join(str(cfg.dump_dir), f"rank{dist.get_rank()}")
    return str(cfg.dump_dir)


@dataclass
class CompileContext:
    """What the passes of one compile share: options, the partitioned inputs, the record."""

    cfg: Config
    params: Dict[int, ParamInfo]
    record: CompileRecord
    device_type: str = "cpu"
    # graph inputs a pass added (the tiles of tiled weights), passed after the Dynamo inputs, and
    # for each (index of the weight among the Dynamo inputs, uid of the tile it was compiled for)
    extra_inputs: List[Any] = field(default_factory=list)
    extra_specs: List[Tuple[int, int]] = field(default_factory=list)


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


def keeps_pass_code(cfg: Config) -> bool:
    """Whether every pass's graph keeps its code: someone reads it (files, a structured trace, or asked)."""
    return bool(cfg.pass_code or cfg.dump_dir or _torch_compat.structured_trace_enabled())


def snapshot(ctx: CompileContext, stage: str, pass_name: str, gm: torch.fx.GraphModule, seconds: float,
             *, code: bool = True) -> None:
    """Record ``gm`` after ``pass_name``; with ``code``, its generated code too (files and trace)."""
    rec = ctx.record
    snap = GraphSnapshot(stage, pass_name, gm.code if code else None, op_counts(gm.graph), seconds,
                         _zinf_nodes(gm))
    rec.snapshots.append(snap)
    if code:
        _emit(ctx, len(rec.snapshots) - 1)


def _emit(ctx: CompileContext, idx: int) -> None:
    """Write snapshot ``idx`` of the record (one that has its code) to the structured trace and ``dump_dir``."""
    rec = ctx.record
    snap = rec.snapshots[idx]
    stage, pass_name, seconds = snap.stage, snap.pass_name, snap.seconds
    _trace_snapshot(rec, idx, snap)
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
        f.write(snap.code or "")
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
    """Run ``passes`` in order on ``gm``, recording the input graph and each pass's output.

    ``gm`` is recompiled once, after the last pass (each pass edits ``gm.graph`` and none calls the
    module); the last snapshot then takes that code unless every snapshot already has its own.
    """
    every = keeps_pass_code(ctx.cfg)
    snapshot(ctx, stage, "input", gm, 0.0, code=every)
    first = len(ctx.record.snapshots) - 1
    for name, fn in passes:
        if name in ctx.cfg.disabled_passes:
            log.info("zinf: pass %s disabled (%s)", name, stage)
            continue
        t0 = time.perf_counter()
        gm = fn(gm, example_inputs, ctx=ctx)
        gm.graph.lint()
        if every:
            gm.recompile()
        dt = time.perf_counter() - t0
        log.debug("zinf: %s pass %s took %.1f ms", stage, name, dt * 1e3)
        snapshot(ctx, stage, name, gm, dt, code=every)
    if not every:
        t0 = time.perf_counter()
        gm.recompile()
        last = ctx.record.snapshots[-1]
        last.code = gm.code
        log.debug("zinf: %s recompile took %.1f ms", stage, (time.perf_counter() - t0) * 1e3)
    ctx.record.final_modules[stage] = gm
    if log.isEnabledFor(logging.INFO):
        log.info("zinf: %s", _stage_summary(ctx.record, stage, first))
    return gm


def _stage_summary(rec: CompileRecord, stage: str, first: int) -> str:
    """``graph 0 GraphModule forward: 2 passes in 0.6 ms, ops +14 zinf.release.default``."""
    snaps = rec.snapshots[first:]
    before, after = snaps[0].op_counts, snaps[-1].op_counts
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after))}
    ops = ", ".join(f"{v:+d} {k}" for k, v in delta.items() if v) or "no op-count change"
    ms = sum(s.seconds for s in snaps) * 1e3
    return f"graph {rec.id} {rec.name} {stage}: {len(snaps) - 1} passes in {ms:.1f} ms, ops {ops}"
