"""The Lightning module and data of the Lightning tests (tests/test_lightning.py at dp 1, and its
dp-2 worker, tests/workers/lightning_dp.py)."""

from __future__ import annotations

import torch

import lightning.pytorch as pl  # make setup installs it (Makefile)

from zinf_compile.models import GPT, GPTConfig, make_batch

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


class LitGPT(pl.LightningModule):
    """A GPT compiled with ``backend="zinf"`` (``options``) or run eagerly (``None``); it records every
    training and validation loss, and whether each validation ran under inference mode."""

    def __init__(self, options: dict | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = GPT(CFG)
        self.net = net if options is None else torch.compile(net, backend="zinf", options=options)
        self.train_losses: list = []
        self.val_losses: list = []
        self.val_modes: list = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.net(x, y)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self(*batch)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.val_modes.append(torch.is_inference_mode_enabled())
        loss = self(*batch)
        self.val_losses.append(loss.clone())
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        # a plain torch optimizer, as a Lightning user writes it: zinf converts it on its first step
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(seeds: range, batch: int, per_step: int | None = None) -> torch.utils.data.DataLoader:
    """The batches ``make_batch(CFG, batch, seed=s)`` for ``s`` in ``seeds``, in order, ``per_step`` rows
    (default ``batch``) to a loader batch (at dp 2, half of them: each rank its own)."""
    xs, ys = zip(*(make_batch(CFG, batch, seed=s) for s in seeds))
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(data, batch_size=per_step or batch, shuffle=False)
