"""Gradient reduction of `shard`: plain functions with explicit arguments.

As FSDP2's `foreach_reduce`, these take the buffers, groups and dtypes they work on as
arguments and keep no state: the runtime (runtime.py) decides when to call them. A unit's
sharded gradients leave a rank as one reduce-scatter of the packed `(k, *lead, S)` buffer
(layout: plan.py); HSDP and tensor parallelism then complete the `(*lead, S)` result in
place with all-reduces ([Note: FSDP x TP] in tp.py); whole (replicated) leaves are
all-reduced, one collective per set of axes.
"""

from __future__ import annotations

import functools

import torch

from .._backend import ops
from .._errors import NonFiniteError
from .._quant import Wire
from . import qgz
from .plan import LeafLayout, UnitPlan, unpack_shard_grads

__all__ = ["Stats", "reduce_scatter", "finish_reduce", "shard_grads", "zero_shard_grads", "all_reduce_replicated",
           "check_finite", "raise_nonfinite"]


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class Stats:
    """`step.stats()`: bytes and count of the collectives issued, and the most bytes of
    gathered (unsharded) parameters alive at once. With quantized gradients
    (`reduce_scatter_dtype`), `reduce_scatter_bytes` counts the encoded buffer handed to the
    all-to-all that replaces the reduce-scatter ([Note: qgZ] in qgz.py)."""

    KEYS = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "num_collectives", "peak_gathered_bytes")

    def __init__(self):
        self.reset()

    def reset(self):
        self.values = dict.fromkeys(self.KEYS, 0)
        self.live = 0

    def collective(self, kind: str, nbytes: int, group=None) -> None:
        """Count a collective; an all-reduce over a one-rank `group` sends nothing (ops makes
        it a copy) and is not counted."""
        if group is not None and group.size == 1:
            return
        self.values[f"{kind}_bytes"] += nbytes
        self.values["num_collectives"] += 1

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.values["peak_gathered_bytes"] = max(self.values["peak_gathered_bytes"], self.live)


def reduce_scatter(packed: torch.Tensor, group, stats: Stats, out: torch.Tensor | None = None,
                   wire: Wire | None = None) -> ops.Pending:
    """Start the reduce-scatter (sum) of a packed `(k, *lead, S)` gradient buffer over the
    shard group; the result is this rank's `(*lead, S)` (written into `out` if given).

    The one entry of the eager gradient reduction, which picks its implementation: with a
    `wire` format over more than one rank, ZeRO++'s qgZ (`qgz.reduce_scatter`: encoded rows,
    one all-to-all, decoded sum; [Note: qgZ] in qgz.py); else the plain sum,
    `ops.reduce_scatter_async` (over a gloo group of two an exchange and an add: [Note:
    gloo's two-rank collectives] in ops.py). Either way an `ops.Pending`; `stats` counts
    the buffer handed over. The traced step's `GatherFlat.backward` mirrors it in graph ops,
    its qgZ ending in the same `qgz.decoded_sum`."""
    if wire is not None and group.size > 1:
        return qgz.reduce_scatter(packed, group, wire, stats, out=out)
    stats.collective("reduce_scatter", _nbytes(packed))
    return ops.reduce_scatter_async(group, packed, out=out)


def finish_reduce(flat: torch.Tensor, *, replica_regions, regions, mesh, stats: Stats, fix: float = 1.0) -> None:
    """After the reduce-scatter, in place on the `(*lead, S)` shard gradient: the sum over
    the other data axes (HSDP replicas) for the shard-buffer `replica_regions` of the leaves
    replicated there ([Note: expert parallelism]), then over the tensor-parallel axes for
    the `regions` of the leaves they replicate ([Note: FSDP x TP]); then the loss mean's
    rounding `fix` ([Note: the loss mean's 1/N])."""
    for axes, start, stop in replica_regions + regions:
        region = flat.narrow(-1, start, stop - start)
        stats.collective("all_reduce", _nbytes(region))
        region.copy_(ops.all_reduce(mesh.group(axes), region))
    if fix != 1.0:
        flat.mul_(fix)


