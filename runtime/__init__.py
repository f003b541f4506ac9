"""zinf_runtime: the runtime half of zinf_compile.

It owns the parameter store (1/dp fp32 shards per rank), the ``torch.ops.zinf.*`` operators the
compiler's passes insert, the sharded optimizers and the memory accounting, the last per model
(``context.RuntimeContext``). It never imports the compiler: the two meet only through
``torch.ops.zinf.*`` (and ``compiling``, which scopes a compile's partitions to its model).
"""

from . import ops  # noqa: F401  (registers torch.ops.zinf.*)
from .accounting import ZinfOutOfMemoryError
from .context import RuntimeContext, compiling, contexts_of, io_stats, memory_stats, reset_peak_memory_stats
from .store import PartitionedDataError, Placement, handle_of, is_partitioned, partition

__all__ = [
    "memory_stats",
    "io_stats",
    "reset_peak_memory_stats",
    "RuntimeContext",
    "ZinfOutOfMemoryError",
    "PartitionedDataError",
    "compiling",
    "contexts_of",
    "Placement",
    "handle_of",
    "is_partitioned",
    "partition",
]
