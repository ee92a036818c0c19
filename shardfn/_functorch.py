"""What a tensor is under torch.func's transforms (one place for the question, asked by
`shard` and by `sf.optim`, which may not import each other)."""

from __future__ import annotations

import torch

__all__ = ["is_batched"]


def is_batched(t: torch.Tensor) -> bool:
    """Whether `t` is, or wraps, a vmap-batched tensor."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False
