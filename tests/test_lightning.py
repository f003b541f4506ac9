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

import os
import sys

import pytest
import torch

import lightning.pytorch as pl  # make setup installs it (Makefile)
from lightning.pytorch.callbacks import ModelCheckpoint

import zinf_compile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from lit_common import LitGPT, loader as _loader  # noqa: E402

pytestmark = pytest.mark.parity


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


class _LitTwoOptimizers(LitGPT):
    """Manual optimization with two optimizers over disjoint parameters (the blocks; the embeddings,
    the final norm and the head), as GAN or encoder/decoder loops are written: both ``zero_grad``,
    one ``manual_backward``, Lightning's ``clip_gradients`` on one, then both ``step``."""

    def __init__(self, options: dict | None) -> None:
        super().__init__(options)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        a, b = self.optimizers()
        loss = self(*batch)
        self.train_losses.append(loss.detach().clone())
        a.zero_grad()
        b.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(a, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        a.step()
        b.step()
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        named = list(getattr(self.net, "_orig_mod", self.net).named_parameters())
        blocks = [p for n, p in named if n.startswith("blocks.")]
        rest = [p for n, p in named if not n.startswith("blocks.")]
        return [torch.optim.SGD(blocks, lr=0.1, momentum=0.9), torch.optim.SGD(rest, lr=0.05)]


class _LitAutocast(LitGPT):
    """Records whether each training step ran under CPU autocast (``precision="bf16-mixed"``)."""

    def __init__(self, options: dict | None) -> None:
        super().__init__(options)
        self.autocast: list = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return super().training_step(batch, batch_idx)


_LOOPS = {
    # micro-batches accumulated by Lightning (no zero_grad between them), clipped once per step
    "accumulate_grad_batches": (LitGPT, dict(accumulate_grad_batches=2, gradient_clip_val=0.05), 4, 8),
    # torch.autocast("cpu", bfloat16) around forward; fp32 master weights, as eager's AMP
    "bf16-mixed": (_LitAutocast, dict(precision="bf16-mixed", gradient_clip_val=0.05), 4, 4),
    # max_steps counts each optimizer's step: 8 steps are 4 batches
    "two_optimizers": (_LitTwoOptimizers, {}, 8, 4),
}


@pytest.mark.parametrize("loop", sorted(_LOOPS))
def test_lightning_loop_variants_match_eager(tmp_path, loop):
    """Three more things Lightning users turn on, each bitwise eager's with params and optimizer on NVMe
    (dp 1, ``compiler="eager"``: the same ops in the same order): gradient accumulation, bf16 autocast,
    and manual optimization with two optimizers over one compiled network."""
    cls, extra, max_steps, n_losses = _LOOPS[loop]
    (tmp_path / "swap").mkdir()
    options = {"compiler": "eager", "offload_params": "nvme", "offload_optimizer": "nvme",
               "nvme_path": str(tmp_path / "swap")}
    runs = {}
    for name, opts in (("eager", None), ("zinf", options)):
        module = cls(opts)
        init = {k: v.clone() for k, v in _plain(module.state_dict()).items()}  # before the first forward partitions it
        pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                   default_root_dir=str(tmp_path / name), **extra).fit(module, _loader(range(8), 4))
        final = _plain(zinf_compile.full_state_dict(module)) if opts else module.state_dict()
        runs[name] = (module, init, final)
    (ref, init, want), (got, _, final) = runs["eager"], runs["zinf"]
    assert len(got.train_losses) == len(ref.train_losses) == n_losses
    assert torch.equal(torch.stack(got.train_losses), torch.stack(ref.train_losses))
    assert final.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(final[k], v), k
    moved = {k for k, v in want.items() if not torch.equal(v, init[k])}
    assert {"net.tok.weight", "net.blocks.0.qkv.weight"} <= moved, moved  # both optimizers' parameters stepped
    if loop == "bf16-mixed":
        assert got.autocast == ref.autocast == [True] * 4


