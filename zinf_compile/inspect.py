"""``zinf inspect DUMP_DIR``: read the graphs a compile wrote with ``dump_dir`` and explain them.

Reads only the dump folder (``graph_<id>_<name>/NN_<stage>_<pass>.py`` + ``index.json``, written by
``zinf_compile.pipeline.snapshot``), so it works on a dump copied from another machine. Commands::

    zinf inspect DUMP                    # every compiled graph, its passes and their times
    zinf inspect DUMP --diff             # what each pass changed: op counts, nodes added/removed/moved
    zinf inspect DUMP --graph 0 --stage forward --pass insert_release   # the graph before and after
    zinf inspect DUMP --node release_default_3   # which pass inserted a node, and why

``--node`` output::

    node release_default_3 -- graph 0 GraphModule, stage forward
      inserted by  pass insert_release (forward), first in 06_forward_insert_release.py
      why          release of blocks.0.ln1.weight (uid 3) after its last reader getitem_2: its gathered
                   storage is freed right there, so only parameters in use stay resident
      code         release_default_3 = torch.ops.zinf.release.default(fetch_shard_default_2, 3, [...])
      reads        fetch_shard_default_2, getitem, getitem_1, getitem_2
      read by      (nothing)
      history      input: -  sink_fetch: -  insert_release: added

A node that came out of the joint graph says so (``inserted by  pass insert_fetch (joint), ...;
AOTAutograd's partitioner carried it into the backward graph``); one traced from the model says
``AOTAutograd's trace`` and, if a pass tagged it, ``tagged by``. Names are per stage: a
``fetch_shard_default_2`` in forward and one in backward are two nodes, both explained unless
``--stage`` picks one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["Dump", "GraphDump", "Snapshot", "load", "explain_node", "add_arguments", "run", "main"]

_ASSIGN = re.compile(r"^    ([A-Za-z_]\w*) = (.*)$")
_ZINF_OPS = ("fetch_shard", "all_gather", "release", "reduce_grad")


@dataclass
class Snapshot:
    """One graph after one pass, as dumped."""

    index: int
    stage: str
    pass_name: str
    file: str
    seconds: float
    op_counts: Dict[str, int]
    zinf_nodes: Dict[str, dict]
    path: str
    _nodes: Optional[Dict[str, str]] = field(default=None, repr=False)

    @property
    def code(self) -> str:
        with open(self.path) as f:
            return "".join(line for line in f if not line.startswith("# ")).lstrip("\n")

    def nodes(self) -> Dict[str, str]:
        """Node name -> its line of code (without the ``x = None`` clean-ups), in graph order."""
        if self._nodes is None:
            out: Dict[str, str] = {}
            for line in self.code.splitlines():
                if line.startswith("def forward(self"):
                    for arg in line[len("def forward(self"):].strip(" ,):").split(","):
                        name = arg.split(":")[0].strip()
                        if name:
                            out[name] = f"{name} (graph input)"
                    continue
                m = _ASSIGN.match(line)
                if m and not re.fullmatch(r"(\w+ = )*None", m[2]):  # skip ``x = None`` clean-ups
                    out[m[1]] = f"{m[1]} = {m[2].split(';  ')[0]}"
            self._nodes = out
        return self._nodes


@dataclass
class GraphDump:
    id: int
    name: str
    folder: str
    snapshots: List[Snapshot]
    counters: Dict[str, int]
    warnings: List[str]

    def stages(self) -> List[str]:
        return list(dict.fromkeys(s.stage for s in self.snapshots))

    def stage(self, stage: str) -> List[Snapshot]:
        return [s for s in self.snapshots if s.stage == stage]


@dataclass
class Dump:
    root: str
    graphs: List[GraphDump]

    def graph(self, gid: Optional[int]) -> GraphDump:
        if gid is None:
            if len(self.graphs) == 1:
                return self.graphs[0]
            raise ValueError(f"{len(self.graphs)} graphs in {self.root}; choose one with --graph "
                             f"{{{', '.join(str(g.id) for g in self.graphs)}}}")
        for g in self.graphs:
            if g.id == gid:
                return g
        raise ValueError(f"no graph {gid} in {self.root}; graphs: {[g.id for g in self.graphs]}")


def load(root: str) -> Dump:
    """Read a dump folder (or one ``graph_*`` folder inside it)."""
    if not os.path.isdir(root):
        raise ValueError(f"{root!r} is not a directory (pass the dump_dir a compile wrote)")
    folders = [root] if os.path.exists(os.path.join(root, "index.json")) else sorted(
        os.path.join(root, d) for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "index.json")))
    if not folders:
        ranks = sorted(d for d in os.listdir(root) if d.startswith("rank") and os.path.isdir(os.path.join(root, d)))
        if ranks:  # dp > 1: each process wrote its own folder (pipeline.dump_root)
            raise ValueError(f"{root!r} holds one folder per rank ({', '.join(ranks)}): pass one of them, "
                             f"e.g. zinf inspect {os.path.join(root, ranks[0])}")
        raise ValueError(f"no compiled graphs in {root!r}: expected graph_<id>_<name>/index.json folders "
                         "(compile with options={'dump_dir': ...} or ZINF_DUMP_DIR)")
    graphs = []
    for folder in folders:
        with open(os.path.join(folder, "index.json")) as f:
            idx = json.load(f)
        snaps = [Snapshot(e["index"], e["stage"], e["pass"], e["file"], float(e["seconds"]), e["op_counts"],
                          {z["node"]: z for z in e.get("zinf_nodes", [])}, os.path.join(folder, e["file"]))
                 for e in idx["graphs"]]
        graphs.append(GraphDump(int(idx["id"]), idx["graph"], folder, snaps, idx.get("counters", {}),
                                idx.get("warnings", [])))
    return Dump(root, sorted(graphs, key=lambda g: g.id))


def _param(name: Optional[str]) -> str:
    return re.sub(r"^l_self\.", "", name) if name else "?"


def _zinf_count(snap: Snapshot) -> str:
    counts = [sum(v for k, v in snap.op_counts.items() if k.startswith(f"zinf.{op}")) for op in _ZINF_OPS]
    return "/".join(map(str, counts)) if any(counts) else "-"


# -- listing and diffs --------------------------------------------------------------------------------


def format_list(dump: Dump) -> str:
    lines = [f"dump {dump.root}: {len(dump.graphs)} compiled graph(s)"]
    for g in dump.graphs:
        lines += ["", f"graph {g.id}  {g.name}  ({os.path.basename(g.folder)}, {len(g.snapshots)} snapshots)",
                  f"  {'#':<4}{'stage':<11}{'pass':<16}{'ms':>8}{'nodes':>7}  "
                  "zinf fetch_shard/all_gather/release/reduce_grad"]
        for s in g.snapshots:
            lines.append(f"  {s.index:02d}  {s.stage:<11}{s.pass_name:<16}{s.seconds * 1e3:>8.1f}"
                         f"{sum(s.op_counts.values()):>7}  {_zinf_count(s)}")
        total = sum(s.seconds for s in g.snapshots) * 1e3
        lines.append(f"  passes took {total:.1f} ms in all")
        if g.counters:
            lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(g.counters.items())))
        lines += [f"  warning: {w}" for w in g.warnings]
    for name in ("plan.txt",):
        if os.path.exists(os.path.join(dump.root, name)):
            lines += ["", f"memory plan: {os.path.join(dump.root, name)}"]
    lines += ["", "next: --diff (what each pass changed), --graph N --stage S --pass P (code), --node NAME (why)"]
    return "\n".join(lines)


def _previous(g: GraphDump, snap: Snapshot) -> Optional[Snapshot]:
    same = g.stage(snap.stage)
    i = same.index(snap)
    return same[i - 1] if i > 0 else None


def _names(items: Sequence[str], limit: int = 8) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def format_diff(g: GraphDump, stage: Optional[str] = None) -> str:
    lines = [f"graph {g.id} {g.name}: what each pass changed (vs the previous snapshot of its stage)"]
    for st in g.stages():
        if stage is not None and st != stage:
            continue
        lines.append(f"\n{st}:")
        for snap in g.stage(st):
            prev = _previous(g, snap)
            if prev is None:
                lines.append(f"  {snap.pass_name:<16} {sum(snap.op_counts.values())} op nodes ({snap.file})")
                continue
            keys = sorted(set(prev.op_counts) | set(snap.op_counts))
            delta = [(k, snap.op_counts.get(k, 0) - prev.op_counts.get(k, 0)) for k in keys]
            delta = [(k, d) for k, d in delta if d]
            lines.append(f"  {snap.pass_name:<16} {snap.seconds * 1e3:.1f} ms  ({snap.file})")
            lines += [f"      {d:+d} {k}" for k, d in delta] or ["      no op-count change"]
            before, after = list(prev.nodes()), list(snap.nodes())
            added = [n for n in after if n not in prev.nodes()]
            removed = [n for n in before if n not in snap.nodes()]
            moved_set = _moved(prev, snap)
            moved = [n for n in after if n in moved_set]
            for label, items in (("added", added), ("removed", removed), ("moved", moved)):
                if items:
                    lines.append(f"      {label} {len(items)}: {_names(items)}")
    return "\n".join(lines)


def _find_snapshot(g: GraphDump, stage: Optional[str], pass_name: Optional[str]) -> Snapshot:
    cands = [s for s in g.snapshots if (stage is None or s.stage == stage)
             and (pass_name is None or s.pass_name == pass_name)]
    if pass_name is None and stage is not None and cands:
        return cands[-1]  # the final graph of the stage
    if len(cands) == 1:
        return cands[0]
    where = [f"--stage {s.stage} --pass {s.pass_name}" for s in (cands or g.snapshots)]
    if not cands:
        raise ValueError(f"graph {g.id} has no snapshot for stage={stage} pass={pass_name}; choose from: "
                         + "; ".join(where))
    raise ValueError(f"stage={stage} pass={pass_name} is ambiguous in graph {g.id}; choose from: "
                     + "; ".join(where))


def format_graph(g: GraphDump, stage: Optional[str], pass_name: Optional[str], show: str = "both") -> str:
    snap = _find_snapshot(g, stage, pass_name)
    prev = _previous(g, snap)
    head = f"graph {g.id} {g.name}, {snap.stage}"
    if show == "udiff":
        if prev is None:
            return f"{head}: {snap.pass_name!r} is the stage's first snapshot; nothing to diff\n" + snap.code
        return "".join(difflib.unified_diff(prev.code.splitlines(True), snap.code.splitlines(True),
                                            f"{prev.file} (before {snap.pass_name})",
                                            f"{snap.file} (after {snap.pass_name})"))
    parts = []
    if show in ("both", "before"):
        if prev is None:
            parts.append(f"===== {head}: no graph before {snap.pass_name!r} (the stage's input)")
        else:
            parts.append(f"===== {head}, before pass {snap.pass_name!r}: {prev.path}\n{prev.code}")
    if show in ("both", "after"):
        parts.append(f"===== {head}, after pass {snap.pass_name!r} ({snap.seconds * 1e3:.1f} ms): "
                     f"{snap.path}\n{snap.code}")
    return "\n".join(parts)


# -- explaining one node ----------------------------------------------------------------------------


def _why(z: dict, line: str) -> str:
    kind, uid, p = z.get("kind"), z.get("uid"), _param(z.get("param"))
    if kind == "fetch_shard":
        text = f"fetch of {p}'s own 1/dp shard (uid {uid}, {z.get('dtype', '?')}) onto the compute device"
        if z.get("owns_full"):
            text += "; at dp = 1 the shard is the whole parameter, and this node's storage is what release frees"
        return text
    if kind == "all_gather":
        if z.get("owns_full"):
            return f"all-gather of the full {p} (uid {uid}) from every rank's shard, just before its first use"
        return f"the full {p} (uid {uid}): at dp = 1 a view of the fetched shard with the parameter's shape"
    if kind == "release":
        return (f"release of {p} (uid {uid}) after its last reader {z.get('after', '?')}: its gathered storage "
                "is freed right there, so only parameters in use stay resident")
    if kind == "reduce_grad":
        m = re.search(r"reduce_grad\.default\((\w+)", line)
        grad = m[1] if m else "its gradient"
        return (f"reduce-scatter of {p}'s gradient {grad} (uid {uid}) into its fp32 gradient shard as soon as "
                "it is computed; the backward returns None for the parameter")
    if kind == "param_derived":
        return ("computed from gathered parameters alone: tagged must-recompute, so the backward recomputes "
                "it instead of saving a full parameter between forward and backward")
    return "zinf tag " + json.dumps(z)


def _first(snaps: List[Snapshot], name: str) -> Optional[Snapshot]:
    return next((s for s in snaps if name in s.nodes()), None)


def explain_node(dump: Dump, name: str, gid: Optional[int] = None, stage: Optional[str] = None) -> str:
    """Which pass inserted node ``name`` (first snapshot it appears in) and why (its zinf tag)."""
    out: List[str] = []
    for g in dump.graphs:
        if gid is not None and g.id != gid:
            continue
        for st in g.stages():
            if stage is not None and st != stage:
                continue
            snaps = g.stage(st)
            first = _first(snaps, name)
            if first is None:
                continue
            last = [s for s in snaps if name in s.nodes()][-1]
            line = last.nodes()[name]
            z = first.zinf_nodes.get(name) or last.zinf_nodes.get(name)
            if first.pass_name != "input":
                origin = f"pass {first.pass_name} ({st}), first in {first.file}"
            else:
                origin = _origin_before_stage(g, st, name, first)
            reads = [n for n in re.findall(r"\b[A-Za-z_]\w*\b", _args(line)) if n in last.nodes() and n != name]
            readers = [n for n, ln in last.nodes().items() if n != name and re.search(rf"\b{name}\b", _args(ln))]
            hist = "  ".join(f"{s.pass_name}: {_state(s, snaps, name)}" for s in snaps)
            out += [f"node {name} -- graph {g.id} {g.name}, stage {st}",
                    f"  inserted by  {origin}"]
            if z and "trace" in origin:
                out.append(f"  tagged by    {_tagged_by(g, st, name)}")
            out += [
                    f"  why          {_why(z, line) if z else 'not a zinf node: ' + _not_zinf(first)}",
                    f"  code         {line}",
                    f"  reads        {_names(list(dict.fromkeys(reads)), 12) or '(nothing)'}",
                    f"  read by      {_names(readers, 12) or '(nothing)'}",
                    f"  history      {hist}", ""]
    if not out:
        every = sorted({n for g in dump.graphs for s in g.snapshots for n in s.nodes()})
        close = difflib.get_close_matches(name, every, n=6)
        raise ValueError(f"no node {name!r} in {dump.root}" + (f"; did you mean {', '.join(close)}?" if close else ""))
    return "\n".join(out).rstrip()


def _args(line: str) -> str:
    """The argument text of a node's line (not its target, whose name may look like a node's)."""
    rhs = line.split(" = ", 1)[-1]
    m = re.match(r"^[\w.]+\((.*)\)$", rhs)
    return m[1] if m else rhs


def _moved(prev: Snapshot, cur: Snapshot) -> set:
    """Nodes in both graphs outside their longest common ordering (what ``--diff`` calls moved)."""
    a = [n for n in prev.nodes() if n in cur.nodes()]
    b = [n for n in cur.nodes() if n in prev.nodes()]
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    kept = {n for blk in sm.get_matching_blocks() for n in a[blk.a:blk.a + blk.size]}
    return {n for n in b if n not in kept}


def _state(s: Snapshot, snaps: List[Snapshot], name: str) -> str:
    prev = snaps[snaps.index(s) - 1] if snaps.index(s) > 0 else None
    here = name in s.nodes()
    if prev is None:
        return "present" if here else "-"
    was = name in prev.nodes()
    if here and not was:
        return "added"
    if was and not here:
        return "removed"
    if here and name in _moved(prev, s):
        return "moved"
    return "kept" if here else "-"


def _tagged_by(g: GraphDump, stage: str, name: str) -> str:
    """The first pass whose output carries the node's zinf tag (looking back into the joint graph)."""
    for st in [p for p in ("joint", "inference_joint") if stage in ("forward", "backward", "inference")] + [stage]:
        for s in g.stage(st):
            if name in s.zinf_nodes:
                return f"pass {s.pass_name} ({st}), in {s.file}" if s.pass_name != "input" else \
                    f"already tagged in the {st} graph's input {s.file}"
    return "?"


