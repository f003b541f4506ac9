"""The ``zinf`` Dynamo backend: ``torch.compile(model, backend="zinf", options={...})``.

One call per Dynamo graph. It partitions the graph's parameters into the runtime's store (each rank
keeps a 1/dp fp32 shard; the parameter keeps its shape with 0-byte storage, so Dynamo needs no
patching), then traces forward and backward with AOTAutograd and runs zinf's passes::

    Dynamo graph --autocast, plan_tiling, [relayout_tiles: the store re-lays tiled weights],
        tile_matmul--> AOTAutograd joint graph
        --insert_fetch, mark_grads--> min-cut partition
        forward:   sink_fetch -> insert_release -> plan_schedule -> schedule -> carry -> keep_alive
                   -> Inductor (or eager)
        backward:  sink_fetch -> reduce_grad -> insert_release -> plan_schedule -> schedule -> carry
                   -> donate_grads -> keep_alive -> Inductor (or eager)
        inference: insert_fetch -> sink_fetch -> insert_release -> plan_schedule -> schedule -> carry
                   -> keep_alive -> Inductor (or eager)

Every intermediate graph is kept in a ``CompileRecord`` (``zinf_compile.last_graphs()``) and, with
``dump_dir``, written out as code.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.fx

import zinf_runtime

from . import _torch_compat, fallback, rendezvous
from .config import Config
from .passes.autocast import autocast_pass
from .passes.carry import carry_pass, graph_heads
from .passes.copy_escaping import copy_escaping_params_pass
from .passes.donate_grads import donate_grads_pass
from .passes.insert_fetch import insert_fetch_pass
from .passes.insert_release import insert_release_pass
from .passes.keep_alive import keep_alive_pass
from .passes.mark_grads import mark_grads_pass
from .passes.reduce_grad import reduce_grad_pass
from .passes.plan_tiling import plan_tiling_pass
from .passes.schedule import plan_schedule_pass, schedule_pass
from .passes.sink_fetch import sink_fetch_pass
from .passes.tile_matmul import tile_matmul_pass
from .pipeline import CompileContext, Pass, ParamInfo, new_record, run_passes

log = logging.getLogger("zinf_compile")

DYNAMO_PASSES: List[Tuple[str, Pass]] = [
    ("copy_escaping", copy_escaping_params_pass),
    ("autocast", autocast_pass),
    ("plan_tiling", plan_tiling_pass),
    ("tile_matmul", tile_matmul_pass),
]
JOINT_PASSES: List[Tuple[str, Pass]] = [("insert_fetch", insert_fetch_pass), ("mark_grads", mark_grads_pass)]
SCHEDULE_PASSES: List[Tuple[str, Pass]] = [("plan_schedule", plan_schedule_pass), ("schedule", schedule_pass)]
FORWARD_PASSES: List[Tuple[str, Pass]] = [
    ("sink_fetch", sink_fetch_pass),
    ("insert_release", insert_release_pass),
] + SCHEDULE_PASSES + [("carry", functools.partial(carry_pass, stage="forward")), ("keep_alive", keep_alive_pass)]
BACKWARD_PASSES: List[Tuple[str, Pass]] = [
    ("sink_fetch", sink_fetch_pass),
    ("reduce_grad", reduce_grad_pass),
    ("insert_release", insert_release_pass),
] + SCHEDULE_PASSES + [("carry", functools.partial(carry_pass, stage="backward")),
                        ("donate_grads", donate_grads_pass), ("keep_alive", keep_alive_pass)]
INFERENCE_PASSES: List[Tuple[str, Pass]] = [("insert_fetch", insert_fetch_pass)] + FORWARD_PASSES[:-2] + [
    ("carry", functools.partial(carry_pass, stage="inference")), ("keep_alive", keep_alive_pass)]


def pass_names() -> frozenset:
    """Every pass name ``disabled_passes`` may hold (a name nothing runs under would be ignored)."""
    lists = (DYNAMO_PASSES, JOINT_PASSES, FORWARD_PASSES, BACKWARD_PASSES, INFERENCE_PASSES)
    return frozenset(name for passes in lists for name, _ in passes)


def _source_text(node: torch.fx.Node) -> str:
    source = getattr(node, "_dynamo_source", None)
    text = getattr(source, "name", "") if source is not None else ""
    return text() if callable(text) else str(text)


def _param_name(node: torch.fx.Node) -> str:
    """The parameter's name as in ``model.named_parameters()`` (e.g. ``blocks.0.fc.weight``)."""
    text = _source_text(node)
    parts = re.findall(r"_(?:modules|parameters|buffers)\['([^']+)'\]", text)
    if parts:
        return ".".join(parts)
    name = re.sub(r"^[Ll]_(self_|fn_)?", "", node.name).rstrip("_")
    return re.sub(r"_modules_|_parameters_|_buffers_", ".", name)


