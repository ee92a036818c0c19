"""The matrix-aware path: whole-matrix math on one owner rank per matrix.

[Note: the owner rule]
Element-wise transforms (Adam, SGD, Lion) run on a rank's blocks unchanged. Muon's
Newton–Schulz, Shampoo/SOAP's preconditioners and the like need the whole matrix. For
each such leaf:

1. the leaf's blocks live on the ranks of its *group*: the mesh axes its spec names
   (dim 0 over ``"data"`` for ``sf.shard``'s shards; also ``"model"`` under TP; only
   ``"shard"`` under HSDP, whose replicas each run the same group, redundantly);
2. one rank of the group *owns* the leaf: owners are assigned greedily, largest cost
   first, to the least-loaded rank (``cost`` ~ the math's FLOPs), the same on every rank
   since it depends on global shapes only;
3. every other rank sends its block of the input to the owner (one uneven all-to-all per
   group and dtype, ``ragged_all_to_all``: no all-reduce, no full copy on any other rank);
   the owner assembles the matrix, runs the math, and sends each rank its block of the
   result (a second uneven all-to-all).

Bytes per step, with b the wire dtype's size, N_i a leaf's elements and n_i(r) rank r's
block of it (a rank's own block never travels)::

    gather(r)  = b * sum_{i: owner(i) != r} n_i(r)
    scatter(r) = b * sum_{i: owner(i) == r} (N_i - n_i(r))
    over the group: gather + scatter = 2 * b * sum_i (N_i - n_i(owner(i)))

which is what ``ops.recording`` notes (the send buffers) and ``update.stats()`` reports.
A leaf whose spec names no axis (replicated, or ``mesh=None``) is computed where it is,
with no communication. The owner holds, transiently, its matrices' inputs and outputs
whole: ``sum_{i owned} N_i * (b_in + b_out)`` bytes at most.

[Note: the layout a transform is given]
``shardfn.optim`` does not import ``shard`` (the layering test), so the step does not
hand the optimizer its plan. The caller gives ``mesh`` and ``specs`` (``step.specs``, as
for ``clip_by_global_norm``): each leaf's block is ``torch.chunk`` per dim over the axes
its spec names. Global shapes are not in the blocks, so the first update of a tree
structure finds them with one small all-reduce of the block sizes per set of axes (the
sum of a dim's block sizes over its axes), checks every rank's block against them, and
caches the result per tree structure and rank.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .. import _tree
from .._backend import ops
from .._backend.base import rank_coords
from .._errors import SpecError
from .._spec import PartitionSpec, as_spec, block_index, chunk_bounds, entry_axes, is_spec

Owners = Optional[Callable[[tuple, tuple, int], int]]


@dataclasses.dataclass(frozen=True)
class LeafBlocks:
    """How one leaf is laid out over the mesh."""

    path: tuple
    shape: tuple[int, ...]  # global (logical) shape
    spec: PartitionSpec  # one entry per dim
    axes: tuple[str, ...]  # the mesh axes the spec names, mesh order: the leaf's group

    def bounds(self, coords: dict, mesh_shape: dict) -> tuple[slice, ...]:
        """The slices of the global leaf held by the rank at `coords`."""
        out = []
        for dim, entry in enumerate(self.spec):
            index, count = block_index(entry, coords, mesh_shape)
            start, stop = chunk_bounds(self.shape[dim], count, index)
            out.append(slice(start, stop))
        return tuple(out)

    def block_numel(self, coords: dict, mesh_shape: dict) -> int:
        return math.prod(s.stop - s.start for s in self.bounds(coords, mesh_shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _full_spec(spec, ndim: int) -> PartitionSpec:
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return PartitionSpec(*entries)


class Layout:
    """Each leaf's global shape and blocks, from `mesh` and `specs` ([Note: the layout a
    transform is given]); cached per tree structure and rank."""

    def __init__(self, mesh, specs, who: str):
        if mesh is None and specs is not None:
            raise ValueError(f"{who}: `specs` describe a mesh; pass `mesh` too.")
        self.mesh, self.specs, self.who = mesh, specs, who
        self._cache: dict = {}
        self._lock = threading.Lock()

    def rank_key(self):
        return self.mesh.rank if self.mesh is not None and self.mesh.in_rank() else 0

    def of(self, tree) -> list[LeafBlocks]:
        paths, leaves, treedef = _tree.flatten_with_paths(tree)
        key = (treedef, self.rank_key(), tuple(tuple(x.shape) for x in leaves))
        got = self._cache.get(key)
        if got is None:
            got = self._build(tree, paths, leaves)
            with self._lock:
                self._cache[key] = got
        return got

    def _specs_per_leaf(self, tree, leaves) -> list[PartitionSpec]:
        if self.mesh is None:
            return [PartitionSpec()] * len(leaves)
        if self.specs is None:
            axes = tuple(self.mesh.axis_names)
            entry = axes[0] if len(axes) == 1 else axes
            return [PartitionSpec() if x.dim() == 0 else PartitionSpec(entry) for x in leaves]
        try:
            per_leaf = _tree.broadcast_prefix(self.specs, tree, what="specs", is_prefix_leaf=is_spec)
        except SpecError as e:
            raise SpecError(f"{self.who}: `specs` must be a pytree prefix of the params with a "
                            f"PartitionSpec or None per leaf (like `step.specs`).\n{e}") from None
        return [as_spec(s, f"{self.who}: specs") for s in per_leaf]

    def _build(self, tree, paths, leaves) -> list[LeafBlocks]:
        specs = self._specs_per_leaf(tree, leaves)
        mesh = self.mesh
        problems = []
        for p, x, s in zip(paths, leaves, specs):
            if len(s) > x.dim():
                problems.append(f"params{_tree.keystr(p)}: spec {s} has {len(s)} entries but the leaf has "
                                f"{x.dim()} dims (shape {tuple(x.shape)})")
        if problems:
            raise SpecError(f"{self.who}: specs that do not fit the leaves:\n" + "\n".join(f"  - {q}" for q in problems)
                            + "\nFix: pass the specs of these params (e.g. step.specs).")
        specs = [_full_spec(s, x.dim()) for s, x in zip(specs, leaves)]
        shapes = [list(x.shape) for x in leaves]
        if mesh is not None:
            # one all-reduce of block sizes per set of axes ([Note: the layout a transform is given])
            requests: dict[tuple, list[tuple[int, int]]] = {}
            for i, s in enumerate(specs):
                for d, entry in enumerate(s):
                    axes = entry_axes(entry)
                    if axes:
                        requests.setdefault(tuple(sorted(axes, key=mesh.axis_names.index)), []).append((i, d))
            for axes in sorted(requests, key=lambda a: [mesh.axis_names.index(x) for x in a]):
                where = requests[axes]
                sizes = torch.tensor([shapes[i][d] for i, d in where], dtype=torch.int64)
                mesh.all_reduce(sizes, axes, op="sum")
                for (i, d), n in zip(where, sizes.tolist()):
                    shapes[i][d] = n
            # every rank must see the same global shapes: one all-reduce of (max, -min)
            flat = torch.tensor([n for s in shapes for n in s], dtype=torch.int64)
            both = torch.cat([flat, -flat])
            mesh.all_reduce(both, None, op="max")
            hi, lo = both[: flat.numel()], -both[flat.numel():]
            if not torch.equal(hi, lo):
                at, pos = [], 0
                for p, s in zip(paths, shapes):
                    if not torch.equal(hi[pos:pos + len(s)], lo[pos:pos + len(s)]):
                        at.append(f"params{_tree.keystr(p)}: global shape between {tuple(lo[pos:pos + len(s)].tolist())}"
                                  f" and {tuple(hi[pos:pos + len(s)].tolist())} depending on the rank")
                    pos += len(s)
                raise SpecError(f"{self.who}: the blocks do not follow `specs` (torch.chunk per dim over the spec's "
                                f"axes): the ranks' blocks add up to different global shapes:\n"
                                + "\n".join(f"  - {q}" for q in at[:10])
                                + "\nFix: pass the specs the blocks were made with (step.specs for sf.shard's shards).")
        out = []
        coords = mesh.coords if mesh is not None else {}
        mesh_shape = mesh.shape if mesh is not None else {}
        for p, x, s, shape in zip(paths, leaves, specs, shapes):
            names = {a for e in s for a in entry_axes(e)}
            axes = tuple(a for a in mesh.axis_names if a in names) if mesh is not None else ()
            lb = LeafBlocks(p, tuple(shape), s, axes)
            if mesh is not None:
                want = tuple(sl.stop - sl.start for sl in lb.bounds(coords, mesh_shape))
                if want != tuple(x.shape):
                    problems.append(f"params{_tree.keystr(p)}: this rank's block has shape {tuple(x.shape)} but "
                                    f"spec {s} over mesh {mesh_shape} gives {want} of the global shape {tuple(shape)}")
            out.append(lb)
        if problems:
            raise SpecError(f"{self.who}: the blocks do not follow `specs` (torch.chunk per dim over the spec's axes):\n"
                            + "\n".join(f"  - {q}" for q in problems)
                            + "\nFix: pass the specs the blocks were made with (step.specs for sf.shard's shards).")
        return out


def assign_owners(items: Sequence[tuple[int, LeafBlocks, float]], mesh, owners: Owners, who: str) -> dict[int, int]:
    """`{leaf index: owner's index in the leaf's group}` ([Note: the owner rule]): `owners`
    if given (`owners(path, global_shape, group_size) -> index`), else greedy by cost."""
    out: dict[int, int] = {}
    by_axes: dict[tuple, list] = {}
    for i, lb, cost in items:
        by_axes.setdefault(lb.axes, []).append((i, lb, cost))
    for axes, group in by_axes.items():
        k = math.prod(mesh.shape[a] for a in axes) if axes else 1
        if owners is not None:
            for i, lb, _ in group:
                o = owners(lb.path, lb.shape, k)
                if not isinstance(o, int) or not 0 <= o < k:
                    raise ValueError(f"{who}: owners(params{_tree.keystr(lb.path)}, {lb.shape}, {k}) returned "
                                     f"{o!r}; it must be an int in [0, {k}) (an index in the leaf's group over {axes}).")
                out[i] = o
            continue
        load = [0.0] * k
        for i, lb, cost in sorted(group, key=lambda t: (-t[2], t[0])):
            o = min(range(k), key=lambda r: (load[r], r))
            load[o] += cost
            out[i] = o
    return out


class Stats:
    """Per-rank bytes of the last call of a matrix-aware update ([Note: the owner rule])."""

    KEYS = ("gather_bytes", "scatter_bytes", "num_collectives", "owned_matrices", "owned_cost", "owner_transient_bytes")

    def __init__(self):
        self._by_rank: dict[int, dict] = {}

    def set(self, rank: int, values: dict) -> None:
        self._by_rank[rank] = values

    def get(self, mesh) -> dict:
        rank = mesh.rank if mesh is not None and mesh.in_rank() else 0
        return dict(self._by_rank.get(rank, dict.fromkeys(self.KEYS, 0)))


def map_whole(fn: Callable[[int, torch.Tensor], torch.Tensor], blocks: dict[int, torch.Tensor],
              layout: list[LeafBlocks], owner: dict[int, int], mesh, cost: dict[int, float],
              out_dtype: Optional[torch.dtype] = None) -> tuple[dict[int, torch.Tensor], dict]:
    """This rank's block of `fn(i, whole leaf i)` for each leaf index in `blocks`.

    `blocks[i]` is this rank's block of leaf i's input; the owner of each leaf gathers it,
    calls `fn`, and scatters the result ([Note: the owner rule]). Returns the blocks and
    this rank's stats. Every rank of each group must call it with the same leaves.
    """
    stats = dict.fromkeys(Stats.KEYS, 0)
    result: dict[int, torch.Tensor] = {}
    groups: dict[tuple, list[int]] = {}
    for i in sorted(blocks):
        groups.setdefault((layout[i].axes, blocks[i].dtype), []).append(i)
    for (axes, dtype), idx in groups.items():
        k = math.prod(mesh.shape[a] for a in axes) if axes else 1
        if k == 1:
            for i in idx:
                out = fn(i, blocks[i])
                result[i] = out if out_dtype is None else out.to(out_dtype)
                stats["owned_matrices"] += 1
                stats["owned_cost"] += cost.get(i, 0.0)
            continue
        _exchange(fn, blocks, layout, owner, mesh, axes, idx, cost, out_dtype, result, stats)
    return result, stats


def _exchange(fn, blocks, layout, owner, mesh, axes, idx, cost, out_dtype, result, stats):
    """Gather each leaf of `idx` to its owner, run `fn`, scatter the result: two uneven all-to-alls."""
    group = mesh.group(axes)
    k, me = group.size, group.index
    mesh_shape = mesh.shape
    coords = [rank_coords(r, mesh_shape) for r in group.ranks]
    bounds = {i: [layout[i].bounds(coords[j], mesh_shape) for j in range(k)] for i in idx}

    def numel(i, j):
        return math.prod(s.stop - s.start for s in bounds[i][j])

    mine = [i for i in idx if owner[i] == me]
    in_dtype = blocks[idx[0]].dtype
    device = blocks[idx[0]].device
    # gather: to each owner, my blocks of its leaves (leaf order); from each rank, its blocks of mine
    sends = [torch.cat([blocks[i].reshape(-1) for i in idx if owner[i] == j]) if j != me and
             any(owner[i] == j for i in idx) else torch.empty(0, dtype=in_dtype, device=device) for j in range(k)]
    recv = [0 if j == me else sum(numel(i, j) for i in mine) for j in range(k)]
    got = _all_to_all(group, sends, recv, in_dtype, device)
    stats["gather_bytes"] += sum(s.numel() for s in sends) * _size(in_dtype)
    stats["num_collectives"] += 1
    pieces = [list(g.split([numel(i, j) for i in mine])) if j != me else None for j, g in enumerate(got)]
    whole = {}
    for n, i in enumerate(mine):
        full = torch.empty(layout[i].shape, dtype=in_dtype, device=device)
        for j in range(k):
            src = blocks[i] if j == me else pieces[j][n]
            if src.numel():
                full[bounds[i][j]] = src.reshape(full[bounds[i][j]].shape)
        out = fn(i, full)
        whole[i] = out if out_dtype is None else out.to(out_dtype)
        stats["owned_matrices"] += 1
        stats["owned_cost"] += cost.get(i, 0.0)
        stats["owner_transient_bytes"] += full.numel() * (_size(in_dtype) + _size(whole[i].dtype))
    rdtype = out_dtype or in_dtype
    sends = [torch.cat([whole[i][bounds[i][j]].reshape(-1) for i in mine]) if j != me and mine
             else torch.empty(0, dtype=rdtype, device=device) for j in range(k)]
    theirs = [[i for i in idx if owner[i] == j] for j in range(k)]
    recv = [0 if j == me else sum(numel(i, me) for i in theirs[j]) for j in range(k)]
    got = _all_to_all(group, sends, recv, rdtype, device)
    stats["scatter_bytes"] += sum(s.numel() for s in sends) * _size(rdtype)
    stats["num_collectives"] += 1
    for j in range(k):
        if j == me:
            for i in mine:
                result[i] = whole[i][bounds[i][me]].clone()
        else:
            for i, piece in zip(theirs[j], got[j].split([numel(i, me) for i in theirs[j]])):
                result[i] = piece.reshape(blocks[i].shape)


def _all_to_all(group, sends: list[torch.Tensor], recv: list[int], dtype, device) -> list[torch.Tensor]:
    """One uneven all-to-all of 1-D pieces; the received pieces by source index."""
    x = torch.cat(sends) if sends else torch.empty(0, dtype=dtype, device=device)
    out = ops.ragged_all_to_all(group, x, [s.numel() for s in sends], recv)
    return list(out.split(recv))


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Shape:
    """A mesh's shape only: what `assign_owners` and `plan` read."""

    def __init__(self, mesh_shape: dict):
        self.shape = dict(mesh_shape)
        self.axis_names = tuple(self.shape)


