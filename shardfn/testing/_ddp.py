"""The equivalence oracle: `shard` training must equal data-parallel training.

`assert_ddp_equivalent` runs the same loss function, parameters and per-step global
batches three ways and compares every step's loss and the parameters after each step:
- `shard` on a simulated mesh of each world size (every rank gets its `torch.chunk` of
  the global batch),
- a single-process reference with DDP's semantics: the loss is the mean over ranks of
  each rank's loss on its chunk (equal to the global-batch loss when chunks are equal),
- on request (`ddp=True`), PyTorch's own `DistributedDataParallel` on real gloo
  processes with the same per-rank data (see `ddp_training`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from .. import _tree

__all__ = ["assert_ddp_equivalent", "reference_training", "ddp_training", "local_batch", "ParamsModule"]


def local_batch(batch, rank: int, world: int):
    """Rank's `torch.chunk` (dim 0) of every tensor leaf of a global batch."""
    def take(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        chunks = torch.chunk(x, world, dim=0)
        return chunks[rank] if rank < len(chunks) else x[:0]

    return _tree.tree_map(take, batch)


def _sgd(lr: float):
    def update(params, grads, state):
        return _tree.tree_map(lambda p, g: p - lr * g, params, grads), state

    return (lambda params: None), update


def _optimizer(optimizer, lr):
    if optimizer is None:
        return _sgd(lr)
    from .. import optim

    def update(params, grads, state):
        updates, state = optimizer.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    return optimizer.init, update


def reference_training(loss_fn, params, batches, world: int, *, optimizer=None, lr: float = 0.1):
    """Single-process training with DDP's loss semantics; returns (losses, params per step)."""
    init, update = _optimizer(optimizer, lr)
    state = init(params)

    def mean_loss(p, batch):
        return sum(loss_fn(p, local_batch(batch, r, world)) for r in range(world)) / world

    losses, history = [], []
    for batch in batches:
        grads, loss = torch.func.grad_and_value(mean_loss)(params, batch)
        params, state = update(params, grads, state)
        losses.append(float(loss))
        history.append(params)
    return losses, history


class ParamsModule(nn.Module):
    """A params pytree as an nn.Module (for DDP): leaves become nn.Parameters."""

    def __init__(self, params, loss_fn):
        super().__init__()
        paths, leaves, self._treedef = _tree.flatten_with_paths(params)
        self._names = [f"p{i}" for i in range(len(leaves))]
        for name, leaf in zip(self._names, leaves):
            self.register_parameter(name, nn.Parameter(leaf.detach().clone()))
        self._loss_fn = loss_fn

    def tree(self):
        return _tree.unflatten(self._treedef, [getattr(self, n) for n in self._names])

    def forward(self, batch):
        return self._loss_fn(self.tree(), batch)


def ddp_training(loss_fn, params, batches, *, lr: float = 0.1, optimizer=None):
    """On each rank of an initialized default process group: DDP + a torch.optim optimizer
    (`optimizer(parameters)`, default SGD(lr)) on this rank's chunk of each global batch.
    Returns (losses, params per step), losses being the mean over ranks (as DDP's
    gradients are)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    world, rank = dist.get_world_size(), dist.get_rank()
    module = ParamsModule(params, loss_fn)
    model = DDP(module)
    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    losses, history = [], []
    for batch in batches:
        opt.zero_grad()
        loss = model(local_batch(batch, rank, world))
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        history.append(_tree.tree_map(lambda t: t.detach().clone(), module.tree()))
    return losses, history


def _shard_training(loss_fn, params, batches, world: int, optimizer, lr, shard_kwargs):
    import shardfn as sf

    mesh = sf.local_mesh({"data": world})
    step = sf.shard(loss_fn, mesh, **shard_kwargs)
    init, update = _optimizer(optimizer, lr)

    def train():
        shards = step.shard_params(params)
        state = init(shards)
        losses, history = [], []
        for batch in batches:
            grads, loss = torch.func.grad_and_value(step)(shards, local_batch(batch, mesh.rank, world))
            shards, state = update(shards, grads, state)
            losses.append(float(loss))
            history.append(step.unshard_params(shards))
        return losses, history

    return mesh.run(train)


def _default_atol(params) -> float:
    leaves = _tree.flatten(params)[0]
    if any(x.dtype == torch.float64 for x in leaves):
        return 1e-10
    if any(x.dtype in (torch.float16, torch.bfloat16) for x in leaves):
        return 1e-2
    return 1e-5


def assert_ddp_equivalent(
    loss_fn: Callable,
    params,
    batches: Sequence,
    *,
    world_sizes: Sequence[int] = (1, 2, 4),
    steps: int = 3,
    optimizer=None,
    lr: float = 0.1,
    atol: float | None = None,
    **shard_kwargs,
) -> None:
    """Check that `sf.shard(loss_fn, ...)` trains exactly like data parallelism.

    For each world size, runs `steps` steps of `shard` on a simulated mesh (each rank gets
    its `torch.chunk` of `batches[t]`) and of a single-process reference with DDP's loss
    semantics, using SGD (`lr`) or the given `sf.optim` transformation, and compares every
    step's loss on every rank and every parameter after every step.

    Raises:
      AssertionError naming the world size, step, leaf path and rank of the first
      divergence, with the difference and the tolerance (scaled by the values' magnitude).

    Example:
      >>> import torch
      >>> from shardfn.testing import assert_ddp_equivalent
      >>> from shardfn.testing.models import mlp_params, mlp_loss
      >>> g = torch.Generator().manual_seed(0)
      >>> params = mlp_params(g, [4, 8, 2], dtype=torch.float64)
      >>> batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
      ...             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(2)]
      >>> assert_ddp_equivalent(mlp_loss, params, batches, world_sizes=(2,), steps=2)
    """
    batches = list(batches)[:steps]
    if len(batches) < steps:
        batches = (batches * steps)[:steps]
    tol = _default_atol(params) if atol is None else atol
    for world in world_sizes:
        ref_losses, ref_history = reference_training(loss_fn, params, batches, world, optimizer=optimizer, lr=lr)
        per_rank = _shard_training(loss_fn, params, batches, world, optimizer, lr, shard_kwargs)
        for t in range(len(batches)):
            for rank, (losses, history) in enumerate(per_rank):
                scale = max(1.0, abs(ref_losses[t]))
                if not abs(losses[t] - ref_losses[t]) <= tol * scale:  # NaN fails too
                    raise AssertionError(
                        f"shard diverges from data parallelism at world size {world}, step {t}, rank {rank}: "
                        f"loss {losses[t]!r} vs reference {ref_losses[t]!r} (tolerance {tol * scale:g})"
                    )
                paths, got, _ = _tree.flatten_with_paths(history[t])
                want = _tree.flatten(ref_history[t])[0]
                for path, a, b in zip(paths, got, want):
                    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                    scale = max(1.0, b.double().abs().max().item() if b.numel() else 0.0)
                    if not diff <= tol * scale:  # NaN fails too
                        raise AssertionError(
                            f"shard diverges from data parallelism at world size {world}, step {t}, rank "
                            f"{rank}: params{_tree.keystr(path)} differs by {diff:.3g} (tolerance {tol * scale:g})"
                        )
