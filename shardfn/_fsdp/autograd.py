"""The autograd Functions of `shard`: they move a unit's parameters in (all-gather) and
its gradients out (reduce-scatter), in reverse and forward mode and under vmap. They are
thin adapters: each calls the named transitions of the per-rank state (runtime.py:
`RankState.pre_forward` / `pre_backward` / `post_backward`, `reduce_gradients`) or the
unit's own gathers (unit.py), and keeps no logic of the schedule ([Note: backward order]
in runtime.py explains when their backward nodes run).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._compile import not_traced
from .._collectives import _Psum
from .._errors import ShardingError
from .batch import reduce_loss, settle

if TYPE_CHECKING:
    from .runtime import RankState

__all__ = ["GatherUnit", "ReduceScatterUnit", "GatherStacked", "GatherTangent", "LossMean", "plain"]

_BACKWARD = "shard's backward nodes (re-gathers, reduce-scatters) run eagerly ([Note: no whole-step graph])"
_NESTED_STACKING = "shard: vmap over stacked shards nests once (one ensemble dimension)"

# [Note: stacked shards]
# `vmap(step)` over stacked shards (an ensemble of B models, each sharded like the
# params): the unit's shards of all B members travel in one (B, S) all-gather and come
# back as (B, *leaf shape) full leaves (GatherStacked). No freeing and no prefetch: the
# gathered members stay alive until the backward (memory: B units per unit touched).
# Backward: one reduce-scatter of the (k, B, S) gradients (ReduceScatterUnit with
# `stacked`), the same path as per-example gradients. With a compressed all-gather each
# member's shard buffer is encoded as its own row: (B, nbytes(S)) per rank.


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor under any functorch wrappers (same storage), detached. (Detached with
    functorch off: under a transform, `detach()` would wrap the result again.)"""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    with torch._C._DisableFuncTorch():
        return t.detach()




def _batch_first(xs, dims, size: int) -> list:
    """A vmap rule's inputs with their batch dim first; unbatched ones expanded to `size`."""
    out = []
    for x, d in zip(xs, dims):
        if x is None:
            out.append(None)
        elif d is None:
            out.append(x.unsqueeze(0).expand((size,) + tuple(x.shape)))
        else:
            out.append(x.movedim(d, 0))
    return out


class GatherUnit(torch.autograd.Function):
    """Shards of one unit -> its full leaves (views of the unit's unsharded buffer).

    Backward: one reduce-scatter of the unit's gradients (through ReduceScatterUnit, so it
    also works on functorch-wrapped cotangents)."""

    @staticmethod
    def forward(rs: RankState, u: int, *inputs):
        rs.pre_forward(u, inputs)
        return rs.units[u].forward_outputs(inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.u = inputs[0], inputs[1]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *grads):
        ctx.rs.post_backward(ctx.u)
        return (None, None) + tuple(ReduceScatterUnit.apply(ctx.rs, ctx.u, False, *grads))

    @staticmethod
    def jvp(ctx, _rs, _u, *tangents):
        return tuple(GatherTangent.apply(ctx.rs, ctx.u, *tangents))

    @staticmethod
    def vmap(info, in_dims, rs, u, *inputs):
        if all(d is None for d in in_dims[2:]):  # vmap over the batch: the shards are shared
            outs = GatherUnit.apply(rs, u, *inputs)
            return outs, (None,) * len(outs)
        # [Note: stacked shards] vmap over an ensemble: every member's shards, stacked.
        rs.units[u].step.stacked = True
        outs = GatherStacked.apply(rs, u, *_batch_first(inputs, in_dims[2:], info.batch_size))
        return outs, (0,) * len(outs)


