"""The lookahead schedule: plan (tags) then rewrite each blocking transfer into a start and a wait.

Runs on the forward, backward and inference graphs, after ``insert_release``. Counted in
parameter-using operators (the first compute node reading a gathered parameter; an ``addmm``
reading a weight and a bias is one operator), never in seconds, so the same graph serves every
shape. With the default depths ``(nvme, upload, gather) = (3, 2, 1)`` and ``reduce_depths = (1, 2)``::

    before:  s2 = fetch_shard(p2); w2 = all_gather(s2); mm(x, w2); release(w2)
             g2 = ...; reduce_grad(g2, p2)
    after:   t = load(p5)                      # NVMe read for operator i+3
             u = upload(p4, t4)                # host -> device for operator i+2
             s3 = wait_upload(u3); a = gather(s3)   # all-gather for operator i+1
             w2 = wait_gather(a2, s2)          # operator i's own wait, right before its use
             mm(x, w2); release(w2)
             r = reduce(g2, p2) ... wait_reduce(r, g2) after the next gradient,
             ... wait_offload after the one after that (the graph's end at the latest)

Where nothing moves (dp = 1, the shard in the compute device's memory: it is read in place, and
the gradient's slot is in that memory too) the fetch and the ``reduce_grad`` stay single ops: a
start/wait pair would only add a custom-op call and split Inductor's fusion there.

``plan_schedule_pass`` only tags: each fetch node gets ``meta["zinf"]["schedule"] = {"op": k,
"load_at", "upload_at", "gather_at"}`` (operator indices; negative: the graph's top) and each
``reduce_grad`` node ``{"grad": j, "wait_at", "offload_at"}``. A prefetch that would push the bytes
fetched ahead of their use over ``max_inflight_bytes`` starts later, down to the serial schedule.
With a ``device_memory_budget`` (planned for the serial schedule) and no ``max_inflight_bytes``,
only NVMe -> host reads run ahead (host memory); with both, the cap is at most half the budget. ``schedule_pass`` acts on the tags: it
replaces the nodes, gives every node a priority (its original position; a start the position of
the operator it must precede), and orders the graph with a stable priority topological sort of its
dependency graph (networkx), so data dependencies always win over priorities. Depths ``(0, 0, 0)``
and ``(0, 0)`` give exactly the serial order (checked by tests).

With ``bucket_bytes``, runs of consecutive small gathers (operator order) become one
``zinf.gather_bucket`` (``zinf_runtime.bucket``), started where the run's first gather would start
and no later than the first use of the bucket before it (the gather depth counted in collectives);
each member keeps its ticket and its ``wait_gather``. Off under a ``device_memory_budget`` without
``max_inflight_bytes`` (a bucket fetches its later members early); under a cap, a bucket holds at
most the cap. In backward, runs of consecutive small gradients likewise become one
``zinf.reduce_bucket``, started once the run's last gradient exists.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import networkx as nx
import torch
import torch.fx

from ..ops import ALL_GATHER, FETCH_SHARD, REDUCE_GRAD, is_zinf, tag
from ..pipeline import CompileContext
from ._graph import positions

Z = torch.ops.zinf


@dataclasses.dataclass
class Chain:
    """One fetch of one parameter: shard fetch, gather (dp > 1) and the operator that uses it."""

    fetch: torch.fx.Node
    gather: Optional[torch.fx.Node]  # None at dp = 1 (a view of the shard)
    use: torch.fx.Node
    uid: int
    nbytes: int


def _use_node(start: torch.fx.Node, pos: Dict[torch.fx.Node, int]) -> Optional[torch.fx.Node]:
    """The first compute node reading ``start`` through views, casts and other parameter-derived
    nodes (those are part of the fetch, not operators)."""
    frontier, best = [start], None
    seen = set()
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            z = u.meta.get("zinf", {})
            if u.op == "call_function" and (z.get("kind") in ("param_derived", "all_gather")
                                            or u.target is torch.ops.aten.view.default and z):
                frontier.append(u)
            elif is_zinf(u) and z.get("kind") == "release":
                continue
            elif best is None or pos[u] < pos[best]:
                best = u
    return best


def find_chains(graph: torch.fx.Graph) -> List[Chain]:
    pos = positions(graph)
    chains = []
    for n in graph.nodes:
        if not is_zinf(n, FETCH_SHARD):
            continue
        gather = next((u for u in n.users if is_zinf(u, ALL_GATHER)), None)
        use = _use_node(gather or n, pos)
        if use is None:
            continue
        val = n.meta.get("val")
        nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
        if gather is not None and isinstance(gather.meta.get("val"), torch.Tensor):
            nbytes = gather.meta["val"].numel() * gather.meta["val"].element_size()
        chains.append(Chain(n, gather, use, n.args[1], nbytes))
    return chains


def _inflight_cap(ctx: CompileContext) -> Optional[int]:
    cap = ctx.cfg.max_inflight_bytes
    budget = ctx.cfg.device_memory_budget
    if budget is not None:  # tiling sizes each operator's working memory to half the budget
        cap = budget // 2 if cap is None else min(cap, budget // 2)
    return cap


def in_place_uids(ctx: CompileContext) -> Tuple[set, set]:
    """Parameters whose fetch moves nothing, and those whose gradient moves nothing (uids).

    At dp = 1 a shard in the compute device's memory (the device tier, or the CPU tier when the
    compute device is the CPU) is read where it lives (``ParamHandle.shard_in_place``) and, with the
    optimizer's tier in that memory too, its gradient is added into a slot there: there is no
    transfer to start early, and splitting the op into a start and a wait would only add a custom-op
    call and cut Inductor's fusion at one more place. Each parameter's own tiers decide, not the
    options: ``nvme_min_shard_bytes`` keeps a small parameter's NVMe tiers in CPU memory."""
    local = _local_tiers(ctx)
    fetch: set = set()
    grad: set = set()
    for info in ctx.params.values():
        if info.world != 1:
            continue
        uids = {info.uid} | {uid for uid, _, _ in info.parts}  # tiles share their weight's placement
        if info.tier in local:
            fetch |= uids
        if info.optim_tier in local:
            grad |= uids
    return fetch, grad