def plan(params: Any, mesh_shape: dict, specs: Any, cost_fn: Callable[[tuple], float], in_dtype,
         out_dtype, owners: Owners, who: str) -> dict[int, dict]:
    """Every rank's `Stats` of one update, from the full params (or meta tensors) with no
    collective: the owner rule's formula ([Note: the owner rule]) evaluated per rank."""
    from .._spec import local_shape

    mesh = _Shape(mesh_shape)
    paths, leaves, _ = _tree.flatten_with_paths(params)
    if specs is None:
        axes = mesh.axis_names
        entry = axes[0] if len(axes) == 1 else axes
        per_leaf = [PartitionSpec() if x.dim() == 0 else PartitionSpec(entry) for x in leaves]
    else:
        per_leaf = [as_spec(s, f"{who}: specs") for s in
                    _tree.broadcast_prefix(specs, params, what="specs", is_prefix_leaf=is_spec)]
    lay = []
    for p, x, s in zip(paths, leaves, per_leaf):
        s = _full_spec(s, x.dim())
        names = {a for e in s for a in entry_axes(e)}
        lay.append(LeafBlocks(p, tuple(x.shape), s, tuple(a for a in mesh.axis_names if a in names)))
    cost = {i: cost_fn(lb.shape) for i, lb in enumerate(lay)}
    owner = assign_owners([(i, lb, cost[i]) for i, lb in enumerate(lay)], mesh, owners, who)
    b_in = _size(in_dtype) if in_dtype is not None else None
    out = {}
    for rank in range(math.prod(mesh.shape.values()) if mesh.shape else 1):
        coords = rank_coords(rank, mesh.shape)
        st = dict.fromkeys(Stats.KEYS, 0)
        groups = set()
        for i, (lb, x) in enumerate(zip(lay, leaves)):
            bi = b_in or x.element_size()
            bo = _size(out_dtype) if out_dtype is not None else bi
            index, k = 0, 1
            for a in lb.axes:
                index, k = index * mesh.shape[a] + coords[a], k * mesh.shape[a]
            mine = math.prod(local_shape(lb.shape, lb.spec, coords, mesh.shape))
            if k > 1:
                groups.add((lb.axes, bi))
            if owner[i] == index:
                st["owned_matrices"] += 1
                st["owned_cost"] += cost[i]
                if k > 1:
                    st["scatter_bytes"] += (lb.numel - mine) * bo
                    st["owner_transient_bytes"] += lb.numel * (bi + bo)
            elif k > 1:
                st["gather_bytes"] += mine * bi
        st["num_collectives"] = 2 * len(groups)
        out[rank] = st
    return out
