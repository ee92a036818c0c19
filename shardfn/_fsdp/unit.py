"""One unit of `shard` on one rank: its lifecycle and its buffers.

`UnitRuntime` owns everything that happens to one unit: its `UnitState`, its unsharded
buffer, the all-gathers into it (through gather.py) and its named transitions
(`pre_forward`, `post_forward`, `pre_backward`, `prefetch_backward`, `post_backward`,
FSDP2's `FSDPParamGroup` shape). Its buffers count their own bytes (`Held`, held.py), and
what it knows of the current step is a `UnitStep` built fresh each step. When a
transition happens is the rank's decision (runtime.py: `RankState`).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from .._backend import ops
from . import gather, reduce
from .autograd import plain
from .groups import Groups
from .held import Held, Meter
from .plan import UnitPlan, leaf_views

__all__ = ["UnitState", "UnitStep", "UnitRuntime"]

# [Note: why storage is freed, not the tensor]
# A unit's full parameters are views of one flat unsharded buffer. Ops that used them
# saved those views for their backward. After a unit's forward we release the buffer's
# storage (`untyped_storage().resize_(0)`), and before its backward ops run we resize it
# back and all-gather into it again: the saved views see the data again without autograd
# knowing. Writes go through `.data` (a tensor sharing the storage but not the version
# counter), so the restore is not an in-place op that would invalidate saved tensors.
# `torch.func` refuses saved-tensor hooks, so this is the mechanism that works under
# `grad` / `vjp` as well as `loss.backward()`.


# Schedule work (gathers, frees) also runs inside backward functions, where functorch
# would otherwise wrap the results of ops on our plain buffers.
_raw = ops.plain_mode


class UnitState(enum.Enum):
    SHARDED = "sharded"  # no unsharded storage
    SHARDED_POST_FORWARD = "sharded_post_forward"  # no unsharded storage; hpZ rows kept ([Note: hpZ])
    GATHERING = "gathering"  # storage allocated, all-gather in flight
    GATHERED = "gathered"  # full parameters valid



@dataclasses.dataclass
class UnitStep:
    """What one unit knows of the current step, built fresh each step (nothing to reset)."""

    shards: list[torch.Tensor] = dataclasses.field(default_factory=list)  # plain shard tensors (sharded leaves)
    outputs: dict[int, torch.Tensor] | None = None  # leaf index -> what loss_fn sees
    backward_done: bool = False
    stacked: bool = False  # gathered stacked shards (vmap over an ensemble): no schedule
    pinned: bool = False  # used again after other units in this forward: kept until its backward


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

    def views(self) -> list[torch.Tensor]:
        # Views of `full` (not of `_full_data`): our writes bump only `_full_data`'s version
        # counter, so tensors saved for backward stay valid. [Note: why storage is freed, not the tensor]
        return leaf_views(self.plan, self.full)
