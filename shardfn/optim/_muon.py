"""Muon with ``torch.optim.Muon``'s numerics, on whole matrices under any sharding.

Per 2-D leaf, as ``torch.optim.Muon`` (torch 2.13, ``torch/optim/_muon.py``) computes it:

    buf = lerp(buf, g, 1 - momentum)                     # the buffer, an EMA
    x   = lerp(g, buf, momentum) if nesterov else buf
    O   = NS(x): x in bfloat16, transposed if tall, divided by max(||x||_F, eps), then
          ns_steps of  A = X X^T;  B = b A + c A A;  X = a X + B X
    p  <- p (1 - lr wd) - lr * ratio(shape) * O          # ratio: "original" sqrt(max(1, A/B)),
                                                         # "match_rms_adamw" 0.2 sqrt(max(A, B))

The buffer is element-wise, so it lives on each rank's shard (ZeRO); only ``x`` needs the
whole matrix: it goes to the matrix's owner in the Newton–Schulz dtype (bfloat16, which is
torch's first op anyway, so the bytes halve and the bits do not change), the owner runs
``NS`` on the whole matrix and sends each rank its block of ``O`` ([Note: the owner rule]
in ``_owner.py``). ``scale_by_muon`` returns ``ratio * O``; ``muon`` chains it with the
decoupled decay and the learning rate, as ``adamw`` does.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from .. import _tree
from . import _flat, _owner
from ._scale import ScalarOrSchedule, scale_by_learning_rate
from ._weight_decay import add_decayed_weights
from .base import GradientTransformation, chain

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon's DEFAULT_A, B, C
NS_STEPS = 5
EPS = 1e-7


class ScaleByMuonState(NamedTuple):
    """State of ``scale_by_muon``: ``count`` (0-dim int64) and ``momentum``, shaped like the
    params (on shards: like the shards)."""

    count: torch.Tensor
    momentum: Any


def newton_schulz(x: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = EPS,
                  dtype: Optional[torch.dtype] = torch.bfloat16) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz``, op for op (in ``dtype``; None keeps
    ``x``'s): the result has ``x``'s shape and ``dtype``."""
    a, b, c = coefficients
    o = x.to(dtype) if dtype is not None else x
    tall = x.size(0) > x.size(1)
    if tall:
        o = o.T
    o = o.div(o.norm().clamp(min=eps))
    for _ in range(steps):
        gram = o @ o.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.addmm(o, update, o, beta=a)
    return o.T if tall else o


