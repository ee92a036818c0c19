"""Lion's sign update (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

``update = sign(b1 * mu + (1 - b1) * g)``, then ``mu = b2 * mu + (1 - b2) * g``.

[Note: Lion in place]
Both outputs need the old ``mu`` and ``g``, so an in-place step needs a trick to avoid
a scratch list: compute ``c = lerp(g, mu, b1)`` into the gradient buffers, then
``mu_new = lerp(mu, c, (1 - b2) / (1 - b1))``, which is exactly
``b2 * mu + (1 - b2) * g`` in exact arithmetic (substitute ``c``). It differs from the
pure path by rounding only (about 1e-16 relative in float64).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _tree
from . import _flat, _hyper
from .base import GradientTransformation


class ScaleByLionState(NamedTuple):
    """State of ``scale_by_lion``: ``count`` and the momentum ``mu`` shaped like the params."""

    count: torch.Tensor
    mu: Any


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, *, inplace: bool = False) -> GradientTransformation:
    """Replace updates by ``sign(b1 * mu + (1 - b1) * g)`` and track ``mu`` with decay ``b2``.

    Args:
        b1: interpolation between momentum and gradient for the sign.
        b2: decay of the momentum.
        inplace: update ``mu`` in place and write the signs into the incoming updates.

    ``b1`` and ``b2`` are numbers or, in pure mode, 0-dim floating-point tensors. The
    update is a sign, whose derivative is 0 wherever it exists; ``mu`` is differentiable.

    Returns:
        A ``GradientTransformation`` with ``ScaleByLionState(count, mu)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.scale_by_lion()
        >>> state = opt.init({"w": torch.zeros(3)})
        >>> opt.update({"w": torch.tensor([0.5, -2.0, 0.0])}, state)[0]["w"]
        tensor([ 1., -1.,  0.])
    """
    b1, b2 = _hyper.check(b1, "b1", "scale_by_lion"), _hyper.check(b2, "b2", "scale_by_lion")
    if not _hyper.is_tensor(b1) and not 0.0 <= b1 < 1.0:
        raise ValueError(f"scale_by_lion: b1 must be in [0, 1), got {b1}.")
    if not _hyper.is_tensor(b2) and not 0.0 <= b2 < 1.0:
        raise ValueError(f"scale_by_lion: b2 must be in [0, 1), got {b2}.")
    if inplace:
        _hyper.numbers_only("scale_by_lion", "inplace=True", b1=b1, b2=b2)
    who = "scale_by_lion.update"

    def init(params):
        leaves, treedef = _tree.flatten(params)
        mu = _tree.unflatten(treedef, _flat.zeros_like(leaves))
        return ScaleByLionState(count=_flat.new_count(), mu=mu)

    def update(updates, state, params=None):
        del params
        g, treedef = _tree.flatten(updates)
        mu = _flat.leaves_like(treedef, state.mu, "state.mu", who, shapes_of=g)
        if inplace:
            _flat.refuse_func(who, "optim.scale_by_lion(...) without inplace=True", g, mu)
        count, _ = _flat.bump_count(state.count, inplace)
        if not g:
            return updates, ScaleByLionState(count, state.mu)
        if inplace:
            # See [Note: Lion in place].
            with torch.no_grad():
                g = _flat.writable(g)
                torch._foreach_lerp_(g, mu, b1)
                torch._foreach_lerp_(mu, g, (1.0 - b2) / (1.0 - b1))
                torch._foreach_sign_(g)
            return _tree.unflatten(treedef, g), ScaleByLionState(count, state.mu)
        if _flat.per_leaf(g, mu, hyper=(b1, b2)):  # [Note: differentiable pure mode] in _flat.py
            cast = _hyper.Cast(1.0 - b1, 1.0 - b2)
            out = [torch.sign(torch.lerp(m, x, cast(m)[0])) for m, x in zip(mu, g)]
            mu = [torch.lerp(m, x, cast(m)[1]) for m, x in zip(mu, g)]
            return _tree.unflatten(treedef, out), ScaleByLionState(count, _tree.unflatten(treedef, mu))
        out = torch._foreach_lerp(mu, g, 1.0 - b1)
        torch._foreach_sign_(out)
        mu = torch._foreach_lerp(mu, g, 1.0 - b2)
        return _tree.unflatten(treedef, out), ScaleByLionState(count, _tree.unflatten(treedef, mu))

    return GradientTransformation(init, update)
