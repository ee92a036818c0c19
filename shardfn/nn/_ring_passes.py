"""The passes of ring attention over a mesh axis: forward, backward and tangent.

Plain tensors in, plain tensors out (the `autograd.Function`s of `_ring.py` call these);
K/V blocks move with `ops.ppermute_async`.

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
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from .._backend import ops
from . import _blocks
from ._layout import chunk_ids

__all__ = ["Plan", "counting", "ring_forward", "ring_backward", "ring_tangent", "Q_TILE"]


class Plan:
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

# [Note: score tiles] A pair of chunks is computed a tile of at most Q_TILE query rows at a
# time against all the chunk's keys, so the transient score block is B * H * Q_TILE * Tk
# accumulation-dtype elements, whatever the local length: memory stays linear in T / N.
Q_TILE = 512


def _pairs(plan: Plan, me: int, src: int, t: int):
    """(query slice, key slice, diagonal?) of the chunk pairs to compute when rank `me`
    holds rank `src`'s K/V ([Note: causal pairs])."""
    if not plan.causal:
        return [(slice(None), slice(None), False)]
    n = plan.group.size
    qc, kc = chunk_ids(plan.layout, me, n), chunk_ids(plan.layout, src, n)
    c = t // len(qc)
    return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), kb == qa)
            for a, qa in enumerate(qc) for b, kb in enumerate(kc) if kb <= qa]


def _allowed(diagonal: bool, key_mask, rows: tuple[int, int], c: int, device):
    """A tile's bool mask, broadcastable to (B, Hkv, g, rows, Tk), or None: on a diagonal
    pair (a chunk with itself) query row i of the chunk sees keys 0..i, and/or the keys'
    padding mask."""
    allowed = None
    if diagonal:
        allowed = torch.arange(*rows, device=device)[:, None] >= torch.arange(c, device=device)[None, :]
    if key_mask is not None:
        km = key_mask[:, None, None, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def _tiles(plan: Plan, me: int, src: int, t: int, key_mask, device):
    """(query rows, key slice, mask) of each score tile to compute when rank `me` holds
    rank `src`'s K/V: the chunk pairs of `_pairs`, their queries cut into tiles of at most
    Q_TILE rows ([Note: score tiles])."""
    for qs, ks, diag in _pairs(plan, me, src, t):
        start, stop = qs.start or 0, t if qs.stop is None else qs.stop
        c = (t if ks.stop is None else ks.stop) - (ks.start or 0)
        km = None if key_mask is None else key_mask[:, ks]
        for lo in range(start, stop, Q_TILE):
            hi = min(lo + Q_TILE, stop)
            yield slice(lo, hi), ks, _allowed(diag, km, (lo - start, hi - start), c, device)


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


def _visit(plan: Plan, buf, mask, fn) -> None:
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


def ring_forward(q, k, v, mask, plan: Plan):
    """(out (B, H, T, D) in q's dtype, lse (B, H, T) in the accumulation dtype)."""
    acc = _blocks.accumulation_dtype(q.dtype)
    b, h, t, d = q.shape
    hkv = k.shape[1]
    qa = _heads(q, hkv, acc)
    out = torch.zeros_like(qa)
    lse = torch.full(qa.shape[:-1], float("-inf"), dtype=acc, device=q.device)

    def visit(step, src, kv, km):
        for qs, ks, allowed in _tiles(plan, plan.group.index, src, t, km, q.device):
            k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
            part_out, part_lse = _blocks.forward_pair(qa[..., qs, :], k_blk, v_blk, allowed, plan.scale)
            _count(part_out.shape[-2], k_blk.shape[2])
            out[..., qs, :], lse[..., qs] = _blocks.merge(out[..., qs, :], lse[..., qs], part_out, part_lse)

    _visit(plan, torch.stack([k, v]), mask, visit)
    return out.reshape(b, h, t, d).to(q.dtype), lse.reshape(b, h, t)


def ring_backward(dout, q, k, v, out, lse, mask, plan: Plan):
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
        for qs, ks, allowed in _tiles(plan, group.index, src, t, km, q.device):
            k_blk, v_blk = kv[0][:, :, ks], kv[1][:, :, ks]
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


def ring_tangent(q, k, v, tq, tk, tv, mask, out, lse, plan: Plan):
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
        for qs, ks, allowed in _tiles(plan, plan.group.index, src, t, km, q.device):
            blk = buf[:, :, :, ks]
            tn_p, tl_p = _blocks.tangent_pair(qa[..., qs, :], blk[0], blk[1], tqa[..., qs, :], blk[2], blk[3],
                                              allowed, plan.scale, lse5[..., qs])
            tn[..., qs, :] += tn_p
            tl[..., qs] += tl_p

    _visit(plan, torch.stack([k, v, tk.to(k.dtype), tv.to(v.dtype)]), mask, visit)
    t_out = tn - _heads(out, hkv, acc) * tl.unsqueeze(-1)
    return t_out.reshape(b, h, t, d).to(q.dtype)
