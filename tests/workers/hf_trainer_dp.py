"""dp = 2 worker: the Hugging Face Trainer recipe (README) under torchrun, as a user would try it.

accelerate wraps the model in DistributedDataParallel whenever more than one process runs; its
reducer then writes into zinf's sharded gradients. The test expects the clear error naming the
Trainer and what to do, not a run that trains on doubled reductions.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

import zinf_compile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import Tokens  # noqa: E402


def main(out: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    model.compile(backend="zinf", options={"compiler": "eager"})
    opt = zinf_compile.optim.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, report_to=[],
                                          save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                                          disable_tqdm=True, ddp_backend="gloo", ddp_timeout=120)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(n=8), optimizers=(opt, None)).train()


if __name__ == "__main__":
    main(sys.argv[1])
