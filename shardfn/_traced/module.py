"""`sf.traced_apply(model)`: `sf.functional(model)`'s apply function ([Note: one apply
function] in shardfn/_functional.py).

It was a second apply function, one `torch.func.functional_call` for the traced step,
which failed when called eagerly on a shard step's params view. `sf.functional`'s apply
now runs traced under `sf.jit` and eagerly everywhere else, so this name returns it.
"""

from __future__ import annotations

import torch

__all__ = ["traced_apply"]


def traced_apply(model: torch.nn.Module):
    """`apply(params, *args, **kwargs)` = `model(*args, **kwargs)` with the parameters of
    `params`, a tree in `sf.functional(model)`'s layout: the same function as
    `sf.functional(model)[0]`, traceable by `sf.jit` and eager in a shard step. Tied
    parameters are given once in the tree and stay tied.

    Example:
      >>> import shardfn as sf, torch
      >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3))
      >>> _, params = sf.functional(model)
      >>> apply = sf.traced_apply(model)
      >>> apply(params, torch.ones(1, 2)).shape
      torch.Size([1, 3])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"sf.traced_apply: expected an nn.Module, got {type(model).__name__}")
    from .._functional import functional

    return functional(model)[0]
