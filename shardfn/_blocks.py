"""Local blocks <-> global tensors on a mesh, and the checks on what crosses that edge.

The layer under `shard_map`, `scatter` / `gather`, their global mode (`_global.py`) and
`shard`: slicing this rank's block out of a global tensor, all-gathering the blocks back
into the global tensor, and checking that a tensor can be moved by a mesh's collectives.
The spec arithmetic itself (`chunk_bounds`, `block_index`, `local_block`) is in `_spec.py`.
"""

from __future__ import annotations

import torch

from ._backend import ops
from ._errors import SpecError, bullet_list
from ._spec import PartitionSpec, as_spec, chunk_bounds, chunk_size, entry_axes, local_block, validate_spec

__all__ = ["slice_block", "gather_blocks", "check_tensor", "checked_spec", "check_no_empty_blocks"]


def slice_block(x: torch.Tensor, spec: PartitionSpec, mesh, offset: int = 0) -> torch.Tensor:
    """This rank's block of a global `x` (a view); dims shifted by `offset` (vmap)."""
    return local_block(x, spec, mesh.coords, mesh.shape, offset)


def gather_blocks(x: torch.Tensor, spec: PartitionSpec, mesh, offset: int = 0) -> torch.Tensor:
    """Global tensor from this rank's block: per sharded dim, pad to the chunk size,
    all-gather, trim. Uneven blocks must follow `torch.chunk` (checked)."""
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        if not axes:
            continue
        d = dim + offset
        group = mesh.group(axes)
        k = group.size
        sizes = ops.all_gather(group, torch.tensor([x.shape[d]], device=x.device)).tolist()
        n = sum(sizes)
        c = chunk_size(n, k)
        expected = [chunk_bounds(n, k, i)[1] - chunk_bounds(n, k, i)[0] for i in range(k)]
        if sizes != expected:
            raise SpecError(
                f"gather: the blocks along dim {dim} over axes {axes} have sizes {sizes}, which is not "
                f"the torch.chunk layout {expected} of a dim of size {n} split {k} ways.\nFix: produce "
                f"blocks with sf.scatter (or torch.chunk), or re-chunk before gathering."
            )
        padded = torch.nn.functional.pad(x.movedim(d, -1), (0, c - x.shape[d])).movedim(-1, d)
        x = ops.all_gather(group, padded, d).narrow(d, 0, n)
    return x


def check_tensor(x, mesh, where: str, communicates: bool = True) -> None:
    """SpecError unless `x` is a tensor a collective on this mesh can move."""
    if not isinstance(x, torch.Tensor):
        raise SpecError(f"{where}: expected a torch.Tensor, got {type(x).__name__} {x!r:.60}")
    if communicates and x.device.type != mesh.device.type:
        raise SpecError(
            f"{where}: the tensor is on {x.device}, but this mesh's ranks communicate tensors on "
            f"{mesh.device.type} ({mesh.kind} mesh).\nFix: move it with .to(mesh.device)."
        )


def checked_spec(x: torch.Tensor, mesh, spec, where: str, communicates: bool = True) -> PartitionSpec:
    """`spec` as a PartitionSpec, checked against the tensor `x` and the mesh."""
    check_tensor(x, mesh, where, communicates)
    spec = as_spec(spec)
    validate_spec(spec, tuple(x.shape), mesh.shape, where)
    return spec


def check_no_empty_blocks(shape: tuple[int, ...], spec: PartitionSpec, mesh_shape, where: str) -> None:
    """SpecError if splitting `shape` by `spec` leaves some ranks zero rows of a dim while
    others hold rows (torch.chunk: 6 rows over 4 ranks are 2, 2, 2, 0). The answer depends
    only on the global shape, so every rank raises it, or none."""
    problems, fixes = [], []
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        if not axes or dim >= len(shape) or shape[dim] == 0:
            continue
        n, k = shape[dim], 1
        for axis in axes:
            k *= mesh_shape[axis]
        rows = [chunk_bounds(n, k, i)[1] - chunk_bounds(n, k, i)[0] for i in range(k)]
        if 0 in rows:
            named = " x ".join(f"{a!r} (size {mesh_shape[a]})" for a in axes)
            empty = rows.count(0)
            problems.append(
                f"dim {dim} (size {n}) over {named}: torch.chunk blocks of ceil({n} / {k}) = {chunk_size(n, k)} "
                f"rows give the {k} ranks {rows} rows; the last {empty} get none"
            )
            multiple = -(-n // k) * k
            fixes.append(f"dim {dim}: a size divisible by {k} (pad to {multiple}, or drop to {n // k * k})")
    if problems:
        raise SpecError(
            f"{where}: splitting a tensor of shape {tuple(shape)} by {spec!r} leaves some ranks empty blocks "
            f"while others hold rows:\n{bullet_list(problems)}\nAn empty block is an empty batch on that rank "
            f"(a NaN mean loss; under sf.shard an unequal batch).\nFix: {'; '.join(fixes)}; or pass "
            f"allow_empty=True to keep torch.chunk's layout with its empty blocks."
        )
