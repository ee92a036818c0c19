"""The per-rank machinery of `shard`: unit states, the gather/free/re-gather schedule, and
the resolution of a parameter read inside `loss_fn` to its gathered leaf.

What one rank keeps is split by how long it lives:
- `Groups` (groups.py): process groups, indices and dtypes, fixed for a (plan, mesh, config);
- `Schedule`: which units to gather when (access order, prefetch), learned step to step;
- `StepMode`: what kind of call is running (one enum instead of flags);
- `UnitRuntime`: one unit's buffer and `UnitState`;
- `RankState`: the above together, driven by the autograd Functions of autograd.py.
Gradient reduction itself is plain functions in reduce.py.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from .. import _tree
from .._backend import ops
from .._compile import not_traced
from .._errors import ShardingError
from .._shard_map import replicated_mismatch
from . import gather, reduce
from .batch import UNKNOWN
from .autograd import GatherUnit, LossMean, plain
from .view import stacked
from .view import current_scope
from .groups import Groups
from .held import Held, Meter
from .plan import Plan, UnitPlan, leaf_views, pack_grads

__all__ = ["Schedule", "StepMode", "UnitState", "UnitRuntime", "RankState", "Meter"]

# [Note: why storage is freed, not the tensor]
# A unit's full parameters are views of one flat unsharded buffer. Ops that used them
# saved those views for their backward. After a unit's forward we release the buffer's
# storage (`untyped_storage().resize_(0)`), and before its backward ops run we resize it
# back and all-gather into it again: the saved views see the data again without autograd
# knowing. Writes go through `.data` (a tensor sharing the storage but not the version
# counter), so the restore is not an in-place op that would invalidate saved tensors.
# `torch.func` refuses saved-tensor hooks, so this is the mechanism that works under
# `grad` / `vjp` as well as `loss.backward()`.

# [Note: backward order]
# The autograd engine runs ready nodes highest sequence number first. Unit k's GatherUnit
# node was created when unit k was first touched in the forward, after every op of unit
# k-1, so its backward (the reduce-scatter of unit k's gradients) runs before unit k-1's
# backward ops: that is where unit k-1 is re-gathered. The last unit is re-gathered by
# the backward of the loss (LossMean), which runs first of all. This fits units used one
# after another in the forward (a layer stack); the patterns that do not are handled as
# [Note: units used again later in the forward] says.

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
# A view kept past the entry of other units and used later without being read again is
# still freed; the backward's prefetches never give a freed unit storage before its data
# is there (they gather beside the buffer), so such a use fails loudly ("storage of size
# 0") instead of reading a buffer an all-gather is filling.

_READ = "a parameter read inside a shard step gathers its unit eagerly: a graph break"
_IN_FLIGHT = 2  # deferred reduce-scatters at once ([Note: deferred reductions])

# Schedule work (gathers, frees) also runs inside backward functions, where functorch
# would otherwise wrap the results of ops on our plain buffers.
_raw = ops.plain_mode


class UnitState(enum.Enum):
    SHARDED = "sharded"  # no unsharded storage
    SHARDED_POST_FORWARD = "sharded_post_forward"  # no unsharded storage; hpZ rows kept ([Note: hpZ])
    GATHERING = "gathering"  # storage allocated, all-gather in flight
    GATHERED = "gathered"  # full parameters valid


class StepMode(enum.Enum):
    EAGER = "eager"  # each unit's gradient is reduced and waited when its backward ends
    DEFERRED = "deferred"  # Shard.grad_and_value: reduce-scatters waited at the end ([Note: deferred reductions])
    ACCUMULATE = "accumulate"  # Shard.accumulate: as EAGER; stats() covers every micro-batch
    ACCUMULATE_HOLD = "accumulate_hold"  # accumulate(mode="reduce_once") before the last micro-batch: no reduction

    @property
    def keeps_stats(self) -> bool:
        return self in (StepMode.ACCUMULATE, StepMode.ACCUMULATE_HOLD)


class Schedule:
    """Which units to gather when: this step's first-access order, the previous step's
    (the prefetch plan), and how far ahead to prefetch. Pure bookkeeping: the RankState
    acts on its answers."""

    def __init__(self, units: tuple[UnitPlan, ...], prefetch: int):
        self.units = units
        self.prefetch = prefetch
        self.order: list[int] = []  # units in first-access order, this step
        self.prev_order: list[int] = []  # ... on the previous step
        self.in_forward = False

    def begin_step(self) -> None:
        self.prev_order, self.order = (self.order or self.prev_order), []
        self.in_forward = True

    def prefetch_after(self, u: int) -> list[int]:
        """Forward: the units to start gathering once unit u is entered."""
        if self.prefetch <= 0 or u not in self.prev_order:
            return []
        pos = self.prev_order.index(u)
        return [i for i in self.prev_order[pos + 1: pos + 1 + self.prefetch] if self.units[i].sharded]

    def backward_next(self, upcoming: list[int]) -> tuple[list[int], list[int]]:
        """Backward: of the units whose backward is still to come (next first), those to
        have gathered now — frozen ones (they have no node to do it for the next) up to
        the first trainable one — and `prefetch` more to start."""
        need = []
        for i in upcoming:
            need.append(i)
            if not self.units[i].frozen:
                break
        return need, upcoming[len(need): len(need) + self.prefetch]


@dataclasses.dataclass
class UnitStep:
    """What one unit knows of the current step, built fresh each step (nothing to reset)."""

    shards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # plain shard tensors (sharded leaves)
    outputs: dict[int, torch.Tensor] | None = None  # leaf index -> what loss_fn sees
    backward_done: bool = False
    stacked: bool = False  # gathered stacked shards (vmap over an ensemble): no schedule
    pinned: bool = False  # used again after other units in this forward: kept until its backward


@dataclasses.dataclass
class RankStep:
    """What one rank knows of the current step beside its units', built fresh each step."""

    leaves: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the shard leaves loss_fn's caller passed
    scope: object = None  # the `together` block being read ...
    scope_units: set[int] = dataclasses.field(default_factory=set)  # ... and its units
    scope_of: dict[int, object] = dataclasses.field(default_factory=dict)  # unit -> the `together` block it was entered in