def _graph_name(gm: torch.fx.GraphModule) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", getattr(gm, "_zinf_name", None) or type(gm).__name__)[:40]


def zinf_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: Any = None,
                 mode: Optional[str] = None, **kwargs: Any) -> Callable:
    """Dynamo backend entry point (registered as ``torch_dynamo_backends: zinf``)."""
    cfg = Config.from_options(options)
    if mode not in (None, "default"):
        warnings.warn(f"zinf: torch.compile mode={mode!r} is ignored; zinf uses its own options")
    if kwargs:
        raise ValueError(f"zinf backend: unexpected arguments {sorted(kwargs)}; pass settings in options={{...}}")
    # one torch.compile call hands every graph the same options object: its parameters share a context
    with zinf_runtime.compiling(options, device_memory_budget=cfg.device_memory_budget,
                                malloc_mmap_threshold=cfg.malloc_mmap_threshold):
        return compile_graph(gm, list(example_inputs), cfg)


def _fp32_holds(dtype: torch.dtype) -> bool:
    """Whether the store's fp32 master shards hold every value of ``dtype`` exactly."""
    if dtype.is_complex:
        return False
    if dtype.is_floating_point:
        return dtype.itemsize <= 4  # fp32, bf16, fp16, fp8
    return dtype.itemsize <= 2  # bool, (u)int8, (u)int16: |v| < 2**24


def _check_dtypes(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> None:
    """Refuse, before anything is partitioned, parameters that fp32 master shards would round.

    fp64 (and int32/int64) parameters would silently lose precision in fp32 masters and complex
    ones their imaginary part; the user gets an error naming the parameter and the fix instead.
    """
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.nn.Parameter) and not _fp32_holds(t.dtype) and zinf_runtime.handle_of(t) is None:
            name = _param_name(phs[i]) if i < len(phs) else f"input{i}"
            raise TypeError(
                f"zinf: parameter {name!r} is {t.dtype}; zinf keeps fp32 master shards, which would silently "
                f"lose {'the imaginary part' if t.dtype.is_complex else 'precision'}. Train it in float32 "
                "(model.float(), or bf16/fp16 via options={'mixed_precision': ...}), or keep it out of the "
                "compiled model."
            )


def relayout_tiles(gm: torch.fx.GraphModule) -> None:
    """The partition step of tiling: re-lay each weight ``plan_tiling`` tagged as its tiles' units in the
    store (collective when dp > 1), between the planning pass and ``tile_matmul``, which then only
    rewrites the graph. Passes neither mutate the store nor run collectives."""
    for node in gm.graph.nodes:
        plan = node.meta.get("zinf", {}) if node.op == "placeholder" else {}
        if plan.get("kind") == "tile_plan":
            zinf_runtime.store.get(plan["uid"]).split_into_tiles(plan["bounds"], plan["dim"])


def _partition_inputs(gm: torch.fx.GraphModule, example_inputs: List[Any], cfg: Config) -> dict[int, ParamInfo]:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter)]
    if not found:
        return {}
    devices = {t.device for _, t in found}
    if len(devices) != 1:
        raise ValueError(f"zinf: parameters of one graph live on several devices {sorted(map(str, devices))}; "
                         "move the model to one device before compiling")
    device = devices.pop()
    placement = cfg.placement(device)
    names = [_param_name(phs[i]) if i < len(phs) else f"input{i}" for i, _ in found]
    uids = zinf_runtime.partition([(n, t) for n, (_, t) in zip(names, found)], placement, cfg.sync_module_states,
                                  retype=False)  # retyped once the compile succeeded (compile_graph)
    if cfg.sync_module_states:  # buffers are replicated: rank 0's values win, as for the parameters
        buffers = [t for i, t in enumerate(example_inputs) if i < len(phs) and isinstance(t, torch.Tensor)
                   and not isinstance(t, torch.nn.Parameter) and "_buffers[" in _source_text(phs[i])]
        zinf_runtime.store.sync_buffers(buffers, placement.group)
    infos = {}
    for (i, t), uid, name in zip(found, uids, names):
        h = zinf_runtime.handle_of(t)
        parts = tuple((u.uid, u.shard_numel, u.shape) for u in h.tiles) if h.tiles is not None else ()
        # the placement's tier (= the fetched copy's slot tier), the same on every rank: a non-owner's
        # empty shard under partition="broadcast" sits in a 0-byte CPU slot even on the NVMe tier
        # (each handle's own: nvme_min_shard_bytes keeps a small parameter's NVMe tiers in CPU memory)
        infos[i] = ParamInfo(i, uid, h.name, tuple(t.shape), t.dtype, h.shard_numel, t.requires_grad, h.world,
                             parts, h.tile_dim, h.placement.tier, h.placement.master_tier)
    return infos


