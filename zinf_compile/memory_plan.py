"""Static memory plan of one zinf training step, read off the final compiled graphs.

``memory_plan(model, example_inputs, **options)`` compiles a private copy of ``model`` with the zinf
backend (``compiler="eager"`` unless given), runs one forward+backward on it to trigger the compile, and
walks the final forward and backward graphs (``CompileRecord.final_modules``) in execution order. Every
tensor gets a live interval on the schedule (forward nodes, then backward nodes)::

    device  activation   every tensor a node defines (views share their base's storage), from its
                         node to its last reader; graph inputs that are not parameters from the start;
                         tensors saved for backward until their backward graph returns (AOTAutograd
                         holds them that long; ``hold_saved=False``: to their last reader); outputs to the end
    device  gathered     a fetched / all-gathered full parameter, from fetch to its ``zinf.release``
    device  grad_buffer  a parameter's gradient, until ``zinf.reduce_grad`` consumed it (+ its copies there)
    device  comm         bucket:    a coalesced collective's flat buffers (``bucket_bytes``, dp > 1): the
                                    packed input and the output (on gloo, an all-gather's packed input
                                    is its exchange's send buffer, the shards once per rank, or at 2
                                    ranks a row of its output, and a reduce-scatter adds its exchange's
                                    receive buffer), from
                                    ``gather_bucket`` / ``reduce_bucket`` to its last member's wait (the
                                    runtime books them as ``comm`` too)
                         exchange:  on gloo a lone parameter's all-gather or reduce-scatter is an
                                    exchange (``zinf_runtime.comm.exchanges``): its send or receive
                                    buffer (``comm.exchange_numel``: none for an all-gather at 2 ranks),
                                    from the pool, from the start to the wait
    <tier>  param/grad/optim   the runtime's shards: fp32 masters (+ compute-dtype copies) for the whole
                         step, a gradient shard from its first reduce_grad on, optimizer state if asked

``<tier>``: fp32 masters, gradient shards and optimizer state live where ``offload_optimizer`` puts
them; a separate parameter copy (``param_copy``) lives where ``offload_params`` puts it when the two
tiers differ (``device``, ``cpu`` or ``nvme``), except that an fp32 parameter copy in CPU memory is
also the master of an optimizer on NVMe (``zinf_runtime.store.master_home``). On ``nvme`` a shard
is a file: its bytes count on the ``nvme`` tier (payload, as the runtime's accounting counts them;
``plan.nvme_file_bytes()`` adds the 4096-byte padding of each file, i.e. what the swap folder
holds), never on ``cpu``. What NVMe IO needs in host memory is the ``cpu`` tier's ``staging`` kind::

    cpu     staging      read_buffer:  the host buffer a fetch reads a shard into (+ its cast), from the
                                       read's start (a stage's first reads: from the previous stage's end,
                                       which carries them, ``zinf_runtime.carry``) to the fetch
                         read_cache:   a shard's buffer kept for its next read (``zinf_runtime.read_cache``):
                                       the optimizer's written masters until forward's fetch, a fetched
                                       shard until backward's fetch or the optimizer's master read, each
                                       to that read, its eviction past ``nvme_read_cache_bytes`` or the
                                       end of the step
                         write_buffer: the host copy of a gradient shard an asynchronous write sends, from
                                       its reduce_grad to the end of the step (the runtime also caps the
                                       bytes in flight, ZINF_NVME_WRITE_INFLIGHT, so for big models this
                                       is an upper bound)
                         kept:         a stepped parameter the last optimizer step kept in memory as its
                                       value (``nvme_param_write_back``), the whole step: the newest up to
                                       ``nvme_read_cache_bytes``, in the order the step set them (taken as
                                       the fetch order); its fetches read it there (no read buffer, no
                                       cached copy) and its file is not rewritten
    cpu     optim        scalar: Adam's ``step`` per parameter, kept in memory beside NVMe moments

Summing the intervals live at each step gives bytes per tier and kind
over the schedule; the predicted peak is its maximum. ``plan.table()`` prints (``zinf memplan gpt
--layers 2 --hidden 64 --seq 32 --batch 4 --vocab 128``)::

    zinf memory plan: graph 0 GraphModule; schedule = 217 forward, 271 backward nodes (FX order)

    tier    kind         at peak       own peak
    device  activation   1.45 MiB      1.57 MiB
    device  gathered     48.00 KiB     97.00 KiB
    device  grad_buffer  48.00 KiB     65.00 KiB
    device  param        429.00 KiB    429.00 KiB
    device  grad         340.50 KiB    429.00 KiB
    device  total        2.29 MiB      peak at step 463 (backward mm_22)

    live at the device peak, largest first:
        128.00 KiB  activation   saved         addmm                                forward:addmm -> end of backward
         96.00 KiB  activation   temp          cat_1                                backward:cat_1 -> backward:mm_22
         64.00 KiB  param        shard         blocks.0.fc.weight                   whole step
        ...

With ``dynamic=True`` (or ``dynamic={0: [0]}``: input 0's dim 0) sizes are sympy expressions in Dynamo's
size symbols, e.g. ``Max(45696*s33 + 138376, 64128*s33 + 86152)`` bytes; ``plan.symbols`` says which
input dimension each stands for (``{"s33": "input 0 dim 0"}``) and ``plan.evaluate(s33=8)`` gives the
concrete plan. ``plan.to_json()``; ``plan.plot("mem.png")``: device bytes per kind over the schedule
(matplotlib if installed, else a plain PNG: shards grey at the bottom, gathered orange, comm brown, grad_buffer
green, activation blue; red line = peak, black line = forward/backward boundary). With ``dump_dir`` the
plan is also written there as plan.json / plan.txt; ``zinf memplan`` is the command-line front end.

The figures model the graphs executed as plain FX code in graph order (``compiler="eager"``): on the
GPT model they match the CPU allocator's peak during a step to the byte, and the gathered peak and the
shard bytes of every tier match ``zinf_compile.memory_stats()`` exactly (benchmarks/memory_plan_accuracy.py).
With ``compiler="inductor"`` the plan reads the same graphs before Inductor lowers them: the zinf
figures (gathered, shards per tier) still matched the runtime's accounting exactly on the GPT model
(the zinf ops stay opaque fallback kernels), but Inductor fuses away intermediates and reuses
buffers, so the activation figures are an estimate: the step peak was an upper bound in every
measured configuration, 0.80-0.91x of the plan (tests/test_memory_plan.py checks the bound). With several
Dynamo graphs (graph breaks) the plan concatenates them and counts a tensor handed from one graph to
the next twice.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect as pyinspect
import itertools
import json
import operator
import os
import re
import struct
import sys
import types
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import sympy
import torch
import torch.fx

from zinf_runtime import comm, store
from zinf_runtime.tiers import flat_nbytes
from zinf_runtime.swap import ALIGN as SWAP_ALIGN

from .analytic import human_bytes
from .config import TIER_OF, Config
from .ops import (ALL_GATHER, CARRY, FETCH_SHARD, GATHER, GATHER_BUCKET, KEEP, REDUCE, REDUCE_BUCKET, REDUCE_GRAD, RELEASE, TICKET_OPS,
                  WAIT_GATHER, WAIT_REDUCE, WAIT_UPLOAD)
from .pipeline import CompileRecord, compile_records, dump_root

Bytes = Union[int, sympy.Expr]
TIERS = ("device", "cpu", "nvme")
KINDS = ("activation", "gathered", "grad_buffer", "comm", "param", "grad", "optim", "staging")
_OPTIM_BYTES = {None: (0, 0), "adam": (8, 4), "adamw": (8, 4), "sgd": (4, 0)}  # per element, per param
_MAYBE_ALIAS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
                torch.ops.aten.contiguous.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}

__all__ = ["MemoryPlan", "Interval", "Step", "memory_plan", "build_plan", "TIERS", "KINDS"]


@dataclass(frozen=True)
class Step:
    """One node of the schedule."""

    index: int
    graph: int  # CompileRecord.id
    stage: str  # "forward" | "backward" | "inference"
    node: str
    target: str


def _newest_within(items: Iterable[Tuple[Any, int]], cap: int) -> List[Any]:
    """What a write-back tracker (``tiers.DirtyTracker``) still holds after ``items`` (key, bytes)
    were deferred in this order: past ``cap`` the oldest are evicted (written)."""
    held: Dict[Any, int] = {}
    total = 0
    for key, nbytes in items:
        held[key] = nbytes
        total += nbytes
        while total > cap and held:
            total -= held.pop(next(iter(held)))
    return list(held)


def _deferred_grads(ivs: List["Interval"], cap: int) -> set:
    """The parameters whose NVMe gradient stays in host memory, never written (``tiers.DirtyTracker``):
    gradients are kept in the order they are reduced while their bytes fit under ``cap``; past it
    the oldest are written back. A kept gradient's write buffer lives to the end of the step, the
    optimizer step reads it from memory, and it has no file."""
    grads = sorted((iv for iv in ivs if iv.role == "write_buffer"), key=lambda iv: iv.start)
    if not all(isinstance(iv.nbytes, int) for iv in grads):
        return set()  # symbolic sizes: the upper bound, every gradient written
    kept = _newest_within(((i, iv.nbytes) for i, iv in enumerate(grads)), cap)
    return {grads[i].param for i in kept if grads[i].param is not None}


def _kept_params(reads: List[Tuple[Any, int, int, Any, str, Optional[str]]], stepped: set, cap: int,
                 masters: Dict[Any, Tuple[int, int, Optional[str]]]) -> Dict[Any, Tuple[int, Optional[str]]]:
    """The units whose stepped value the last optimizer step left in memory (write-back,
    ``ctx.kept``): the step sets each unit that gets a gradient (``stepped``) in turn, the oldest
    evicted (written) past ``cap``, so the newest that fit remain. The step's order is the optimizer's
    parameter order, taken here as the fetch order (a model's parameters are usually registered in
    the order forward uses them). A unit fetched from NVMe keeps the value its fetches read; one whose
    fp32 master lives on NVMe apart from its fetched copy (a bf16 model, or parameters on the device)
    keeps that master too: ``masters[unit] = (bytes, first fetch, param)``. ``{unit: (bytes, param)}``."""
    if not cap or not all(isinstance(r[3], int) for r in reads) or not all(
            isinstance(m[0], int) for m in masters.values()):
        return {}  # off, or symbolic sizes: the upper bound (every read and write counted)
    units: Dict[Any, List[Any]] = {}  # unit -> [first fetch, bytes, param]
    for unit, at, _, nbytes, _, param in sorted(reads, key=lambda r: r[1]):
        units.setdefault(unit, [at, nbytes, param])
    for unit, (nbytes, at, param) in masters.items():
        units.setdefault(unit, [at, 0, param])[1] += nbytes
    order = sorted((u for u, (_, _, param) in units.items() if param in stepped), key=lambda u: units[u][0])
    return {u: (units[u][1], units[u][2]) for u in _newest_within(((u, units[u][1]) for u in order), cap)}


def _cap_write_buffers(ivs: List["Interval"]) -> List["Interval"]:
    """NVMe write buffers as the runtime keeps them: once more than ``WRITE_INFLIGHT_CAP`` bytes of
    writes are in flight, the oldest is waited for (``tiers.WriteTracker``), so its host buffer ends
    where the write that pushed it out starts, not at the end of the step (which counted the whole
    fp32 gradient as host memory: a 4x over-prediction on a 2.2e9-parameter NVMe run)."""
    from zinf_runtime.tiers import WRITE_INFLIGHT_CAP

    writes = sorted((iv for iv in ivs if iv.role == "write_buffer"), key=lambda iv: iv.start)
    if not writes or not all(isinstance(iv.nbytes, int) for iv in writes):
        return ivs  # symbolic sizes: keep the upper bound
    ended: Dict[int, Tuple[int, str]] = {}
    queue: List[Interval] = []
    inflight = 0
    for iv in writes:
        queue.append(iv)
        inflight += iv.nbytes
        while inflight > WRITE_INFLIGHT_CAP and len(queue) > 1:
            old = queue.pop(0)
            inflight -= old.nbytes
            ended[id(old)] = (max(iv.start, old.start), iv.name)
    return [dataclasses.replace(iv, end=ended[id(iv)][0], end_node=ended[id(iv)][1]) if id(iv) in ended else iv
            for iv in ivs]


def _cached_reads(reads: List[Tuple[Any, int, int, Any, str, Optional[str]]], cap: int, end: int) -> List["Interval"]:
    """Host buffers the read cache holds (``zinf_runtime.read_cache``), as the runtime keeps them:
    ``reads`` are ``(unit, read start, fetch, bytes, name, param)``. The step starts with the values
    the previous step's optimizer wrote (write-through), counted here as the first-read units up to
    ``cap``; each is held until its unit's first read takes it (that read's own interval counts it
    from its start). A fetch's buffer is kept from the fetch on, oldest evicted past ``cap``, until
    the unit's next read takes it or the step ends (the optimizer's master read takes it: the end
    of the step, an upper bound)."""
    if not cap or not all(isinstance(r[3], int) for r in reads):
        return []
    held: Dict[Any, Tuple[int, int, str, Optional[str]]] = {}  # unit -> (bytes, kept from, name, param), oldest first
    total = 0
    for unit, _, _, nbytes, _, param in sorted(reads, key=lambda r: r[1]):
        if unit not in held and total + nbytes <= cap:
            held[unit] = (nbytes, 0, f"written:{param}", param)
            total += nbytes
    events = sorted([(r[1], 0, i) for i, r in enumerate(reads)] + [(r[2], 1, i) for i, r in enumerate(reads)])
    out: List[Interval] = []

    def close(unit: Any, last: int) -> None:
        nonlocal total
        nbytes, since, name, param = held.pop(unit)
        total -= nbytes
        if last >= since:
            out.append(Interval(name, "cpu", "staging", "read_cache", nbytes, since, last,
                                "evicted" if last < end else "end", (), param))

    for pos, put, i in events:
        unit, nbytes = reads[i][0], reads[i][3]
        if not put:
            if unit in held:  # taken by this read
                close(unit, pos - 1)
            continue
        if nbytes > cap or unit in held:
            continue
        held[unit] = (nbytes, pos + 1, reads[i][4], reads[i][5])
        total += nbytes
        while total > cap:
            close(next(iter(held)), pos)
    for unit in list(held):
        close(unit, end)
    return out


@dataclass(frozen=True)
class Interval:
    """Bytes live on ``tier`` from step ``start`` to step ``end`` (both included)."""

    name: str  # "<stage>:<node>" that allocates it
    tier: str
    kind: str
    role: str  # input | temp | saved | output | tangent | fetched_shard | reduce_copy | shard | compute_copy
    nbytes: Bytes
    start: int
    end: int
    end_node: str  # "<stage>:<node>" whose step frees it ("end" for the end of the step)
    aliases: Tuple[str, ...] = ()
    param: Optional[str] = None
    # NVMe shards: files holding it on disk in steady training (2: rewritten every step under
    # nvme_reuse_files, which keeps the previous version's file as the next write's spare)
    files: int = 1


def _expr(x: Any) -> Bytes:
    if isinstance(x, torch.SymInt):
        e = sympy.expand(x.node.expr)
        return int(e) if e.is_Integer else e
    return int(x)


def _is_sym(x: Bytes) -> bool:
    return isinstance(x, sympy.Basic) and not x.is_Integer


def _fmt(x: Bytes) -> str:
    return str(x) + " B" if _is_sym(x) else human_bytes(int(x))


def _target(n: torch.fx.Node) -> str:
    if n.target is operator.getitem:
        return "getitem"
    return str(n.target) if hasattr(n.target, "_schema") else getattr(n.target, "__name__", str(n.target))


def _alias_arg(n: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The input whose storage ``n``'s result shares, if any (views, in-place ops, view-likes)."""
    if n.op != "call_function":
        return None
    schema = getattr(n.target, "_schema", None)
    if n.target in _MAYBE_ALIAS:
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        a, b = n.meta.get("val"), src.meta.get("val") if src is not None else None
        if n.target is not torch.ops.aten._unsafe_view.default and isinstance(a, torch.Tensor) \
                and isinstance(b, torch.Tensor):
            try:  # reshape / contiguous / to copy or not: the fake values say which
                from torch.multiprocessing.reductions import StorageWeakRef

                if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
                    return None
            except Exception:
                pass
        return src
    if schema is None:
        return None
    sets = set()
    for r in schema.returns:
        if r.alias_info is not None:
            sets |= set(r.alias_info.before_set)
    if not sets:
        return None
    args = list(n.args) + [n.kwargs.get(a.name) for a in schema.arguments[len(n.args):]]
    for a, v in zip(schema.arguments, args):
        if a.alias_info is not None and sets & set(a.alias_info.before_set) and isinstance(v, torch.fx.Node):
            return v
    return None


