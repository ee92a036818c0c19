"""The per-rank machinery of `shard`: the schedule of the unit transitions, the resolution
of a parameter read inside `loss_fn` to its gathered leaf, and gradient reduction's
modes.

What one rank keeps is split by how long it lives:
- `Groups` (groups.py): process groups, indices and dtypes, fixed for a (plan, mesh, config);
- `Schedule` (schedule.py): which units to gather when (access order, prefetch), learned step to step;
- `StepMode` (schedule.py): what kind of call is running (one enum instead of flags);
- `UnitRuntime` (unit.py): one unit's lifecycle, buffers and its two states, `TrainingState` x
  `UnitState`, changed only by its named transitions ([Note: a unit's two states] in unit.py);
- `RankStep`: what the rank knows of the current step, built fresh each step;
- `RankState`: the above together. Its transitions `pre_forward` / `post_forward` /
  `pre_backward` / `post_backward` decide when each unit's transitions of the same names
  run; the autograd Functions of autograd.py call them and nothing else of the schedule.
- `Reducer` (reducer.py): a unit's gradients -> its shard gradients, deferred or at once;
  the collectives themselves are plain functions in reduce.py.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import _tree
from .._backend import flight
from .._compile import not_traced
from .._errors import ShardingError
from . import gather, reduce, tp
from .autograd import GatherUnit, LossMean, plain
from .batch import UNKNOWN
from .groups import Groups
from .held import Meter
from .plan import Plan
from .reducer import Reducer
from .schedule import Schedule, StepMode
from .unit import UnitRuntime
from .view import current_scope, stacked

__all__ = ["RankStep", "RankState"]

# [Note: backward order]
# The autograd engine runs ready nodes highest sequence number first. Unit k's GatherUnit
# node was created when unit k was first touched in the forward, after every op of unit
# k-1, so its backward (the reduce-scatter of unit k's gradients) runs before unit k-1's
# backward ops: that is where unit k-1 is re-gathered. The last unit is re-gathered by
# the backward of the loss (LossMean), which runs first of all. This fits units used one
# after another in the forward (a layer stack); the patterns that do not are handled as
# [Note: units used again later in the forward] says.

# [Note: no cycle through the autograd graph]
# The gathered leaves that `leaf` hands to loss_fn carry a GatherUnitBackward whose ctx
# holds this RankState, so keeping them in `unit.step.outputs` past the forward makes a
# cycle through the C++ autograd graph, which Python's collector cannot see: the step,
# its mesh and (on the simulated mesh) every gloo group and thread would outlive the
# last reference to them. The outputs are read only while loss_fn runs (`leaf` refuses
# later reads), so `post_forward` drops them; the graph itself lives as long as the loss.

# [Note: units used again later in the forward]
# The schedule frees a unit when the next one is entered, which assumes a unit's
# parameters are used before the next unit's (a layer stack). Two patterns break that,
# and each is handled rather than left to read freed memory:
# - a unit read again after other units (the root's tied head, a shared layer, units
#   interleaved by `units=`): the read gathers it again and pins it, so it stays gathered
#   until its own backward (its ops run in the backward before the node that would
#   re-gather it);
# - units read together, e.g. by `sf.functional`, which fetches all leaves of a block
#   before running it, when `units=` or `frozen=` split that block over several units:
#   inside `view.together()` units entered together do not free each other, and the
#   backward brings them back together; `together(held=True)` (a module's root leaves,
#   bound for its whole forward) pins them.
# - a leaf kept by loss_fn past the entry of other units and used later without being
#   read again (`ws = [p[0]["w"], p[1]["w"]]`, then `sum(ws)`): [Note: a view kept across units].

# [Note: a view kept across units]
# Freeing a unit resizes its buffer's storage to 0 bytes; a kernel reading a view of it
# afterwards reads freed memory (a segfault on CPU, an illegal address on CUDA), it does
# not raise. So before the forward frees a unit because another is entered, it asks the
# unit whether loss_fn may still hold one of the leaves it handed out (`views_held`: a
# Python reference beside `step.outputs`'s; autograd's saved tensors and views derived
# from a leaf are C++ references and do not count). If so, the free is deferred to the
# end of the forward (`step.deferred`), when loss_fn has returned; that costs memory in
# the forward, not correctness. The answer is this rank's own (a compiled loss_fn's
# resume frames hold leaves too, and on the simulated mesh one rank may run compiled
# while another warms up), so it never changes a collective: a deferred unit read again
# or prefetched is first released, as on a rank that freed it, and the backward finds
# every rank's units in the same states. Not seen: a view derived from a leaf
# (`p["w"].T`, `p["w"][0]`) kept while the leaf itself is dropped, and a leaf kept past
# the forward (returned in aux, stored in a global): its unit is freed after the forward
# or its backward. Read a leaf where it is used; return copies (docs/fsdp_design.md).


_READ = "a parameter read inside a shard step gathers its unit eagerly: a graph break"


@dataclasses.dataclass
class RankStep:
    """What one rank knows of the current step beside its units', built fresh each step."""

    leaves: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the shard leaves loss_fn's caller passed
    scope: object = None  # the `together` block being read ...
    scope_units: set[int] = dataclasses.field(default_factory=set)  # ... and its units
    scope_of: dict[int, object] = dataclasses.field(default_factory=dict)  # unit -> the `together` block it was entered in
    second_backward: bool = False  # a unit's gradient was differentiated ([Note: second order through shard])
    loss_weight: float | None = None  # this rank's weight in the loss mean, when not 1/N (batch.py)


