"""Lightning at dp > 1: ``ZinfStrategy``, Lightning's DDP process handling without the DDP wrapper.

zinf reduce-scatters the gradients of the parameters it partitions, so the module must not be
wrapped in ``DistributedDataParallel`` (its reducer would reduce them a second time: zinf refuses it
with an error). Lightning's ``strategy="ddp"`` wraps; this strategy keeps everything else of it (the
launch, the process group, ``DistributedSampler``, ``reduce``/``barrier``/``broadcast``, logging with
``sync_dist``)::

    before:  Trainer(strategy="ddp")          DDP(LitModule)  -> zinf: "a DistributedDataParallel wrapper ..."
    after:   Trainer(strategy=ZinfStrategy())  LitModule: the zinf-compiled parts reduce-scatter their
                                              gradients; parameters no graph partitions are averaged
                                              over ranks by the optimizer's hook, as DDP would

What DDP's constructor does besides wrapping is kept: before training, rank 0's values of every
parameter and buffer zinf does not hold are broadcast (partitioned ones are synced from rank 0 when
zinf partitions them), and Lightning's own sync before ``validate``/``test`` skips the shards.

Checkpoints are sharded: ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) writes
``zinf_compile.save``'s directory at ``path``, each rank its own shards of parameters and optimizer
states, with the rest of Lightning's checkpoint (loops, callbacks, LR schedulers, hyper-parameters)
stored as its ``extra``. Lightning's default would write only rank 0's optimizer shards. Loading
(``fit(ckpt_path=...)``, ``validate(ckpt_path=...)``) reads such a directory at any dp size, into a
fresh module too: its zinf-compiled parts are partitioned then, never gathered whole. A directory
like this holds no ``"state_dict"`` for ``on_load_checkpoint`` hooks; ``zinf_compile.export`` writes
full tensors for use without zinf.

Requires ``lightning`` (``lightning.pytorch``); importing this module imports it and registers the
name: ``Trainer(strategy="zinf")`` is ``ZinfStrategy()``.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Dict, List, Mapping, Optional

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import zinf_runtime
from zinf_runtime import comm

from . import _torch_compat
from .checkpoint import CheckpointError, checkpoint_exists, load, save

__all__ = ["ZinfStrategy"]

_EXTRA_KEY = "lightning"  # where Lightning's checkpoint dict (less model and optimizer state) is kept


class ZinfStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` that does not wrap the module; see the module docstring.

    Takes ``DDPStrategy``'s process arguments (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``,
    ``timeout``, ``start_method``). Options of the DDP wrapper itself are refused by name.
    """

    strategy_name = "zinf"

    _PROCESS_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                     "precision_plugin", "process_group_backend", "timeout", "start_method")

    def __init__(self, **kwargs: Any) -> None:
        bad = sorted(k for k in kwargs if k not in self._PROCESS_ARGS)
        if bad:  # DDPStrategy's others (comm hooks, find_unused_parameters, ...) configure the wrapper
            raise TypeError(f"ZinfStrategy: {bad} configure the DistributedDataParallel wrapper, which this "
                            "strategy does not create (zinf reduces the gradients itself); remove them. "
                            f"It takes {list(self._PROCESS_ARGS)}")
        super().__init__(**kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``strategy="zinf"`` (DDPStrategy's own would register its "ddp" names to this class)."""
        strategy_registry.register("zinf", cls, description="DDP processes without the DDP wrapper: zinf "
                                   "reduces its own gradients (zinf_compile.lightning)", override=True)

    # -- no wrapper -------------------------------------------------------------------------------

    def setup(self, trainer: Any) -> None:
        # Lightning broadcasts rank 0's parameters before validate/test (``_sync_module_states``),
        # honouring DDP's ignore list: a partitioned parameter has only this rank's shard
        assert self.model is not None
        _torch_compat.ddp_ignore(self.model, _partitioned_names(self.model))
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """What DDP's constructor does, without the wrapper: every rank starts from rank 0's values."""
        assert self.model is not None
        _broadcast_unpartitioned(self.model)

    # -- sharded checkpoints ----------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer exists by then: its shards load with the parameters'

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        return {}  # the parameters go to zinf_compile.save's shards (a full state dict gathers them)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        return {}  # the same: each rank writes its own optimizer shards

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Collective (Lightning calls it on every rank): ``zinf_compile.save`` at ``filepath``."""
        if storage_options is not None:
            raise TypeError("ZinfStrategy.save_checkpoint: storage_options is not supported (the checkpoint "
                            "is a zinf_compile.save directory); leave it None")
        opt = self._one_optimizer("save") if checkpoint.get("optimizer_states") else None
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        rest["zinf_has_optimizer"] = opt is not None
        save(os.fspath(filepath), self.lightning_module, opt, extra={_EXTRA_KEY: rest})

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Load the shards into the module (and, when fitting, the optimizer); return Lightning's dict."""
        path = os.fspath(checkpoint_path)
        if not checkpoint_exists(path):
            what = "a file, not a directory" if os.path.isfile(path) else "not found"
            raise CheckpointError(
                f"ZinfStrategy: {path} is {what}: this strategy reads the directories it writes "
                "(zinf_compile.save). A checkpoint from another strategy holds full tensors: load it with "
                "module.load_state_dict(torch.load(path)['state_dict']) before fit, without ckpt_path")
        if weights_only:  # torch.load's restricted unpickler: the saved Lightning state is a pickle
            raise CheckpointError(f"ZinfStrategy: weights_only=True cannot load {path}: its Lightning state "
                                  "(loops, callbacks, schedulers) is stored pickled, as torch.save stores a "
                                  "Lightning checkpoint; pass weights_only=False for a checkpoint you trust")
        opt = self._one_optimizer("load") if self.optimizers else None  # fitting: the optimizer's shards too
        extra = load(path, self.lightning_module, opt)
        ckpt = dict(extra.get(_EXTRA_KEY) or {}) if isinstance(extra, dict) else {}
        if not ckpt:
            raise CheckpointError(f"ZinfStrategy: {path} was written by zinf_compile.save, not by a Lightning "
                                  "Trainer; load it with zinf_compile.load(path, module, optimizer) instead")
        had_optimizer = ckpt.pop("zinf_has_optimizer", False)
        ckpt["state_dict"] = {}  # loaded above
        if had_optimizer:
            ckpt["optimizer_states"] = [{} for _ in self.optimizers]  # loaded above
        return ckpt

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the shards

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # the same

    def _one_optimizer(self, what: str) -> Optional[torch.optim.Optimizer]:
        opts: List[Any] = [getattr(o, "_optimizer", o) for o in self.optimizers]  # LightningOptimizer
        if len(opts) > 1:
            raise NotImplementedError(f"ZinfStrategy: cannot {what} a checkpoint of {len(opts)} optimizers "
                                      "(zinf_compile.save takes one); use one optimizer with several param groups")
        return opts[0] if opts else None


def _partitioned_names(module: torch.nn.Module) -> List[str]:
    return [n for n, p in module.named_parameters() if zinf_runtime.handle_of(p) is not None]


def _broadcast_unpartitioned(module: torch.nn.Module) -> None:
    """Rank 0's value of every parameter and buffer zinf does not hold, as DDP's constructor does
    (``comm.broadcast`` stages a tensor through the group's device: NCCL refuses CPU buffers)."""
    if comm.world_size(None) == 1:  # type: ignore[arg-type]
        return
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            if zinf_runtime.handle_of(t) is None:
                comm.broadcast(t.data, None)  # type: ignore[arg-type]


ZinfStrategy.register_strategies(StrategyRegistry)  # Trainer(strategy="zinf") once this module is imported
