"""The Hugging Face ``Trainer`` recipe: ``model.compile(backend="zinf")`` in place, zinf's AdamW passed in.

accelerate rejects unknown names in ``TrainingArguments.torch_compile_backend``, so HF users reach a
custom backend by compiling the model in place before building the ``Trainer``. The Trainer then
calls ``model.zero_grad()``, ``clip_grad_norm_(model.parameters(), max_grad_norm)`` (through
accelerate) and its linear LR schedule: each must act on zinf's sharded gradients. Before
``ShardedGrad`` this run reported ``grad_norm 0.0``, clipped nothing and accumulated gradients across
steps (loss off by 1e-3 after 4 steps). At the end ``model.state_dict()`` and ``Trainer.save_model``
(safetensors) must give the trained values: before ``runtime/eager_access.py`` the first returned
tensors over 0-byte storage and reading one killed the process.

Tolerances: the losses and gradient norms come from the same kernels on the same values (rtol 1e-6
leaves room only for a last-bit difference in a norm); parameters after 4 AdamW steps are compared
tensor-wise, ``||zinf - eager|| <= 1e-5 ||eager||``: AOTAutograd's decomposed RMSNorm/rotary kernels
round differently from eager's in the last bits and Adam passes those through at ~lr scale. The model
has no biases and no absent-token gradients that are not exactly zero, so Adam is well conditioned.
"""

from __future__ import annotations

import pytest
import torch

import zinf_compile
from workers.hf_common import Tokens

pytestmark = pytest.mark.parity  # run again under ATEN_CPU_CAPABILITY=default by make test

transformers = pytest.importorskip("transformers", reason="transformers is installed by `make setup`")


def _train(zinf: bool, tmp_path) -> tuple[list, dict]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    if zinf:
        model.compile(backend="zinf", options={"compiler": "eager"})
        opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("zinf" if zinf else "eager")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=4, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, max_grad_norm=1.0, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(opt, None))
    trainer.train()
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    # the same calls for both: model.state_dict() (full values under zinf) and Trainer.save_model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.save_model(args.output_dir)
    saved = transformers.LlamaForCausalLM.from_pretrained(args.output_dir).state_dict()
    assert saved.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(saved[k], v), f"{k}: the saved checkpoint differs from model.state_dict()"
    if zinf:
        full = zinf_compile.full_state_dict(model)
        assert all(torch.equal(full[k], v) for k, v in state.items())
    return logs, state


def test_hf_trainer_llama_matches_eager(tmp_path):
    eager_logs, eager_state = _train(False, tmp_path)
    zinf_logs, zinf_state = _train(True, tmp_path)
    assert len(zinf_logs) == 4
    assert all(gn > 1.0 for _, gn in eager_logs), "max_grad_norm=1.0 must clip at every step"
    torch.testing.assert_close(torch.tensor(zinf_logs), torch.tensor(eager_logs), rtol=1e-6, atol=0)
    assert zinf_state.keys() == eager_state.keys()
    for k, want in eager_state.items():
        err = (zinf_state[k].double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
        assert err <= 1e-5, f"{k}: relative error {err:.3g}"


def test_zinf_trainer_at_dp2_matches_the_ddp_trainer_and_resumes(tmp_path):
    """``zinf_compile.hf.ZinfTrainer`` under torchrun at dp 2 against the plain ``Trainer`` (DDP) on the
    same model, data split and arguments (tests/workers/hf_zinf_trainer_dp.py): 4 steps of 2
    micro-batches with clipping and the linear schedule, a checkpoint every 2 steps, then a fresh
    model and Trainer resuming from ``checkpoint-2`` to step 4. About 60 s.

    Tolerances as the dp-1 test above: the losses and gradient norms within rtol 1e-6 (a norm's last
    bit: zinf sums per-shard norms in float64), the parameters after 4 AdamW steps within 1e-5 of
    eager's norm. The resumed run must give bitwise the uninterrupted run's values (same kernels on
    the same restored state), and ``from_pretrained`` of the last checkpoint the trained values."""
    import sys

    sys.path.insert(0, __import__("os").path.dirname(__file__))
    from _torchrun import run_modes

    runs = run_modes("hf_zinf_trainer_dp.py", tmp_path, timeout=400)
    for z, e in zip(runs["zinf"], runs["eager"]):
        assert len(z["logs"]) == len(e["logs"]) == 4 and z["resumed_logs"] == z["logs"]
        assert all(gn > 0.5 for _, gn in e["logs"])
        torch.testing.assert_close(torch.tensor(z["logs"]), torch.tensor(e["logs"]), rtol=1e-6, atol=0)
        assert z["params"].keys() == e["params"].keys() == z["saved"].keys()
        for k, want in e["params"].items():
            err = (z["params"][k].double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)
            assert err <= 1e-5, f"{k}: relative error {err:.3g}"
            assert torch.equal(z["resumed_params"][k], z["params"][k]), f"{k}: the resumed run differs"
            assert torch.equal(z["saved"][k], z["params"][k]), f"{k}: checkpoint-4 differs from the model"

