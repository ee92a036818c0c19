"""`sf.jit(step, opt)`: the whole train step of a `shard` step as one torch.compile graph.

[Note: the traced step]
`sf.train_step(step, opt)` runs the unit schedule eagerly (Python state, storage resizes,
process-group calls: docs/fsdp_design.md "Compiling"). The traced step is a second,
pure description of the same step, written for dynamo:

    (shards, opt_state, batch) -> (new shards, new opt_state, loss)

- each unit's shard leaves are packed (pad + cat, `plan.py`'s layout) and all-gathered
  with `GatherFlat` (a functional collective whose transpose is the reduce-scatter,
  [Note: traceable collectives]), then unpacked to full leaves with narrow + reshape;
- `loss_fn` runs on the full leaves; the gradient is `torch.autograd.grad` of the local
  loss times 1/N (dynamo traces it with `trace_autograd_ops`): autograd composes the
  unpack, the reduce-scatter and the pack into the shard gradients;
- whole (replicated) leaves' gradients are all-reduced, one flat all-reduce per unit;
- the loss mean is the all-reduce the eager step issues ([Note: the batch size rides on
  the loss all-reduce] in `_fsdp/batch.py`), with its equal-batch check as an in-graph
  assert;
- `opt.update` + `apply_updates` run in the same graph; the step count is the state's
  0-dim tensor, so no Python scalar changes between steps and nothing recompiles;
- the unit schedule (gather just in time, re-gather in the backward for
  reshard-after-forward) is a pass over the captured graph ([Note: the schedule is a
  graph pass] in schedule.py).

It shares with the eager runtime the plan (units, flat buffers, padding), `loss_fn`'s mesh
binding and the collectives layer: loss_fn's named-axis collectives (tensor parallelism)
issue their graph forms ([Note: collectives in a graph] in shardfn/_backend/graph.py), and
the traced step's own gather and reduce-scatter go through the same functions by name.

[Note: the gradient pack is a cat]
Autograd writes the gradient pack (the reduce-scatter's input: each leaf's gradient in
its unit's rank-major layout) as the transpose of the unpack. The unpack was first a
narrow of the (k, S) rows per leaf; a narrow's transpose is a zero-padded buffer of the
whole row width, one per leaf, summed, and inductor fused that sum into one loop that
tests every leaf's bounds at every element: 62-70 ms per step of a GPT 8L d512 (12 leaves
a unit), and the same masks in front of the optimizer's update. One split of the rows
into all regions (padding included) has a cat as its transpose, which inductor lowers to
a copy per leaf.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import re
from typing import NamedTuple

import torch

from .. import _tree
from .._backend import graph
from .._errors import ShardingError, SpecError
from .._fsdp import api, support
from .._fsdp.plan import pack_shards
from ..optim.base import apply_updates
from .checks import check_traceable
from .remat import remat_across_collectives
from .._fsdp.gather import segments
from .collectives import GatherFlat, Wires, all_reduce_max, all_reduce_sum
from .schedule import Hpz, SchedulePass, TrafficRecord, pin_pass, schedule_units
from .trees import fill, leaves_of, list_state, skeleton

__all__ = ["jit", "TracedStep"]

_BACKENDS = ("inductor", "aot_eager")


def jit(step, opt, *, backend: str = "inductor", options: dict | None = None,
        inplace: bool = False, accumulate: str | None = None) -> "TracedStep":
    """Trace a `shard` step's whole train step (forward, backward, reduce-scatters,
    optimizer update) into one graph, compiled with `torch.compile(fullgraph=True)`.

    The result is called like `sf.train_step(step, opt)`'s:
    `shards, opt_state, loss = train(shards, opt_state, batch)` (with `has_aux`:
    `shards, opt_state, loss, aux`), on every rank of a distributed mesh. The first call
    traces and compiles (seconds to a minute); later calls with the same shapes run the
    graph.

    Args:
      step: the result of `sf.shard(loss_fn, mesh, ...)`, after `step.shard_params(...)`.
        `loss_fn` must be traceable by dynamo: no `.item()`, no Python branch on a tensor's
        value (use `torch.where`); `sf.remat` traces as torch's checkpoint ([Note: remat under
        sf.jit] in shardfn/_remat.py). A model's `sf.functional` apply function
        traces ([Note: one apply function] in shardfn/_functional.py).
      opt: a `sf.optim` transformation (e.g. `sf.optim.adamw(1e-3)`).
      backend: "inductor" (fused kernels) or "aot_eager" (the same graph run op by op:
        compiles in a fraction of the time; for tests and debugging).
      options: extra inductor options (`torch.compile(options=...)`).
      inplace: write the new shards and optimizer state into the tensors passed in (JAX's
        buffer donation; `sf.train_step(..., inplace=True)` with an in-place optimizer in
        eager) and return those same trees: no new shards or state are allocated each
        step, and inductor's update kernel stores straight into them. The trees passed in
        must not be used as the old values afterwards.
      accumulate: None, or "reduce_each" / "reduce_once": gradient accumulation, as
        `step.accumulate(shards, micro_batches, mode=...)` then the update, in one graph;
        the call's batch is then a list of micro-batches (their count fixed per compile).
        [Note: accumulation in the graph]

    Returns:
      A `TracedStep`; `.stats()` gives the compiled graph's collective bytes (the counts
      `step.stats()` gives for the eager step).

    Raises:
      SpecError: an option the traced step does not support (naming the eager fallback),
        or the simulated mesh.
      ShardingError: `loss_fn` cannot be traced as one graph (the first call; the message
        gives dynamo's reason).
      NonFiniteError: (a call, with `check_finite=True`) the loss or a unit's gradient is
        NaN or infinite on some rank, as the eager step raises it; nothing is updated.

    Example (on 2 processes; see docs/howto/compile.md):
      >>> train = sf.jit(step, sf.optim.adamw(1e-3))          # doctest: +SKIP
      >>> shards, state, loss = train(shards, state, batch)   # doctest: +SKIP
    """
    if not (hasattr(step, "config") and hasattr(step, "shard_params") and hasattr(step, "loss_fn")):
        raise SpecError(
            f"sf.jit: expected the result of sf.shard(loss_fn, mesh, ...), got {type(step).__name__}.\n"
            f"Fix: step = sf.shard(loss_fn, mesh); train = sf.jit(step, opt)."
        )
    if not (isinstance(opt, tuple) and len(opt) == 2 and all(callable(f) for f in opt)):
        raise SpecError(f"sf.jit: opt must be a sf.optim GradientTransformation (init, update), got {opt!r:.60}")
    kernel = getattr(opt.update, "fused_kernel", None)
    if kernel is not None:
        raise SpecError(
            f"sf.jit: opt runs torch's fused kernel (torch.{kernel}), which updates its lists in place outside "
            f"what dynamo traces into a graph.\nFix: build the optimizer without fused=True (e.g. "
            f"sf.optim.adamw(lr)): in the graph inductor fuses its foreach math into one kernel per unit; or "
            f"train eagerly with sf.train_step(step, opt)."
        )
    if backend not in _BACKENDS:
        raise SpecError(f"sf.jit: backend must be one of {_BACKENDS}, got {backend!r}")
    mp = getattr(step.config, "mixed_precision", None)
    fp8 = [f for f in ("all_gather_dtype", "reduce_scatter_dtype") if mp is not None
           and getattr(mp, f) in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if backend == "inductor" and fp8:
        raise SpecError(
            f"sf.jit: MixedPrecision({fp8[0]}={getattr(mp, fp8[0])}) with backend='inductor': inductor (torch "
            f"{torch.__version__}) cannot lower the float8 wire format's encode (\"Promotion for Float8 Types is not "
            f"supported\").\nFix: sf.jit(step, opt, backend='aot_eager') (the same graph, op by op), the 'int8' wire "
            f"format with inductor, or train eagerly with sf.train_step(step, opt)."
        )
    _check_accumulate(step, accumulate)
    return TracedStep(step, opt, backend, dict(options or {}), bool(inplace), accumulate)


def _check_accumulate(step, accumulate) -> None:
    """[Note: accumulation in the graph]: the modes, and what they do not combine with yet."""
    if accumulate is None:
        return
    if accumulate not in ("reduce_each", "reduce_once"):
        raise SpecError(f"sf.jit: accumulate must be None, 'reduce_each' or 'reduce_once' (step.accumulate's "
                        f"modes), got {accumulate!r}")
    cfg = step.config
    why = None
    if cfg.check_finite:
        why = "check_finite=True (its flags per micro-batch are not written in the traced step)"
    elif cfg.batch_weighting == "global_mean":
        why = "batch_weighting='global_mean' (the micro-batches' weights are not written in the traced step)"
    elif accumulate == "reduce_once":
        mp = cfg.mixed_precision
        if mp is not None and (any(w is not None for w in mp.wires()) or
                               (mp.reduce_dtype is not None and mp.reduce_dtype != mp.param_dtype)):
            why = ("mode 'reduce_once' with a reduce dtype or wire format of its own (the held sums are kept in the "
                   "compute dtype in the graph)")
    if why is not None:
        raise SpecError(f"sf.jit(accumulate={accumulate!r}) with {why}.\nFix: accumulate='reduce_each' where "
                        f"that is the limit, or train eagerly with step.accumulate(...) and the optimizer.")


class TracedStep:
    """The compiled train step of `sf.jit` (one compiled function per shard layout)."""

    def __init__(self, step, opt, backend: str, options: dict, inplace: bool = False, accumulate: str | None = None):
        self.step, self.opt, self.backend, self.options, self.inplace = step, opt, backend, options, inplace
        self.accumulate = accumulate
        self.record = TrafficRecord()
        self._compiled: dict[int, object] = {}
        self._loss_checked: set = set()  # the keys whose first call's loss was checked (tensor parallel)

    def stats(self) -> dict[str, int]:
        """Collective bytes and count of one call of the compiled graph (counted in the graph
        after the schedule pass; `step.stats()`'s keys, without `peak_gathered_bytes`)."""
        return self.record.stats()

    def __call__(self, shards, opt_state, batch):
        plan = api.plan_of(self.step, shards)
        micro = self._micro_batches(batch)
        key = (id(plan), None if micro is None else len(micro))
        fn = self._compiled.get(key)
        if fn is None:
            check_traceable(self.step, plan)
            fn = self._compiled[key] = self._compile(plan, 1 if micro is None else len(micro))
        paths, leaves, treedef = _tree.flatten_with_paths(shards)
        api.check_shards(self.step, plan, paths, leaves, self.step.mesh.group(self.step.config.shard_axes).index)
        state_leaves, state_def = _tree.flatten(opt_state)
        if micro is None:
            n, batch = _batch_size(batch), _cast_batch(self.step.config, batch)
        else:
            n, batch = [_batch_size(b) for b in micro], [_cast_batch(self.step.config, b) for b in micro]
        with _tracing_config(), api.loss_binding(self.step, plan):
            try:
                out = fn(leaves, state_leaves, batch, n)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed,
                    torch._dynamo.exc.UserError) as e:  # UserError: a data-dependent shape (a MoE's routing)
                ours = _raised_while_tracing(e)
                if ours is not None:
                    raise ours from e
                if "disjoint backward regions that require recomputation" in str(e) and self.accumulate:
                    raise SpecError(
                        f"sf.jit(accumulate={self.accumulate!r}) with sf.remat in loss_fn: torch "
                        f"{torch.__version__}'s compiler recomputes one backward region per graph, and each "
                        f"micro-batch's backward is one.\nFix: accumulate=None (one micro-batch per call), drop "
                        f"sf.remat, or train eagerly with step.accumulate(...) and the optimizer.") from e
                raise ShardingError(_untraceable(e)) from e
        if self.step.config.check_finite:  # [Note: check_finite in the graph]
            *out, (local, reduced) = out
            _raise_if_nonfinite(self.step, plan, local, reduced)
        if key not in self._loss_checked:  # eager checks its first call's loss too ([Note: FSDP x TP])
            api.check_tp_loss(self.step, plan, out[0 if self.inplace else 2])
            self._loss_checked.add(key)
        if self.inplace:  # the graph wrote into `leaves` and `state_leaves`
            return (shards, opt_state) + tuple(out)
        new, new_state = _tree.unflatten(treedef, out[0]), _tree.unflatten(state_def, out[1])
        return (new, new_state) + tuple(out[2:])

    def _micro_batches(self, batch) -> list | None:
        if self.accumulate is None:
            return None
        if not isinstance(batch, (list, tuple)) or not batch:
            raise SpecError(f"sf.jit(accumulate={self.accumulate!r}): the batch must be a non-empty list of "
                            f"micro-batches, got {type(batch).__name__}.\nFix: train(shards, state, [mb0, mb1, ...]) "
                            f"(e.g. list(zip(x.chunk(k), y.chunk(k))) of this rank's batch).")
        return list(batch)

    # -- building the graph ---------------------------------------------------------------
    def _reshard_flags(self, plan, micro: int = 1) -> tuple[bool, ...]:
        again = self.step.config.reshard_after_forward
        return tuple(again and not unit.is_root for unit in plan.units if unit.sharded) * micro

    def _compile(self, plan, micro: int = 1):
        trees = skeleton(plan.treedef), skeleton(list_state(self.opt, plan))
        for tree in trees:  # a container `fill` cannot rebuild: a SpecError here, not inside the trace
            fill(tree, [None] * len(_tree.flatten(tree)[0]))
        static = _Static.of(self.step, plan, self.inplace, self.accumulate)
        body = functools.partial(_train, static, self.step.loss_fn, self.opt, plan, *trees)
        flags, prefetch, hpz = self._reshard_flags(plan, micro), self.step.config.prefetch, _hpz(self.step)
        if self.backend == "inductor":
            options = dict(self.options, post_grad_custom_pre_pass=SchedulePass(flags, self.record, prefetch, hpz),
                           post_grad_custom_post_pass=pin_pass(self.record))
            options.setdefault("fx_graph_cache", False)  # the pass must run: it counts the traffic
            # inductor's locality pass sinks each weight gradient's mm to its unit's gradient pack,
            # which put every reduce-scatter after the whole backward: [Note: overlap in the graph]
            options.setdefault("reorder_for_locality", False)
            return torch.compile(body, fullgraph=True, backend="inductor", options=options)
        from torch._dynamo.backends.common import aot_autograd

        def compiler(gm, example_inputs):
            schedule_units(gm.graph, flags, self.record, prefetch, hpz)
            gm.recompile()
            return gm

        return torch.compile(body, fullgraph=True, backend=aot_autograd(fw_compiler=compiler))


# Logger methods a model's forward may call (transformers' GPT-2 logs a warning_once there):
# dynamo refuses them ("logging.Logger method not supported"), a graph break; they change no
# number, so the trace skips them (the message is not printed from the compiled step).
_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "warning_once", "info_once")