def _local_tiers(ctx: CompileContext) -> Tuple[str, ...]:
    """Tiers in the compute device's own memory, where a dp-1 fetch reads in place; none under a
    ``device_memory_budget`` (fetches then copy into budgeted buffers: ``ParamHandle.reads_in_place``)."""
    if ctx.cfg.device_memory_budget is not None:
        return ()
    return ("device", "cpu") if ctx.device_type == "cpu" else ("device",)


def plan_schedule_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                       ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    pos = positions(graph)
    still_fetch, still_grad = in_place_uids(ctx)
    chains = []
    for c in find_chains(graph):  # every fetch's uid is an input's or its tile's (ctx.params)
        if c.uid in still_fetch:
            ctx.record.counters["fetch_in_place"] += 1
        else:
            chains.append(c)
    uses = sorted({c.use for c in chains}, key=pos.__getitem__)
    op_of = {u: k for k, u in enumerate(uses)}
    nc, cg, gg = ctx.cfg.prefetch_depths
    rd, od = ctx.cfg.reduce_depths
    if ctx.cfg.device_memory_budget is not None and ctx.cfg.max_inflight_bytes is None:
        # the budget was planned for the serial schedule (plan_tiling sizes each operator's working
        # memory to it, and parameters live across operators, a tied embedding, count too): only
        # the NVMe -> host reads, which cost host memory, run ahead; device-side transfers and
        # gradient lifetimes stay serial unless max_inflight_bytes says how much more may be live
        cg = gg = rd = od = 0
        ctx.record.counters["schedule_serial_on_device_for_budget"] += 1
    cap = _inflight_cap(ctx)
    ahead = [0] * (len(uses) + 1)  # bytes fetched ahead of their use while operator j runs
    for c in sorted(chains, key=lambda c: (op_of[c.use], pos[c.fetch])):
        k = op_of[c.use]
        depth = max(nc, cg, gg)
        if cap is not None and (cg or gg):  # shorten the lookahead until the bytes in flight fit under the cap
            while depth > 0 and any(ahead[j] + c.nbytes > cap for j in range(max(k - depth, 0), k)):
                depth -= 1
        for j in range(max(k - depth, 0), k):
            ahead[j] += c.nbytes
        z = c.fetch.meta["zinf"]
        z["schedule"] = {"op": k, "load_at": k - min(nc, depth), "upload_at": k - min(cg, depth),
                         "gather_at": k - min(gg, depth), "bytes": c.nbytes}
        if depth < max(nc, cg, gg):
            ctx.record.counters["prefetch_capped"] += 1
    reduces = []
    for n in graph.nodes:
        if not is_zinf(n, REDUCE_GRAD):
            continue
        if n.args[2] in still_grad:
            ctx.record.counters["reduce_in_place"] += 1
        else:
            reduces.append(n)
    for j, n in enumerate(reduces):
        n.meta["zinf"]["schedule"] = {"grad": j, "wait_at": j + rd, "offload_at": j + max(rd, od)}
    if ctx.cfg.bucket_limit:
        if ctx.cfg.device_memory_budget is not None and ctx.cfg.max_inflight_bytes is None:
            # a bucket fetches its later members early and keeps its earlier gradients late
            ctx.record.counters["buckets_off_for_budget"] += 1
        else:
            limit = ctx.cfg.bucket_limit if cap is None else min(ctx.cfg.bucket_limit, cap)
            ordered = sorted(chains, key=lambda c: (op_of[c.use], pos[c.fetch]))
            _plan_buckets(ordered, limit, ctx)
            _plan_group_lookahead(ordered, len(uses), gg, cap, ctx)
            dp = {info.uid: info.world for info in ctx.params.values()}
            sharded = [n for n in reduces if dp.get(n.args[2], 1) > 1]
            _plan_reduce_buckets(sharded, limit, ctx)
            _plan_reduce_group_waits(sharded, rd, od, ctx)
    ctx.record.counters["scheduled_operators"] += len(uses)
    return gm


