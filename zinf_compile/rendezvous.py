"""dp > 1: every rank must run the same compiled graph at the same time, or nothing collective works.

A compiled graph's collectives (all-gathers in forward, reduce-scatters in backward) pair up across
ranks by order alone. A rank that evaluates alone (``if rank == 0: evaluate(model)``), that runs
another graph or another grad mode than its peers, or whose model differs (one parameter of another
shape), would block forever in its first all-gather or exchange shards with a peer that is elsewhere.
So ranks compare fingerprints in one tiny all-reduce before anything collective happens:

* at compile, before a graph's parameters are partitioned (partitioning broadcasts them from rank 0):
  the parameters' names, shapes, dtypes and grad mode (:func:`check_compile`);
* before every call of a compiled graph: the graph, its grad mode and its **collective sequence** —
  the ordered list of zinf ops with the parameter, shape and shard size each moves, read from the
  graphs as compiled (:func:`collective_sequence`)::

    before: compiled(*args)                       -> first all_gather hangs when a peer is absent
    after:  rendezvous(fingerprint(graph, grad mode, collective sequence)); compiled(*args)
                                                  -> an error naming the graph, the first difference
                                                     between the ranks, and the remedy

On a mismatch every rank raises, naming the first entry where its peers differ. The guard also posts
any exception of the compiled call (bad input, an IO error) as this rank's failure, so peers waiting
in a collective raise ``RankFailedError`` naming this rank and the operation (``zinf_runtime.comm``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

import zinf_runtime
from zinf_runtime import comm, eager_access

from . import _torch_compat
from .pipeline import ParamInfo

comm.set_store_provider(_torch_compat.default_store)  # where a failed rank posts its error
eager_access.set_compile_session_probe(_torch_compat.in_compile_session)  # torch 2.11's is_compiling()

_LOCAL_OPS = ("release", "grad_of")  # zinf ops that move nothing between ranks


def fingerprint(name: str, params: Sequence[Any], grad_enabled: bool, sequence: Sequence[Any] = ()) -> int:
    """A 62-bit digest of what a call of the graph will exchange; equal on ranks running the same."""
    text = repr((name, tuple(params), bool(grad_enabled), tuple(sequence)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _param_text(uid: int) -> str:
    try:
        h = zinf_runtime.store.get(uid)
    except RuntimeError:
        return f"uid {uid}"
    if h.owner is not None:  # partition="broadcast": shard sizes differ by rank
        return f"{h.name!r} {tuple(h.shape)} owner {h.owner}"
    return f"{h.name!r} {tuple(h.shape)} shard {h.shard_numel}"


def collective_sequence(record: Any) -> List[str]:
    """The zinf ops of the compiled graphs in order (forward, backward, inference: those compiled so
    far), each with the parameter it moves: what this rank's calls will exchange, in which order."""
    seq: List[str] = []
    modules = getattr(record, "final_modules", None) or {}
    for stage in ("forward", "backward", "inference"):
        gm = modules.get(stage)
        if gm is None:
            continue
        for n in gm.graph.nodes:
            target = n.target
            if n.op != "call_function" or getattr(target, "namespace", None) != "zinf":
                continue
            op = getattr(target, "_opname", str(target))
            if op in _LOCAL_OPS:
                continue
            uid = (n.meta.get("zinf") or {}).get("uid")
            if uid is None:
                uid = next((a for a in n.args if isinstance(a, int) and not isinstance(a, bool)), None)
            seq.append(f"{stage} {op} of {_param_text(uid) if uid is not None else '?'}")
    return seq


def _params_of(infos: Sequence[ParamInfo]) -> List[str]:
    return [f"parameter {i.name!r} {i.shape} {str(i.dtype).replace('torch.', '')}"
            f"{'' if i.requires_grad else ' frozen'}" for i in infos]


def check_compile(name: str, named_params: Sequence[tuple], group: Any) -> None:
    """Before a graph's parameters are partitioned at dp > 1: every rank compiles the same graph over the
    same parameters (names, shapes, dtypes) in the same grad mode, or every rank raises naming the first
    parameter that differs. Partitioning broadcasts each parameter from rank 0 and then all-gathers it by
    shape: ranks whose parameters differ would hang there or silently exchange mismatched data."""
    if comm.world_size(group) == 1:
        return
    mode = torch.is_grad_enabled()
    desc = [f"parameter {n!r} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
            f"{'' if t.requires_grad else ' frozen'}" for n, t in named_params]
    what = f"compiling graph {name!r} ({'training' if mode else 'no_grad'})"
    with comm.reporting(what):
        comm.rendezvous(fingerprint(f"compile {name}", desc, mode), what, group,
                        describe=lambda: [f"grad mode {mode}"] + desc)


def guard(compiled: Callable, params: Dict[int, ParamInfo], group: Any, name: str,
          record: Optional[Any] = None) -> Callable:
    """Wrap ``compiled`` with the rendezvous when its parameters are sharded over dp > 1 ranks.

    The fingerprint is computed at the first call (once the compiled graphs exist) and reused: the
    call itself costs one all-reduce of two int64s, as before.
    """
    infos = sorted(params.values(), key=lambda i: i.index)
    if not infos or max(i.world for i in infos) == 1:
        return compiled
    plist = _params_of(infos)
    cache: Dict[bool, tuple] = {}

    def described(mode: bool) -> tuple:
        if mode not in cache:
            seq = collective_sequence(record) if record is not None else []
            desc = [f"graph {name!r}", f"grad mode {mode}"] + plist + seq
            cache[mode] = (fingerprint(name, plist, mode, seq), desc)
        return cache[mode]

    def call(*args: Any) -> Any:  # same calling convention as ``compiled`` (boxed or not)
        mode = torch.is_grad_enabled()
        what = f"graph {name!r} ({'training' if mode else 'no_grad'})"
        with comm.reporting(f"the forward of {what}"):
            fp, desc = described(mode)
            comm.rendezvous(fp, what, group, describe=lambda: desc)
            return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call
