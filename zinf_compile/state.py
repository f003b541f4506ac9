"""Reading and writing partitioned parameters from eager code.

``full_state_dict(model)`` returns full CPU tensors under ``model.state_dict()``'s keys;
``with gathered(model):`` materializes every partitioned parameter for eager reads and writes and
writes the (possibly changed) values back to the shards on exit::

    inside:  p.untyped_storage() -> numel bytes, holding the full value
    after:   shards updated from p; p.untyped_storage() -> 0 bytes again
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch

import zinf_runtime
from zinf_runtime import comm
from zinf_runtime.modes import normal_tensors
from zinf_runtime.store import ParamHandle


def _partitioned(model: torch.nn.Module) -> List[tuple[torch.nn.Parameter, ParamHandle]]:
    out, seen = [], set()
    for p in model.parameters():
        h = zinf_runtime.handle_of(p)
        if h is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((p, h))
    return out


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with every partitioned parameter gathered into a full CPU tensor.

    Collective when dp > 1: call it on every rank. With ``rank0_only`` other ranks get ``{}``.
    """
    sd = model.state_dict(keep_vars=True)
    out: Dict[str, torch.Tensor] = {}
    me = 0
    for key, t in sd.items():
        h = zinf_runtime.handle_of(t)
        if h is not None:
            me = h.rank
            with normal_tensors():  # zinf_runtime.modes: the runtime's buffers stay normal tensors
                value = h.full_data(t.dtype).cpu()
        else:
            value = t.detach().cpu().clone()
        out[key] = value
    if rank0_only and me != 0:
        return {}
    return out


@contextlib.contextmanager
def gathered(model: torch.nn.Module, modifier_rank: Optional[int] = None) -> Iterator[torch.nn.Module]:
    """Materialize the model's partitioned parameters; write them back to the shards on exit.

    With dp > 1 every rank must enter. Writes made on ``modifier_rank`` (a rank of the parameters'
    group) are broadcast to the others on exit; with ``None`` each rank keeps its own writes, which
    must then be the same everywhere.
    """
    items = _partitioned(model)
    with normal_tensors():  # zinf_runtime.modes; the caller's block keeps its own mode
        for p, h in items:
            full = h.full_data(p.dtype)
            p.untyped_storage().resize_(full.numel() * full.element_size())
            with torch.no_grad():
                p.copy_(full.view(p.shape))
    try:
        yield model
    finally:
        with normal_tensors():
            _write_back(items, modifier_rank)


def _write_back(items: List[tuple[torch.nn.Parameter, ParamHandle]], modifier_rank: Optional[int]) -> None:
    """``gathered``'s exit: each parameter's (possibly changed) values back into its shards."""
    for p, h in items:
        data = p.detach()
        if modifier_rank is not None and h.world > 1:
            data = data.clone()
            torch.distributed.broadcast(
                data, src=torch.distributed.get_global_rank(h.placement.group, modifier_rank)
                if h.placement.group is not None else modifier_rank, group=h.placement.group)
        h.load_full(data)
        p.untyped_storage().resize_(0)