def _origin_before_stage(g: GraphDump, stage: str, name: str, first: Snapshot) -> str:
    """A node present in a stage's input graph: find where it came from in the stages before."""
    if stage in ("forward", "backward", "inference"):
        for prior in ("joint", "inference_joint"):
            snaps = g.stage(prior)
            src = _first(snaps, name)
            if src is not None and src.pass_name != "input":
                return (f"pass {src.pass_name} ({prior}), first in {src.file}; AOTAutograd's partitioner "
                        f"carried it into the {stage} graph")
            if src is not None:
                return f"AOTAutograd's trace (already in the {prior} graph's input {src.file})"
        return f"AOTAutograd (in the {stage} graph's input {first.file})"
    if stage in ("joint", "inference_joint"):
        return f"AOTAutograd's trace (in the {stage} graph's input {first.file})"
    return f"Dynamo's trace (in the {stage} graph's input {first.file})"


def _not_zinf(first: Snapshot) -> str:
    return "traced from the model, no zinf pass inserted it" if first.pass_name == "input" else \
        f"added by pass {first.pass_name} without a zinf tag"


# -- command line -------------------------------------------------------------------------------------


def _emit(text: str) -> None:
    """Print, quietly stopping if the reader went away (``zinf ... | head``)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump_dir", help="the folder a compile wrote with options={'dump_dir': ...} (or ZINF_DUMP_DIR)")
    p.add_argument("--diff", action="store_true", help="what each pass changed: op counts, nodes added/removed/moved")
    p.add_argument("--graph", type=int, default=None, help="graph id (see the listing); needed with several graphs")
    p.add_argument("--stage", default=None, help="dynamo | joint | forward | backward | inference")
    p.add_argument("--pass", dest="pass_name", default=None, help="print the graph before and after this pass")
    p.add_argument("--show", choices=("both", "before", "after", "udiff"), default="both",
                   help="with --pass: which code to print (udiff: a unified diff)")
    p.add_argument("--node", default=None, help="explain a node: which pass inserted it and why")


def run(args: argparse.Namespace) -> int:
    dump = load(args.dump_dir)
    if args.node:
        _emit(explain_node(dump, args.node, args.graph, args.stage))
    elif args.pass_name or (args.stage and args.graph is not None and not args.diff):
        _emit(format_graph(dump.graph(args.graph), args.stage, args.pass_name, args.show))
    elif args.diff:
        graphs = dump.graphs if args.graph is None else [dump.graph(args.graph)]
        _emit("\n\n".join(format_diff(g, args.stage) for g in graphs))
    else:
        _emit(format_list(dump))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="zinf inspect", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as exc:
        print(f"zinf inspect: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
