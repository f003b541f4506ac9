"""Each pass on a tiny hand-built graph: it fires, it is a no-op when it should be, numerics hold."""

from __future__ import annotations

import tempfile
import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

import zinf_compile
import zinf_runtime
from zinf_runtime.swap import SwapConfig
from zinf_compile.config import Config
from zinf_compile.passes.insert_fetch import insert_fetch_pass
from zinf_compile.passes.insert_release import insert_release_pass
from zinf_compile.passes.mark_grads import mark_grads_pass
from zinf_compile.passes.reduce_grad import reduce_grad_pass
from zinf_compile.passes.sink_fetch import sink_fetch_pass
from zinf_compile.passes._graph import op_counts
from zinf_compile.pipeline import CompileContext, ParamInfo, new_record

aten = torch.ops.aten


def partitioned(*shapes, seed=0, nvme=None):
    """Real parameters partitioned into the store, and a full copy of each for reference; on the
    NVMe folder ``nvme`` if given (where a fetch copies into a buffer of its own), else on the device
    (where, at dp = 1, a fetch reads the shard in place)."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    fulls = [p.detach().clone() for p in params]
    placement = zinf_runtime.Placement(tier="device", compute_device=torch.device("cpu"))
    if nvme is not None:
        placement = zinf_runtime.Placement(tier="nvme", compute_device=torch.device("cpu"),
                                           swap=SwapConfig(nvme_path=str(nvme)))
    zinf_runtime.partition([(f"p{i}", p) for i, p in enumerate(params)], placement)
    return params, fulls


def make_ctx(params, indices, cfg=None, n_inputs=None):
    infos = {}
    for i, p in zip(indices, params):
        h = zinf_runtime.handle_of(p)
        infos[i] = ParamInfo(i, h.uid, h.name, tuple(p.shape), p.dtype, h.shard_numel, p.requires_grad, h.world,
                             tier=h.placement.tier)  # as the backend builds it: the passes plan by tier
    if cfg is None and any(info.tier == "nvme" for info in infos.values()):
        cfg = Config(compiler="eager", offload_params="nvme", nvme_path=tempfile.gettempdir())  # planning only: nothing written
    ctx = CompileContext(cfg or Config(compiler="eager"), infos, new_record("unit", cfg or Config()), "cpu")
    ctx.record.counters["graph_inputs"] = n_inputs if n_inputs is not None else len(indices) + 1
    return ctx


def build(fn, *shapes_dtypes):
    """A GraphModule from ``fn(graph, *placeholders)`` with fake ``meta['val']`` on every node."""
    g = torch.fx.Graph()
    mode = FakeTensorMode()
    phs = []
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        ph = g.placeholder(f"in{i}")
        ph.meta["val"] = mode.from_tensor(torch.empty(shape, dtype=dtype))
        phs.append(ph)
    out = fn(g, *phs)
    g.output(out)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with mode:
        for n in g.nodes:
            if n.op == "call_function":
                args = torch.fx.node.map_arg(n.args, lambda a: a.meta["val"])
                n.meta["val"] = n.target(*args, **n.kwargs)
    return gm


def linear_graph(g, w, x):
    t = g.call_function(aten.t.default, (w,))
    mm = g.call_function(aten.mm.default, (x, t))
    return (g.call_function(aten.relu.default, (mm,)),)


def test_insert_fetch_fires_tags_and_keeps_numerics():
    (w,), (wf,) = partitioned((5, 3))
    gm = build(linear_graph, ((5, 3), torch.float32), ((4, 3), torch.float32))
    ctx = make_ctx([w], [0])
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    gm.recompile()
    counts = op_counts(gm.graph)
    assert counts["zinf.fetch_shard.default"] == 1
    must = [n for n in gm.graph.nodes if n.meta.get("recompute") is not None]
    assert {str(n.target) for n in must} == {"zinf.fetch_shard.default", "aten.view.default", "aten.t.default"}
    x = torch.randn(4, 3)
    torch.testing.assert_close(gm(w, x)[0], torch.relu(x @ wf.t()))


def test_insert_fetch_is_noop_without_parameters():
    gm = build(linear_graph, ((5, 3), torch.float32), ((4, 3), torch.float32))
    before = op_counts(gm.graph)
    ctx = make_ctx([], [])
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    assert op_counts(gm.graph) == before


def test_insert_fetch_gathers_in_compute_dtype_when_every_use_casts():
    (w,), (wf,) = partitioned((5, 3))

    def fn(g, w, x):
        c = g.call_function(aten._to_copy.default, (w,), {"dtype": torch.bfloat16})
        t = g.call_function(aten.t.default, (c,))
        return (g.call_function(aten.mm.default, (x, t)),)

    gm = build(fn, ((5, 3), torch.float32), ((4, 3), torch.bfloat16))
    ctx = make_ctx([w], [0], cfg=Config(compiler="eager", mixed_precision="bf16"))
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    gm.recompile()
    assert "aten._to_copy.default" not in op_counts(gm.graph)
    fetch = next(n for n in gm.graph.nodes if n.target is torch.ops.zinf.fetch_shard.default)
    assert fetch.args[3] == torch.bfloat16
    x = torch.randn(4, 3).bfloat16()
    torch.testing.assert_close(gm(w, x)[0], x @ wf.bfloat16().t())


def test_insert_release_after_last_reader_through_views(tmp_path):
    (w,), (wf,) = partitioned((5, 3), nvme=tmp_path)
    gm = build(linear_graph, ((5, 3), torch.float32), ((4, 3), torch.float32))
    ctx = make_ctx([w], [0])
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    gm = insert_release_pass(gm, [], ctx=ctx)
    gm.recompile()
    names = [n for n in gm.graph.nodes if n.op == "call_function"]
    rel = next(i for i, n in enumerate(names) if n.target is torch.ops.zinf.release.default)
    mm = next(i for i, n in enumerate(names) if n.target is aten.mm.default)
    assert rel == mm + 1  # right after the reader of the transposed view, before relu
    assert names[rel].args[2] == [names[mm]]  # the reader's result is a dependency of the release
    zinf_compile.reset_peak_memory_stats()
    before = zinf_compile.memory_stats()["device"]["gathered"]["current"]
    x = torch.randn(4, 3)
    torch.testing.assert_close(gm(w, x)[0], torch.relu(x @ wf.t()))
    stats = zinf_compile.memory_stats()["device"]["gathered"]
    assert stats["current"] == before and stats["peak"] >= before + 15 * 4


def test_insert_release_skips_and_reports_an_escaping_parameter():
    (w,), _ = partitioned((5, 3))
    gm = build(lambda g, w, x: (g.call_function(aten.t.default, (w,)),), ((5, 3), torch.float32), ((4, 3), torch.float32))
    ctx = make_ctx([w], [0])
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    with pytest.warns(UserWarning, match="escapes"):
        gm = insert_release_pass(gm, [], ctx=ctx)
    assert "zinf.release.default" not in op_counts(gm.graph)
    assert ctx.record.counters["gathered_escaped"] == 1


def test_sink_fetch_moves_each_fetch_to_its_first_use():
    (w1, w2), (f1, f2) = partitioned((3, 3), (3, 3))

    def fn(g, w1, w2, x):
        a = g.call_function(aten.mm.default, (x, w2))
        b = g.call_function(aten.relu.default, (a,))
        return (g.call_function(aten.mm.default, (b, w1)),)

    gm = build(fn, ((3, 3), torch.float32), ((3, 3), torch.float32), ((2, 3), torch.float32))
    ctx = make_ctx([w1, w2], [0, 1])
    gm = insert_fetch_pass(gm, [], ctx=ctx)
    # put both fetch chains at the top, as the partitioner does in backward graphs
    anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for n in [n for n in gm.graph.nodes if n.meta.get("zinf", {}).get("kind") in ("fetch_shard", "all_gather")]:
        anchor.append(n)
        anchor = n
    gm.graph.lint()
    gm = sink_fetch_pass(gm, [], ctx=ctx)
    gm.graph.lint()
    gm.recompile()
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    relu = next(i for i, n in enumerate(order) if n.target is aten.relu.default)
    w1_fetch = next(i for i, n in enumerate(order) if n.target is torch.ops.zinf.fetch_shard.default and n.args[0].name == "in0")
    assert w1_fetch > relu  # w1 is fetched only when it is needed
    x = torch.randn(2, 3)
    torch.testing.assert_close(gm(w1, w2, x)[0], torch.relu(x @ f2) @ f1)


def test_mark_grads_then_reduce_grad_route_parameter_gradients():
    (w,), _ = partitioned((3, 2))

    def joint(g, w, x, tangents_1):
        y = g.call_function(aten.mm.default, (x, w))
        gw = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (x,)), tangents_1))
        return (y, gw, None)

    gm = build(joint, ((3, 2), torch.float32), ((4, 3), torch.float32), ((4, 2), torch.float32))
    for n in gm.graph.nodes:  # the joint graph's placeholder names tell AOT's tangents apart
        if n.name == "in2":
            n.name = "tangents_1"
    ctx = make_ctx([w], [0], n_inputs=2)
    gm = insert_fetch_pass(gm, [], ctx=ctx)  # the forward half reads w through a fetch, as in real graphs
    gm = mark_grads_pass(gm, [], ctx=ctx)
    outs = list(gm.graph.find_nodes(op="output")[0].args[0])
    assert outs[1].target is torch.ops.zinf.grad_of.default and outs[1].args[1].name == "in0"
    assert outs[2] is None
    # the backward half: the marker becomes reduce_grad and the output None
    gm = reduce_grad_pass(gm, [], ctx=ctx)
    gm.recompile()
    assert "zinf.grad_of.default" not in op_counts(gm.graph)
    x, dy = torch.randn(4, 3), torch.randn(4, 2)
    h = zinf_runtime.handle_of(w)
    y, g1, g2 = gm(w, x, dy)
    assert g1 is None and g2 is None
    gm(w, x, dy)  # accumulates
    torch.testing.assert_close(h.grad.view(3, 2), 2 * (x.t() @ dy))


def test_reduce_grad_refuses_gradients_without_markers():
    (w,), _ = partitioned((3, 2))
    gm = build(lambda g, w, x: (g.call_function(aten.t.default, (x,)),), ((3, 2), torch.float32), ((2, 3), torch.float32))
    ctx = make_ctx([w], [0], n_inputs=2)
    with pytest.raises(RuntimeError, match="grad_of markers"):
        reduce_grad_pass(gm, [], ctx=ctx)


def test_disabled_pass_is_skipped_and_recorded():
    from zinf_compile.pipeline import run_passes

    (w,), _ = partitioned((5, 3))
    gm = build(linear_graph, ((5, 3), torch.float32), ((4, 3), torch.float32))
    cfg = Config(compiler="eager", disabled_passes=("insert_fetch",))
    ctx = make_ctx([w], [0], cfg=cfg)
    run_passes(gm, [], [("insert_fetch", insert_fetch_pass)], ctx=ctx, stage="joint")
    assert [s.pass_name for s in ctx.record.snapshots] == ["input"]
    assert "zinf.fetch_shard.default" not in op_counts(gm.graph)
