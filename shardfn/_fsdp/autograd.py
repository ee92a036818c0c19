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

__all__ = ["GatherUnit", "ReduceScatterUnit", "GatherStacked", "GatherTangent", "ReduceScatterTangent",
           "GatherCotangent", "LossMean", "LossTangent", "plain"]

_BACKWARD = "shard's backward nodes (re-gathers, reduce-scatters) run eagerly ([Note: no whole-step graph])"
_NESTED_STACKING = "shard: vmap over stacked shards nests once (one ensemble dimension)"
_HVP = "torch.func.jvp(torch.func.grad(step), (shards, batch), (v, zeros))"

# [Note: second order through shard]
# A unit's gradient is `fix * RS(G)`: the sum over the shard axes of the ranks' full-leaf
# gradients G (one reduce-scatter), completed by sums over the replica / tensor-parallel
# axes (HSDP, FSDP x TP) and the loss mean's rounding `fix` ([Note: the loss mean's 1/N]);
# whole leaves are all-reduced. All of it is linear in G, so:
# - forward mode (forward-over-reverse, `jvp(grad(step))`, the HVP): the tangent of the
#   gradient is the same reduction of G's tangent (ReduceScatterTangent, exact: no wire
#   format, no held sums), as the tangent of the parameters is the same gather of the
#   shards' tangent (GatherTangent). Per unit and HVP: one more all-gather (the tangent's,
#   in the forward; its full leaves stay alive until the backward's ops have read them)
#   and one more reduce-scatter.
# - reverse mode (reverse-over-reverse): the transpose of the reduce-scatter is the
#   all-gather of the cotangent (GatherCotangent). The sums over the replica axes and the
#   whole leaves' all-reduce transpose to the identity: their result is the same on every
#   replica, and so is its cotangent (every replica holds the same block of `v`), the
#   invariant case of docs/autodiff.md §3, as the loss mean's 1/N. The second backward
#   runs through the step's graph again, after its units were freed: its first
#   ReduceScatterUnit backward gathers every unit of the step again and each stays
#   gathered until the backward of its gather in that second pass
#   (`RankState.pre_second_backward`): the second backward holds the whole model.
# - reverse mode over forward mode (`grad` of `jvp(step)`) is refused where it starts,
#   at the loss tangent (LossTangent): torch 2.13's own reverse-over-forward is wrong
#   through layer_norm (3.7 off on one device, no shard involved), so shard would return
#   a wrong number for the examples' GPT without knowing it.
# Wire formats are straight-through here too: tangents and cotangents travel exactly, and
# so do the second backward's reductions (the HVP), so with a quantized all-gather the HVP
# is the one at the decoded parameters, and a quantized reduce-scatter (qgZ) quantizes the
# gradient only, not the HVP.

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
    also works on functorch-wrapped cotangents, and is differentiable: [Note: second order
    through shard])."""

    @staticmethod
    def forward(rs: RankState, u: int, *inputs):
        rs.pre_forward(u, inputs)
        return rs.units[u].forward_outputs(inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.u = inputs[0], inputs[1]
        ctx.call = inputs[0].step  # [Note: one call's backward at a time]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *grads):
        check_call(ctx.rs, ctx.call)
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
    `stacked`: the gradients carry a leading ensemble dim (GatherStacked's backward).
    jvp: the same reduction of the tangents; backward: the all-gather of the cotangents
    ([Note: second order through shard])."""

    @staticmethod
    def forward(rs: RankState, u: int, stacked: bool, *grads):
        lead = (next(g.shape[0] for g in grads if g is not None),) if stacked else ()
        return tuple(rs.reduce_gradients(u, list(grads), lead=lead))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.u, ctx.stacked = inputs[0], inputs[1], inputs[2]
        ctx.fix = inputs[0].grad_fix
        ctx.third = inputs[0].step.second_backward  # made by a second backward: its backward is a third
        ctx.call = inputs[0].step
        ctx.floating = [g is not None and g.is_floating_point() for g in inputs[3:]]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *cotangents):
        if ctx.stacked:
            raise ShardingError(
                "shard: second-order derivatives of an ensemble's step (vmap over stacked shards) are not "
                "supported.\nFix: differentiate each member's step."
            )
        if ctx.third:
            raise ShardingError(_third_order("a third derivative (reverse mode over a second backward)"))
        check_call(ctx.rs, ctx.call)
        ctx.rs.pre_second_backward(ctx.u)
        full = GatherCotangent.apply(ctx.rs, ctx.u, ctx.fix, *cotangents)
        return (None, None, None) + tuple(g if f else None for g, f in zip(full, ctx.floating))

    @staticmethod
    def jvp(ctx, _rs, _u, _stacked, *tangents):  # (stacked: GatherStacked refuses forward mode first)
        ctx.rs.check_second_order("forward mode over the gradient (jvp of grad)")
        return tuple(ReduceScatterTangent.apply(ctx.rs, ctx.u, ctx.fix, *tangents))

    @staticmethod
    def vmap(info, in_dims, rs, u, stacked, *grads):
        if stacked:
            raise ShardingError(_NESTED_STACKING)
        outs = rs.reduce_gradients(u, _batch_first(grads, in_dims[3:], info.batch_size), lead=(info.batch_size,))
        return tuple(outs), (0,) * len(outs)


