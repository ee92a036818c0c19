"""Ring attention: the public function and its `autograd.Function`s.

The passes themselves (the schedule, the custom backward, the tangent) live in
`_ring_passes.py` with their notes: [Note: the ring schedule], [Note: ring backward],
[Note: causal pairs]. The backward and jvp here run through further `autograd.Function`s
(`_RingGrad`, `_RingTangent`) so that torch.func transforms see them as ops, as DESIGN.md
asks of collectives.
"""

from __future__ import annotations

import torch

from .. import _collectives, _vma
from .._errors import ShardingError
from ._checks import check_qkv, default_scale, same_blocks
from ._layout import check_layout
from ._ring_passes import Plan, counting, ring_backward, ring_forward, ring_tangent

__all__ = ["ring_attention", "counting"]

# -- the autograd.Functions ------------------------------------------------------------------


def _fold(x, d, size: int):
    """Merge a vmap batch dim into dim 0 (the attention batch): (V, B, ...) -> (V*B, ...)."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand((size,) + tuple(x.shape)) if d is None else x.movedim(d, 0)
    return x.reshape((size * x.shape[1],) + tuple(x.shape[2:]))


def _unfold(x, size: int):
    return x.reshape((size, x.shape[0] // size) + tuple(x.shape[1:]))


def _no_higher_order(what: str):
    raise ShardingError(f"ring_attention: {what} of ring attention's own backward/tangent is not supported "
                        f"(first-order VJP and JVP are).\nFix: differentiate once, or use "
                        f"sf.nn.ulysses_attention, which is built from differentiable collectives.")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, mask, plan):
        return ring_forward(q, k, v, mask, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, ctx.plan = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.save_for_forward(q, k, v, out, lse, mask)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _RingGrad.apply(dout, q, k, v, out, lse, mask, ctx.plan)
        return dq, dk, dv, None, None

    @staticmethod
    def jvp(ctx, tq, tk, tv, _tmask, _plan):
        q, k, v, out, lse, mask = ctx.saved_tensors
        return _RingTangent.apply(q, k, v, tq, tk, tv, mask, out, lse, ctx.plan), None

    @staticmethod
    def vmap(info, in_dims, q, k, v, mask, plan):
        n = info.batch_size
        args = [_fold(x, d, n) for x, d in zip((q, k, v, mask), in_dims[:4])]
        out, lse = _RingAttention.apply(*args, plan)
        return (_unfold(out, n), _unfold(lse, n)), (0, 0)


class _RingGrad(torch.autograd.Function):
    @staticmethod
    def forward(dout, q, k, v, out, lse, mask, plan):
        return ring_backward(dout, q, k, v, out, lse, mask, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _no_higher_order("the gradient")

    @staticmethod
    def jvp(ctx, *tangents):
        _no_higher_order("forward-mode AD")

    @staticmethod
    def vmap(info, in_dims, dout, q, k, v, out, lse, mask, plan):
        n = info.batch_size
        args = [_fold(x, d, n) for x, d in zip((dout, q, k, v, out, lse, mask), in_dims[:7])]
        grads = _RingGrad.apply(*args, plan)
        return tuple(_unfold(g, n) for g in grads), (0, 0, 0)


class _RingTangent(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, tq, tk, tv, mask, out, lse, plan):
        return ring_tangent(q, k, v, tq, tk, tv, mask, out, lse, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        _no_higher_order("the gradient")

    @staticmethod
    def jvp(ctx, *tangents):
        _no_higher_order("forward-mode AD")

    @staticmethod
    def vmap(info, in_dims, q, k, v, tq, tk, tv, mask, out, lse, plan):
        n = info.batch_size
        args = [_fold(x, d, n) for x, d in zip((q, k, v, tq, tk, tv, mask, out, lse), in_dims[:9])]
        return _unfold(_RingTangent.apply(*args, plan), n), 0


# -- the public function ---------------------------------------------------------------------


def ring_attention(q, k, v, axis, *, causal: bool = True, scale: float | None = None, mask=None,
                   layout: str = "contiguous") -> torch.Tensor:
    """Attention over a sequence split along a mesh axis; K/V blocks travel around the ring.

    Call it inside a shard_map body or an `sf.shard` loss_fn. Each rank passes its own
    sequence block; the result is this rank's block of
    `F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)` over the
    whole (gathered) sequence, with `mask` the key-padding mask. Softmax statistics and
    the output accumulate in fp32 (fp64 for fp64 inputs); the result has q's dtype.
    The next K/V block's transfer is started before the current block is computed
    ([Note: the ring schedule]). The backward is a custom VJP that saves only this rank's
    q, k, v, output and log-sum-exp and rotates K/V and their gradients around the ring
    again, so memory per rank stays O(T / N) ([Note: ring backward]).

    Args:
      q: (B, H, T_local, D), this rank's queries.
      k: (B, Hkv, T_local, D) with H a multiple of Hkv (GQA; Hkv = 1 is MQA).
      v: (B, Hkv, T_local, D), the same shape as k.
      axis: the mesh axis (or tuple of axes) the sequence is split over; rank i along it
        holds block i (contiguous) or chunks i and 2N-1-i (zigzag).
      causal: mask future keys, by global position.
      scale: the score scale; default 1/sqrt(D).
      mask: None or a bool key-padding mask (B, T_local) of this rank's keys, True where
        a key takes part; it travels with K/V. A query whose keys are all masked gets 0.
      layout: "contiguous" or "zigzag" (see `sf.nn.zigzag`); only matters when causal.

    Returns:
      (B, H, T_local, D) in q's dtype: this rank's block of the attention output.

    Raises:
      ShardingError: outside a shard_map / shard, an unknown axis, shapes that do not
        fit (named with the axis and its size), an odd T_local with layout="zigzag".

    Autodiff: VJP (`backward`, `torch.func.grad`/`vjp`) and JVP (`torch.func.jvp`,
    computed by one more ring pass with the tangents of K/V travelling beside them);
    `torch.func.vmap` folds its batch dim into B. Second-order derivatives raise.

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"seq": 2})
      >>> q = k = v = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
      >>> f = sf.shard_map(lambda q, k, v: sf.nn.ring_attention(q, k, v, "seq"), mesh,
      ...                  sf.P(None, None, "seq"), sf.P(None, None, "seq"))
      >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      >>> bool(torch.allclose(f(q, k, v), ref, atol=1e-6))
      True
    """
    where = f"ring_attention(axis={axis!r}, causal={causal!r}, layout={layout!r})"
    check_layout(layout, where)
    if not isinstance(causal, bool):
        raise ShardingError(f"{where}: causal must be True or False, got {causal!r:.60}")
    group = _collectives._group("ring_attention", axis)
    check_qkv(f"{where} on axis {axis!r} of size {group.size}", q, k, v, mask)
    if layout == "zigzag" and q.shape[2] % 2:
        raise ShardingError(
            f"{where}: q has shape {tuple(q.shape)}; the zig-zag layout gives each of the {group.size} ranks of "
            f"axis {axis!r} two equal chunks, but the local sequence length {q.shape[2]} is odd.\nFix: make the "
            f"global length a multiple of 2 * {group.size} = {2 * group.size} and lay it out with "
            f"sf.nn.zigzag(x, {group.size}, dim).")
    plan = Plan(group, causal, default_scale(scale, q.shape[-1], where), layout)
    types = _collectives._types("ring_attention", group)
    with same_blocks(where, q, k, axis, group.size):
        if types is None:
            return _RingAttention.apply(q, k, v, mask, plan)[0]
        axes = _vma.vma(q, types) | _vma.vma(k, types) | _vma.vma(v, types) | set(group.axes)
        q, k, v = (_vma.lift(x, axes, types) for x in (q, k, v))
        with _vma.paused():
            out = _RingAttention.apply(q, k, v, mask, plan)[0]
        return _vma.tag(out, axes, types)
