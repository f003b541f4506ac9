"""zinf_compile: ZeRO-Infinity as a ``torch.compile`` backend.

    cmodel = torch.compile(model, backend="zinf", options={"offload_params": "cpu"})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=3e-4)

Parameters are sharded 1/dp per rank into the runtime's store; see README.md.
"""

from zinf_runtime import memory_stats, reset_peak_memory_stats

from . import optim
from .backend import zinf_backend
from .checkpoint import CheckpointError, checkpoint_exists, export
from .checkpoint import load as _load, save as _save
from .config import Config
from .init import init
from .memory_plan import memory_plan
from .pipeline import compile_records, last_graphs
from .state import full_state_dict, gathered


# partition="broadcast" models are refused here until the checkpoint layout knows owners
# (zinf_runtime.broadcast.refuse_checkpoint says why); the checks belong in checkpoint.save/load.
def save(path, model, optimizer=None, *, extra=None):  # type: ignore[no-untyped-def]
    from zinf_runtime.broadcast import refuse_checkpoint

    refuse_checkpoint(model, "save")
    return _save(path, model, optimizer, extra=extra)


def load(path, model, optimizer=None, *, options=None):  # type: ignore[no-untyped-def]
    from zinf_runtime.broadcast import refuse_checkpoint

    refuse_checkpoint(model, "load", options)
    return _load(path, model, optimizer, options=options)


save.__doc__, load.__doc__ = _save.__doc__, _load.__doc__

__all__ = [
    "Config",
    "init",
    "save",
    "load",
    "export",
    "checkpoint_exists",
    "CheckpointError",
    "optim",
    "zinf_backend",
    "full_state_dict",
    "gathered",
    "last_graphs",
    "compile_records",
    "memory_plan",
    "memory_stats",
    "reset_peak_memory_stats",
]