def lr_ratio(shape, adjust_lr_fn: Optional[str]) -> float:
    """``torch.optim._muon._adjust_lr``'s factor for a matrix of ``shape`` (global)."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def ns_flops(shape, steps: int = NS_STEPS) -> float:
    """Multiply-adds x2 of ``steps`` Newton–Schulz iterations on a matrix of ``shape``:
    per step ``X X^T`` (2 r^2 c), ``A A`` (2 r^3), ``B X`` (2 r^2 c), r = min, c = max."""
    r, c = sorted(shape[:2])
    return float(steps * (4 * r * r * c + 2 * r ** 3))


def _check(momentum, ns_coefficients, ns_steps, eps, adjust_lr_fn, who):
    if not momentum >= 0.0:
        raise ValueError(f"{who}: momentum should be >= 0 but is: {momentum}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"{who}: ns_coefficients must be a tuple of exactly 3 values, got {ns_coefficients!r}")
    if not 0 <= ns_steps < 100:
        raise ValueError(f"{who}: ns_steps must be in [0, 100) (torch's bound), got {ns_steps}")
    if not eps >= 0.0:
        raise ValueError(f"{who}: eps must be >= 0, got {eps}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"{who}: adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: Optional[str] = None,
    *,
    ns_dtype: Optional[torch.dtype] = torch.bfloat16,
    mesh: Any = None,
    specs: Any = None,
    owners: _owner.Owners = None,
) -> GradientTransformation:
    """Muon's direction: momentum, then each whole matrix orthogonalized, times the shape ratio.

    Args:
        momentum: the buffer's decay (``buf = lerp(buf, g, 1 - momentum)``, as ``torch.optim.Muon``).
        nesterov: orthogonalize ``lerp(g, buf, momentum)`` instead of ``buf``.
        ns_coefficients: the quintic Newton–Schulz coefficients ``(a, b, c)``.
        eps: the floor of the Frobenius norm the input is divided by.
        ns_steps: Newton–Schulz iterations (< 100).
        adjust_lr_fn: ``None`` / ``"original"`` (``sqrt(max(1, A/B))``) or ``"match_rms_adamw"``
            (``0.2 sqrt(max(A, B))``), of the global shape.
        ns_dtype: the Newton–Schulz dtype (torch's is bfloat16); None computes in the
            params' dtype (not torch's numbers: for float64 studies).
        mesh: the mesh whose ranks hold blocks of the leaves (None: leaves are whole).
        specs: the leaves' spec tree (a pytree prefix of the params, e.g. ``step.specs``);
            default: dim 0 over every mesh axis, 0-dim leaves whole.
        owners: ``owners(path, global_shape, group_size) -> index`` to pin each matrix's
            owner; default: balanced by Newton–Schulz FLOPs ([Note: the owner rule]).

    Returns:
        A ``GradientTransformation`` with ``ScaleByMuonState(count, momentum)``; its
        ``update.stats()`` gives this rank's bytes of the last update, its
        ``update.owners(tree)`` the ``{path: (group axes, owner index)}`` of a tree, its
        ``update.plan(full_params, mesh_shape, specs)`` every rank's stats of one update
        before any run (``{rank: stats}``, no collective; meta tensors do).

    Raises:
        ValueError: (in ``update``) a leaf that is not 2-D, naming its path.
    """
    who = "scale_by_muon"
    _check(momentum, ns_coefficients, ns_steps, eps, adjust_lr_fn, who)
    layout = _owner.Layout(mesh, specs, who)
    stats = _owner.Stats()
    coeffs = tuple(float(c) for c in ns_coefficients)

    def plan(tree):
        lay = layout.of(tree)
        bad = [lb for lb in lay if len(lb.shape) != 2]
        if bad:
            listing = "\n".join(f"  - params{_tree.keystr(lb.path)}: shape {lb.shape}" for lb in bad[:10])
            raise ValueError(f"{who}: Muon only supports 2-D parameters (as torch.optim.Muon); these are not:\n"
                             f"{listing}\nFix: route them to another optimizer, e.g. optim.multi_transform("
                             f"{{'muon': optim.muon(lr), 'adamw': optim.adamw(lr)}}, lambda path, p: 'muon' if "
                             f"p.ndim == 2 else 'adamw').")
        cost = {i: ns_flops(lb.shape, ns_steps) for i, lb in enumerate(lay)}
        owner = _owner.assign_owners([(i, lb, cost[i]) for i, lb in enumerate(lay)], mesh, owners, who)
        return lay, cost, owner

    def init(params):
        leaves, treedef = _tree.flatten(params)
        return ScaleByMuonState(_flat.new_count(), _tree.unflatten(treedef, _flat.zeros_like(leaves)))

    def update(updates, state, params=None):
        del params
        g, treedef = _tree.flatten(updates)
        buf = _flat.leaves_like(treedef, state.momentum, "state.momentum", f"{who}.update", shapes_of=g)
        count, _ = _flat.bump_count(state.count, False)
        if not g:
            return updates, ScaleByMuonState(count, state.momentum)
        lay, cost, owner = plan(updates)
        new_buf = [torch.lerp(b, x, 1.0 - momentum) for b, x in zip(buf, g)]
        inputs = [torch.lerp(x, b, momentum) if nesterov else b for x, b in zip(g, new_buf)]
        wire = {i: (x.to(ns_dtype) if ns_dtype is not None else x) for i, x in enumerate(inputs)}

        def orthogonalize(i, whole):
            return newton_schulz(whole, coeffs, ns_steps, eps, ns_dtype)

        out, rank_stats = _owner.map_whole(orthogonalize, wire, lay, owner, mesh, cost)
        stats.set(layout.rank_key(), rank_stats)
        new = [out[i].to(x.dtype).mul(lr_ratio(lay[i].shape, adjust_lr_fn)) for i, x in enumerate(g)]
        return _tree.unflatten(treedef, new), ScaleByMuonState(count, _tree.unflatten(treedef, new_buf))

    def owners_of(tree):
        lay, _, own = plan(tree)
        return {lay[i].path: (lay[i].axes, o) for i, o in sorted(own.items())}

    def plan_of(params, mesh_shape, specs=specs):
        """Every rank's stats of one update, from the full params (or meta tensors), no collective."""
        return _owner.plan(params, mesh_shape, specs, lambda shape: ns_flops(shape, ns_steps), ns_dtype, ns_dtype,
                           owners, who)

    update.stats = lambda: stats.get(mesh)
    update.owners = owners_of
    update.plan = plan_of
    if mesh is None:
        update.unplaced = ('scale_by_muon',)
    return GradientTransformation(init, update)


def muon(
    learning_rate: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: Optional[str] = None,
    *,
    ns_dtype: Optional[torch.dtype] = torch.bfloat16,
    mesh: Any = None,
    specs: Any = None,
    owners: _owner.Owners = None,
) -> GradientTransformation:
    """Muon with ``torch.optim.Muon``'s semantics and defaults, on whole or sharded matrices.

    ``chain(scale_by_muon(...), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``:
    the update is ``-lr * (ratio * O + weight_decay * p)``, torch's
    ``p.mul_(1 - lr * wd); p.add_(O, alpha=-lr * ratio)`` up to rounding. Every leaf
    must be 2-D; use ``multi_transform`` for the usual recipe (Muon on hidden matrices,
    AdamW on embeddings, heads, norms and biases: docs/optimizers-sharded.md).

    On shards, pass ``mesh`` and ``specs`` (``step.specs``): each matrix is gathered to
    one owner rank, orthogonalized whole and scattered back ([Note: the owner rule] in
    ``_owner.py``); every rank of the mesh must call ``update`` together.

    Args:
        learning_rate: a float or a schedule ``count -> lr``.
        weight_decay: decoupled, scaled by the learning rate (torch's default 0.1).
        momentum: as ``scale_by_muon``.
        nesterov: as ``scale_by_muon``.
        ns_coefficients: as ``scale_by_muon``.
        eps: as ``scale_by_muon``.
        ns_steps: as ``scale_by_muon``.
        adjust_lr_fn: as ``scale_by_muon``.
        ns_dtype: as ``scale_by_muon``.
        mesh: as ``scale_by_muon``.
        specs: as ``scale_by_muon``.
        owners: as ``scale_by_muon``.

    Returns:
        The chain; ``opt.update.stats()`` and ``opt.update.owners(tree)`` as in ``scale_by_muon``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.muon(0.02)
        >>> params = {"w": torch.eye(3)}
        >>> u, state = opt.update({"w": torch.eye(3)}, opt.init(params), params)
        >>> u["w"].shape
        torch.Size([3, 3])
    """
    inner = scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, ns_dtype=ns_dtype,
                          mesh=mesh, specs=specs, owners=owners)
    opt = chain(inner, add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
    opt.update.stats = inner.update.stats
    opt.update.owners = inner.update.owners
    opt.update.plan = inner.update.plan
    return opt
