"""Rotary position embedding (RoPE) at given positions, for sequence-split models."""

from __future__ import annotations

import torch

from .._errors import ShardingError
from ._blocks import accumulation_dtype

__all__ = ["rotary"]


def rotary(x: torch.Tensor, positions: torch.Tensor, *, base: float = 10000.0) -> torch.Tensor:
    """Rotate `x` by RoPE at `positions` (the "rotate half" form of Llama / transformers).

    With the sequence split over a mesh axis, pass `sf.nn.positions(t_local, axis,
    layout=...)` so every rank rotates its tokens by their global positions. Angles are
    computed in fp32 (fp64 for fp64 inputs); the result has x's dtype.

    Args:
      x: (..., T, D) with D even, e.g. q or k of shape (B, H, T, D).
      positions: (T,) integer (or float) positions of the T rows.
      base: the frequency base (10000 in Llama 2; rope_theta in transformers configs).

    Returns:
      `x * cos + rotate_half(x) * sin`, same shape and dtype as x.

    Raises:
      ShardingError: odd D, or positions whose length is not x's T.

    Example:
      >>> import shardfn as sf, torch
      >>> x = torch.ones(1, 1, 2, 2)
      >>> sf.nn.rotary(x, torch.tensor([0, 1]))[0, 0, 0]  # position 0: unchanged
      tensor([1., 1.])
    """
    d = x.shape[-1]
    if d % 2 or x.dim() < 2 or positions.dim() != 1 or positions.shape[0] != x.shape[-2]:
        raise ShardingError(f"rotary: x has shape {tuple(x.shape)} and positions {tuple(positions.shape)}; x must "
                            f"be (..., T, D) with D even and positions (T,).\nFix: pass "
                            f"sf.nn.positions(T_local, axis, layout=...) for this rank's T_local rows.")
    acc = accumulation_dtype(x.dtype)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=acc, device=x.device) / d))
    angles = positions.to(device=x.device, dtype=acc)[:, None] * inv[None, :]  # (T, D/2)
    emb = torch.cat([angles, angles], dim=-1)  # (T, D)
    xa = x.to(acc)
    half = torch.cat([-xa[..., d // 2:], xa[..., : d // 2]], dim=-1)
    return (xa * emb.cos() + half * emb.sin()).to(x.dtype)