class RankState:
    """Everything `shard` keeps for one rank and one plan: groups, schedule, unit
    runtimes, statistics, and the current step's mode and shard leaves."""

    def __init__(self, plan: Plan, mesh, config):
        self.plan = plan
        self.config = config
        self.mesh = mesh
        self.groups = Groups.build(plan, mesh, config)
        self.schedule = Schedule(plan.units, config.prefetch)
        self.stats = reduce.Stats()
        self.encoded = Meter()  # encoded send buffers alive ([Note: quantized all-gather] in gather.py)
        regather = config.reshard_after_forward and self.groups.hpz is None
        check = gather.should_check(self.groups.device, config.check_finite)
        self.units = [UnitRuntime(u, self.groups, self.stats, regather=regather and not u.is_root, check=check,
                                  encoded_meter=self.encoded) for u in plan.units]
        self.mode = StepMode.EAGER
        self.reducer = Reducer(self.groups, config, mesh, self.stats)
        # The loss must be the same on every tensor-parallel rank: checked on the first call.
        self.loss_checked = self.groups.tp_size == 1
        self.step = RankStep()  # this step's record, built fresh by begin_step
        self.calls = 0  # steps begun on this rank (the flight recorder's step label)
        self.started = 0.0  # time.time() at this step's begin_step
        self.timings = None  # the straggler check's per-rank times of this step (stats() shows them)
        self.grad_fix = 1.0  # exact / rounded 1/N of the loss mean's backward ([Note: the loss mean's 1/N])
        self.batch_size = UNKNOWN  # this call's local batch size (batch.py), set by the step
        self.batch_check = None  # batch.EqualCheck of the last step, read at the next one (on an accelerator)

    # -- step lifecycle -------------------------------------------------------------------
    def begin_step(self, leaves: list[torch.Tensor]) -> None:
        hold = self.mode.keeps_stats  # accumulate: the shards, and so their encoding, stay the step's
        shards = [[plain(leaves[layout.index]) for layout in unit.plan.sharded] for unit in self.units]
        with torch.no_grad():
            for unit, mine in zip(self.units, shards):
                unit.begin_step(mine, keep_encoded=hold)
        if not hold:
            self.stats.reset()
            self.encoded.reset()
        self.schedule.begin_step()
        self.step = RankStep(leaves=list(leaves))
        self.calls += 1
        flight.context.step = self.calls  # labels this step's collectives ([Note: flight recorder])
        self.started, self.timings = time.time(), None  # [Note: busy time] in stragglers.py

    def drop_encoded(self) -> None:
        """Forget every unit's encoded send buffer (the shards changed: a new step)."""
        for unit in self.units:
            unit.drop_encoded()

    def drop_held_grads(self) -> None:
        """Forget the gradient sums `accumulate(mode="reduce_once")` holds (a run that raised
        before its last micro-batch: the next step must not add them into its gradient)."""
        for unit in self.units:
            unit.grad_sum = None

    def post_forward(self) -> None:
        """The forward of the step is over: free the units it gathered (reshard_after_forward)."""
        self.schedule.in_forward = False
        for unit in self.units:  # [Note: no cycle through the autograd graph]
            unit.step.outputs = None
        if self.config.reshard_after_forward:
            for i in self.schedule.order:
                if not self.units[i].plan.is_root and not self.units[i].step.pinned:
                    self.units[i].post_forward()

    @not_traced(_READ)  # [Note: no whole-step graph] in shardfn/_compile.py
    def leaf(self, i: int) -> torch.Tensor:
        """What `loss_fn` sees for params leaf i: its full value, gathering its unit on
        first access (one GatherUnit node per unit and step)."""
        plan = self.plan
        if not self.schedule.in_forward:
            raise ShardingError(
                f"shard: params{_tree.keystr(plan.leaves[i].path)} was read outside the forward of the "
                f"step. Units are gathered only while loss_fn runs, and with reshard_after_forward=True "
                f"each unit's full parameters are released after the forward.\nFix: read parameters "
                f"inside loss_fn; for evaluation use step.unshard_params(shards)."
            )
        u = plan.unit_of[i]
        unit = self.units[u]
        if unit.step.outputs is None:
            order = unit.plan.sharded + unit.plan.replicated
            inputs = [self.step.leaves[l.index] for l in order]
            if unit.plan.frozen and stacked(inputs[0]):  # vmap over an ensemble
                with torch.no_grad():
                    outs = GatherUnit.apply(self, u, *inputs)
            elif unit.plan.frozen:  # gathered, but no gradient: no autograd node at all
                with torch.no_grad():
                    inputs = [plain(x) for x in inputs]
                    self.pre_forward(u, inputs)
                    outs = unit.views() + inputs[len(unit.plan.sharded):]
            else:
                outs = GatherUnit.apply(self, u, *inputs)
            unit.step.outputs = {l.index: o for l, o in zip(order, outs)}
        elif (unit.step.deferred or not unit.gathered) and not unit.step.stacked:  # released earlier in this forward
            if unit.step.deferred:  # released now, as on a rank that did not defer: [Note: a view kept across units]
                unit.post_forward()
            unit.reenter_forward()  # gathered again and pinned: [Note: units used again later in the forward]
        return unit.step.outputs[i]

    def loss_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss: the mean over the data axes (see LossMean)."""
        return LossMean.apply(loss, self)

    # -- the schedule ---------------------------------------------------------------------
    def pre_forward(self, u: int, inputs) -> None:
        """Forward: unit u is touched for the first time (inside GatherUnit.forward): free the
        units before it, gather it, prefetch the next."""
        unit = self.units[u]
        scope = current_scope()
        if scope is None or scope is not self.step.scope:
            self.step.scope, self.step.scope_units = scope, set()
        if scope is not None:
            unit.step.pinned = unit.step.pinned or scope.held
            self.step.scope_of[u] = scope
        if self.config.reshard_after_forward and not unit.plan.is_root:
            for i, other in enumerate(self.units):
                if (other is not unit and not other.plan.is_root and other.gathered
                        and not other.step.pinned and i not in self.step.scope_units):
                    if other.views_held():  # [Note: a view kept across units]
                        other.step.deferred = True
                    else:
                        other.post_forward()
        if scope is not None:
            self.step.scope_units.add(u)
        self.schedule.order.append(u)  # (here: a failure above leaves no IDLE unit in the order)
        unit.pre_forward(inputs)
        for nxt in self.schedule.prefetch_after(u):
            if self.units[nxt].step.deferred:  # as on a rank that freed it ([Note: a view kept across units])
                self.units[nxt].post_forward()
            self.units[nxt].prefetch_forward()

    def pre_backward(self) -> None:
        """Backward of the loss (LossMean): re-gather the units whose backward comes first."""
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(self.schedule.order) if not self.units[i].backward_done])

    def post_backward(self, u: int) -> None:
        """Backward of unit u's gather (its grads are complete; GatherUnit.backward): free it
        (and the frozen units used after it, whose backward ops have run), then bring the
        next ones. Its gradients are then reduced by `reduce_gradients`. In a second backward
        (after `pre_second_backward`) its gather's backward frees what that pass gathered."""
        if self.step.second_backward:
            self.units[u].post_second_backward()
        else:
            self.units[u].post_backward()
        order = self.schedule.order
        pos = order.index(u) if u in order else 0
        for i in order[pos + 1:]:
            if self.units[i].plan.frozen:
                self.units[i].release_frozen()
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(order[:pos]) if not self.units[i].backward_done])

    def pre_second_backward(self, u: int) -> None:
        """A second backward reaches unit u's gradient reduce-scatter (reverse-over-reverse;
        ReduceScatterUnit.backward): the first time in the step, gather every unit the step
        used again. Each stays gathered until its gather's backward in this pass frees it
        (`post_backward`): the pass reads units in no order the schedule knows
        ([Note: second order through shard] in autograd.py)."""
        self.check_second_order("reverse mode over the gradient (grad of grad)")
        if self.step.second_backward:
            return
        self.step.second_backward = True
        self.grad_fix = 1.0  # this pass's cotangents carry the loss mean's fix already (GatherCotangent)
        for i in self.schedule.order:
            self.units[i].pre_second_backward()

    def check_second_order(self, what: str) -> None:
        """Second order runs only over a step's plain backward (no accumulate hold, no
        deferred reduce-scatters)."""
        if self.mode not in (StepMode.EAGER, StepMode.ACCUMULATE):
            raise ShardingError(
                f"shard: {what} is not supported inside step.grad_and_value / sf.train_step or "
                f"step.accumulate(mode='reduce_once') (step mode {self.mode.value}).\nFix: differentiate "
                f"torch.func.grad(step) itself, e.g. torch.func.jvp(torch.func.grad(step), (shards, batch), "
                f"(v, zeros)) for a Hessian-vector product."
            )

    def _bring(self, upcoming: list[int]) -> None:
        need, ahead = self.schedule.backward_next(upcoming)
        scopes = {self.step.scope_of[i] for i in need if i in self.step.scope_of}
        need += [i for i in upcoming if i not in need and self.step.scope_of.get(i) in scopes]  # read together
        for i in need:
            self.units[i].pre_backward()
        for i in ahead:  # after the copy-out of `need`: its all-gather output is gone by then
            self.units[i].prefetch_backward()

    # -- gradients ------------------------------------------------------------------------
    def reduce_gradients(self, u: int, grads, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Unit u's full-leaf grads -> this rank's shard grads and all-reduced whole-leaf
        grads, as the step mode says (reducer.py)."""
        if self.step.second_backward:  # the HVP's reduction: exact ([Note: second order through shard])
            return self.reducer.reduce_linear(self.units[u], grads, self.grad_fix, lead)
        return self.reducer.reduce(self.units[u], grads, self.mode, self.grad_fix, lead)

    def finish_deferred(self, complete: bool = True) -> None:
        """Wait for the deferred reduce-scatters; when the backward completed, finish them."""
        self.reducer.finish(complete)

    # -- checks ---------------------------------------------------------------------------
    def check_loss(self, loss: torch.Tensor) -> None:
        """The loss is finite (with check_finite), and on the first call the same on every
        rank of the tensor-parallel axes (each computes the loss of the same data rank's
        batch), else the gradient would be wrong ([Note: FSDP x TP])."""
        if self.config.check_finite:
            reduce.check_finite(loss, "the loss", group=self.groups.all, stats=self.stats)
        if self.loss_checked:
            return
        self.loss_checked = True
        axes = self.plan.tp_axes
        group = self.mesh.group(axes)
        self.stats.collective("all_reduce", 4 * 8)  # two float64 fingerprints and their negations
        if loss.is_meta:  # sf.estimate's dry run: no values to compare (the all-reduce is counted above)
            return
        tp.check_same_loss(group, axes, loss)
