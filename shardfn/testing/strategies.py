"""Hypothesis strategies for shardfn: meshes, specs, shapes and collective programs.

Everything stays small (at most 4 ranks, blocks of at most 3 rows per dim), because every
example runs real collectives on a simulated mesh.

Example:
  >>> from hypothesis import given
  >>> from shardfn.testing import strategies as sfst
  >>> @given(sfst.collective_cases())
  ... def test_case(case):
  ...     f = case.program()  # a program written against shardfn.testing C
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import torch
from hypothesis import strategies as st

from .._spec import PartitionSpec
from ._reference import C

__all__ = [
    "MESH_SHAPES",
    "mesh_shapes",
    "axis_names",
    "partition_specs",
    "global_shapes",
    "CollectiveCase",
    "COLLECTIVES",
    "collective_cases",
    "make_case",
]

MESH_SHAPES: tuple[dict[str, int], ...] = (
    {"x": 1},
    {"x": 2},
    {"x": 3},
    {"x": 4},
    {"x": 2, "y": 2},
    {"x": 1, "y": 2},
    {"x": 2, "y": 1},
)


def mesh_shapes(max_ranks: int = 4, min_ranks: int = 1, two_d: bool = True) -> st.SearchStrategy:
    """Mesh shapes (dicts) of 1 or 2 axes named 'x' and 'y', with at most `max_ranks` ranks."""
    pool = [s for s in MESH_SHAPES
            if min_ranks <= math.prod(s.values()) <= max_ranks and (two_d or len(s) == 1)]
    return st.sampled_from(pool)


@st.composite
def axis_names(draw, mesh_shape: Mapping[str, int], min_size: int = 1):
    """A collective's `axis`: one name, or a tuple of distinct names in any order."""
    names = list(mesh_shape)
    chosen = draw(st.permutations(names))
    n = draw(st.integers(min_size, len(names)))
    axes = tuple(chosen[:n])
    if len(axes) == 1 and draw(st.booleans()):
        return axes[0]
    return axes


