"""DP-SGD's aggregation (Abadi et al., 2016) with Opacus's semantics, on whole or sharded
per-example gradients.

[Note: DP-SGD on shards]
Input: per-example gradients, each leaf (B, *block) with a leading example dim, as
`sf.per_example_grads` gives them (every example's block of this rank's shard). Per step:

  ||g_b||   = sqrt(psum over the leaf's spec axes of the blocks' squared norms)
              (a leaf replicated over an axis counted once, [Note: the global norm of a
              sharded tree] in _clipping.py), one all-reduce of B numbers;
  c_b       = min(1, C / (||g_b|| + 1e-6))       (Opacus's `clip_factor`, max_grad_norm C)
  out       = (sum_b c_b g_b + sigma * C * z) / B   (std sigma * C; `loss_reduction="mean"`)

The noise z of each block is drawn where the block lives, from an explicit generator:
block i of leaf j (flattened order) at step t is
`torch.randn(block_shape, generator=torch.Generator(device).manual_seed(noise_seed(seed, t, j, i)))`,
i being the block's index under the leaf's spec (`torch.chunk` order of dim 0 over the
spec's axes, row-major over several; 0 for a whole leaf, which every rank then draws
alike). So the noise of a step is fixed by (seed, step, layout): a one-device reference
rebuilds it by concatenating the blocks (tests/fsdp/test_per_example.py does), and the
same seed on another number of ranks draws other (equally distributed) noise.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from .. import _tree
from .._spec import PartitionSpec, as_spec, block_index, is_spec
from .._errors import SpecError
from .base import GradientTransformation

__all__ = ["DPAggregateState", "dp_aggregate", "noise_seed"]

_MIX = 1_000_003
_MASK = (1 << 63) - 1


def noise_seed(seed: int, step: int, leaf: int, block: int) -> int:
    """The generator seed of block `block` of leaf `leaf` at step `step` ([Note: DP-SGD on shards])."""
    return (((int(seed) * _MIX + int(step)) * _MIX + int(leaf)) * _MIX + int(block)) & _MASK


class DPAggregateState(NamedTuple):
    count: torch.Tensor  # int64 (): steps taken, the noise's step index


def dp_aggregate(l2_norm_clip: float, noise_multiplier: float, seed: int, *, mesh: Any = None,
                 specs: Any = None, batch_size: int | None = None) -> GradientTransformation:
    """Clip each example's gradient to norm `l2_norm_clip`, sum, add Gaussian noise of std
    `noise_multiplier * l2_norm_clip`, divide by the batch size (Opacus's DP-SGD step;
    optax's `differentially_private_aggregate` with Opacus's clip factor).

    Args:
        l2_norm_clip: C, the per-example clip norm (> 0).
        noise_multiplier: sigma (>= 0); the noise std is sigma * C.
        seed: the noise key; step t of leaf j's block i draws from `noise_seed(seed, t, j, i)`.
        mesh: the mesh the per-example blocks live on (every rank calls `update`); None: whole leaves.
        specs: the leaves' spec tree (`step.specs`); default with a mesh: 0-dim leaves whole,
            others dim 0 over every mesh axis (`sf.shard`'s layout over all axes).
        batch_size: the divisor (Opacus's `expected_batch_size`); default: the examples' count B.

    Returns:
        A ``GradientTransformation`` whose ``update`` takes per-example gradients (leaves
        (B, *block)) and returns the private mean gradient (leaves (*block)).

    Example:
        >>> import torch, shardfn.optim as optim
        >>> opt = optim.chain(optim.dp_aggregate(1.0, 0.0, seed=0), optim.sgd(0.1))
        >>> params = {"w": torch.zeros(2)}
        >>> state = opt.init(params)
        >>> per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}  # norms 5 and 0.5
        >>> updates, state = opt.update(per_example, state, params)
        >>> [round(v, 4) for v in updates["w"].tolist()]  # -0.1 * ((0.6, 0.8) + (0.3, 0.4)) / 2
        [-0.045, -0.06]
    """
    if not l2_norm_clip > 0:
        raise ValueError(f"dp_aggregate: l2_norm_clip must be > 0, got {l2_norm_clip}")
    if not noise_multiplier >= 0:
        raise ValueError(f"dp_aggregate: noise_multiplier must be >= 0, got {noise_multiplier}")
    if mesh is None and specs is not None:
        raise ValueError("dp_aggregate: `specs` describe a mesh; pass `mesh` too.")
    cache: dict = {}

    def init(params):
        del params
        return DPAggregateState(torch.zeros((), dtype=torch.int64))

    def update(updates, state, params=None):
        del params
        paths, leaves, treedef = _tree.flatten_with_paths(updates)
        layout = cache.get(treedef)
        if layout is None:
            layout = cache[treedef] = _layout(updates, paths, leaves)
        b = leaves[0].shape[0]
        sq = per_example_sq_norms(leaves, layout, mesh)
        factors = (l2_norm_clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # (B,)
        t = int(state.count)
        std = noise_multiplier * l2_norm_clip
        out = []
        for j, (g, (_, block)) in enumerate(zip(leaves, layout)):
            summed = torch.einsum("b,b...->...", factors.to(g.dtype), g)
            if std:
                gen = torch.Generator(device=g.device).manual_seed(noise_seed(seed, t, j, block))
                summed = summed + std * torch.randn(summed.shape, generator=gen, dtype=g.dtype, device=g.device)
            out.append(summed / (batch_size or b))
        return _tree.unflatten(treedef, out), DPAggregateState(state.count + 1)

    def _layout(tree, paths, leaves):
        """Per leaf: (the axes its blocks are reduced over, or () for whole; its block index)."""
        sizes = {x.shape[0] if x.dim() else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise SpecError("dp_aggregate: every leaf must be per-example, (B, *block) with one B; got leading "
                            f"sizes {sorted(str(s) for s in sizes)}.\nFix: pass sf.per_example_grads(...).grads.")
        if mesh is None:
            return [((), 0)] * len(leaves)
        axes_all = tuple(mesh.axis_names)
        if specs is None:
            per_leaf = [PartitionSpec() if x.dim() == 1 else PartitionSpec(axes_all) for x in leaves]
        else:
            try:
                per_leaf = _tree.broadcast_prefix(specs, tree, what="specs", is_prefix_leaf=is_spec)
            except SpecError as e:
                raise SpecError("dp_aggregate: `specs` must be a pytree prefix of the per-example gradients with a "
                                f"PartitionSpec per leaf (like `step.specs`).\n{e}") from None
            per_leaf = [as_spec(s, "dp_aggregate: specs") for s in per_leaf]
        out = []
        for spec in per_leaf:
            index, count = 0, 1
            for entry in spec:
                i, n = block_index(entry, mesh.coords, mesh.shape)
                index, count = index * n + i, count * n
            out.append((spec.axes, index))
        return out

    return GradientTransformation(init, update)


def per_example_sq_norms(leaves: list[torch.Tensor], layout, mesh) -> torch.Tensor:
    """(B,): each example's squared norm over all leaves, psummed over the leaves' spec axes;
    a leaf replicated over an axis another leaf is sharded on is counted once (by the rank
    at coordinate 0 of that axis)."""
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
    b = leaves[0].shape[0]
    if mesh is None:
        return sum(_rows(x).to(dtype).pow(2).sum(1) for x in leaves)
    reduced = sorted({a for axes, _ in layout for a in axes}, key=mesh.axis_names.index)
    sq = torch.zeros(b, dtype=dtype, device=leaves[0].device)
    for x, (axes, _) in zip(leaves, layout):
        if all(mesh.coords[a] == 0 for a in reduced if a not in axes):
            sq = sq + _rows(x).to(dtype).pow(2).sum(1)
    if reduced:
        mesh.all_reduce(sq, tuple(reduced), op="sum")
    return sq



def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, *block) -> (B, numel(block)), empty blocks included."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))
