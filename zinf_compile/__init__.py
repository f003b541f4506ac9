"""zinf_compile: ZeRO-Infinity as a ``torch.compile`` backend.

    cmodel = torch.compile(model, backend="zinf", options={"offload_params": "cpu"})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=3e-4)

Parameters are sharded 1/dp per rank into the runtime's store; see README.md.
"""

from zinf_runtime import PartitionedDataError, io_stats, memory_stats, reset_peak_memory_stats
from zinf_runtime.store import install_optimizer_guard

from . import optim
from .backend import zinf_backend
from .checkpoint import CheckpointError, checkpoint_exists, export, load, save
from .config import Config
from .init import init
from .memory_plan import memory_plan
from .pipeline import compile_records, last_graphs
from .state import full_state_dict, gathered

install_optimizer_guard()  # before a first step that partitions inside its closure (zinf_runtime.store)

__all__ = [
    "Config",
    "init",
    "save",
    "load",
    "export",
    "checkpoint_exists",
    "CheckpointError",
    "PartitionedDataError",
    "optim",
    "zinf_backend",
    "full_state_dict",
    "gathered",
    "last_graphs",
    "compile_records",
    "memory_plan",
    "memory_stats",
    "io_stats",
    "reset_peak_memory_stats",
]
