"""`per_example_grads`: every example's own gradient on a sharded model, each rank holding
its own examples (the normal data-parallel layout).

[Note: per-example gradients under shard]
`torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))` differentiates the *step*
once per vmap slot: slot i's loss is the mean over the data axes of every rank's slot-i
example, and its reduce-scatter sums slot i over the ranks, as a batched collective does
in JAX. With ranks holding different examples slot i is therefore the mean over ranks of
their i-th examples' gradients, not any one example's gradient. Per-example gradients need
a different reduction: nothing is summed over examples, and each shard owner receives
*every* example's piece of its shard.

`per_example_grads(step, shards, batch)` does that, simply:

1. the step's parameters are all-gathered unit by unit (`step.unshard_params`, Ψ bytes);
2. every rank runs `torch.func.vmap(torch.func.grad(loss_fn))` on its own B_local examples
   against the full parameters: (B_local, *leaf shape) per leaf;
3. per unit, those gradients are packed rank-major like a reduce-scatter's input,
   (k, B_local, S), and sent with one **all-to-all** over the shard axes (not a
   reduce-scatter): owner j receives block j of every rank's examples, (k, B_local, S) =
   (B, S) with B = k * B_local, and unpacks its shard of every example's gradient;
   leaves every rank keeps whole are all-gathered over the examples instead;
4. each example's squared norm is the psum over the shard axes of the owners' squared
   pieces (one all-reduce of B numbers; whole leaves counted once): no full gradient is
   ever gathered.

The global example order is rank-major: example `r * B_local + i` is example i of the rank
at index r of the shard group (`mesh.group(shard_axes).index`), the order of `torch.cat` of
the local batches in rank order.

Memory (per rank, parameter dtype): the full parameters Ψ, the local per-example full
gradients B_local * Ψ (plus what vmap keeps of the activations), one unit's send buffer
B_local * Ψ_unit at a time, and the result B * Ψ / k. The local per-example gradients of a
unit are dropped once sent. Bytes: `PerExampleGrads.stats` (from the backend's recording)
and docs/autodiff.md §12.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from . import _tree
from ._backend import ops
from ._errors import ShardingError, SpecError, bullet_list
from ._fsdp import api
from ._fsdp.plan import pack_grads, unpack_shard_grads

__all__ = ["PerExampleGrads", "per_example_grads"]

STATS_KEYS = ("all_gather_bytes", "all_to_all_bytes", "all_reduce_bytes", "num_collectives")


class PerExampleGrads(NamedTuple):
    """What `per_example_grads` returns on each rank (B = the global batch size)."""

    grads: Any  # like the shards; each leaf (B, *this rank's shard shape): its block of every example's gradient
    sq_norms: torch.Tensor  # (B,), the same on every rank: ||g_b||^2 of example b's full gradient
    losses: torch.Tensor  # (B,), the same on every rank: example b's loss
    aux: Any  # has_aux steps: this rank's examples' aux, vmapped (leading dim B_local); else None
    stats: dict  # bytes and count of the collectives this call issued (the backend's recording)

    @property
    def norms(self) -> torch.Tensor:
        """(B,): each example's gradient norm."""
        return self.sq_norms.sqrt()


