"""The layout plan of `shard`: units, per-leaf chunks, and the flat communication buffers.

Layout = FSDP2's: each sharded leaf is split on dim 0 with `torch.chunk` over the shard
group, so rank i holds rows [i*c, min((i+1)*c, n)) with c = ceil(n / k). A unit's leaves
travel together in one flat buffer per collective:

  shard buffer (S,)          = [leaf_0 chunk padded to c_0 rows | leaf_1 chunk padded | ...]
  gathered buffer (k, S)     = every rank's shard buffer, rank-major (all-gather output)
  unsharded buffer (k*S,)    = [leaf_0 padded to k*c_0 rows | leaf_1 ... ] (leaf-major),
                               so each full leaf is a contiguous view of its first n_j rows.

Copy-in is one `torch.cat`, copy-out one `torch.split_with_sizes_copy` (the (k, S) ->
leaf-major transpose), and the gradient pack is the same transpose in reverse. Padding
lives only in these buffers; shards themselves are never padded.

Plans are built once per (tree structure, shapes, dtypes), complete and frozen: nothing
is set on a plan after `build_plan` returns, so the rank threads can share one.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Callable, Hashable

import torch

from .. import _tree
from .._backend import ops
from .._backend.base import coords_rank, rank_coords
from .._errors import ShardingError, SpecError, bullet_list
from .._spec import PartitionSpec, chunk_bounds

__all__ = ["LeafLayout", "UnitPlan", "Plan", "build_plan", "default_unit", "hpz_rows", "pack_shards", "in_unit_buffers", "unit_buffer_views", "packed_view", "pack_grads",
           "copy_out", "leaf_views", "unpack_shard_grads"]

ROOT = "<root>"


class FrozenKey(tuple):
    """Unit key of the frozen leaves of a unit: they travel in a unit of their own."""

    def __new__(cls, key):
        return super().__new__(cls, ("frozen", key))


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    index: int  # position in the flattened params
    path: tuple
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    sharded: bool  # False: every rank keeps the whole leaf (0-dim, non-float, or marked)
    rows: int = 0  # n: global dim-0 size
    row_numel: int = 1  # elements per dim-0 row
    chunk: int = 0  # c: rows per block (torch.chunk)
    offset: int = 0  # where this leaf's padded chunk starts in the shard buffer
    reduce_axes: tuple[str, ...] = ()  # non-data axes the leaf is replicated over: its gradient is psummed
    replica_axes: tuple[str, ...] = ()  # data axes, not shard axes, it is replicated over (HSDP): psummed too

    @property
    def chunk_numel(self) -> int:
        return self.chunk * self.row_numel

    def local_rows(self, index: int, k: int) -> int:
        start, stop = chunk_bounds(self.rows, k, index)
        return stop - start

    def local_shape(self, index: int, k: int) -> tuple[int, ...]:
        return (self.local_rows(index, k),) + self.shape[1:]


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    key: Hashable
    position: int  # order of definition (first leaf's position)
    sharded: tuple[LeafLayout, ...]
    replicated: tuple[LeafLayout, ...]
    k: int  # shard group size
    shard_numel: int  # S
    dtype: torch.dtype | None  # dtype of the sharded leaves (before mixed precision)
    frozen: bool = False  # gathered for the forward, never reduce-scattered, no gradient
    # (axes, start, stop): shard-buffer ranges whose reduced gradient is also psummed over
    # those non-data axes ([Note: FSDP x TP] in tp.py)
    regions: tuple[tuple[tuple[str, ...], int, int], ...] = ()
    # the same over the data axes that are not shard axes (HSDP's replicas; [Note: expert parallelism])
    replica_regions: tuple[tuple[tuple[str, ...], int, int], ...] = ()

    @property
    def is_root(self) -> bool:
        return self.key == ROOT or self.key == FrozenKey(ROOT)

    @property
    def full_numel(self) -> int:
        return self.k * self.shard_numel

    def name(self) -> str:
        return "root unit" if self.is_root else f"unit {self.key!r}"


@dataclasses.dataclass(frozen=True)
class Plan:
    treedef: Any
    leaves: tuple[LeafLayout, ...]
    units: tuple[UnitPlan, ...]
    unit_of: tuple[int, ...]  # leaf index -> unit index
    k: int  # shard group size
    tp_axes: tuple[str, ...] = ()  # the axes param_specs name (tensor parallelism), mesh order
    tp_specs: tuple[PartitionSpec, ...] = ()  # per leaf, its spec over tp_axes (all P() without TP)


def default_unit(paths: list[tuple]) -> Callable[[tuple], Hashable]:
    """Each element of the first list/tuple found in the tree is a unit; the rest is root."""
    prefix = None
    for path in paths:
        # The first position whose key is an int names a sequence node.
        for depth, key in enumerate(path):
            if isinstance(key, int):
                prefix = path[:depth]
                break
        if prefix is not None:
            break

    def unit_of(path: tuple):
        if prefix is not None and len(path) > len(prefix) and path[: len(prefix)] == prefix:
            return prefix + (path[len(prefix)],)
        return ROOT

    return unit_of


def _describe_leaf(path, leaf) -> str:
    return f"params{_tree.keystr(path)}"


def build_plan(params, k: int, units, replicated: Callable[[tuple], bool] | None,
               frozen: Callable[[tuple], bool] | None = None, *,
               tp_axes: tuple[str, ...] = (), tp_specs: list[PartitionSpec] | None = None,
               reduce_axes: list[tuple[str, ...]] | None = None,
               replica_axes: list[tuple[str, ...]] | None = None, allow_meta: bool = False) -> Plan:
    """Lay out `params` over a shard group of size k.

    `params` are the blocks that the shard group splits: the full leaves, or with
    tensor parallelism this rank's tensor-parallel blocks (`tp_specs[i]` is leaf i's spec
    over `tp_axes`). `replica_axes[i]` names the data axes that are not shard axes leaf i
    is replicated over, `reduce_axes[i]` the non-data axes leaf i is replicated over
    (its gradient is psummed over them); within a unit, leaves are ordered by it so that
    each set of axes is one contiguous range of the shard buffer (`UnitPlan.regions`).
    `allow_meta` accepts meta tensors (`init_shards` lays out a description, no data).
    """
    paths, leaves, treedef = _tree.flatten_with_paths(params)
    problems = []
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            problems.append(
                f"{_describe_leaf(path, leaf)} is a {type(leaf).__name__}, not a tensor; fix: make it a "
                f"tensor, or keep non-tensor settings out of the params tree (close over them)"
            )
        elif leaf.device.type == "meta" and not (allow_meta or ops.in_meta_run()):  # init_shards, sf.estimate
            problems.append(
                f"{_describe_leaf(path, leaf)} is on the meta device (it has no data to shard); fix: "
                f"materialize it first (e.g. module.to_empty(device=...) and initialize), or describe it with "
                f"sf.init (e.g. sf.init.from_module(module)) and call step.init_shards(description, seed)"
            )
        elif leaf.is_complex():
            problems.append(
                f"{_describe_leaf(path, leaf)} is complex ({leaf.dtype}); shardfn's collectives move real "
                f"dtypes: keep torch.view_as_real(p) in the tree"
            )
    if problems:
        raise ShardingError("shard: every leaf of params must be a tensor:\n" + bullet_list(problems))
    if not leaves:
        raise ShardingError("shard: params has no tensors to shard")
    unit_fn = units if units is not None else default_unit(list(paths))
    keys: dict[Hashable, int] = {}
    unit_of: list[int] = []
    members: list[list[tuple[int, tuple, torch.Tensor]]] = []
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        key = unit_fn(path)
        key = ROOT if key is None else key
        if frozen is not None and frozen(path):
            key = FrozenKey(key)
        if key not in keys:
            keys[key] = len(members)
            members.append([])
        members[keys[key]].append((i, path, leaf))
        unit_of.append(keys[key])
    layouts: list[LeafLayout | None] = [None] * len(leaves)
    unit_plans = []
    reduce_axes = reduce_axes or [()] * len(leaves)
    replica_axes = replica_axes or [()] * len(leaves)
    for position, (key, idx) in enumerate(keys.items()):
        sharded, repl, offset, dtypes = [], [], 0, set()
        # stable sort: each set of axes summed over after the reduce-scatter is one range
        for i, path, leaf in sorted(members[idx], key=lambda m: (replica_axes[m[0]], reduce_axes[m[0]])):
            axes, replicas = reduce_axes[i], replica_axes[i]
            is_float = leaf.is_floating_point() or leaf.is_complex()
            keep_whole = leaf.dim() == 0 or not is_float or (replicated is not None and replicated(path))
            if keep_whole:
                layout = LeafLayout(i, path, tuple(leaf.shape), leaf.dtype, sharded=False, reduce_axes=axes,
                                    replica_axes=replicas)
                repl.append(layout)
            else:
                n = leaf.shape[0]
                c = math.ceil(n / k) if n else 0
                row = math.prod(leaf.shape[1:])
                layout = LeafLayout(i, path, tuple(leaf.shape), leaf.dtype, True, n, row, c, offset, axes, replicas)
                offset += c * row
                sharded.append(layout)
                dtypes.add(leaf.dtype)
            layouts[i] = layout
        if len(dtypes) > 1:
            listing = ", ".join(f"params{_tree.keystr(l.path)}: {l.dtype}" for l in sharded)
            raise SpecError(
                f"shard: the leaves of unit {key!r} have different dtypes ({listing}); a unit travels in "
                f"one flat buffer of one dtype.\nFix: cast them to one dtype, set "
                f"mixed_precision=sf.MixedPrecision(param_dtype=...), or split them with units=."
            )
        unit_plans.append(
            UnitPlan(key, position, tuple(sharded), tuple(repl), k, offset, next(iter(dtypes), None),
                     isinstance(key, FrozenKey), _regions(sharded, "reduce_axes"), _regions(sharded, "replica_axes"))
        )
    tp_specs = tuple(tp_specs) if tp_specs is not None else (PartitionSpec(),) * len(leaves)
    return Plan(treedef, tuple(layouts), tuple(unit_plans), tuple(unit_of), k, tuple(tp_axes), tp_specs)


def _regions(sharded: list[LeafLayout], field: str) -> tuple[tuple[tuple[str, ...], int, int], ...]:
    """Contiguous shard-buffer ranges of the leaves with the same (non-empty) axes `field`;
    ranges of neighbouring leaves with the same axes merge (padding included)."""
    out: list[tuple[tuple[str, ...], int, int]] = []
    for layout in sharded:
        axes = getattr(layout, field)
        if not axes:
            continue
        stop = layout.offset + layout.chunk_numel
        if out and out[-1][0] == axes and out[-1][2] == layout.offset:
            out[-1] = (axes, out[-1][1], stop)
        else:
            out.append((axes, layout.offset, stop))
    return tuple(out)


# -- flat buffers ------------------------------------------------------------------------


# [Note: shards in one buffer]
# An all-gather sends one contiguous (S,) buffer per rank: the unit's shard leaves, each
# zero-padded to its chunk, end to end (`pack_shards`). Packing them is a copy of 1/N of
# the unit at every gather, twice a step with reshard-after-forward (measured on the GPT
# 8L d512, world 2: about half of the step's `aten::cat` time). So `step.shard_params` and
# `step.init_shards` return each unit's shard leaves as views of one such buffer
# (`unit_buffer_views`); an optimizer that updates in place (`sf.train_step`'s fused or
# `inplace=True` AdamW) keeps them so, and `pack_shards` then returns the buffer itself
# (`packed_view`, checked each gather leaf by leaf on their addresses). Leaves that are
# not views of it (a pure optimizer's new tensors, shards a user made) are packed as
# before: the same bytes either way. The padding is never written (no leaf covers it).
# stats() counts what is allocated: no send buffer for a view. (`torch.save` of one leaf
# alone writes the whole unit buffer, as it does for any view; `sf.checkpoint` writes
# each leaf's own bytes: checked, the same size on disk as separate tensors.)


def in_unit_buffers(plan: "Plan", shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's flat list of leaves with each unit's sharded leaves copied into the
    unit's buffer, as views of it ([Note: shards in one buffer])."""
    out = list(shards)
    for unit in plan.units:
        views = unit_buffer_views(unit, [tuple(out[layout.index].shape) for layout in unit.sharded],
                                  [out[layout.index].dtype for layout in unit.sharded], out[0].device if out else None)
        for layout, view in zip(unit.sharded, views or ()):
            view.copy_(out[layout.index])
            out[layout.index] = view
    return out


