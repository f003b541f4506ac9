"""The lookahead schedule (zinf_compile/passes/schedule.py) and the asynchronous runtime under it.

Invariants on the compiled graphs (every wait after its start and before its first use, every
release after the last reader, in-flight bytes under the cap, the serial depths giving today's
order exactly) and numerics: scheduled, serial and unscheduled runs give bitwise the same
gradients and parameters, since the schedule moves transfers, never arithmetic.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch
import torch.fx

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch
from zinf_compile.ops import (ALL_GATHER, FETCH_SHARD, GATHER, KEEP, LOAD, REDUCE, REDUCE_GRAD, RELEASE, UPLOAD,
                              WAIT_GATHER, WAIT_OFFLOAD, WAIT_REDUCE, WAIT_UPLOAD)
from zinf_compile.passes._graph import alias_closure
from zinf_compile.passes.schedule import Chain, _plan_group_lookahead, _plan_reduce_group_waits

from conftest import zinf_full_grads
from test_dp import run_dp

CFG = GPTConfig(vocab=64, seq=16, layers=3, hidden=32, heads=2)
SERIAL = {"prefetch_depths": (0, 0, 0), "reduce_depths": (0, 0), "bucket_bytes": 0}
UNSCHEDULED = {"disabled_passes": ("plan_schedule", "schedule")}
STARTS = {WAIT_UPLOAD: UPLOAD, WAIT_GATHER: GATHER, WAIT_REDUCE: REDUCE}


def _train(options: dict, steps: int = 2, tmp=None, cfg: GPTConfig = CFG) -> Tuple[List[float], Dict, Dict, list]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(cfg)
    opts = dict(compiler="eager", **options)
    if "nvme" in (opts.get("offload_params"), opts.get("offload_optimizer")):
        opts["nvme_path"] = str(tmp)
    cm = torch.compile(model, backend="zinf", options=opts)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], {}
    for step in range(steps):
        x, y = make_batch(cfg, 4, seed=step)
        loss = cm(x, y)
        loss.backward()
        if step == 0:
            grads = zinf_full_grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    records = [r for r in zinf_compile.compile_records() if r.final_modules]
    return losses, grads, zinf_compile.full_state_dict(model), records[-1:]


def _graphs(records) -> List[Tuple[str, torch.fx.Graph]]:
    return [(stage, gm.graph) for r in records for stage, gm in r.final_modules.items()
            if stage in ("forward", "backward", "inference")]


OFFLOADS = [dict(), dict(offload_params="cpu", offload_optimizer="cpu"),
            dict(offload_params="nvme", offload_optimizer="nvme"),
            dict(tiles=3, tile_threshold_bytes=2_000)]


@pytest.mark.parametrize("offload", OFFLOADS, ids=["memory", "cpu", "nvme", "tiled"])
def test_schedule_changes_no_number(offload, tmp_path):
    base = _train({**offload, **UNSCHEDULED}, tmp=tmp_path)
    for variant in (SERIAL, {}, {"prefetch_depths": (4, 3, 2), "reduce_depths": (2, 3)}):
        got = _train({**offload, **variant}, tmp=tmp_path)
        assert got[0] == base[0], variant
        for k, g in base[1].items():
            assert torch.equal(got[1][k], g), (variant, k)
        for k, v in base[2].items():
            assert torch.equal(got[2][k], v), (variant, k)


def _waits_and_releases(graph: torch.fx.Graph) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in STARTS:
            start = n.args[0]
            assert start.target is STARTS[n.target] and order[start] < order[n], n
            users = [u for u in n.users if u.target not in (RELEASE, KEEP)]  # keep: the graph's end, reads nothing
            assert users and all(order[n] < order[u] for u in users), n
            if n.target is WAIT_REDUCE:  # its result is the offload's ticket, waited for later on purpose
                continue
            # right before its first use: nothing but other transfer ops or views of the
            # parameter run between the wait and the node that reads its result
            first = min(users, key=order.__getitem__)
            between = list(graph.nodes)[order[n] + 1:order[first]]
            assert all(b.meta.get("zinf") for b in between), (n, first, between)
        if n.target is WAIT_OFFLOAD:
            assert n.args[0].target is WAIT_REDUCE and order[n.args[0]] < order[n]
        if n.target is RELEASE:
            full = n.args[0]
            readers = {u for a in alias_closure(full) for u in a.users if u is not n and u.target is not KEEP}
            assert all(order[r] < order[n] for r in readers), n
            # the transfer that read the buffer is done: a gathered buffer's all-gather was waited
            # (it is the wait's own result), and a shard read by an all-gather outlives its wait
            if full.target is WAIT_UPLOAD:
                for g in (u for u in full.users if u.target is GATHER):
                    waits = [w for w in g.users if w.target is WAIT_GATHER]
                    assert waits and all(order[w] < order[n] for w in waits)


def test_every_wait_follows_its_start_and_precedes_its_use(tmp_path):
    # every parameter on NVMe (nvme_min_shard_bytes=0): a norm kept in memory at dp 1 is read in
    # place, its fetch_shard left as it is
    *_, records = _train({"offload_params": "nvme", "offload_optimizer": "nvme", "tiles": 2,
                          "tile_threshold_bytes": 2_000, "nvme_min_shard_bytes": 0}, steps=1, tmp=tmp_path)
    graphs = _graphs(records)
    assert {s for s, _ in graphs} >= {"forward", "backward"}
    for stage, g in graphs:
        targets = [n.target for n in g.nodes]
        assert FETCH_SHARD not in targets and REDUCE_GRAD not in targets, stage  # all rewritten
        assert targets.count(LOAD) == targets.count(UPLOAD) == targets.count(WAIT_UPLOAD) > 0, stage
        if stage == "backward":
            assert targets.count(REDUCE) == targets.count(WAIT_REDUCE) == targets.count(WAIT_OFFLOAD) > 0
        _waits_and_releases(g)


def test_prefetch_runs_ahead_by_the_depths(tmp_path):
    *_, records = _train({"offload_params": "nvme", "offload_optimizer": "nvme"}, steps=1, tmp=tmp_path)
    fwd = records[0].final_modules["forward"].graph
    tags = [n.meta["zinf"] for n in fwd.nodes if n.target in (LOAD, UPLOAD)]
    lead = {(t["kind"], t["op"] - t["at"]) for t in tags if t["op"] >= 3}
    assert lead == {("load_start", 3), ("upload_start", 2)}, lead
    # in graph order: the load of operator k comes before operator k-3's compute node
    order = {n: i for i, n in enumerate(fwd.nodes)}
    loads = [n for n in fwd.nodes if n.target is LOAD]
    assert order[loads[-1]] < order[[n for n in fwd.nodes if n.target is WAIT_UPLOAD][-3]]


def _inflight(graph: torch.fx.Graph) -> int:
    """The largest number of bytes fetched ahead of their operator at any point of the graph."""
    peak = 0
    spans = []
    for n in graph.nodes:
        z = n.meta.get("zinf", {})
        if n.target is WAIT_UPLOAD and "schedule" in z:
            s = z["schedule"]
            spans.append((min(s["load_at"], s["upload_at"], s["gather_at"]), s["op"], s["bytes"]))
    for j in range(max((op for _, op, _ in spans), default=0) + 1):
        ahead = sum(b for lo, op, b in spans if max(lo, 0) <= j < op)
        peak = max(peak, ahead)
    return peak


def test_inflight_bytes_stay_under_the_cap(tmp_path):
    # NVMe: fetches move bytes (CPU memory is the compute device's own here: read in place, not scheduled)
    *_, free = _train({"offload_params": "nvme"}, steps=1, tmp=tmp_path)
    uncapped = max(_inflight(g) for _, g in _graphs(free))
    cap = uncapped // 3
    losses, grads, state, capped = _train({"offload_params": "nvme", "max_inflight_bytes": cap}, steps=1,
                                          tmp=tmp_path)
    assert uncapped > 0
    for _, g in _graphs(capped):
        assert _inflight(g) <= cap
    assert capped[0].counters["prefetch_capped"] > 0


def _collapsed(graph: torch.fx.Graph) -> List[str]:
    """Node targets, each scheduled transfer chain written as the blocking op it replaced."""
    out = []
    for n in graph.nodes:
        if n.target in (LOAD, UPLOAD, GATHER, WAIT_REDUCE, WAIT_OFFLOAD):
            continue
        name = {WAIT_UPLOAD: str(FETCH_SHARD), WAIT_GATHER: str(ALL_GATHER), REDUCE: str(REDUCE_GRAD)}.get(
            n.target, str(n.target) if n.op == "call_function" else n.op)
        out.append(name)
    return out


@pytest.mark.parametrize("dp_options", [dict(offload_params="nvme", offload_optimizer="nvme"),
                                        dict(tiles=3, tile_threshold_bytes=2_000)], ids=["nvme", "tiled"])
def test_serial_depths_reproduce_the_unscheduled_order(dp_options, tmp_path):
    *_, plain = _train({**dp_options, **UNSCHEDULED}, steps=1, tmp=tmp_path)
    *_, serial = _train({**dp_options, **SERIAL}, steps=1, tmp=tmp_path)
    for (s1, g1), (s2, g2) in zip(_graphs(plain), _graphs(serial)):
        assert s1 == s2
        assert _collapsed(g1) == _collapsed(g2), s1
        # and each start sits with its wait (nothing in between but its own chain)
        nodes = list(g2.nodes)
        for i, n in enumerate(nodes):
            if n.target in (WAIT_REDUCE,):
                assert nodes[i - 1].target is REDUCE and nodes[i + 1].target is WAIT_OFFLOAD


def test_dynamic_shapes_compile_once_and_match_eager(tmp_path):
    torch._dynamo.reset()
    cfg = GPTConfig(vocab=64, seq=32, layers=2, hidden=32, heads=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    n0 = len(zinf_compile.compile_records())
    # parameters on NVMe, so the schedule has transfers to place (in memory at dp 1 nothing moves)
    cm = torch.compile(model, backend="zinf", dynamic=True, options={"compiler": "eager", "offload_params": "nvme",
                                                                     "nvme_path": str(tmp_path)})
    after_first = None
    for seq in (8, 12, 20):
        x, y = make_batch(GPTConfig(vocab=64, seq=seq, layers=2, hidden=32, heads=2), 2, seed=seq)
        loss, rloss = cm(x, y), ref(x, y)
        loss.backward()
        rloss.backward()
        assert loss.item() == rloss.item(), seq
        zg = zinf_full_grads(model)
        for name, p in ref.named_parameters():
            assert torch.equal(zg[name], p.grad), (seq, name)
        model.zero_grad()
        ref.zero_grad()
        if after_first is None:
            after_first = len(zinf_compile.compile_records())
    # one graph serves every length: nothing compiled after the first (whose compile Dynamo may
    # restart once, to specialize a float: that retrace is part of the first compile)
    assert len(zinf_compile.compile_records()) == after_first
    assert zinf_compile.compile_records()[-1].counters["transfers_scheduled"] > 0
    assert not zinf_compile.compile_records()[-1].counters["gather_all_fallback"]


def test_trace_shows_transfers_under_compute(tmp_path):
    path = tmp_path / "step.json"
    _train({"offload_params": "nvme", "offload_optimizer": "nvme", "trace": str(path)}, steps=3, tmp=tmp_path)
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["cat"] for e in events if e.get("ph") == "X"}
    assert {"compute", "nvme_read", "nvme_write", "h2d", "reduce_scatter", "d2h", "optimizer"} <= lanes, lanes
    writes = [e for e in events if e.get("cat") == "nvme_write"]
    assert all(e["args"]["nbytes"] > 0 and e["dur"] >= 0 for e in writes), writes[:3]
    # the optimizer's own reads of the moments it wrote the step before (not through fetch tickets)
    state_reads = [e for e in events if e.get("cat") == "nvme_read" and e["name"].endswith(".optim")]
    assert state_reads and all(e["args"]["nbytes"] > 0 for e in state_reads), state_reads[:3]
    state_writes = [e for e in writes if e["name"].endswith(".optim")]
    assert {e["name"] for e in state_reads} == {e["name"] for e in state_writes}
    # the step takes units in the order their reads started (their gradients became final), so the
    # last read, started at the end of backward, finishes while the others step
    by_start = [e["name"] for e in sorted(state_reads, key=lambda e: e["ts"])]
    assert [e["name"] for e in sorted(state_writes, key=lambda e: e["ts"])] == by_start
    assert json.loads(path.read_text())["otherData"]["step"] == 1  # the second step, after compile
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert {"compute", "nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter", "optimizer"} <= names


def test_trace_step_records_the_step_asked_for(tmp_path):
    """``trace_step``: the trace holds the step asked for (here the third, counted from 0), written as
    soon as that step's optimizer step ends."""
    path = tmp_path / "step.json"
    _train({"offload_params": "nvme", "offload_optimizer": "nvme", "trace": str(path), "trace_step": 2},
           steps=3, tmp=tmp_path)
    trace = json.loads(path.read_text())
    assert trace["otherData"]["step"] == 2
    assert {"compute", "nvme_read", "optimizer"} <= {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}