def _runs(items: List[Any], limit: int, info: Any) -> List[List[Any]]:
    """Group ``items`` (in order) into runs of at most ``limit`` bytes; ``info(item)`` gives
    ``(nbytes or None: never bucketed, dtype, uid, position)``. A run breaks at an item too big, another
    dtype, a repeated uid or a gap in positions; only runs of two or more are returned."""
    runs: List[List[Any]] = [[]]
    size = 0
    for item in items:
        nbytes, dtype, uid, where = info(item)
        last = runs[-1]
        if last and (nbytes is None or nbytes > limit or size + nbytes > limit or info(last[0])[1] != dtype
                     or uid in {info(r)[2] for r in last} or where != info(last[-1])[3] + 1):
            runs.append([])
            size = 0
        if nbytes is not None and nbytes <= limit:
            runs[-1].append(item)
            size += nbytes
    return [r for r in runs if len(r) > 1]


def _plan_buckets(chains: List[Chain], limit: int, ctx: CompileContext) -> None:
    """Tag runs of consecutive small gathers (operator order, one dtype, at most ``limit`` gathered
    bytes together) as buckets: the bucket's gather starts where its first member's would, and every
    member's load and upload no later. The members' bytes are in flight from that start on."""
    index = {id(c): i for i, c in enumerate(chains)}

    def info(c: Chain) -> Tuple[Optional[int], Any, int, int]:
        val = c.gather.meta.get("val") if c.gather is not None else None
        ok = isinstance(val, torch.Tensor)
        return (c.nbytes if ok else None), (val.dtype if ok else None), c.uid, index[id(c)]

    for count, run in enumerate(_runs(chains, limit, info)):
        at = min(c.fetch.meta["zinf"]["schedule"]["gather_at"] for c in run)
        for i, c in enumerate(run):
            z = c.fetch.meta["zinf"]["schedule"]
            z.update(bucket=count, bucket_index=i, gather_at=at, upload_at=min(z["upload_at"], at),
                     load_at=min(z["load_at"], at))
        ctx.record.counters["gather_buckets"] += 1
        ctx.record.counters["bucketed_gathers"] += len(run)


