"""Weight decay as a transform: ``updates + weight_decay * params`` on the masked leaves.

Placed before the adaptive scaling it is L2 regularization (``torch.optim.Adam``'s and
``SGD``'s ``weight_decay``); placed after it and before ``scale_by_learning_rate`` it
is decoupled weight decay (``torch.optim.AdamW``): the update becomes
``-lr * (adam + wd * p)``, i.e. ``p * (1 - lr * wd) - lr * adam``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import optree
import torch

from .. import _tree
from .._errors import SpecError
from . import _flat, _fusion, _hyper
from .base import EmptyState, GradientTransformation

Mask = Union[Any, Callable[[Any], Any]]


def _selected(mask: Optional[Mask], params: Any, who: str) -> Optional[list[int]]:
    """Indices (into the flat params) of the leaves to decay; None means all."""
    if mask is None:
        return None
    tree = mask(params) if callable(mask) else mask
    return _flags_to_index(tree, params, who)


def _flags_to_index(tree: Any, params: Any, who: str) -> list[int]:
    try:
        flags = _tree.broadcast_prefix(tree, params, what="mask", is_prefix_leaf=lambda _: False)
    except SpecError as e:
        raise ValueError(
            f"{who}: `mask` must be a pytree of bools with the structure of the params "
            f"(or a prefix of it), or a callable returning one.\n{e}"
        ) from None
    for i, f in enumerate(flags):
        if not isinstance(f, (bool, torch.Tensor)) and f not in (0, 1):
            path = optree.tree_accessors(params, namespace=_tree.NAMESPACE)[i].codify("params")
            raise ValueError(f"{who}: mask entry for {path} is {f!r}; expected a bool.")
    return [i for i, f in enumerate(flags) if bool(f)]


def add_decayed_weights(
    weight_decay: float = 0.0, mask: Optional[Mask] = None, *, inplace: bool = False
) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates of the leaves selected by ``mask``.

    Args:
        weight_decay: the coefficient (a number, or in pure mode a 0-dim floating-point
            tensor: differentiable; a tensor is applied even when it is 0).
        mask: ``None`` (all leaves), a pytree of bools shaped like the params (or a
            prefix of it), or a callable ``mask(params) -> pytree of bools``; ``True``
            leaves are decayed.
        inplace: write into the incoming updates.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``; its update needs ``params``.

    Raises:
        ValueError: from update, when ``params`` is missing or the mask does not fit.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> opt = optim.add_decayed_weights(0.1, mask={"w": True, "b": False})
        >>> u, _ = opt.update({"w": torch.zeros(2), "b": torch.zeros(1)}, opt.init(params), params)
        >>> u["w"], u["b"]
        (tensor([0.1000, 0.1000]), tensor([0.]))
    """
    weight_decay = _hyper.check(weight_decay, "weight_decay", "add_decayed_weights")
    if inplace:
        _hyper.numbers_only("add_decayed_weights", "inplace=True", weight_decay=weight_decay)
    who = "add_decayed_weights.update"
    cache: dict = {}  # a fixed mask tree: indices per params structure

    def selected(params):
        if mask is None or callable(mask):
            return _selected(mask, params, who)
        key = optree.tree_structure(params, namespace=_tree.NAMESPACE)
        if key not in cache:
            cache[key] = _selected(mask, params, who)
        return cache[key]

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        return scaled(updates, state, params, 1.0, False)

    def scaled(updates, state, params, scale, owned):
        """``scale * (u + wd * p)`` given ``scale * u``; writes into it when owned."""
        if not _hyper.is_tensor(weight_decay) and weight_decay == 0.0:
            return updates, state
        _flat.require_params(params, who)
        u, treedef = _tree.flatten(updates)
        p = _flat.leaves_like(treedef, params, "params", who, shapes_of=u)
        index = selected(params)
        us = u if index is None else [u[i] for i in index]
        ps = p if index is None else [p[i] for i in index]
        if not us:
            return updates, state
        if inplace:
            _flat.refuse_func(who, "optim.add_decayed_weights(...) without inplace=True", us, ps)
        if not inplace and _flat.per_leaf(us, ps, hyper=(weight_decay, scale)):
            # [Note: differentiable pure mode] in _flat.py; out of place even when owned
            cast = _hyper.Cast(scale * weight_decay)
            us = [_hyper.add_scaled(x, q, *cast(q)) for x, q in zip(us, ps)]
        elif inplace or owned:
            with torch.no_grad():
                us = _flat.writable(us) if inplace else us
                torch._foreach_add_(us, ps, alpha=scale * weight_decay)
        else:
            us = torch._foreach_add(us, ps, alpha=scale * weight_decay)
        if index is None:
            u = us
        else:
            u = list(u)
            for i, t in zip(index, us):
                u[i] = t
        return _tree.unflatten(treedef, u), state

    _fusion.mark(update, _fusion.Fusion("linear", scaled=scaled))
    return GradientTransformation(init, update)
