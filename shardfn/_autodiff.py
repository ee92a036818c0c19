"""`grad_and_value` on eager autograd, for the training fast paths.

Differentiates with `torch.autograd.grad` with respect to detached aliases of the tree's
leaves (same storage, so in-place updates reach the caller's tensors). It skips
functorch's per-op wrapping, and the gradients are autograd outputs, never accumulated
into `.grad`, so nothing reads them before the backward returns. Leaves without a
gradient get zeros, as with `torch.func.grad`.

It sits below both of its users, `sf.shard`'s step (`_fsdp/step.py`) and `sf.train_step`
(`optim/train.py`), so that neither package imports the other.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _tree

__all__ = ["eager_grad_and_value"]


def eager_grad_and_value(fn: Callable, tree, *args, has_aux: bool = False):
    """`(grads, value)` of `fn(tree, *args)`; `value` is `(loss, aux)` when `has_aux`."""
    leaves, treedef = _tree.flatten(tree)
    inputs = [x.detach().requires_grad_(x.is_floating_point()) for x in leaves]
    with torch.enable_grad():
        value = fn(_tree.unflatten(treedef, inputs), *args)
        loss = value[0] if has_aux else value
        wanted = [x for x in inputs if x.requires_grad]
        found = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    grads = [(next(found) if x.requires_grad else None) for x in inputs]
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return _tree.unflatten(treedef, grads), value
