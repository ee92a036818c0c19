"""Ring attention: K/V blocks travel around a mesh axis, partial softmaxes merge by log-sum-exp.

[Note: the ring schedule] On an axis of N ranks, rank r starts with its own K/V block and,
at step s = 0..N-1, holds the block of rank (r - s) mod N. Before computing with it, it
starts sending it to rank r+1 (`ops.ppermute_async`), so the transfer of the next block
overlaps this block's compute; N-1 transfers per rank. Each (query chunk, key chunk) pair
yields a partial (out, lse) over its keys, merged into the running pair (`_blocks.merge`),
in fp32 (fp64 for fp64 inputs) whatever the input dtype. K and V travel as one stacked
buffer (2, B, Hkv, T, D), the key-padding mask (as uint8) beside it.

[Note: ring backward] The custom VJP saves only this rank's q, k, v, out and lse (and the
mask): O(T/N) per rank. Its backward runs the ring again: K/V rotate as in the forward
(N-1 transfers), and beside them an accumulator (dK, dV) for the block being visited,
which each rank adds its share to and passes on; after N hops (one more than K/V) it is
back at the block's owner. dQ stays local. Per rank, in bytes, with
kv = 2 * B * Hkv * T_local * D:
  forward   (N-1) * kv * itemsize(dtype)
  backward  (N-1) * kv * itemsize(dtype) + N * kv * itemsize(accumulation dtype)
plus (N-1) * B * T_local bytes of mask in each pass when a mask is given. Autograd
through `ppermute` instead would keep every visited K/V block and every score block alive
until the backward: O(T) and O(T^2 / N) per rank.

[Note: causal pairs] With causal=True a (query chunk a, key chunk b) pair, by global chunk
number, is fully visible when b < a, lower-triangular when b == a, and skipped when
b > a. Contiguous layout: one chunk per rank, so rank r computes r + 1 of the N blocks.
Zig-zag layout ([Note: zig-zag layout] in _layout.py): chunks r and 2N-1-r; every rank
computes 2N + 1 chunk pairs (2 per visiting block, 3 for its own), whatever r.

The backward and jvp run through further `autograd.Function`s (`_RingGrad`, `_RingTangent`)
so that torch.func transforms see them as ops, as DESIGN.md asks of collectives.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from .. import _collectives, _vma
from .._backend import ops
from .._errors import ShardingError
from . import _blocks
from ._checks import check_qkv, default_scale, same_blocks
from ._layout import check_layout, chunk_ids

__all__ = ["ring_attention", "counting"]


class _Plan:
    """What every rank agrees on for one call (a plain object: functorch rebuilds containers)."""

    __slots__ = ("group", "causal", "scale", "layout")

    def __init__(self, group, causal: bool, scale: float, layout: str):
        self.group, self.causal, self.scale, self.layout = group, causal, scale, layout


# -- work accounting (tests measure the causal balance with it) ---------------------------

_work = threading.local()


@contextlib.contextmanager
def counting():
    """Count, on this thread, what ring attention does: `pairs`, the (query, key) score
    entries computed per sequence and head (a diagonal chunk pair counts whole); `blocks`,
    the chunk pairs; `transfers`, the K/V (and accumulator) transfers waited for; `wait_s`,
    the seconds spent waiting for them after the compute they overlap (the part of the
    communication the compute did not hide). `with counting() as c: ...; c["pairs"]`.
    Private: the tests measure the zig-zag balance with it, the benchmark the overlap."""
    box = {"pairs": 0, "blocks": 0, "transfers": 0, "wait_s": 0.0}
    stack = getattr(_work, "stack", None)
    if stack is None:
        stack = _work.stack = []
    stack.append(box)
    try:
        yield box
    finally:
        stack.pop()


def _count(tq: int, tk: int) -> None:
    for box in getattr(_work, "stack", ()):
        box["pairs"] += tq * tk
        box["blocks"] += 1


def _waited(pending):
    """`pending.wait()`, its waiting time counted."""
    start = time.perf_counter()
    out = pending.wait()
    for box in getattr(_work, "stack", ()):
        box["transfers"] += 1
        box["wait_s"] += time.perf_counter() - start
    return out


# -- the schedule -------------------------------------------------------------------------


def _pairs(plan: _Plan, me: int, src: int, t: int):
    """(query slice, key slice, diagonal?) of the chunk pairs to compute when rank `me`
    holds rank `src`'s K/V ([Note: causal pairs])."""
    if not plan.causal:
        return [(slice(None), slice(None), False)]
    n = plan.group.size
    qc, kc = chunk_ids(plan.layout, me, n), chunk_ids(plan.layout, src, n)
    c = t // len(qc)
    return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), kb == qa)
            for a, qa in enumerate(qc) for b, kb in enumerate(kc) if kb <= qa]


