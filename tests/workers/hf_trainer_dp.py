"""dp = 2 worker: the Hugging Face Trainer recipe (README) under torchrun, as a user would try it.

accelerate wraps the model in DistributedDataParallel whenever more than one process runs; its
reducer then writes into zinf's sharded gradients. The test expects the clear error naming the
Trainer and what to do, not a run that trains on doubled reductions.
"""

from __future__ import annotations

import sys

import torch
import transformers

import zinf_compile


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, seq: int = 16, vocab: int = 128):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


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
    transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None)).train()


if __name__ == "__main__":
    main(sys.argv[1])