def _bucketed_vs_serial(tmp_path):
    """bucket_bytes on top of the default schedule: the same bytes gathered and reduced by fewer
    collectives, so the same numbers as the serial order, bitwise (zinf against zinf: no rounding to
    vary, so not rerun with ATEN_CPU_CAPABILITY=default). The schedule without buckets at dp 2:
    test_dp2_scheduled_equals_serial (make test-slow; CI time)."""
    serial = run_dp(tmp_path, {"compiler": "eager", "prefetch_depths": [0, 0, 0], "reduce_depths": [0, 0],
                               "bucket_bytes": 0})
    (tmp_path / "c").mkdir()
    bucketed = run_dp(tmp_path / "c", {"compiler": "eager", "bucket_bytes": 1 << 14})  # several buckets a graph
    assert bucketed["losses"] == serial["losses"]
    for k, v in serial["state"].items():
        assert torch.equal(bucketed["state"][k], v), k
    for k, v in serial["grads"].items():
        assert torch.equal(bucketed["grads"][k], v), k
    for stage in ("forward", "backward"):
        n_buckets = bucketed["counts"].get(f"{stage}:zinf.gather_bucket.default", 0)
        singles = bucketed["counts"].get(f"{stage}:zinf.gather.default", 0)
        waits = bucketed["counts"].get(f"{stage}:zinf.wait_gather.default", 0)
        assert n_buckets > 0 and singles + n_buckets < waits, (stage, bucketed["counts"])
    reduce_buckets = bucketed["counts"].get("backward:zinf.reduce_bucket.default", 0)
    single_reduces = bucketed["counts"].get("backward:zinf.reduce.default", 0)
    reduce_waits = bucketed["counts"]["backward:zinf.wait_reduce.default"]
    assert reduce_buckets > 0 and reduce_buckets + single_reduces < reduce_waits, bucketed["counts"]
    # the buckets started one bucket ahead (_plan_group_lookahead), and the numbers above did not move
    assert bucketed["record_counters"].get("group_lookahead", 0) > 0, bucketed["record_counters"]
    assert bucketed["record_counters"].get("reduce_group_wait_later", 0) > 0, bucketed["record_counters"]
    return serial, bucketed