class UnitRuntime:
    """One unit on one rank: its unsharded buffer, its state and this step's shards."""

    def __init__(self, plan: UnitPlan, groups: Groups, stats: reduce.Stats, *, regather: bool = True,
                 check: bool = False, encoded_meter: Meter | None = None):
        self.plan = plan
        self.groups = groups
        self.stats = stats
        self.dtype = groups.param_dtype or plan.dtype
        self.wire = groups.gather_wire if plan.sharded else None  # [Note: quantized all-gather] in gather.py
        self.row_bytes = gather.row_bytes(plan, self.dtype, self.wire) if plan.sharded else 0  # one rank's send
        self.regather = regather  # the backward gathers it again from the shards (not from hpZ rows)
        self.check = check  # encodes refuse NaN / inf (gather.should_check)
        self.full: torch.Tensor | None = None  # 1-D, k * S elements, leaf-major (see plan.py)
        self._full_data: torch.Tensor | None = None  # `.data` of full: writes skip the version counter
        self.state = UnitState.SHARDED
        self.pending: ops.Pending | None = None  # the all-gather in flight while GATHERING
        self.gathering_kept = False  # ... and whether it re-gathers the hpZ rows
        self.send = Held(stats)  # a packed send buffer in flight (0 bytes: the shard itself, or `encoded`, is sent)
        self.apart = Held(stats)  # a separate (k, S) / (k, nbytes(S)) all-gather output, alive until the copy-out
        self.full_bytes = Held(stats)  # the unsharded buffer's storage
        self.kept_bytes = Held(stats)  # the hpZ rows
        self.kept: torch.Tensor | None = None  # (k / M, S) hpZ rows (encoded rows with a wire format)
        self.encoded: torch.Tensor | None = None  # (nbytes(S),) uint8: this step's encoded shard buffer
        self.hold_encoded = False  # keep `encoded` across calls (accumulate's micro-batches)
        self.encoded_bytes = Held(stats, encoded_meter or Meter())
        self.step = UnitStep()  # this step's record, built fresh by RankState.begin_step
        self.acc: torch.Tensor | None = None  # (k, *lead, S) unsharded grad sum (accumulate, reduce_once)
        self.acc_replicated: list | None = None

    @property
    def nbytes(self) -> int:
        return self.plan.full_numel * self.dtype.itemsize if self.plan.sharded else 0

    @property
    def full_held(self) -> bool:
        """The unsharded buffer has storage."""
        return self.full_bytes.held

    @property
    def gather_bytes(self) -> int:
        """The all-gather's output: k rows of what each rank sends."""
        return self.plan.k * self.row_bytes

    # -- gather / free ------------------------------------------------------------------
    # [Note: gathering into the unit's buffer]
    # A unit with one sharded leaf has the same rank-major and leaf-major layout, so its
    # all-gather writes straight into the unit's unsharded buffer: no copy-out, and the
    # send buffer is the shard itself (no pack) when no cast or padding is needed. A unit
    # of several leaves gathers into a (k, S) buffer, allocates its unsharded buffer only
    # when the gather is waited, copies out and drops the (k, S) buffer at once. With a
    # wire format ([Note: quantized all-gather] in gather.py) every unit gathers encoded
    # rows into a (k, nbytes(S)) uint8 buffer and decodes them row by row into its
    # unsharded buffer; the encoded send buffer is made once per step and kept while a
    # re-gather may need it (until the unit's backward releases it; only for the gather
    # itself when the backward does not gather from the shards: the root, hpZ,
    # reshard_after_forward=False). Every buffer is counted in `peak_gathered_bytes` while
    # it lives: the packed or encoded send buffer, the all-gather output, the unsharded
    # buffer and the hpZ rows, so the statistic matches what an allocator sees (decoding's
    # one-row scratch excepted: sf.estimate's step peak sees it).

    def start_gather(self, into_buffer: bool = True) -> None:
        """Start the all-gather; `into_buffer=False`: never into the unit's buffer (which
        then stays without storage until `finish_gather`)."""
        with _raw():
            self._start_gather(into_buffer)

    def _start_gather(self, into_buffer: bool = True) -> None:
        if not self.plan.sharded:
            self.state = UnitState.GATHERED
            return
        if self.state not in (UnitState.SHARDED, UnitState.SHARDED_POST_FORWARD):
            return
        g, plan = self.groups, self.plan
        self.gathering_kept = self.state is UnitState.SHARDED_POST_FORWARD
        out = None
        if self.gathering_kept:  # [Note: hpZ] re-gather from the kept rows, over the sub-group
            send = self.kept  # -> (M, k / M, S)
        elif self.wire is not None:
            send = self._encoded()  # -> (k, nbytes(S)) uint8
        else:
            send = gather.send_buffer(plan, self.step.shards, self.dtype, g.device)
            if into_buffer and len(plan.sharded) == 1:
                out = self._alloc_full().view(plan.k, plan.shard_numel)
        fresh = not (self.gathering_kept or send is self.encoded or any(ops.same_memory(send, x) for x in self.step.shards))
        self.send.take(send.numel() * send.element_size() if fresh else 0)  # a shard itself is no new buffer
        self.apart.take(0 if out is not None else self.gather_bytes)  # a separate all-gather output
        self.pending = gather.start(g.hpz if self.gathering_kept else g.shard, send, out=out)
        self.stats.collective("all_gather", self.gather_bytes)
        self.state = UnitState.GATHERING

    def _encoded(self) -> torch.Tensor:
        """This step's encoded shard buffer, encoded on first use ([Note: quantized all-gather])."""
        if self.encoded is None:
            self.encoded = gather.send_buffer(self.plan, self.step.shards, self.dtype, self.groups.device, wire=self.wire,
                                              check=self.check)
            self.encoded_bytes.take(self.row_bytes)
        return self.encoded

    def drop_encoded(self) -> None:
        if self.encoded is not None:
            self.encoded = None
            self.encoded_bytes.free()

    def _alloc_full(self) -> torch.Tensor:
        """Give the unsharded buffer its storage (counted); returns its `.data`."""
        if self.full is None:
            self.full = torch.empty(self.plan.full_numel, dtype=self.dtype, device=self.groups.device)
            self._full_data = self.full.data
        else:
            self._full_data.untyped_storage().resize_(self.nbytes)
        self.full_bytes.take(self.nbytes)
        return self._full_data

    def finish_gather(self, in_forward: bool = False) -> None:
        """Wait for (or start and wait for) the unit's all-gather and lay it out in the
        unsharded buffer; in the forward, also keep the hpZ rows ([Note: hpZ])."""
        with _raw():
            if self.state in (UnitState.SHARDED, UnitState.SHARDED_POST_FORWARD):
                self._start_gather()
            if self.state is not UnitState.GATHERING:
                return
            gathered = self._wait()  # (k, S) in logical rank order; (M, k / M, S) from the kept rows
            g, plan = self.groups, self.plan
            if self.gathering_kept:  # reordered into a copy: two (k, S) buffers for a moment, then the
                copy = Held(self.stats)  # gathered one is freed and `apart` stands for the copy
                copy.take(self.gather_bytes)
                copy.free()
                gathered = gathered.reshape(plan.k, -1).index_select(0, g.hpz_order)
            elif g.hpz_keep is not None and in_forward and not plan.is_root:
                self.kept = gathered.index_select(0, g.hpz_keep)  # (k / M, S), a copy
                self.kept_bytes.take(self.kept.numel() * self.kept.element_size())
            if not self.full_held:
                self._alloc_full()
            if gathered.data_ptr() != self._full_data.data_ptr():
                gather.copy_out(plan, gathered, self._full_data, self.wire)
            del gathered
            self.apart.free()
            if not self.regather and not self.hold_encoded:  # no gather from the shards again this step
                self.drop_encoded()
            self.state = UnitState.GATHERED

    def _wait(self) -> torch.Tensor:
        """Wait for the all-gather; its send buffer is released here."""
        gathered = self.pending.wait()
        self.pending = None
        self.send.free()
        return gathered

    def reshard(self, post_forward: bool = False) -> None:
        """Release the unsharded storage. `post_forward`: a forward-time release, which
        keeps the hpZ rows (if any) for the backward's re-gather (SHARDED_POST_FORWARD);
        otherwise they are dropped too."""
        if not post_forward and self.kept is not None:
            self.kept_bytes.free()
            self.kept = None
        if not post_forward and not self.hold_encoded:  # its backward is done (or the step over)
            self.drop_encoded()
        if not self.plan.sharded:  # nothing gathered: its leaves are whole on every rank
            return
        if self.state is UnitState.GATHERING:
            self._wait()
            self.apart.free()
        if self.full_held:
            self._full_data.untyped_storage().resize_(0)
            self.full_bytes.free()
        self.state = UnitState.SHARDED_POST_FORWARD if self.kept is not None else UnitState.SHARDED

    # -- the unit's transitions (FSDP2's FSDPParamGroup shape) ------------------------------
    # RankState decides when (the schedule, other units); these say what happens to this one.

    def pre_forward(self, inputs) -> None:
        """The forward enters the unit: take this call's shards, have it gathered."""
        self.step.shards = [plain(x) for x in inputs[: len(self.plan.sharded)]]
        self.finish_gather(in_forward=True)

    def post_forward(self) -> None:
        """The forward is done with the unit: free it, keeping hpZ rows for the backward."""
        self.reshard(post_forward=True)

    def pre_backward(self) -> None:
        """The unit's backward ops come next: have it gathered (again)."""
        self.finish_gather()

    def prefetch_backward(self) -> None:
        """Its backward is near: start gathering beside the buffer ([Note: units used again later
        in the forward])."""
        self.start_gather(into_buffer=False)

    def post_backward(self) -> None:
        """Its gradients are complete: free everything this step gathered for it."""
        self.step.backward_done = True
        self.reshard()

    def views(self) -> list[torch.Tensor]:
        # Views of `full` (not of `_full_data`): our writes bump only `_full_data`'s version
        # counter, so tensors saved for backward stay valid. [Note: why storage is freed, not the tensor]
        return leaf_views(self.plan, self.full)


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
        self.deferred: list = []  # (ops.Pending, (*lead, S) output, finish_reduce kwargs) per deferred unit
        # The loss must be the same on every tensor-parallel rank: checked on the first call.
        self.loss_checked = self.groups.tp_size == 1
        self.step = RankStep()  # this step's record, built fresh by begin_step
        self.grad_fix = 1.0  # exact / rounded 1/N of the loss mean's backward ([Note: the loss mean's 1/N])
        self.batch_size = UNKNOWN  # this call's local batch size (batch.py), set by the step
        self.loss_weight: float | None = None  # this rank's weight in the loss mean, when not 1/N (batch.py)
        self.batch_check = None  # batch.EqualCheck of the last step, read at the next one (on an accelerator)

    # -- step lifecycle -------------------------------------------------------------------
    def begin_step(self, leaves: list[torch.Tensor]) -> None:
        hold = self.mode.keeps_stats  # accumulate: the shards, and so their encoding, stay the step's
        with torch.no_grad():
            for unit in self.units:
                unit.hold_encoded = hold
                unit.reshard()
        if not hold:
            self.stats.reset()
            self.encoded.reset()
        self.schedule.begin_step()
        self.step = RankStep(leaves=list(leaves))
        for unit in self.units:
            unit.step = UnitStep(shards=[plain(leaves[layout.index]) for layout in unit.plan.sharded])

    def drop_encoded(self) -> None:
        """Forget every unit's encoded send buffer (the shards changed: a new step)."""
        for unit in self.units:
            unit.hold_encoded = False
            unit.drop_encoded()

    def post_forward(self) -> None:
        """The forward of the step is over: free the units it gathered (reshard_after_forward)."""
        self.schedule.in_forward = False
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
        elif unit.state is not UnitState.GATHERED and not unit.step.stacked:  # released earlier in this forward
            unit.finish_gather(in_forward=True)
            unit.step.pinned = True  # [Note: units used again later in the forward]
        return unit.step.outputs[i]

    def loss_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss: the mean over the data axes (see LossMean)."""
        return LossMean.apply(loss, self)

    # -- the schedule ---------------------------------------------------------------------
    def pre_forward(self, u: int, inputs) -> None:
        """Forward: unit u is touched for the first time (inside GatherUnit.forward): free the
        units before it, gather it, prefetch the next."""
        unit = self.units[u]
        self.schedule.order.append(u)
        scope = current_scope()
        if scope is None or scope is not self.step.scope:
            self.step.scope, self.step.scope_units = scope, set()
        if scope is not None:
            unit.step.pinned = unit.step.pinned or scope.held
            self.step.scope_of[u] = scope
        if self.config.reshard_after_forward and not unit.plan.is_root:
            for i, other in enumerate(self.units):
                if (other is not unit and not other.plan.is_root and other.state is UnitState.GATHERED
                        and not other.step.pinned and i not in self.step.scope_units):
                    other.post_forward()
        if scope is not None:
            self.step.scope_units.add(u)
        unit.pre_forward(inputs)
        for nxt in self.schedule.prefetch_after(u):
            self.units[nxt].start_gather()

    def pre_backward(self) -> None:
        """Backward of the loss (LossMean): re-gather the units whose backward comes first."""
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(self.schedule.order) if not self.units[i].step.backward_done])

    def post_backward(self, u: int) -> None:
        """Backward of unit u's gather (its grads are complete; GatherUnit.backward): free it
        (and the frozen units used after it, whose backward ops have run), then bring the
        next ones. Its gradients are then reduced by `reduce_gradients`."""
        self.units[u].post_backward()
        order = self.schedule.order
        pos = order.index(u) if u in order else 0
        for i in order[pos + 1:]:
            if self.units[i].plan.frozen:
                self.units[i].reshard()
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(order[:pos]) if not self.units[i].step.backward_done])

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
        """Unit u's full-leaf grads -> this rank's shard grads (sharded leaves) and
        all-reduced grads (whole leaves), as the step mode says."""
        unit, g, cfg = self.units[u], self.groups, self.config
        plan = unit.plan
        n = len(plan.sharded)
        sharded_grads, whole_grads = list(grads[:n]), list(grads[n:])
        reduce_dtype = g.reduce_dtype or unit.dtype
        if self.mode is StepMode.ACCUMULATE_HOLD:  # add to the local sums, reduce on the last micro-batch
            if plan.sharded:
                packed = pack_grads(plan, sharded_grads, reduce_dtype, g.device, lead)
                unit.acc = packed if unit.acc is None else unit.acc + packed
            if plan.replicated:
                held = unit.acc_replicated or [None] * len(plan.replicated)
                unit.acc_replicated = [_add(a, b) for a, b in zip(held, whole_grads)]
            return reduce.zero_shard_grads(plan, g.shard_index, g.device, lead)
        out: list[torch.Tensor] = []
        if plan.sharded:
            packed = pack_grads(plan, sharded_grads, reduce_dtype, g.device, lead)  # (k, *lead, S)
            if unit.acc is not None:
                packed, unit.acc = packed + unit.acc, None
            finish = dict(replica_regions=plan.replica_regions, regions=plan.regions, mesh=self.mesh, stats=self.stats,
                          fix=self.grad_fix)
            if self._can_defer(plan, reduce_dtype, lead):  # [Note: deferred reductions]
                flat = torch.empty(packed.shape[1:], dtype=packed.dtype, device=packed.device)
                while len(self.deferred) >= _IN_FLIGHT:  # its packed input would stay alive until waited
                    _settle(self.deferred.pop(0))
                self.deferred.append((reduce.reduce_scatter(packed, g.shard, self.stats, out=flat, wire=g.reduce_wire),
                                      flat, finish))
                out.extend(reduce.shard_grads(plan, flat, g.shard_index, lead))  # filled by finish_deferred
            else:
                flat = reduce.reduce_scatter(packed, g.shard, self.stats, wire=g.reduce_wire).wait()  # (*lead, S)
                reduce.finish_reduce(flat, **finish)
                if cfg.check_finite:
                    reduce.check_finite(flat, f"the gradient of {plan.name()}", group=g.all, stats=self.stats)
                out.extend(reduce.shard_grads(plan, flat, g.shard_index, lead))
        if plan.replicated:
            if unit.acc_replicated is not None:
                whole_grads = [_add(a, b) for a, b in zip(whole_grads, unit.acc_replicated)]
                unit.acc_replicated = None
            out.extend(reduce.all_reduce_replicated(
                plan.replicated, whole_grads, shard_axes=cfg.shard_axes, mesh=self.mesh,
                reduce_dtype=g.reduce_dtype, device=g.device, lead=lead, stats=self.stats, fix=self.grad_fix))
        return out

    def _can_defer(self, plan: UnitPlan, reduce_dtype, lead) -> bool:
        """[Note: deferred reductions]"""
        return (
            self.mode is StepMode.DEFERRED and not lead and not self.config.check_finite
            and all(layout.dtype == reduce_dtype for layout in plan.sharded)
        )

    def finish_deferred(self, complete: bool = True) -> None:
        """Wait for the deferred reduce-scatters; when the backward completed, finish them
        (after a failure, no further collective is started)."""
        pending, self.deferred = self.deferred, []
        for entry in pending:
            _settle(entry, complete)

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
        if replicated_mismatch(group, [loss])[0]:
            raise ShardingError(
                f"shard: the loss differs across mesh axes {axes} (ranks {list(group.ranks)}, seen on rank "
                f"{group.ranks[group.index]}), the tensor-parallel axes of param_specs: shard treats every "
                f"rank of them as computing the same loss of the same batch.\nFix: give every rank of "
                f"{axes} the same batch and reduce the loss over them (sf.psum / all_gather) so it is "
                f"the same there; or, if those axes split the batch, add them to data_axes."
            )


def _settle(entry, complete: bool = True) -> None:
    """Wait for a deferred reduce-scatter `(work, flat, finish kwargs)`; if `complete`, finish
    its gradient in place (the HSDP / tensor-parallel all-reduces, the 1/N fix)."""
    work, flat, finish = entry
    work.wait()
    if complete:
        reduce.finish_reduce(flat, **finish)


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b
