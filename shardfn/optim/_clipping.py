"""Global-norm clipping, like ``torch.nn.utils.clip_grad_norm_``, on whole or sharded trees.

[Note: the global norm of a sharded tree]
On a mesh each rank holds blocks of the gradient, so the norm of the *global* gradient
is ``sqrt(psum(sum of squared local norms))`` over the axes the leaves are sharded on.
A leaf that is replicated over some of those axes (a 0-dim leaf, a bias kept whole)
is the same on every rank of them and must be counted once: a rank adds its squared
norm only when its coordinate is 0 on every reduced axis the leaf's spec does not
mention. That is exact (no division by a group size) and works for partial
replication (e.g. HSDP: sharded over "shard", replicated over "replica").
Without ``specs``, 0-dim leaves are taken as replicated and all others as sharded
over every reduced axis, which is the layout of ``sf.shard``'s shards.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import optree
import torch

from .. import _tree
from .._errors import SpecError
from .._spec import as_spec, is_spec
from . import _flat, _hyper
from .base import EmptyState, GradientTransformation

Axes = Union[None, str, Sequence[str]]


class _Counted(NamedTuple):
    """Which flat leaves this rank counts, for one tree structure."""

    treedef: optree.PyTreeSpec
    index: Optional[list[int]]  # None: every leaf


def _axes_tuple(mesh: Any, axes: Axes, who: str) -> tuple[str, ...]:
    names = tuple(mesh.shape)
    if axes is None:
        return names
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in axes if a not in names]
    if unknown:
        raise SpecError(
            f"{who}: axes {unknown} are not axes of the mesh; the mesh has axes "
            f"{list(names)} (shape {dict(mesh.shape)})."
        )
    return axes


def _counted(tree: Any, leaves: list, treedef, mesh, axes, specs, who) -> _Counted:
    if specs is None:
        replicated_axes = [set(axes) if leaf.dim() == 0 else set() for leaf in leaves]
    else:
        try:
            per_leaf = _tree.broadcast_prefix(specs, tree, what="specs", is_prefix_leaf=is_spec)
        except SpecError as e:
            raise SpecError(
                f"{who}: `specs` must be a pytree prefix of the gradients with a "
                f"PartitionSpec or None per leaf (like `step.specs`).\n{e}"
            ) from None
        replicated_axes = [set(axes) - set(as_spec(s, f"{who}: specs").axes) for s in per_leaf]
    coords = mesh.coords
    keep = [all(coords[a] == 0 for a in rep) for rep in replicated_axes]
    return _Counted(treedef, None if all(keep) else [i for i, k in enumerate(keep) if k])


def _acc_dtype(leaves: list[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in leaves) else torch.float32


def _norms(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's 2-norm: ``torch._foreach_norm``, or leaf by leaf (the same kernel) where it
    must be differentiable or batched ([Note: differentiable pure mode] in _flat.py)."""
    if _flat.per_leaf(leaves):
        return [torch.linalg.vector_norm(t, 2) for t in leaves]
    return list(torch._foreach_norm(leaves, 2))


def _local_sq_norm(leaves: list[torch.Tensor], dtype, device) -> torch.Tensor:
    if not leaves:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack([n.to(dtype) for n in _norms(leaves)]).square().sum()


def _global_norm(leaves, mesh, axes, counted) -> torch.Tensor:
    dtype = _acc_dtype(leaves) if leaves else torch.float32
    if mesh is None:
        if not leaves:
            return torch.zeros((), dtype=dtype)
        # The same arithmetic as torch.nn.utils.clip_grad_norm_.
        return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in _norms(leaves)]), 2)
    device = leaves[0].device if leaves else torch.device("cpu")
    mine = leaves if counted.index is None else [leaves[i] for i in counted.index]
    sq = _local_sq_norm(mine, dtype, device)
    mesh.all_reduce(sq, axes, op="sum")
    return sq.sqrt()


