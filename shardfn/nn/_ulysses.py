"""Ulysses attention: trade the sequence split for a head split, attend locally, trade back.

[Note: Ulysses] (DeepSpeed-Ulysses, Jacobs et al. 2023) Each rank holds (B, H, T/N, D).
One all_to_all per tensor splits the heads and gathers the sequence: (B, H/N, T, D); the
rank runs ordinary `F.scaled_dot_product_attention` on whole sequences of H/N heads, and
one all_to_all brings the output back to (B, H, T/N, D). Per rank it moves, each way,
(N-1)/N of its q, k, v and output blocks: 4 all_to_alls forward and 4 backward, a volume
that does not grow with N, against ring attention's (N-1) K/V blocks. It needs the heads
(query and K/V heads) to divide by N, and a rank holds the whole sequence for its heads
(the T x T scores of H/N heads, unless SDPA's fused kernel avoids them). Autodiff comes
from the collectives' own rules: VJP, JVP and vmap whenever SDPA supports them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _collectives
from .._errors import ShardingError
from ._checks import check_qkv, default_scale, same_blocks
from ._layout import check_layout, chunk_ids

__all__ = ["ulysses_attention"]


def _global_positions(n: int, t_local: int, layout: str, device) -> torch.Tensor:
    """Global position of each row of the gathered sequence (rank-major blocks)."""
    if layout == "contiguous":
        return torch.arange(n * t_local, device=device)
    c = t_local // 2
    return torch.cat([torch.arange(c, device=device) + cid * c for i in range(n) for cid in chunk_ids(layout, i, n)])


def ulysses_attention(q, k, v, axis, *, causal: bool = True, scale: float | None = None, mask=None,
                      layout: str = "contiguous") -> torch.Tensor:
    """Attention over a sequence split along a mesh axis, by all_to_all to a head split.

    Same contract as `sf.nn.ring_attention` (this rank's blocks in and out, GQA, a
    key-padding mask, either layout), computed as [Note: Ulysses] describes: q, k, v go
    from sequence-split to head-split with `sf.all_to_all`, `F.scaled_dot_product_attention`
    runs on whole sequences of H/N heads, and the output comes back. Its gradients, JVP
    and vmap are those of the collectives and of SDPA.

    Args:
      q: (B, H, T_local, D).
      k: (B, Hkv, T_local, D); both H and Hkv must divide by the axis size N.
      v: (B, Hkv, T_local, D), the same shape as k.
      axis: the mesh axis (or tuple of axes) the sequence is split over.
      causal: mask future keys, by global position.
      scale: the score scale; default 1/sqrt(D).
      mask: None or a bool key-padding mask (B, T_local), True where a key takes part.
      layout: "contiguous" or "zigzag", how the sequence is laid out over the axis.

    Returns:
      (B, H, T_local, D): this rank's block of the attention output.

    Raises:
      ShardingError: heads that do not divide by the axis size (with what to do for
        GQA), bad shapes, outside a shard_map / shard, an unknown axis.

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"seq": 2})
      >>> q = k = v = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
      >>> f = sf.shard_map(lambda q, k, v: sf.nn.ulysses_attention(q, k, v, "seq"), mesh,
      ...                  sf.P(None, None, "seq"), sf.P(None, None, "seq"))
      >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      >>> bool(torch.allclose(f(q, k, v), ref, atol=1e-6))
      True
    """
    where = f"ulysses_attention(axis={axis!r}, causal={causal!r}, layout={layout!r})"
    check_layout(layout, where)
    if not isinstance(causal, bool):
        raise ShardingError(f"{where}: causal must be True or False, got {causal!r:.60}")
    n = _collectives.axis_size(axis)
    check_qkv(f"{where} on axis {axis!r} of size {n}", q, k, v, mask)
    h, hkv, t = q.shape[1], k.shape[1], q.shape[2]
    if h % n or hkv % n:
        fix = f"use sf.nn.ring_attention (no head constraint), or a mesh axis whose size divides {h}"
        if h % n == 0 and n % hkv == 0:
            fix = (f"repeat the K/V heads to {n} before the call, k = k.repeat_interleave({n // hkv}, dim=1) (and "
                   f"v alike; the GQA pairing is kept), or " + fix)
        raise ShardingError(
            f"{where}: Ulysses splits the heads over axis {axis!r} of size {n}, but q {tuple(q.shape)} has {h} "
            f"head{'s' * (h != 1)} and k/v {tuple(k.shape)} have {hkv}; both must divide by {n}.\nFix: {fix}.")
    if layout == "zigzag" and t % 2:
        raise ShardingError(f"{where}: q has shape {tuple(q.shape)}; the zig-zag layout needs an even local "
                            f"sequence length, got {t} on axis {axis!r} of size {n}.\nFix: lay the batch out "
                            f"with sf.nn.zigzag(x, {n}, dim) from a length divisible by {2 * n}.")
    scale = default_scale(scale, q.shape[-1], where)

    def to_heads(x):  # (B, H, T/N, D) -> (B, H/N, T, D)
        return _collectives.all_to_all(x, axis, split_dim=1, concat_dim=2)

    with same_blocks(where, q, k, axis, n):
        qh = to_heads(q)
    kh, vh = to_heads(k), to_heads(v)
    allowed = None
    if causal:
        pos = _global_positions(n, t, layout, q.device)
        allowed = pos[:, None] >= pos[None, :]  # (T, T)
    if mask is not None:
        keys = _collectives.all_gather(mask.to(torch.uint8), axis, dim=1).bool()  # (B, T)
        keys = keys[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    causal_only = causal and mask is None and layout == "contiguous"
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=None if causal_only else allowed,
                                         is_causal=causal_only, scale=scale, enable_gqa=hkv != h)
    return _collectives.all_to_all(out, axis, split_dim=2, concat_dim=1)
