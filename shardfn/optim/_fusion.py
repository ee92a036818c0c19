"""Scale fusion: how ``chain`` saves the learning-rate pass of ``adamw``.

[Note: scale fusion]
``adamw`` is ``chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate)``. Run
one after another, the last link is a full memory pass that only multiplies by ``-lr``.
But Adam ends with a division whose denominator already carries scalar factors, so it
can return ``-lr * adam`` for free, and weight decay is linear: ``-lr * (u + wd * p)``
is ``(-lr * u) + (-lr * wd) * p``. So ``chain`` looks, once, at its links' hooks:

- a *factor* link (``scale``, ``scale_by_schedule``) can say which scalar it would
  multiply by (``factor(state)``) and step its state without touching tensors
  (``advance(state)``);
- an *absorb* link (``scale_by_adam``) can return ``scale * output`` at no extra cost
  (``scaled(updates, state, params, scale, owned)``);
- a *linear* link (``add_decayed_weights``, ``identity``) maps ``scale * u`` to
  ``scale * T(u)`` when told the scale (same signature).

When the chain ends ``absorb, linear*, factor``, it passes the factor to the absorb link,
the linear links after it get their input already scaled, and the factor link only
advances its state. The outputs of an absorb link are fresh tensors (or, in in-place
mode, the gradient buffers), so the linear links may also write into them in pure mode
(``owned=True``): pure ``adamw`` allocates only the new moments, the update and the new
params. The numbers change by rounding only; a factor of 0 (e.g. warmup from 0) takes
the plain path. Transforms without hooks (yours) always take the plain path.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch


class Fusion(NamedTuple):
    """Hooks a built-in transform's ``update`` function carries as ``update.fusion``."""

    kind: str  # "factor" | "absorb" | "linear"
    factor: Optional[Callable[[Any], float]] = None  # factor: the scalar, state untouched
    advance: Optional[Callable[[Any], Any]] = None  # factor: state after one update
    scaled: Optional[Callable[..., tuple]] = None  # absorb / linear


def mark(update: Callable, fusion: Fusion) -> Callable:
    """Attach ``fusion`` to ``update`` and return it."""
    update.fusion = fusion
    return update


def fusion_of(update: Callable) -> Optional[Fusion]:
    return getattr(update, "fusion", None)


def plan(update_fns: tuple) -> Optional[int]:
    """Index of the absorb link when the chain ends ``absorb, linear*, factor``; else None."""
    if len(update_fns) < 2:
        return None
    last = fusion_of(update_fns[-1])
    if last is None or last.kind != "factor":
        return None
    for j in range(len(update_fns) - 2, -1, -1):
        f = fusion_of(update_fns[j])
        if f is None:
            return None
        if f.kind == "absorb":
            return j
        if f.kind != "linear":
            return None
    return None


def run_fused(update_fns: tuple, j: int, updates, state, params):
    """Run a chain with plan ``j``; None when the factor is 0 or a tensor (a schedule's value
    inside a graph): then the chain runs plainly."""
    last = fusion_of(update_fns[-1])
    factor = last.factor(state[-1])
    # a schedule's value inside a graph is a tensor ([Note: schedules in a graph]): whether it is
    # 0 is not known when tracing, so the plain path (whose lr multiply inductor fuses anyway)
    if isinstance(factor, torch.Tensor) or float(factor) == 0.0:
        return None
    factor = float(factor)
    new_state = []
    for fn, s in zip(update_fns[:j], state[:j]):
        updates, s = fn(updates, s, params)
        new_state.append(s)
    updates, s = fusion_of(update_fns[j]).scaled(updates, state[j], params, factor, False)
    new_state.append(s)
    for fn, s in zip(update_fns[j + 1 : -1], state[j + 1 : -1]):
        updates, s = fusion_of(fn).scaled(updates, s, params, factor, True)
        new_state.append(s)
    new_state.append(last.advance(state[-1]))
    return updates, tuple(new_state)
