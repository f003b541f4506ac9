"""The Hugging Face ``Trainer`` at any number of processes: ``ZinfTrainer``.

zinf shards the parameters and reduce-scatters their gradients itself. The ``Trainer`` (through
accelerate) wraps the model in ``DistributedDataParallel`` whenever more than one process runs, and
saves a checkpoint from the main process alone. Both break a zinf model: the wrapper's reducer
writes every gradient a second time, ``model.state_dict()`` is collective, and the optimizer's state
is each rank's own shards. This subclass keeps everything else of the ``Trainer`` and changes those
three points::

    before:  Trainer(model, args, optimizers=(opt, None))        dp > 1: DDP(model) -> zinf stops at
                                                                 the first backward, naming the wrapper
    after:   ZinfTrainer(model, args, optimizers=(opt, None))    the model runs as compiled; every rank
                                                                 joins each save; checkpoints hold every
                                                                 rank's shards (zinf_compile.save)

- **No wrapper.** accelerate still builds its ``DistributedDataParallel`` (which broadcasts rank 0's
  initial values, as DDP does), but the training loop runs the model itself. The wrapper's forward,
  which arms its reducer, is never called, so the reducer does nothing.
- **Saving the model** (``save_model``, and every checkpoint): each rank joins the gather of the
  full values (``zinf_compile.full_state_dict(rank0_only=True)``); the main process writes them with
  ``save_pretrained`` as before, so ``from_pretrained`` reads the checkpoint folder.
- **Saving and resuming the optimizer**: every rank writes its shards of the model and the optimizer
  into ``<checkpoint>/zinf`` with ``zinf_compile.save``, and ``resume_from_checkpoint`` reads them with
  ``zinf_compile.load`` (any dp size). The LR scheduler, RNG states and trainer state are the
  ``Trainer``'s own files.

Use it like the ``Trainer``; compile the model in place and pass zinf's optimizer, as at one process::

    model.compile(backend="zinf", options={...})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    ZinfTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, optimizers=(opt, None)).train()
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers.trainer import SCHEDULER_NAME

from . import checkpoint
from .state import full_state_dict

#: the folder of a Trainer checkpoint that holds zinf's shards of the model and the optimizer
SHARDS_DIR = "zinf"


class ZinfTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model compiled with ``backend="zinf"``; see the module docstring."""

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if isinstance(model, DistributedDataParallel):  # accelerate's, at dp > 1: the loop runs the model itself
            model = model.module
            self.model_wrapped = model
        return model, train_dataloader

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Every rank joins the gather of the full values; the main process writes them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self.model, rank0_only=True)  # collective at dp > 1
        self._save(output_dir, state_dict=state if self.args.should_save else None)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's shards of the model and the optimizer (``zinf_compile.save``); the scheduler as
        the ``Trainer`` saves it."""
        checkpoint.save(os.path.join(output_dir, SHARDS_DIR), self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        if checkpoint_dir is None:
            return
        shards = os.path.join(checkpoint_dir, SHARDS_DIR)
        if not os.path.isdir(shards):
            raise checkpoint.CheckpointError(
                f"zinf: {checkpoint_dir} has no {SHARDS_DIR}/ folder of zinf shards: it was not written by "
                "ZinfTrainer. Its optimizer file holds one rank's shards at most; resume from a ZinfTrainer "
                "checkpoint, or start the optimizer afresh (load the weights with from_pretrained)")
        checkpoint.load(shards, self.model, self.optimizer)
        sched = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
