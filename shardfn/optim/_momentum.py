"""Momentum (``trace``) with ``torch.optim.SGD``'s semantics.

``trace = decay * trace + g``; the update is ``trace``, or ``g + decay * trace`` with
Nesterov. The trace starts at zero, so the first step gives ``trace = g`` exactly,
which is what torch's SGD does by initializing its momentum buffer to the gradient
(``dampening=0``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _tree
from . import _flat, _hyper
from .base import GradientTransformation


class TraceState(NamedTuple):
    """State of ``trace``: the momentum buffers, a pytree shaped like the params."""

    trace: Any


def trace(decay: float, nesterov: bool = False, *, inplace: bool = False) -> GradientTransformation:
    """Momentum: accumulate ``trace = decay * trace + updates`` (torch SGD's momentum buffer).

    Args:
        decay: the momentum coefficient (a number, or in pure mode a 0-dim floating-point
            tensor: differentiable).
        nesterov: return ``updates + decay * trace`` instead of ``trace``.
        inplace: update the buffers in place and write the result into the incoming
            updates (which are consumed).

    Returns:
        A ``GradientTransformation`` with ``TraceState(trace)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.trace(0.9)
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> u, state = opt.update({"w": torch.ones(2)}, state)
        >>> u, state = opt.update({"w": torch.ones(2)}, state)
        >>> u["w"]
        tensor([1.9000, 1.9000])
    """
    decay = _hyper.check(decay, "decay", "trace")
    if inplace:
        _hyper.numbers_only("trace", "inplace=True", decay=decay)
    who = "trace.update"

    def init(params):
        leaves, treedef = _tree.flatten(params)
        return TraceState(trace=_tree.unflatten(treedef, _flat.zeros_like(leaves)))

    def update(updates, state, params=None):
        del params
        g, treedef = _tree.flatten(updates)
        tr = _flat.leaves_like(treedef, state.trace, "state.trace", who, shapes_of=g)
        if not g:
            return updates, state
        if inplace:
            _flat.refuse_func(who, "optim.trace(...) without inplace=True", g, tr)
            with torch.no_grad():
                g = _flat.writable(g)
                torch._foreach_mul_(tr, decay)
                torch._foreach_add_(tr, g)
                if nesterov:
                    torch._foreach_add_(g, tr, alpha=decay)
                else:
                    # The update must not alias the buffer: later in-place transforms
                    # (e.g. the learning rate) write into it.
                    torch._foreach_copy_(g, tr)
            return _tree.unflatten(treedef, g), state
        if _flat.per_leaf(g, tr, hyper=(decay,)):  # [Note: differentiable pure mode] in _flat.py
            cast = _hyper.Cast(decay)
            tr = [torch.add(torch.mul(b, *cast(b)), x) for b, x in zip(tr, g)]
            out = [_hyper.add_scaled(x, b, *cast(b)) for x, b in zip(g, tr)] if nesterov else tr
            return _tree.unflatten(treedef, out), TraceState(trace=_tree.unflatten(treedef, tr))
        tr = torch._foreach_mul(tr, decay)
        torch._foreach_add_(tr, g)
        out = torch._foreach_add(g, tr, alpha=decay) if nesterov else tr
        new_trace = _tree.unflatten(treedef, tr)
        return _tree.unflatten(treedef, out), TraceState(trace=new_trace)

    return GradientTransformation(init, update)