def test_dp2_bucketed_schedule_equals_serial(tmp_path):
    _bucketed_vs_serial(tmp_path)


@pytest.mark.slow  # CI time: test_dp2_bucketed_schedule_equals_serial runs the schedule at dp 2 in CI
def test_dp2_scheduled_equals_serial(tmp_path):
    """The default schedule without buckets at dp 2: bitwise the serial order, with waits in the graphs,
    and as many waits as the bucketed schedule (bucketing changes the collectives, not the uses)."""
    (tmp_path / "a").mkdir()
    serial, bucketed = _bucketed_vs_serial(tmp_path / "a")
    (tmp_path / "b").mkdir()
    sched = run_dp(tmp_path / "b", {"compiler": "eager", "bucket_bytes": 0})
    assert serial["losses"] == sched["losses"]
    for k, v in serial["state"].items():
        assert torch.equal(sched["state"][k], v), k
    for k, v in serial["grads"].items():
        assert torch.equal(sched["grads"][k], v), k
    assert sched["counts"].get("forward:zinf.wait_gather.default", 0) > 0, sched["counts"]
    for stage in ("forward", "backward"):
        assert bucketed["counts"][f"{stage}:zinf.wait_gather.default"] == \
            sched["counts"][f"{stage}:zinf.wait_gather.default"]
    assert bucketed["counts"]["backward:zinf.wait_reduce.default"] == sched["counts"]["backward:zinf.wait_reduce.default"]


