"""`sf.traced_apply(model)`: an apply function of an nn.Module that dynamo can trace.

`sf.functional`'s apply function binds each block's parameters around the block's own
forward, through a per-thread module copy and Python state (so that `shard` gathers one
unit at a time in eager); it is `not_traced` ([Note: no whole-step graph] in
`_compile.py`). The traced step needs none of that: it passes full parameters, and its
schedule is a graph pass. So `traced_apply` is one `torch.func.functional_call` with the
same parameter tree as `sf.functional` (nested dicts, the first ModuleList a list).
"""

from __future__ import annotations

import torch

__all__ = ["traced_apply"]


def _named(tree, prefix: str, out: dict) -> dict:
    """Dotted module names -> leaves, by plain recursion over dicts and lists (dynamo
    traces it; optree's polyfills fail on some dicts: [Note: trees in the graph] in step.py)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        out[prefix] = tree
        return out
    for key, value in items:
        _named(value, f"{prefix}.{key}" if prefix else str(key), out)
    return out


def traced_apply(model: torch.nn.Module):
    """`apply(params, *args, **kwargs)` = `model(*args, **kwargs)` with the parameters of
    `params`, a tree in `sf.functional(model)`'s layout; traceable by torch.compile (for
    `sf.jit`). Tied parameters are given once in the tree and stay tied.

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

    def apply(params, *args, **kwargs):
        return torch.func.functional_call(model, _named(params, "", {}), args, kwargs, strict=False)

    return apply
