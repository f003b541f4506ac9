"""dp > 1: every rank must run the same compiled graph at the same time, or nothing collective works.

A compiled graph's collectives (all-gathers in forward, reduce-scatters in backward) pair up across
ranks by order alone. A rank that evaluates alone (``if rank == 0: evaluate(model)``), or that runs
another graph or another grad mode than its peers, would block forever in its first all-gather or
exchange shards with a peer that is elsewhere. So each call of a compiled graph first checks, in one
tiny all-reduce, that every rank is about to run the same graph in the same mode::

    before: compiled(*args)                       -> first all_gather hangs when a peer is absent
    after:  rendezvous(fingerprint(graph, grad mode)); compiled(*args)
                                                  -> an error naming the graph and the remedy
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Sequence

import torch

from zinf_runtime import comm

from .pipeline import ParamInfo


def fingerprint(name: str, params: Sequence[tuple[str, tuple]], grad_enabled: bool) -> int:
    """A 62-bit digest of what a call of the graph will exchange; equal on ranks running the same."""
    text = repr((name, tuple(params), bool(grad_enabled)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def guard(compiled: Callable, params: Dict[int, ParamInfo], group: Any, name: str) -> Callable:
    """Wrap ``compiled`` with the rendezvous when its parameters are sharded over dp > 1 ranks."""
    infos = sorted(params.values(), key=lambda i: i.index)
    if not infos or max(i.world for i in infos) == 1:
        return compiled
    params = [(i.name, i.shape) for i in infos]
    prints = {mode: fingerprint(name, params, mode) for mode in (False, True)}

    def call(*args: Any) -> Any:  # same calling convention as ``compiled`` (boxed or not)
        mode = torch.is_grad_enabled()
        comm.rendezvous(prints[mode], f"graph {name!r} ({'training' if mode else 'no_grad'})", group)
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):
        call._boxed_call = True  # type: ignore[attr-defined]
    return call