def compile_graph(gm: torch.fx.GraphModule, example_inputs: List[Any], cfg: Config) -> Callable:
    """Partition, trace, rewrite and compile one Dynamo graph.

    Validation errors (bad devices or dtypes) raise before anything is partitioned. Once the
    parameters are partitioned, a failure anywhere later (a pass, AOTAutograd, Inductor) or a graph
    the rewrite does not support gives the gather-all fallback with a warning, never an error that
    leaves 0-byte parameters behind.
    """
    record = new_record(_graph_name(gm), cfg)
    _check_dtypes(gm, example_inputs)
    inputs_params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter)]
    before = {id(t) for t in inputs_params if zinf_runtime.handle_of(t) is not None}
    if len(before) < len(inputs_params):  # partitioning broadcasts: ranks must agree on the parameters first
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rendezvous.check_compile(record.name, [(_param_name(phs[i]) if i < len(phs) else f"input{i}", t)
                                               for i, t in enumerate(example_inputs)
                                               if isinstance(t, torch.nn.Parameter)], cfg.resolved_group())
    device_type = inputs_params[0].device.type if inputs_params else "cpu"
    params: dict[int, ParamInfo] = {}
    guarded: List[Any] = []
    try:
        params = _partition_inputs(gm, example_inputs, cfg)
        guarded = [example_inputs[i] for i in params]  # before a pass adds tile inputs to params
        record.counters["partitioned_inputs"] = len(params)
        if cfg.trace:
            _start_trace(cfg, [example_inputs[i] for i in params])
        for ctx in zinf_runtime.contexts_of([example_inputs[i] for i in params]):  # runtime/optim_overlap.py
            ctx.optimizer_prefetch, ctx.overlap_optimizer_step = cfg.optimizer_prefetch, cfg.overlap_optimizer_step
        mutated = fallback.mutated_param_inputs(gm, params)
        if mutated:
            idx, op = next(iter(mutated.items()))
            compiled = _fall_back(gm, params, cfg, device_type, record,
                                  f"it writes partitioned parameter {params[idx].name} in place ({op})", mutated)
        else:
            compiled = _compile_partitioned(gm, example_inputs, cfg, params, record, device_type)
    except Exception as exc:  # noqa: BLE001 - any failure after partitioning must leave the user whole
        if _torch_compat.is_dynamo_restart(exc):
            raise  # Dynamo retraces (the parameters stay partitioned; the next call finds them so)
        if isinstance(exc, ValueError) and all(
                zinf_runtime.handle_of(t) is None or id(t) in before for t in inputs_params):
            raise  # a bad setting, found before this compile partitioned anything: the user's to fix
        log.debug("zinf: graph %s falls back", record.id, exc_info=True)
        compiled = _fall_back(gm, params, cfg, device_type, record, _reason(exc), {})
    # after compiling: a forward pre-hook registered before a Dynamo restart (dynamic=True) would
    # send the retrace down another call path than the first trace, which Dynamo refuses
    fallback.install_call_guards(guarded)
    # likewise the class that refuses eager reads of 0-byte parameters (runtime/store.py)
    zinf_runtime.store.retype_partitioned(inputs_params)
    # ranks must agree on the graph and on how it runs (rewritten or gather-all: other collectives)
    how = "gather-all fallback" if record.counters.get("gather_all_fallback") else "rewritten"
    compiled = rendezvous.guard(compiled, params, cfg.resolved_group(), f"{record.name} ({how})", record=record)
    compiled = _drop_stale_transfers(compiled, guarded, record.id)
    return fallback.guard_other_instances(compiled, params, example_inputs)


