"""Scaling transforms: by a constant, by a schedule, by a (scheduled) learning rate."""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import torch

from .. import _tree
from . import _flat, _fusion, _hyper, _in_graph
from .base import EmptyState, GradientTransformation

ScalarOrSchedule = Union[float, torch.Tensor, Callable[[int], float]]


class ScaleByScheduleState(NamedTuple):
    """State of ``scale_by_schedule``: ``count`` (0-dim int64 CPU tensor) = updates done."""

    count: torch.Tensor


def _scale_leaves(leaves, factor, inplace, who):
    """``factor * leaves``; ``factor`` is a float, or a 0-dim tensor (a tensor hyperparameter,
    or a schedule's value: [Note: tensor hyperparameters] in _hyper.py)."""
    if not leaves:
        return leaves
    if inplace:
        _flat.refuse_func(who, f"optim.{who.split('.')[0]}(...) without inplace=True", leaves)
    if isinstance(factor, torch.Tensor):  # a schedule's value in a graph: computed once
        factor = _in_graph.scalar(factor, leaves[0])
    if inplace:
        with torch.no_grad():
            leaves = _flat.writable(leaves)
            torch._foreach_mul_(leaves, factor)
        return leaves
    if (isinstance(factor, torch.Tensor) and not torch.compiler.is_compiling()) or _flat.per_leaf(leaves):
        # [Note: differentiable pure mode] in _flat.py
        cast = _hyper.Cast(factor)
        return [torch.mul(t, *cast(t)) for t in leaves]
    return torch._foreach_mul(leaves, factor)


def scale(step_size: float, *, inplace: bool = False) -> GradientTransformation:
    """Multiply the updates by a constant ``step_size``.

    Args:
        step_size: the factor: a number, or a 0-dim floating-point tensor (pure mode only;
            differentiable, see ``docs/optim.md``).
        inplace: write into the incoming updates (see ``docs/optim.md``, in-place mode).

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.scale(-2.0).update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
        tensor([-2., -2.])
    """
    step_size = _hyper.check(step_size, "step_size", "scale")
    if inplace:
        _hyper.numbers_only("scale", "inplace=True", step_size=step_size)

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        leaves, treedef = _tree.flatten(updates)
        return _tree.unflatten(treedef, _scale_leaves(leaves, step_size, inplace, "scale.update")), state

    fusion = _fusion.Fusion("factor", factor=lambda state: step_size, advance=lambda state: state)
    return GradientTransformation(init, _fusion.mark(update, fusion))


def scale_by_schedule(
    step_size_fn: Callable[[int], float], *, inplace: bool = False
) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, ``count`` = updates done so far.

    Args:
        step_size_fn: ``schedule(step: int) -> float`` (or a 0-dim tensor, e.g. a learnable
            scale times a schedule: differentiable in pure mode).
        inplace: write into the incoming updates and bump the count in place.

    Returns:
        A ``GradientTransformation`` with ``ScaleByScheduleState(count)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.scale_by_schedule(lambda k: 10.0 ** -k)
        >>> state = opt.init({"w": torch.ones(2)})
        >>> u, state = opt.update({"w": torch.ones(2)}, state)
        >>> u, state = opt.update({"w": torch.ones(2)}, state)
        >>> u["w"], int(state.count)
        (tensor([0.1000, 0.1000]), 2)
    """

    def init(params):
        del params
        return ScaleByScheduleState(count=_flat.new_count())

    def update(updates, state, params=None):
        del params
        leaves, treedef = _tree.flatten(updates)
        leaves = _scale_leaves(leaves, factor(state), inplace, "scale_by_schedule.update")
        return _tree.unflatten(treedef, leaves), advance(state)

    def factor(state):  # a 0-dim tensor under torch.compile: [Note: schedules in a graph]
        value = step_size_fn(_flat.read_count(state.count))
        return value if isinstance(value, torch.Tensor) else float(value)

    def advance(state):
        return ScaleByScheduleState(count=_flat.bump_count(state.count, inplace)[0])

    fusion = _fusion.Fusion("factor", factor=factor, advance=advance)
    return GradientTransformation(init, _fusion.mark(update, fusion))


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True, inplace: bool = False
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (a float or a schedule of the step count).

    Args:
        learning_rate: a float, a 0-dim floating-point tensor (pure mode; differentiable), or
            ``schedule(step) -> float`` called with the number of updates done so far (see
            ``shardfn.optim`` schedules).
        flip_sign: negate, so that ``apply_updates`` descends (the usual case).
        inplace: write into the incoming updates.

    Returns:
        ``scale(-lr)`` for a float, ``scale_by_schedule(lambda k: -lr(k))`` for a schedule.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.scale_by_learning_rate(0.5).update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
        tensor([-0.5000, -0.5000])
    """
    sign = -1.0 if flip_sign else 1.0
    if not callable(learning_rate):
        learning_rate = _hyper.check(learning_rate, "learning_rate", "scale_by_learning_rate")
        if inplace:
            _hyper.numbers_only("scale_by_learning_rate", "inplace=True", learning_rate=learning_rate)
    if callable(learning_rate):
        return scale_by_schedule(lambda k: sign * learning_rate(k), inplace=inplace)
    return scale(sign * learning_rate, inplace=inplace)
