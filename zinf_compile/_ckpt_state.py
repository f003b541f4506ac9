"""What ``zinf_compile.save`` writes: DCP entries for a model and its optimizer (see ``_ckpt_layout``).

    "model/<fqn>"          parameter, logical flat fp32 (numel,): this rank's chunk (partitioned) or whole
    "model/<buffer fqn>"   buffer, as it is (replicated: DCP writes it once)
    "optim/<fqn>/<name>"   per-element optimizer state, laid out like its parameter
    "zinf/meta"            pickled: format version, dp size, parameter shapes/tiling, param_groups
                           (hyper-parameters and parameter names), scalar optimizer state (``step``)
    "zinf/extra"           pickled: the caller's ``extra``
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

import zinf_runtime
from zinf_runtime.packed_state import PackedField, is_per_element, reader
from zinf_runtime.store import ParamHandle
from zinf_runtime.tiers import Slot

from ._ckpt_layout import Piece, owned, unit_key


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under ``torch.compile``'s ``OptimizedModule`` (its parameters are the same)."""
    return getattr(model, "_orig_mod", model)


def named_params(mod: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    """Parameters under their first ``state_dict`` name (tied ones once)."""
    return list(mod.named_parameters())


def buffers_of(mod: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Persistent buffers under their ``state_dict`` keys."""
    pids = {id(p) for p in mod.parameters()}
    return {k: v for k, v in mod.state_dict(keep_vars=True).items() if id(v) not in pids}


def per_element(v: Any, shard_numel: int) -> bool:
    return isinstance(v, (Slot, PackedField)) or is_per_element(v, shard_numel)


def unit_states(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter, h: ParamHandle) -> List[Dict[str, Any]]:
    """This rank's optimizer state of each unit of ``h``: tensors (memory tiers), packed fields (NVMe), scalars."""
    units = h.units()
    if h.placement.master_tier == "nvme":
        return [{**u.optim_small, **u.optim_state.fields()} for u in units]
    st = optimizer.state.get(p) if p in optimizer.state else None
    if not st:
        return [{} for _ in units]
    if len(units) == 1:
        return [st]
    return list(st["tiles"])


def build_save_state(mod: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], extra: Any,
                     version: int) -> Tuple[Dict[str, Any], List[Piece], int]:
    """``(DCP state dict of replicated entries, this rank's chunks, bytes of the chunks)``."""
    state: Dict[str, Any] = {}
    pieces: List[Piece] = []
    params = named_params(mod)
    fqn_of = {id(p): fqn for fqn, p in params}
    layout: Dict[str, dict] = {}
    world = 1
    for fqn, p in params:
        h = zinf_runtime.handle_of(p)
        layout[fqn] = {"shape": tuple(p.shape), "dtype": str(p.dtype),
                       "tiles": None if h is None or h.tiles is None else (h.tile_dim, h.tile_bounds)}
        if h is None:
            state[f"model/{fqn}"] = p.detach().reshape(-1).to(torch.float32)
            continue
        world = h.world
        for i, u in enumerate(h.units()):
            key, numel, base = unit_key(fqn, h, i)
            lo, n = owned(u)
            pieces.append(Piece(f"model/{key}", numel, base + lo, n, reader(u.master)))
    for k, b in buffers_of(mod).items():
        state[f"model/{k}"] = b.detach()
    meta: Dict[str, Any] = {"version": version, "world": world, "params": layout, "param_groups": None, "small": {}}
    if optimizer is not None:
        groups = []
        for g in optimizer.param_groups:
            missing = [tuple(p.shape) for p in g["params"] if id(p) not in fqn_of]
            if missing:
                raise ValueError(f"zinf.save: the optimizer holds parameters of shapes {missing} that are not in "
                                 "the model; save the model the optimizer was built for")
            groups.append({"hp": {k: v for k, v in g.items() if k != "params"},
                           "params": [fqn_of[id(p)] for p in g["params"]]})
        meta["param_groups"] = groups
        meta["optim_class"] = type(optimizer).__name__
        for p in {id(p): p for g in optimizer.param_groups for p in g["params"]}.values():
            fqn = fqn_of[id(p)]
            h = zinf_runtime.handle_of(p)
            if h is None:  # replicated: full-shaped state, saved whole (once)
                small = {}
                for name, v in (optimizer.state.get(p, {}) if p in optimizer.state else {}).items():
                    if per_element(v, p.numel()):
                        state[f"optim/{fqn}/{name}"] = v.detach().reshape(-1).to(torch.float32)
                    else:
                        small[name] = v.detach().cpu().clone() if torch.is_tensor(v) else v
                meta["small"][fqn] = [small]
                continue
            smalls = []
            for i, (u, st) in enumerate(zip(h.units(), unit_states(optimizer, p, h))):
                key, numel, base = unit_key(fqn, h, i)
                lo, n = owned(u)
                small = {}
                for name, v in st.items():
                    if per_element(v, u.shard_numel):
                        pieces.append(Piece(f"optim/{key}/{name}", numel, base + lo, n, reader(v)))
                    else:
                        small[name] = v.detach().cpu().clone() if torch.is_tensor(v) else v
                smalls.append(small)
            meta["small"][fqn] = smalls
    state["zinf/meta"] = meta
    state["zinf/extra"] = extra
    return state, pieces, sum(4 * p.length for p in pieces)
