"""The optimizer protocol: a pair of functions over pytrees, composed with ``chain``.

An optimizer is ``GradientTransformation(init, update)``, as in optax:

- ``init(params) -> state``: a NamedTuple whose tensors are shaped like ``params``.
  Called on a rank's shards it allocates state shaped like the shards, so optimizer
  state is sharded exactly like the parameters (ZeRO) with no extra code.
- ``update(updates, state, params=None) -> (updates, state)``: transforms gradients
  into updates. ``apply_updates(params, updates)`` adds them.

Trees are flattened once per call with optree (namespace ``"shardfn"``) and the math
runs on flat lists with ``torch._foreach_*`` ops.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .. import _tree
from . import _flat, _fusion


class GradientTransformation(NamedTuple):
    """A pure optimizer: ``init(params) -> state``, ``update(updates, state, params) -> (updates, state)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.adamw(1e-3)
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2, 3)}, state, params)
        >>> params = optim.apply_updates(params, updates)
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def identity() -> GradientTransformation:
    """A transform that returns the updates unchanged.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.identity().update({"w": torch.ones(2)}, optim.EmptyState())[0]["w"]
        tensor([1., 1.])
    """

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        return updates, state

    def scaled(updates, state, params, scale, owned):
        del params, scale, owned
        return updates, state

    _fusion.mark(update, _fusion.Fusion("linear", scaled=scaled))
    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms: each one's updates feed the next; the state is a tuple of theirs.

    A chain of built-in transforms that ends in a learning-rate scale (like ``adamw``)
    skips that multiply pass by folding the factor into Adam's denominator (see
    [Note: scale fusion] in ``_fusion.py``); the numbers change by rounding only.

    Args:
        *transforms: ``GradientTransformation``s applied left to right.

    Returns:
        A ``GradientTransformation`` whose state is ``tuple`` of the inner states.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.full((3,), 10.0)}, state, params)
    """
    for i, t in enumerate(transforms):
        if not (isinstance(t, tuple) and len(t) == 2 and all(callable(f) for f in t)):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation "
                "(a pair of callables init, update); did you forget to call it, e.g. "
                "`adamw(1e-3)` rather than `adamw`?"
            )
    inits = tuple(t.init for t in transforms)
    updates_fns = tuple(t.update for t in transforms)
    fused_at = _fusion.plan(updates_fns)

    def init(params):
        return tuple(fn(params) for fn in inits)

    def update(updates, state, params=None):
        if len(state) != len(updates_fns):
            raise ValueError(
                f"chain.update: the state holds {len(state)} inner states but the chain "
                f"has {len(updates_fns)} transforms; pass the state this chain's init returned."
            )
        if fused_at is not None:
            out = _fusion.run_fused(updates_fns, fused_at, updates, state, params)
            if out is not None:
                return out
        new_state = []
        for fn, s in zip(updates_fns, state):
            updates, s = fn(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    kernels = [f.fused_kernel for f in updates_fns if getattr(f, "fused_kernel", None)]
    if kernels:  # a link runs torch's fused kernel: sf.jit reads it
        update.fused_kernel = kernels[0]
    mark_unplaced(update, updates_fns)
    return GradientTransformation(init, update)


def mark_unplaced(update: Callable, inner_updates) -> None:
    """Carry up the names of whole-matrix transforms built without a ``mesh``
    (``update.unplaced``): ``train_step`` refuses them on a sharded step, where they would
    run on each rank's slice of a matrix ([Note: the owner rule] in ``_owner.py``)."""
    names = tuple(n for f in inner_updates for n in getattr(f, "unplaced", ()))
    if names:
        update.unplaced = names


class AppliedUpdates:
    """What a fused optimizer's ``update`` returns: ``params`` were already updated in place.

    ``apply_updates(params, AppliedUpdates(params))`` returns ``params`` as they are. To
    pytrees it is one leaf, so a transform given it (instead of ``apply_updates``) fails
    with a structure error rather than reading it as updates.
    """

    __slots__ = ("params",)

    def __init__(self, params: Any):
        self.params = params

    def __repr__(self) -> str:
        return "AppliedUpdates(<params updated in place>)"


def apply_updates(params: Any, updates: Any, *, inplace: bool = False) -> Any:
    """Add ``updates`` to ``params`` leaf by leaf (``torch._foreach_add``).

    Args:
        params: a pytree of tensors.
        updates: a pytree of tensors with the same structure.
        inplace: add into the ``params`` tensors (no allocation, under
            ``torch.no_grad()``) and return the same tree; otherwise return new tensors.

    Returns:
        The updated parameters, each leaf in its parameter's dtype. Given the
        ``AppliedUpdates`` of a fused optimizer (whose kernel already wrote the params),
        the params as they are, whatever ``inplace`` says.

    Raises:
        ValueError: trees of different structures; ``AppliedUpdates`` of other params.
        RuntimeError: ``inplace=True`` on tensors of a ``torch.func`` transform.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})["w"]
        tensor([0.5000, 0.5000])
    """
    if isinstance(updates, AppliedUpdates):
        return _already_applied(params, updates)
    p, treedef = _tree.flatten(params)
    u = _flat.leaves_like(treedef, updates, "updates", "apply_updates", ref="the params", shapes_of=p)
    if not p:
        return params
    if inplace:
        _flat.refuse_func("apply_updates", "apply_updates(params, updates) without inplace=True", p, u)
        with torch.no_grad():
            torch._foreach_add_(p, u)
        return params
    if _flat.per_leaf(p, u):  # [Note: differentiable pure mode] in _flat.py
        new = [torch.add(a, b) for a, b in zip(p, u)]
    else:
        new = torch._foreach_add(p, u)
    new = [n if n.dtype == q.dtype else n.to(q.dtype) for n, q in zip(new, p)]
    return _tree.unflatten(treedef, new)


def _already_applied(params: Any, updates: AppliedUpdates) -> Any:
    """``apply_updates`` of a fused update: check that these are the params it wrote."""
    if updates.params is not params:
        mine, theirs = _tree.flatten(params)[0], _tree.flatten(updates.params)[0]
        if len(mine) != len(theirs) or any(a is not b for a, b in zip(mine, theirs)):
            raise ValueError(
                "apply_updates: `updates` is the AppliedUpdates of a fused optimizer, which "
                "already wrote other params in place; pass the params given to that "
                "update(grads, state, params)."
            )
    return params
