"""Uneven local batches: the loss mean of `shard` and its `batch_weighting`.

The step returns a mean of the ranks' losses over the data axes. With equal local batches
that is the mean over the global batch; with unequal ones it is not (each example of a
smaller batch weighs more), so `batch_weighting` makes the choice explicit:

- `"equal"` (default): local batches must have the same size; checked on every call, and
  a ShardingError on every rank names each rank's size otherwise;
- `"mean_of_means"`: the mean of the per-rank means, whatever the sizes (not checked);
- `"global_mean"`: each rank's loss weighted by its batch size, `sum(n_r * loss_r) /
  sum(n_r)`: the mean over the global batch, as one process computes it on the
  concatenated batch (for a `loss_fn` that returns the mean over its batch).

[Note: the batch size rides on the loss all-reduce]
No collective is added: under "equal" and "global_mean" the loss all-reduce that `shard`
issues anyway carries, in float64, `[loss (or n * loss), n, n * n, unknown]` instead of
the loss alone (32 bytes instead of the loss' 4 for a float32 scalar). Every rank reads
the same sums, so every rank takes the same decision: the sizes are equal exactly when
`K * sum(n^2) == sum(n)^2` over the K ranks that know theirs (Cauchy-Schwarz; integers,
exact in float64). Only on the error path does one more all-gather name each rank's size.
The loss is summed in float64 and cast back to its dtype, so a float32 loss may differ
from a float32 sum by its last bit. "mean_of_means" keeps the loss-only all-reduce of the
loss' dtype. On meta or fake tensors (`sf.estimate`) nothing can be read, and nothing is
checked.

[Note: the equal-size check does not stall an accelerator]
Reading the sums back is a host sync. On the CPU it costs nothing (gloo's all-reduce has
finished when it returns), and "equal" checks at once. On an accelerator the check of one
step is read at the start of the next step's loss mean (`settle`), when that step's
all-reduce has long finished, so the host never waits on the stream for it: the error
comes one step late, on every rank alike. "global_mean" needs the sums for the backward's
weights, and reads them at once on every device.

A rank's batch size is the leading dim of the tensor leaves of its batch (0-dim leaves
aside). When the leaves disagree, there are none, or the batch is vmapped (per-example
gradients) the size is unknown: "equal" then checks nothing if no rank knows its size (and
raises if only some do); "global_mean" raises, since it cannot weigh.
"""

from __future__ import annotations

import warnings

import torch

from .. import _tree
from .._backend import ops
from .._errors import ShardingError, SpecError
from .view import stacked

__all__ = ["WEIGHTINGS", "UNKNOWN", "batch_is_vmapped", "check_weighting", "local_batch_size", "micro_batch_weights",
           "reduce_loss", "settle"]

WEIGHTINGS = ("equal", "mean_of_means", "global_mean")
UNKNOWN = -1


def check_weighting(value) -> str:
    """`shard(batch_weighting=...)`, checked."""
    if value not in WEIGHTINGS:
        raise SpecError(
            f"shard: batch_weighting must be one of {WEIGHTINGS}, got {value!r:.60}.\nFix: 'equal' (local batches "
            f"of one size, checked), 'global_mean' (the mean over the global batch: each rank's loss weighted by "
            f"its batch size) or 'mean_of_means' (the mean of the per-rank means)."
        )
    return value


def batch_is_vmapped(batch) -> bool:
    """Whether a tensor leaf of the batch is batched by vmap (its size is the vmapped one's)."""
    return any(isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and stacked(leaf) for leaf in _tree.flatten(batch)[0])


