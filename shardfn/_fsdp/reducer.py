"""One rank's gradient reduction: a unit's full-leaf gradients -> its shard gradients.

`RankState.reduce_gradients` (the backward of a unit's gather, autograd.py) hands each
unit's gradients here; the step mode decides what happens to them:
- `ACCUMULATE_HOLD` (a micro-batch of `accumulate`, not the last): added to the unit's
  local sums, zeros returned;
- `DEFERRED` (`Shard.grad_and_value`): the reduce-scatter starts and the shard gradients
  are views of its output, completed by `finish` ([Note: deferred reductions]);
- otherwise at once: reduce-scatter, wait, the all-reduces that complete it.
Whole (replicated) leaves are all-reduced. The collectives are reduce.py's functions.
"""

from __future__ import annotations

import torch

from .._backend import flight
from . import reduce
from .plan import UnitPlan, pack_grads
from .schedule import StepMode

__all__ = ["Reducer"]

# [Note: deferred reductions]
# Under `Shard.grad_and_value` nothing reads the shard gradients before the backward
# returns (they are `torch.autograd.grad` outputs, no AccumulateGrad), so a unit's
# reduce-scatter can run while the backward of the units before it computes, and be
# waited once at the end, followed by the all-reduces that complete it in place (HSDP,
# tensor parallelism). Only when the shard gradients are views of its output: no cast,
# no finiteness check, no vmap. At most _IN_FLIGHT of them are in flight: the process group
# holds each one's packed (k, S) input, a whole unsharded unit, until it is waited, so a
# unit's reduce-scatter first waits for the one two units back (FSDP2 keeps one in flight).
# A quantized reduction ([Note: qgZ] in qgz.py) defers the same way: its all-to-all of
# encoded rows is in flight (holding a quarter of the packed bytes for int8), and the
# decode and float32 sum into the shard-gradient buffer happen at the wait.

_IN_FLIGHT = 2  # deferred reduce-scatters at once ([Note: deferred reductions])


class Reducer:
    """Gradient reduction for one rank and plan: the deferred reduce-scatters it owns
    until `finish`."""

    def __init__(self, groups, config, mesh, stats):
        self.groups, self.config, self.mesh, self.stats = groups, config, mesh, stats
        self.deferred: list = []  # (ops.Pending, (*lead, S) output, finish_reduce kwargs) per deferred unit

    def reduce(self, unit, grads, mode: StepMode, fix: float, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """`unit`'s (a UnitRuntime) full-leaf grads -> this rank's shard grads (sharded
        leaves) and all-reduced grads (whole leaves), as `mode` says; `fix`: the loss mean's
        1/N correction."""
        with flight.unit(unit.plan.name()):  # [Note: flight recorder]
            return self._reduce(unit, grads, mode, fix, lead)

    def _reduce(self, unit, grads, mode: StepMode, fix: float, lead: tuple[int, ...]) -> list[torch.Tensor]:
        g, cfg, plan = self.groups, self.config, unit.plan
        n = len(plan.sharded)
        sharded_grads, whole_grads = list(grads[:n]), list(grads[n:])
        reduce_dtype = g.reduce_dtype or unit.dtype
        if mode is StepMode.ACCUMULATE_HOLD:  # add to the unit's held sums, reduce on the last micro-batch
            unit.hold_grads(pack_grads(plan, sharded_grads, reduce_dtype, g.device, lead) if plan.sharded else None,
                            whole_grads if plan.replicated else None)
            return reduce.zero_shard_grads(plan, g.shard_index, g.device, lead)
        out: list[torch.Tensor] = []
        if plan.sharded:
            packed = pack_grads(plan, sharded_grads, reduce_dtype, g.device, lead)  # (k, *lead, S)
            packed = unit.with_held_packed(packed)  # + accumulate(mode="reduce_once")'s held sum
            finish = dict(replica_regions=plan.replica_regions, regions=plan.regions, mesh=self.mesh, stats=self.stats,
                          fix=fix)
            if self._can_defer(plan, mode, reduce_dtype, lead):  # [Note: deferred reductions]
                flat = torch.empty(packed.shape[1:], dtype=packed.dtype, device=packed.device)
                while len(self.deferred) >= _IN_FLIGHT:  # its packed input would stay alive until waited
                    _settle(self.deferred.pop(0))
                self.deferred.append((reduce.reduce_scatter(packed, g.shard, self.stats, out=flat, wire=g.reduce_wire),
                                      flat, finish))
                out.extend(reduce.shard_grads(plan, flat, g.shard_index, lead))  # filled by finish
            else:
                flat = reduce.reduce_scatter(packed, g.shard, self.stats, wire=g.reduce_wire).wait()  # (*lead, S)
                reduce.finish_reduce(flat, **finish)
                if cfg.check_finite:
                    reduce.check_finite(flat, f"the gradient of {plan.name()}", group=g.all, stats=self.stats)
                out.extend(reduce.shard_grads(plan, flat, g.shard_index, lead))
        if plan.replicated:
            whole_grads = unit.with_held_whole(whole_grads)
            out.extend(reduce.all_reduce_replicated(
                plan.replicated, whole_grads, shard_axes=cfg.shard_axes, mesh=self.mesh,
                reduce_dtype=g.reduce_dtype, device=g.device, lead=lead, stats=self.stats, fix=fix))
        return out

    def reduce_linear(self, unit, grads, fix: float, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """The reduction as the linear map it is, for tangents (forward mode over the
        gradient): the same sums as `reduce` in EAGER mode, done exactly (no wire format:
        straight-through), at once, without the held sums of `accumulate`
        ([Note: second order through shard] in autograd.py)."""
        g, plan = self.groups, unit.plan
        n = len(plan.sharded)
        out: list[torch.Tensor] = []
        if plan.sharded:
            packed = pack_grads(plan, list(grads[:n]), g.reduce_dtype or unit.dtype, g.device, lead)  # (k, *lead, S)
            flat = reduce.reduce_scatter(packed, g.shard, self.stats).wait()  # (*lead, S)
            reduce.finish_reduce(flat, replica_regions=plan.replica_regions, regions=plan.regions, mesh=self.mesh,
                                 stats=self.stats, fix=fix)
            out.extend(reduce.shard_grads(plan, flat, g.shard_index, lead))
        if plan.replicated:
            out.extend(reduce.all_reduce_replicated(
                plan.replicated, list(grads[n:]), shard_axes=self.config.shard_axes, mesh=self.mesh,
                reduce_dtype=g.reduce_dtype, device=g.device, lead=lead, stats=self.stats, fix=fix))
        return out

    def _can_defer(self, plan: UnitPlan, mode: StepMode, reduce_dtype, lead) -> bool:
        """[Note: deferred reductions]"""
        return (
            mode is StepMode.DEFERRED and not lead and not self.config.check_finite
            and all(layout.dtype == reduce_dtype for layout in plan.sharded)
        )

    def finish(self, complete: bool = True) -> None:
        """Wait for the deferred reduce-scatters; when the backward completed, finish them
        (after a failure, no further collective is started)."""
        pending, self.deferred = self.deferred, []
        for entry in pending:
            _settle(entry, complete)


def _settle(entry, complete: bool = True) -> None:
    """Wait for a deferred reduce-scatter `(work, flat, finish kwargs)`; if `complete`, finish
    its gradient in place (the HSDP / tensor-parallel all-reduces, the 1/N fix)."""
    work, flat, finish = entry
    work.wait()
    if complete:
        reduce.finish_reduce(flat, **finish)

