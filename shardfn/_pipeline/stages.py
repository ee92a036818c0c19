"""Where a pipeline's layers live: one stacked tree, split over the pipeline axis.

[Note: stacked layers] The layers of a pipeline share one structure, so their parameters
are stacked: every leaf gets a leading layer dim (`L` layers). Without virtual stages a
leaf is `(L, ...)` under `P('stage')`: rank `r` holds layers `r*L/p .. (r+1)*L/p - 1`.
With `V` virtual stages a leaf is `(V, L/V, ...)` under `P(None, 'stage')`: chunk
`c = v*p + r` (Megatron's interleaving, chunk `c` on rank `c % p`) holds layers
`c*L/(pV) .. (c+1)*L/(pV) - 1`, which are row `v`, block `r` of the stack; the model's
layer order is the stack's row-major order either way. So `sf.scatter` /
`sf.checkpoint` with `stage_specs(...)` place the layers, and resharding to another stage
count (or to none, `P()`) is a checkpoint load with other specs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .. import _tree
from .._errors import ShardingError
from .._spec import P

__all__ = ["stack_layers", "unstack_layers", "stage_specs", "layer_view"]


def stack_layers(layers: Sequence[Any], virtual_stages: int = 1):
    """Stack per-layer parameter trees (same structure) into the pipeline's layout.

    Args:
      layers: `L` trees of tensors, one per layer, in model order.
      virtual_stages: `V`; the stack is `(V, L/V, ...)` when `V > 1`.

    Returns:
      One tree whose leaves are `(L, ...)` (or `(V, L/V, ...)`).

    Raises:
      ShardingError: the trees differ in structure, or `L` is not a multiple of `V`.
    """
    if not layers:
        raise ShardingError("stack_layers: no layers given.\nFix: pass a list of per-layer parameter trees.")
    first = _tree.flatten(layers[0])[1]
    for i, layer in enumerate(layers):
        if _tree.flatten(layer)[1] != first:
            raise ShardingError(f"stack_layers: layer {i} has another tree structure than layer 0; layers of a "
                                f"pipeline must share one structure.\nFix: keep different blocks (embedding, "
                                f"head) in pre= / post=.")
    if len(layers) % virtual_stages:
        raise ShardingError(f"stack_layers: {len(layers)} layers do not split into virtual_stages="
                            f"{virtual_stages} equal parts.\nFix: a layer count divisible by {virtual_stages}.")
    stacked = _tree.tree_map(lambda *xs: torch.stack(xs), *layers)
    if virtual_stages == 1:
        return stacked
    return _tree.tree_map(lambda x: x.reshape(virtual_stages, -1, *x.shape[1:]), stacked)


def unstack_layers(stacked, virtual_stages: int = 1) -> list:
    """The per-layer trees of a (global) stack, in model order: `stack_layers`' inverse."""
    leaves, treedef = _tree.flatten(stacked)
    if virtual_stages > 1:
        leaves = [x.reshape(-1, *x.shape[2:]) for x in leaves]
    return [_tree.unflatten(treedef, [x[i] for x in leaves]) for i in range(leaves[0].shape[0])]


def stage_specs(stacked, axis: str = "stage", virtual_stages: int = 1):
    """The spec tree of a stack: `P(axis)` per leaf, `P(None, axis)` with virtual stages."""
    spec = P(axis) if virtual_stages == 1 else P(None, axis)
    return _tree.tree_map(lambda _: spec, stacked)


def layer_view(local_leaves: list[torch.Tensor], virtual_stages: int) -> list[list[list[torch.Tensor]]]:
    """This rank's layers as `[v][layer][leaf]` tensors (views of the local stack)."""
    out = []
    for v in range(virtual_stages):
        rows = [x[v] if virtual_stages > 1 else x for x in local_leaves]
        out.append([[x[i] for x in rows] for i in range(rows[0].shape[0])])
    return out


def local_layer_count(local_leaves: list[torch.Tensor], virtual_stages: int, where: str) -> int:
    """Layers per chunk on this rank, checked: every leaf has the same leading dims."""
    dims = 2 if virtual_stages > 1 else 1
    counts = set()
    for x in local_leaves:
        if x.dim() < dims or (virtual_stages > 1 and x.shape[0] != virtual_stages):
            raise ShardingError(f"{where}: a stacked layer leaf of shape {tuple(x.shape)} lacks the leading "
                                f"{'(V, layers)' if dims == 2 else '(layers,)'} dims of virtual_stages="
                                f"{virtual_stages}.\nFix: build params['layers'] with "
                                f"sf.pipeline.stack_layers(layers, virtual_stages={virtual_stages}) and scatter it with "
                                f"pipe.scatter_params(params).")
        counts.add(int(x.shape[dims - 1]))
    if len(counts) != 1:
        raise ShardingError(f"{where}: the stacked layer leaves disagree on the number of layers ({sorted(counts)}"
                            f").\nFix: stack every leaf of params['layers'] with one leading layer dim.")
    return counts.pop()