_BUFFERS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # where a unit buffer starts -> it


def _start_key(x: torch.Tensor, offset: int):
    """Where the unit buffer would start if `x` were its leaf at element `offset`: an
    address (meta tensors have none: their storage and offset)."""
    if x.is_meta:
        return ("meta", x.untyped_storage()._cdata, x.storage_offset() - offset)
    return (x.device, x.data_ptr() - offset * x.element_size())


def unit_buffer_views(unit: UnitPlan, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], device
                      ) -> list[torch.Tensor] | None:
    """[Note: shards in one buffer] A fresh zero-padded (S,) buffer of `unit`, laid out as
    `pack_shards` packs it, as one view per sharded leaf (of its local `shapes`); None
    when the unit has no sharded leaf or the leaves' dtypes differ from the unit's."""
    if not unit.sharded or any(dtype != unit.dtype for dtype in dtypes):
        return None
    buf = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=device)
    _BUFFERS[_start_key(buf, 0)] = buf  # alive while a view is (a view holds its base)
    return [buf.narrow(0, layout.offset, math.prod(shape)).view(shape) for layout, shape in zip(unit.sharded, shapes)]


def packed_view(unit: UnitPlan, shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """[Note: shards in one buffer] The (S,) shard buffer when `shards` still lie where
    `unit_buffer_views` put them in it (an in-place optimizer keeps them there), else None.
    Found by the address its first leaf implies (the runtime sees detached aliases of
    the leaves, which have no `_base`) and checked leaf by leaf."""
    if not shards or shards[0].dtype != dtype or torch.compiler.is_compiling():  # a graph packs: no addresses
        return None
    try:
        key = _start_key(shards[0], unit.sharded[0].offset)
        buf = _BUFFERS.get(key)
        if buf is None or buf.numel() != unit.shard_numel or buf.dtype != dtype:
            return None
        for layout, x in zip(unit.sharded, shards):
            if _start_key(x, layout.offset) != key or not x.is_contiguous():
                return None
    except (RuntimeError, AttributeError, NotImplementedError):  # wrapped or fake tensors: no address
        return None
    return buf


def pack_shards(unit: UnitPlan, shards: list[torch.Tensor], dtype: torch.dtype, device,
                lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Copy-in: this rank's shards (leading dims `lead`) -> the (*lead, S) shard buffer in
    `dtype`, zero-padded; the buffer itself, without a copy, when the shards are views of
    it ([Note: shards in one buffer])."""
    if not lead:
        view = packed_view(unit, shards, dtype)
        if view is not None:
            return view
    pieces = []
    for layout, shard in zip(unit.sharded, shards):
        flat = shard.reshape(lead + (-1,)).to(dtype)
        pad = layout.chunk_numel - flat.shape[-1]
        pieces.append(torch.nn.functional.pad(flat, (0, pad)) if pad else flat)
    if not pieces:
        return torch.empty(lead + (0,), dtype=dtype, device=device)
    return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0].contiguous()


def region_views(unit: UnitPlan, full: torch.Tensor) -> list[torch.Tensor]:
    """Per leaf, its (k, c*row) region of the leaf-major unsharded buffer."""
    out, start = [], 0
    for layout in unit.sharded:
        size = unit.k * layout.chunk_numel
        out.append(full.narrow(0, start, size).view(unit.k, layout.chunk_numel))
        start += size
    return out


def leaf_views(unit: UnitPlan, full: torch.Tensor) -> list[torch.Tensor]:
    """Per leaf, the full (unpadded) tensor as a view of the unsharded buffer."""
    out, start = [], 0
    for layout in unit.sharded:
        out.append(full.narrow(0, start, layout.rows * layout.row_numel).view(layout.shape))
        start += unit.k * layout.chunk_numel
    return out


def copy_out(unit: UnitPlan, gathered: torch.Tensor, full: torch.Tensor) -> None:
    """(k, S) rank-major gathered buffer -> leaf-major unsharded buffer, one pass."""
    sizes = [layout.chunk_numel for layout in unit.sharded]
    torch.split_with_sizes_copy(gathered.view(unit.k, unit.shard_numel), sizes, dim=1, out=region_views(unit, full))


def pack_grads(unit: UnitPlan, grads: list[torch.Tensor | None], dtype, device, lead: tuple[int, ...] = ()) -> torch.Tensor:
    """Full-leaf grads (leading batch dims `lead`) -> (k, *lead, S) for a reduce-scatter."""
    k = unit.k
    pieces = []
    for layout, g in zip(unit.sharded, grads):
        if g is None:
            pieces.append(torch.zeros(lead + (k, layout.chunk_numel), dtype=dtype, device=device))
            continue
        flat = g.reshape(lead + (-1,)).to(dtype)
        pad = k * layout.chunk_numel - flat.shape[-1]
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        pieces.append(flat.reshape(lead + (k, layout.chunk_numel)))
    packed = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]  # (*lead, k, S)
    return packed.movedim(len(lead), 0).contiguous()


def unpack_shard_grads(unit: UnitPlan, flat: torch.Tensor, index: int, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """(*lead, S) reduce-scattered buffer -> this rank's unpadded shard grads."""
    out = []
    for layout in unit.sharded:
        rows = layout.local_rows(index, unit.k)
        piece = flat.narrow(-1, layout.offset, rows * layout.row_numel)
        out.append(piece.reshape(lead + (rows,) + layout.shape[1:]))
    return out


# -- hpZ ---------------------------------------------------------------------------------

# [Note: hpZ]
# `reshard_after_forward=<axes>` (ZeRO++'s hpZ, FSDP2's int form): after the forward a
# rank keeps, of each unit's gathered (k, S) buffer, the k / M rows of the shard-group
# ranks that share its coordinates on the sub-axes (M ranks in all), i.e. its own shard
# and those of its counterparts across the other shard axes; the unit is then in state
# SHARDED_POST_FORWARD (unit.py). In the backward the M ranks of its sub-axes group
# all-gather those rows, (M, k / M, S), which is the whole buffer in another order: no
# traffic crosses the other shard axes (e.g. nodes). Memory: 1/M of each unit between
# its forward and its backward.


def hpz_rows(mesh, shard_axes: tuple[str, ...], sub_axes: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """[Note: hpZ] `(keep, order)`: the shard-group rows this rank keeps (ordered by their
    index over the other axes), and for each row j its position in the flattened re-gather."""
    def ravel(coords, axes):  # the index of `coords` within the sub-mesh of `axes` (row-major)
        return coords_rank(coords, {a: mesh.shape[a] for a in axes})

    def unravel(j):
        return rank_coords(j, {a: mesh.shape[a] for a in shard_axes})

    outer = tuple(a for a in shard_axes if a not in sub_axes)
    k, m = mesh.axis_size(shard_axes), mesh.axis_size(sub_axes)
    mine = ravel(mesh.coords, sub_axes)
    rows = [unravel(j) for j in range(k)]
    keep = sorted((j for j in range(k) if ravel(rows[j], sub_axes) == mine), key=lambda j: ravel(rows[j], outer))
    order = [ravel(c, sub_axes) * (k // m) + ravel(c, outer) for c in rows]
    return keep, order