class ReduceScatterUnit(torch.autograd.Function):
    """A unit's full-leaf gradients -> this rank's shard gradients, one reduce-scatter.
    `stacked`: the gradients carry a leading ensemble dim (GatherStacked's backward)."""

    @staticmethod
    def forward(rs: RankState, u: int, stacked: bool, *grads):
        lead = (next(g.shape[0] for g in grads if g is not None),) if stacked else ()
        return tuple(rs.reduce_gradients(u, list(grads), lead=lead))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *gg):
        raise ShardingError("shard: differentiating through the gradient reduce-scatter (double backward) is not supported")

    @staticmethod
    def vmap(info, in_dims, rs, u, stacked, *grads):
        if stacked:
            raise ShardingError(_NESTED_STACKING)
        outs = rs.reduce_gradients(u, _batch_first(grads, in_dims[3:], info.batch_size), lead=(info.batch_size,))
        return tuple(outs), (0,) * len(outs)


class GatherStacked(torch.autograd.Function):
    """A unit's stacked shards (B, ...) -> B members' full leaves ([Note: stacked shards])."""

    @staticmethod
    def forward(rs: RankState, u: int, *inputs):
        return rs.units[u].gather_stacked(inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.u = inputs[0], inputs[1]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *grads):
        return (None, None) + tuple(ReduceScatterUnit.apply(ctx.rs, ctx.u, True, *grads))

    @staticmethod
    def vmap(info, in_dims, rs, u, *inputs):
        raise ShardingError(_NESTED_STACKING)


class GatherTangent(torch.autograd.Function):
    """Forward mode: the tangents of a unit's shards -> tangents of its full leaves."""

    @staticmethod
    def forward(rs: RankState, u: int, *tangents):
        return rs.units[u].gather_tangents(tangents)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *gs):
        raise ShardingError("shard: reverse mode over forward mode through a unit gather is not supported")


# [Note: the loss mean's 1/N]
# The step returns the mean of the ranks' losses, so its backward scales the cotangent by
# 1/N (no collective: every rank seeds the same cotangent). That product is in the loss'
# dtype: a float32 or bf16 loss rounds 1/3 (1 + 3e-8, or +0.2 % in bf16), and every
# gradient would carry that factor, where DDP divides the (float64, or reduce-dtype)
# gradients themselves. So the backward records the exact/rounded ratio, and the
# gradient reduction multiplies the reduced parameter gradients by it in the reduce dtype
# (reduce.py; a no-op for a float64 loss or a power-of-two N). Gradients that flow to the
# batch or other inputs keep the loss dtype's 1/N, as autograd computes them.


class LossMean(torch.autograd.Function):
    """Mean of the per-rank loss over the data axes. Backward: scale by 1/N (no collective:
    every rank seeds the same cotangent; [Note: the loss mean's 1/N]) and start
    re-gathering for the backward."""

    @staticmethod
    def forward(loss, rs: RankState):
        rs.check_loss(loss)
        # [Note: the batch size rides on the loss all-reduce] in batch.py
        pending, rs.batch_check = rs.batch_check, None
        settle(pending)  # the previous step's check, on an accelerator (batch.py)
        mean, rs.loss_weight, rs.batch_check = reduce_loss(loss, rs.batch_size, rs.config.batch_weighting,
                                                           rs.groups.data, rs.stats)
        return mean

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs = inputs[1]
        ctx.weight = inputs[1].loss_weight  # None: 1/N; else this rank's n / sum(n) (global_mean)

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, g):
        rs = ctx.rs
        rs.pre_backward()
        if ctx.weight is None:
            scale = 1.0 / (rs.groups.data.size * rs.groups.tp_size)  # [Note: FSDP x TP] rule (1)
            rounded = float(torch.tensor(scale, dtype=g.dtype))
            rs.grad_fix = scale / rounded  # [Note: the loss mean's 1/N]
        else:  # weights differ by rank: each rank's rounding is its own, and stays in its gradient
            rounded = float(torch.tensor(ctx.weight / rs.groups.tp_size, dtype=g.dtype))
            rs.grad_fix = 1.0
        return g * rounded, None

    @staticmethod
    def jvp(ctx, t, _):
        if ctx.weight is None:
            return _Psum.apply(t, ctx.rs.groups.data) / ctx.rs.groups.data.size
        return _Psum.apply(t * ctx.weight, ctx.rs.groups.data)

    @staticmethod
    def vmap(info, in_dims, loss, rs):
        return LossMean.apply(loss, rs), in_dims[0]
