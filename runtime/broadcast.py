"""``partition="broadcast"``: the classic single-owner scheme, for the bandwidth-centric comparison.

ZeRO-Infinity's bandwidth-centric partitioning gives every rank 1/dp of every parameter, so a fetch
reads all ranks' slow-memory links at once and all-gathers; the classic scheme (ZeRO-Offload,
DeepSpeed's pre-Infinity offload) gives each parameter ONE owner rank that keeps it whole::

    bandwidth:  rank r holds flat[r*s : (r+1)*s]        fetch = read own 1/dp  -> all_gather
                gradient = reduce_scatter -> own 1/dp   optimizer steps 1/dp of every parameter
    broadcast:  owner(p) holds flat[0 : numel]          fetch = owner reads it -> broadcast(src=owner)
                others hold 0 elements                  gradient = reduce(dst=owner)
                                                        optimizer: the owner steps the whole parameter

In the store this is only another layout: a handle's local shard is the whole parameter on its owner
and empty elsewhere (``ParamHandle.shard_numel`` is rank-dependent, ``shard_lo`` is 0), and the three
collectives a handle issues (gather, reduce, full-gradient/full-master joins) become broadcast and
reduce. Graphs, the schedule, clipping (partial norms of empty shards are 0) and the optimizer (it
steps 0-element shards on non-owners) need no change.

Owners are chosen greedily by bytes, in partition order: each new parameter goes to the rank that
owns the fewest bytes so far (ties: the lowest rank). Partition order is the same on every rank (it
already broadcasts each parameter from rank 0 in that order), so every rank computes the same owners
without communicating. The load counters are per ``RuntimeContext`` (per model), never process-wide.

Limits (say so rather than guess): ``zinf_compile.save``/``load`` refuse a broadcast model (see
``refuse_checkpoint``); bucketing is not implemented for either scheme; a second instance of a model
class that reuses the first one's compiled graph gets owners of its own, and where they differ from
the graph's the call raises on every rank (``store.resolve``: recompile), as a shape mismatch does.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch

SCHEMES = ("bandwidth", "broadcast")

# bytes owned per rank, per model context (weak: a context's counters die with it)
_loads: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()


def assign_owner(context: Any, nbytes: int, world: int) -> int:
    """The owner rank of a new parameter of ``nbytes``: the least-loaded rank of ``context`` so far."""
    load = _loads.get(context)
    if load is None or len(load) != world:
        load = [0] * world
        _loads[context] = load
    owner = min(range(world), key=lambda r: (load[r], r))
    load[owner] += nbytes
    return owner


def owned_bytes(context: Any) -> Optional[List[int]]:
    """fp32 bytes owned by each rank in ``context`` (None: no broadcast-partitioned parameter yet)."""
    load = _loads.get(context)
    return None if load is None else list(load)


class BroadcastCheckpointError(NotImplementedError):
    """``zinf_compile.save``/``load`` of a model partitioned with ``partition="broadcast"``."""


def refuse_checkpoint(model: torch.nn.Module, what: str, options: Any = None) -> None:
    """Raise if ``model`` is (or will be) partitioned with ``partition="broadcast"``.

    The checkpoint layout (``zinf_compile._ckpt_layout``) writes rank r's slice ``[r*s, (r+1)*s)`` of
    every parameter: with one owner per parameter that slice is wrong on every owner but rank 0, so
    saving would silently drop parameters. Until the layout learns owners, refuse clearly.
    """
    from . import store

    mod = getattr(model, "_orig_mod", model)
    found = any(h.owner is not None for _, h in store.iter_handles(mod.parameters()))
    if not found:
        opts = options
        if opts is None:
            try:
                from zinf_compile import _torch_compat

                got = _torch_compat.compile_options_of(model) or _torch_compat.compile_options_of(mod)
                opts = got[1] if got is not None and got[0] == "zinf" else None
            except Exception:  # noqa: BLE001 - no compile options: nothing to refuse
                opts = None
        part = getattr(opts, "partition", None) if not isinstance(opts, dict) else opts.get("partition")
        found = part == "broadcast"
    if found:
        raise BroadcastCheckpointError(
            f"zinf.{what}: this model is partitioned with partition='broadcast' (one owner rank per "
            "parameter), which zinf checkpoints do not support yet (their layout stores every parameter "
            "1/dp per rank). Fix: train with the default partition='bandwidth' to checkpoint, or export "
            "full weights with zinf_compile.full_state_dict(model) / zinf_compile.export(path, model).")
