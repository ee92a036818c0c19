"""Global tensors <-> per-rank blocks, by shardfn's layout rules, for tests and references.

Ranks are row-major over the mesh axes; a spec entry naming a tuple of axes splits a dim
over their product (first axis major); blocks follow `torch.chunk` (trailing blocks
shorter or empty); an axis an out spec omits means "replicated", and `join_blocks` takes
the value of the ranks at coordinate 0 on it (checking, by default, that the others agree).
It shares shardfn's spec arithmetic (`_spec.py`) and rank layout (`rank_coords`) but none
of its collectives, on purpose: tests compare the blocks it builds with the ones the
backends move.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import optree
import torch

from .._backend.base import rank_coords
from .._spec import PartitionSpec, as_spec, block_index, entry_axes, is_spec, local_block

__all__ = [
    "ReferenceCheckError",
    "rank_coords",
    "split_blocks",
    "join_blocks",
    "split_tree",
    "join_tree",
    "local_blocks",
]


class ReferenceCheckError(AssertionError):
    """The program is not a valid SPMD program (ranks disagree, a shape does not fit, ...)."""


def _shape(mesh_shape) -> dict[str, int]:
    return dict(mesh_shape.shape if hasattr(mesh_shape, "shape") and not isinstance(mesh_shape, Mapping)
                else mesh_shape)


# -- global <-> blocks -----------------------------------------------------------------


def _check_spec(spec: PartitionSpec, ndim: int, mesh_shape) -> None:
    if len(spec) > ndim:
        raise ReferenceCheckError(f"spec {spec!r} is longer than the tensor rank {ndim}")
    for axis in spec.axes:
        if axis not in mesh_shape:
            raise ReferenceCheckError(f"spec {spec!r} names {axis!r}, not an axis of {list(mesh_shape)}")
    if len(set(spec.axes)) != len(spec.axes):
        raise ReferenceCheckError(f"spec {spec!r} uses an axis twice")


def split_blocks(x: torch.Tensor, spec, mesh_shape) -> list[torch.Tensor]:
    """Every rank's block of the global `x` under `spec`, in rank order (differentiable views)."""
    mesh_shape, spec = _shape(mesh_shape), as_spec(spec)
    _check_spec(spec, x.dim(), mesh_shape)
    n = math.prod(mesh_shape.values())
    return [local_block(x, spec, rank_coords(r, mesh_shape), mesh_shape) for r in range(n)]


def local_blocks(tree, specs, mesh) -> Any:
    """Inside a rank of `mesh`: this rank's blocks of the global tensors of `tree`."""
    return split_tree(tree, specs, mesh.shape)[mesh.rank]


def _plain(t: torch.Tensor) -> bool:
    return not torch._C._functorch.is_functorch_wrapped_tensor(t)


def join_blocks(blocks: Sequence[torch.Tensor], spec, mesh_shape, *, check: bool = True,
                rtol: float = 1e-6, atol: float = 1e-6, where: str = "output") -> torch.Tensor:
    """The global tensor whose blocks under `spec` are `blocks` (one per rank, rank order).

    Along an axis the spec omits, the value of the ranks at coordinate 0 is taken; with
    `check`, every other rank's block must agree with it (skipped for functorch-wrapped
    tensors, whose values cannot be compared here).
    """
    mesh_shape, spec = _shape(mesh_shape), as_spec(spec)
    omitted = [a for a in mesh_shape if a not in spec.axes]
    sharded = [(d, e) for d, e in enumerate(spec) if entry_axes(e)]
    by_key: dict[tuple, torch.Tensor] = {}
    for rank, block in enumerate(blocks):
        coords = rank_coords(rank, mesh_shape)
        key = tuple(block_index(e, coords, mesh_shape)[0] for _, e in sharded)
        if all(coords[a] == 0 for a in omitted):
            by_key[key] = block
    if check:
        for rank, block in enumerate(blocks):
            coords = rank_coords(rank, mesh_shape)
            key = tuple(block_index(e, coords, mesh_shape)[0] for _, e in sharded)
            rep = by_key[key]
            if block is rep or not (_plain(block) and _plain(rep)):
                continue
            same = block.shape == rep.shape and torch.allclose(
                block.detach(), rep.detach(), rtol=rtol, atol=atol, equal_nan=True)
            if not same:
                raise ReferenceCheckError(
                    f"{where}: the out spec {spec!r} omits axes {omitted}, but rank {rank} "
                    f"(coords {coords}) holds a different value than its replica at coordinate 0"
                )
    counts = [block_index(e, rank_coords(0, mesh_shape), mesh_shape)[1] for _, e in sharded]

    def build(prefix: tuple) -> torch.Tensor:
        depth = len(prefix)
        if depth == len(sharded):
            return by_key[prefix]
        parts = [build(prefix + (i,)) for i in range(counts[depth])]
        return torch.cat(parts, sharded[depth][0])

    return build(())


def _spec_leaves(specs, tree) -> list[PartitionSpec]:
    from .._tree import broadcast_prefix

    return [as_spec(s) for s in broadcast_prefix(specs, tree, what="specs", is_prefix_leaf=is_spec)]


def split_tree(tree, specs, mesh_shape) -> list:
    """`split_blocks` over a pytree with a spec prefix tree: one tree of blocks per rank."""
    mesh_shape = _shape(mesh_shape)
    leaves, treedef = optree.tree_flatten(tree, namespace="shardfn")
    spec_leaves = _spec_leaves(specs, tree)
    n = math.prod(mesh_shape.values())
    per_leaf = [split_blocks(x, s, mesh_shape) if isinstance(x, torch.Tensor) else [x] * n
                for x, s in zip(leaves, spec_leaves)]
    return [optree.tree_unflatten(treedef, [p[r] for p in per_leaf]) for r in range(n)]


def join_tree(trees: Sequence, specs, mesh_shape, *, check: bool = True, rtol: float = 1e-6,
              atol: float = 1e-6):
    """`join_blocks` over per-rank pytrees (same structure) with a spec prefix tree."""
    mesh_shape = _shape(mesh_shape)
    paths, leaves0, treedef = optree.tree_flatten_with_path(trees[0], namespace="shardfn")
    spec_leaves = _spec_leaves(specs, trees[0])
    per_rank = []
    for r, tree in enumerate(trees):
        leaves, td = optree.tree_flatten(tree, namespace="shardfn")
        if td != treedef:
            raise ReferenceCheckError(f"rank {r} returned a tree of structure {td}, rank 0 returned {treedef}")
        per_rank.append(leaves)
    out = []
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves0, spec_leaves)):
        if isinstance(leaf, torch.Tensor):
            where = "output" + "".join(f"[{k!r}]" for k in path)
            out.append(join_blocks([leaves[i] for leaves in per_rank], spec, mesh_shape, check=check,
                                   rtol=rtol, atol=atol, where=where))
        else:
            out.append(leaf)
    return optree.tree_unflatten(treedef, out)
