"""A functional GPT whose sequence may be split over a mesh axis (context parallelism).

The same nanoGPT block as `shardfn.testing.models.GPT` (pre-LayerNorm, causal attention,
GELU MLP, tied output head), written as a function of an explicit parameter tree so that
one function runs on one device (`attention="sdpa"`, the whole sequence) and on a rank's
sequence block (`attention="ring"` / `"ulysses"` over `cfg.axis`): positions come from
`sf.nn.positions`, so a block knows where its tokens sit in the sequence (learned position
embeddings, or RoPE with `rope=True`). `mlp_axis` splits the MLP's hidden units over a
tensor-parallel axis (Megatron: column- then row-parallel, one psum); `mlp_tp_spec`
gives `sf.shard(..., param_specs=...)` that split. `remat=True` wraps each block in
`sf.remat`. Used by tests/nn/test_context_parallel_gpt.py, examples/long_context.py and
docs/howto/context-parallel.md.

The loss is the mean next-token cross-entropy over this rank's tokens. With every rank
holding as many tokens (equal local batches, the sequence split evenly), `sf.shard`'s
mean over `data_axes=("data", "seq")` is then the token mean over the global batch, as
one device computes it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

import shardfn as sf

__all__ = ["SeqGPTConfig", "block", "forward", "init_params", "loss_fn", "mlp_tp_spec"]


@dataclasses.dataclass(frozen=True)
class SeqGPTConfig:
    vocab_size: int = 96
    max_len: int = 256  # rows of the learned position table (global positions)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    attention: str = "sdpa"  # "sdpa" (one device, whole sequence), "ring" or "ulysses"
    axis: str | None = None  # the sequence axis of "ring" / "ulysses"
    layout: str = "contiguous"  # or "zigzag" (the batch must be put through sf.nn.zigzag)
    rope: bool = False  # RoPE on q and k instead of learned positions
    mlp_axis: str | None = None  # tensor-parallel axis of the MLP (params split by mlp_tp_spec)
    remat: bool = False  # sf.remat around each block


def init_params(cfg: SeqGPTConfig, generator: torch.Generator, dtype=torch.float32) -> dict:
    """The full parameter tree, nanoGPT's init (normal(0, 0.02), zero biases, unit LayerNorms).

    Layers are a list, so `sf.shard`'s default units are the blocks."""
    C = cfg.n_embd

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype) * 0.02

    def layer():
        return {
            "ln1_w": torch.ones(C, dtype=dtype), "ln1_b": torch.zeros(C, dtype=dtype),
            "qkv_w": normal(C, 3 * C), "qkv_b": torch.zeros(3 * C, dtype=dtype),
            "proj_w": normal(C, C), "proj_b": torch.zeros(C, dtype=dtype),
            "ln2_w": torch.ones(C, dtype=dtype), "ln2_b": torch.zeros(C, dtype=dtype),
            "fc_w": normal(C, 4 * C), "fc_b": torch.zeros(4 * C, dtype=dtype),
            "out_w": normal(4 * C, C), "out_b": torch.zeros(C, dtype=dtype),
        }

    params = {"wte": normal(cfg.vocab_size, C), "layers": [layer() for _ in range(cfg.n_layer)],
              "lnf_w": torch.ones(C, dtype=dtype), "lnf_b": torch.zeros(C, dtype=dtype)}
    if not cfg.rope:
        params["wpe"] = normal(cfg.max_len, C)
    return params


def mlp_tp_spec(path):
    """`param_specs` for `mlp_axis="model"`: fc column-parallel, out row-parallel."""
    specs = {"fc_w": sf.P(None, "model"), "fc_b": sf.P("model"), "out_w": sf.P("model")}
    path = tuple(path)
    return specs.get(path[-1]) if path[:1] == ("layers",) else None


def _positions(cfg: SeqGPTConfig, t: int, device) -> torch.Tensor:
    if cfg.attention == "sdpa":
        return torch.arange(t, device=device)
    return sf.nn.positions(t, cfg.axis, layout=cfg.layout, device=device)


def _attention(cfg: SeqGPTConfig, q, k, v):
    if cfg.attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = {"ring": sf.nn.ring_attention, "ulysses": sf.nn.ulysses_attention}[cfg.attention]
    return attn(q, k, v, cfg.axis, causal=True, layout=cfg.layout)


def block(cfg: SeqGPTConfig, p: dict, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One pre-LN transformer block on this rank's tokens: (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    hs = C // cfg.n_head
    h = F.layer_norm(x, (C,), p["ln1_w"], p["ln1_b"])
    q, k, v = (h @ p["qkv_w"] + p["qkv_b"]).split(C, dim=2)
    q, k, v = (t.view(B, T, cfg.n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    if cfg.rope:
        q, k = sf.nn.rotary(q, pos), sf.nn.rotary(k, pos)
    y = _attention(cfg, q, k, v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    x = x + y @ p["proj_w"] + p["proj_b"]
    h = F.layer_norm(x, (C,), p["ln2_w"], p["ln2_b"])
    y = F.gelu(h @ p["fc_w"] + p["fc_b"]) @ p["out_w"]  # (B, T, C); a partial sum under TP
    if cfg.mlp_axis is not None:
        y = sf.psum(y, cfg.mlp_axis)
    return x + y + p["out_b"]


def forward(params: dict, idx: torch.Tensor, cfg: SeqGPTConfig) -> torch.Tensor:
    """Logits (B, T, vocab) of this rank's tokens idx (B, T) (T: the local block)."""
    T = idx.shape[1]
    pos = _positions(cfg, T, idx.device)
    x = params["wte"][idx]  # (B, T, C)
    if not cfg.rope:
        x = x + params["wpe"][pos]
    run = sf.remat(block) if cfg.remat else block
    for p in params["layers"]:
        x = run(cfg, p, x, pos)
    x = F.layer_norm(x, (cfg.n_embd,), params["lnf_w"], params["lnf_b"])
    return x @ params["wte"].T  # tied head


def loss_fn(params: dict, batch, cfg: SeqGPTConfig) -> torch.Tensor:
    """Mean next-token cross-entropy over this rank's tokens; batch = (idx, targets), (B, T)."""
    idx, targets = batch
    logits = forward(params, idx, cfg)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

