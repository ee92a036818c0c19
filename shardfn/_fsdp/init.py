"""`step.init_shards(init_fn, seed)`: each rank materializes only its own shards.

The description (`sf.init`: a tree of `Param(shape, init, dtype)`) is laid out exactly as
`shard_params` lays out real tensors, from meta tensors of the same shapes: the same
tensor-parallel specs and checks, the same `Plan` (shared through the step's plan cache,
so `step(...)`, `unshard_params` and `step.specs` treat these shards as their own). Then
each leaf's part on this rank, the global index range of its tensor-parallel block's
dim-0 chunk, is drawn block by block ([Note: N-independent random streams] in
shardfn/_init/describe.py): the values equal `sf.init.materialize(init_fn, seed)` sliced the way
`shard_params` slices it, and no rank holds more than its shards plus one row block.
"""

from __future__ import annotations

import torch

from .. import _tree
from .._agree import check_same_everywhere
from .._spec import block_index, chunk_bounds
from .._init.describe import _check_seed, describe, sample
from .plan import unit_buffer_views

__all__ = ["init_shards", "local_bounds"]


def init_shards(step, init_fn, seed: int):
    """See `Shard.init_shards`."""
    _check_seed(seed, "step.init_shards")
    mesh, cfg = step.mesh, step.config
    paths, params, treedef = describe(init_fn)
    metas = [p.meta() for p in params]
    lines = [f"seed {seed}"] + [f"params{_tree.keystr(path)}: {p.shape} {p.dtype} {p.init!r}"
                                for path, p in zip(paths, params)]
    check_same_everywhere(
        mesh.group(mesh.axis_names), lines, "parameter descriptions (or seeds) to init_shards",
        "call step.init_shards with the same description and the same seed on every rank.",
    )
    plan, _ = step._lay_out(_tree.unflatten(treedef, metas), paths, metas, treedef, allow_meta=True)
    bounds = local_bounds(plan, mesh, cfg.shard_axes, [p.shape for p in params])
    into: list = [None] * len(params)  # [Note: shards in one buffer]: drawn straight into the unit buffers
    for unit in plan.units:
        shapes = [tuple(b - a for a, b in bounds[layout.index]) for layout in unit.sharded]
        views = unit_buffer_views(unit, shapes, [params[layout.index].dtype for layout in unit.sharded], mesh.device)
        for layout, view in zip(unit.sharded, views or ()):
            into[layout.index] = view
    with torch.no_grad():
        shards = [sample(param, path, seed, b, device=mesh.device, out=out)
                  for param, path, b, out in zip(params, paths, bounds, into)]
    return _tree.unflatten(treedef, shards)


def local_bounds(plan, mesh, shard_axes, shapes) -> list[list[tuple[int, int]]]:
    """Per leaf, per dim, the global `(start, stop)` of this rank's shard of a leaf of that
    global shape: its tensor-parallel block, dim 0 narrowed to the shard group's chunk of
    that block when the leaf is sharded. (`sf.hf.load_shards` reads exactly these ranges.)"""
    index = mesh.group(shard_axes).index
    out = []
    for layout, shape, spec in zip(plan.leaves, shapes, plan.tp_specs):
        bounds = _tp_bounds(shape, spec, mesh)
        if layout.sharded:  # this rank's dim-0 chunk of its tensor-parallel block
            first = bounds[0][0]
            start, stop = chunk_bounds(layout.rows, plan.k, index)
            bounds[0] = (first + start, first + stop)
        out.append(bounds)
    return out


def _tp_bounds(shape, spec, mesh) -> list[tuple[int, int]]:
    """Per dim, the global `(start, stop)` of this rank's tensor-parallel block."""
    out = [(0, n) for n in shape]
    for dim, entry in enumerate(spec):
        i, count = block_index(entry, mesh.coords, mesh.shape)
        out[dim] = chunk_bounds(shape[dim], count, i)
    return out
