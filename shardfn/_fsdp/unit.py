"""One unit of `shard` on one rank: its lifecycle and its buffers.

`UnitRuntime` owns everything that happens to one unit: its two states (`TrainingState`:
what it is doing in the step; `UnitState`: how its parameters are held), its unsharded
buffer, the all-gathers into it (through gather.py) and its named transitions
(`pre_forward`, `post_forward`, `pre_backward`, `prefetch_backward`, `post_backward`, ...,
FSDP2's `FSDPParamGroup` shape), each of which checks that it comes at a moment its states
allow ([Note: a unit's two states]). Its buffers count their own bytes (`Held`, held.py),
and what it knows of the current step is a `UnitStep` built fresh each step. When a
transition happens is the rank's decision (runtime.py: `RankState`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from typing import Callable, ClassVar

import torch

from .._backend import flight, ops
from . import gather, reduce
from .autograd import plain
from .groups import Groups
from .held import Held, Meter
from .plan import UnitPlan, leaf_views

__all__ = ["TrainingState", "UnitState", "UnitStateError", "UnitStep", "GradSum", "UnitRuntime"]

# [Note: why storage is freed, not the tensor]
# A unit's full parameters are views of one flat unsharded buffer. Ops that used them
# saved those views for their backward. After a unit's forward we release the buffer's
# storage (`untyped_storage().resize_(0)`), and before its backward ops run we resize it
# back and all-gather into it again: the saved views see the data again without autograd
# knowing. Writes go through `.data` (a tensor sharing the storage but not the version
# counter), so the restore is not an in-place op that would invalidate saved tensors.
# `torch.func` refuses saved-tensor hooks, so this is the mechanism that works under
# `grad` / `vjp` as well as `loss.backward()`.

# [Note: a unit's two states]
# A unit has FSDP2's two states: what it is doing in the step (`TrainingState`) and how
# its parameters are held on this rank (`UnitState`, which also names the all-gather in
# flight and hpZ's kept rows). Only the named transitions below change them, and each
# declares the states it may start from (`@transition`): one out of order raises
# `UnitStateError`, an internal error naming the unit, its states and the transition, so
# a bug in the schedule is a clear message, not a wrong number or a read of freed memory.
# One step of a unit of a layer stack (prefetch=1, its second step: the first has no
# forward prefetch), after each transition:
#
#   transition            training        parameters   (hpZ: reshard_after_forward=<axes>)
#   begin_step            IDLE            SHARDED
#   prefetch_forward      IDLE            GATHERING    (started when the unit before is entered)
#   pre_forward           FORWARD         GATHERED     (hpZ: GATHERED_KEPT, k / M rows cut and kept)
#   post_forward          FORWARD         SHARDED      (hpZ: SHARDED_POST_FORWARD)
#   prefetch_backward     FORWARD         GATHERING    (hpZ: GATHERING_KEPT, over the sub-group)
#   pre_backward          PRE_BACKWARD    GATHERED     (hpZ: GATHERED_KEPT)
#   post_backward         POST_BACKWARD   SHARDED      (hpZ: the kept rows dropped too)
#
# With reshard_after_forward=False, and for the root, pre_forward leaves it GATHERED until
# post_backward (no post_forward, no pre_backward). The rest:
# - `reenter_forward`: a unit read again in the forward after it was freed is gathered
#   again and pinned ([Note: units used again later in the forward] in runtime.py);
# - a frozen unit has no gather node, so no post_backward: `release_frozen` frees it once
#   the unit before it is done, and its training state stays (FORWARD or PRE_BACKWARD):
#   the schedule may bring it back later in the same backward;
# - second order: `pre_second_backward` gathers every unit the step used again (a
#   trainable one is POST_BACKWARD by then and stays so), `post_second_backward` frees it
#   ([Note: second order through shard] in autograd.py);
# - stacked shards (vmap over an ensemble) bypass the schedule: the unit stays IDLE and
#   SHARDED, its members gathered by `gather_stacked` ([Note: stacked shards] in autograd.py),
#   up to post_backward when vmap is outside grad (GatherUnit's backward runs then);
# - a unit without sharded leaves goes SHARDED <-> GATHERED with no collective and no bytes.
# Not states: the per-step facts on `UnitStep` (pinned, deferred, stacked, keep_encoded: the step
# mode's, the same for every unit); the encoded send buffer, made on first use and kept for
# the step (under accumulate, across micro-batches: `keep_encoded`); and the gradient sums
# of accumulate(mode="reduce_once"), a buffer the unit holds between micro-batches
# (`grad_sum`, None when none are held; `hold_grads` adds to it, `with_held_*` hand it back).


# Schedule work (gathers, frees) also runs inside backward functions, where functorch
# would otherwise wrap the results of ops on our plain buffers.
_raw = ops.plain_mode


class TrainingState(enum.Enum):
    """What a unit is doing in the current step (FSDP2's `TrainingState`)."""

    IDLE = "idle"  # not entered by this step's forward (or only as stacked shards: no schedule)
    FORWARD = "forward"  # entered by the forward; its backward has not begun
    PRE_BACKWARD = "pre_backward"  # brought back for its backward ops, which run next
    POST_BACKWARD = "post_backward"  # its gradients are complete (its gather's backward ran)


class UnitState(enum.Enum):
    """How a unit's parameters are held on this rank (FSDP2's `ShardedState`, with the
    all-gather in flight as states of its own)."""

    SHARDED = "sharded"  # the shards only: no unsharded storage
    GATHERING = "gathering"  # an all-gather of the shards in flight (its output in the buffer or beside it)
    GATHERED = "gathered"  # full parameters valid in the unsharded buffer
    SHARDED_POST_FORWARD = "sharded_post_forward"  # hpZ: no unsharded storage; k / M rows kept ([Note: hpZ])
    GATHERING_KEPT = "gathering_kept"  # hpZ: the kept rows' all-gather over the sub-group in flight
    GATHERED_KEPT = "gathered_kept"  # hpZ: full parameters valid, and the kept rows still held


_S = UnitState
_T = TrainingState
_ANY = tuple(UnitState)
_STARTABLE = (_S.SHARDED, _S.SHARDED_POST_FORWARD)  # no storage, no all-gather in flight
_IN_FLIGHT = (_S.GATHERING, _S.GATHERING_KEPT)
_GATHERED = (_S.GATHERED, _S.GATHERED_KEPT)
_ENTERED = (_T.FORWARD, _T.PRE_BACKWARD)  # entered by the forward, its backward not done


class UnitStateError(RuntimeError):
    """Internal error: a unit transition came at a moment the unit's states do not allow
    (a bug in shard's schedule; [Note: a unit's two states])."""


def _out_of_order(unit: UnitRuntime, name: str, training: tuple, state: tuple, stacked: bool) -> str:
    """The message of a transition out of order: the unit, its states, what was needed."""
    needs = []
    if unit.training not in training:
        also = " (or IDLE with stacked shards)" if stacked else ""
        needs.append(f"training state {' or '.join(t.name for t in training)}{also}")
    if unit.state not in state:
        needs.append(f"parameters {' or '.join(s.name for s in state)}")
    return (
        f"shard internal error: {unit.plan.name()} cannot {name}: it is {unit.training.name} with its "
        f"parameters {unit.state.name}, and {name} needs {' and '.join(needs)}. This is a bug in shard's "
        f"schedule (shardfn/_fsdp/runtime.py), not in your program; please report it with this message."
    )


def transition(*, training: tuple = tuple(TrainingState), state: tuple = _ANY, stacked: bool = False):
    """A named transition of a unit: it may start only from these states
    ([Note: a unit's two states]); `stacked`: also from IDLE when this step gathered the
    unit's stacked shards (no schedule). After it, `UnitRuntime.observer` (if set) sees the unit."""

    def wrap(method):
        name = method.__name__

        @functools.wraps(method)
        def run(self: UnitRuntime, *args, **kwargs):
            idle_stacked = stacked and self.step.stacked and self.training is TrainingState.IDLE
            if (self.training not in training and not idle_stacked) or self.state not in state:
                raise UnitStateError(_out_of_order(self, name, training, state, stacked))
            before, flight.context.unit = flight.context.unit, self.plan.name()  # [Note: flight recorder]
            try:
                out = method(self, *args, **kwargs)
            finally:
                flight.context.unit = before
            if UnitRuntime.observer is not None:
                UnitRuntime.observer(self, name)
            return out

        return run

    return wrap


@dataclasses.dataclass
class UnitStep:
    """What one unit knows of the current step, built fresh each step (nothing to reset)."""

    shards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # plain shard tensors (sharded leaves)
    outputs: dict[int, torch.Tensor] | None = None  # leaf index -> what loss_fn sees
    stacked: bool = False  # gathered stacked shards (vmap over an ensemble): no schedule
    pinned: bool = False  # used again after other units in this forward: kept until its backward
    deferred: bool = False  # held by loss_fn when another unit was entered: freed later ([Note: a view kept across units])
    keep_encoded: bool = False  # the encoded shards outlive the step (accumulate: the shards stay the same)


@dataclasses.dataclass
class GradSum:
    """accumulate(mode="reduce_once"): a unit's gradients summed over the micro-batches so
    far, not yet reduced (reduced once, with the last micro-batch's)."""

    packed: torch.Tensor | None = None  # (k, *lead, S) in the reduce dtype: the sharded leaves'
    whole: list | None = None  # the whole leaves' (None where a leaf has none yet)


class UnitRuntime:
    """One unit on one rank: its states, its unsharded buffer and this step's shards."""

    # Called as observer(unit, transition) after every transition (tests record the states).
    observer: ClassVar[Callable[[UnitRuntime, str], None] | None] = None

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
        self.training = TrainingState.IDLE  # [Note: a unit's two states]
        self.state = UnitState.SHARDED
        self.full: torch.Tensor | None = None  # 1-D, k * S elements, leaf-major (see plan.py)
        self._full_data: torch.Tensor | None = None  # `.data` of full: writes skip the version counter
        self.pending: ops.Pending | None = None  # the all-gather in flight (GATHERING, GATHERING_KEPT)
        self.kept: torch.Tensor | None = None  # (k / M, S) hpZ rows (encoded rows with a wire format): the *_KEPT states
        self.encoded: torch.Tensor | None = None  # (nbytes(S),) uint8: this step's encoded shard buffer
        self.grad_sum: GradSum | None = None  # accumulate(mode="reduce_once")'s held sums; None: none held
        self.send = Held(stats)  # a packed send buffer in flight (0 bytes: the shard itself, or `encoded`, is sent)
        self.apart = Held(stats)  # a separate (k, S) / (k, nbytes(S)) all-gather output, alive until the copy-out
        self.full_bytes = Held(stats)  # the unsharded buffer's storage
        self.kept_bytes = Held(stats)  # the hpZ rows
        self.encoded_bytes = Held(stats, encoded_meter or Meter())
        self.step = UnitStep()  # this step's record, built fresh by begin_step

    @property
    def nbytes(self) -> int:
        return self.plan.full_numel * self.dtype.itemsize if self.plan.sharded else 0

    @property
    def full_held(self) -> bool:
        """The unsharded buffer has storage."""
        return self.full_bytes.held

    @property
    def gathered(self) -> bool:
        """Its full parameters are valid (GATHERED, GATHERED_KEPT)."""
        return self.state in _GATHERED

    @property
    def backward_done(self) -> bool:
        """Its gradients are complete this step (POST_BACKWARD)."""
        return self.training is TrainingState.POST_BACKWARD

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
    #
    # The three moves of the parameters' state, below the transitions; each expects the
    # states it is called in (the transitions check them):
    #   _start_gather   SHARDED -> GATHERING, SHARDED_POST_FORWARD -> GATHERING_KEPT
    #                   (no sharded leaves: SHARDED -> GATHERED, nothing to gather)
    #   _finish_gather  GATHERING -> GATHERED (GATHERED_KEPT: the forward's hpZ rows cut),
    #                   GATHERING_KEPT -> GATHERED_KEPT
    #   _release        any -> SHARDED, or SHARDED_POST_FORWARD keeping the hpZ rows

    def _start_gather(self, into_buffer: bool = True) -> None:
        """Start the all-gather; `into_buffer=False`: never into the unit's buffer (which
        then stays without storage until `_finish_gather`)."""
        if not self.plan.sharded:
            self.state = UnitState.GATHERED
            return
        g, plan = self.groups, self.plan
        from_kept = self.state is UnitState.SHARDED_POST_FORWARD
        out = None
        if from_kept:  # [Note: hpZ] re-gather from the kept rows, over the sub-group
            send = self.kept  # -> (M, k / M, S)
        elif self.wire is not None:
            send = self._encoded()  # -> (k, nbytes(S)) uint8
        else:
            send = gather.send_buffer(plan, self.step.shards, self.dtype, g.device)
            if into_buffer and len(plan.sharded) == 1:
                out = self._alloc_full().view(plan.k, plan.shard_numel)
        fresh = not (from_kept or send is self.encoded or any(ops.same_memory(send, x) for x in self.step.shards))
        self.send.take(send.numel() * send.element_size() if fresh else 0)  # a shard itself is no new buffer
        self.apart.take(0 if out is not None else self.gather_bytes)  # a separate all-gather output
        self.pending = gather.start(g.hpz if from_kept else g.shard, send, out=out)
        self.stats.collective("all_gather", self.gather_bytes)
        self.state = UnitState.GATHERING_KEPT if from_kept else UnitState.GATHERING

    def _encoded(self) -> torch.Tensor:
        """This step's encoded shard buffer, encoded on first use ([Note: quantized all-gather])."""
        if self.encoded is None:
            self.encoded = gather.send_buffer(self.plan, self.step.shards, self.dtype, self.groups.device, wire=self.wire,
                                              check=self.check)
            self.encoded_bytes.take(self.row_bytes)
        return self.encoded

    def _drop_encoded(self) -> None:
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

    def _finish_gather(self, in_forward: bool = False) -> None:
        """Wait for the unit's all-gather and lay it out in the unsharded buffer; in the
        forward, also keep the hpZ rows ([Note: hpZ])."""
        gathered = self._wait()  # (k, S) in logical rank order; (M, k / M, S) from the kept rows
        g, plan = self.groups, self.plan
        if self.state is UnitState.GATHERING_KEPT:  # reordered into a copy: two (k, S) buffers for a moment,
            copy = Held(self.stats)  # then the gathered one is freed and `apart` stands for the copy
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
        if not self.regather and not self.step.keep_encoded:  # no gather from the shards again this step
            self._drop_encoded()
        self.state = UnitState.GATHERED_KEPT if self.kept is not None else UnitState.GATHERED

    def _wait(self) -> torch.Tensor:
        """Wait for the all-gather; its send buffer is released here."""
        gathered = self.pending.wait()
        self.pending = None
        self.send.free()
        return gathered

    def _have_gathering(self, into_buffer: bool = True) -> None:
        """Start its all-gather, unless it is gathering or gathered already."""
        if self.state in _STARTABLE:
            with _raw():
                self._start_gather(into_buffer)

    def _have_gathered(self, in_forward: bool = False) -> None:
        """Its full parameters valid: start (unless started) and finish its all-gather."""
        with _raw():
            if self.state in _STARTABLE:
                self._start_gather()
            if self.state in _IN_FLIGHT:
                self._finish_gather(in_forward)

    def _release(self, post_forward: bool = False, keep_encoded: bool | None = None) -> None:
        """Release the unsharded storage (waiting for an all-gather in flight).
        `post_forward`: a forward-time release, which keeps the hpZ rows (if any) for the
        backward's re-gather (SHARDED_POST_FORWARD); otherwise they are dropped too, and so
        is the encoded shard buffer unless `keep_encoded` (default: the step's)."""
        keep_encoded = self.step.keep_encoded if keep_encoded is None else keep_encoded
        if not post_forward and self.kept is not None:
            self.kept_bytes.free()
            self.kept = None
        if not post_forward and not keep_encoded:  # its backward is done (or the step over)
            self._drop_encoded()
        if not self.plan.sharded:  # nothing gathered: its leaves are whole on every rank
            self.state = UnitState.SHARDED
            return
        if self.state in _IN_FLIGHT:
            if self.pending is not None:  # None: waited, and its copy-out raised (that error is the step's)
                self._wait()
            self.apart.free()
        if self.full_held:
            self._full_data.untyped_storage().resize_(0)
            self.full_bytes.free()
        self.state = UnitState.SHARDED_POST_FORWARD if self.kept is not None else UnitState.SHARDED

    # -- the unit's transitions (FSDP2's FSDPParamGroup shape) ------------------------------
    # RankState decides when (the schedule, other units); these say what happens to this one,
    # and from which states ([Note: a unit's two states]).

    @transition()
    def begin_step(self, shards: list[torch.Tensor], keep_encoded: bool = False) -> None:
        """A new step: release what the last one left (from any state), take its shards.
        `keep_encoded`: the encoded shards outlive the step (accumulate's micro-batches)."""
        self._release(keep_encoded=keep_encoded)
        self.step = UnitStep(shards=shards, keep_encoded=keep_encoded)
        self.training = TrainingState.IDLE

    @transition(training=(_T.IDLE, _T.FORWARD))
    def prefetch_forward(self) -> None:
        """A unit before it in the last step's order was entered: start gathering it."""
        self._have_gathering()

    @transition(training=(_T.IDLE,), state=(_S.SHARDED, _S.GATHERING))
    def pre_forward(self, inputs) -> None:
        """The forward enters the unit: take this call's shards, have it gathered. (It is
        FORWARD from here on, even if the gather fails: the step's post_forward frees it.)"""
        self.training = TrainingState.FORWARD
        self.step.shards = [plain(x) for x in inputs[: len(self.plan.sharded)]]
        self._have_gathered(in_forward=True)

    @transition(training=(_T.FORWARD,), state=_STARTABLE + _IN_FLIGHT)
    def reenter_forward(self) -> None:
        """Read again in the forward after it was freed: gather it again and keep it until
        its backward ([Note: units used again later in the forward] in runtime.py)."""
        self._have_gathered(in_forward=True)
        self.step.pinned = True

    @transition(training=(_T.FORWARD,))
    def post_forward(self) -> None:
        """The forward is done with the unit: free it, keeping hpZ rows for the backward."""
        self.step.deferred = False
        self._release(post_forward=True)

    @transition(training=_ENTERED)
    def prefetch_backward(self) -> None:
        """Its backward is near: start gathering beside the buffer ([Note: units used again later
        in the forward])."""
        self._have_gathering(into_buffer=False)

    @transition(training=_ENTERED)
    def pre_backward(self) -> None:
        """The unit's backward ops come next: have it gathered (again)."""
        self._have_gathered()
        self.training = TrainingState.PRE_BACKWARD

    @transition(training=_ENTERED, stacked=True)
    def post_backward(self) -> None:
        """Its gradients are complete: free everything this step gathered for it (nothing,
        for stacked shards: their gather's backward comes here when vmap is outside grad)."""
        self._release()
        self.training = TrainingState.POST_BACKWARD

    @transition(training=_ENTERED)
    def release_frozen(self) -> None:
        """A frozen unit (no gather node, so no post_backward of its own) whose backward ops
        have run: free everything this step gathered for it; its training state stays."""
        self._release()

    @transition(training=_ENTERED + (_T.POST_BACKWARD,))
    def pre_second_backward(self) -> None:
        """A second backward through the step begins (reverse-over-reverse): have it
        gathered again; its training state stays ([Note: second order through shard])."""
        self._have_gathered()

    @transition(training=(_T.POST_BACKWARD,))
    def post_second_backward(self) -> None:
        """Its gather's backward in the second backward: free everything gathered again."""
        self._release()

    def drop_encoded(self) -> None:
        """Forget the encoded shard buffer and keep none for the rest of the step (the
        shards change: accumulate begins or ends)."""
        self.step.keep_encoded = False
        self._drop_encoded()

    # -- accumulate(mode="reduce_once")'s held gradient sums (reducer.py) ------------------
    def hold_grads(self, packed: torch.Tensor | None, whole: list | None) -> None:
        """A micro-batch before the last: add its unreduced gradients to the held sums
        (`packed`: (k, *lead, S) of the sharded leaves; `whole`: the whole leaves')."""
        held = self.grad_sum or GradSum()
        if packed is not None:
            held.packed = packed if held.packed is None else held.packed + packed
        if whole is not None:
            held.whole = [_add(a, b) for a, b in zip(held.whole or [None] * len(whole), whole)]
        self.grad_sum = held

    def with_held_packed(self, packed: torch.Tensor) -> torch.Tensor:
        """`packed` plus the held sum of the sharded leaves' gradients, which the unit lets go."""
        held = self.grad_sum
        if held is None or held.packed is None:
            return packed
        packed, held.packed = packed + held.packed, None
        if held.whole is None:
            self.grad_sum = None
        return packed

    def with_held_whole(self, whole: list) -> list:
        """The whole leaves' gradients plus their held sums, which the unit lets go."""
        held = self.grad_sum
        if held is None or held.whole is None:
            return whole
        whole, held.whole = [_add(a, b) for a, b in zip(whole, held.whole)], None
        if held.packed is None:
            self.grad_sum = None
        return whole

    # -- what the autograd Functions return (autograd.py) ---------------------------------
    def forward_outputs(self, inputs) -> tuple[torch.Tensor, ...]:
        """GatherUnit: the full leaves, views of the unsharded buffer, then the whole leaves."""
        n = len(self.plan.sharded)
        return tuple(self.views()) + tuple(x.view_as(x) for x in inputs[n:])

    def gather_stacked(self, inputs) -> tuple[torch.Tensor, ...]:
        """GatherStacked: stacked (B, ...) shards -> B members' full leaves, one all-gather and
        no schedule ([Note: stacked shards] in autograd.py)."""
        g, plan = self.groups, self.plan
        n = len(plan.sharded)
        out = []
        if plan.sharded:
            size = inputs[0].shape[0]
            send = gather.send_buffer(plan, inputs[:n], self.dtype, g.device, wire=g.gather_wire, lead=(size,),
                                      check=self.check)  # (B, S), or (B, nbytes(S)) encoded
            self.stats.collective("all_gather", plan.k * send.numel() * send.element_size())
            rows = gather.start(g.shard, send).wait()  # (k, B, S)
            del send
            out.extend(gather.stacked_leaves(plan, rows, self.dtype, g.gather_wire))
        out.extend(x.view_as(x) for x in inputs[n:])
        return tuple(out)

    def gather_tangents(self, tangents) -> tuple[torch.Tensor, ...]:
        """GatherTangent (forward mode): the shards' tangents -> the full leaves' tangents;
        GatherCotangent (the transpose of the gradient reduce-scatter) the same for cotangents.
        Exact (no wire format), in the compute dtype, counted in `all_gather_bytes`."""
        g, plan = self.groups, self.plan
        n = len(plan.sharded)
        out = []
        if plan.sharded:
            self.stats.collective("all_gather", plan.k * plan.shard_numel * self.dtype.itemsize)
            zero = [t if t is not None else torch.zeros(l.local_shape(g.shard_index, plan.k), dtype=self.dtype, device=g.device)
                    for l, t in zip(plan.sharded, tangents[:n])]
            out.extend(gather.gather_full(plan, g.shard, zero, self.dtype, g.device))  # exact: [Note: quantized all-gather]
        out.extend(t if t is not None else torch.zeros(l.shape, dtype=l.dtype, device=g.device)
                   for l, t in zip(plan.replicated, tangents[n:]))
        return tuple(out)

    def views_held(self) -> bool:
        """Whether Python code still holds one of the full sharded leaves handed to loss_fn
        this step (beyond `step.outputs`): freeing the unit now would leave it reading
        freed storage ([Note: a view kept across units] in runtime.py)."""
        outputs = self.step.outputs
        return outputs is not None and any(
            l.index in outputs and _python_refs(outputs[l.index]) > 1 for l in self.plan.sharded)  # 1: `outputs`

    def views(self) -> list[torch.Tensor]:
        # Views of `full` (not of `_full_data`): our writes bump only `_full_data`'s version
        # counter, so tensors saved for backward stay valid. [Note: why storage is freed, not the tensor]
        return leaf_views(self.plan, self.full)


def _cxx_holds_add_a_python_ref() -> bool:
    """Whether this torch keeps a tensor's Python object referenced while C++ holds the
    tensor (a view's base, autograd's saved tensors): newer versions do, with one reference."""
    base = torch.empty(0)
    view = base.view(0)  # noqa: F841 (its base reference is the C++ one)
    return sys.getrefcount(base) > 2  # `base` and the argument, plus C++'s


_CXX_REF = int(_cxx_holds_add_a_python_ref())


def _python_refs(t: torch.Tensor) -> int:
    """References to `t` from Python (not counting this call's): C++ references (a view
    derived from it, autograd saving it) are not counted."""
    return sys.getrefcount(t) - 2 - (_CXX_REF if t._use_count() > 1 else 0)  # `t` and the argument


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b