@contextlib.contextmanager
def _tracing_config():
    """dynamo traces `torch.autograd.grad` only when asked, and skips logging calls; the AOT
    cache would skip the pass; remat across collectives ([Note: remat across a collective's
    backward] in remat.py)."""
    import logging

    import torch._dynamo
    import torch._functorch.config

    quiet = {m for m in (getattr(logging.Logger, name, None) for name in _LOG_METHODS) if m is not None}
    with torch._dynamo.config.patch(trace_autograd_ops=True, ignore_logger_methods=quiet), \
            torch._functorch.config.patch(enable_autograd_cache=False), remat_across_collectives(), \
            graph.fullgraph():
        yield


# [Note: check_finite in the graph]
# The eager step checks the loss (forward) and each unit's reduced gradient (backward) with
# a (1,) float32 flag all-reduced by max over every mesh axis, and raises before anything
# is updated. A graph cannot raise a Python error, so the traced step computes the same
# flags and all-reduces them one by one (the same bytes and count in `stats()`), returns
# them beside its results, and the host reads them once per step (one sync, as eager's
# flags read one each): on a non-finite one it raises eager's NonFiniteError, naming the
# first flag in eager's order and the ranks that set it; the new shards and state it
# computed are dropped, so no update was applied. With `inplace=True` the graph writes
# `where(all finite, new, old)` into the donated tensors, which keeps them as they were.


def _raise_if_nonfinite(step, plan, local: torch.Tensor, reduced: torch.Tensor) -> None:
    bad = [i for i, flag in enumerate(reduced.tolist()) if flag]
    if bad:
        api.raise_nonfinite(step, finite_checks(plan)[bad[0]], local[bad[0]:bad[0] + 1])


def _hpz(step) -> Hpz | None:
    """The backward re-gather's sub-group, with `reshard_after_forward=<inner shard axes>`
    ([Note: hpZ in the graph] in schedule.py)."""
    cfg = step.config
    if not cfg.reshard_axes:
        return None
    sub = step.mesh.group(cfg.reshard_axes)
    return Hpz(step.mesh.axis_size(cfg.shard_axes), sub.size, sub.index, sub.pg.group_name)


def _batch_size(batch) -> int:
    """The leading dim the batch's tensor leaves share (0-dim leaves aside), else -1."""
    sizes = {int(x.shape[0]) for x in _tree.flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else -1


def _cast_batch(cfg, batch):
    mp = cfg.mixed_precision
    if mp is None or mp.param_dtype is None or not mp.cast_inputs:
        return batch
    return _tree.tree_map(lambda x: x.to(mp.param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point()
                          else x, batch)


def _raised_while_tracing(e: Exception) -> Exception | None:
    """shardfn's own SpecError / ShardingError raised by code dynamo was tracing (loss_fn's
    sf.remat, a collective's check): dynamo reports it as an "Observed exception" whose
    cause is `Observed<Name>Error("raised exception Name('message')")`; the message is the
    user's, so it is raised as itself, not as an untraceable step."""
    kinds = {"SpecError": SpecError, "ShardingError": ShardingError}
    seen = e
    while seen is not None:
        found = re.fullmatch(r"raised exception (\w+)\((.*)\)", str(seen).strip(), re.S)
        if found and found.group(1) in kinds:
            try:
                message = ast.literal_eval(found.group(2))
            except (ValueError, SyntaxError):
                return None
            return kinds[found.group(1)](message) if isinstance(message, str) else None
        seen = seen.__cause__ or seen.__context__
    return None


def _untraceable(e: Exception) -> str:
    """The message for a step dynamo could not capture whole (`Unsupported`: a graph
    break under fullgraph; `UserError`: a guard on a data-dependent size, e.g. a MoE loop
    over the experts its tokens were routed to) or captured but could not compile
    (`BackendCompilerFailed`: e.g. an `.item()` whose unbacked scalar AOTAutograd's traced
    backward cannot take)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = "; ".join(lines[:2]) if lines else type(e).__name__
    return (
        f"sf.jit: the train step cannot be traced as one graph: {first}\n"
        f"A traced loss_fn must be one graph: no .item() / float(tensor) / print of a tensor, no Python "
        f"if/while on a tensor's value (use torch.where). The same holds for a learning-rate schedule of your own: in the graph it "
        f"gets the step count as a 0-dim tensor (docs/optim.md).\nFix: rewrite that part of loss_fn or the "
        f"schedule, or train eagerly with sf.train_step(step, opt)."
    )


# -- the traced function --------------------------------------------------------------------


class _Static(NamedTuple):
    """What the traced body reads of the step and mesh: plain constants (dynamo would
    otherwise trace the mesh's lookups)."""

    has_aux: bool
    mp: object  # MixedPrecision or None
    shard_name: str  # registered name of the shard group's process group
    data_name: str
    data_size: int
    weighting: str
    inplace: bool  # write the results into the input tensors
    tp_size: int = 1  # the size of the tensor-parallel axes: the loss mean's cotangent is 1/(N * tp_size)
    check_finite: bool = False
    all_name: str | None = None  # the group of every mesh axis (check_finite's flags)
    accumulate: str | None = None  # step.accumulate's mode, or None
    whole_groups: tuple = ()  # per whole (replicated) leaf index, the group its gradient is summed over, or None
    regions: tuple = ()  # per unit, ((group name, start, stop), ...) summed after its reduce-scatter

    @classmethod
    def of(cls, step, plan, inplace: bool = False, accumulate: str | None = None) -> "_Static":
        cfg, mesh = step.config, step.mesh
        data = mesh.group(cfg.data_axes)
        every = mesh.group(mesh.axis_names)
        tp_size = math.prod(mesh.shape[a] for a in plan.tp_axes)
        return cls(cfg.has_aux, cfg.mixed_precision, mesh.group(cfg.shard_axes).pg.group_name,
                   data.pg.group_name, data.size, cfg.batch_weighting, inplace, tp_size, cfg.check_finite,
                   every.pg.group_name if every.size > 1 else None, accumulate, _whole_groups(step, plan),
                   _regions(step, plan))


def _whole_groups(step, plan) -> tuple:
    """Per leaf index, the registered name of the group a whole leaf's gradient is summed
    over (None for a sharded leaf, or a group of one): eager's `all_reduce_replicated`
    groups, the shard axes then the leaf's HSDP replica axes, in that order (the same
    process group, so the same sums, bit for bit)."""
    cfg, mesh = step.config, step.mesh
    names: list = [None] * len(plan.leaves)
    for unit in plan.units:
        for layout in unit.replicated:
            group = mesh.group(tuple(cfg.shard_axes) + layout.replica_axes + layout.reduce_axes)
            names[layout.index] = group.pg.group_name if group.size > 1 else None
    return tuple(names)


def _regions(step, plan) -> tuple:
    """Per unit, the shard-buffer ranges summed after its reduce-scatter, as eager's
    `finish_reduce` sums them: HSDP's replica axes, then the tensor-parallel axes the
    leaves there are replicated over ([Note: FSDP x TP]); by registered group name."""
    mesh = step.mesh
    return tuple(tuple((mesh.group(axes).pg.group_name, start, stop)
                       for axes, start, stop in unit.replica_regions + unit.regions) for unit in plan.units)


def _unpack(unit, gathered: torch.Tensor) -> list[torch.Tensor]:
    """(k * S,) rank-major gathered buffer -> each sharded leaf's full tensor: one split of
    the (k, S) rows into the leaves' (k, c * row) regions (and the padding between them),
    then reshape, where eager copies into a leaf-major buffer it owns (`plan.copy_out`).
    Split, not a narrow per leaf: its transpose is one cat of the leaves' gradients into
    `plan.pack_grads`'s layout, where a narrow's is a zero-padded buffer per leaf, summed
    ([Note: the gradient pack is a cat])."""
    rows = gathered.view(unit.k, unit.shard_numel)
    sizes, at = [], 0
    for layout in unit.sharded:
        if layout.offset > at:
            sizes.append(layout.offset - at)
        sizes.append(layout.chunk_numel)
        at = layout.offset + layout.chunk_numel
    if unit.shard_numel > at:
        sizes.append(unit.shard_numel - at)
    pieces = iter(rows.split_with_sizes(sizes, dim=1))
    out, at = [], 0
    for layout in unit.sharded:
        if layout.offset > at:
            next(pieces)
        region = next(pieces)  # (k, c * row)
        at = layout.offset + layout.chunk_numel
        full = region.reshape((unit.k * layout.chunk,) + layout.shape[1:])
        out.append(full.narrow(0, 0, layout.rows))
    return out


def _wires(mp, unit) -> Wires:
    """The unit's wire formats, as the eager runtime resolves them (`_fsdp/groups.py`)."""
    if mp is None:
        return Wires()
    gather, reduce = mp.wires()
    return Wires(gather, segments(unit) if gather is not None else None, reduce)


def _gather_params(static: _Static, plan, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    mp, name = static.mp, static.shard_name
    full: list = [None] * len(leaves)
    for u, unit in enumerate(plan.units):
        if unit.sharded:
            param_dtype = (mp.param_dtype if mp is not None else None) or unit.dtype
            reduce_dtype = (mp.reduce_dtype if mp is not None else None) or param_dtype
            shards = [leaves[layout.index] for layout in unit.sharded]
            buf = pack_shards(unit, shards, shards[0].dtype, shards[0].device)  # eager's copy-in (pad + cat)
            gathered = GatherFlat.apply(buf, unit.k, name, param_dtype, reduce_dtype, static.regions[u],
                                        _wires(mp, unit))
            for layout, value in zip(unit.sharded, _unpack(unit, gathered)):
                full[layout.index] = value
        for layout in unit.replicated:  # whole leaves keep their dtype, as in eager
            full[layout.index] = leaves[layout.index]
    return full


def _reduce_replicated(static: _Static, plan, leaves, grads: list) -> None:
    """Whole leaves' gradients: one flat all-reduce (sum) per unit and group (the shard
    axes and the leaf's HSDP replica axes: `_whole_groups`), in place in `grads`, as eager's
    `all_reduce_replicated` (frozen units have none)."""
    mp = static.mp
    for unit in plan.units:
        if unit.frozen:
            continue
        by_group: dict = {}
        for layout in unit.replicated:
            if layout.dtype.is_floating_point:
                by_group.setdefault(static.whole_groups[layout.index], []).append(layout.index)
        for name, floats in by_group.items():
            if name is None:  # a group of one: nothing to sum
                continue
            dtype = (mp.reduce_dtype if mp is not None else None) or functools.reduce(
                torch.promote_types, (grads[i].dtype for i in floats), torch.float32)
            flat = all_reduce_sum(torch.cat([grads[i].reshape(-1).to(dtype) for i in floats]), name)
            start = 0
            for i in floats:
                n = grads[i].numel()
                grads[i] = flat.narrow(0, start, n).reshape(grads[i].shape).to(leaves[i].dtype)
                start += n


def _loss_mean(static: _Static, loss: torch.Tensor, n: int) -> torch.Tensor:
    """The eager step's loss all-reduce, same payload ([Note: the batch size rides on the loss
    all-reduce]); the equal-batch check is an in-graph assert."""
    k, name = static.data_size, static.data_name
    if k == 1:  # a data group of one: no all-reduce, as in eager
        return loss.detach()
    if static.weighting == "mean_of_means":
        return all_reduce_sum(loss.detach(), name) / k
    meta = [float(n), float(n * n), 0.0] if n >= 0 else [0.0, 0.0, 1.0]
    packed = torch.cat([loss.detach().reshape(1).to(torch.float64),
                        torch.tensor(meta, dtype=torch.float64, device=loss.device)])
    total = all_reduce_sum(packed, name)
    sum_n, sum_nn, unknown = total[1], total[2], total[3]
    equal = (unknown == k) | ((unknown == 0) & (k * sum_nn == sum_n * sum_n))
    torch._assert_async(equal, "sf.jit: the local batches differ in size across the data axes; give every rank "
                               "the same number of examples, or use batch_weighting='mean_of_means'")
    return (total[0] / k).to(loss.dtype)


def _global_mean(static: _Static, loss: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_weighting="global_mean"`: the loss mean over the global batch and this rank's
    weight in it, from the eager step's one all-reduce of (n * loss, n, n^2, unknown)
    (`_fsdp/batch.py` `reduce_loss`), issued before the backward as there; the weight is
    1/N when the sizes are equal (eager's None) and n / sum(n) otherwise, rounded to the
    loss' dtype as eager's backward seed is. Unknown sizes or an empty global batch are an
    in-graph assert on every rank."""
    value = loss.detach().reshape(1).to(torch.float64)
    value = value * n if n > 0 else torch.zeros_like(value)  # an empty batch's (NaN) mean counts 0 times
    meta = [float(n), float(n * n), 0.0] if n >= 0 else [0.0, 0.0, 1.0]
    total = all_reduce_sum(torch.cat([value, torch.tensor(meta, dtype=torch.float64, device=loss.device)]),
                           static.data_name)
    sum_n, sum_nn, unknown = total[1], total[2], total[3]
    torch._assert_async((unknown == 0) & (sum_n > 0),
                        "sf.jit: batch_weighting='global_mean' needs every rank's batch size (one leading dim of "
                        "the batch's tensor leaves) and a non-empty global batch")
    k = static.data_size
    weight = torch.where(k * sum_nn == sum_n * sum_n, torch.full_like(sum_n, 1.0 / k), max(n, 0) / sum_n)
    return (total[0] / sum_n).to(loss.dtype).reshape(loss.shape), (weight / static.tp_size).to(loss.dtype)


def _nonfinite(values: list[torch.Tensor]) -> torch.Tensor:
    """check_finite's flag: (1,) float32, 1.0 when any of `values` is NaN or infinite."""
    bad = torch.stack([(~torch.isfinite(v.detach())).any() for v in values]).any()
    return bad.to(torch.float32).reshape(1)


def finite_checks(plan) -> list[str]:
    """What `check_finite`'s flags check, in the eager step's order (the loss in the forward,
    then each reduced sharded unit's gradient in backward order): the error's subject."""
    units = [u for u in reversed(plan.units) if u.sharded and not u.frozen]
    return ["the loss"] + [f"the gradient of {unit.name()}" for unit in units]


def _flags(static: _Static, plan, loss, grads: list) -> tuple[torch.Tensor, torch.Tensor]:
    """check_finite in the graph: (local flags, their max over every mesh axis), one tiny
    all-reduce per flag as the eager step issues them ([Note: check_finite in the graph])."""
    units = [u for u in reversed(plan.units) if u.sharded and not u.frozen]
    local = [_nonfinite([loss])] + [_nonfinite([grads[layout.index] for layout in u.sharded]) for u in units]
    if static.all_name is None:
        return torch.cat(local), torch.cat(local)
    reduced = [all_reduce_max(flag, static.all_name) for flag in local]
    return torch.cat(local), torch.cat(reduced)


# [Note: accumulation in the graph]
# `sf.jit(step, opt, accumulate=mode)` is eager `step.accumulate(shards, micro_batches,
# mode=mode)` followed by the update, traced as one graph: the micro-batches' forwards and
# backwards are unrolled in order (each gathers its units again, as each eager call does,
# and the schedule pass sees the units' flags once per micro-batch). "reduce_each": each
# micro-batch's gradient goes through its reduce-scatter and the whole leaves' all-reduce,
# and the shard gradients are summed. "reduce_once": the gradient is taken at the gathered
# full leaves and summed there; the last micro-batch's sum is pushed through its gather,
# whose backward is the one reduce-scatter per unit (the whole leaves: one all-reduce of
# their sums). Then grads and loss are divided by the count, as eager does: bit for bit
# with eager under aot_eager. Refused for now: check_finite and global_mean with
# accumulation, and reduce_once with a reduce dtype or wire format of its own.


def _micro(static: _Static, loss_fn, plan, skeleton, live: list, batch, n: int, hold: list | None = None):
    """One micro-batch's (or the whole batch's) part of the traced step: gather, loss,
    gradient. Returns (grads per leaf or None, the loss mean, aux, the loss, the full
    leaves). `hold`: [Note: accumulation in the graph] -- None: the gradient of the shard
    leaves (through the reduce-scatter); a list: reduce_once's held sums so far (None
    for the first) -- the gradient is taken at the gathered full leaves instead, where
    the held sums are added, and no reduce-scatter runs."""
    full = _gather_params(static, plan, live)
    out = loss_fn(fill(skeleton, full), batch)
    loss, aux = out if static.has_aux else (out, None)
    k = static.data_size
    mean = None
    if static.weighting == "global_mean" and k > 1:
        mean, weight = _global_mean(static, loss, n)
    else:
        weight = 1.0 / (k * static.tp_size)  # [Note: FSDP x TP] rule (1), as eager's LossMean
    wanted = [i for i, x in enumerate(live) if x.requires_grad]
    if hold is None:
        got = torch.autograd.grad(loss * weight, [live[i] for i in wanted], allow_unused=True)
    else:  # at the full leaves (sharded ones) and the whole leaves themselves
        sharded = {layout.index for unit in plan.units for layout in unit.sharded}
        at = [full[i] if i in sharded else live[i] for i in wanted]
        got = torch.autograd.grad(loss * weight, at, allow_unused=True)
        got = [g if h is None else (h if g is None else h + g) for g, h in zip(got, hold)]
    by_leaf = dict(zip(wanted, got))
    grads = [by_leaf.get(i) for i in range(len(live))]
    if mean is None:
        mean = _loss_mean(static, loss, n)
    mp = static.mp
    if mp is not None and mp.output_dtype is not None:
        mean = mean.to(mp.output_dtype)
    return grads, mean, aux, loss, full


def _through_gather(plan, live: list, full: list, held: list) -> list:
    """reduce_once's last micro-batch: the held sums pushed through that micro-batch's
    gather (its backward is the one reduce-scatter per unit), the whole leaves' sums as
    they are."""
    sharded = [layout.index for unit in plan.units for layout in unit.sharded
               if held[layout.index] is not None]
    got = torch.autograd.grad([full[i] for i in sharded], [live[i] for i in sharded],
                              grad_outputs=[held[i] for i in sharded], allow_unused=True)
    out = list(held)
    for i, g in zip(sharded, got):
        out[i] = g
    return out


def _accumulated(static: _Static, loss_fn, plan, skeleton, live: list, micro_batches, sizes):
    """[Note: accumulation in the graph] The eager `step.accumulate` then the update:
    grads and loss are the means over micro-batches, summed in eager's order."""
    m = len(micro_batches)
    total, total_loss, auxes = None, None, []
    if static.accumulate == "reduce_each":
        for batch, n in zip(micro_batches, sizes):
            grads, mean, aux, _, _ = _micro(static, loss_fn, plan, skeleton, live, batch, n)
            grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, live)]
            _reduce_replicated(static, plan, live, grads)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            total_loss = mean if total_loss is None else total_loss + mean
            auxes.append(aux)
    else:  # reduce_once: full gradients held, one reduce-scatter (and all-reduce) on the last
        wanted = [i for i, x in enumerate(live) if x.requires_grad]
        held = [None] * len(wanted)
        for j, (batch, n) in enumerate(zip(micro_batches, sizes)):
            got, mean, aux, _, full = _micro(static, loss_fn, plan, skeleton, live, batch, n, hold=held)
            held = [got[i] for i in wanted]
            total_loss = mean if total_loss is None else total_loss + mean
            auxes.append(aux)
        total = _through_gather(plan, live, full, got)
        total = [g if g is not None else torch.zeros_like(x) for g, x in zip(total, live)]
        _reduce_replicated(static, plan, live, total)
    grads = [g / m for g in total]
    return grads, total_loss / m, auxes


def _train(static: _Static, loss_fn, opt, plan, skeleton, state_skeleton, leaves: list, state_leaves: list, batch,
           n):
    """The traced body: [Note: the traced step]."""
    frozen = {layout.index for unit in plan.units if unit.frozen for layout in unit.sharded + unit.replicated}
    live = [x.detach().requires_grad_(x.is_floating_point() and i not in frozen) for i, x in enumerate(leaves)]
    flags = None
    if static.accumulate is not None:
        grads, mean, aux = _accumulated(static, loss_fn, plan, skeleton, live, batch, n)
    else:
        grads, mean, aux, loss, _ = _micro(static, loss_fn, plan, skeleton, live, batch, n)
        grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves)]
        flags = _flags(static, plan, loss, grads) if static.check_finite else None
        _reduce_replicated(static, plan, leaves, grads)
    with torch.no_grad():
        opt_state = fill(state_skeleton, state_leaves)
        updates, opt_state = opt.update(grads, opt_state, list(leaves))
        new = apply_updates(list(leaves), updates)
    new_state = leaves_of(opt_state, [])
    tail = () if flags is None else (flags,)
    if static.inplace:  # donated inputs: AOTAutograd keeps the mutation, inductor stores into them
        with torch.no_grad():
            ok = None if flags is None else flags[1].sum() == 0  # a non-finite step writes nothing
            for old, value in zip(leaves + state_leaves, new + new_state):
                old.copy_(value if ok is None else torch.where(ok, value, old))
        return ((mean, aux) if static.has_aux else (mean,)) + tail
    if static.has_aux:
        return (new, new_state, mean, aux) + tail
    return (new, new_state, mean) + tail