def _groups(items: List[Any], buckets: List[Optional[int]]) -> List[List[Any]]:
    """``items`` (in order) as collectives: the members of one bucket together, every other item alone."""
    groups: List[List[Any]] = []
    by_bucket: Dict[int, List[Any]] = {}
    for item, b in zip(items, buckets):
        if b is not None and b in by_bucket:
            by_bucket[b].append(item)
            continue
        groups.append([item])
        if b is not None:
            by_bucket[b] = groups[-1]
    return groups


def _plan_group_lookahead(chains: List[Chain], n_ops: int, depth: int, cap: Optional[int],
                          ctx: CompileContext) -> None:
    """Start each gather group (a bucket, or a parameter gathered alone) no later than the first use
    of the group ``depth`` groups before it: the all-gather for the next bucket runs while this
    bucket's operators compute, the paper's "all-gather for i+1" counted in collectives.

    Why: counted in operators alone, the bucket that holds a transformer block's matmuls starts one
    operator ahead, which is the block's own layer norm, so nearly all of its exchange was waited
    for (the 25M GPT at dp 2 on gloo: one 5-9 ms wait per block per pass, 130-170 ms a step, in
    ``options={"trace": ...}``). Pulled to the previous bucket's first use, those waits were gone
    and the step 4% faster, paired in one process (README "Buckets start one bucket ahead").
    A parameter gathered alone after another one already starts there (one operator ahead); after a
    bucket it moves to that bucket's first use like a bucket would. The bytes fetched ahead stay
    under ``cap``: a group that would push them over starts as late as fits, down to where it was."""
    if depth == 0:
        return
    gathered = [c for c in chains if c.gather is not None]
    groups = _groups(gathered, [c.fetch.meta["zinf"]["schedule"].get("bucket") for c in gathered])

    def sched(c: Chain) -> Dict[str, Any]:
        return c.fetch.meta["zinf"]["schedule"]

    def lo(c: Chain) -> int:
        s = sched(c)
        return max(min(s["load_at"], s["upload_at"], s["gather_at"]), 0)

    ahead = [0] * (n_ops + 1)  # bytes fetched ahead of their use while operator j runs
    for c in chains:
        for j in range(lo(c), sched(c)["op"]):
            ahead[j] += c.nbytes
    for i in range(depth, len(groups)):
        group = groups[i]
        target = min(sched(c)["op"] for c in groups[i - depth])
        start = min(sched(c)["gather_at"] for c in group)
        new = target
        while cap is not None and new < start and any(
                ahead[j] + sum(c.nbytes for c in group if j < lo(c)) > cap for j in range(new, start)):
            new += 1
        if new >= start:
            if target < start:
                ctx.record.counters["group_lookahead_capped"] += 1
            continue
        for c in group:
            for j in range(new, lo(c)):
                ahead[j] += c.nbytes
            s = sched(c)
            s.update(gather_at=new, upload_at=min(s["upload_at"], new), load_at=min(s["load_at"], new))
        ctx.record.counters["group_lookahead"] += 1


def _plan_reduce_buckets(reduces: List[torch.fx.Node], limit: int, ctx: CompileContext) -> None:
    """Tag runs of consecutive small reduces (gradient order, one dtype, at most ``limit`` gradient
    bytes) as buckets reduced by one collective once the last member's gradient exists; no member is
    waited for before that."""

    def info(n: torch.fx.Node) -> Tuple[Optional[int], Any, int, int]:
        val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        ok = isinstance(val, torch.Tensor)
        return ((val.numel() * val.element_size()) if ok else None, (val.dtype if ok else None), n.args[2],
                n.meta["zinf"]["schedule"]["grad"])

    for count, run in enumerate(_runs(reduces, limit, info)):
        last = run[-1].meta["zinf"]["schedule"]["grad"]
        for i, n in enumerate(run):
            z = n.meta["zinf"]["schedule"]
            z.update(bucket=count, bucket_index=i, bucket_last=last, wait_at=max(z["wait_at"], last),
                     offload_at=max(z["offload_at"], last))
        ctx.record.counters["reduce_buckets"] += 1
        ctx.record.counters["bucketed_reduces"] += len(run)