@dataclass
class _Val:
    key: Tuple
    name: str
    start: int
    end: int
    end_node: str
    role: str
    nbytes: Bytes = 0
    parent: Optional[Tuple] = None
    node: Optional[torch.fx.Node] = None


class _Builder:
    """Walks the final graphs in schedule order and collects intervals."""

    def __init__(self, optimizer: Optional[str], hold_saved: bool = True):
        self.hold_saved = hold_saved
        self.reuse_files = False  # from the records' config (_runtime_nodes)
        self.dirty_cap = 0
        self.read_cache_cap = 0
        self.kept_cap = 0  # write-back of stepped NVMe parameters (ctx.kept): their cap
        self.masters: Dict[Any, Tuple[Any, int, Optional[str]]] = {}  # unit -> an NVMe master apart from its
        # fetched copy: (bytes, first fetch, param)
        self.reads: List[Tuple[Any, int, int, Any, str, Optional[str]]] = []  # NVMe fetches (_cached_reads)
        self.stage_last: Dict[Tuple[int, str], int] = {}
        if optimizer not in _OPTIM_BYTES:
            raise ValueError(f"memory_plan: optimizer {optimizer!r} unknown; choose one of {list(_OPTIM_BYTES)}")
        self.optim = _OPTIM_BYTES[optimizer]
        self.steps: List[Step] = []
        self.step_of: Dict[Tuple[int, str, str], int] = {}
        self.vals: Dict[Tuple, _Val] = {}
        self.extra: List[Interval] = []
        self.seen: set = set()
        self.symbols: Dict[str, str] = {}
        self.END = -1
        self._saved: Dict[Tuple[int, str], Tuple] = {}  # (record id, name) of forward outputs -> value key
        self._prev_stage: Optional[str] = None  # the stage added before this one (plan order)

    # -- one graph -----------------------------------------------------------------------------
    def add_graph(self, rec: CompileRecord, stage: str, gm: torch.fx.GraphModule, params: set, saved: set) -> None:
        nodes = list(gm.graph.nodes)
        first = len(self.steps)
        pos: Dict[torch.fx.Node, int] = {}
        for n in nodes:
            if n.op not in ("placeholder", "output"):
                pos[n] = len(self.steps)
                self.step_of[(rec.id, stage, n.name)] = pos[n]
                self.steps.append(Step(len(self.steps), rec.id, stage, n.name, _target(n)))
        self.stage_last[(rec.id, stage)] = len(self.steps) - 1
        outs: List[torch.fx.Node] = []
        for n in nodes:
            if n.op == "output":
                torch.fx.node.map_arg(n.args, outs.append)
        to_end = {a for a in outs if not (stage == "forward" and a.name in saved)}

        def last_use(n: torch.fx.Node) -> Tuple[int, str]:
            users = [u for u in n.users if u.op != "output" and u.target is not KEEP]  # keep: no use of memory
            if n in to_end:
                return self.END, "end"
            if not users:
                return pos.get(n, first), f"{stage}:{n.name}"
            u = max(users, key=pos.__getitem__)
            return pos[u], f"{stage}:{u.name}"

        def add(v: _Val) -> None:
            self.vals[v.key] = v
            if stage == "forward" and v.key[3] is None and v.name in saved:
                self._saved[(rec.id, v.name)] = v.key

        for n in nodes:
            val = n.meta.get("val")
            key = (rec.id, stage, n.name, None)
            if n.op == "placeholder":
                if not isinstance(val, torch.Tensor) or n.name in params:
                    continue
                end, end_node = last_use(n)
                parent = self._saved.get((rec.id, n.name)) if stage == "backward" else None
                if parent is not None:
                    add(_Val(key, n.name, first, end, end_node, "saved", parent=parent, node=n))
                else:
                    role = "tangent" if n.name.startswith("tangents") else "input"
                    add(_Val(key, n.name, first, end, end_node, role, self._bytes(val), node=n))
                continue
            if n.op not in ("call_function", "get_attr", "call_module") or n.target in TICKET_OPS or (
                    n.target is operator.getitem and getattr(n.args[0], "target", None) in TICKET_OPS):
                continue  # tickets are one-element CPU tensors, not memory worth planning
            end, end_node = last_use(n)
            if n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
                src = (rec.id, stage, n.args[0].name, n.args[1])
                if src in self.vals:
                    add(_Val(key, n.name, pos[n], end, end_node, "temp", parent=src, node=n))
                continue
            if isinstance(val, (tuple, list)):
                pkey = self._key_of(rec.id, stage, _alias_arg(n))
                for k, v in enumerate(val):
                    if isinstance(v, torch.Tensor):
                        nb = 0 if pkey else self._bytes(v)
                        add(_Val((rec.id, stage, n.name, k), f"{n.name}[{k}]", pos[n], end, end_node, "temp", nb,
                                 pkey, node=n))
                continue
            if not isinstance(val, torch.Tensor):
                continue
            parent = self._key_of(rec.id, stage, _alias_arg(n))
            role = "input" if n.op == "get_attr" else "temp"
            born = pos[n]
            if n.target in (WAIT_UPLOAD, WAIT_GATHER) and n.args[0] in pos:
                born = pos[n.args[0]]  # the runtime allocates the buffer when the transfer starts
            add(_Val(key, n.name, born, end, end_node, role, 0 if parent else self._gathered_bytes(n, val),
                     parent, node=n))
        # the previous stage's end starts this stage's first NVMe reads (zinf.carry), except from a
        # backward into a forward, so their buffers are live from that end on
        carried_from = first - 1 if first > 0 and any(n.target is CARRY for n in nodes) and not (
            self._prev_stage == "backward" and stage != "backward") else None
        self._runtime_nodes(rec, stage, nodes, pos, carried_from)
        self._prev_stage = stage

    def _key_of(self, rid: int, stage: str, n: Optional[torch.fx.Node]) -> Optional[Tuple]:
        if n is None:
            return None
        key = (rid, stage, n.name, None)
        return key if key in self.vals else None

    def _bytes(self, val: torch.Tensor) -> Bytes:
        self._note_symbols(val)
        try:
            return _expr(val.untyped_storage().nbytes())
        except Exception:  # no storage (e.g. a sparse or functional wrapper): count the elements
            return _expr(val.numel() * val.element_size())

    def _gathered_bytes(self, n: torch.fx.Node, val: torch.Tensor) -> Bytes:
        z = n.meta.get("zinf") or {}
        if n.target in (FETCH_SHARD, WAIT_UPLOAD):  # a shard read in place allocates nothing
            h = _handle(n.args[1] if n.target is FETCH_SHARD else n.args[2])
            if h is not None and h.reads_in_place():
                return 0
        if z.get("kind") == "all_gather" and z.get("owns_full"):  # the runtime's buffer is padded to dp
            h = _handle(z["uid"])
            if h is not None:
                return h.padded_numel * val.element_size()
        return self._bytes(val)

    def _note_symbols(self, val: torch.Tensor) -> None:
        env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
        if env is None:
            return
        for s in val.shape:
            if isinstance(s, torch.SymInt):
                for sym in s.node.expr.free_symbols:
                    if str(sym) not in self.symbols:
                        srcs = env.var_to_sources.get(sym, [])
                        names = [(src.name() if callable(src.name) else src.name) for src in srcs]
                        self.symbols[str(sym)] = " = ".join(names) or "?"

    # -- runtime nodes: shards, gradient shards, reduce copies ---------------------------------
    def _runtime_nodes(self, rec: CompileRecord, stage: str, nodes: List[torch.fx.Node],
                       pos: Dict[torch.fx.Node, int], carried_from: Optional[int] = None) -> None:
        self.reuse_files = rec.config.nvme_reuse_files
        self.dirty_cap = rec.config.optimizer_sub_group_bytes  # write-back gradients (tiers.DirtyTracker)
        self.read_cache_cap = rec.config.nvme_read_cache_bytes
        self.kept_cap = rec.config.nvme_read_cache_bytes if rec.config.nvme_param_write_back else 0
        cfg_tier = TIER_OF[rec.config.offload_params]  # the parameter copy that fetches read
        cfg_otier = TIER_OF[rec.config.offload_optimizer]  # fp32 master, gradient shard, optimizer state
        for n in nodes:
            z = n.meta.get("zinf") or {}
            if n.op == "call_function" and n.target in (GATHER_BUCKET, REDUCE_BUCKET, GATHER, ALL_GATHER, REDUCE,
                                                         REDUCE_GRAD):
                self._comm_intervals(stage, n, pos)
            if n.op == "call_function" and n.target is REDUCE_BUCKET:  # one reduce-scatter, several gradients
                for g, u, name in zip(n.args[0], n.args[2], z.get("params") or [None] * len(n.args[2])):
                    hb = _handle(u)
                    self._grad_intervals(stage, n, g, u, name, hb, hb.shard_numel if hb is not None else None,
                                         _tiers(hb, cfg_tier, cfg_otier)[1], pos)
                continue
            if n.op != "call_function" or n.target not in (FETCH_SHARD, WAIT_UPLOAD, REDUCE_GRAD, REDUCE):
                continue
            fetch = n.target in (FETCH_SHARD, WAIT_UPLOAD)
            # fetch_shard(param, uid, n, dtype), wait_upload(ticket, param, uid, n, dtype),
            # reduce_grad / reduce(grad, param, uid)
            args = n.args[1:] if n.target is WAIT_UPLOAD else n.args
            uid = args[1] if fetch else args[2]
            param = z.get("param")
            h = _handle(uid)
            tier, otier = _tiers(h, cfg_tier, cfg_otier)
            shard_numel = h.shard_numel if h is not None else None
            read_at = pos[n]
            if n.target is WAIT_UPLOAD:  # the NVMe read buffer is live from the read's start
                load = n.args[0].args[4] if isinstance(n.args[0], torch.fx.Node) else None
                read_at = pos.get(load, pos.get(n.args[0], read_at)) if load is not None else read_at
                if carried_from is not None and load is not None and (load.meta.get("zinf") or {}).get("at", 0) < 0:
                    read_at = carried_from
            if fetch:
                shard_numel, dtype = args[2], args[3]
                pdtype = h.dtype if h is not None else torch.float32
                home, shared = store.master_home(tier, otier, pdtype)
                self._once(("param", uid), Interval(f"shard:{param}", home, "param", "shard", 4 * shard_numel,
                                                    0, self.END, "end", (), param))
                if not shared:  # a separate parameter copy on the parameter tier
                    if home == "nvme" and uid not in self.masters:  # its master, stepped and kept beside the copy
                        self.masters[uid] = (4 * shard_numel, read_at, param)
                    nb = shard_numel * torch.empty((), dtype=pdtype).element_size()
                    self._once(("pcopy", uid), Interval(f"copy:{param}", tier, "param", "param_copy", nb,
                                                        0, self.END, "end", (), param))
                if tier == "nvme":  # read into a host buffer, copied to the device at once (ParamHandle.fetch_shard)
                    src_dtype = pdtype if not shared else torch.float32
                    nb = shard_numel * torch.empty((), dtype=src_dtype).element_size()
                    self.reads.append((uid, read_at, pos[n], nb, f"{stage}:{n.name}", param))
                    if dtype != src_dtype:  # + the cast on the host, as transient
                        nb = nb + shard_numel * torch.empty((), dtype=dtype).element_size()
                    self.extra.append(Interval(f"{stage}:{n.name}", "cpu", "staging", "read_buffer", nb, read_at,
                                               pos[n], f"{stage}:{n.name}", (), param))
                elif dtype != torch.float32:  # memory tiers cache the compute-dtype copy until the step
                    nb = shard_numel * torch.empty((), dtype=dtype).element_size()
                    self._once(("copy", uid, dtype), Interval(f"{stage}:{n.name}", tier, "param", "compute_copy",
                                                              nb, pos[n], self.END, "end", (), param))
                continue
            self._grad_intervals(stage, n, n.args[0], uid, param, h, shard_numel, otier, pos)

    def _comm_intervals(self, stage: str, n: torch.fx.Node, pos: Dict[torch.fx.Node, int]) -> None:
        """A collective's flat buffers on the device (``zinf_runtime.bucket``, ``ParamHandle``'s gather
        and reduce), from its start to its wait (a bucket's: its last member's, whose ticket is the last
        to hold them). A bucket's own: for ``gather_bucket`` the packed shards and the (world, total)
        output in the shards' dtype, for ``reduce_bucket`` the fp32 (world, total) pack and the
        total-element output; members the runtime reduces alone (tiled elsewhere, or not
        dp-partitioned) are left out, as there. On gloo every collective is an exchange
        (``comm.exchanges``) with a buffer of its own (``comm.exchange_numel``): from 3 ranks a
        bucket's all-gather packs into a (world, total) send buffer, at 2 into its output's row (no
        buffer); a reduce-scatter receives the other ranks' slices into it; elsewhere a parameter
        gathered alone whose shard is read in place is copied for the collective first (its shard
        bytes). A synchronous ``all_gather`` / ``reduce_grad`` holds them for its own step only."""
        bucket = n.target in (GATHER_BUCKET, REDUCE_BUCKET)
        gather = n.target in (GATHER_BUCKET, GATHER, ALL_GATHER)
        if bucket:
            uids = n.args[1] if gather else n.args[2]
            shard = n.args[0][0] if gather else None
        else:
            uids = [n.args[1] if gather else n.args[2]]
            shard = n.args[0] if gather else None
        handles = [_handle(u) for u in uids]
        if any(h is None for h in handles):
            return
        handles = [h for h in handles if h.world > 1 and h.placement.partition == "bandwidth"
                   and (gather or not bucket or h.tiles is None)]
        if not handles or (not bucket and handles[0].tiles is not None):
            return  # dp 1, broadcast, or a tiled parameter (each tile reduced by its own call)
        world, total = handles[0].world, sum(h.shard_numel for h in handles)
        val = shard.meta.get("val") if isinstance(shard, torch.fx.Node) else None
        item = val.element_size() if gather and isinstance(val, torch.Tensor) else 4  # gradients reduce in fp32
        if n.target in TICKET_OPS:  # started here, waited for later
            waits = [w for t in (n.users if bucket else [n]) for w in t.users
                     if w.target in (WAIT_GATHER, WAIT_REDUCE) and w in pos]
        else:
            waits = []
        last = max(waits, key=pos.__getitem__) if waits else n
        where = f"{stage}:{last.name}"
        dev = handles[0].placement.compute_device
        # on gloo, both collectives run as an exchange (``comm.exchanges``) with a buffer of their own from
        # the pool (``comm.exchange_numel``): an all-gather's send buffer (none at 2 ranks: it sends from
        # its row of the output), a reduce-scatter's receive buffer
        exchanging = _exchanges(handles[0], dev)
        extra = (comm.exchange_numel("all_gather", total, world) if gather
                 else comm.exchange_numel("reduce_scatter", world * total, world)) if exchanging else 0
        exchange = flat_nbytes(extra * item, dev) if extra else 0
        if bucket:  # each rounded up as the runtime's pool hands them out (``tiers.flat_nbytes``)
            if gather:  # its packed shards: the exchange's send buffer, or a row of the output
                packed = exchange if exchanging else flat_nbytes(total * item, dev)
            else:
                packed = flat_nbytes(world * total * item, dev)
            out = flat_nbytes((world if gather else 1) * total * item, dev)
            held = packed + out + (exchange if not gather else 0)
            self.extra.append(Interval(f"{stage}:{n.name}", "device", "comm", "bucket", held,
                                       pos[n], pos[last], where, (), None))
            return
        if exchanging:  # its shard is copied into the exchange's own buffer (none at 2 ranks: the output's row)
            if exchange:
                self.extra.append(Interval(f"{stage}:{n.name}", "device", "comm", "exchange", exchange,
                                           pos[n], pos[last], where, (), handles[0].name))
        elif gather and handles[0].reads_in_place():
            # a shard read in place is copied for its collective (``ParamHandle.collective_input``)
            self.extra.append(Interval(f"{stage}:{n.name}", "device", "comm", "collective_input", total * item,
                                       pos[n], pos[last], where, (), handles[0].name))

    def _grad_intervals(self, stage: str, n: torch.fx.Node, grad: torch.fx.Node, uid: int, param: Optional[str],
                        h: Any, shard_numel: Optional[int], otier: str, pos: Dict[torch.fx.Node, int]) -> None:
        """A reduced gradient's shard, NVMe write buffer, optimizer state and reduce copy."""
        if shard_numel is None:
            shard_numel = _expr(grad.meta["val"].numel()) if "val" in grad.meta else 0
        self._once(("grad", uid), Interval(f"{stage}:{n.name}", otier, "grad", "shard", 4 * shard_numel,
                                           pos[n], self.END, "end", (), param))
        if otier == "nvme":  # a host copy of the shard: kept unwritten (write-back) or the write's source
            self._once(("wbuf", uid), Interval(f"{stage}:{n.name}", "cpu", "staging", "write_buffer",
                                               4 * shard_numel, pos[n], self.END, "end", (), param))
        per_el, per_param = self.optim
        if per_el and otier != "nvme":
            self._once(("optim", uid), Interval(f"optim:{param}", otier, "optim", "shard",
                                                per_el * shard_numel + per_param, 0, self.END, "end", (), param))
        elif per_el:  # on NVMe: the fp32 moments packed in one file (runtime/packed_state.py); Adam's
            # ``step`` stays in memory (optim_small)
            self._once(("optim", uid), Interval(f"optim:{param}", otier, "optim", "shard",
                                                per_el * shard_numel, 0, self.END, "end", (), param))
            if per_param:
                self._once(("optim_small", uid), Interval(f"optim:{param}", "cpu", "optim", "scalar",
                                                          per_param, 0, self.END, "end", (), param))
        copy_bytes = self._reduce_copy_bytes(grad.meta.get("val"), h)
        if copy_bytes:
            # a started reduce-scatter keeps its input copy until its wait (ParamHandle.start_reduce)
            waits = [w for w in n.users if w.target is WAIT_REDUCE and w in pos] if n.target is REDUCE else []
            last = max(waits, key=pos.__getitem__) if waits else n
            self.extra.append(Interval(f"{stage}:{n.name}", "device", "grad_buffer", "reduce_copy", copy_bytes,
                                       pos[n], pos[last], f"{stage}:{last.name}", (), param))

    def _files(self, iv: Interval, rewritten: set) -> int:
        """Files an NVMe shard keeps on disk in steady training: two for a key rewritten every step
        (gradients, optimizer state, and the master of a parameter that gets gradients) when the swap
        engine reuses files (``nvme_reuse_files``), else one."""
        if iv.tier != "nvme" or iv.role != "shard" or not self.reuse_files:
            return 1
        return 2 if iv.kind in ("grad", "optim") or iv.param in rewritten else 1

    def _once(self, key: Tuple, iv: Interval) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.extra.append(iv)

    @staticmethod
    def _reduce_copy_bytes(val: Any, h: Optional[store.ParamHandle]) -> Bytes:
        """What ``ParamHandle.reduce_grad`` allocates besides the gradient shard (see runtime/store.py)."""
        if not isinstance(val, torch.Tensor):
            return 0
        numel = _expr(val.numel())
        try:
            contiguous = bool(val.is_contiguous())
        except Exception:
            contiguous = True
        flat = numel * 4 if (not contiguous or val.dtype != torch.float32) else 0
        if h is None or h.world == 1:
            return flat
        if h.owner is not None:  # partition="broadcast": a private fp32 copy for dist.reduce to clobber,
            return flat + (0 if h.rank == h.owner else h.numel * 4)  # the owner's kept as its gradient shard
        pad = h.padded_numel * 4 if h.padded_numel != h.numel else 0
        return flat + pad + h.shard_numel * 4

    # -- result ----------------------------------------------------------------------------------
    def finish(self, graphs: List[Tuple[int, str]]) -> "MemoryPlan":
        last_step = len(self.steps) - 1
        fix = lambda i: last_step if i == self.END else i  # noqa: E731
        groups: Dict[Tuple, List[_Val]] = {}
        for v in self.vals.values():
            root = v
            while root.parent is not None:
                root = self.vals[root.parent]
            groups.setdefault(root.key, []).append(v)
        out: List[Interval] = []
        for rkey, members in groups.items():
            root = self.vals[rkey]
            if root.nbytes == 0:
                continue
            last = max(members, key=lambda m: fix(m.end))
            end, end_node = fix(last.end), last.end_node
            z = (root.node.meta.get("zinf") or {}) if root.node is not None else {}
            users = [u for m in members if m.node is not None for u in m.node.users
                     if m.key[3] is None or u.target is not operator.getitem]
            kind, role = "activation", root.role
            if z.get("owns_full"):
                kind = "gathered"
                rel = [u for u in users if u.target is RELEASE and u.args[0] is root.node]
                if rel:
                    end, end_node = max(end, self.step_of[(rkey[0], rkey[1], rel[0].name)]), f"{rkey[1]}:{rel[0].name}"
            elif z.get("kind") == "fetch_shard":
                role = "fetched_shard"
            elif any(u.target in (REDUCE_GRAD, REDUCE, REDUCE_BUCKET) for u in users):
                kind = "grad_buffer"
            saved = [m for m in members if m.role == "saved"]
            if saved and self.hold_saved:  # AOTAutograd's ctx holds saved tensors until backward returns
                end = max([end] + [self.stage_last[(m.key[0], m.key[1])] for m in saved])
                end_node = f"end of {saved[0].key[1]}" if end != fix(last.end) else end_node
            if role == "temp" and saved:
                role = "saved"
            if role == "temp" and end_node == "end":
                role = "output"
            out.append(Interval(f"{rkey[1]}:{root.name}", "device", kind, role, root.nbytes, root.start,
                                max(end, root.start), end_node,
                                tuple(f"{m.key[1]}:{m.name}" for m in members if m is not root),
                                z.get("param")))
        stepped = {iv.param for iv in self.extra if iv.kind == "grad"}  # parameters the optimizer steps
        held = _kept_params(self.reads, stepped, self.kept_cap, self.masters)
        held_params = {param for _, param in held.values()}
        rewritten = stepped - held_params  # a kept master is not written while it stays kept
        kept = _deferred_grads(self.extra, self.dirty_cap)
        extra = [dataclasses.replace(iv, end=fix(iv.end), files=0 if iv.kind == "grad" and iv.param in kept
                                     else self._files(iv, rewritten)) for iv in self.extra]
        # a kept value's fetches borrow it: no read buffer (but a cast on the host, if any), nothing cached
        lent = {r[4]: r[3] for r in self.reads if r[0] in held}
        extra = [iv if not (iv.role == "read_buffer" and iv.name in lent)
                 else dataclasses.replace(iv, nbytes=iv.nbytes - lent[iv.name]) for iv in extra]
        extra = [iv for iv in extra if not (iv.role == "read_buffer" and iv.name in lent and iv.nbytes == 0)]
        written = [iv for iv in extra if not (iv.role == "write_buffer" and iv.param in kept)]
        out += [iv for iv in extra if iv.role == "write_buffer" and iv.param in kept] + _cap_write_buffers(written)
        out += [Interval(f"kept:{param}", "cpu", "staging", "kept", nbytes, 0, last_step, "end", (), param)
                for nbytes, param in held.values()]
        out += _cached_reads([r for r in self.reads if r[0] not in held], self.read_cache_cap, last_step)
        out.sort(key=lambda iv: (iv.start, iv.name))
        return MemoryPlan(self.steps, out, dict(self.symbols), graphs)


