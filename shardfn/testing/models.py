"""Small models for tests, examples and benchmarks: a nanoGPT-style GPT and an MLP.

The GPT is the one the examples train too (`examples/train_gpt.py`): nanoGPT's layout
(blocks in an `nn.ModuleList` under `transformer.h`, the output head tied to the token
embedding, a causal mask as a non-persistent buffer), so `sf.functional` + `sf.shard`
exercise per-block units, ties and buffers. `GPTConfig(sdpa=True)` computes attention
with `F.scaled_dot_product_attention` instead, with no mask buffer (as nanoGPT does
where flash attention is available); the parameter tree is the same either way.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "MLP", "mlp_params", "mlp_loss"]


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 1024
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    bias: bool = True
    sdpa: bool = False  # attention by F.scaled_dot_product_attention, not an explicit masked softmax


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.sdpa = cfg.n_head, cfg.sdpa
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        if not cfg.sdpa:
            mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])  # (B, nh, T, T)
            att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf")).softmax(dim=-1)
            y = att @ v  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):  # idx: (B, T) int64
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class MLP(nn.Module):
    """`depth` Linear+tanh layers of `width` in an nn.Sequential, then a linear head."""

    def __init__(self, width: int = 1024, depth: int = 8, d_in: int = 64, d_out: int = 8):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.out = nn.Linear(width, d_out)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(self.out(h), y)


def mlp_params(generator: torch.Generator, sizes, dtype=torch.float32):
    """A plain pytree MLP: {'layers': [{'w': (d_in, d_out), 'b': (d_out,)}, ...]}."""
    layers = []
    for d_in, d_out in zip(sizes[:-1], sizes[1:]):
        w = torch.randn(d_in, d_out, generator=generator, dtype=dtype) / math.sqrt(d_in)
        b = torch.randn(d_out, generator=generator, dtype=dtype) * 0.1
        layers.append({"w": w, "b": b})
    return {"layers": layers}


def mlp_loss(params, batch):
    """Mean squared error of a tanh MLP in the `mlp_params` layout."""
    x, y = batch
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i + 1 < len(params["layers"]):
            h = torch.tanh(h)
    return ((h - y) ** 2).mean()