def _plan_reduce_group_waits(reduces: List[torch.fx.Node], rd: int, od: int, ctx: CompileContext) -> None:
    """Wait for each reduce group's collective (a bucket, or a gradient reduced alone) no earlier than
    the last gradient of the group ``rd`` groups after it, and for its offload ``max(rd, od)`` groups
    after it: the reduce depths counted in collectives, as the gather depth is.

    Why: a bucket's members share one collective, and counted in gradients a member's wait fell on
    the bucket's own last gradient, right after the collective started, so every bucket but its last
    member waited for the whole exchange at once (the 25M GPT at dp 2 on gloo: one 5-13 ms wait per
    block in backward, 70-80 ms a step, in ``options={"trace": ...}``). A gradient reduced alone
    after another one keeps its wait ``rd`` gradients later. Depth 0 stays serial."""
    if rd == 0:
        return
    groups = _groups(reduces, [n.meta["zinf"]["schedule"].get("bucket") for n in reduces])
    last = [max(n.meta["zinf"]["schedule"]["grad"] for n in g) for g in groups]
    end = max((n.meta["zinf"]["schedule"]["grad"] for n in reduces), default=-1) + 1
    for i, group in enumerate(groups):
        wait = last[i + rd] if i + rd < len(groups) else end
        offload = last[i + max(rd, od)] if i + max(rd, od) < len(groups) else end
        moved = False
        for n in group:
            z = n.meta["zinf"]["schedule"]
            if wait > z["wait_at"] or offload > z["offload_at"]:
                moved = True
            z.update(wait_at=max(z["wait_at"], wait), offload_at=max(z["offload_at"], offload, wait))
        ctx.record.counters["reduce_group_wait_later"] += int(moved)


