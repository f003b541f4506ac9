"""Optimizers for partitioned parameters: ``torch.optim`` twins that step zinf's fp32 shards.

``zinf_compile.optim.AdamW(model.parameters(), lr=..., weight_decay=...)`` takes exactly the
arguments of ``torch.optim.AdamW`` (likewise ``SGD`` and ``Adam``) and may be created before the
first compiled call. Gradient clipping: ``opt.clip_grad_norm_(max_norm)``, since ``param.grad`` of a
partitioned parameter is ``None``.
"""

from zinf_runtime.optim import SGD, Adam, AdamW, ShardedOptimizerMixin

__all__ = ["AdamW", "Adam", "SGD", "ShardedOptimizerMixin"]