def _source_name(name: str, argnames: Sequence[str]) -> str:
    """Dynamo's ``L['idx'].size()[1]`` -> ``input 0 dim 1`` (``argnames``: the forward's parameters)."""
    m = re.fullmatch(r"L\['(\w+)'\](?:\[(\d+)\])?\.size\(\)\[(\d+)\]", name)
    if m is None or m[1] not in argnames:
        return name
    i = argnames.index(m[1]) + (int(m[2]) if m[2] is not None else 0)  # *args: L['args'][i]
    return f"input {i} dim {m[3]}"


def _rank(name: str) -> Tuple[bool, str]:
    return (not name.startswith("input "), name)  # "input 0 dim 0" first


def _input_symbols(records: Sequence[CompileRecord], argnames: Sequence[str]) -> Dict[str, str]:
    """``{"s24": "input 0 dim 0"}``: each size symbol of the Dynamo graphs' inputs, first input first."""
    found: Dict[str, str] = {}
    for rec in records:
        gm = rec.final_modules.get("dynamo")
        for n in gm.graph.nodes if gm is not None else ():
            val, src = n.meta.get("example_value"), getattr(n, "_dynamo_source", None)
            if n.op != "placeholder" or not isinstance(val, torch.Tensor) or src is None:
                continue
            text = src.name() if callable(src.name) else src.name
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    name = _source_name(f"{text}.size()[{d}]", argnames)
                    key = str(size.node.expr)
                    if key not in found or _rank(name) < _rank(found[key]):
                        found[key] = name
    return found