class _NormPlan:
    """Resolves mesh axes once and which leaves a rank counts, cached per tree structure."""

    def __init__(self, mesh, axes, specs, who):
        if mesh is None and (axes is not None or specs is not None):
            raise ValueError(f"{who}: `axes` and `specs` describe a mesh; pass `mesh` too.")
        self.mesh, self.specs, self.who = mesh, specs, who
        self.axes = None if mesh is None else _axes_tuple(mesh, axes, who)
        self._cache: dict[Any, _Counted] = {}

    def norm(self, tree: Any, leaves: list, treedef) -> torch.Tensor:
        if self.mesh is None:
            return _global_norm(leaves, None, None, None)
        key = (treedef, tuple(sorted(self.mesh.coords.items())))
        counted = self._cache.get(key)
        if counted is None:
            counted = _counted(tree, leaves, treedef, self.mesh, self.axes, self.specs, self.who)
            self._cache[key] = counted
        return _global_norm(leaves, self.mesh, self.axes, counted)


def global_norm(tree: Any, mesh: Any = None, axes: Axes = None, specs: Any = None) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` together; of the global tree when ``mesh`` is given.

    Args:
        tree: a pytree of tensors (on a mesh: this rank's blocks).
        mesh: a ``Mesh``; when given, every rank must call this (it all-reduces).
        axes: mesh axes the tree is sharded over (a name or names; default: all).
        specs: pytree prefix of the tree with a ``PartitionSpec`` (or None) per leaf;
            leaves whose spec omits a reduced axis are counted once over it. Default:
            0-dim leaves replicated, others sharded.

    Returns:
        A 0-dim tensor (float64 if any leaf is float64, else float32).

    Example:
        >>> import torch, shardfn.optim as optim
        >>> optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor(4.0)})
        tensor(5.)
    """
    leaves, treedef = _tree.flatten(tree)
    return _NormPlan(mesh, axes, specs, "global_norm").norm(tree, leaves, treedef)


def clip_by_global_norm(
    max_norm: float,
    mesh: Any = None,
    axes: Axes = None,
    specs: Any = None,
    *,
    inplace: bool = False,
) -> GradientTransformation:
    """Scale the updates by ``min(1, max_norm / (norm + 1e-6))``, like ``clip_grad_norm_``.

    ``norm`` is the norm of all leaves together. With ``mesh`` the updates are this
    rank's shards and ``norm`` is that of the global gradient (see ``global_norm``);
    every rank of ``axes`` must call ``update`` together.

    Args:
        max_norm: the largest norm let through (a number, or in pure mode a 0-dim
            floating-point tensor: differentiable).
        mesh: the mesh the gradients are sharded over, or None for whole gradients.
        axes: the mesh axes to reduce over (default: all).
        specs: pytree prefix of the gradients with a PartitionSpec or None per leaf
            (e.g. ``step.specs``), to count replicated leaves once.
        inplace: multiply the incoming updates in place.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.clip_by_global_norm(1.0)
        >>> u, _ = opt.update({"w": torch.tensor([3.0, 4.0])}, opt.init(None))
        >>> u["w"]
        tensor([0.6000, 0.8000])
    """
    max_norm = _hyper.check(max_norm, "max_norm", "clip_by_global_norm")
    if inplace:
        _hyper.numbers_only("clip_by_global_norm", "inplace=True", max_norm=max_norm)
    plan = _NormPlan(mesh, axes, specs, "clip_by_global_norm")
    who = "clip_by_global_norm.update"

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        del params
        leaves, treedef = _tree.flatten(updates)
        if inplace:
            _flat.refuse_func(who, "optim.clip_by_global_norm(...) without inplace=True", leaves)
        norm = plan.norm(updates, leaves, treedef)
        if not leaves:
            return updates, state
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if inplace:
            with torch.no_grad():
                leaves = _flat.writable(leaves)
                torch._foreach_mul_(leaves, coef)
        else:
            # in the leaves' dtypes: a 0-dim float32 leaf times the float64 coefficient would be
            # float64 (in place it is rounded back: these are its bits)
            if _flat.per_leaf(leaves, hyper=(max_norm,)):  # [Note: differentiable pure mode] in _flat.py
                scaled = [torch.mul(t, coef) for t in leaves]
            else:
                scaled = torch._foreach_mul(leaves, coef)
            leaves = [s if s.dtype == t.dtype else s.to(t.dtype) for s, t in zip(scaled, leaves)]
        return _tree.unflatten(treedef, leaves), state

    return GradientTransformation(init, update)
