"""PartitionSpec and the block arithmetic of sharded tensors.

A spec has one entry per tensor dim: `None` (not split), an axis name, or a tuple of
names (split over the product of those axes, the first one major), as in JAX. Trailing
dims default to `None`. Blocks follow `torch.chunk`: a dim of size n split k ways has
blocks of `ceil(n / k)` rows, and the trailing blocks may be shorter or empty.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ._errors import SpecError, bullet_list

__all__ = [
    "PartitionSpec",
    "P",
    "is_spec",
    "as_spec",
    "chunk_bounds",
    "normalize_entry",
    "validate_spec",
    "local_shape",
    "local_block",
]


class PartitionSpec(tuple):
    """How a tensor's dims map to mesh axes, with `jax.sharding.PartitionSpec`'s meaning.

    A plain `tuple` subclass so that optree treats it as a leaf of spec trees.

    Example:
      >>> import shardfn as sf
      >>> sf.P("data", None)
      P('data', None)
      >>> sf.P(("replica", "shard")).axes
      ('replica', 'shard')
    """

    def __new__(cls, *entries):
        return super().__new__(cls, tuple(normalize_entry(e) for e in entries))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def __reduce__(self):
        return (PartitionSpec, tuple(self))

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec names, in order of appearance."""
        out: list[str] = []
        for entry in self:
            out.extend(entry_axes(entry))
        return tuple(out)


P = PartitionSpec


def is_spec(x) -> bool:
    """Whether `x` is a leaf of a spec tree: a PartitionSpec, or None (= `P()`, replicated)."""
    return isinstance(x, PartitionSpec) or x is None


def as_spec(x, where: str = "spec") -> PartitionSpec:
    """`x` as a PartitionSpec (None becomes `P()`); SpecError naming `where` otherwise."""
    if x is None:
        return PartitionSpec()
    if not isinstance(x, PartitionSpec):
        raise SpecError(
            f"{where}: expected a PartitionSpec (sf.P(...)) or None, got {type(x).__name__} {x!r:.60}.\n"
            f"Fix: wrap axis names in sf.P, e.g. sf.P('data') instead of 'data', sf.P() for replicated."
        )
    return x


def normalize_entry(entry):
    """`None`, a name, or a tuple of names; `()` and 1-tuples are kept as written."""
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise SpecError(
        f"a PartitionSpec entry must be None, an axis name or a tuple of axis names; got {entry!r}.\n"
        f"Fix: e.g. P('data', None) or P(('replica', 'shard'))."
    )


def entry_axes(entry) -> tuple[str, ...]:
    """The axis names of one spec entry, major first."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def validate_spec(spec, shape: Sequence[int], mesh_shape: Mapping[str, int], where: str) -> None:
    """Check a spec against a tensor shape and a mesh; raise SpecError naming `where`.

    Collects every problem and reports them as a bulleted list.
    """
    if not isinstance(spec, PartitionSpec):
        raise SpecError(
            f"{where}: expected a PartitionSpec (sf.P(...)) or None, got {type(spec).__name__} {spec!r}.\n"
            f"Fix: wrap the entries, e.g. sf.P{tuple(spec) if isinstance(spec, (tuple, list)) else ('data',)!r}."
        )
    problems = []
    if len(spec) > len(shape):
        problems.append(
            f"the spec {spec!r} has {len(spec)} entries but the tensor has rank {len(shape)} "
            f"(shape {tuple(shape)}); fix: drop the extra entries, e.g. P{tuple(spec)[: len(shape)]!r}"
        )
    seen: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        for axis in entry_axes(entry):
            if axis not in mesh_shape:
                problems.append(
                    f"dim {dim} names axis {axis!r}, which is not a mesh axis; the mesh has axes "
                    f"{list(mesh_shape)} (sizes {dict(mesh_shape)})"
                )
            elif axis in seen:
                problems.append(
                    f"axis {axis!r} is used twice (dims {seen[axis]} and {dim}); an axis may shard one dim only"
                )
            else:
                seen[axis] = dim
    if problems:
        raise SpecError(f"{where}: invalid partition spec {spec!r} for shape {tuple(shape)}:\n{bullet_list(problems)}")


def chunk_size(n: int, k: int) -> int:
    """Rows per block when a dim of size n is split k ways, `torch.chunk` style."""
    return math.ceil(n / k) if n > 0 else 0


def chunk_bounds(n: int, k: int, index: int) -> tuple[int, int]:
    """`(start, stop)` of block `index` of k blocks of a dim of size n (torch.chunk rules)."""
    c = chunk_size(n, k)
    start = min(index * c, n)
    return start, min(start + c, n)


def block_index(entry, coords: Mapping[str, int], mesh_shape: Mapping[str, int]) -> tuple[int, int]:
    """`(index, count)`: which of how many blocks of a dim this rank holds under `entry`."""
    index, count = 0, 1
    for axis in entry_axes(entry):
        index = index * mesh_shape[axis] + coords[axis]
        count *= mesh_shape[axis]
    return index, count


def local_shape(global_shape: Sequence[int], spec, coords, mesh_shape) -> tuple[int, ...]:
    """Shape of this rank's block of a tensor of `global_shape` under `spec`."""
    shape = list(global_shape)
    for dim, entry in enumerate(spec):
        index, count = block_index(entry, coords, mesh_shape)
        start, stop = chunk_bounds(shape[dim], count, index)
        shape[dim] = stop - start
    return tuple(shape)


def local_block(x, spec, coords, mesh_shape, offset: int = 0):
    """The block of a global tensor `x` at mesh `coords` under `spec` (a view, `torch.chunk`
    rules); `offset` shifts the spec's dims right (leading batch dims, e.g. under vmap)."""
    for dim, entry in enumerate(spec):
        if not entry_axes(entry):
            continue
        index, count = block_index(entry, coords, mesh_shape)
        start, stop = chunk_bounds(x.shape[dim + offset], count, index)
        x = x.narrow(dim + offset, start, stop - start)
    return x