def _planning_ctx() -> SimpleNamespace:
    """What the group rules read of a CompileContext: the record's counters."""
    return SimpleNamespace(record=SimpleNamespace(counters=Counter()))


def _fake_chains(groups: List[List[int]], nbytes: int = 100) -> list:
    """Chains of a graph with one parameter-using operator per chain, grouped into buckets as given
    (a group of one is a parameter gathered alone), scheduled one operator ahead as
    plan_schedule_pass tags them before the group lookahead."""
    g = torch.fx.Graph()
    chains, op = [], 0
    for b, size in enumerate(groups):
        for i in range(size):
            fetch = g.placeholder(f"p{op}")
            fetch.meta["zinf"] = {"schedule": {"op": op, "load_at": op - 1, "upload_at": op - 1,
                                               "gather_at": op - 1, "bytes": nbytes}}
            if size > 1:
                fetch.meta["zinf"]["schedule"].update(bucket=b, bucket_index=i)
            chains.append(Chain(fetch, fetch, fetch, op, nbytes))
            op += 1
    for c in chains:  # a bucket starts where its first member's gather would (_plan_buckets)
        s = c.fetch.meta["zinf"]["schedule"]
        if "bucket" in s:
            first = min(d.fetch.meta["zinf"]["schedule"]["op"] for d in chains
                        if d.fetch.meta["zinf"]["schedule"].get("bucket") == s["bucket"])
            s.update(gather_at=first - 1, upload_at=first - 1, load_at=first - 1)
    return chains


