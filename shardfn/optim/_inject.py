"""``inject_hyperparams``: an optimizer whose hyperparameters live in its state, as tensors.

optax's ``inject_hyperparams`` on PyTorch tensors. ``inject_hyperparams(adamw)(1e-3)``
builds the same optimizer as ``adamw(1e-3)``, but its numeric arguments (the learning
rate, ``b1``, ``b2``, ``eps``, ``weight_decay``) are 0-dim tensors in
``state.hyperparams``, and each ``update`` builds ``adamw`` from the values found there.
So a hyperparameter can be changed between steps (``state.hyperparams["learning_rate"] =
torch.tensor(1e-4)``), and a meta-step can differentiate the loss after some updates with
respect to the state's hyperparameters (``torch.func.grad`` with respect to the state).

[Note: what inject_hyperparams injects]
A hyperparameter is an argument of the factory, given or defaulted, whose value is a
number (not a bool: ``nesterov`` stays a flag), a floating-point tensor, or a callable
given for an argument whose default is a number or that has no default (a schedule:
``learning_rate=warmup_cosine_decay_schedule(...)``; ``mask``'s default is None, so a
callable mask is passed through). Everything else, and the names in ``static_args``, is
passed to the factory as it is. A schedule is called with the number of updates done so
far and its value stored in ``state.hyperparams`` for that update, as optax does.

The inner optimizer then runs with tensor hyperparameters, in pure mode on the per-leaf
path ([Note: differentiable pure mode] in ``_flat.py``); its numbers equal the plain
optimizer's up to rounding (e.g. a tensor learning rate is not folded into Adam's
denominator: [Note: scale fusion] in ``_fusion.py``). With ``inplace=True`` or
``fused=True`` among the static arguments, the inner optimizer gets the values as Python
floats, read from the state at each update (those modes are not differentiable anyway).
"""

from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import _flat, _hyper
from .base import GradientTransformation


class InjectHyperparamsState(NamedTuple):
    """State of ``inject_hyperparams``.

    ``count``: 0-dim int64 CPU tensor, updates done. ``hyperparams``: dict from argument
    name to a 0-dim floating-point tensor, the values of the last update (of ``init`` before
    any); change an entry to change the next update's value (a schedule's entry is
    recomputed). ``inner_state``: the inner optimizer's state.
    """

    count: torch.Tensor
    hyperparams: dict
    inner_state: Any


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: Union[str, Sequence[str]] = (),
    hyperparam_dtype: Optional[torch.dtype] = None,
) -> Callable[..., GradientTransformation]:
    """Wrap an optimizer factory so that its numeric hyperparameters live in the state, as tensors.

    See [Note: what inject_hyperparams injects] for which arguments become hyperparameters.

    Args:
        inner_factory: a function returning a ``GradientTransformation``, e.g. ``optim.adamw``.
        static_args: names of numeric arguments to pass as they are (e.g. ``"momentum"``,
            whose being 0 decides whether ``sgd`` has a momentum buffer).
        hyperparam_dtype: dtype of the tensors made from numbers (default ``torch.float64``,
            which holds a Python float exactly); a tensor given is kept as it is.

    Returns:
        A function with ``inner_factory``'s signature returning a ``GradientTransformation``
        whose state is ``InjectHyperparamsState(count, hyperparams, inner_state)``.

    Raises:
        ValueError: a name in ``static_args`` that ``inner_factory`` does not take; from the
            returned function, the inner factory's errors for the values given.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.inject_hyperparams(optim.sgd)(learning_rate=0.1)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> state.hyperparams["learning_rate"]
        tensor(0.1000, dtype=torch.float64)
        >>> state.hyperparams["learning_rate"] = torch.tensor(0.5, dtype=torch.float64)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([0.5000, 0.5000])
    """
    static_args = (static_args,) if isinstance(static_args, str) else tuple(static_args)
    name = getattr(inner_factory, "__name__", repr(inner_factory))
    signature = inspect.signature(inner_factory)
    unknown = [a for a in static_args if a not in signature.parameters]
    if unknown:
        raise ValueError(
            f"inject_hyperparams: static_args names {unknown}, which {name} does not take; its "
            f"arguments are {list(signature.parameters)}."
        )
    dtype = torch.float64 if hyperparam_dtype is None else hyperparam_dtype

    def as_tensor(value):
        return value if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=dtype)

    def factory(*args, **kwargs) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        numeric, schedules, other = {}, {}, {}
        for arg, value in bound.arguments.items():
            default = signature.parameters[arg].default
            if arg in static_args or isinstance(value, bool):
                other[arg] = value
            elif isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
                numeric[arg] = _hyper.check(value, arg, name) if isinstance(value, torch.Tensor) else value
            elif callable(value) and (default is inspect.Parameter.empty or _is_number(default)):
                schedules[arg] = value
            else:
                other[arg] = value
        # the inner factory's own checks, once, on the values given (a schedule's first value)
        inner_factory(**other, **numeric, **{k: fn(0) for k, fn in schedules.items()})
        as_numbers = bool(other.get("inplace")) or bool(other.get("fused"))
        who = f"inject_hyperparams({name}).update"

        def inner(hyperparams: dict) -> GradientTransformation:
            if as_numbers:  # in-place / fused: numbers only ([Note: what inject_hyperparams injects])
                hyperparams = {k: float(v) for k, v in hyperparams.items()}
            return inner_factory(**other, **hyperparams)

        def init(params):
            hyperparams = {k: as_tensor(v) for k, v in numeric.items()}
            hyperparams.update({k: as_tensor(fn(0)) for k, fn in schedules.items()})
            return InjectHyperparamsState(_flat.new_count(), hyperparams, inner(hyperparams).init(params))

        def update(updates, state, params=None):
            if not isinstance(state, InjectHyperparamsState):
                raise ValueError(
                    f"{who}: the state should be the InjectHyperparamsState this optimizer's init "
                    f"returned, got {type(state).__name__}."
                )
            if as_numbers:
                _flat.refuse_func(who, f"inject_hyperparams({name})(...) without inplace=... and fused=...",
                                  updates, state, params)
            hyperparams = dict(state.hyperparams)
            missing = sorted((set(numeric) | set(schedules)) - set(hyperparams))
            if missing:
                raise ValueError(f"{who}: state.hyperparams lacks {missing}; it holds {sorted(hyperparams)}.")
            if schedules:
                step = _flat.read_count(state.count)
                hyperparams.update({k: as_tensor(fn(step)) for k, fn in schedules.items()})
            updates, inner_state = inner(hyperparams).update(updates, state.inner_state, params)
            count, _ = _flat.bump_count(state.count, False)
            return updates, InjectHyperparamsState(count, hyperparams, inner_state)

        return GradientTransformation(init, update)

    factory.__name__ = f"inject_hyperparams({name})"
    return factory


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
