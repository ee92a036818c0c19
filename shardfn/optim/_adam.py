"""Adam's scaling with ``torch.optim.Adam``'s numerics.

``mu = lerp(mu, g, 1 - b1)``, ``nu = b2 * nu + (1 - b2) * g * g`` (the same foreach ops
torch uses), and the update ``mu_hat / (sqrt(nu_hat) + eps)`` with torch's placement of
``eps``: ``denom = sqrt(nu) / sqrt(1 - b2**t) + eps``, after the square root, like
``torch.optim.Adam`` (not optax's ``eps_root``).

[Note: Adam's arithmetic]
The bias correction ``1 / (1 - b1**t)`` of ``mu`` is folded into the denominator,
``denom * bc1 = sqrt(nu) / (sqrt(bc2) / bc1) + eps * bc1``, so the update is one
division ``mu / (denom * bc1)``. Every op works in place on one scratch list: the
gradient buffers in in-place mode (allocating nothing), the ``sqrt`` output in pure mode
(allocating only the new state and the update). The result differs from torch's
``addcdiv`` by a couple of ulps (float64 parity tests hold to 1e-10 after 20 steps).

[Note: big leaves]
``torch._foreach_*`` ops have no form that writes ``sqrt(nu)`` or ``mu / d`` into
another list without allocating (their ``out=`` overloads compute into a temporary and
copy). For leaves of at least ``_BIG`` elements we call ``torch.sqrt(nu, out=g)`` and
``torch.div(mu, g, out=g)`` leaf by leaf: one memory pass each instead of two
(copy + sqrt_, reciprocal_ + mul_), and the per-call overhead (~2 us) is noise next to
the work. On CPU the foreach ops are themselves a loop of per-tensor kernels, so this
costs nothing; small leaves stay on the foreach path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import _tree
from . import _flat, _fusion, _hyper, _in_graph
from .base import GradientTransformation

_BIG = 1 << 14  # elements; see [Note: big leaves]


class ScaleByAdamState(NamedTuple):
    """State of ``scale_by_adam``.

    ``count``: 0-dim int64 CPU tensor, updates done. ``mu``, ``nu``: first and second
    moments, pytrees shaped like the params (on shards: shaped like the shards).
    """

    count: torch.Tensor
    mu: Any
    nu: Any


def _check_betas(b1, b2, eps, who: str) -> tuple:
    """The hyperparameters as floats (range-checked) or 0-dim tensors (dtype and ndim
    checked: [Note: tensor hyperparameters] in _hyper.py)."""
    b1, b2, eps = (_hyper.check(v, n, who) for v, n in ((b1, "b1"), (b2, "b2"), (eps, "eps")))
    if not _hyper.is_tensor(b1) and not 0.0 <= b1 < 1.0:
        raise ValueError(f"{who}: b1 must be in [0, 1), got {b1}.")
    if not _hyper.is_tensor(b2) and not 0.0 <= b2 < 1.0:
        raise ValueError(f"{who}: b2 must be in [0, 1), got {b2}.")
    if not _hyper.is_tensor(eps) and not eps >= 0.0:
        raise ValueError(f"{who}: eps must be >= 0, got {eps}.")
    return b1, b2, eps


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, inplace: bool = False
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments: ``mu_hat / (sqrt(nu_hat) + eps)``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the bias-corrected ``sqrt(nu)`` (torch's placement).
        inplace: update ``mu``, ``nu`` and ``count`` in place and write the result into
            the incoming updates (which are consumed); allocates nothing.

    Each hyperparameter is a number or, in pure mode, a 0-dim floating-point tensor
    (differentiable; see ``docs/optim.md``).

    Returns:
        A ``GradientTransformation`` with ``ScaleByAdamState(count, mu, nu)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.scale_by_adam()
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> u, state = opt.update({"w": torch.tensor([2.0, -3.0])}, state)
        >>> u["w"].round(decimals=4)
        tensor([ 1., -1.])
    """
    b1, b2, eps = _check_betas(b1, b2, eps, "scale_by_adam")
    if inplace:
        _hyper.numbers_only("scale_by_adam", "inplace=True", b1=b1, b2=b2, eps=eps)
    who = "scale_by_adam.update"
    hyper = (b1, b2, eps)

    def init(params):
        leaves, treedef = _tree.flatten(params)
        mu = _tree.unflatten(treedef, _flat.zeros_like(leaves))
        nu = _tree.unflatten(treedef, _flat.zeros_like(leaves))
        return ScaleByAdamState(count=_flat.new_count(), mu=mu, nu=nu)

    def update(updates, state, params=None):
        del params
        return scaled(updates, state, None, 1.0, False)

    def scaled(updates, state, params, out_scale, owned):
        """``out_scale * mu_hat / denom``; see [Note: scale fusion] in _fusion.py."""
        del params, owned
        g, treedef = _tree.flatten(updates)
        mu = _flat.leaves_like(treedef, state.mu, "state.mu", who, shapes_of=g)
        nu = _flat.leaves_like(treedef, state.nu, "state.nu", who, shapes_of=g)
        if inplace:
            _flat.refuse_func(who, "optim.scale_by_adam(...) without inplace=True", g, mu, nu)
        count, t = _flat.bump_count(state.count, inplace)
        if not g:
            return updates, ScaleByAdamState(count, state.mu, state.nu)
        bc1 = 1.0 - b1**t
        bc2 = 1.0 - b2**t
        # See [Note: Adam's arithmetic].
        denom_scale, denom_eps = _hyper.sqrt(bc2) / bc1 * out_scale, eps * bc1 / out_scale
        if not inplace and _flat.per_leaf(g, mu, nu, hyper=hyper):
            out, mu, nu = _per_leaf(g, mu, nu, b1, b2, denom_scale, denom_eps)
            new_state = ScaleByAdamState(count, _tree.unflatten(treedef, mu), _tree.unflatten(treedef, nu))
            return _tree.unflatten(treedef, out), new_state
        # symbolic under torch.compile: [Note: step-dependent scalars in a graph]
        denom_scale, denom_eps = _in_graph.scalar(denom_scale, g[0]), _in_graph.scalar(denom_eps, g[0])
        if inplace:
            with torch.no_grad():
                g = _flat.writable(g)
                torch._foreach_lerp_(mu, g, 1.0 - b1)
                torch._foreach_mul_(nu, b2)
                torch._foreach_addcmul_(nu, g, g, 1.0 - b2)
                _sqrt_into(g, nu)
                _finish(g, mu, denom_scale, denom_eps)
            return _tree.unflatten(treedef, g), ScaleByAdamState(count, state.mu, state.nu)
        mu = torch._foreach_lerp(mu, g, 1.0 - b1)
        nu = torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nu, g, g, 1.0 - b2)
        out = torch._foreach_sqrt(nu)
        _finish(out, mu, denom_scale, denom_eps)
        new_state = ScaleByAdamState(
            count, _tree.unflatten(treedef, mu), _tree.unflatten(treedef, nu)
        )
        return _tree.unflatten(treedef, out), new_state

    _fusion.mark(update, _fusion.Fusion("absorb", scaled=scaled))
    return GradientTransformation(init, update)