def _starts(chains: list) -> List[int]:
    return [c.fetch.meta["zinf"]["schedule"]["gather_at"] for c in chains]


def test_a_bucket_starts_at_the_previous_groups_first_use():
    """The gather of each group starts no later than the first use of the group before it (depth 1):
    a bucket of three operators starts while the previous bucket's operators run, not one operator
    before its own first use. A parameter gathered alone after another one keeps its one-operator
    lookahead (the group before it is one operator)."""
    ctx = _planning_ctx()
    chains = _fake_chains([3, 3, 1, 3])  # ops 0-2, 3-5, 6, 7-9
    _plan_group_lookahead(chains, 10, 1, None, ctx)
    assert _starts(chains) == [-1, -1, -1, 0, 0, 0, 3, 6, 6, 6]
    assert ctx.record.counters["group_lookahead"] == 2
    ctx.record.counters.clear()
    chains = _fake_chains([3, 1, 1, 3])  # ops 0-2, 3, 4, 5-7
    _plan_group_lookahead(chains, 8, 1, None, ctx)
    assert _starts(chains) == [-1, -1, -1, 0, 3, 4, 4, 4]
    assert ctx.record.counters["group_lookahead"] == 1
    for c in chains:  # the member's upload and load come no later than its gather
        s = c.fetch.meta["zinf"]["schedule"]
        assert s["load_at"] <= s["gather_at"] and s["upload_at"] <= s["gather_at"]
    chains = _fake_chains([3, 3, 1, 3])
    _plan_group_lookahead(chains, 10, 0, None, ctx)  # gather depth 0: the serial schedule stays serial
    assert _starts(chains) == [-1, -1, -1, 2, 2, 2, 5, 6, 6, 6]


def test_the_group_lookahead_keeps_inflight_bytes_under_the_cap():
    ctx = _planning_ctx()
    # two buckets of 3 x 100 bytes: the second one ahead while the first runs is 500 bytes at op 2
    for cap, starts in ((None, [-1, -1, -1, 0, 0, 0]), (500, [-1, -1, -1, 0, 0, 0]), (499, [-1, -1, -1, 1, 1, 1]),
                        (399, [-1, -1, -1, 2, 2, 2])):
        chains = _fake_chains([3, 3])
        _plan_group_lookahead(chains, 6, 1, cap, ctx)
        assert _starts(chains) == starts, cap
        spans = [(max(c.fetch.meta["zinf"]["schedule"]["gather_at"], 0), c.fetch.meta["zinf"]["schedule"]["op"])
                 for c in chains]
        peak = max(sum(100 for lo, op in spans if lo <= j < op) for j in range(6))
        assert cap is None or peak <= cap, (cap, peak)
    assert ctx.record.counters["group_lookahead_capped"] == 1


def _fake_reduces(groups: List[int], rd: int = 1, od: int = 2) -> list:
    """reduce_grad nodes in gradient order, grouped into buckets as given, tagged as plan_schedule_pass
    and _plan_reduce_buckets tag them (a bucket's members waited no earlier than its last gradient)."""
    g = torch.fx.Graph()
    nodes, j = [], 0
    for b, size in enumerate(groups):
        last = j + size - 1
        for i in range(size):
            n = g.placeholder(f"g{j}")
            z = {"grad": j, "wait_at": j + rd, "offload_at": j + max(rd, od)}
            if size > 1:
                z.update(bucket=b, bucket_index=i, bucket_last=last, wait_at=max(j + rd, last),
                         offload_at=max(j + max(rd, od), last))
            n.meta["zinf"] = {"schedule": z}
            nodes.append(n)
            j += 1
    return nodes


