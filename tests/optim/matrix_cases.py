"""Shared cases of the matrix-aware optimizer tests (Muon, Adafactor, SOAP): trees of given
shapes, gradient sequences, dim-0 blocks, a small MLP under sf.shard."""

from __future__ import annotations

import torch

from optim_testutil import leaves
from shardfn._spec import chunk_bounds

STEPS = 10


def tree_of(shapes, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}


def grads_of(shapes, seed, dtype, steps=STEPS):
    return [tree_of(shapes, seed * 1000 + i, dtype) for i in range(steps)]


def rel_err(a, b):
    """max over leaves of max |a - b| / max(max |b|, 1)."""
    return max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp(min=1)).item()
               for x, y in zip(leaves(a), leaves(b)) if y.numel())


def block(t, n, index):
    """Rank `index`'s dim-0 torch.chunk of t over n ranks (0-dim leaves whole)."""
    if t.dim() == 0:
        return t.clone()
    start, stop = chunk_bounds(t.shape[0], n, index)
    return t[start:stop].clone()


def blocks(tree, n, index):
    return {k: block(v, n, index) for k, v in tree.items()}


def mlp(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.5 * torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return {"layers": [{"w": r(7, 5), "b": r(7)}, {"w": r(6, 7), "b": r(6)}, {"w": r(5, 6), "b": r(5)}],
            "head": r(3, 5)}


def mlp_loss(params, batch):
    x, y = batch  # (B, 5), (B, 3)
    h = x
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"].T + layer["b"])  # (B, d)
    return ((h @ params["head"].T - y) ** 2).mean()


def mlp_batches(n, dtype=torch.float64, steps=STEPS, per_rank=4):
    gen = torch.Generator().manual_seed(9)
    return [(torch.randn(n * per_rank, 5, generator=gen, dtype=dtype),
             torch.randn(n * per_rank, 3, generator=gen, dtype=dtype)) for _ in range(steps)]