class ReduceScatterTangent(torch.autograd.Function):
    """Forward mode of ReduceScatterUnit: the tangents of a unit's full-leaf gradients ->
    the tangents of its shard gradients, the same reduction done exactly (no wire format,
    no held sums) with the primal's `fix` ([Note: second order through shard])."""

    @staticmethod
    def forward(rs: RankState, u: int, fix: float, *tangents):
        return tuple(rs.reducer.reduce_linear(rs.units[u], list(tangents), fix))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *gs):
        raise ShardingError(_third_order("reverse mode over forward-over-reverse"))

    @staticmethod
    def vmap(info, in_dims, rs, u, fix, *tangents):  # a batch of tangents (several HVPs at once)
        outs = rs.reducer.reduce_linear(rs.units[u], _batch_first(tangents, in_dims[3:], info.batch_size), fix,
                                        lead=(info.batch_size,))
        return tuple(outs), (0,) * len(outs)


class GatherCotangent(torch.autograd.Function):
    """The transpose of ReduceScatterUnit: cotangents of a unit's shard gradients -> the
    cotangents of its full-leaf gradients, one exact all-gather; the replica and whole-leaf
    sums transpose to the identity ([Note: second order through shard])."""

    @staticmethod
    def forward(rs: RankState, u: int, fix: float, *cotangents):
        if fix != 1.0:
            cotangents = [None if c is None else c * fix for c in cotangents]
        return rs.units[u].gather_tangents(cotangents)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.u, ctx.fix = inputs[0], inputs[1], inputs[2]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, *gs):  # (a third backward meets the ReduceScatterUnit of the second one first)
        raise ShardingError(_third_order("a third derivative (reverse mode over a second backward)"))

    @staticmethod
    def jvp(ctx, _rs, _u, _fix, *tangents):
        return tuple(GatherCotangent.apply(ctx.rs, ctx.u, ctx.fix, *tangents))

    @staticmethod
    def vmap(info, in_dims, rs, u, fix, *cotangents):  # jacrev of the gradient: one gather per row
        rows = _batch_first(cotangents, in_dims[3:], info.batch_size)
        outs = [GatherCotangent.apply(rs, u, fix, *[None if c is None else c[i] for c in rows])
                for i in range(info.batch_size)]
        return tuple(torch.stack(x) for x in zip(*outs)), (0,) * len(outs[0])


def _third_order(what: str) -> str:
    return (f"shard: {what} through a unit's gradient reduction is not supported: shard differentiates its "
            f"step twice (Hessian-vector products), not three times.\nFix: for a Hessian-vector product use "
            f"{_HVP}.")


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
    def jvp(ctx, _rs, _u, *tangents):
        raise ShardingError(
            "shard: forward mode (jvp) through an ensemble's step (vmap over stacked shards) is not supported.\n"
            "Fix: run torch.func.jvp on each member's step (its shards unstacked)."
        )

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
        raise ShardingError("shard: reverse mode over forward mode through a unit gather is not supported.\n"
                            f"Fix: for a Hessian-vector product use forward-over-reverse, {_HVP}.")

    @staticmethod
    def vmap(info, in_dims, rs, u, *tangents):  # a batch of tangents: one gather per member
        rows = _batch_first(tangents, in_dims[2:], info.batch_size)
        outs = [GatherTangent.apply(rs, u, *[None if t is None else t[i] for t in rows])
                for i in range(info.batch_size)]
        return tuple(torch.stack(x) for x in zip(*outs)), (0,) * len(outs[0])


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
        mean, rs.step.loss_weight, rs.batch_check = reduce_loss(loss, rs.batch_size, rs.config.batch_weighting,
                                                                rs.groups.data, rs.stats)
        return mean

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs = inputs[1]
        ctx.weight = inputs[1].step.loss_weight  # None: 1/N; else this rank's n / sum(n) (global_mean)
        ctx.call = inputs[1].step

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, g):
        check_call(ctx.rs, ctx.call)
        return _seed_backward(ctx.rs, ctx.weight, g), None

    @staticmethod
    def jvp(ctx, t, _):
        return LossTangent.apply(t, ctx.rs, ctx.weight)

    @staticmethod
    def vmap(info, in_dims, loss, rs):
        return LossMean.apply(loss, rs), in_dims[0]


