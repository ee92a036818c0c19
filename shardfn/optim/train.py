"""One training step: gradient, optimizer update, parameter update."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .._compile import not_traced
from .._autodiff import eager_grad_and_value
from .._errors import SpecError
from .base import GradientTransformation, apply_updates


def train_step(
    step: Callable[..., torch.Tensor],
    opt: GradientTransformation,
    *,
    has_aux: bool | None = None,
    inplace: bool = False,
    use_func: bool = False,
    replicas=None,
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
            ``(shards, opt_state, loss, aux)``. One rule for ``sf.train_step`` and
            ``sf.jit``: an ``sf.shard`` step says it itself (``sf.shard(...,
            has_aux=True)``), so leave this out (None) for one; a value that contradicts the
            step is a ``SpecError``. For a plain function, None means False.
        inplace: add the updates into the ``shards`` tensors instead of returning new ones.
        use_func: take the gradient with ``torch.func.grad_and_value``.
        replicas: a torchft ``Manager`` (this rank's): synchronous HSDP across torchft
            replicas, each replica its own mesh; the gradient is averaged over the replicas
            in each step's quorum, a lost replica is dropped without a restart and a
            replacement is healed from a peer. ``train`` then also has ``state_dict`` /
            ``load_state_dict`` for the Manager ([Note: synchronous replicas through
            torchft] in shardfn/_replicas.py; docs/howto/fault-tolerance.md).

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
    _check_placed(step, opt)
    has_aux = _has_aux(step, has_aux)
    if replicas is not None:
        from .._replicas import Replicated

        if use_func:
            raise SpecError("train_step(replicas=..., use_func=True): the step across torchft replicas takes its "
                            "gradient with the shard step's own grad_and_value.\nFix: drop use_func.")
        return Replicated(step, opt, replicas, inplace=inplace)
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


def _has_aux(step, has_aux: bool | None) -> bool:
    """One has_aux rule ([Note: one has_aux rule]): an sf.shard step's own (its config),
    which sf.jit reads too; train_step's argument only for a plain function."""
    own = getattr(getattr(step, "config", None), "has_aux", None)
    if own is None:
        return bool(has_aux)
    if has_aux is not None and bool(has_aux) != own:
        raise SpecError(
            f"train_step(has_aux={has_aux}): this step was built with sf.shard(..., has_aux={own}), so it returns "
            f"{'(loss, aux)' if own else 'the loss alone'}.\nFix: leave train_step's has_aux out: an sf.shard "
            f"step's own has_aux is used (by sf.train_step and sf.jit alike)."
        )
    return own


# [Note: one has_aux rule]
# Whether a loss returns (loss, aux) is said once, where the loss function meets the
# mesh: `sf.shard(loss_fn, mesh, has_aux=True)`. `sf.train_step(step, opt)` and
# `sf.jit(step, opt)` both read it from the step (train and the traced step then return
# `(shards, opt_state, loss, aux)`); `train_step`'s own `has_aux` is for plain functions,
# and given for a shard step it must agree.


def _check_placed(step, opt: GradientTransformation) -> None:
    """A whole-matrix transform without a mesh on a sharded step would run on each rank's
    slice of every matrix: refuse it, naming the fix ([Note: the owner rule] in _owner.py)."""
    unplaced = getattr(opt.update, "unplaced", ())
    mesh = getattr(step, "mesh", None)
    if unplaced and hasattr(type(step), "specs") and getattr(mesh, "size", 1) > 1:  # a shard step
        names = ", ".join(dict.fromkeys(unplaced))
        raise SpecError(
            f"train_step: {names} needs whole matrices, but this step's params are sharded over the mesh "
            f"{dict(mesh.shape)} and {names} was built without `mesh`, so it would orthogonalize / factor each "
            f"rank's slice of every matrix (a silently different update).\nFix: build it with the step's layout, "
            f"e.g. optim.muon(lr, mesh=mesh, specs=step.specs) (docs/optimizers-sharded.md)."
        )


_TRAIN_EAGER = (
    "torch.compile does not capture sf.train_step's step whole: it runs eagerly, as one graph break (a shard "
    "step's collectives and schedule are not traceable, and the optimizer's step count and schedules would "
    "recompile it every step), and compiles the blocks of sf.functional models the step runs with this "
    "torch.compile's backend. Use the fused optimizer for the update, sf.optim.adamw(..., fused=True) "
    "(docs/howto/compile.md)."
)
