"""What ``zinf_compile.load`` does with a checkpoint (the entries are listed in ``_ckpt_state``).

    1. read "zinf/meta" and "zinf/extra";
    2. a model compiled with backend="zinf" but not called yet is partitioned now, with its compile
       options, exactly as its first call would (then the call finds its shards in place);
    3. buffers and replicated parameters are loaded in place;
    4. partitioned parameters, a sub-group at a time (at most ``optimizer_sub_group_bytes`` of master +
       moments): DCP fills this rank's range of each, then the master goes to its slot (refreshing the
       parameter copy) and the moments to the optimizer's tier (NVMe slots or ``optimizer.state``);
    5. ``param_groups`` hyper-parameters (lr, betas, ``initial_lr`` of a scheduler, ...) are restored.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import zinf_runtime
from zinf_runtime.store import ParamHandle

from . import _torch_compat
from ._ckpt_layout import LoadPlanner, Target, owned, unit_key
from ._ckpt_state import buffers_of, named_params, unwrap
from .config import Config


def partition_now(model: torch.nn.Module, options: Any) -> None:
    """Partition a zinf-compiled model that was not called yet, as its first call would.

    A model that is not compiled itself but holds zinf-compiled submodules (a LightningModule whose
    ``self.net`` is compiled) has each of those partitioned with its own options: loading into full
    tensors that the first call then partitions would hold the whole model in memory on every rank."""
    mod = unwrap(model)
    todo = [(fqn, p) for fqn, p in named_params(mod) if zinf_runtime.handle_of(p) is None]
    if not todo:
        return
    if options is None:
        found = _torch_compat.compile_options_of(model) or _torch_compat.compile_options_of(mod)
        if found is None or found[0] != "zinf":
            for child in _compiled_children(mod):  # an eager module, or one holding compiled parts
                partition_now(child, None)
            return
        options = found[1]
    cfg = Config.from_options(options)
    devices = {p.device for _, p in todo}
    if len(devices) != 1:
        raise ValueError(f"zinf.load: parameters live on several devices {sorted(map(str, devices))}; move the "
                         "model to one device before compiling")
    placement = cfg.placement(devices.pop())
    with zinf_runtime.compiling(options, device_memory_budget=cfg.device_memory_budget,
                                malloc_mmap_threshold=cfg.malloc_mmap_threshold):
        zinf_runtime.partition(todo, placement, sync_from_rank0=False)  # every value is overwritten next


def _compiled_children(mod: torch.nn.Module) -> List[torch.nn.Module]:
    """The outermost descendants of ``mod`` compiled with ``backend="zinf"`` (not searched inside)."""
    out: List[torch.nn.Module] = []
    for child in mod.children():
        found = _torch_compat.compile_options_of(child) or _torch_compat.compile_options_of(unwrap(child))
        if found is not None and found[0] == "zinf":
            out.append(child)
        else:
            out.extend(_compiled_children(child))
    return out


def _optim_names(metadata: Any) -> Dict[str, List[str]]:
    """Per-element optimizer entries of the checkpoint, by unit key."""
    out: Dict[str, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith("optim/"):
            unit, _, name = key[len("optim/"):].rpartition("/")
            out.setdefault(unit, []).append(name)
    return out


def _check_params(meta: dict, params: List[Tuple[str, torch.nn.Parameter]]) -> None:
    saved, mine = set(meta["params"]), {fqn for fqn, _ in params}
    if saved != mine:
        raise ValueError(f"zinf.load: the checkpoint's parameters differ from the model's: missing "
                         f"{sorted(saved - mine)[:5]}, unexpected {sorted(mine - saved)[:5]}")
    for fqn, p in params:
        if tuple(meta["params"][fqn]["shape"]) != tuple(p.shape):
            raise ValueError(f"zinf.load: parameter {fqn!r} has shape {tuple(p.shape)}, the checkpoint's "
                             f"{tuple(meta['params'][fqn]['shape'])}")
        h = zinf_runtime.handle_of(p)
        mine_t = None if h is None or h.tiles is None else (h.tile_dim, tuple(h.tile_bounds))
        saved_t = meta["params"][fqn]["tiles"]
        saved_t = None if saved_t is None else (saved_t[0], tuple(tuple(b) for b in saved_t[1]))
        if mine_t != saved_t and any(t is not None and t[0] != 0 for t in (mine_t, saved_t)):
            raise ValueError(f"zinf.load: {fqn!r} was saved tiled as {saved_t} and is tiled as {mine_t} now; "
                             "tiles along a dim other than 0 load only into the same tiling")


def _restore_groups(optimizer: torch.optim.Optimizer, meta: dict, fqn_of: Dict[int, str]) -> None:
    groups = meta["param_groups"]
    if groups is None:
        raise ValueError("zinf.load: the checkpoint holds no optimizer state (saved without an optimizer); "
                         "call load without the optimizer")
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"zinf.load: the checkpoint's optimizer has {len(groups)} param groups, this one "
                         f"{len(optimizer.param_groups)}")
    for i, (saved, g) in enumerate(zip(groups, optimizer.param_groups)):
        names = [fqn_of.get(id(p), "?") for p in g["params"]]
        if names != saved["params"]:
            raise ValueError(f"zinf.load: param group {i} holds {names[:4]}..., the checkpoint's {saved['params'][:4]}...; "
                             "build the optimizer over the same parameters in the same order")
        g.update(saved["hp"])


def load_into(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], options: Any, metadata: Any,
              run: Callable[[Dict[str, Any], LoadPlanner], None], path: str, version: int,
              progress: Callable[[int, str], Optional[Callable[[int], None]]]) -> Dict[str, Any]:
    for key in ("zinf/meta", "zinf/extra"):
        if key not in metadata.state_dict_metadata:
            raise ValueError(f"zinf.load: {path} is a DCP checkpoint but not one written by zinf_compile.save "
                             f"(no {key!r})")
    head = LoadPlanner([])
    run({"zinf/meta": None, "zinf/extra": None}, head)
    meta, extra = head.loaded_bytes["zinf/meta"], head.loaded_bytes["zinf/extra"]
    if meta.get("version") != version:
        raise ValueError(f"zinf.load: {path} has format version {meta.get('version')}, this zinf reads {version}")
    partition_now(model, options)
    mod = unwrap(model)
    params = named_params(mod)
    _check_params(meta, params)
    fqn_of = {id(p): fqn for fqn, p in params}
    in_optim = set()
    if optimizer is not None:
        _restore_groups(optimizer, meta, fqn_of)
        in_optim = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(zinf_runtime.handle_of(p) is not None for g in optimizer.param_groups for p in g["params"]):
            from zinf_runtime.optim_adapt import sharded

            sharded(optimizer)  # the twin places moments on the optimizer's tier
    names = _optim_names(metadata)

    # buffers and replicated parameters (with their optimizer state), in place
    plain: Dict[str, Any] = {f"model/{k}": b for k, b in buffers_of(mod).items()}
    targets: List[Target] = []
    after: List[Callable[[], None]] = []
    for fqn, p in params:
        if zinf_runtime.handle_of(p) is not None:
            continue
        flat = torch.empty(p.numel(), dtype=torch.float32)
        targets.append(Target(f"model/{fqn}", p.numel(), 0, flat))
        after.append(lambda p=p, flat=flat: p.data.copy_(flat.view(p.shape)))
        if id(p) in in_optim:
            st = {n: torch.empty(p.numel(), dtype=torch.float32) for n in names.get(fqn, [])}
            targets.extend(Target(f"optim/{fqn}/{n}", p.numel(), 0, t) for n, t in st.items())
            small = (meta["small"].get(fqn) or [{}])[0]

            def place(p: torch.nn.Parameter = p, st: dict = st, small: dict = small) -> None:
                optimizer.state[p] = {**small, **{n: t.view(p.shape).to(p.device, p.dtype) for n, t in st.items()}}
            after.append(place)
    planner = LoadPlanner(targets)
    run(plain, planner)
    with torch.no_grad():
        for fn in after:
            fn()

    # partitioned parameters: bounded sub-groups
    todo = [(fqn, p, h) for fqn, p in params if (h := zinf_runtime.handle_of(p)) is not None]
    total = sum(4 * u.shard_numel * (1 + len(names.get(unit_key(fqn, h, i)[0], []) if id(p) in in_optim else 0))
                for fqn, p, h in todo for i, u in enumerate(h.units()))
    bar = progress(total, "zinf load")
    group: List[Tuple[str, torch.nn.Parameter, ParamHandle]] = []
    size = 0
    for item in todo:
        fqn, p, h = item
        b = sum(4 * u.shard_numel for u in h.units()) * (1 + (len(names.get(fqn, [])) if id(p) in in_optim else 0))
        staged = any(u.master.tier == "nvme" for u in h.units())  # memory tiers load in place: no bound,
        if group and staged and size + b > h.placement.sub_group_bytes:  # and one DCP call reads in file order
            size = _load_group(group, optimizer, in_optim, names, meta, run, bar, size)
            group = []
        group.append(item)
        size += b
    if group:
        _load_group(group, optimizer, in_optim, names, meta, run, bar, size)
    if optimizer is not None and hasattr(optimizer, "_account_state"):
        optimizer._account_state()
    return extra


def _staging(numel: int, n: int) -> torch.Tensor:
    """A buffer DCP fills in ``[:n]``; only the padding past this rank's range is zeroed (zeroing all of it
    first was a second pass over every loaded byte)."""
    t = torch.empty(numel, dtype=torch.float32)
    t[n:].zero_()
    return t


def _held_state(optimizer: Optional[torch.optim.Optimizer], p: torch.nn.Parameter, i: int, units: int) -> dict:
    """The memory-tier state the optimizer holds now for unit ``i`` of ``p`` (empty before its first step)."""
    st = optimizer.state.get(p, {}) if optimizer is not None else {}
    if units > 1:
        tiles = st.get("tiles")
        return tiles[i] if isinstance(tiles, list) and len(tiles) == units else {}
    return st


def _reuse(held: Any, numel: int, n: int) -> torch.Tensor:
    """Load a moment into the tensor the optimizer holds for it when it has the shard's layout: no second
    copy of the state in memory during the load, and the bytes land in pages already mapped (a read into
    fresh pages ran at about half the disk's speed here). Like the master, it is overwritten in place."""
    if (torch.is_tensor(held) and held.device.type == "cpu" and held.dtype == torch.float32
            and held.numel() == numel and held.dim() == 1 and held.is_contiguous()):
        held[n:].zero_()
        return held
    return _staging(numel, n)


def _load_group(group: List[Tuple[str, torch.nn.Parameter, ParamHandle]], optimizer: Optional[torch.optim.Optimizer],
                in_optim: set, names: Dict[str, List[str]], meta: dict, run: Callable, bar: Any, size: int) -> int:
    """Read one sub-group's ranges, then hand each master and state to its tier."""
    targets: List[Target] = []
    staged = []
    for fqn, p, h in group:
        per_unit = []
        for i, u in enumerate(h.units()):
            key, numel, base = unit_key(fqn, h, i)
            lo, n = owned(u)
            nvme = u.master.tier == "nvme"
            master = _staging(u.shard_numel, n) if nvme else u.master.resident()
            if not nvme:
                master[n:].zero_()
            targets.append(Target(f"model/{key}", numel, base + lo, master[:n]))
            st = {}
            if id(p) in in_optim:
                held = {} if nvme else _held_state(optimizer, p, i, len(h.units()))
                for name in names.get(key, []):
                    st[name] = _reuse(held.get(name), u.shard_numel, n)
                    targets.append(Target(f"optim/{key}/{name}", numel, base + lo, st[name][:n]))
            per_unit.append((u, master, st))
        staged.append((fqn, p, h, per_unit))
    run({}, LoadPlanner(targets))
    for fqn, p, h, per_unit in staged:
        smalls = meta["small"].get(fqn) or [{}]
        states = []
        for i, (u, master, st) in enumerate(per_unit):
            if u.master.tier == "nvme":
                u.master_updated(master)
                u.master.set(master, donate=True)
            else:
                u.master_updated()
            states.append({**smalls[min(i, len(smalls) - 1)], **st})
        if optimizer is not None and id(p) in in_optim and any(states):
            optimizer._adopt_state(p, h, states[0] if len(states) == 1 else {"tiles": states})
    if bar is not None:
        bar(size)
    return 0
