"""`step.unshard_params` one unit at a time: the full leaves, gathered as a stream.

`iter_unshard(step, shards)` all-gathers one unit's flat shard buffer over the shard
axes, yields its leaves (with tensor parallelism, each leaf's blocks gathered over the
tensor-parallel axes too), then frees it before the next unit: a consumer that writes
each leaf out (`sf.hf.save_pretrained`) never holds more than one unit's full
parameters. `unshard_params` keeps them all. It is collective: every rank of the mesh
iterates it to the end, in the same order. The gather is exact (an export): a compressed
all-gather format (`MixedPrecision.all_gather_dtype`) is for training steps only.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .. import _tree
from .._blocks import gather_blocks
from .autograd import plain
from .gather import gather_full
from .plan import Plan

__all__ = ["iter_unshard"]


def iter_unshard(step, shards) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield `(leaf index, full leaf)` for every leaf of `shards`: the sharded leaves unit by
    unit, then the leaves every rank keeps whole. A yielded tensor may be a view of a buffer
    reused after the next `next()`: clone it to keep it. No autograd."""
    plan: Plan = step._plan_for(shards)
    _, leaves, _ = _tree.flatten_with_paths(shards)
    mesh = step.mesh
    group = mesh.group(step.config.shard_axes)

    def whole(i: int, x: torch.Tensor) -> torch.Tensor:
        spec = plan.tp_specs[i] if plan.tp_specs else None
        return gather_blocks(x, spec, mesh) if spec is not None and spec.axes else x

    done = set()
    with torch.no_grad():
        for unit in plan.units:
            if not unit.sharded:
                continue
            views = gather_full(unit, group, [plain(leaves[l.index]) for l in unit.sharded], unit.dtype, mesh.device)
            for layout, view in zip(unit.sharded, views):
                done.add(layout.index)
                yield layout.index, whole(layout.index, view)
            del views, view
        for i, x in enumerate(leaves):
            if i not in done:
                yield i, whole(i, plain(x))