def micro_batch_weights(micro_batches, weighting: str, group, stats) -> list[float | None]:
    """The weight of each micro-batch's loss in `Shard.accumulate`'s mean: None (1/m), or
    with "global_mean" its share of the global examples (one small all-reduce of the local
    sizes), so that the step is the mean over all the step's examples, as one big batch."""
    m = len(micro_batches)
    if weighting != "global_mean":
        return [None] * m
    sizes = [local_batch_size(b) for b in micro_batches]
    if UNKNOWN in sizes:
        raise ShardingError(
            f"shard.accumulate(batch_weighting='global_mean'): micro-batches {[i for i, n in enumerate(sizes) if n == UNKNOWN]} "
            f"have no batch size ({_SIZE}), so they cannot be weighted by it.\nFix: give the batch tensor "
            f"leaves one leading (batch) dim.")
    local = torch.tensor(sizes, dtype=torch.float64)
    stats.collective("all_reduce", local.numel() * local.element_size(), group)
    total = ops.all_reduce(group, local)
    if total.is_meta:  # sf.estimate: shapes only
        return [None] * m
    counts = total.tolist()
    if sum(counts) == 0:
        raise ShardingError("shard.accumulate(batch_weighting='global_mean'): every micro-batch is empty on "
                            "every rank.\nFix: pass at least one example.")
    return [c / sum(counts) for c in counts]


def local_batch_size(batch) -> int:
    """The leading dim shared by the batch's tensor leaves (0-dim leaves aside), or UNKNOWN."""
    sizes = set()
    for leaf in _tree.flatten(batch)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        if stacked(leaf):  # vmap over the batch: its leading dim is not the batch size
            return UNKNOWN
        sizes.add(int(leaf.shape[0]))
    return sizes.pop() if len(sizes) == 1 else UNKNOWN