def _drop_stale_transfers(compiled: Callable, params: List[Any], key: int) -> Callable:
    """Every transfer a graph starts is waited for in that graph, so none is pending when a graph
    starts, unless an earlier one raised between a start and its wait: those are waited for and
    dropped first (their buffers would otherwise stay referenced). So are the reads this graph's
    previous forward carried for a backward that did not run (``zinf_runtime.carry``)."""
    engines = [c.transfers for c in zinf_runtime.contexts_of(params)]
    if not engines:
        return compiled
    from zinf_runtime.carry import carry_of

    def call(*args: Any) -> Any:
        for eng in engines:
            if eng.in_flight:
                eng.abandon()
            if "_carry" in eng.__dict__:
                carry_of(eng).drop(key)
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call


def _start_trace(cfg: Config, params: List[Any]) -> None:
    """``options={"trace": path}``: the transfer engine of each model these parameters belong to
    records one step (``zinf_runtime.trace``)."""
    from zinf_runtime.trace import Tracer

    for ctx in zinf_runtime.contexts_of(params):
        if ctx.transfers.tracer is None:
            ctx.transfers.tracer = Tracer(str(cfg.trace), rank=zinf_runtime.comm.rank(cfg.resolved_group()),
                                          record_step=cfg.trace_step)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"compiling it failed with {type(exc).__name__}: {text[0] if text else ''}"


def _fall_back(gm: torch.fx.GraphModule, params: dict[int, ParamInfo], cfg: Config, device_type: str,
               record: Any, reason: str, mutated: dict[int, str]) -> Callable:
    msg = fallback.fallback_warning(fallback.graph_label(gm, record.id, params), reason)
    record.warnings.append(msg)
    record.counters["gather_all_fallback"] += 1
    warnings.warn(msg, stacklevel=2)
    return fallback.gather_all(gm, params, cfg.compute_dtype, device_type, write_back=list(mutated))


def _compile_partitioned(gm: torch.fx.GraphModule, example_inputs: List[Any], cfg: Config,
                         params: dict[int, ParamInfo], record: Any, device_type: str) -> Callable:
    ctx = CompileContext(cfg, params, record, device_type)
    gm = _torch_compat.detach_dynamo_graph(gm)
    names = [n for n, _ in DYNAMO_PASSES]
    cut = names.index("plan_tiling") + 1 if "plan_tiling" in names else 0
    gm = run_passes(gm, example_inputs, DYNAMO_PASSES[:cut], ctx=ctx, stage="dynamo")
    if "tile_matmul" not in cfg.disabled_passes:
        relayout_tiles(gm)
    gm = run_passes(gm, example_inputs, DYNAMO_PASSES[cut:], ctx=ctx, stage="dynamo")
    inputs = example_inputs + [_torch_compat.static_fake_like(t, example_inputs) for t in ctx.extra_inputs]
    record.counters["graph_inputs"] = len(inputs)
    compiled = (_compile_eager if cfg.compiler == "eager" else _compile_inductor)(gm, inputs, ctx)
    if record.dump_folder() is not None:
        _dump_plan(record)
    return _with_extra_inputs(compiled, ctx.extra_inputs, ctx.extra_specs, example_inputs)


def _dump_plan(record: Any) -> None:
    """Write this graph's static memory plan next to its dumped graphs (best effort: a report)."""
    from .memory_plan import build_plan

    stages = record.final_modules
    if not ("inference" in stages or ("forward" in stages and "backward" in stages)):
        return  # called again once the backward compiler ran (it runs inside the same compile)
    try:
        build_plan([record]).save(record.dump_folder())
    except Exception as exc:  # a report must never break a compile
        record.warnings.append(f"zinf: memory plan not written: {exc}")


def _with_extra_inputs(compiled: Callable, extra: List[Any], specs: List[Tuple[int, int]],
                       example_inputs: List[Any]) -> Callable:
    """Append the inputs a pass added (weight tiles) to every call, in the callee's convention.

    Dynamo reuses this compiled graph for every instance of the model's class: when the weight
    passed is not the one compiled for, its own tiles (tiled like the template) are passed.
    """
    if not extra:
        return compiled
    boxed = getattr(compiled, "_boxed_call", False)
    # weakly: Dynamo's cache keeps this closure, which must not keep a deleted model's weights alive
    compiled_weights = {idx: weakref.ref(example_inputs[idx]) for idx, _ in specs}

    def tiles_for(args: Sequence[Any]) -> List[Any]:
        if all(args[idx] is w() for idx, w in compiled_weights.items()):
            return extra
        out = []
        for idx, tile_uid in specs:
            th = zinf_runtime.store.resolve(args[idx], tile_uid)
            out.append(th.parent.tile_inputs()[th.tile_index])
        return out

    def call(*args: Any) -> Any:
        if boxed and len(args) == 1 and isinstance(args[0], list):  # graph inputs are never lists
            return compiled(args[0] + tiles_for(args[0]))
        return compiled(*args, *tiles_for(args))

    return call