def schedule_pass(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                  ctx: CompileContext) -> torch.fx.GraphModule:
    graph = gm.graph
    pos = positions(graph)
    chains = [c for c in find_chains(graph) if "schedule" in c.fetch.meta["zinf"]]
    reduces = [n for n in graph.nodes if is_zinf(n, REDUCE_GRAD) and "schedule" in n.meta["zinf"]]
    if not chains and not reduces:
        return gm
    out = graph.find_nodes(op="output")[0]
    uses = sorted({c.use for c in chains}, key=pos.__getitem__)
    key: Dict[torch.fx.Node, Tuple[int, float, int]] = {}

    def before_op(k: int, stage: int) -> Tuple[int, float, int]:
        """Priority of a start that must run before operator ``k`` (k < 0: the graph's top)."""
        if k < 0:
            return (1, -1.0, stage)
        return (1, pos[uses[k]] - 0.5, stage)

    # NVMe-resident shards get a read of their own (tiles made by this compile have new uids: the
    # option decides for them); a memory-tier shard given a load gets an empty ticket, and one
    # missing a load is read at its upload, so a wrong guess costs time, never correctness
    nvme = {info.uid for info in ctx.params.values() if info.tier == "nvme"}
    nvme |= {uid for info in ctx.params.values() if info.tier == "nvme" for uid, _, _ in info.parts}
    all_nvme = ctx.cfg.offload_params == "nvme"
    buckets: Dict[int, List[Tuple[Chain, torch.fx.Node, Optional[torch.fx.Node], torch.fx.Node]]] = {}
    for c in chains:
        s = c.fetch.meta["zinf"]["schedule"]
        ph, uid, n, dtype = c.fetch.args
        z = dict(c.fetch.meta["zinf"])
        with graph.inserting_before(c.fetch):
            load = graph.call_function(Z.load.default, (ph, uid)) if all_nvme or uid in nvme else None
            up = graph.call_function(Z.upload.default, (ph, uid, n, dtype, load))
            shard = graph.call_function(Z.wait_upload.default, (up, ph, uid, n, dtype))
        shard.meta.update({k: v for k, v in c.fetch.meta.items()})
        c.fetch.replace_all_uses_with(shard)
        graph.erase_node(c.fetch)
        here = float(pos[c.fetch])
        for node, kind, stage, at in ((load, "load_start", 0, s["load_at"]), (up, "upload_start", 1, s["upload_at"])):
            if node is not None:
                node.meta["val"] = torch.empty(1, dtype=torch.int64)
                tag(node, kind, uid, param=z.get("param"), op=s["op"], at=at)
                # no lookahead: where the blocking fetch was (the serial order, exactly)
                key[node] = before_op(at, stage) if at < s["op"] else (1, here, stage)
        if c.gather is None:
            key[shard] = (1, here, 2)
            continue
        if "bucket" in s:
            buckets.setdefault(s["bucket"], []).append((c, shard, load, up))
            continue
        gz = dict(c.gather.meta["zinf"])
        shape = c.gather.args[2]
        with graph.inserting_before(c.gather):
            start = graph.call_function(Z.gather.default, (shard, uid, shape))
            full = graph.call_function(Z.wait_gather.default, (start, shard, uid, shape))
        full.meta.update(c.gather.meta)
        c.gather.replace_all_uses_with(full)
        start.meta["val"] = torch.empty(1, dtype=torch.int64)
        tag(start, "gather_start", uid, param=gz.get("param"), op=s["op"], at=s["gather_at"])
        g_here = float(pos[c.gather])
        k_start = before_op(s["gather_at"], 3) if s["gather_at"] < s["op"] else (1, g_here, 0)
        key[start] = k_start
        # the upload is waited for right before the gather starts (serial: where the fetch was)
        key[shard] = (k_start[0], k_start[1], 2) if s["gather_at"] < s["op"] else (1, here, 2)
        key[full] = (1, g_here, 1)
        graph.erase_node(c.gather)

    for members in buckets.values():
        _rewrite_bucket(graph, members, key, pos, before_op)

    anchors = [pos[n] for n in reduces]
    red_buckets: Dict[int, torch.fx.Node] = {}
    for n in reduces:
        s = n.meta["zinf"]["schedule"]
        g, param, uid = n.args
        if "bucket" in s:  # one reduce_bucket for the run, placed at its last gradient
            last = reduces[[r.meta["zinf"]["schedule"]["grad"] for r in reduces].index(s["bucket_last"])]
            if s["bucket"] not in red_buckets:
                members = [r for r in reduces if r.meta["zinf"]["schedule"].get("bucket") == s["bucket"]]
                members.sort(key=lambda r: r.meta["zinf"]["schedule"]["bucket_index"])
                with graph.inserting_before(last):
                    b = graph.call_function(Z.reduce_bucket.default, ([r.args[0] for r in members],
                                                                      [r.args[1] for r in members],
                                                                      [r.args[2] for r in members]))
                b.meta["val"] = [torch.empty(1, dtype=torch.int64) for _ in members]
                tag(b, "reduce_bucket_start", members[0].args[2],
                    params=[r.meta["zinf"].get("param") for r in members], grad=s["bucket_last"])
                key[b] = (1, float(pos[last]), 0)
                red_buckets[s["bucket"]] = b
            with graph.inserting_before(n):
                red = graph.call_function(operator.getitem, (red_buckets[s["bucket"]], s["bucket_index"]))
            here, first_grad = float(pos[last]), s["bucket_last"]
            key[red] = (1, here, 0.5)
        else:
            with graph.inserting_before(n):
                red = graph.call_function(Z.reduce.default, (g, param, uid))
            here, first_grad = float(pos[n]), s["grad"]
            key[red] = (1, here, 0)
        with graph.inserting_before(n):
            rw = graph.call_function(Z.wait_reduce.default, (red, g, param, uid))
            ow = graph.call_function(Z.wait_offload.default, (rw, g, uid))
        for node, kind in ((red, "reduce_start"), (rw, "reduce_wait"), (ow, "offload_wait")):
            if node is not ow:
                node.meta["val"] = torch.empty(1, dtype=torch.int64)
            if node.target is not operator.getitem:
                tag(node, kind, uid, param=n.meta["zinf"].get("param"), grad=s["grad"])
        for node, at, stage in ((rw, s["wait_at"], 1), (ow, s["offload_at"], 2)):
            if at == first_grad:
                key[node] = (1, here, stage)  # serial: right after the reduce starts
            elif at < len(anchors):
                key[node] = (1, anchors[at] - 0.5, stage)  # after the later gradient is computed
            else:
                key[node] = (1, pos[out] - 0.5, stage)
        graph.erase_node(n)

    _reorder(graph, key, pos)
    ctx.record.counters["transfers_scheduled"] += len(chains) + len(reduces)
    return gm


