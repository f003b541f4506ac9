"""A real Lightning ``Trainer`` loop, zinf against eager, on the CPU.

Lightning is one of the loops the project takes as its spec. Its ``fit`` calls, in its own order:
``optimizer.zero_grad()``, ``backward``, ``clip_grad_norm_`` over the optimizer's parameters
(``gradient_clip_val``), the LR scheduler, a validation loop under ``torch.no_grad()`` and, at its end,
the ``ModelCheckpoint`` callback, which reads ``state_dict()`` of the module and of the optimizer.
``trainer.validate`` runs the same loop under ``torch.inference_mode()``, and ``fit(ckpt_path=...)``
resumes through ``load_state_dict`` of both. The module below compiles its network with
``backend="zinf"`` (params and optimizer on NVMe) or runs it eagerly; at dp = 1 with
``compiler="eager"`` both run the same ops in the same order, so every logged loss, the final
parameters and the saved checkpoints must be equal.
"""

from __future__ import annotations

import pytest
import torch

import lightning.pytorch as pl  # make setup installs it (Makefile)
from lightning.pytorch.callbacks import ModelCheckpoint

import zinf_compile
from zinf_compile.models import GPT, GPTConfig, make_batch

pytestmark = pytest.mark.parity

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4)


class LitGPT(pl.LightningModule):
    def __init__(self, options: dict | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        net = GPT(CFG)
        self.net = net if options is None else torch.compile(net, backend="zinf", options=options)
        self.train_losses: list = []
        self.val_losses: list = []
        self.val_modes: list = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.net(*batch)
        self.train_losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.val_modes.append(torch.is_inference_mode_enabled())
        loss = self.net(*batch)
        self.val_losses.append(loss.clone())
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        # a plain torch optimizer, as a Lightning user writes it: zinf converts it on its first step
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(seeds: range, batch: int) -> torch.utils.data.DataLoader:
    xs, ys = zip(*(make_batch(CFG, batch, seed=s) for s in seeds))
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)


def _run(options: dict | None, root) -> tuple[LitGPT, dict]:
    """fit 4 steps (validating at step 3; ``last.ckpt`` saved there and at the end), validate under
    inference mode, then resume from ``last.ckpt`` in a new Trainer and fit to step 6 (validating and
    saving there)."""
    module = LitGPT(options)

    def trainer(steps: int, folder: str) -> pl.Trainer:
        ckpt = ModelCheckpoint(dirpath=str(root / folder), save_last=True, save_top_k=0)
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=3,
                          limit_val_batches=2, num_sanity_val_steps=0, gradient_clip_val=0.05,
                          logger=False, enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=True, callbacks=[ckpt], default_root_dir=str(root))

    train, val = _loader(range(6), 4), _loader(range(100, 102), 2)
    first = trainer(4, "a")
    first.fit(module, train, val)
    first.validate(module, val, verbose=False)
    trainer(6, "b").fit(module, train, val, ckpt_path=str(root / "a" / "last.ckpt"))
    saved = torch.load(root / "b" / "last.ckpt", weights_only=False)
    return module, saved


def _plain(state: dict) -> dict:
    """State-dict keys without ``torch.compile``'s wrapper (``net._orig_mod.x`` -> ``net.x``)."""
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def test_lightning_fit_validate_resume_and_checkpoint_match_eager(tmp_path):
    (tmp_path / "swap").mkdir()
    options = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme",
               "nvme_path": str(tmp_path / "swap")}
    ref, ref_ckpt = _run(None, tmp_path / "eager")
    got, got_ckpt = _run(options, tmp_path / "zinf")

    # steps 1-4, then 5-6 after resuming (through load_state_dict of the module and the optimizer)
    assert len(got.train_losses) == len(ref.train_losses) == 6
    assert torch.equal(torch.stack(got.train_losses), torch.stack(ref.train_losses))
    # fit's validations under no_grad, trainer.validate's under inference mode: both happened
    assert got.val_modes == ref.val_modes == [False, False, True, True, False, False]
    assert torch.equal(torch.stack(got.val_losses), torch.stack(ref.val_losses))
    assert ref_ckpt["global_step"] == got_ckpt["global_step"] == 6

    full = zinf_compile.full_state_dict(got)
    want = ref.state_dict()
    assert _plain(full).keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(_plain(full)[k], v), k
    saved, saved_ref = _plain(got_ckpt["state_dict"]), ref_ckpt["state_dict"]
    assert saved.keys() == saved_ref.keys()
    for k, v in saved_ref.items():
        assert torch.equal(saved[k], v), k
    (zs,), (rs,) = got_ckpt["optimizer_states"], ref_ckpt["optimizer_states"]
    assert zs["param_groups"][0]["lr"] == rs["param_groups"][0]["lr"] == 0.1 * 0.5 ** 3  # StepLR(2, 0.5)
    rbufs = [s["momentum_buffer"] for s in rs["state"].values()]
    zbufs = [s["momentum_buffer"] for s in zs["state"].values()]
    assert len(zbufs) == len(rbufs) > 0
    for a, b in zip(zbufs, rbufs):  # zinf's state is the flat shard: the whole parameter at dp 1
        assert torch.equal(a.reshape(b.shape), b)