def _compile_eager(gm: torch.fx.GraphModule, example_inputs: List[Any], ctx: CompileContext) -> Callable:
    """AOTAutograd with zinf's partition function; the rewritten graphs run as plain FX code."""

    def partition_fn(joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kw: Any):
        joint = run_passes(joint, joint_inputs, JOINT_PASSES, ctx=ctx, stage="joint")
        return _torch_compat.min_cut_partition(joint, joint_inputs, **kw)

    def stage_compiler(stage: str, passes: List[Tuple[str, Pass]]) -> Callable:
        def compiler(g: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable:
            g = run_passes(g, inputs, passes, ctx=ctx, stage=stage)
            _register_carry(g, ctx, stage)
            if stage == "backward":
                if ctx.record.dump_folder() is not None:
                    _dump_plan(ctx.record)
            return _torch_compat.make_boxed(g)

        return compiler

    backend = _torch_compat.aot_autograd(
        fw_compiler=stage_compiler("forward", FORWARD_PASSES),
        bw_compiler=stage_compiler("backward", BACKWARD_PASSES),
        inference_compiler=stage_compiler("inference", INFERENCE_PASSES),
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
    )
    with _torch_compat.eager_patches():
        return backend(gm, example_inputs)


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: List[Any], ctx: CompileContext) -> Callable:
    """Inductor's own pipeline, with zinf's joint pass hooked in and zinf's passes before codegen."""
    n_inputs = len(example_inputs)

    def joint_pass(graph: torch.fx.Graph) -> None:
        owner = graph.owning_module
        phs = [n for n in graph.nodes if n.op == "placeholder"]
        if owner is None or len(phs) < n_inputs or not _matches_params(phs, ctx):
            return  # a nested subgraph (e.g. a higher-order op body), not our graph
        stage = "joint" if any(p.name.startswith("tangents") for p in phs) else "inference_joint"
        run_passes(owner, example_inputs, JOINT_PASSES, ctx=ctx, stage=stage)

    def inner_compile(g: torch.fx.GraphModule, inputs: Sequence[Any], **kw: Any) -> Any:
        if kw.get("is_backward"):
            stage, passes = "backward", BACKWARD_PASSES
        elif kw.get("is_inference"):
            stage, passes = "inference", INFERENCE_PASSES
        else:
            stage, passes = "forward", FORWARD_PASSES
        g = run_passes(g, inputs, passes, ctx=ctx, stage=stage)
        _register_carry(g, ctx, stage)
        if stage == "backward":
            if ctx.record.dump_folder() is not None:
                _dump_plan(ctx.record)
        return _torch_compat.inductor_compile_fx_inner(g, inputs, **kw)

    custom = _torch_compat.custom_graph_pass(joint_pass, uuid=f"zinf-joint-{ctx.record.id}")
    with _torch_compat.inductor_patches(custom):
        return _torch_compat.inductor_compile_fx(gm, example_inputs, inner_compile=inner_compile)


def _register_carry(g: torch.fx.GraphModule, ctx: CompileContext, stage: str) -> None:
    """Tell the models' transfer engines which NVMe reads this graph stage begins with, for the
    ``zinf.carry`` of the stage before it to start (the backend's doing, not a pass's: passes never
    touch the runtime)."""
    heads = graph_heads(g)
    if not heads or "carry" in ctx.cfg.disabled_passes:
        return
    from zinf_runtime.carry import carry_of

    engines = []
    for info in ctx.params.values():
        h = zinf_runtime.store._handles.get(info.uid)
        if h is not None and h.context.transfers not in engines:
            engines.append(h.context.transfers)
    for eng in engines:
        carry_of(eng).heads[(ctx.record.id, stage)] = heads


def _matches_params(phs: List[torch.fx.Node], ctx: CompileContext) -> bool:
    for idx, info in ctx.params.items():
        val = phs[idx].meta.get("val")
        if val is None or tuple(val.shape) != info.shape or val.dtype != info.dtype:
            return False
    return True
