"""FSDP x TP: the tensor-parallel side of `shard(..., param_specs=...)`.

`param_specs` lays each parameter out over the mesh axes that are not data axes (the
tensor-parallel axes); `shard` then FSDP-shards each rank's tensor-parallel block over
its shard axes. This module resolves and checks those specs, derives which axes a leaf's
gradient must be summed over, combines both layouts into one spec per leaf (what
`step.specs` reports and checkpoints use), and vets the collectives `loss_fn` calls.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _tree
from .._errors import ShardingError, SpecError
from .._shard_map import replicated_mismatch
from .._spec import PartitionSpec, block_index, chunk_bounds, entry_axes, validate_spec

__all__ = ["tp_specs", "tp_axes", "replica_axes", "reduce_axes", "check_nested_chunks", "combined_spec",
           "collective_axes_check", "check_same_loss"]

# [Note: FSDP x TP]
# `shard` is shard_map over the whole mesh with the params sharded and
# the loss replicated, so it follows shard_map's transpose rule (_shard_map.py, JEP 17111):
#   (1) the loss's out spec is P(): its cotangent is divided by the size of every mesh
#       axis: 1/|data axes| (the mean) and 1/|tensor-parallel axes| (LossMean.backward);
#   (2) a parameter's cotangent is psummed over every axis its spec omits: over the shard
#       axes by the reduce-scatter, over the other data axes by HSDP's all-reduce, and
#       over the tensor-parallel axes that `param_specs` does not name by an all-reduce of
#       that leaf's range of the reduce-scattered (1/N-sized) buffer (UnitPlan.regions).
# Inside loss_fn the collectives over the tensor-parallel axes use psum's transpose =
# psum, which together with (1) and (2) gives the exact gradient: a weight split over
# 'model' gets the contributions of all ranks through the collectives' backward, and a
# weight replicated over 'model' (a LayerNorm) gets 1/|model| of its gradient on each
# 'model' rank, summed by (2). Without tensor-parallel axes both are no-ops.
# The runtime side: LossMean (autograd.py) and reduce.finish_reduce (reduce.py).

# [Note: expert parallelism]
# A spec may also name a data axis that is not a shard axis, e.g. experts stacked on dim 0
# with P('expert') under data_axes=('data', 'expert'), shard_axes='data': every rank of
# 'expert' reads its own batch and holds its own experts, and loss_fn routes tokens to
# them with all_to_all over 'expert'. The same transpose rule covers it: the loss is the
# mean over all data axes; an expert weight receives, through all_to_all's transpose, the
# contributions of every token routed to it, so its gradient is summed over the shard axes
# (the reduce-scatter) but not over 'expert' (it is split there, not replicated), while a
# leaf replicated over 'expert' is summed over it as HSDP sums replicas (`replica_axes`).


def tp_specs(given: Any, params, paths, leaves, mesh, data_axes, shard_axes) -> list[PartitionSpec]:
    """Per leaf, its spec over the tensor-parallel axes (`param_specs`; P() without it), checked."""
    if given is None:
        return [PartitionSpec()] * len(leaves)
    if callable(given) and not isinstance(given, PartitionSpec):
        specs = [given(path) for path in paths]
    else:
        specs = _tree.broadcast_prefix(given, params, what="param_specs",
                                       is_prefix_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    others = [a for a in mesh.axis_names if a not in shard_axes]
    out = []
    for path, leaf, spec in zip(paths, leaves, specs):
        where = f"shard(param_specs) for params{_tree.keystr(path)}"
        spec = PartitionSpec() if spec is None else spec
        shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else ()
        validate_spec(spec, shape, mesh.shape, where)
        clash = [a for a in spec.axes if a in shard_axes]
        if clash:
            raise SpecError(
                f"{where}: the spec {spec!r} names data axes {clash} that shard shards over (shard_axes "
                f"{list(shard_axes)}); param_specs lay parameters out over the other axes {others} "
                f"(tensor-parallel axes, or data axes that are not shard axes: expert parallelism).\nFix: "
                f"drop {clash} from the spec."
            )
        if spec.axes and not isinstance(leaf, torch.Tensor):
            raise SpecError(f"{where}: a {type(leaf).__name__} cannot be split over {spec.axes}; give it P()")
        out.append(spec)
    return out


def tp_axes(mesh, specs: list[PartitionSpec], data_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The tensor-parallel axes: the non-data axes some spec names, in mesh order. (A data
    axis a spec names splits that leaf over the ranks of the batch: [Note: expert parallelism].)"""
    return tuple(a for a in mesh.axis_names if a not in data_axes and any(a in s.axes for s in specs))