def _rewrite_bucket(graph: torch.fx.Graph, members: List[Tuple[Chain, torch.fx.Node, Optional[torch.fx.Node], torch.fx.Node]],
                    key: Dict[torch.fx.Node, Tuple[int, float, int]], pos: Dict[torch.fx.Node, int],
                    before_op: Any) -> None:
    """One ``gather_bucket`` for the members' gathers; each member keeps its own ticket and wait."""
    members = sorted(members, key=lambda m: m[0].fetch.meta["zinf"]["schedule"]["bucket_index"])
    first = members[0][0]
    s0 = first.fetch.meta["zinf"]["schedule"]
    with graph.inserting_before(first.gather):
        start = graph.call_function(Z.gather_bucket.default, ([m[1] for m in members], [m[0].uid for m in members]))
    start.meta["val"] = [torch.empty(1, dtype=torch.int64) for _ in members]
    tag(start, "gather_bucket_start", first.uid, params=[m[0].gather.meta["zinf"].get("param") for m in members],
        op=s0["op"], at=s0["gather_at"])
    k_start = before_op(s0["gather_at"], 3) if s0["gather_at"] < s0["op"] else (1, float(pos[first.gather]), 0)
    key[start] = k_start
    for i, (c, shard, load, up) in enumerate(members):
        for node, stage in ((load, 0), (up, 1), (shard, 2)):  # every member's shard is in before the start
            if node is not None:
                key[node] = min(key.get(node, (1, float("inf"), stage)), (k_start[0], k_start[1] - 0.25, stage))
        shape = c.gather.args[2]
        with graph.inserting_before(c.gather):
            ticket = graph.call_function(operator.getitem, (start, i))
            full = graph.call_function(Z.wait_gather.default, (ticket, shard, c.uid, shape))
        ticket.meta["val"] = torch.empty(1, dtype=torch.int64)
        full.meta.update(c.gather.meta)
        c.gather.replace_all_uses_with(full)
        key[ticket] = (k_start[0], k_start[1], k_start[2] + 0.5)
        key[full] = (1, float(pos[c.gather]), 1)
        graph.erase_node(c.gather)


def _reorder(graph: torch.fx.Graph, key: Dict[torch.fx.Node, Tuple[int, float, int]],
             pos: Dict[torch.fx.Node, int]) -> None:
    """Order ``graph`` by a stable priority topological sort: the smallest-priority ready node
    first. Old nodes keep their relative order (their priorities are their positions, a valid
    topological order); nodes with side effects are chained so they never pass each other."""
    dag = nx.DiGraph()
    nodes = list(graph.nodes)
    prio: Dict[torch.fx.Node, Tuple[int, float, int]] = {}
    for n in nodes:
        if n.op == "placeholder":
            prio[n] = (0, float(pos[n]), 0)
        elif n.op == "output":
            prio[n] = (2, 0.0, 0)
        else:
            prio[n] = key.get(n, (1, float(pos.get(n, -1)), 0))
        dag.add_node(n)
        for i in n.all_input_nodes:
            dag.add_edge(i, n)
    last_effect = None
    for n in nodes:
        if n.op == "call_function" and n in pos and _has_effect(n):
            if last_effect is not None:
                dag.add_edge(last_effect, n)
            last_effect = n
    index = {n: i for i, n in enumerate(nodes)}
    order = list(nx.lexicographical_topological_sort(dag, key=lambda n: (prio[n], index[n])))
    out = order[-1]
    assert out.op == "output", "the output node must come last"
    for n in order:
        if n.op not in ("placeholder", "output"):
            out.prepend(n)


def _has_effect(n: torch.fx.Node) -> bool:
    """Mutating ops (releases, in-place updates, the offload waits) keep their relative order."""
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable
