"""The per-rank machinery of `shard`: unit states and the gather/free/re-gather schedule.
The autograd Functions that drive it are in _fsdp_autograd.py.

[Note: why storage is freed, not the tensor] A unit's full parameters are views of one
flat unsharded buffer. Ops that used them saved those views for their backward. After a
unit's forward we release the buffer's storage (`untyped_storage().resize_(0)`), and
before its backward ops run we resize it back and all-gather into it again: the saved
views see the data again without autograd knowing. Writes go through `.data` (a tensor
sharing the storage but not the version counter), so the restore is not an in-place op
that would invalidate saved tensors. `torch.func` refuses saved-tensor hooks, so this is
the mechanism that works under `grad` / `vjp` as well as `loss.backward()`.

[Note: backward order] The autograd engine runs ready nodes highest sequence number first.
Unit k's `_GatherUnit` node was created when unit k was first touched in the forward,
after every op of unit k-1, so its backward (the reduce-scatter of unit k's gradients)
runs before unit k-1's backward ops: that is where unit k-1 is re-gathered. The last unit
is re-gathered by the backward of the loss (`_LossMean`), which runs first of all. This
assumes units are used one after another in the forward (a layer stack); a unit's
parameters used again after later units, or used only through a detached path, can find
their storage released: keep such leaves in the root unit or use
`reshard_after_forward=False`.
"""

from __future__ import annotations

import enum

import torch

from ._backend import ops
from ._errors import NonFiniteError, ShardingError
from ._fsdp_plan import UnitPlan, copy_out, leaf_views, pack_grads, pack_shards, unpack_shard_grads

__all__ = ["RankState", "UnitRuntime", "UnitState", "Stats"]


# Schedule work (gathers, frees) also runs inside backward functions, where functorch
# would otherwise wrap the results of ops on our plain buffers.
_raw = ops.plain_mode


class UnitState(enum.Enum):
    SHARDED = "sharded"  # no unsharded storage
    GATHERING = "gathering"  # storage allocated, all-gather in flight
    GATHERED = "gathered"  # full parameters valid


class Stats:
    KEYS = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "num_collectives", "peak_gathered_bytes")

    def __init__(self):
        self.reset()

    def reset(self):
        self.values = dict.fromkeys(self.KEYS, 0)
        self.live = 0

    def collective(self, kind: str, nbytes: int) -> None:
        self.values[f"{kind}_bytes"] += nbytes
        self.values["num_collectives"] += 1

    def hold(self, nbytes: int) -> None:
        self.live += nbytes
        self.values["peak_gathered_bytes"] = max(self.values["peak_gathered_bytes"], self.live)


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


class UnitRuntime:
    """One unit on one rank: its unsharded buffer, state and this step's shards."""

    def __init__(self, plan: UnitPlan, rank_state: "RankState"):
        self.plan = plan
        self.rs = rank_state
        self.dtype = rank_state.param_dtype or plan.dtype
        self.full: torch.Tensor | None = None  # 1-D, k * S elements, leaf-major (see _fsdp_plan)
        self._full_data: torch.Tensor | None = None  # `.data` of full: writes skip the version counter
        self.state = UnitState.SHARDED
        self.pending = None  # (ops.Pending, whether it gathers the hpZ rows) while GATHERING
        self.kept: torch.Tensor | None = None  # (k / M, S): rows kept after the forward for hpZ
        self.shards: list[torch.Tensor] = []  # this step's plain shard tensors (sharded leaves)
        self.outputs: dict[int, torch.Tensor] | None = None  # leaf index -> what loss_fn sees
        self.backward_done = False
        self.stacked = False  # this step gathered stacked shards (vmap over an ensemble): no schedule
        self.acc: torch.Tensor | None = None  # (k, *lead, S) unsharded grad sum (accumulate, reduce_once)
        self.acc_replicated: list | None = None

    @property
    def nbytes(self) -> int:
        return self.plan.full_numel * self.dtype.itemsize if self.plan.sharded else 0

    # -- gather / free ------------------------------------------------------------------
    def start_gather(self) -> None:
        with _raw():
            self._start_gather()

    def _start_gather(self) -> None:
        if self.state is not UnitState.SHARDED or not self.plan.sharded:
            if not self.plan.sharded:
                self.state = UnitState.GATHERED
            return
        rs = self.rs
        if self.full is None:
            self.full = torch.empty(self.plan.full_numel, dtype=self.dtype, device=rs.device)
            self._full_data = self.full.data
        else:
            self._full_data.untyped_storage().resize_(self.nbytes)
        rs.stats.hold(self.nbytes)
        if self.kept is not None:  # [Note: hpZ] re-gather from the kept rows, over the sub-group
            pending = ops.all_gather_async(rs.hpz_group, self.kept)  # (M, k / M, S)
        else:
            pending = ops.all_gather_async(rs.shard_group, pack_shards(self.plan, self.shards, self.dtype, rs.device))
        rs.stats.collective("all_gather", self.nbytes)
        self.pending = (pending, self.kept is not None)
        self.state = UnitState.GATHERING

    def finish_gather(self) -> None:
        with _raw():
            self._finish_gather()

    def _finish_gather(self) -> None:
        if self.state is UnitState.SHARDED:
            self._start_gather()
        if self.state is UnitState.GATHERING:
            pending, from_kept = self.pending
            gathered = pending.wait()  # (k, S) in logical rank order; (M, k / M, S) from the kept rows
            self.pending = None
            rs = self.rs
            if from_kept:
                gathered = gathered.reshape(self.plan.k, -1).index_select(0, rs.hpz_order)
            elif rs.hpz_keep is not None and rs.in_forward and not self.plan.is_root:
                self.kept = gathered.index_select(0, rs.hpz_keep)  # (k / M, S), a copy
                rs.stats.hold(self.kept.numel() * self.kept.element_size())
            copy_out(self.plan, gathered, self._full_data)
            self.state = UnitState.GATHERED

    def free(self, keep: bool = False) -> None:
        """Release the unsharded storage; `keep`: a forward-time release, which keeps the
        hpZ rows (if any) for the backward's re-gather."""
        if not keep and self.kept is not None:
            self.rs.stats.hold(-self.kept.numel() * self.kept.element_size())
            self.kept = None
        if not self.plan.sharded or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self.pending[0].wait()
            self.pending = None
        self._full_data.untyped_storage().resize_(0)
        self.rs.stats.hold(-self.nbytes)
        self.state = UnitState.SHARDED

    def views(self) -> list[torch.Tensor]:
        # Views of `full` (not of `_full_data`): our writes bump only `_full_data`'s version
        # counter, so tensors saved for backward stay valid. [Note: why storage is freed...]
        return leaf_views(self.plan, self.full)

    # -- gradients ------------------------------------------------------------------------
    def reduce_gradients(self, grads, lead: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Full-leaf grads -> this rank's shard grads (sharded) and all-reduced grads (replicated)."""
        rs, plan = self.rs, self.plan
        n_sharded = len(plan.sharded)
        sharded_grads, repl_grads = list(grads[:n_sharded]), list(grads[n_sharded:])
        out: list[torch.Tensor] = []
        if rs.accumulating:
            return self._hold_gradients(sharded_grads, repl_grads, lead)
        if plan.sharded:
            reduce_dtype = rs.reduce_dtype or self.dtype
            packed = pack_grads(plan, sharded_grads, reduce_dtype, rs.device, lead)  # (k, *lead, S)
            if self.acc is not None:
                packed, self.acc = packed + self.acc, None
            rs.stats.collective("reduce_scatter", packed.numel() * packed.element_size())
            if rs.can_defer(plan, reduce_dtype, lead):  # [Note: deferred reductions]
                flat = torch.empty(packed.shape[1:], dtype=packed.dtype, device=packed.device)
                rs.deferred.append((ops.reduce_scatter_async(rs.shard_group, packed, out=flat), self, flat))
                out.extend(unpack_shard_grads(plan, flat, rs.shard_index, lead))  # filled by finish_deferred
            else:
                out.extend(self._reduce_now(packed, lead))
        if plan.replicated:
            if self.acc_replicated is not None:
                repl_grads = [_add(a, b) for a, b in zip(repl_grads, self.acc_replicated)]
                self.acc_replicated = None
            out.extend(self._all_reduce_replicated(repl_grads, lead))
        return out

    def _reduce_now(self, packed: torch.Tensor, lead) -> list[torch.Tensor]:
        """Reduce-scatter (k, *lead, S), all-reduce over replicas, check, unpack and cast."""
        rs, plan = self.rs, self.plan
        flat = ops.reduce_scatter_async(rs.shard_group, packed).wait()  # (*lead, S)
        self.finish_reduce(flat)
        if rs.config.check_finite:
            rs.check_finite(flat, f"the gradient of {plan.name()}")
        shard_grads = unpack_shard_grads(plan, flat, rs.shard_index, lead)
        return [g.to(layout.dtype) for layout, g in zip(plan.sharded, shard_grads)]

    def finish_reduce(self, flat: torch.Tensor) -> None:
        """After the reduce-scatter, in place on the (*lead, S) shard gradient: the sum over
        the other data axes (HSDP replicas), then over the tensor-parallel axes for the
        ranges of the leaves they replicate ([Note: FSDP x TP] in _fsdp_tp.py)."""
        rs = self.rs
        if rs.replica_group is not None:
            rs.stats.collective("all_reduce", flat.numel() * flat.element_size())
            flat.copy_(ops.all_reduce(rs.replica_group, flat))
        for axes, start, stop in self.plan.regions:
            region = flat.narrow(-1, start, stop - start)
            rs.stats.collective("all_reduce", region.numel() * region.element_size())
            region.copy_(ops.all_reduce(rs.mesh.group(axes), region))

    def _hold_gradients(self, sharded_grads, repl_grads, lead) -> list[torch.Tensor]:
        """Accumulation without communication: add the unsharded grads to a local buffer and
        return zeros; the last micro-batch reduces the sum once (see Shard.accumulate)."""
        rs, plan = self.rs, self.plan
        out: list[torch.Tensor] = []
        if plan.sharded:
            packed = pack_grads(plan, sharded_grads, rs.reduce_dtype or self.dtype, rs.device, lead)
            self.acc = packed if self.acc is None else self.acc + packed
            for layout in plan.sharded:
                shape = lead + layout.local_shape(rs.shard_index, plan.k)
                out.append(torch.zeros(shape, dtype=layout.dtype, device=rs.device))
        if plan.replicated:
            held = self.acc_replicated or [None] * len(plan.replicated)
            self.acc_replicated = [_add(a, b) for a, b in zip(held, repl_grads)]
            out.extend(torch.zeros(lead + l.shape, dtype=l.dtype, device=rs.device) for l in plan.replicated)
        return out

    def _all_reduce_replicated(self, grads, lead) -> list[torch.Tensor]:
        rs = self.rs
        filled = [
            (g if g is not None else torch.zeros(lead + layout.shape, dtype=layout.dtype, device=rs.device))
            for layout, g in zip(self.plan.replicated, grads)
        ]
        by_axes: dict[tuple[str, ...], list[int]] = {}  # one all-reduce per set of axes
        for i, layout in enumerate(self.plan.replicated):
            if layout.dtype.is_floating_point:
                by_axes.setdefault(rs.config.data_axes + layout.reduce_axes, []).append(i)
        for axes, floats in by_axes.items():
            group = rs.mesh.group(axes)
            if group.size == 1:
                continue
            dtype = rs.reduce_dtype or torch.promote_types(*(filled[i].dtype for i in floats), torch.float32)
            flat = torch.cat([filled[i].reshape(lead + (-1,)).to(dtype) for i in floats], dim=-1)
            rs.stats.collective("all_reduce", flat.numel() * flat.element_size())
            flat = ops.all_reduce(group, flat)
            start = 0
            for i in floats:
                n = filled[i][(0,) * len(lead)].numel() if lead else filled[i].numel()
                filled[i] = flat.narrow(-1, start, n).reshape(filled[i].shape).to(filled[i].dtype)
                start += n
        return filled


def hpz_rows(mesh, shard_axes: tuple[str, ...], sub_axes: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """[Note: hpZ] `reshard_after_forward=<axes>` (ZeRO++'s hpZ, FSDP2's int form): after
    the forward a rank keeps, of each unit's gathered (k, S) buffer, the k / M rows of the
    shard-group ranks that share its coordinates on the sub-axes (M ranks in all), i.e.
    its own shard and those of its counterparts across the other shard axes. In the
    backward the M ranks of its sub-axes group all-gather those rows, (M, k / M, S), which
    is the whole buffer in another order: no traffic crosses the other shard axes (e.g.
    nodes). Memory: 1/M of each unit between its forward and its backward.

    Returns `(keep, order)`: the shard-group rows this rank keeps (ordered by their index
    over the other axes), and for each row j its position in the flattened re-gather."""
    def ravel(coords, axes):
        index = 0
        for a in axes:
            index = index * mesh.shape[a] + coords[a]
        return index

    def unravel(j):
        coords = {}
        for a in reversed(shard_axes):
            j, coords[a] = divmod(j, mesh.shape[a])
        return coords

    outer = tuple(a for a in shard_axes if a not in sub_axes)
    k, m = mesh.axis_size(shard_axes), mesh.axis_size(sub_axes)
    mine = ravel(mesh.coords, sub_axes)
    rows = [unravel(j) for j in range(k)]
    keep = sorted((j for j in range(k) if ravel(rows[j], sub_axes) == mine), key=lambda j: ravel(rows[j], outer))
    order = [ravel(c, sub_axes) * (k // m) + ravel(c, outer) for c in rows]
    return keep, order


class RankState:
    """Everything `shard` keeps for one rank: unit runtimes, access order, statistics."""

    def __init__(self, plan, mesh, config):
        self.plan = plan
        self.config = config
        self.device = mesh.device
        self.mesh = mesh
        self.shard_group = mesh.group(config.shard_axes)
        self.data_group = mesh.group(config.data_axes)
        self.all_group = mesh.group(mesh.axis_names)
        # The tensor-parallel axes: the loss is the same on all their ranks and its
        # cotangent is split between them. [Note: FSDP x TP] in _fsdp_tp.py
        self.model_size = mesh.axis_size(plan.tp_axes) if plan.tp_axes else 1
        self.loss_checked = self.model_size == 1
        self.hpz_group = self.hpz_keep = self.hpz_order = None
        if config.reshard_axes:  # [Note: hpZ]
            self.hpz_group = mesh.group(config.reshard_axes)
            keep, order = hpz_rows(mesh, config.shard_axes, config.reshard_axes)
            self.hpz_keep = torch.tensor(keep, device=mesh.device)
            self.hpz_order = torch.tensor(order, device=mesh.device)
        replica_axes = tuple(a for a in config.data_axes if a not in config.shard_axes)
        self.replica_group = mesh.group(replica_axes) if replica_axes and mesh.axis_size(replica_axes) > 1 else None
        self.shard_index = self.shard_group.index
        mp = config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.reduce_dtype = mp.reduce_dtype if mp is not None else None
        self.units = [UnitRuntime(u, self) for u in plan.units]
        self.stats = Stats()
        self.order: list[int] = []  # units in first-access order, this step
        self.prev_order: list[int] = []  # ... on the previous step (prefetch plan)
        self.in_forward = False
        self.accumulating = False  # Shard.accumulate(mode="reduce_once"), all but the last micro-batch
        self.defer = False  # Shard.grad_and_value: gradient reduce-scatters are waited at the end
        self.deferred: list = []  # (ops.Pending, UnitRuntime, output buffer) per deferred unit
        self.keep_stats = False  # Shard.accumulate: statistics cover all micro-batches

    def can_defer(self, plan, reduce_dtype, lead) -> bool:
        """[Note: deferred reductions] Under `Shard.grad_and_value` nothing reads the shard
        gradients before the backward returns (they are `torch.autograd.grad` outputs, no
        AccumulateGrad), so a unit's reduce-scatter can run while the backward of the units
        before it computes, and be waited once at the end, followed by the all-reduces that
        complete it in place (HSDP, tensor parallelism). Only when the shard gradients are
        views of its output: no cast, no finiteness check, no vmap."""
        return (
            self.defer and not lead and not self.config.check_finite
            and all(layout.dtype == reduce_dtype for layout in plan.sharded)
        )

    def finish_deferred(self, complete: bool = True) -> None:
        """Wait for the deferred reduce-scatters; when the backward completed, finish them
        (after a failure, no further collective is started)."""
        pending, self.deferred = self.deferred, []
        for work, unit, flat in pending:
            work.wait()
            if complete:
                unit.finish_reduce(flat)

    def check_loss_replicated(self, loss: torch.Tensor) -> None:
        """First call: the loss must be the same on every rank of the non-data axes (each
        computes the loss of the same data rank's batch), else the gradient would be wrong."""
        from ._shard_map import replicated_mismatch

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

    def check_finite(self, values: torch.Tensor, what: str) -> None:
        """`shard(check_finite=True)`: raise NonFiniteError on every rank of the mesh if
        `values` holds a NaN/Inf on any of them (one tiny all-reduce + one on failure)."""
        group = self.all_group
        bad = torch.tensor([0.0 if bool(torch.isfinite(values).all()) else 1.0], device=self.device)
        self.stats.collective("all_reduce", bad.numel() * bad.element_size())
        if float(ops.all_reduce(group, bad, "max")) == 0.0:
            return
        flags = ops.all_gather(group, bad).tolist()
        ranks = [r for r, f in zip(group.ranks, flags) if f]
        raise NonFiniteError(
            f"shard(check_finite=True): {what} is NaN or infinite on ranks {ranks} (this is rank "
            f"{group.ranks[group.index]}). The step stopped before returning, so no "
            f"parameter update was applied.\nFix: look at those ranks' batches; lower the learning rate, "
            f"or use a loss scale / bf16 instead of fp16."
        )

    # -- step lifecycle -------------------------------------------------------------------
    def begin_step(self, shard_leaves: list[torch.Tensor]) -> None:
        for unit in self.units:
            unit.free()
        if not self.keep_stats:
            self.stats.reset()
        self.prev_order, self.order = (self.order or self.prev_order), []
        for unit in self.units:
            unit.outputs = None
            unit.backward_done = False
            unit.stacked = False
            unit.shards = [shard_leaves[layout.index] for layout in unit.plan.sharded]
        self.in_forward = True

    def end_forward(self) -> None:
        self.in_forward = False
        if self.config.reshard_after_forward:
            for i in self.order:
                if not self.units[i].plan.is_root:
                    self.units[i].free(keep=True)

    # -- the schedule ---------------------------------------------------------------------
    def enter(self, u: int, inputs: tuple) -> None:
        """Forward: unit u is touched for the first time (inside _GatherUnit.forward)."""
        unit = self.units[u]
        n = len(unit.plan.sharded)
        unit.shards = list(inputs[:n])
        self.order.append(u)
        if self.config.reshard_after_forward and not unit.plan.is_root:
            for other in self.units:
                if other is not unit and not other.plan.is_root and other.state is UnitState.GATHERED:
                    other.free(keep=True)
        unit.finish_gather()
        self._prefetch_after(u, self.prev_order)

    def regather_in_forward(self, u: int) -> None:
        """Forward: a unit released earlier in this forward is touched again."""
        unit = self.units[u]
        if unit.state is not UnitState.GATHERED and not unit.stacked:
            unit.finish_gather()

    def _prefetch_after(self, u: int, order: list[int]) -> None:
        k = self.config.prefetch
        if k <= 0 or u not in order:
            return
        pos = order.index(u)
        for nxt in order[pos + 1 : pos + 1 + k]:
            if self.units[nxt].plan.sharded:
                self.units[nxt].start_gather()

    def backward_start(self) -> None:
        """Backward of the loss: re-gather the units whose backward comes first."""
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(self.order) if not self.units[i].backward_done])

    def unit_backward(self, u: int) -> None:
        """Backward of unit u's gather (its grads are complete): free it (and the frozen units
        used after it, whose backward ops have run), then bring the next ones."""
        unit = self.units[u]
        unit.backward_done = True
        unit.free()
        pos = self.order.index(u) if u in self.order else 0
        for i in self.order[pos + 1 :]:
            if self.units[i].plan.frozen:
                self.units[i].free()
        if self.config.reshard_after_forward:
            self._bring([i for i in reversed(self.order[:pos]) if not self.units[i].backward_done])

    def _bring(self, upcoming: list[int]) -> None:
        """Gather the units whose backward ops run next: frozen ones (they have no backward
        node to do it for the next) up to the first trainable one, plus `prefetch` more."""
        need = []
        for i in upcoming:
            need.append(i)
            if not self.units[i].plan.frozen:
                break
        ahead = upcoming[len(need) : len(need) + max(self.config.prefetch, 0)]
        for i in need + ahead:
            self.units[i].start_gather()
        for i in need:
            self.units[i].finish_gather()
