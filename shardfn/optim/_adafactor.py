"""Adafactor with ``torch.optim.Adafactor``'s numerics, on whole leaves or blocks of them.

Per leaf, as ``torch.optim.Adafactor`` (torch 2.13, ``_single_tensor_adafactor``) computes it,
at step t (from 1), with ``w = t ** beta2_decay``, ``rho = min(lr, t ** -0.5)``:

    alpha = max(eps2, ||p|| / sqrt(numel)) * rho          # before the decay
    p    *= 1 - lr * weight_decay
    >= 2-D: R = lerp(R, mean(g*g, -1), w); C = lerp(C, mean(g*g, -2), w)
            V = (R @ C) / max(mean(R, -2), eps1)           # factored over the last two dims
    else:   V = lerp(V, g*g, w)
    u     = g / sqrt(max(V, eps1**2));  p -= alpha / max(1, ||u|| / (sqrt(numel) d)) * u

[Note: Adafactor on blocks]
Everything above is element-wise except five reductions: ``||p||``, ``||u||``, the row
means (over dim -1), the column means and ``mean(R, -2)`` (over dim -2). On blocks each is
the local sum followed by a sum over the mesh axes that split the reduced dims: the axes
of ``spec[-1]`` for row means, of ``spec[-2]`` for column means and ``mean(R, -2)``, every
axis the spec names for the norms. No matrix is gathered: ``R`` is sharded like the rows,
``C`` like the columns (replicated over the axes of ``spec[-2]``: for ``sf.shard``'s dim-0
shards of a matrix, ``C`` is whole on every rank, ``n`` numbers). The sums of one phase go
in one ``mesh.all_reduce`` per set of axes: two per step for dim-0 shards (``||p||``, the
column sums and the ``R`` sums; then ``||u||``), a third first when a spec splits the last
dim (tensor parallelism). Rounding differs from the whole leaf's by the order of the sums.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .. import _tree
from .._spec import entry_axes
from . import _flat, _owner
from ._scale import ScalarOrSchedule
from .base import GradientTransformation


class AdafactorState(NamedTuple):
    """State of ``adafactor``: ``count`` (0-dim int64); ``row_var`` and ``col_var``, trees with
    ``p.shape[:-1] + (1,)`` and ``p.shape[:-2] + (1, p.shape[-1])`` blocks for leaves of 2 or
    more dims (None for the others); ``variance``, shaped like the leaves of fewer dims (None
    for the factored ones): torch's ``row_var``, ``col_var`` and ``variance``."""

    count: torch.Tensor
    row_var: Any
    col_var: Any
    variance: Any