def _tiers(h: Optional[store.ParamHandle], tier: str, otier: str) -> tuple[str, str]:
    """The parameter-copy and master tiers of ``h``: its own placement's, which differ from the
    options' for a parameter under ``nvme_min_shard_bytes`` (kept in CPU memory); the options'
    (``tier``, ``otier``) for an unknown uid."""
    if h is None:
        return tier, otier
    return h.placement.tier, h.placement.master_tier


def _handle(uid: int) -> Optional[store.ParamHandle]:
    try:
        return store.get(uid)
    except RuntimeError:
        return None


def _exchanges(h: store.ParamHandle, device: Any) -> bool:
    """Whether ``h``'s collectives on ``device`` tensors run as exchanges (``zinf_runtime.comm.exchanges``:
    gloo, host tensors, dp > 1)."""
    return "gloo" in str(_backend(h)) and torch.device(device).type == "cpu" and h.world > 1


def _backend(h: store.ParamHandle) -> Optional[str]:
    """The collective backend of ``h``'s dp group ("gloo", "nccl", ...), None if unknown."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend(h.placement.group))
    except Exception:
        return None


def _sym_max(xs: Iterable[Bytes]) -> Bytes:
    """Max of byte counts; for sympy polynomials in positive sizes, dominated terms are dropped first."""
    uniq = list(dict.fromkeys(xs))
    if not uniq:
        return 0
    if not any(_is_sym(x) for x in uniq):
        return max(int(x) for x in uniq)
    syms = sorted(set().union(*(sympy.sympify(x).free_symbols for x in uniq)), key=str)
    try:
        polys = [(x, sympy.Poly(x, *syms).as_dict()) for x in uniq]
    except sympy.PolynomialError:  # floor/ceil/Max of sizes: no pruning
        return sympy.Max(*uniq, evaluate=False)
    kept: List[Tuple[Bytes, Dict]] = []
    for x, p in polys:  # a >= b for all positive sizes when every coefficient of a - b is >= 0
        if any(all(q.get(m, 0) - p.get(m, 0) >= 0 for m in set(p) | set(q)) for _, q in kept):
            continue
        kept = [(y, q) for y, q in kept if not all(p.get(m, 0) - q.get(m, 0) >= 0 for m in set(p) | set(q))]
        kept.append((x, p))
    return kept[0][0] if len(kept) == 1 else sympy.Max(*[x for x, _ in kept], evaluate=False)


@dataclass
class MemoryPlan:
    """Live intervals over the schedule; see the module docstring."""

    steps: List[Step]
    intervals: List[Interval]
    symbols: Dict[str, str] = field(default_factory=dict)  # size symbol -> the input dimension it stands for
    graphs: List[Tuple[int, str]] = field(default_factory=list)
    _cache: Dict[Any, List[Bytes]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def symbolic(self) -> bool:
        return any(_is_sym(iv.nbytes) for iv in self.intervals)

    def stage_ranges(self) -> List[Tuple[str, int, int]]:
        """``(stage, first step, last step)`` per contiguous run of one graph's stage."""
        out: List[Tuple[str, int, int]] = []
        for s in self.steps:
            if out and out[-1][0] == s.stage and s.index == out[-1][2] + 1:
                out[-1] = (s.stage, out[-1][1], s.index)
            else:
                out.append((s.stage, s.index, s.index))
        return out

    def timeline(self, tier: Optional[str] = None, kind: Optional[str] = None) -> List[Bytes]:
        """Bytes live at each step, on ``tier`` (all tiers if None), of ``kind`` (all kinds if None)."""
        key = (tier, kind)
        if key not in self._cache:
            diff: List[Bytes] = [0] * (len(self.steps) + 1)
            for iv in self.intervals:
                if (tier is None or iv.tier == tier) and (kind is None or iv.kind == kind):
                    diff[iv.start] += iv.nbytes
                    diff[iv.end + 1] -= iv.nbytes
            cur: Bytes = 0
            line = []
            for d in diff[:-1]:
                cur = cur + d
                line.append(sympy.expand(cur) if _is_sym(cur) else int(cur))
            self._cache[key] = line
        return self._cache[key]

    def peak(self, tier: str = "device", kind: Optional[str] = None) -> Bytes:
        """Predicted peak bytes (a sympy expression, possibly a ``Max``, when sizes are symbolic)."""
        key = ("peak", tier, kind)
        if key not in self._cache:
            self._cache[key] = [_sym_max(self.timeline(tier, kind))]
        return self._cache[key][0]

    def nvme_file_bytes(self, kind: Optional[str] = None) -> Bytes:
        """Peak bytes of the NVMe tier's files on disk in steady training: each shard's file is padded to
        the swap engine's O_DIRECT alignment (4096 bytes), and with ``nvme_reuse_files`` (the default) a
        shard rewritten every step has two files (its current version and the spare its next write
        overwrites). A gradient kept in memory (``_deferred_grads``: all of them while they fit under
        ``optimizer_sub_group_bytes``) has none; one written back counts two, which it keeps only
        while it is accumulated over several backwards: ``zero_grad`` leaves one file, which the next
        backward overwrites in place. So this is the peak ``du`` of the swap folder from the second step on (one backward
        per step: less one file per gradient), not the payload that ``peak("nvme")`` and the
        runtime's accounting count."""
        diff: List[Bytes] = [0] * (len(self.steps) + 1)
        for iv in self.intervals:
            if iv.tier == "nvme" and (kind is None or iv.kind == kind):
                nb = iv.nbytes
                padded = sympy.ceiling(nb / SWAP_ALIGN) * SWAP_ALIGN if _is_sym(nb) else \
                    -(-int(nb) // SWAP_ALIGN) * SWAP_ALIGN
                diff[iv.start] += padded * iv.files
                diff[iv.end + 1] -= padded * iv.files
        cur: Bytes = 0
        line: List[Bytes] = []
        for d in diff[:-1]:
            cur = cur + d
            line.append(cur)
        return _sym_max(line)

    def peak_step(self, tier: str = "device") -> int:
        if self.symbolic:
            raise ValueError("memory plan is symbolic: the peak step depends on the sizes; evaluate() it first")
        line = self.timeline(tier)
        return max(range(len(line)), key=lambda i: (line[i], -i)) if line else 0

    def at_peak(self, tier: str = "device") -> Dict[str, Bytes]:
        """Bytes of each kind at the tier's peak step (they sum to ``peak(tier)``)."""
        i = self.peak_step(tier)
        return {k: self.timeline(tier, k)[i] if self.steps else 0 for k in KINDS}

    def live_at(self, step: int, tier: Optional[str] = None) -> List[Interval]:
        return [iv for iv in self.intervals if iv.start <= step <= iv.end and (tier is None or iv.tier == tier)]

    def size_symbol(self, input_index: int, dim: int) -> str:
        """The symbol standing for ``example_inputs[input_index].shape[dim]`` (for ``evaluate``)."""
        want = f"input {input_index} dim {dim}"
        for name, src in self.symbols.items():
            if src == want:
                return name
        raise KeyError(f"no size symbol for {want}; this plan has {self.symbols}")

    def evaluate(self, **sizes: int) -> "MemoryPlan":
        """The plan at concrete sizes, e.g. ``plan.evaluate(s0=8)`` (names: ``plan.symbols``)."""
        unknown = set(sizes) - set(self.symbols)
        if unknown:
            raise ValueError(f"evaluate: unknown size symbols {sorted(unknown)}; this plan has {self.symbols}")

        def ev(x: Bytes) -> int:
            if not _is_sym(x):
                return int(x)
            y = x.subs({s: sizes[str(s)] for s in x.free_symbols if str(s) in sizes})
            if not y.is_number:
                raise ValueError(f"evaluate: give a value for {sorted(map(str, y.free_symbols))} ({self.symbols})")
            return int(y)

        ivs = [dataclasses.replace(iv, nbytes=ev(iv.nbytes)) for iv in self.intervals]
        return MemoryPlan(self.steps, ivs, {}, self.graphs)

    # -- rendering -------------------------------------------------------------------------------
    def _header(self) -> str:
        stages = ", ".join(f"{e - s + 1} {st}" for st, s, e in self.stage_ranges())
        graphs = ", ".join(f"graph {i} {n}" for i, n in self.graphs)
        return f"zinf memory plan: {graphs}; schedule = {stages} nodes (FX order)"

    def table(self, top: int = 8) -> str:
        lines = [self._header()]
        if self.symbolic:
            lines += ["sizes: " + ", ".join(f"{k} = {v}" for k, v in self.symbols.items()),
                      "(figures in bytes; plan.evaluate(**sizes) gives numbers)"]
        lines += ["", f"{'tier':<8}{'kind':<13}{'at peak':<14}own peak"]
        for tier in TIERS:
            if not any(iv.tier == tier for iv in self.intervals) and tier != "device":
                continue
            at = {} if self.symbolic else self.at_peak(tier)
            for kind in KINDS:
                own = self.peak(tier, kind)
                if own != 0:
                    lines.append(f"{tier:<8}{kind:<13}{_fmt(at[kind]) if at else '-':<14}{_fmt(own)}")
            total = self.peak(tier)
            where = ""
            if not self.symbolic and self.steps:
                s = self.steps[self.peak_step(tier)]
                where = f"peak at step {s.index} ({s.stage} {s.node})"
            lines.append(f"{tier:<8}{'total':<13}{_fmt(total):<14}{where}")
        if not self.symbolic and self.steps and top:
            i = self.peak_step("device")
            live = sorted(self.live_at(i, "device"), key=lambda iv: -int(iv.nbytes))[:top]
            lines += ["", "live at the device peak, largest first:"]
            for iv in live:
                what = iv.name.split(":", 1)[-1]
                what += f" ({iv.param})" if iv.param and iv.param != what else ""
                span = f"{self._where(iv.start)} -> {iv.end_node if iv.end_node != 'end' else 'end of step'}"
                if iv.start == 0 and iv.role == "shard":
                    span = "whole step"
                lines.append(f"  {_fmt(iv.nbytes):>12}  {iv.kind:<12} {iv.role:<13} {what:<36} {span}")
        return "\n".join(lines)

    def _where(self, i: int) -> str:
        s = self.steps[i] if self.steps else None
        return f"{s.stage}:{s.node}" if s else "-"

    def to_dict(self) -> Dict[str, Any]:
        j = lambda x: str(x) if _is_sym(x) else int(x)  # noqa: E731
        peaks: Dict[str, Any] = {}
        for tier in TIERS:
            peaks[tier] = {"total": j(self.peak(tier)), "kinds": {k: j(self.peak(tier, k)) for k in KINDS}}
            if not self.symbolic:
                peaks[tier]["step"] = self.peak_step(tier)
                peaks[tier]["at_peak"] = {k: j(v) for k, v in self.at_peak(tier).items()}
        return {
            "graphs": [{"id": i, "name": n} for i, n in self.graphs],
            "symbolic": self.symbolic, "symbols": self.symbols, "peaks": peaks,
            "steps": [asdict(s) for s in self.steps],
            "intervals": [{**asdict(iv), "nbytes": j(iv.nbytes), "aliases": list(iv.aliases)}
                          for iv in self.intervals],
            "timeline": {t: [j(x) for x in self.timeline(t)] for t in TIERS},
        }

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, folder: str) -> Tuple[str, str]:
        """Write ``plan.json`` and ``plan.txt`` into ``folder``; return their paths."""
        os.makedirs(folder, exist_ok=True)
        pj, pt = os.path.join(folder, "plan.json"), os.path.join(folder, "plan.txt")
        with open(pj, "w") as f:
            f.write(self.to_json())
        with open(pt, "w") as f:
            f.write(self.table() + "\n")
        return pj, pt

    def plot(self, path: str, tier: str = "device", backend: str = "auto") -> str:
        """PNG of ``tier``'s bytes per kind over the schedule (``backend``: auto | matplotlib | png)."""
        if self.symbolic:
            raise ValueError("plot: the plan is symbolic; plot plan.evaluate(**sizes) instead")
        lines = {k: [int(x) for x in self.timeline(tier, k)] for k in KINDS}
        if backend in ("auto", "matplotlib"):
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                if backend == "matplotlib":
                    raise
            else:
                fig, ax = plt.subplots(figsize=(10, 4))
                kinds = [k for k in _STACK if any(lines[k])]
                ax.stackplot(range(len(self.steps)), *[lines[k] for k in kinds], labels=kinds, step="post",
                             colors=[tuple(c / 255 for c in _COLORS[k]) for k in kinds])
                for st, s, _ in self.stage_ranges()[1:]:
                    ax.axvline(s, color="k", lw=0.8)
                ax.axhline(int(self.peak(tier)), color="r", lw=0.8, ls="--", label="peak")
                ax.set_xlabel("schedule step (forward, then backward nodes)")
                ax.set_ylabel(f"{tier} bytes")
                ax.legend(loc="upper left", fontsize=8)
                fig.tight_layout()
                fig.savefig(path)
                plt.close(fig)
                return path
        _png_stack(path, lines, [s for _, s, _ in self.stage_ranges()[1:]])
        return path