def _as_tuple(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


@st.composite
def partition_specs(draw, ndim: int, mesh_shape: Mapping[str, int], allowed=None, max_len=None):
    """A valid spec for a tensor of rank `ndim`: each mesh axis on at most one dim.

    Entries are None, a name, or a tuple of names in any order; trailing Nones are
    sometimes dropped (they are the default).
    """
    allowed = list(mesh_shape) if allowed is None else list(allowed)
    entries: list[list[str]] = [[] for _ in range(ndim)]
    if ndim:
        for axis in draw(st.permutations(allowed)):
            dim = draw(st.integers(-1, ndim - 1))
            if dim >= 0:
                entries[dim].append(axis)
    out = []
    for axes in entries:
        if not axes:
            out.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            out.append(axes[0])
        else:
            out.append(tuple(axes))
    keep = len(out)
    while keep and out[keep - 1] is None and draw(st.booleans()):
        keep -= 1
    if max_len is not None:
        keep = min(keep, max_len)
    return PartitionSpec(*out[:keep])


def _count(entry, mesh_shape) -> int:
    if entry is None:
        return 1
    return math.prod(mesh_shape[a] for a in _as_tuple(entry))


@st.composite
def global_shapes(draw, spec: PartitionSpec, ndim: int, mesh_shape: Mapping[str, int], *,
                  even: bool = True, max_block: int = 3, block_shape=None):
    """A global shape fitting `spec`: each sharded dim is `count * block` when `even`,
    else any size up to `count * max_block` (uneven `torch.chunk` blocks, empty ones too).
    `block_shape` fixes the local block shape (even sharding only)."""
    shape = []
    for d in range(ndim):
        entry = spec[d] if d < len(spec) else None
        k = _count(entry, mesh_shape)
        if block_shape is not None:
            shape.append(block_shape[d] * k)
        elif even or k == 1:
            shape.append(draw(st.integers(1, max_block)) * k)
        else:
            shape.append(draw(st.integers(0, max_block * k)))
    return tuple(shape)


# -- collective programs -----------------------------------------------------------------

COLLECTIVES = (
    "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all",
    "axis_index", "reduce_psum", "local",
)


@dataclasses.dataclass(frozen=True)
class CollectiveCase:
    """One collective inside a tiny shard_map program, with specs that fit it.

    The program is `x -> z + z**2 / 2` with `z = op(tanh(x)).unsqueeze(0)`: smooth on both
    sides of the collective, so values, gradients and tangents all exercise it. Outputs
    get a leading unit dim so that every axis the result varies over has a dim to live on.
    """

    mesh_shape: dict
    op: str
    axis: Any  # a name or tuple of names
    kwargs: dict
    in_spec: PartitionSpec
    out_spec: PartitionSpec
    global_shape: tuple

    @property
    def axes(self) -> tuple[str, ...]:
        return _as_tuple(self.axis)

    def program(self) -> Callable:
        op, axis, kw = self.op, self.axis, dict(self.kwargs)

        def f(x):
            h = torch.tanh(x)
            if op in ("psum", "pmean", "pmax", "pmin"):
                y = getattr(C, op)(h, axis)
            elif op == "all_gather":
                y = C.all_gather(h, axis, **kw)
            elif op == "psum_scatter":
                y = C.psum_scatter(h, axis, **kw)
            elif op == "ppermute":
                y = C.ppermute(h, axis, kw["perm"])
            elif op == "all_to_all":
                y = C.all_to_all(h, axis, **kw)
            elif op == "axis_index":
                y = h * (C.axis_index(axis) + 1.0) / C.axis_size(axis)
            elif op == "reduce_psum":
                y = C.psum((h * h).sum(0), axis)
            elif op == "local":
                y = 2.0 * h
            else:  # pragma: no cover
                raise ValueError(op)
            z = y.unsqueeze(0)
            return z + 0.5 * z * z

        f.__name__ = f"prog_{op}"
        return f

    def __repr__(self) -> str:
        kw = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return (f"CollectiveCase({self.op}(axis={self.axis!r}{', ' + kw if kw else ''}) on {self.mesh_shape}, "
                f"x{self.global_shape} in {self.in_spec!r} -> out {self.out_spec!r})")

    @property
    def id(self) -> str:
        kw = ",".join(f"{k}={v}" for k, v in self.kwargs.items() if k != "perm")
        mesh = "x".join(str(v) for v in self.mesh_shape.values())
        return f"{self.op}[{'+'.join(self.axes)}{',' + kw if kw else ''}]@{mesh}"


def _out_local_shape(op: str, shape: tuple, kw: dict, k: int) -> tuple:
    shape = list(shape)
    if op == "all_gather":
        d = kw["dim"]
        if kw["tiled"]:
            shape[d] *= k
        else:
            shape.insert(d, k)
    elif op == "psum_scatter":
        d = kw["dim"]
        if kw["tiled"]:
            shape[d] //= k
        else:
            del shape[d]
    elif op == "all_to_all":
        s, c = kw["split_dim"], kw["concat_dim"]
        if kw["tiled"]:
            shape[s] //= k
            shape[c] *= k
        else:
            del shape[s]
            shape.insert(c, k)
    elif op == "reduce_psum":
        shape = shape[1:]
    return tuple(shape)


def _varying_after(op: str, varying: set, axes: tuple) -> set:
    if op in ("psum", "pmean", "pmax", "pmin", "all_gather", "reduce_psum"):
        return varying - set(axes)
    if op in ("psum_scatter", "ppermute", "all_to_all", "axis_index"):
        return varying | set(axes)
    return set(varying)


@st.composite
def _out_spec(draw, out_ndim: int, mesh_shape, varying: set, pinned: PartitionSpec | None):
    """An out spec for a (1, *y.shape) output naming every axis in `varying`.

    `pinned` (for uneven outputs) fixes the entries of dims 1.. to the input's layout, so
    only dim 0 takes the other axes."""
    extra = [a for a in mesh_shape if a not in varying]
    names = sorted(varying) + [a for a in extra if draw(st.booleans())]
    if pinned is not None:
        names = [a for a in names if a not in pinned.axes]
        order = draw(st.permutations(names))
        return PartitionSpec(tuple(order) if order else None, *pinned)
    entries: list[list[str]] = [[] for _ in range(out_ndim)]
    for axis in draw(st.permutations(names)):
        entries[draw(st.integers(0, out_ndim - 1))].append(axis)
    return PartitionSpec(*[tuple(e) if e else None for e in entries])


@st.composite
def collective_cases(draw, mesh_shape=None, ops=COLLECTIVES):
    """A `CollectiveCase`: a mesh, one collective with valid arguments, specs and a shape."""
    mesh_shape = dict(draw(mesh_shapes()) if mesh_shape is None else mesh_shape)
    op = draw(st.sampled_from(list(ops)))
    axis = draw(axis_names(mesh_shape))
    axes = _as_tuple(axis)
    k = math.prod(mesh_shape[a] for a in axes)
    kw: dict = {}
    min_ndim = 1 if op in ("all_gather", "psum_scatter", "all_to_all", "reduce_psum") else 0
    ndim = draw(st.integers(min_ndim, 3))
    block = [draw(st.integers(1, 3)) for _ in range(ndim)]
    if op == "all_gather":
        kw["tiled"] = draw(st.booleans())
        kw["dim"] = draw(st.integers(0, ndim - (1 if kw["tiled"] else 0)))
    elif op == "psum_scatter":
        kw["tiled"] = draw(st.booleans())
        kw["dim"] = draw(st.integers(0, ndim - 1))
        block[kw["dim"]] = k * draw(st.integers(1, 2)) if kw["tiled"] else k
    elif op == "all_to_all":
        kw["tiled"] = draw(st.booleans())
        kw["split_dim"] = draw(st.integers(0, ndim - 1))
        kw["concat_dim"] = draw(st.integers(0, ndim - 1))
        block[kw["split_dim"]] = k * draw(st.integers(1, 2)) if kw["tiled"] else k
    elif op == "ppermute":
        kw["perm"] = draw(permutations_of(k))
    # negative dims, sometimes, for the ops that take them
    for key in ("dim", "split_dim", "concat_dim"):
        if key in kw and draw(st.booleans()):
            rank = ndim + (1 if op == "all_gather" and not kw["tiled"] else 0)
            kw[key] = kw[key] - rank
    uneven = op in ("reduce_psum", "local")
    if op == "reduce_psum":
        entry = axis if len(axes) > 1 or draw(st.booleans()) else axes[0]
        in_spec = PartitionSpec(entry, *([None] * draw(st.integers(0, ndim - 1))))
        shape = tuple([draw(st.integers(0, 3 * k))] + block[1:])
    else:
        in_spec = draw(partition_specs(ndim, mesh_shape))
        shape = draw(global_shapes(in_spec, ndim, mesh_shape, even=not uneven,
                                   block_shape=None if uneven else block))
    varying = _varying_after(op, set(in_spec.axes), axes)
    if uneven:
        pinned = PartitionSpec(*[in_spec[d] if d < len(in_spec) else None for d in range(ndim)])
        pinned = pinned[1:] if op == "reduce_psum" else pinned
        out_spec = draw(_out_spec(0, mesh_shape, varying, PartitionSpec(*pinned)))
    else:
        norm = {key: (v % (ndim + (1 if op == "all_gather" and not kw["tiled"] else 0)))
                for key, v in kw.items() if key in ("dim", "split_dim", "concat_dim")}
        out_shape = _out_local_shape(op, tuple(block), {**kw, **norm}, k)
        out_spec = draw(_out_spec(len(out_shape) + 1, mesh_shape, varying, None))
    return CollectiveCase(mesh_shape, op, axis, kw, in_spec, out_spec, shape)


@st.composite
def permutations_of(draw, k: int):
    """A (possibly partial) permutation of 0..k-1 as `ppermute` pairs."""
    targets = draw(st.permutations(range(k)))
    pairs = [(i, t) for i, t in enumerate(targets)]
    keep = draw(st.lists(st.booleans(), min_size=k, max_size=k))
    if any(keep) and not all(keep) and draw(st.booleans()):
        pairs = [p for p, kp in zip(pairs, keep) if kp]
    return tuple(pairs)


def make_case(mesh_shape, op, axis, in_spec, out_spec, global_shape, **kwargs) -> CollectiveCase:
    """A hand-written `CollectiveCase` (for parametrized tests)."""
    return CollectiveCase(dict(mesh_shape), op, axis, kwargs, in_spec, out_spec, tuple(global_shape))