class _Sums:
    """Sums over mesh axes, batched: one all-reduce per set of axes ([Note: Adafactor on blocks])."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.requests: list[tuple[tuple, torch.Tensor]] = []

    def add(self, axes: tuple, t: torch.Tensor) -> int:
        self.requests.append((axes, t))
        return len(self.requests) - 1

    def run(self) -> list[torch.Tensor]:
        out = [t for _, t in self.requests]
        by_axes: dict[tuple, list[int]] = {}
        for i, (axes, _) in enumerate(self.requests):
            if axes and self.mesh is not None:
                by_axes.setdefault(axes, []).append(i)
        for axes in sorted(by_axes):
            idx = by_axes[axes]
            flat = torch.cat([self.requests[i][1].reshape(-1) for i in idx])
            self.mesh.all_reduce(flat, axes, op="sum")
            for i, part in zip(idx, flat.split([self.requests[i][1].numel() for i in idx])):
                out[i] = part.view(self.requests[i][1].shape)
        self.requests = []
        return out


def _axes(mesh, entry) -> tuple:
    names = entry_axes(entry)
    return tuple(a for a in mesh.axis_names if a in names) if mesh is not None else ()


def adafactor(
    learning_rate: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[Optional[float], float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
    mesh: Any = None,
    specs: Any = None,
) -> GradientTransformation:
    """Adafactor with ``torch.optim.Adafactor``'s semantics and defaults, on whole leaves or blocks.

    The learning rate is torch's: a cap on the relative step size ``min(lr, 1/sqrt(t))``,
    scaled by the leaf's RMS; ``update`` returns the full step (no ``scale_by_learning_rate``
    after it). On blocks, pass ``mesh`` and ``specs`` (``step.specs``): the row and column
    statistics and the norms are summed over the mesh axes that split them, never gathered
    ([Note: Adafactor on blocks] in ``_adafactor.py``); every rank calls ``update`` together.

    Args:
        learning_rate: a float or a schedule ``count -> lr``.
        beta2_decay: the second moment's decay exponent (``w_t = t ** beta2_decay``).
        eps: ``(eps1, eps2)``; ``eps1=None`` means the params' ``finfo(dtype).eps``.
        d: the update's RMS clipping threshold.
        weight_decay: decoupled, times the learning rate.
        maximize: ascend.
        mesh: the mesh whose ranks hold blocks of the leaves (None: leaves are whole).
        specs: the leaves' spec tree, e.g. ``step.specs`` (default: dim 0 over every mesh axis).

    Returns:
        A ``GradientTransformation`` with ``AdafactorState(count, row_var, col_var, variance)``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.adafactor(1e-2)
        >>> params = {"w": torch.ones(2, 3)}
        >>> u, state = opt.update({"w": torch.ones(2, 3)}, opt.init(params), params)
        >>> u["w"]
        tensor([[-0.0100, -0.0100, -0.0100],
                [-0.0100, -0.0100, -0.0100]])
    """
    who = "adafactor"
    if not callable(learning_rate) and not learning_rate >= 0.0:
        raise ValueError(f"{who}: learning rate should be >= 0 but is: {learning_rate}")
    if not beta2_decay <= 0.0:
        raise ValueError(f"{who}: beta2_decay should be <= 0 but is: {beta2_decay}")
    if eps[0] is not None and not eps[0] >= 0.0:
        raise ValueError(f"{who}: epsilon1 should be >= 0 but is: {eps[0]}")
    if not eps[1] >= 0.0:
        raise ValueError(f"{who}: epsilon2 should be >= 0 but is: {eps[1]}")
    if not d >= 1.0:
        raise ValueError(f"{who}: clipping threshold d should be >= 1 but is: {d}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{who}: weight_decay should be >= 0 but is: {weight_decay}")
    layout = _owner.Layout(mesh, specs, who)

    def init(params):
        leaves, treedef = _tree.flatten(params)

        def shaped(x, dim, factored):
            if (x.dim() > 1) != factored:
                return None
            if not factored:
                return torch.zeros_like(x)
            shape = list(x.shape)
            shape[dim] = 1
            return x.new_zeros(shape)

        return AdafactorState(
            _flat.new_count(),
            _tree.unflatten(treedef, [shaped(x, -1, True) for x in leaves]),
            _tree.unflatten(treedef, [shaped(x, -2, True) for x in leaves]),
            _tree.unflatten(treedef, [shaped(x, 0, False) for x in leaves]),
        )

    def update(updates, state, params=None):
        _flat.require_params(params, f"{who}.update")
        g, treedef = _tree.flatten(updates)
        p = _flat.leaves_like(treedef, params, "params", f"{who}.update", shapes_of=g)
        count, t = _flat.bump_count(state.count, False)
        if not g:
            return updates, AdafactorState(count, state.row_var, state.col_var, state.variance)
        lay = layout.of(updates)
        # the state trees hold None where a leaf has no such statistic: flatten them with the
        # Nones as leaves, at the positions of this call's leaves ([Note: masked trees] in _multi.py)
        slots, full_def = _tree.flatten(updates, none_is_leaf=True)
        at = [i for i, x in enumerate(slots) if x is not None]
        rows, cols, var = ([_tree.flatten(s, none_is_leaf=True)[0][i] for i in at] if s is not None else [None] * len(at)
                           for s in (state.row_var, state.col_var, state.variance))
        lr = float(learning_rate(t - 1)) if callable(learning_rate) else float(learning_rate)
        w = float(t) ** beta2_decay
        rho = min(lr, 1 / (float(t) ** 0.5))
        if maximize:
            g = [-x for x in g]
        sums = _Sums(mesh)
        every = [lb.axes for lb in lay]
        last = [_axes(mesh, lb.spec[-1]) if len(lb.shape) > 1 else () for lb in lay]
        second = [_axes(mesh, lb.spec[-2]) if len(lb.shape) > 1 else () for lb in lay]

        def norm(axes, x):  # a request whose result is ||x||: squared and summed when split
            return sums.add(axes, x.norm(2).square().reshape(1) if axes else x.norm(2))

        def root(axes, got):
            return got.sqrt() if axes else got

        # row means of g*g (summed over the axes of spec[-1]: none unless the last dim is split)
        row_sq = {i: sums.add(last[i], torch.norm(x, dim=-1, keepdim=True).square_())
                  for i, x in enumerate(g) if x.dim() > 1}
        row_sq = dict(zip(row_sq, sums.run()))
        new_rows, new_cols, new_var = list(rows), list(cols), list(var)
        for i, x in enumerate(g):
            if x.dim() > 1:
                new_rows[i] = torch.lerp(rows[i], row_sq[i].div_(lay[i].shape[-1]), w)
        # phase 1: ||p||, column sums of g*g, mean of R over dim -2
        p_norm = [norm(every[i], x) for i, x in enumerate(p)]
        col_sq = {i: sums.add(second[i], torch.norm(x, dim=-2, keepdim=True).square_())
                  for i, x in enumerate(g) if x.dim() > 1}
        r_mean = {i: sums.add(second[i], new_rows[i].sum(dim=-2, keepdim=True) if second[i]
                              else new_rows[i].mean(dim=-2, keepdim=True)) for i in col_sq}
        got = sums.run()
        out_u = []
        for i, (x, q) in enumerate(zip(g, p)):
            eps1 = eps[0] if eps[0] is not None else torch.finfo(q.dtype).eps
            if x.dim() > 1:
                new_cols[i] = torch.lerp(cols[i], got[col_sq[i]].div_(lay[i].shape[-2]), w)
                estimate = new_rows[i] @ new_cols[i]
                mean_r = got[r_mean[i]].div(lay[i].shape[-2]) if second[i] else got[r_mean[i]]
                estimate.div_(mean_r.clamp_(min=eps1))
            else:
                new_var[i] = torch.lerp(var[i], x * x, w)
                estimate = new_var[i].clone()
            u = estimate.clamp_(min=eps1 * eps1).rsqrt_()
            u.mul_(x)
            out_u.append(u)
        u_norm = [norm(every[i], u) for i, u in enumerate(out_u)]
        got_u = sums.run()
        new = []
        for i, (u, q) in enumerate(zip(out_u, p)):
            numel = lay[i].numel
            alpha = max(eps[1], root(every[i], got[p_norm[i]]).item() / (numel ** 0.5)) * rho
            denom = max(1.0, root(every[i], got_u[u_norm[i]]).item() / ((numel ** 0.5) * d))
            step = u.mul(-alpha / denom)
            if weight_decay != 0:
                step = step.sub(q, alpha=lr * weight_decay)
            new.append(step)

        def tree(leaves):
            return _tree.unflatten(treedef, leaves)

        def stat_tree(leaves):
            full = [None] * len(slots)
            for i, x in zip(at, leaves):
                full[i] = x
            return _tree.unflatten(full_def, full)

        return tree(new), AdafactorState(count, stat_tree(new_rows), stat_tree(new_cols), stat_tree(new_var))

    if mesh is None:
        update.unplaced = ("adafactor",)
    return GradientTransformation(init, update)


def adafactor_state_specs(state: AdafactorState, params_specs: Any, params: Any) -> AdafactorState:
    """The spec tree of an ``adafactor`` state built from blocks, for ``sf.checkpoint``.

    ``R`` (the row factor) is split like its leaf except along the last dim, ``C`` (the
    column factor) like its leaf except along dim -2 (so for dim-0 blocks of a matrix,
    ``C`` is replicated), the unfactored ``variance`` like its leaf.

    Args:
        state: ``adafactor(...).init(shards)`` (or a later state).
        params_specs: the params' spec tree (a pytree prefix, e.g. ``step.specs``).
        params: the shards (their structure and ranks).

    Returns:
        An ``AdafactorState`` of specs to give ``sf.checkpoint.save`` / ``load`` with ``state``.

    Example:
        >>> import torch, shardfn as sf, shardfn.optim as optim
        >>> params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
        >>> state = optim.adafactor().init(params)
        >>> optim.adafactor_state_specs(state, sf.P("data"), params).col_var
        {'w': P(None, None), 'b': None}
    """
    from .._spec import PartitionSpec, as_spec, is_spec

    paths, leaves, treedef = _tree.flatten_with_paths(params)
    per_leaf = _tree.broadcast_prefix(params_specs, params, what="params_specs", is_prefix_leaf=is_spec)
    rows, cols, var = [], [], []
    for x, s in zip(leaves, per_leaf):
        s = as_spec(s, "adafactor_state_specs: params_specs")
        full = tuple(s) + (None,) * (x.dim() - len(s))
        if x.dim() > 1:
            rows.append(PartitionSpec(*full[:-1], None))
            cols.append(PartitionSpec(*full[:-2], None, full[-1]))
            var.append(None)
        else:
            rows.append(None)
            cols.append(None)
            var.append(PartitionSpec(*full))
    tree = lambda xs: _tree.unflatten(treedef, xs)  # noqa: E731
    del state  # its structure is that of `params`' leaves (the Nones are its unfactored slots)
    return AdafactorState(PartitionSpec(), tree(rows), tree(cols), tree(var))