def shard_grads(plan: UnitPlan, flat: torch.Tensor, index: int, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """The reduced `(*lead, S)` buffer -> this rank's shard gradients in the leaves' dtypes
    (views of `flat` where no cast is needed)."""
    grads = unpack_shard_grads(plan, flat, index, lead)
    return [g.to(layout.dtype) for layout, g in zip(plan.sharded, grads)]


def zero_shard_grads(plan: UnitPlan, index: int, device, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Zeros shaped like this rank's shard gradients (and the whole leaves' gradients) of a
    unit whose reduction is held back (`accumulate(mode="reduce_once")`)."""
    out = [torch.zeros(lead + l.local_shape(index, plan.k), dtype=l.dtype, device=device) for l in plan.sharded]
    out.extend(torch.zeros(lead + l.shape, dtype=l.dtype, device=device) for l in plan.replicated)
    return out


def all_reduce_replicated(layouts: tuple[LeafLayout, ...], grads: list, *, shard_axes: tuple[str, ...], mesh,
                          reduce_dtype: torch.dtype | None, device, lead: tuple[int, ...], stats: Stats,
                          fix: float = 1.0) -> list:
    """Gradients of whole leaves (None: zeros) summed over the shard axes and the other
    data and tensor-parallel axes each leaf is replicated over: one flat all-reduce per set
    of axes, in `reduce_dtype` (default: at least float32), cast back to each leaf's dtype."""
    filled = [
        (g if g is not None else torch.zeros(lead + layout.shape, dtype=layout.dtype, device=device))
        for layout, g in zip(layouts, grads)
    ]
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, layout in enumerate(layouts):
        if layout.dtype.is_floating_point:
            by_axes.setdefault(shard_axes + layout.replica_axes + layout.reduce_axes, []).append(i)
    for axes, floats in by_axes.items():
        group = mesh.group(axes)
        if group.size == 1:
            if fix != 1.0:
                for i in floats:
                    filled[i] = filled[i] * fix
            continue
        dtype = reduce_dtype or functools.reduce(torch.promote_types, (filled[i].dtype for i in floats), torch.float32)
        flat = torch.cat([filled[i].reshape(lead + (-1,)).to(dtype) for i in floats], dim=-1)
        stats.collective("all_reduce", _nbytes(flat))
        flat = ops.all_reduce(group, flat)
        if fix != 1.0:
            flat = flat * fix
        start = 0
        for i in floats:
            n = filled[i][(0,) * len(lead)].numel() if lead else filled[i].numel()
            filled[i] = flat.narrow(-1, start, n).reshape(filled[i].shape).to(filled[i].dtype)
            start += n
    return filled


def check_finite(values: torch.Tensor, what: str, *, group, stats: Stats) -> None:
    """`shard(check_finite=True)`: raise NonFiniteError on every rank of `group` if
    `values` holds a NaN/Inf on any of them (one tiny all-reduce + one on failure)."""
    if values.is_meta:  # sf.estimate: the flag's all-reduce is counted; there is nothing to check
        stats.collective("all_reduce", _nbytes(torch.empty(1)), group)
        return
    bad = torch.tensor([0.0 if bool(torch.isfinite(values).all()) else 1.0], device=values.device)
    stats.collective("all_reduce", _nbytes(bad), group)
    if float(ops.all_reduce(group, bad, "max")) != 0.0:
        raise_nonfinite(what, bad, group)


def raise_nonfinite(what: str, bad: torch.Tensor, group) -> None:
    """Raise check_finite's NonFiniteError on every rank of `group`, naming the ranks whose
    flag `bad` ((1,) float32: 1.0 where `what` was not finite) is set (one all-gather)."""
    flags = ops.all_gather(group, bad).tolist()
    ranks = [r for r, f in zip(group.ranks, flags) if f]
    raise NonFiniteError(
        f"shard(check_finite=True): {what} is NaN or infinite on ranks {ranks} (this is rank "
        f"{group.ranks[group.index]}). The step stopped before returning, so no "
        f"parameter update was applied.\nFix: look at those ranks' batches; lower the learning rate, "
        f"or use a loss scale / bf16 instead of fp16."
    )
