"""Attention on one (query chunk, key chunk) pair: forward, backward and tangent, in fp32+.

The ring (`_ring.py`) calls these on plain tensors, one pair of chunks at a time, and
merges the partial results itself. Shapes, with GQA folded in (`g = H / Hkv` query heads
share one K/V head, as `F.scaled_dot_product_attention(enable_gqa=True)` pairs them):

  q   (B, Hkv, g, Tq, D)   in the accumulation dtype (fp32, or fp64 for fp64 inputs)
  k,v (B, Hkv, Tk, D)      any float dtype; promoted here, per pair
  allowed                  bool, broadcastable to (B, 1, 1, Tq, Tk), True = attend; or None
  lse (B, Hkv, g, Tq)      log-sum-exp of the scaled scores over every key seen so far

[Note: fully masked rows] A query whose keys are all masked gets output 0, lse = -inf and
zero gradients, as `F.scaled_dot_product_attention` gives it (torch >= 2.5). The helpers
keep -inf out of subtractions (`_finite`) so no NaN appears.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "forward_pair", "merge", "backward_pair", "tangent_pair"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64: softmax statistics never in 16 bits."""
    return torch.promote_types(dtype, torch.float32)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a fully masked row's max or lse) replaced by 0, so `s - x` stays -inf, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _scores(q, k, allowed, scale) -> torch.Tensor:
    """(B, Hkv, g, Tq, Tk) scaled scores, masked keys at -inf."""
    s = torch.matmul(q, k.to(q.dtype).unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if allowed is not None:
        s = s.masked_fill_(~allowed, float("-inf"))
    return s


def _probs(q, k, allowed, scale, lse) -> torch.Tensor:
    """Softmax probabilities of this pair, normalized by the final `lse` over all keys."""
    s = _scores(q, k, allowed, scale)
    return s.sub_(_finite(lse).unsqueeze(-1)).exp_()


def forward_pair(q, k, v, allowed, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q attending to this pair's keys only: out (B, Hkv, g, Tq, D), lse (B, Hkv, g, Tq)."""
    s = _scores(q, k, allowed, scale)
    m = _finite(s.amax(-1, keepdim=True))
    p = s.sub_(m).exp_()  # in place: one (Tq, Tk) buffer per tile
    l = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.to(q.dtype).unsqueeze(2)).div_(torch.where(l == 0, torch.ones_like(l), l))
    return out, (m + l.log()).squeeze(-1)


def merge(out, lse, part_out, part_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial (out, lse) over disjoint keys into one."""
    new = torch.logaddexp(lse, part_lse)
    base = _finite(new)
    out = out * (lse - base).exp().unsqueeze(-1) + part_out * (part_lse - base).exp().unsqueeze(-1)
    return out, new


def backward_pair(q, k, v, allowed, scale, lse, dout, delta):
    """Gradients of this pair's share: (dq (B, Hkv, g, Tq, D), dk, dv (B, Hkv, Tk, D)).

    `dout` is the output cotangent in the accumulation dtype; `delta = (dout * out).sum(-1)`
    (the softmax's row correction), both over this chunk of queries."""
    p = _probs(q, k, allowed, scale, lse)
    vv = v.to(q.dtype).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    ds = torch.matmul(dout, vv.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    del p
    dq = torch.matmul(ds, k.to(q.dtype).unsqueeze(2)).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2).mul_(scale)
    return dq, dk, dv


def tangent_pair(q, k, v, tq, tk, tv, allowed, scale, lse):
    """This pair's share of the output tangent: (tN (B, Hkv, g, Tq, D), tl (B, Hkv, g, Tq)).

    With P = exp(S - lse) over all keys, out = sum_pairs P V, and the tangent of the
    output is sum_pairs (P * dS) V + P tV  -  out * sum_pairs rowsum(P * dS), where
    dS = scale (tq k^T + q tk^T); the ring sums tN and tl, then subtracts."""
    p = _probs(q, k, allowed, scale, lse)
    ds = torch.matmul(tq, k.to(q.dtype).unsqueeze(2).transpose(-1, -2))
    ds = ds.add_(torch.matmul(q, tk.to(q.dtype).unsqueeze(2).transpose(-1, -2))).mul_(scale).mul_(p)
    if allowed is not None:
        ds = ds.masked_fill_(~allowed, 0.0)
    tn = torch.matmul(ds, v.to(q.dtype).unsqueeze(2)).add_(torch.matmul(p, tv.to(q.dtype).unsqueeze(2)))
    return tn, ds.sum(-1)