class LossTangent(torch.autograd.Function):
    """Forward mode of LossMean: the mean of the loss' tangent over the data axes (one
    all-reduce of a scalar). Its backward is where reverse mode over forward mode (`grad` of
    `jvp(step)`) starts, and refuses it ([Note: second order through shard])."""

    @staticmethod
    def forward(t, rs: RankState, weight):
        if weight is None:
            return _Psum.apply(t, rs.groups.data) / rs.groups.data.size
        return _Psum.apply(t * weight, rs.groups.data)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.rs, ctx.weight = inputs[1], inputs[2]

    @staticmethod
    @not_traced(_BACKWARD)
    def backward(ctx, g):
        raise ShardingError(
            "shard: reverse mode over forward mode (torch.func.grad of torch.func.jvp(step)) is not supported: "
            "torch 2.13's reverse-over-forward is wrong for some ops (layer_norm), with or without shard.\n"
            f"Fix: for a Hessian-vector product use forward-over-reverse, {_HVP}."
        )

    @staticmethod
    def jvp(ctx, t, _rs, _weight):
        return LossTangent.apply(t, ctx.rs, ctx.weight)

    @staticmethod
    def vmap(info, in_dims, t, rs, weight):
        return LossTangent.apply(t, rs, weight), in_dims[0]


# [Note: one call's backward at a time]
# A unit has one unsharded buffer, and the backward of a call re-gathers into it the shard
# leaves of the *current* call (`RankStep.leaves`). So the backward of an earlier call of
# the same step that runs after a later call reads the later call's parameters. With the
# same shard tensors (`step(s, b1) + step(s, b2)`, accumulation) that is the same values,
# and right; with other ones (a meta-gradient through optimizer steps: each inner step's
# shards are new tensors) it was silently wrong (2 SGD steps: 3.7e-4 off, 2 AdamW steps
# 0.025). That case is refused, on the earlier call's first backward node; one step per
# call keeps one buffer per call and is right.


def check_call(rs: RankState, call) -> None:
    """Refuse the backward of an earlier call whose shard leaves are not the current call's."""
    current = rs.step
    if call is current or (len(call.leaves) == len(current.leaves)
                           and all(a is b for a, b in zip(call.leaves, current.leaves))):
        return
    raise ShardingError(
        "shard: the backward of an earlier call of this step runs after a later call with other shards "
        "(e.g. a gradient through optimizer steps: each inner step's shards are new tensors). A step keeps "
        "one unsharded buffer per unit, which now holds the later call's parameters, so that backward would "
        "be silently wrong.\nFix: build one sf.shard step per call of the differentiated program "
        "(steps = [sf.shard(loss_fn, mesh) for _ in range(k)]; shard each step's params with its own "
        "step.shard_params), or differentiate each call's step before the next call."
    )


def _seed_backward(rs: RankState, weight, g: torch.Tensor) -> torch.Tensor:
    """The backward of the step's loss: start re-gathering, scale the cotangent by this
    rank's weight in the mean ([Note: the loss mean's 1/N])."""
    rs.pre_backward()
    if weight is None:
        scale = 1.0 / (rs.groups.data.size * rs.groups.tp_size)  # [Note: FSDP x TP] rule (1)
        rounded = float(torch.tensor(scale, dtype=g.dtype))
        rs.grad_fix = scale / rounded  # [Note: the loss mean's 1/N]
    else:  # weights differ by rank: each rank's rounding is its own, and stays in its gradient
        rounded = float(torch.tensor(weight / rs.groups.tp_size, dtype=g.dtype))
        rs.grad_fix = 1.0
    return g * rounded
