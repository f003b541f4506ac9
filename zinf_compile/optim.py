"""Optimizers for partitioned parameters.

Any ``torch.optim`` optimizer works unchanged: built over partitioned parameters, it becomes on its first
step the sharded twin of its class and steps zinf's fp32 shards with its own update (see
``zinf_runtime.optim_adapt``; optimizers whose update is not elementwise are refused by name).
``zinf_compile.optim.AdamW`` / ``Adam`` / ``SGD`` are those twins, kept as thin names (they skip the
first-step check); ``zinf_compile.optim.sharded(opt)`` converts an optimizer up front.
"""

from zinf_runtime.optim import SGD, Adam, AdamW, ShardedOptimizerMixin
from zinf_runtime.optim_adapt import sharded, sharded_class

__all__ = ["AdamW", "Adam", "SGD", "ShardedOptimizerMixin", "sharded", "sharded_class"]