def _readable(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return not x.is_meta and not is_fake(x)


class EqualCheck:
    """The "equal" check of one step, read later on an accelerator. [Note: the equal-size
    check does not stall an accelerator]"""

    def __init__(self, tail: torch.Tensor, n: int, group):
        self.tail, self.n, self.group = tail, n, group

    def verify(self) -> None:
        sum_n, sum_nn, unknown = (int(v) for v in self.tail.tolist())
        size = self.group.size
        if unknown == size or (unknown == 0 and size * sum_nn == sum_n * sum_n):
            return
        raise ShardingError(_unequal(self.group, self.n, self.tail.device))


def _defer(device: torch.device) -> bool:
    return device.type != "cpu"


def settle(pending: EqualCheck | None) -> None:
    """Read a previous step's deferred check (None: nothing pending)."""
    if pending is not None:
        pending.verify()


def reduce_loss(loss: torch.Tensor, n: int, weighting: str, group, stats):
    """The loss mean over the data group, this rank's weight in it when that is not 1/N
    (`global_mean` with unequal sizes, else None), and the "equal" check left to read at
    the next step (on an accelerator, else None).

    Raises:
      ShardingError: on every rank of the group, "equal" with unequal (or partly unknown)
        sizes, "global_mean" with unknown sizes or an empty global batch.
    """
    size = group.size
    if weighting == "mean_of_means" or size == 1:
        stats.collective("all_reduce", loss.numel() * loss.element_size(), group)
        return ops.all_reduce(group, loss) / size, None, None
    value = loss.reshape(-1).to(torch.float64)
    if weighting == "global_mean":  # an empty batch's (NaN) mean counts 0 times
        value = value * n if n > 0 else torch.zeros_like(value)
    meta = torch.tensor([n, n * n, 0] if n != UNKNOWN else [0, 0, 1], dtype=torch.float64)
    packed = torch.cat([value, meta.to(value.device)])
    stats.collective("all_reduce", packed.numel() * packed.element_size(), group)
    total = ops.all_reduce(group, packed)
    sums, tail = total[:-3], total[-3:]
    if not _readable(total):  # sf.estimate: shapes only
        return (sums / size).to(loss.dtype).reshape(loss.shape), None, None
    if weighting == "equal":
        mean = (sums / size).to(loss.dtype).reshape(loss.shape)
        check = EqualCheck(tail, n, group)
        if _defer(total.device):  # [Note: the equal-size check does not stall an accelerator]
            return mean, None, check
        check.verify()
        return mean, None, None
    sum_n, sum_nn, unknown = (int(v) for v in tail.tolist())
    if unknown or sum_n == 0:
        raise ShardingError(_unweighable(group, n, value.device, unknown))
    weight = None if size * sum_nn == sum_n * sum_n else max(n, 0) / sum_n
    return (sums / sum_n).to(loss.dtype).reshape(loss.shape), weight, None


def _sizes(group, n: int, device) -> str:
    """Each rank's batch size (one all-gather, on the error path only)."""
    sizes = ops.all_gather(group, torch.tensor([float(n)], dtype=torch.float64, device=device)).tolist()
    return ", ".join(f"rank {r}: {'unknown' if s == UNKNOWN else int(s)}" for r, s in zip(group.ranks, sizes))


_SIZE = ("a rank's batch size is the leading dim of its batch's tensor leaves; 'unknown' when they disagree or "
         "there are none")


def _unequal(group, n: int, device) -> str:
    k = group.size
    return (
        f"shard: the local batches differ in size across the data axes ({_sizes(group, n, device)}; {_SIZE}). "
        f"The step's loss is the mean of the ranks' losses, which with unequal batches is not the mean over "
        f"the global batch: an example of a smaller batch would weigh more.\nFix: give every rank the same "
        f"number of examples (drop or pad the global batch to a multiple of {k}; sf.scatter refuses splits that "
        f"leave a rank empty); or choose: sf.shard(..., batch_weighting='global_mean') for the mean over the "
        f"global batch (each rank's loss weighted by its batch size), batch_weighting='mean_of_means' for the "
        f"mean of the per-rank means."
    )


def _unweighable(group, n: int, device, unknown: int) -> str:
    if unknown:
        why = "no rank knows its batch size" if unknown == group.size else "some ranks do not know their batch size"
    else:
        why = "every rank's batch is empty"
    return (
        f"shard(batch_weighting='global_mean'): {why} ({_sizes(group, n, device)}; {_SIZE}), so the ranks' "
        f"losses cannot be weighted by their batch sizes.\nFix: give the batch tensor leaves one leading "
        f"(batch) dim, or use batch_weighting='equal' / 'mean_of_means'."
    )


# [Note: vmap over the batch with per-rank examples]
# `vmap(grad(step), in_dims=(None, 0))` batches the step: slot i's loss is the mean over the
# data axes of every rank's i-th example, and its gradient reduce-scatter sums slot i over
# the ranks (a batched collective, as in JAX). That is each example's own gradient only
# when all ranks of the data axes hold the same examples; with the normal data-parallel
# layout (each rank its own examples) it is the mean over ranks of their i-th examples'
# gradients. The first vmapped call of a step on each rank checks which case it is: one
# all-reduce (max) of two float64s, a fingerprint of the local batch and its negation, over
# the data axes; different fingerprints warn, naming `sf.per_example_grads`. Later calls
# and meta runs (`sf.estimate`) check nothing.


def warn_if_examples_differ(batch, group, data_axes) -> None:
    """[Note: vmap over the batch with per-rank examples] A UserWarning on every rank when
    the ranks of `group` (the data axes) hold different vmapped examples."""
    functorch = torch._C._functorch
    leaves = []
    for x in _tree.flatten(batch)[0]:
        if not isinstance(x, torch.Tensor):
            continue
        while functorch.is_functorch_wrapped_tensor(x):
            x = functorch.get_unwrapped(x)
        if x.is_meta or type(x) not in (torch.Tensor, torch.nn.Parameter):  # meta or fake: nothing to read
            return
        leaves.append(x)
    if not leaves or group.size == 1:
        return
    with torch._C._DisableFuncTorch(), torch.no_grad():
        h = torch.zeros((), dtype=torch.float64, device=leaves[0].device)
        for x in leaves:
            flat = x.detach().reshape(-1).to(torch.float64)
            h = h + flat.sum() + (flat * torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64,
                                                         device=flat.device)).sum()
        both = ops.all_reduce(group, torch.stack([h, -h]), "max")
    if float(both[0]) != -float(both[1]):
        warnings.warn(
            f"shard: vmap over the batch with different examples on the ranks of the data axes {list(data_axes)}: "
            f"vmap slot i of the step is the mean over those ranks of their i-th examples (its gradient "
            f"reduce-scatter sums slot i over the ranks), not one example's gradient.\nFor every example's own "
            f"gradient, use sf.per_example_grads(step, shards, batch) (each shard owner receives every example's "
            f"block; docs/autodiff.md §12). If the mean per slot is what you want, this warning can be filtered "
            f"(it is raised on the first vmapped call only).", UserWarning, stacklevel=3)