def _allowed(diagonal: bool, key_mask, tq: int, tk: int, device):
    """The pair's bool mask, broadcastable to (B, Hkv, g, Tq, Tk), or None."""
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=device).tril_() if diagonal else None
    if key_mask is not None:
        km = key_mask[:, None, None, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def _ring_perm(n: int):
    return [(i, (i + 1) % n) for i in range(n)]


def _send(group, buf, mask):
    """Start passing (buf, mask) one step along the ring; returns a function that waits."""
    perm = _ring_perm(group.size)
    pending = ops.ppermute_async(group, buf, perm)
    pending_mask = None if mask is None else ops.ppermute_async(group, mask.to(torch.uint8), perm)

    def wait():
        return _waited(pending), None if pending_mask is None else pending_mask.wait().bool()

    return wait


def _visit(plan: _Plan, buf, mask, fn) -> None:
    """Run `fn(step, src, buf, mask)` for each of the N blocks of the ring, the next
    block's transfer started before `fn` runs ([Note: the ring schedule])."""
    group = plan.group
    n = group.size
    for step in range(n):
        wait = _send(group, buf, mask) if step < n - 1 else None
        fn(step, (group.index - step) % n, buf, mask)
        if wait is not None:
            buf, mask = wait()


def _heads(x: torch.Tensor, hkv: int, dtype) -> torch.Tensor:
    """(B, H, T, D) -> (B, Hkv, g, T, D) in `dtype`; head h pairs with K/V head h // g."""
    b, h, t, d = x.shape
    return x.reshape(b, hkv, h // hkv, t, d).to(dtype)


def ring_forward(q, k, v, mask, plan: _Plan):
    """(out (B, H, T, D) in q's dtype, lse (B, H, T) in the accumulation dtype)."""
    acc = _blocks.accumulation_dtype(q.dtype)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qa = _heads(q, hkv, acc)
    out = torch.zeros_like(qa)
    lse = torch.full(qa.shape[:-1], float("-inf"), dtype=acc, device=q.device)

    def visit(step, src, kv, km):
        for qs, ks, diag in _pairs(plan, plan.group.index, src, t):
            k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
            allowed = _allowed(diag, None if km is None else km[:, ks], k_blk.shape[2], k_blk.shape[2], q.device)
            part_out, part_lse = _blocks.forward_pair(qa[..., qs, :], k_blk, v_blk, allowed, plan.scale)
            _count(part_out.shape[-2], k_blk.shape[2])
            out[..., qs, :], lse[..., qs] = _blocks.merge(out[..., qs, :], lse[..., qs], part_out, part_lse)

    _visit(plan, torch.stack([k, v]), mask, visit)
    return out.reshape(b, h, t, d).to(q.dtype), lse.reshape(b, h, t)


def ring_backward(dout, q, k, v, out, lse, mask, plan: _Plan):
    """(dq, dk, dv) in the inputs' dtypes ([Note: ring backward])."""
    acc = _blocks.accumulation_dtype(q.dtype)
    group = plan.group
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qa, doa = _heads(q, hkv, acc), _heads(dout, hkv, acc)
    delta = (doa * _heads(out, hkv, acc)).sum(-1)
    lse5 = lse.reshape(qa.shape[:-1])
    dq = torch.zeros_like(qa)
    state = {"incoming": None, "dkv": None}

    def visit(step, src, kv, km):
        part = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=q.device)  # (dK, dV) of block src
        for qs, ks, diag in _pairs(plan, group.index, src, t):
            k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
            allowed = _allowed(diag, None if km is None else km[:, ks], k_blk.shape[2], k_blk.shape[2], q.device)
            dq_p, dk_p, dv_p = _blocks.backward_pair(qa[..., qs, :], k_blk, v_blk, allowed, plan.scale,
                                                     lse5[..., qs], doa[..., qs, :], delta[..., qs])
            dq[..., qs, :] += dq_p
            part[0][:, :, ks] += dk_p
            part[1][:, :, ks] += dv_p
        if state["incoming"] is not None:  # the accumulator of block src, from rank r-1
            part += _waited(state["incoming"])
        if group.size > 1:  # pass it on; after N hops it is home
            state["incoming"] = ops.ppermute_async(group, part, _ring_perm(group.size))
        else:
            state["dkv"] = part

    _visit(plan, torch.stack([k, v]), mask, visit)
    dkv = state["dkv"] if group.size == 1 else _waited(state["incoming"])
    return dq.reshape(b, h, t, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_tangent(q, k, v, tq, tk, tv, mask, out, lse, plan: _Plan):
    """The output's tangent (B, H, T, D) for input tangents (None: zero); K/V and their
    tangents travel together, N-1 transfers of 4 blocks."""
    acc = _blocks.accumulation_dtype(q.dtype)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    tq, tk, tv = (torch.zeros_like(x) if tx is None else tx for x, tx in ((q, tq), (k, tk), (v, tv)))
    qa, tqa = _heads(q, hkv, acc), _heads(tq, hkv, acc)
    lse5 = lse.reshape(qa.shape[:-1])
    tn = torch.zeros_like(qa)
    tl = torch.zeros(qa.shape[:-1], dtype=acc, device=q.device)

    def visit(step, src, buf, km):
        for qs, ks, diag in _pairs(plan, plan.group.index, src, t):
            blk = buf[:, :, :, ks]
            allowed = _allowed(diag, None if km is None else km[:, ks], blk.shape[3], blk.shape[3], q.device)
            tn_p, tl_p = _blocks.tangent_pair(qa[..., qs, :], blk[0], blk[1], tqa[..., qs, :], blk[2], blk[3],
                                              allowed, plan.scale, lse5[..., qs])
            tn[..., qs, :] += tn_p
            tl[..., qs] += tl_p

    _visit(plan, torch.stack([k, v, tk.to(k.dtype), tv.to(v.dtype)]), mask, visit)
    t_out = tn - _heads(out, hkv, acc) * tl.unsqueeze(-1)
    return t_out.reshape(b, h, t, d).to(q.dtype)


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
    plan = _Plan(group, causal, default_scale(scale, q.shape[-1], where), layout)
    types = _collectives._types("ring_attention", group)
    with same_blocks(where, q, k, axis, group.size):
        if types is None:
            return _RingAttention.apply(q, k, v, mask, plan)[0]
        axes = _vma.vma(q, types) | _vma.vma(k, types) | _vma.vma(v, types) | set(group.axes)
        q, k, v = (_vma.lift(x, axes, types) for x in (q, k, v))
        with _vma.paused():
            out = _RingAttention.apply(q, k, v, mask, plan)[0]
        return _vma.tag(out, axes, types)
