"""The equivalence oracle: `shard` training must equal data-parallel training.

`assert_ddp_equivalent` runs the same loss function, parameters and per-step global
batches two ways and compares every step's loss and the parameters after each step:
- `shard` on a simulated mesh of each world size (every rank gets its `torch.chunk` of
  the global batch), against a single-process reference with DDP's semantics: the loss
  is the mean over ranks of each rank's loss on its chunk (equal to the global-batch
  loss when chunks are equal), see `reference_training`;
- or, with `ddp=True`, `shard` on the distributed backend against PyTorch's own
  `DistributedDataParallel`, both on the same real gloo processes (forked by
  `run_multiprocess`) with the same per-rank data, see `ddp_training`.

`fsdp2_training` is the other PyTorch reference: `fully_shard` (FSDP2), e.g. with a
`MixedPrecisionPolicy`, for comparing `shard(..., mixed_precision=...)`.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .. import _tree

__all__ = ["assert_ddp_equivalent", "reference_training", "ddp_training", "fsdp2_training", "local_batch",
           "ParamsModule"]


def local_batch(batch, rank: int, world: int):
    """Rank's `torch.chunk` (dim 0) of every tensor leaf of a global batch."""
    def take(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        chunks = torch.chunk(x, world, dim=0)
        return chunks[rank] if rank < len(chunks) else x[:0]

    return _tree.tree_map(take, batch)


def _micro(batch, k: int) -> list:
    """A rank's batch as `k` micro-batches: the same `torch.chunk` rule as `local_batch`."""
    return [local_batch(batch, i, k) for i in range(k)]


def _rows(batch) -> int | None:
    """Dim-0 size of the batch's first tensor leaf of rank >= 1 (None when it has none)."""
    for x in _tree.flatten(batch)[0]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    return None


def _check_split(batches, world: int, micro_batches: int) -> None:
    """Every rank, and every micro-batch of it, must get rows: the mean loss of none is NaN."""
    for t, batch in enumerate(batches):
        for rank in range(world):
            local = local_batch(batch, rank, world)
            rows = _rows(local)
            if rows is None:
                continue
            if rows == 0:
                raise ValueError(
                    f"assert_ddp_equivalent: step {t}'s batch of {_rows(batch)} rows gives rank {rank} of {world} "
                    f"no rows under torch.chunk (chunks of ceil(rows / {world})).\nFix: give at least "
                    f"{world} rows, in a number that torch.chunk splits into {world} non-empty chunks."
                )
            if any(_rows(m) == 0 for m in _micro(local, micro_batches)):
                raise ValueError(
                    f"assert_ddp_equivalent: step {t}: rank {rank}'s {rows} rows do not split into "
                    f"{micro_batches} non-empty micro-batches under torch.chunk.\nFix: give each rank at "
                    f"least {micro_batches} rows, e.g. {world * micro_batches} rows per batch."
                )


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


def _zero_frozen(grads, frozen):
    if frozen is None:
        return grads
    paths, leaves, treedef = _tree.flatten_with_paths(grads)
    return _tree.unflatten(treedef, [torch.zeros_like(g) if frozen(p) else g for p, g in zip(paths, leaves)])


def reference_training(loss_fn, params, batches, world: int, *, optimizer=None, lr: float = 0.1,
                       micro_batches: int = 1, frozen: Callable[[tuple], bool] | None = None):
    """Single-process training with DDP's loss semantics; returns (losses, params per step).

    Each step's loss is the mean over the `world` ranks of each rank's loss on its
    `torch.chunk` of the batch; with `micro_batches=k`, a rank's loss is the mean over its
    k micro-batches (DDP with `no_sync` on all but the last). Leaves where `frozen(path)`
    get a zero gradient.
    """
    init, update = _optimizer(optimizer, lr)
    state = init(params)

    def mean_loss(p, batch):
        per_rank = [sum(loss_fn(p, m) for m in _micro(local_batch(batch, r, world), micro_batches)) / micro_batches
                    for r in range(world)]
        return sum(per_rank) / world

    losses, history = [], []
    for batch in batches:
        grads, loss = torch.func.grad_and_value(mean_loss)(params, batch)
        params, state = update(params, _zero_frozen(grads, frozen), state)
        losses.append(float(loss))
        history.append(params)
    return losses, history


class ParamsModule(nn.Module):
    """A params pytree as an nn.Module (for DDP): leaves become nn.Parameters; leaves where
    `frozen(path)` get `requires_grad=False` (DDP neither reduces nor updates them)."""

    def __init__(self, params, loss_fn, frozen: Callable[[tuple], bool] | None = None):
        super().__init__()
        paths, leaves, self._treedef = _tree.flatten_with_paths(params)
        self._names = [f"p{i}" for i in range(len(leaves))]
        for name, path, leaf in zip(self._names, paths, leaves):
            trainable = frozen is None or not frozen(path)
            self.register_parameter(name, nn.Parameter(leaf.detach().clone(), requires_grad=trainable))
        self._loss_fn = loss_fn

    def tree(self):
        return _tree.unflatten(self._treedef, [getattr(self, n) for n in self._names])

    def forward(self, batch):
        return self._loss_fn(self.tree(), batch)


def ddp_training(loss_fn, params, batches, *, lr: float = 0.1, optimizer=None,
                 frozen: Callable[[tuple], bool] | None = None, micro_batches: int = 1, no_sync: bool = True):
    """DDP + a torch.optim optimizer on this rank's chunk of each global batch.

    Call it on every rank of an initialized default process group (e.g. inside
    `run_multiprocess`).

    Args:
      loss_fn: as for `assert_ddp_equivalent`.
      params: as for `assert_ddp_equivalent`.
      batches: as for `assert_ddp_equivalent`; rank r trains on `local_batch(batch, r,
        world)` of every batch.
      lr: the learning rate of the default optimizer, `torch.optim.SGD(lr=lr)`.
      optimizer: `parameters -> torch.optim.Optimizer`, instead of SGD.
      frozen: `key_path -> bool`; those leaves get `requires_grad=False`.
      micro_batches: split each rank's chunk into this many micro-batches (`torch.chunk`)
        and accumulate `loss / micro_batches` over them.
      no_sync: accumulate under `DDP.no_sync()` for all but the last micro-batch (one
        all-reduce per step); False runs the rank's whole chunk as one big batch instead
        (equal to accumulation only when the micro-batches have equal sizes).

    Returns:
      (losses, params per step): each step's loss averaged over ranks (as DDP averages
      gradients), and a detached copy of the parameter tree after each step.
    """
    import contextlib

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    world, rank = dist.get_world_size(), dist.get_rank()
    module = ParamsModule(params, loss_fn, frozen)
    model = DDP(module)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(trainable) if optimizer is not None else torch.optim.SGD(trainable, lr=lr)
    losses, history = [], []
    for batch in batches:
        opt.zero_grad()
        local = local_batch(batch, rank, world)
        pieces = _micro(local, micro_batches) if no_sync else [local]
        total = 0.0
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(piece)
                (loss / len(pieces)).backward()
            total = total + loss.detach()
        opt.step()
        mean = (total / len(pieces)).clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        history.append(_tree.tree_map(lambda t: t.detach().clone(), module.tree()))
    return losses, history


def fsdp2_training(module: nn.Module, batches, *, lr: float = 0.1, mp_policy=None,
                   units: Callable[[nn.Module], Sequence[nn.Module]] | None = None):
    """PyTorch FSDP2 (`fully_shard`) + SGD on this rank's chunk of each global batch.

    Call it on every rank of an initialized default process group. `units(module)` lists
    the submodules to `fully_shard` first (e.g. the transformer blocks, like shard's
    default units); the root is sharded last. A step is `module(*local_batch)` then
    `backward` and `SGD(lr).step()`.

    Args:
      module: the model (its weights are the initial parameters; it is sharded in place).
      batches: global batches (tuples of tensors); rank r gets `local_batch(batch, r, world)`.
      lr: SGD's learning rate.
      mp_policy: a `torch.distributed.fsdp.MixedPrecisionPolicy` (None: full precision).
      units: `module -> submodules` to shard as their own FSDP units.

    Returns:
      (losses, params per step): each step's loss averaged over ranks, and the full
      parameters after each step as `{dotted name: tensor}` (tied weights once, as
      `named_parameters` lists them; `sf.functional`'s key paths joined by dots).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for sub in (units(module) if units is not None else ()):
        fully_shard(sub, **kwargs)
    fully_shard(module, **kwargs)
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses, history = [], []
    for batch in batches:
        opt.zero_grad()
        loss = module(*local_batch(batch, rank, world))
        loss.backward()
        opt.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        history.append({name: p.full_tensor().detach().clone() for name, p in module.named_parameters()})
    return losses, history


def _shard_rank(step, mesh, params, batches, world: int, optimizer, lr, micro_batches: int, accumulate):
    """One rank's `shard` training: (losses, unsharded params per step)."""
    init, update = _optimizer(optimizer, lr)
    shards = step.shard_params(params)
    state = init(shards)
    losses, history = [], []
    for batch in batches:
        local = local_batch(batch, mesh.rank, world)
        if accumulate is None:
            grads, loss = torch.func.grad_and_value(step)(shards, local)
        else:
            grads, loss = step.accumulate(shards, _micro(local, micro_batches), mode=accumulate)
        shards, state = update(shards, grads, state)
        losses.append(float(loss))
        history.append(step.unshard_params(shards))
    return losses, history


def _default_atol(params) -> float:
    leaves = _tree.flatten(params)[0]
    if any(x.dtype == torch.float64 for x in leaves):
        return 1e-10
    if any(x.dtype in (torch.float16, torch.bfloat16) for x in leaves):
        return 1e-2
    return 1e-5


def _compare(where: str, rank: int, against: str, got, want, tol: float) -> None:
    """Raise on the first step / rank / leaf where `got` = (losses, history) leaves `want`."""
    (losses, history), (want_losses, want_history) = got, want
    for t in range(len(want_losses)):
        scale = max(1.0, abs(want_losses[t]))
        if not abs(losses[t] - want_losses[t]) <= tol * scale:  # NaN fails too
            raise AssertionError(
                f"shard diverges from {against} at {where}, step {t}, rank {rank}: loss {losses[t]!r} vs "
                f"{want_losses[t]!r} (tolerance {tol * scale:g})"
            )
        paths, leaves, _ = _tree.flatten_with_paths(history[t])
        want_leaves = _tree.flatten(want_history[t])[0]
        for path, a, b in zip(paths, leaves, want_leaves):
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            scale = max(1.0, b.double().abs().max().item() if b.numel() else 0.0)
            if not diff <= tol * scale:  # NaN fails too
                raise AssertionError(
                    f"shard diverges from {against} at {where}, step {t}, rank {rank}: "
                    f"params{_tree.keystr(path)} differs by {diff:.3g} (tolerance {tol * scale:g})"
                )


# DDP averages the ranks' gradients of their own mean losses: the mean of the per-rank
# means, also when the local batches differ in size (shard's default would refuse them).
_DDP_WEIGHTING = {"batch_weighting": "mean_of_means"}


def assert_ddp_equivalent(
    loss_fn: Callable,
    params,
    batches: Sequence,
    *,
    world_sizes: Sequence[int | Mapping[str, int]] = (1, 2, 4),
    steps: int = 3,
    optimizer=None,
    lr: float = 0.1,
    atol: float | None = None,
    ddp: bool = False,
    torch_optimizer: Callable | None = None,
    micro_batches: int = 1,
    accumulate: str | None = None,
    ddp_no_sync: bool = True,
    timeout: float = 60.0,
    **shard_kwargs,
) -> None:
    """Check that `sf.shard(loss_fn, ...)` trains exactly like data parallelism.

    For each world size, trains `steps` steps of `shard` (rank r gets
    `local_batch(batches[t], r, world)`, its `torch.chunk`) with SGD (`lr`) or the given
    `sf.optim` transformation, and compares every step's loss on every rank and every
    parameter after every step with data parallelism:
    - `ddp=False`: `shard` on a simulated mesh against `reference_training`, one process
      with DDP's semantics (the loss is the mean over ranks of each rank's mean loss);
    - `ddp=True`: `shard` on the distributed backend (`sf.init_mesh` in each of N gloo
      processes forked by `run_multiprocess`) against PyTorch's `DistributedDataParallel`
      (`ddp_training`) in the same processes, on the same per-rank data; rank r of one is
      compared with rank r of the other.

    Args:
      loss_fn: `loss_fn(params, batch) -> scalar`, the mean loss of a (local) batch.
      params: the initial parameter pytree.
      batches: global batches, one per step (repeated if fewer than `steps`). Every rank,
        and every micro-batch, must get at least one row under `torch.chunk`; uneven
        chunks are fine (each rank's loss is its own mean, as under DDP: the step is
        built with `batch_weighting="mean_of_means"` unless `shard_kwargs` says otherwise).
      world_sizes: an int N is the mesh `{"data": N}`; a dict is a mesh shape (e.g.
        `{"replica": 2, "shard": 2}` for HSDP with `data_axes=("replica", "shard"),
        shard_axes="shard"` in `shard_kwargs`). Data is split over all ranks.
      steps: number of training steps.
      optimizer: an `sf.optim` transformation for `shard` (default: SGD with `lr`).
      lr: the SGD learning rate (both sides).
      atol: tolerance, scaled by each value's magnitude (default: 1e-10 for float64
        params, 1e-5 for float32, 1e-2 for 16-bit).
      ddp: compare against real `DistributedDataParallel` on processes (see above).
      torch_optimizer: with `ddp=True`, `parameters -> torch.optim.Optimizer` for DDP, the
        counterpart of `optimizer` (give both or neither).
      micro_batches: split each rank's chunk into this many micro-batches (`torch.chunk`)
        and train with `step.accumulate`.
      accumulate: `step.accumulate`'s mode, "reduce_each" or "reduce_once" (default
        "reduce_each" when `micro_batches > 1`, else plain `grad_and_value`).
      ddp_no_sync: with `ddp=True` and micro-batches, DDP accumulates under `no_sync`;
        False gives DDP the rank's whole chunk as one big batch (equal micro-batch sizes
        only).
      timeout: with `ddp=True`, the collective timeout of the processes, in seconds.
      **shard_kwargs: passed to `sf.shard` (`units`, `reshard_after_forward`, `prefetch`,
        `replicated`, `frozen`, `data_axes`, `shard_axes`, ...). `frozen` leaves get
        `requires_grad=False` under DDP and a zero gradient in the reference; compare
        them with SGD (a weight-decaying optimizer moves zero-gradient leaves).

    Raises:
      AssertionError: naming the world size (and mesh), step, rank and leaf path of the
        first divergence, with the difference and the tolerance.
      ValueError: an option is inconsistent (e.g. only one of the two optimizers, or a
        rank that gets no rows of a batch).
      RankProcessError: with `ddp=True`, a rank process raised or hung.

    Example:
      >>> import torch
      >>> from shardfn.testing import assert_ddp_equivalent
      >>> from shardfn.testing.models import mlp_params, mlp_loss
      >>> g = torch.Generator().manual_seed(0)
      >>> params = mlp_params(g, [4, 8, 2], dtype=torch.float64)
      >>> batches = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
      ...             torch.randn(8, 2, generator=g, dtype=torch.float64)) for _ in range(2)]
      >>> assert_ddp_equivalent(mlp_loss, params, batches, world_sizes=(2,), steps=2)
      >>> assert_ddp_equivalent(mlp_loss, params, batches, world_sizes=(2,), steps=2, ddp=True,
      ...                       micro_batches=2, accumulate="reduce_once", prefetch=0)
    """
    if ddp and (optimizer is None) != (torch_optimizer is None):
        raise ValueError(
            "assert_ddp_equivalent(ddp=True): give both `optimizer` (sf.optim, for shard) and `torch_optimizer` "
            "(parameters -> torch.optim.Optimizer, for DDP), or neither (SGD with `lr` on both sides)."
        )
    if torch_optimizer is not None and not ddp:
        raise ValueError("assert_ddp_equivalent: `torch_optimizer` is for DDP; pass ddp=True too.")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"assert_ddp_equivalent: micro_batches must be a positive int, got {micro_batches!r}")
    if accumulate is None and micro_batches > 1:
        accumulate = "reduce_each"
    batches = list(batches)[:steps]
    if len(batches) < steps:
        batches = (batches * steps)[:steps]
    tol = _default_atol(params) if atol is None else atol
    frozen = shard_kwargs.get("frozen")
    for size in world_sizes:
        shape = dict(size) if isinstance(size, Mapping) else {"data": int(size)}
        world = math.prod(shape.values())
        where = f"world size {world}" + ("" if not isinstance(size, Mapping) else f" (mesh {shape})")
        _check_split(batches, world, micro_batches)
        if ddp:
            per_rank = _run_against_ddp(loss_fn, params, batches, shape, world, optimizer, torch_optimizer, lr,
                                        micro_batches, accumulate, ddp_no_sync, timeout, shard_kwargs)
            for rank, (ours, theirs) in enumerate(per_rank):
                _compare(where, rank, "DistributedDataParallel", ours, theirs, tol)
        else:
            reference = reference_training(loss_fn, params, batches, world, optimizer=optimizer, lr=lr,
                                           micro_batches=micro_batches, frozen=frozen)
            import shardfn as sf

            mesh = sf.local_mesh(shape)
            step = sf.shard(loss_fn, mesh, **{**_DDP_WEIGHTING, **shard_kwargs})
            per_rank = mesh.run(lambda: _shard_rank(step, mesh, params, batches, world, optimizer, lr,
                                                    micro_batches, accumulate))
            for rank, ours in enumerate(per_rank):
                _compare(where, rank, "data parallelism", ours, reference, tol)


def _run_against_ddp(loss_fn, params, batches, shape, world, optimizer, torch_optimizer, lr, micro_batches,
                     accumulate, ddp_no_sync, timeout, shard_kwargs):
    """On `world` gloo processes: DDP, then shard on `sf.init_mesh(shape)`; per rank (ours, DDP's)."""
    from ._multiprocess import run_multiprocess

    def body():
        import shardfn as sf

        theirs = ddp_training(loss_fn, params, batches, lr=lr, optimizer=torch_optimizer,
                              frozen=shard_kwargs.get("frozen"), micro_batches=micro_batches, no_sync=ddp_no_sync)
        mesh = sf.init_mesh(shape, timeout=timeout)
        step = sf.shard(loss_fn, mesh, **{**_DDP_WEIGHTING, **shard_kwargs})
        ours = _shard_rank(step, mesh, params, batches, world, optimizer, lr, micro_batches, accumulate)
        return ours, theirs

    return run_multiprocess(body, world, timeout=timeout + 10.0)