def replica_axes(spec: PartitionSpec, data_axes: tuple[str, ...], shard_axes: tuple[str, ...], mesh) -> tuple[str, ...]:
    """Data axes (of size > 1) that are not shard axes and that the leaf is replicated over:
    its gradient is summed over them after the reduce-scatter (HSDP's replicas), unless
    its spec splits it over them ([Note: expert parallelism])."""
    named = set(spec.axes)
    return tuple(a for a in data_axes if a not in shard_axes and a not in named and mesh.shape[a] > 1)


def reduce_axes(spec: PartitionSpec, tp: tuple[str, ...], mesh) -> tuple[str, ...]:
    """Tensor-parallel axes (of size > 1) a leaf with `spec` is replicated over: rule (2)."""
    named = set(spec.axes)
    return tuple(a for a in tp if a not in named and mesh.shape[a] > 1)


def check_nested_chunks(plan, leaves, specs: list[PartitionSpec], mesh, shard_axes) -> None:
    """Where param_specs and shard both split dim 0, the shard group's chunks of each
    tensor-parallel block must be the torch.chunk blocks of the combined spec (what
    `step.specs` reports and checkpoints use): true when dim 0 splits evenly."""
    k = plan.k
    for layout, leaf, spec in zip(plan.leaves, leaves, specs):
        if not (layout.sharded and spec and entry_axes(spec[0])):
            continue
        n = leaf.shape[0]
        _, m = block_index(spec[0], mesh.coords, mesh.shape)
        for i in range(m):
            start, stop = chunk_bounds(n, m, i)
            for j in range(k):
                a, b = chunk_bounds(stop - start, k, j)
                if (start + a, start + b) != chunk_bounds(n, m * k, i * k + j):
                    raise SpecError(
                        f"shard: params{_tree.keystr(layout.path)} (shape {tuple(leaf.shape)}) has dim 0 "
                        f"split {m} ways over {entry_axes(spec[0])} by param_specs and then {k} ways over "
                        f"{shard_axes} by shard; {n} rows do not split into {m * k} torch.chunk blocks that "
                        f"way, so the shards would not have the layout step.specs promises.\nFix: make dim 0 "
                        f"a multiple of {m * k}, split another dim over the tensor-parallel axes, or keep the "
                        f"leaf whole with replicated=."
                    )


def combined_spec(sharded: bool, tp_spec: PartitionSpec, shard_axes: tuple[str, ...]) -> PartitionSpec:
    """A leaf's spec: its tensor-parallel spec, with dim 0 also split over the shard axes
    (minor to the tensor-parallel axes of dim 0) when shard shards it."""
    if not sharded:
        return tp_spec
    axes = entry_axes(tp_spec[0] if tp_spec else None) + shard_axes
    entry = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(entry, *tp_spec[1:])


def collective_axes_check(data_axes: tuple[str, ...], tp: tuple[str, ...]) -> Callable[[str, tuple[str, ...]], None]:
    """Inside loss_fn, collectives may run over data axes and tensor-parallel axes; over
    any other axis shard would not reduce the gradients, so they would be wrong."""
    allowed = set(data_axes) | set(tp)

    def check(op: str, axes: tuple[str, ...]) -> None:
        stray = [a for a in axes if a not in allowed]
        if stray:
            raise ShardingError(
                f"shard: {op} over {stray} inside loss_fn, but {stray} are neither data axes {list(data_axes)} "
                f"nor tensor-parallel axes of this step (axes that param_specs names: {list(tp)}), so shard "
                f"would not reduce gradients over them and they would be wrong.\nFix: pass param_specs that "
                f"split some parameters over {stray} (e.g. P(None, {stray[0]!r}) for a column-parallel "
                f"weight), or add {stray} to data_axes if they split the batch."
            )

    return check


def check_same_loss(group, axes: tuple[str, ...], loss: torch.Tensor) -> None:
    """The loss is the same on every rank of the tensor-parallel axes `axes` (`group`): each
    computes the loss of the same data rank's batch, else the gradient would be wrong
    ([Note: FSDP x TP]). One small all-reduce of fingerprints; a ShardingError on every rank."""
    if replicated_mismatch(group, [loss])[0]:
        raise ShardingError(
            f"shard: the loss differs across mesh axes {axes} (ranks {list(group.ranks)}, seen on rank "
            f"{group.ranks[group.index]}), the tensor-parallel axes of param_specs: shard treats every "
            f"rank of them as computing the same loss of the same batch.\nFix: give every rank of "
            f"{axes} the same batch and reduce the loss over them (sf.psum / all_gather) so it is "
            f"the same there; or, if those axes split the batch, add them to data_axes."
        )
