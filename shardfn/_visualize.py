"""`visualize_sharding`: a text picture of which rank holds which block of a tensor.

The counterpart of `jax.debug.visualize_array_sharding`, for a global shape, a mesh and a
PartitionSpec. Blocks follow `torch.chunk` (the same arithmetic as `sf.scatter` and
`sf.shard`), so uneven and empty trailing blocks are drawn as they are.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ._backend.base import rank_coords
from ._errors import SpecError
from ._spec import PartitionSpec, block_index, chunk_bounds, validate_spec

__all__ = ["visualize_sharding"]


def _mesh_shape(mesh) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return dict(mesh)
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping):
        return dict(shape)
    raise SpecError(
        f"visualize_sharding: mesh must be an sf.Mesh or its shape as a dict like {{'data': 4}}, got "
        f"{type(mesh).__name__} {mesh!r}"
    )


def _tensor_shape(x) -> tuple[int, ...]:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, int):
        return (x,)
    if isinstance(x, Sequence) and all(isinstance(d, int) and d >= 0 for d in x):
        return tuple(x)
    raise SpecError(
        f"visualize_sharding: expected a tensor or a shape (a tuple of non-negative ints), got "
        f"{type(x).__name__} {x!r}"
    )


def _ranks_label(ranks: list[int]) -> str:
    """'rank 2', 'ranks 0,2' or 'ranks 0-3' (runs of three or more are ranges)."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(parts)


def _grid(cells: list[list[list[str]]]) -> list[str]:
    """Box-drawing grid of equal-width cells; each cell is a list of centered lines."""
    width = max(len(line) for row in cells for cell in row for line in cell) + 2
    height = max(len(cell) for row in cells for cell in row)
    ncols = len(cells[0])
    rule = lambda left, mid, right: left + mid.join("─" * width for _ in range(ncols)) + right  # noqa: E731
    lines = [rule("┌", "┬", "┐")]
    for r, row in enumerate(cells):
        for k in range(height):
            lines.append("│" + "│".join((cell[k] if k < len(cell) else "").center(width) for cell in row) + "│")
        lines.append(rule("├", "┼", "┤") if r + 1 < len(cells) else rule("└", "┴", "┘"))
    return lines


def visualize_sharding(x, mesh, spec: PartitionSpec | None = None, *, show: bool = False) -> str:
    """Draw which ranks hold which block of a 1-D or 2-D tensor sharded by `spec`.

    Each cell is one block: the ranks holding it (several when the spec leaves a mesh
    axis out, i.e. the block is replicated over it) and the global index range it covers
    (`torch.chunk` blocks, so trailing blocks may be shorter or empty).

    Args:
      x: a tensor (only its shape is used) or a shape such as `(8, 6)`.
      mesh: an `sf.Mesh`, or just its shape as a dict (`{"data": 2, "model": 2}`).
      spec: an `sf.P(...)` for the tensor's dims (None = replicated everywhere).
      show: also print the picture.

    Returns:
      The picture, as a string (a header line, then a box per block).

    Raises:
      SpecError: the spec does not fit the shape or the mesh, or the tensor is not 1-D or 2-D.

    Example:
      >>> import shardfn as sf
      >>> print(sf.visualize_sharding((8, 6), {"data": 2, "model": 2}, sf.P("data", "model")))
      (8, 6) P('data', 'model') on mesh {'data': 2, 'model': 2}
      ┌────────────┬────────────┐
      │   rank 0   │   rank 1   │
      │ [0:4, 0:3] │ [0:4, 3:6] │
      ├────────────┼────────────┤
      │   rank 2   │   rank 3   │
      │ [4:8, 0:3] │ [4:8, 3:6] │
      └────────────┴────────────┘
      >>> _ = sf.visualize_sharding((10,), {"data": 4}, sf.P("data"), show=True)
      (10,) P('data') on mesh {'data': 4}
      ┌────────┬────────┬────────┬────────┐
      │ rank 0 │ rank 1 │ rank 2 │ rank 3 │
      │ [0:3]  │ [3:6]  │ [6:9]  │ [9:10] │
      └────────┴────────┴────────┴────────┘
      >>> print(sf.visualize_sharding((6, 4), {"data": 2, "model": 2}, sf.P(None, "model")))
      (6, 4) P(None, 'model') on mesh {'data': 2, 'model': 2}
      ┌────────────┬────────────┐
      │ ranks 0,2  │ ranks 1,3  │
      │ [0:6, 0:2] │ [0:6, 2:4] │
      └────────────┴────────────┘
    """
    shape = _tensor_shape(x)
    mesh_shape = _mesh_shape(mesh)
    spec = PartitionSpec() if spec is None else spec
    validate_spec(spec, shape, mesh_shape, "visualize_sharding")
    if len(shape) not in (1, 2):
        raise SpecError(
            f"visualize_sharding: draws 1-D and 2-D tensors; got shape {shape} (rank {len(shape)}).\n"
            f"Fix: visualize a 2-D view, e.g. the first two dims: ({', '.join(map(str, shape[:2]))})."
        )
    entries = list(spec) + [None] * (len(shape) - len(spec))
    counts = [block_index(e, rank_coords(0, mesh_shape), mesh_shape)[1] for e in entries]
    holders: dict[tuple[int, ...], list[int]] = {}
    size = 1
    for n in mesh_shape.values():
        size *= n
    for rank in range(size):
        coords = rank_coords(rank, mesh_shape)
        key = tuple(block_index(e, coords, mesh_shape)[0] for e in entries)
        holders.setdefault(key, []).append(rank)

    def cell(key: tuple[int, ...]) -> list[str]:
        bounds = [chunk_bounds(shape[d], counts[d], key[d]) for d in range(len(shape))]
        extent = "[" + ", ".join(f"{a}:{b}" for a, b in bounds) + "]"
        empty = any(a == b for a, b in bounds)
        return [_ranks_label(holders[key]), extent + (" empty" if empty else "")]

    rows = counts[0] if len(shape) == 2 else 1
    cols = counts[-1]
    if len(shape) == 2:
        cells = [[cell((i, j)) for j in range(cols)] for i in range(rows)]
    else:
        cells = [[cell((j,)) for j in range(cols)]]
    picture = "\n".join([f"{shape} {spec!r} on mesh {mesh_shape}"] + _grid(cells))
    if show:
        print(picture)
    return picture
