"""dp = 2 worker: the Hugging Face Trainer under torchrun, eager (``Trainer``: DDP) or zinf (``ZinfTrainer``).

Both train a tiny Llama 4 optimizer steps (2 micro-batches each, clipping, the linear LR schedule),
saving a checkpoint every 2 steps, then a fresh model and Trainer resume from ``checkpoint-2`` and
train to step 4 again. Writes ``result{rank}.pt`` under OUT: the logged losses and gradient norms of
both runs, the final parameters of both, and what ``from_pretrained`` reads from ``checkpoint-4``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers

import zinf_compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import Tokens  # noqa: E402


#: the models trained so far, kept alive: a second instance of a class whose compiled graph was made for a
#: collected first one stops with "no partitioned parameter with uid ..." unless it was partitioned
#: before its first call (a limitation of zinf's graph reuse across instances, not of the Trainer)
ALIVE: list = []


def run(mode: str, out: str, resume: bool) -> tuple[list, dict]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ALIVE.append(model)
    if mode == "zinf":
        from zinf_compile.hf import ZinfTrainer as Trainer

        model.compile(backend="zinf", options={"compiler": "eager", "offload_optimizer": "cpu"})
        opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        Trainer = transformers.Trainer
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        logging_steps=1, report_to=[], save_strategy="steps", save_steps=2, use_cpu=True, max_grad_norm=1.0,
        seed=0, dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo", ddp_timeout=120)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(n=32), optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if resume else None)
    logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    params = zinf_compile.full_state_dict(model) if mode == "zinf" else \
        {k: v.detach().clone() for k, v in model.state_dict().items()}
    return logs, params


def main(mode: str, out: str) -> None:
    result: dict = {}
    result["logs"], result["params"] = run(mode, out, resume=False)
    result["resumed_logs"], result["resumed_params"] = run(mode, out, resume=True)
    saved = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "checkpoint-4"))
    result["saved"] = {k: v.detach().clone() for k, v in saved.state_dict().items()}
    torch.save(result, os.path.join(out, f"result{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