def test_a_reduce_bucket_is_waited_for_after_the_next_groups_last_gradient():
    """Before: every member of a bucket but the last was waited for at the bucket's own last gradient,
    right after its collective started. Now the whole bucket waits until the next group's last
    gradient exists (depth 1), its offload one group later (depth 2); the last groups at the end."""
    ctx = _planning_ctx()
    nodes = _fake_reduces([3, 1, 1, 3])  # gradients 0-2, 3, 4, 5-7
    _plan_reduce_group_waits(nodes, 1, 2, ctx)
    waits = [n.meta["zinf"]["schedule"]["wait_at"] for n in nodes]
    offloads = [n.meta["zinf"]["schedule"]["offload_at"] for n in nodes]
    assert waits == [3, 3, 3, 4, 7, 8, 8, 8], waits
    assert offloads == [4, 4, 4, 7, 8, 8, 8, 9], offloads  # 8 and over: the graph's end
    # every group moved: gradient 3's offload counts two groups (to 7), not two gradients (5)
    assert ctx.record.counters["reduce_group_wait_later"] == 4
    nodes = _fake_reduces([3, 3], rd=0, od=0)
    before = [dict(n.meta["zinf"]["schedule"]) for n in nodes]
    _plan_reduce_group_waits(nodes, 0, 0, ctx)  # depth 0: serial, untouched
    assert [n.meta["zinf"]["schedule"] for n in nodes] == before


def test_schedule_options_are_checked():
    for bad in ({"prefetch_depths": (1, 2)}, {"prefetch_depths": (-1, 0, 0)}, {"reduce_depths": (1,)},
                {"max_inflight_bytes": -1}, {"bucket_bytes": -1}, {"bucket_bytes": 10, "max_inflight_bytes": 5},
                {"bucket_bytes": 10, "partition": "broadcast"},
                {"trace": 3}, {"trace_step": -1}, {"trace_step": 1.5}, {"trace_step": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            zinf_compile.Config(**bad)
    assert zinf_compile.Config(prefetch_depths=[0, 0, 0]).prefetch_depths == (0, 0, 0)


def test_bucket_bytes_default_is_on_for_bandwidth_and_off_for_broadcast():
    """bucket_bytes=None: 8 MiB buckets, at most the in-flight cap; none with the single-owner scheme
    (it broadcasts each parameter), where only an explicit value is refused."""
    from zinf_compile.config import DEFAULT_BUCKET_BYTES
    Config = zinf_compile.Config
    assert Config().bucket_bytes is None and Config().bucket_limit == DEFAULT_BUCKET_BYTES == 8 << 20
    assert Config(max_inflight_bytes=1 << 20).bucket_limit == 1 << 20
    assert Config(partition="broadcast").bucket_limit == 0
    assert Config(bucket_bytes=0).bucket_limit == 0 and Config(bucket_bytes=5).bucket_limit == 5


def test_a_graph_that_raises_midway_leaves_no_transfer_pending(tmp_path):
    """A forward that raises between a start and its wait: the next call waits for and drops the
    stale transfers first, and then trains exactly as a model that never failed."""
    import zinf_runtime
    import zinf_runtime.ops as rops
    from zinf_runtime import transfer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    cm = torch.compile(model, backend="zinf", options={"compiler": "eager", "offload_params": "nvme",
                                                        "nvme_path": str(tmp_path)})
    x, y = make_batch(CFG, 2, seed=0)
    cm(x, y).backward()  # compile
    model.zero_grad()
    real, calls = transfer.op_wait_upload, [0]

    def flaky(*a):
        calls[0] += 1
        if calls[0] == 5:
            raise OSError("simulated read failure")
        return real(*a)

    rops._lib.impl("wait_upload", flaky, "CompositeExplicitAutograd", allow_override=True)
    try:
        with pytest.raises(OSError, match="simulated"):
            cm(x, y)
        engines = {id(h.context.transfers): h.context.transfers
                   for h in (zinf_runtime.handle_of(p) for p in model.parameters()) if h}
        assert any(e.in_flight for e in engines.values())  # the prefetches started before the failure
    finally:
        rops._lib.impl("wait_upload", real, "CompositeExplicitAutograd", allow_override=True)
    loss = cm(x, y)
    loss.backward()
    assert all(not e.in_flight for e in engines.values())
    rloss = ref(x, y)
    rloss.backward()
    assert loss.item() == rloss.item()
    zg = zinf_full_grads(model)
    for name, p in ref.named_parameters():
        assert torch.equal(zg[name], p.grad), name