_STACK = ("param", "optim", "grad", "staging", "gathered", "comm", "grad_buffer", "activation")  # bottom to top
_COLORS = {"activation": (66, 133, 244), "gathered": (244, 160, 0), "grad_buffer": (15, 157, 88),
           "comm": (141, 110, 99),
           "param": (150, 150, 150), "grad": (120, 120, 120), "optim": (90, 90, 90), "staging": (171, 71, 188)}


def _png_stack(path: str, lines: Dict[str, List[int]], marks: List[int], width: int = 800, height: int = 300) -> None:
    """A dependency-free stacked-area PNG (no text; colours as in the module docstring)."""
    n = len(next(iter(lines.values()))) or 1
    totals = [sum(lines[k][i] for k in KINDS) for i in range(n)]
    top = max(totals) or 1
    px = [[(255, 255, 255)] * width for _ in range(height)]
    for x in range(width):
        lo, hi = x * n // width, max(x * n // width + 1, (x + 1) * n // width)
        i = max(range(lo, min(hi, n)), key=totals.__getitem__)
        y0 = 0
        for k in _STACK:
            h = lines[k][i] * (height - 10) // top
            for y in range(y0, min(y0 + h, height)):
                px[height - 1 - y][x] = _COLORS[k]
            y0 += h
    for m in marks:
        for y in range(height):
            px[y][min(width - 1, m * width // n)] = (0, 0, 0)
    for x in range(width):
        px[9][x] = (220, 0, 0)
    raw = b"".join(b"\x00" + bytes(c for p in row for c in p) for row in px)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# -- building plans ------------------------------------------------------------------------------


def build_plan(records: Sequence[CompileRecord], optimizer: Optional[str] = None,
               hold_saved: bool = True) -> MemoryPlan:
    """The plan of one step over ``records``' final graphs: forwards in order, then backwards reversed.

    Records that only hold an inference graph contribute it instead. ``optimizer`` ("adamw", "adam",
    "sgd" with momentum, or None) adds the optimizer state shards. The records' parameters must still be
    alive (the runtime's store is read for shard sizes).
    """
    b = _Builder(optimizer)
    fwd = [r for r in records if "forward" in r.final_modules and "backward" in r.final_modules]
    inf = [r for r in records if "inference" in r.final_modules and r not in fwd]
    params: Dict[int, set] = {}
    saved: Dict[int, set] = {}
    for r in fwd + inf:
        ps = set()
        for gm in r.final_modules.values():
            ps |= {n.args[0].name for n in gm.graph.nodes if n.op == "call_function" and n.target is FETCH_SHARD}
            ps |= {n.args[1].name for n in gm.graph.nodes if n.op == "call_function" and n.target is WAIT_UPLOAD}
        params[r.id] = ps
        bw = r.final_modules.get("backward")
        saved[r.id] = {n.name for n in bw.graph.nodes if n.op == "placeholder"
                       and not n.name.startswith("tangents")} if bw is not None else set()
    for r in fwd:
        b.add_graph(r, "forward", r.final_modules["forward"], params[r.id], saved[r.id])
    for r in inf:
        b.add_graph(r, "inference", r.final_modules["inference"], params[r.id], set())
    for r in reversed(fwd):
        b.add_graph(r, "backward", r.final_modules["backward"], params[r.id], saved[r.id])
    if not b.steps:
        raise ValueError("memory_plan: the compile records hold no forward/backward or inference graph")
    return b.finish([(r.id, r.name) for r in fwd + inf])


def _private_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with real parameter data, unknown to zinf's store (gathers if ``model`` is partitioned)."""
    if any(store.handle_of(p) is not None for p in model.parameters()):
        from .state import gathered

        with gathered(model):
            clone = copy.deepcopy(model)
    else:
        clone = copy.deepcopy(model)
    for p in clone.parameters():
        if hasattr(p, store.UID_ATTR):
            delattr(p, store.UID_ATTR)
    return clone


_plan_ids = itertools.count()


def _planned(clone: torch.nn.Module) -> List[str]:
    """Give ``clone`` a ``forward`` with a code object of its own; return its parameters' names.

    Dynamo caches compiled graphs per code object, and a zinf graph bakes in its parameters' store
    uids: the copy must never share a cache entry with the user's model (or an earlier plan's copy).
    The copy's class becomes a subclass whose ``forward`` is the same function on a fresh code object.
    """
    fwd = type(clone).forward
    if not isinstance(fwd, types.FunctionType):
        raise TypeError(f"memory_plan: {type(clone).__name__}.forward is not a Python function")
    code = fwd.__code__.replace(co_name=f"{fwd.__code__.co_name}_zinf_plan_{next(_plan_ids)}")
    fn = types.FunctionType(code, fwd.__globals__, fwd.__name__, fwd.__defaults__, fwd.__closure__)
    fn.__kwdefaults__, fn.__qualname__ = fwd.__kwdefaults__, fwd.__qualname__
    clone.__class__ = type(type(clone).__name__, (type(clone),), {"forward": fn})
    return [p.name for p in pyinspect.signature(fwd).parameters.values()][1:]


def _leaves(x: Any) -> List[Any]:
    if isinstance(x, dict):
        return [y for v in x.values() for y in _leaves(v)]
    return [y for v in x for y in _leaves(v)] if isinstance(x, (tuple, list)) else [x]


def _default_loss(out: Any) -> torch.Tensor:
    outs = [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        raise ValueError("memory_plan: no output requires grad; pass train=False or a loss_fn")
    return outs[0] if len(outs) == 1 and outs[0].dim() == 0 else sum(o.float().sum() for o in outs)


def memory_plan(
    model: torch.nn.Module,
    example_inputs: Union[torch.Tensor, Sequence[Any]],
    *,
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    dynamic: Union[None, bool, Dict[int, Sequence[int]]] = None,
    optimizer: Optional[str] = None,
    train: bool = True,
    hold_saved: bool = True,
    **options: Any,
) -> MemoryPlan:
    """Plan the memory of one training step of ``model`` on ``example_inputs`` under the zinf backend.

    ``options`` are the backend's (``offload_params``, ``mixed_precision``, ``dump_dir``, ...;
    ``compiler`` defaults to ``"eager"``). ``model`` is not touched: a deep copy is compiled and run
    once (forward, and backward through ``loss_fn(output)``, default: the output if it is a scalar, else
    the sum of the outputs), with the RNG state restored afterwards. That run raises the process's
    ``memory_stats()`` peaks; call ``reset_peak_memory_stats()`` after planning if you track them.
    ``dynamic``: passed to ``torch.compile`` (True: every size symbolic), or ``{input index: dims}`` to
    make just those dimensions symbolic (``torch._dynamo.mark_dynamic``); ``plan.symbols`` then names
    them (``{"s27": "input 0 dim 0"}``) and ``plan.size_symbol(0, 0)`` finds one. ``optimizer`` and
    ``hold_saved``: see ``build_plan``. With dp > 1 every rank must call it (the copy is partitioned, and
    gathered first if ``model`` already is).
    """
    options = dict(options)
    options.setdefault("compiler", "eager")
    cfg = Config.from_options(options)
    inputs = [example_inputs] if isinstance(example_inputs, torch.Tensor) else list(example_inputs)
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    if isinstance(dynamic, dict):
        for i, dims in dynamic.items():
            torch._dynamo.mark_dynamic(inputs[i], list(dims))
        dynamic = None
    clone = _private_copy(model)
    last = max((r.id for r in compile_records()), default=-1)
    argnames = _planned(clone)
    cmodel = torch.compile(clone, backend="zinf", options=options, dynamic=dynamic)
    devices = sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        if train:
            out = cmodel(*inputs)
            (loss_fn or _default_loss)(out).backward()
        else:
            with torch.no_grad():
                cmodel(*inputs)
    records = [r for r in compile_records() if r.id > last]
    if not records:
        raise RuntimeError("memory_plan: running the copy compiled no zinf graph (Dynamo reused a cached one?); "
                           "call torch._dynamo.reset() and retry")
    plan = build_plan(records, optimizer=optimizer, hold_saved=hold_saved)
    plan.symbols.update(_input_symbols(records, argnames))
    root = dump_root(cfg)
    if root is not None:
        plan.save(root)
    del cmodel, clone
    return plan


# -- command line (``zinf memplan``) ----------------------------------------------------------------


def _emit(text: str) -> None:
    """Print, quietly stopping if the reader went away (``zinf ... | head``)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def add_arguments(p: Any) -> None:
    p.add_argument("target", help="'gpt' (the reference GPT, sized by the flags below), 'pkg.module:factory' "
                                  "(factory() returns (model, example_inputs)), or a dump_dir holding plan.txt")
    g = p.add_argument_group("gpt")
    for flag, default in (("layers", 4), ("hidden", 256), ("heads", 8), ("seq", 128), ("vocab", 512), ("batch", 8)):
        g.add_argument(f"--{flag}", type=int, default=default, help=f"default {default}")
    o = p.add_argument_group("zinf options")
    o.add_argument("--offload-params", choices=("none", "cpu"), default="none")
    o.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None)
    o.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    o.add_argument("--dump-dir", default=None, help="also write the graphs and plan.json / plan.txt there")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default=None, help="count optimizer state")
    p.add_argument("--dynamic-batch", action="store_true", help="make dim 0 of every input symbolic")
    p.add_argument("--json", action="store_true", help="print plan.to_json()")
    p.add_argument("--plot", default=None, metavar="PNG", help="write device bytes over the schedule as a PNG")


def run_cli(args: Any) -> int:
    if os.path.isdir(args.target):
        path = os.path.join(args.target, "plan.json" if args.json else "plan.txt")
        if not os.path.exists(path):
            raise ValueError(f"no {os.path.basename(path)} in {args.target!r}; run memory_plan with dump_dir set")
        with open(path) as f:
            _emit(f.read().rstrip())
        return 0
    if args.target == "gpt":
        from .models import GPT, GPTConfig, make_batch

        cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
        torch.manual_seed(0)
        model, inputs = GPT(cfg), make_batch(cfg, args.batch, seed=0)
    elif ":" in args.target:
        import importlib

        mod, fn = args.target.split(":", 1)
        model, inputs = getattr(importlib.import_module(mod), fn)()
    else:
        raise ValueError(f"memplan target {args.target!r}: expected 'gpt', 'pkg.module:factory' or a dump_dir")
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    dynamic = {i: [0] for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.dim()} \
        if args.dynamic_batch else None
    options = {"offload_params": args.offload_params, "mixed_precision": args.mixed_precision,
               "compiler": args.compiler, "dump_dir": args.dump_dir}
    plan = memory_plan(model, inputs, dynamic=dynamic, optimizer=args.optimizer, **options)
    _emit(plan.to_json() if args.json else plan.table())
    if args.plot:
        dims = {v: int(inputs[int(v.split()[1])].shape[0]) for v in plan.symbols.values() if v.endswith(" dim 0")}
        target = plan.evaluate(**{k: dims[v] for k, v in plan.symbols.items()}) if plan.symbolic else plan
        print(f"plot: {target.plot(args.plot)}", file=sys.stderr)
    return 0