def test_lightning_at_dp2_with_zinf_strategy_matches_ddp(tmp_path):
    """``Trainer(devices=2, strategy=ZinfStrategy())`` under torchrun against eager DDP
    (``strategy="ddp"``) on the same module, data split and steps (tests/workers/lightning_dp.py): fit
    with clipping, validation and ``ModelCheckpoint``, ``validate``, then a fresh module resuming from
    the sharded checkpoint (params and optimizer on NVMe) to step 6. About 30 s.

    Tolerance: at dp 2 both reduce a gradient as the sum of two half-batch values (exact order), so
    the gradients are the same; what may differ is the clip coefficient, from zinf's per-shard norms
    summed in float64 against eager's per-tensor fp32 norms: a few ulps. Each update is at most
    lr x 0.05 (the clipped norm), so that costs ~1e-9 a step, and each parameter may round to the
    neighbouring fp32 value once a step: 6 ulps of |p| over 6 steps (``rtol=1e-6``). A first step
    whose replicated gradient was not averaged moved ``scale`` by 3e-6 and the losses by 1e-5."""
    sys.path.insert(0, os.path.dirname(__file__))
    from _torchrun import run_modes

    runs = run_modes("lightning_dp.py", tmp_path)
    tol = dict(rtol=1e-6, atol=1e-7)
    for z, e in zip(runs["zinf"], runs["eager"]):
        assert len(z["train"]) == len(e["train"]) == 6 and len(z["val"]) == len(e["val"]) == 6
        torch.testing.assert_close(torch.stack(z["train"]), torch.stack(e["train"]), **tol)
        torch.testing.assert_close(torch.stack(z["val"]), torch.stack(e["val"]), **tol)
        assert z["val_modes"] == e["val_modes"]
        assert z["global_step"] == e["global_step"] == 6
        assert z["lr"] == e["lr"] == 0.1 * 0.5 ** 3  # the resumed StepLR
        assert z["sharded_ckpt"] and not e["sharded_ckpt"]  # zinf_compile.save's directory
        # the fresh module's compiled network was partitioned by the load, not loaded whole
        assert z["partitioned_at_start"] == (False, True) and e["partitioned_at_start"] == (False, False)
        assert z["params"].keys() == e["params"].keys()
        for k, v in e["params"].items():
            torch.testing.assert_close(z["params"][k], v, **tol, msg=lambda m: f"{k}: {m}")
    z0, z1 = runs["zinf"]
    assert torch.equal(z0["scale_rank"], z1["scale_rank"])  # the replicated parameter: replicas agree


def test_zinf_strategy_refuses_wrapper_options_and_foreign_checkpoints(tmp_path):
    """Options of the DDP wrapper it does not create, a checkpoint file another strategy wrote, and a
    restricted (``weights_only``) load of its pickled Lightning state get errors naming them and what
    to do."""
    from zinf_compile.lightning import ZinfStrategy

    with pytest.raises(TypeError, match=r"\['find_unused_parameters'\] configure the DistributedDataParallel"):
        ZinfStrategy(find_unused_parameters=True)
    foreign = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(zinf_compile.CheckpointError, match="is a file, not a directory.*load_state_dict"):
        ZinfStrategy().load_checkpoint(foreign)
    with pytest.raises(zinf_compile.CheckpointError, match="not found"):
        ZinfStrategy().load_checkpoint(tmp_path / "missing")
    zinf_compile.save(tmp_path / "zinf", torch.nn.Linear(2, 2))  # a zinf checkpoint (not Lightning's)
    with pytest.raises(zinf_compile.CheckpointError, match="weights_only=True cannot load"):
        ZinfStrategy().load_checkpoint(tmp_path / "zinf", weights_only=True)


def test_zinf_strategy_is_registered_by_name():
    """After ``import zinf_compile.lightning``, ``strategy="zinf"`` selects it; Lightning's "ddp" stays DDP."""
    from lightning.pytorch.strategies import DDPStrategy

    from zinf_compile.lightning import ZinfStrategy

    kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_checkpointing=False)
    assert type(pl.Trainer(strategy="zinf", **kw).strategy) is ZinfStrategy
    assert type(pl.Trainer(strategy="ddp", **kw).strategy) is DDPStrategy