def per_example_grads(step, shards, batch, *rest) -> PerExampleGrads:
    """Every example's gradient of a `sf.shard` step, each shard owner holding its block.

    Each rank passes its own examples (the normal data-parallel layout); nothing is averaged
    over examples or ranks. `loss_fn(params, example, *rest)` is called on ONE example
    (vmap removes the batch dim), as under `vmap(grad(step), in_dims=(None, 0))`.
    [Note: per-example gradients under shard] above explains the collectives.

    Args:
      step: a `sf.shard` step (FSDP: `shard_axes` equal to `data_axes`; no `param_specs`,
        `frozen` or `mixed_precision`).
      shards: this rank's shards (`step.shard_params(params)`).
      batch: this rank's examples, a tree of tensors with one leading size B_local, equal
        on every rank.
      *rest: passed to `loss_fn` as they are (not vmapped).

    Returns:
      A `PerExampleGrads`: `grads` (each leaf (B, *shard shape), example `r * B_local + i`
      being rank r's example i), `sq_norms` / `norms` and `losses` ((B,), the same on
      every rank), `aux`, `stats`.

    Raises:
      ShardingError: an option this path does not support, or batches of different sizes.

    Example:
      >>> import torch, shardfn as sf
      >>> from shardfn.testing.models import mlp_loss, mlp_params
      >>> mesh = sf.local_mesh({"data": 2})
      >>> step = sf.shard(mlp_loss, mesh)
      >>> params = mlp_params(torch.Generator().manual_seed(0), [3, 4, 2])
      >>> def per_rank():
      ...     g = torch.Generator().manual_seed(mesh.rank)  # each rank its own examples
      ...     batch = (torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g))
      ...     out = sf.per_example_grads(step, step.shard_params(params), batch)
      ...     return out.grads["layers"][0]["w"].shape, out.norms.shape
      >>> mesh.run(per_rank)[0]
      (torch.Size([8, 2, 4]), torch.Size([8]))
    """
    plan = api.plan_of(step, shards)
    _check_supported(step, plan)
    mesh = step.mesh
    group = mesh.group(step.config.shard_axes)
    k, index = group.size, group.index
    with ops.recording() as rec:
        b_local = _local_batch_size(step, group, batch)
        b = k * b_local
        full = step.unshard_params(shards)
        has_aux = step.config.has_aux

        def one(params, example):
            out = step.loss_fn(params, example, *rest)
            loss, aux = out if has_aux else (out, ())
            return loss, (loss.detach(), aux)

        grads, (losses, aux) = torch.func.vmap(torch.func.grad(one, has_aux=True), in_dims=(None, 0))(full, batch)
        aux = aux if has_aux else None
        del full
        local, _ = _tree.flatten(grads)
        del grads
        _, shard_leaves, treedef = _tree.flatten_with_paths(shards)
        result: list[torch.Tensor | None] = [None] * len(shard_leaves)
        dtype = functools.reduce(torch.promote_types, [x.dtype for x in local])  # the norms' dtype
        sq = torch.zeros(b, dtype=dtype, device=mesh.device)  # the owners' pieces: psummed below
        sq_whole = torch.zeros(b, dtype=dtype, device=mesh.device)  # whole leaves: the same everywhere
        for unit in plan.units:
            if unit.sharded:
                packed = pack_grads(unit, [local[l.index] for l in unit.sharded], unit.dtype, mesh.device,
                                    lead=(b_local,))  # (k, B_local, S): block j for owner j
                for layout in unit.sharded:
                    local[layout.index] = None  # sent: drop the full per-example gradients
                flat = ops.all_to_all(group, packed, split_dim=0, concat_dim=1)[0]  # (B, S), source-major
                del packed
                sq += flat.pow(2).sum(-1).to(dtype)  # padding is zeros
                for layout, piece in zip(unit.sharded, unpack_shard_grads(unit, flat, index, lead=(b,))):
                    result[layout.index] = piece
            for layout in unit.replicated:
                whole = ops.all_gather(group, local[layout.index], dim=0)  # (B, *shape)
                local[layout.index] = None
                sq_whole += _rows(whole).pow(2).sum(-1).to(dtype)
                result[layout.index] = whole
        for i, g in enumerate(local):  # leaves outside every unit's lists (none today): whole, gathered
            if g is not None and result[i] is None:
                whole = ops.all_gather(group, g, dim=0)
                sq_whole += _rows(whole).pow(2).sum(-1).to(dtype)
                result[i] = whole
        sq = ops.all_reduce(group, sq) + sq_whole
        losses = ops.all_gather(group, losses.detach(), dim=0)  # (B,)
    stats = dict.fromkeys(STATS_KEYS, 0)
    for c in rec.records:
        stats[f"{c.op}_bytes"] = stats.get(f"{c.op}_bytes", 0) + c.nbytes
        stats["num_collectives"] += 1
    return PerExampleGrads(_tree.unflatten(treedef, result), sq, losses, aux, stats)


def _check_supported(step, plan) -> None:
    config = step.config
    problems = []
    if tuple(config.shard_axes) != tuple(config.data_axes):
        replicas = [a for a in config.data_axes if a not in config.shard_axes]
        problems.append(f"HSDP: data axes {list(replicas)} are not shard axes (replicas hold other examples); "
                        f"use shard_axes == data_axes, or a step per replica group")
    if plan.tp_axes:
        problems.append(f"param_specs (tensor parallelism over {list(plan.tp_axes)})")
    if config.frozen is not None or any(unit.frozen for unit in plan.units):
        problems.append("frozen= leaves (leave them out of the params, closed over in loss_fn)")
    if config.mixed_precision is not None:
        problems.append("mixed_precision= (per-example gradients are computed in the shards' dtype)")
    if problems:
        raise ShardingError("sf.per_example_grads: this step uses options it does not support yet:\n"
                            + bullet_list(problems)
                            + "\nFix: build a plain FSDP step for it, sf.shard(loss_fn, mesh, data_axes=...), "
                              "on the same shards.")


def _local_batch_size(step, group, batch) -> int:
    """B_local: the one leading size of the batch's tensor leaves, checked equal on every
    rank of the shard group (one all-reduce of two int64s): the all-to-all needs it."""
    paths, leaves, _ = _tree.flatten_with_paths(batch)
    sizes = {_tree.keystr(p): x.shape[0]
             for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor) and x.dim() > 0}
    if not sizes or len(set(sizes.values())) != 1:
        raise SpecError(f"sf.per_example_grads: the batch's tensor leaves must share one leading size (the "
                        f"examples), got {sizes or 'no tensor with a dim'}.\nFix: pass this rank's examples "
                        f"stacked on dim 0, e.g. (x: (B_local, ...), y: (B_local, ...)).")
    b_local = next(iter(sizes.values()))
    both = ops.all_reduce(group, torch.tensor([b_local, -b_local], dtype=torch.int64, device=step.mesh.device),
                          "max")
    if int(both[0]) != int(-both[1]):
        raise ShardingError(f"sf.per_example_grads: ranks of the shard axes {list(step.config.shard_axes)} hold "
                            f"different numbers of examples (this rank {b_local}, from {int(-both[1])} to "
                            f"{int(both[0])}); the all-to-all to the owners needs one size.\nFix: give every rank "
                            f"the same number of examples (pad and mask, or drop the remainder).")
    return b_local


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, *shape) -> (B, numel(shape)), 0-dim and empty shapes included."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))