def _per_leaf(g, mu, nu, b1, b2, denom_scale, denom_eps):
    """The foreach path's arithmetic, out of place and leaf by leaf, with each scalar a float or
    a 0-dim tensor: [Note: differentiable pure mode] in _flat.py. Returns (out, mu, nu)."""
    cast = _hyper.Cast(1.0 - b1, b2, 1.0 - b2, denom_scale, denom_eps)
    out, new_mu, new_nu = [], [], []
    for x, m, v in zip(g, mu, nu):
        w1, b2_, w2, scale, eps = cast(m)
        m = torch.lerp(m, x, w1)
        v = _hyper.addcmul(torch.mul(v, b2_), x, x, w2)
        d = torch.add(torch.div(torch.sqrt(v), scale), eps)
        # _finish's two forms ([Note: big leaves]): the same bits as the foreach path
        out.append(torch.div(m, d) if m.numel() >= _BIG else torch.mul(torch.reciprocal(d), m))
        new_mu.append(m)
        new_nu.append(v)
    return out, new_mu, new_nu


def _sqrt_into(out, nu):
    """``out <- sqrt(nu)`` without allocating; see [Note: big leaves]."""
    small_out, small_nu = [], []
    for o, v in zip(out, nu):
        if o.numel() >= _BIG:
            torch.sqrt(v, out=o)
        else:
            small_out.append(o)
            small_nu.append(v)
    if small_out:
        torch._foreach_copy_(small_out, small_nu)
        torch._foreach_sqrt_(small_out)


def _finish(buf, mu, denom_scale, denom_eps):
    """Turn ``buf`` (holding ``sqrt(nu)``) into ``mu / (buf / denom_scale + denom_eps)``, in place."""
    torch._foreach_div_(buf, denom_scale)
    torch._foreach_add_(buf, denom_eps)
    small_buf, small_mu = [], []
    for b, m in zip(buf, mu):
        if b.numel() >= _BIG:
            torch.div(m, b, out=b)
        else:
            small_buf.append(b)
            small_mu.append(m)
    if small_buf:
        torch._foreach_reciprocal_(small_buf)
        torch._foreach_mul_(small_buf, small_mu)
