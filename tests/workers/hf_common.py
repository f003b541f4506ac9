"""Tiny Hugging Face models, their batches and losses, shared by tests/test_hf_models.py and its dp worker.

Random init from small configs (nothing is downloaded): 2 layers, hidden 32, vocabulary 128,
sequence 16, dropout 0 (eager and zinf must draw no random masks). Each architecture brings
something of its own to the graphs zinf rewrites:

* ``llama``: RMSNorm, rotary position embeddings, grouped-query attention (2 key/value heads for 4);
* ``gpt2``: learned positions, Conv1D weights (used transposed), the LM head tied to ``wte``;
* ``qwen2``: like Llama with biases on q/k/v;
* ``bert``: a bidirectional encoder (``BertForMaskedLM``) with token-type embeddings, the MLM
  decoder tied to the word embeddings and its bias tied to ``cls.predictions.bias``.

Every batch has an attention mask with padding (the last 4 positions of every odd row), so the
masks reach SDPA (transformers' default attention here); padded positions carry label -100. BERT's
labels mark positions 3, 7 and 11 of every row (never padded), and its token types split each row
into segments A and B. Every row pair (2k, 2k+1) has the same number of labelled tokens, so with
dp = 2 each rank's mean over its labels averages to the global batch's mean.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F

VOCAB, SEQ, PAD = 128, 16, 4
NAMES = ("llama", "gpt2", "qwen2", "bert")

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, attention mask, labels, token types


def make_model(name: str) -> torch.nn.Module:
    """The model ``name`` of this module's docstring, randomly initialised from torch's RNG."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common))
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common))
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(intermediate_size=64, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0, **common))
    raise ValueError(f"unknown model {name!r}; choose from {NAMES}")


def batches(name: str, n: int, rows: int = 2, seed: int = 0) -> List[Batch]:
    """``n`` batches of ``rows`` sequences (``rows`` even), the same for every caller."""
    assert rows % 2 == 0
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[1::2, SEQ - PAD:] = 0
        ids[mask == 0] = 0  # pad token
        types = torch.zeros(rows, SEQ, dtype=torch.long)
        if name == "bert":
            labels = torch.full_like(ids, -100)
            labels[:, 3:SEQ - PAD:4] = ids[:, 3:SEQ - PAD:4]
            types[:, SEQ // 2:] = 1
        else:
            labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, mask, labels, types))
    return out


def is_bert(model: torch.nn.Module) -> bool:
    """Also true of the compiled wrapper (``OptimizedModule`` forwards ``config``)."""
    return getattr(getattr(model, "config", None), "model_type", "") == "bert"


def _inputs(model: torch.nn.Module, b: Batch) -> Dict[str, torch.Tensor]:
    ids, mask, _, types = b
    kw = {"input_ids": ids, "attention_mask": mask}
    if is_bert(model):
        kw["token_type_ids"] = types
    return kw


def loss_fn(model: torch.nn.Module, b: Batch) -> torch.Tensor:
    """Transformers' own loss (``labels=``): causal LMs shift the labels, MLM does not."""
    return model(**_inputs(model, b), labels=b[2]).loss


def loss_terms(model: torch.nn.Module, b: Batch) -> torch.Tensor:
    """The per-token terms whose sum is :func:`loss_fn` (for the fp32 summation bound, tests/conftest.py)."""
    logits = model(**_inputs(model, b)).logits
    labels = b[2]
    if not is_bert(model):  # next-token prediction: position t predicts label t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    keep = labels != -100
    return F.cross_entropy(logits[keep], labels[keep], reduction="none") / keep.sum()


class Tokens(torch.utils.data.Dataset):
    """``n`` random rows of ``seq`` token ids, each its own label: the Trainer recipe's dataset
    (tests/test_hf_trainer.py and its dp-2 worker)."""

    def __init__(self, n: int = 16, seq: int = 16, vocab: int = VOCAB):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}
