"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"), on the
owner of each matrix.

Per 2-D leaf ``W`` (m x n) with gradient ``G``, the paper's Algorithm 3, with the
eigenbasis recomputed by ``torch.linalg.eigh`` every ``precondition_frequency`` Adam steps:

    first update: L = (1 - bs) G G^T;  R = (1 - bs) G^T G;  Q_L, Q_R = eigenvectors(L), (R)
                  (no step: the projection never uses the gradient it was built from)
    then, Adam step s = 1, 2, ...:
        G' = Q_L^T G Q_R;   M = lerp(M, G, 1 - b1);   M' = Q_L^T M Q_R
        V  = lerp(V, G' * G', 1 - b2)                              # Adam's second moment, rotated
        N  = Q_L [ (M' / (1 - b1^s)) / (sqrt(V / (1 - b2^s)) + eps) ] Q_R^T
        L  = lerp(L, G G^T, 1 - bs);  R = lerp(R, G^T G, 1 - bs)
        every precondition_frequency steps: Q_L, Q_R = eigenvectors(L), eigenvectors(R)

``scale_by_soap`` returns ``N``; ``soap`` chains it with decoupled decay and the learning rate.

[Note: SOAP's state lives on the owner]
Every step needs the whole ``G`` (for ``G'`` and ``G G^T``) and the whole ``M`` (for
``M'``), so the matrix's owner ([Note: the owner rule] in ``_owner.py``) keeps the
matrix's whole state, ``M, V, L, R, Q_L, Q_R``, and the other ranks keep empty (0,)
tensors in its place: the state is partitioned by matrix, not by rows (each rank holds
the state of the matrices it owns, balanced by cost). A step is one gather of ``G`` to
the owner and one scatter of ``N``, in the params' dtype: the owner rule's bytes. The
state is allocated on the first update (``init`` cannot know the owners without a
collective), so it is not a block layout that ``sf.checkpoint`` could reshard; save and
resume it on the same mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .. import _tree
from . import _flat, _owner
from ._scale import ScalarOrSchedule, scale_by_learning_rate
from ._weight_decay import add_decayed_weights
from .base import GradientTransformation, chain


class ScaleBySoapState(NamedTuple):
    """State of ``scale_by_soap``: ``count`` (0-dim int64) and, per leaf, trees ``m``, ``v``
    (m x n), ``l`` (m x m), ``r`` (n x n), ``ql``, ``qr``: whole on the leaf's owner,
    empty ``(0,)`` tensors on the other ranks ([Note: SOAP's state lives on the owner])."""

    count: torch.Tensor
    m: Any
    v: Any
    l: Any
    r: Any
    ql: Any
    qr: Any


def soap_flops(shape, frequency: int) -> float:
    """Per step: six matmuls of ``m n (m or n)`` and the eigendecompositions' ``~9 (m^3 + n^3)``
    every ``frequency`` steps."""
    m, n = shape[:2]
    return float(6 * m * n * (m + n) / 2 + 9 * (m ** 3 + n ** 3) / max(frequency, 1))


def _eigenvectors(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(a)[1]


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    *,
    mesh: Any = None,
    specs: Any = None,
    owners: _owner.Owners = None,
) -> GradientTransformation:
    """SOAP's direction ``N`` for 2-D leaves, each computed whole by its owner.

    Args:
        b1: the first moment's decay (kept in the original basis).
        b2: the second moment's decay (in the eigenbasis).
        shampoo_beta: the decay of ``L`` and ``R`` (default: ``b2``, as the paper's code).
        eps: Adam's epsilon, after the square root.
        precondition_frequency: recompute the eigenbasis every this many Adam steps.
        mesh: the mesh whose ranks hold blocks of the leaves (None: leaves are whole).
        specs: the leaves' spec tree, e.g. ``step.specs`` (default: dim 0 over every mesh axis).
        owners: ``owners(path, global_shape, group_size) -> index`` pins each matrix's owner
            (default: balanced by cost).

    Returns:
        A ``GradientTransformation`` with ``ScaleBySoapState``; ``update.stats()`` and
        ``update.owners(tree)`` as for ``scale_by_muon``.

    Raises:
        ValueError: bad hyperparameters; (in ``update``) a leaf that is not 2-D.
    """
    who = "scale_by_soap"
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{who}: {name} must be in [0, 1), got {value}.")
    bs = b2 if shampoo_beta is None else shampoo_beta
    if not 0.0 <= bs < 1.0:
        raise ValueError(f"{who}: shampoo_beta must be in [0, 1), got {shampoo_beta}.")
    if not (isinstance(precondition_frequency, int) and precondition_frequency >= 1):
        raise ValueError(f"{who}: precondition_frequency must be an int >= 1, got {precondition_frequency!r}.")
    layout = _owner.Layout(mesh, specs, who)
    stats = _owner.Stats()

    def plan(tree):
        lay = layout.of(tree)
        bad = [lb for lb in lay if len(lb.shape) != 2]
        if bad:
            listing = "\n".join(f"  - params{_tree.keystr(lb.path)}: shape {lb.shape}" for lb in bad[:10])
            raise ValueError(f"{who}: SOAP here preconditions 2-D parameters only; these are not:\n{listing}\n"
                             f"Fix: route them to another optimizer with optim.multi_transform (e.g. adamw).")
        cost = {i: soap_flops(lb.shape, precondition_frequency) for i, lb in enumerate(lay)}
        return lay, cost, _owner.assign_owners([(i, lb, cost[i]) for i, lb in enumerate(lay)], mesh, owners, who)

    def init(params):
        leaves, treedef = _tree.flatten(params)
        empty = lambda: _tree.unflatten(treedef, [x.new_empty((0,)) for x in leaves])  # noqa: E731
        return ScaleBySoapState(_flat.new_count(), empty(), empty(), empty(), empty(), empty(), empty())

    def update(updates, state, params=None):
        del params
        g, treedef = _tree.flatten(updates)
        names = ("m", "v", "l", "r", "ql", "qr")
        old = {k: _flat.leaves_like(treedef, getattr(state, k), f"state.{k}", f"{who}.update") for k in names}
        count, t = _flat.bump_count(state.count, False)
        if not g:
            return updates, state._replace(count=count)
        lay, cost, owner = plan(updates)
        new = {k: list(v) for k, v in old.items()}
        s = t - 1  # Adam steps so far, this one included (the first update only builds the basis)

        def direction(i, grad):
            gg, ggt = grad @ grad.T, grad.T @ grad
            if t == 1:
                l_, r_ = torch.zeros_like(gg), torch.zeros_like(ggt)
                m_, v_ = torch.zeros_like(grad), torch.zeros_like(grad)
                l_, r_ = torch.lerp(l_, gg, 1 - bs), torch.lerp(r_, ggt, 1 - bs)
                ql, qr = _eigenvectors(l_), _eigenvectors(r_)
                n_ = torch.zeros_like(grad)
            else:
                m_, v_, l_, r_, ql, qr = (old[k][i] for k in names)
                gp = ql.T @ grad @ qr
                m_ = torch.lerp(m_, grad, 1 - b1)
                mp = ql.T @ m_ @ qr
                v_ = torch.lerp(v_, gp * gp, 1 - b2)
                np_ = (mp / (1 - b1 ** s)) / ((v_ / (1 - b2 ** s)).sqrt() + eps)
                n_ = ql @ np_ @ qr.T
                l_, r_ = torch.lerp(l_, gg, 1 - bs), torch.lerp(r_, ggt, 1 - bs)
                if s % precondition_frequency == 0:
                    ql, qr = _eigenvectors(l_), _eigenvectors(r_)
            for k, x in zip(names, (m_, v_, l_, r_, ql, qr)):
                new[k][i] = x
            return n_

        out, rank_stats = _owner.map_whole(direction, dict(enumerate(g)), lay, owner, mesh, cost)
        stats.set(layout.rank_key(), rank_stats)
        tree = lambda leaves: _tree.unflatten(treedef, leaves)  # noqa: E731
        return tree([out[i] for i in range(len(g))]), ScaleBySoapState(count, *(tree(new[k]) for k in names))

    def owners_of(tree):
        lay, _, own = plan(tree)
        return {lay[i].path: (lay[i].axes, o) for i, o in sorted(own.items())}

    def plan_of(params, mesh_shape, specs=specs):
        """Every rank's stats of one update, from the full params (or meta tensors), no collective."""
        return _owner.plan(params, mesh_shape, specs, lambda shape: soap_flops(shape, precondition_frequency),
                           None, None, owners, who)

    update.stats = lambda: stats.get(mesh)
    update.owners = owners_of
    update.plan = plan_of
    if mesh is None:
        update.unplaced = ('scale_by_soap',)
    return GradientTransformation(init, update)


def soap(
    learning_rate: ScalarOrSchedule = 3e-3,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: Optional[float] = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    precondition_frequency: int = 10,
    *,
    mesh: Any = None,
    specs: Any = None,
    owners: _owner.Owners = None,
) -> GradientTransformation:
    """SOAP: ``chain(scale_by_soap(...), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))``.

    Each matrix's state and math live on its owner rank ([Note: SOAP's state lives on the
    owner] in ``_soap.py``); every leaf must be 2-D (route the others with
    ``multi_transform``). Defaults follow the paper's code (lr 3e-3, betas 0.95, frequency 10).

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.soap(1e-2)
        >>> params = {"w": torch.ones(3, 2)}
        >>> state = opt.init(params)
        >>> u, state = opt.update({"w": torch.ones(3, 2)}, state, params)   # builds the basis
        >>> u, state = opt.update({"w": torch.ones(3, 2)}, state, params)
        >>> state[0].ql["w"].shape
        torch.Size([3, 3])
    """
    inner = scale_by_soap(b1, b2, shampoo_beta, eps, precondition_frequency, mesh=mesh, specs=specs, owners=owners)
    opt = chain(inner, add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))
    opt.update.stats = inner.update.stats
    opt.update.owners = inner.update.owners
    opt.update.plan = inner.update.plan
    return opt
