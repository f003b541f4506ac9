"""Small reference models shared by the examples, tests and benchmarks (plain PyTorch, nothing zinf).

``GPT`` is a GPT-style decoder: pre-LayerNorm blocks, causal self-attention, GELU MLP, learned
positions, and an LM head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    mlp_bias: bool = True
    attn_bias: bool = False  # a key bias has a zero gradient; Adam turns its noise into drift
    # GPT-2 style normal(0, std) init; None keeps PyTorch's defaults (larger logits, larger gradients:
    # parity tests across reduction orders use it so Adam has no near-zero gradients to amplify)
    init_std: float | None = 0.02


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attn_bias)
        self.proj = nn.Linear(h, h, bias=cfg.attn_bias)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h, bias=cfg.mlp_bias)
        self.out = nn.Linear(4 * h, h, bias=cfg.mlp_bias)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        shape = (b, t, self.heads, h // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, h)
        return self.proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules() if cfg.init_std is not None else ():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=cfg.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (16, 32, 32, 8), bias: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def make_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
