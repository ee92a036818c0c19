"""One training step: gradient, optimizer update, parameter update."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .._compile import not_traced
from .._autodiff import eager_grad_and_value
from .base import GradientTransformation, apply_updates


def train_step(
    step: Callable[..., torch.Tensor],
    opt: GradientTransformation,
    *,
    has_aux: bool = False,
    inplace: bool = False,
    use_func: bool = False,
) -> Callable[[Any, Any, Any], tuple]:
    """Build ``train(shards, opt_state, batch) -> (shards, opt_state, loss)``.

    The returned function computes the loss and its gradient with respect to ``shards``,
    runs ``opt.update(grads, opt_state, shards)`` and applies the updates, all outside
    autograd (``torch.no_grad()``) so no history accumulates across steps.

    The gradient comes from eager autograd (``torch.autograd.grad`` on detached leaves
    that share the shards' storage), which skips functorch's per-op wrapping and is the
    fastest path; ``use_func=True`` uses ``torch.func.grad_and_value`` instead (needed
    when ``train`` itself runs under a ``torch.func`` transform). Both give the same
    numbers; leaves that get no gradient get zeros.

    Args:
        step: ``step(params, batch) -> scalar loss``; a plain function or the result of
            ``sf.shard(...)`` (then call ``train`` on every rank, e.g. in ``mesh.run``).
        opt: the optimizer; build it with ``inplace=True`` to update its state in place.
        has_aux: ``step`` returns ``(loss, aux)``; ``train`` then returns
            ``(shards, opt_state, loss, aux)``.
        inplace: add the updates into the ``shards`` tensors instead of returning new ones.
        use_func: take the gradient with ``torch.func.grad_and_value``.

    Returns:
        The ``train`` function; ``loss`` is detached.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> def loss_fn(params, batch):
        ...     x, y = batch
        ...     return ((x @ params["w"] - y) ** 2).mean()
        >>> opt = optim.sgd(0.5)
        >>> train = optim.train_step(loss_fn, opt)
        >>> params = {"w": torch.zeros(2)}
        >>> state = opt.init(params)
        >>> batch = (torch.eye(2), torch.tensor([1.0, 2.0]))
        >>> for _ in range(60):
        ...     params, state, loss = train(params, state, batch)
        >>> params["w"]
        tensor([1., 2.])
    """
    if use_func:
        grad_and_value = torch.func.grad_and_value(step, has_aux=has_aux)
    elif hasattr(step, "grad_and_value"):  # an sf.shard step: overlapped gradient reductions
        grad_and_value = step.grad_and_value
    else:
        grad_and_value = functools.partial(eager_grad_and_value, step, has_aux=has_aux)

    @not_traced(_TRAIN_EAGER, warn=True)  # [Note: no whole-step graph] in shardfn/_compile.py
    def train(shards, opt_state, batch):
        grads, value = grad_and_value(shards, batch)
        with torch.no_grad():
            updates, opt_state = opt.update(grads, opt_state, shards)
            shards = apply_updates(shards, updates, inplace=inplace)
        if has_aux:
            loss, aux = value
            return shards, opt_state, loss.detach(), aux
        return shards, opt_state, value.detach()

    return train


_TRAIN_EAGER = (
    "torch.compile does not capture sf.train_step's step whole: it runs eagerly, as one graph break (a shard "
    "step's collectives and schedule are not traceable, and the optimizer's step count and schedules would "
    "recompile it every step), and compiles the blocks of sf.functional models the step runs with this "
    "torch.compile's backend. Use the fused optimizer for the update, sf.optim.adamw(..., fused=True) "
    "(docs/howto/compile.md)."
)
