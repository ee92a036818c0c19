"""shard(loss_fn, mesh): fully sharded data parallel training as a function transform.

`step = shard(loss_fn, mesh)`; `shards = step.shard_params(params)`; `step(shards, batch)`
returns the loss averaged over the data axes, and its gradient with respect to `shards`
(by `loss.backward()` or `torch.func.grad`) is the data-parallel mean gradient, already
reduce-scattered to each rank's shard. The file map is in `shardfn/_fsdp/__init__.py`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Hashable

import torch

from .. import _tree
from .._backend import ops
from .._compile import WHOLE_STEP, not_traced
from .._agree import check_same_everywhere
from .._autodiff import eager_grad_and_value
from .._binding import binding, bound_mesh
from .._errors import ShardingError, SpecError
from .._remat_modules import checkpoint_error
from .._blocks import slice_block
from .._spec import chunk_bounds
from . import funcgrad, tp
from .config import Config, MixedPrecision, make_config
from .plan import Plan, build_plan, in_unit_buffers
from . import support
from .batch import UNKNOWN, batch_is_vmapped, local_batch_size, micro_batch_weights, warn_if_examples_differ
from .reduce import Stats
from .runtime import RankState
from .schedule import StepMode
from .unshard import iter_unshard
from .view import make_view

__all__ = ["shard", "Shard"]

_COLLECTIVES = "shard's collectives run eagerly ([Note: no whole-step graph] in shardfn/_compile.py)"


class Shard:
    """The callable returned by `sf.shard`. See `shard` for the arguments."""

    def __init__(self, loss_fn: Callable, mesh, config: Config):
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.config = config
        self._plans: dict[Any, Plan] = {}  # treedef -> the plan its shards follow
        self._by_signature: dict[Any, Plan] = {}  # (treedef, shapes, dtypes) -> plan
        self._lock = threading.Lock()
        self._last_plan: Plan | None = None
        self._states: dict[tuple[int, int], RankState] = {}
        self._vmap_checked: set[int] = set()  # ranks whose first vmapped call checked the examples
        self.__wrapped__ = loss_fn

    # -- params <-> shards ----------------------------------------------------------------
    @not_traced(_COLLECTIVES)
    def shard_params(self, params):
        """This rank's shards of a full parameter tree that every rank holds.

        Each leaf is split on dim 0 with `torch.chunk` over the shard axes (0-dim and
        non-float leaves are kept whole). Checks once, with one small collective, that every
        rank passed the same structure, shapes and dtypes.
        """
        mesh = self.mesh
        paths, leaves, treedef = _tree.flatten_with_paths(params)
        self._check_same_everywhere(paths, leaves)
        plan, blocks = self._lay_out(params, paths, leaves, treedef)
        index = mesh.group(self.config.shard_axes).index
        shards = []
        for layout, leaf in zip(plan.leaves, blocks):
            leaf = leaf.detach().to(mesh.device)
            if layout.sharded:
                start, stop = chunk_bounds(layout.rows, plan.k, index)
                leaf = leaf[start:stop]
            shards.append(leaf.clone())
        return _tree.unflatten(treedef, in_unit_buffers(plan, shards))  # [Note: shards in one buffer]

    def init_shards(self, init_fn, seed: int):
        """This rank's shards of a parameter tree described by `sf.init`, drawn on this rank only.

        No rank ever holds the full tree: each draws only its own dim-0 chunk of each leaf
        (with `param_specs`, of its tensor-parallel block), plus one row block at a time.
        The values do not depend on the world size: `step.unshard_params(shards)` equals
        `sf.init.materialize(init_fn, seed)` bit for bit at any N. The shards are laid out
        exactly as `step.shard_params` lays out real params (same plan, same checks).

        Args:
          init_fn: a pytree of `sf.init.Param(shape, initializer, dtype)`, or a function
            returning one, called under `torch.device("meta")` (e.g.
            `lambda: sf.init.from_module(GPT(cfg))`).
          seed: an int, the same on every rank (checked, with the description, by one
            small collective).

        Returns:
          This rank's shards, the structure of the description.

        Example:
          >>> import shardfn as sf, torch
          >>> mesh = sf.local_mesh({"data": 2})
          >>> step = sf.shard(lambda p, x: (x @ p["w"] + p["b"]).square().mean(), mesh)
          >>> desc = {"w": sf.init.normal(std=0.02)((4, 3)), "b": sf.init.zeros()((3,))}
          >>> def per_rank():
          ...     shards = step.init_shards(desc, seed=0)
          ...     full = step.unshard_params(shards)
          ...     return tuple(shards["w"].shape), torch.equal(full["w"], sf.init.materialize(desc, 0)["w"])
          >>> mesh.run(per_rank)
          [((2, 3), True), ((2, 3), True)]
        """
        from .init import init_shards

        return init_shards(self, init_fn, seed)

    def _lay_out(self, params, paths, leaves, treedef, *, allow_meta: bool = False):
        """`(plan, blocks)` for these leaves: their tensor-parallel specs resolved and
        checked, the blocks the shard group splits (with tensor parallelism this rank's
        tensor-parallel block of each leaf), and their plan, from or into the step's cache
        (rank threads share one plan per signature, and so its RankStates)."""
        mesh, cfg = self.mesh, self.config
        tp_specs = tp.tp_specs(cfg.param_specs, params, paths, leaves, mesh, cfg.data_axes, cfg.shard_axes)
        blocks = [slice_block(x, s, mesh) if s.axes else x for x, s in zip(leaves, tp_specs)]
        signature = (treedef, tuple((tuple(getattr(x, 'shape', ())), getattr(x, 'dtype', type(x))) for x in blocks))
        with self._lock:
            plan = self._by_signature.get(signature)
            if plan is None:
                tp_axes = tp.tp_axes(mesh, tp_specs, cfg.data_axes)
                plan = build_plan(_tree.unflatten(treedef, blocks), mesh.axis_size(cfg.shard_axes), cfg.units,
                                  cfg.replicated, cfg.frozen, tp_axes=tp_axes, tp_specs=tp_specs,
                                  reduce_axes=[tp.reduce_axes(s, tp_axes, mesh) for s in tp_specs],
                                  replica_axes=[tp.replica_axes(s, cfg.data_axes, cfg.shard_axes, mesh)
                                                for s in tp_specs],
                                  allow_meta=allow_meta)
                self._by_signature[signature] = plan
            self._plans[(self._rank(), treedef)] = plan
            self._last_plan = plan
        tp.check_nested_chunks(plan, leaves, tp_specs, mesh, cfg.shard_axes)
        return plan, blocks

    def _rank(self) -> int:
        return self.mesh.rank if self.mesh.in_rank() else -1

    def _check_same_everywhere(self, paths, leaves) -> None:
        lines = [f"params{_tree.keystr(p)}: {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else
                 f"params{_tree.keystr(p)}: {type(x).__name__}" for p, x in zip(paths, leaves)]
        check_same_everywhere(
            self.mesh.group(self.mesh.axis_names), lines, "parameter trees to shard_params",
            "build the params identically on every rank (same code, same seed), then call shard_params on "
            "every rank.",
        )

    @not_traced(_COLLECTIVES)
    def unshard_params(self, shards):
        """The full parameter tree on every rank (for evaluation or export); no autograd.

        Collective. Gathers one unit at a time (`shardfn/_fsdp/unshard.py`), keeping each.
        """
        plan = self._plan_for(shards)
        _, leaves, treedef = _tree.flatten_with_paths(shards)
        full_leaves = list(leaves)
        for index, leaf in iter_unshard(self, shards):  # a sharded leaf is a view of its unit's buffer
            full_leaves[index] = leaf.clone() if plan.leaves[index].sharded else leaf
        return _tree.unflatten(treedef, full_leaves)

    @property
    def specs(self):
        """The spec tree of the shards (dim 0 over the shard axes; P() for whole leaves)."""
        if self._last_plan is None:
            raise ShardingError("step.specs: call step.shard_params(params) first; the specs describe its shards")
        plan = self._last_plan
        axes = self.config.shard_axes
        return _tree.unflatten(plan.treedef, [tp.combined_spec(l.sharded, s, axes) for l, s in zip(plan.leaves, plan.tp_specs)])

    def stats(self) -> dict[str, int]:
        """Collective bytes, count and peak gathered bytes of this rank's last call; after
        `check_stragglers`, also every rank's step and busy time of that call
        (`rank_step_time_s`, `rank_busy_time_s`: lists in the order of the ranks)."""
        rank = self.mesh.rank if self.mesh.in_rank() else 0
        for (r, _), state in self._states.items():
            if r == rank:
                return {**state.stats.values, **(state.timings or {})}
        return dict.fromkeys(Stats.KEYS, 0)

    def check_stragglers(self, *, ratio: float = 1.5, patience: int = 3, min_s: float = 0.05) -> dict:
        """Exchange this rank's time of the last step with every rank and warn about a straggler.

        Call it on every rank after a step ([Note: busy time] in shardfn/_fsdp/stragglers.py):
        one small all-gather over every mesh axis (not counted in `stats()`'s bytes). A rank
        whose busy time (the step's time outside collective waits) exceeds `ratio` times the
        other ranks' median, and `min_s` seconds more, in each of the last `patience` checks,
        is named in a `StragglerWarning`.

        Returns:
          `{"ranks": [...], "step_time_s": [...], "busy_time_s": [...], "slow": [ranks]}`;
          `stats()` then also holds the two time lists.
        """
        from .stragglers import check

        rank = self.mesh.rank
        state = next((s for (r, _), s in self._states.items() if r == rank), None)
        if state is None or state.calls == 0:
            raise ShardingError("shard.check_stragglers: this step has not run on this rank yet.\n"
                                "Fix: call it after a step (step(...), grad_and_value, torch.func.grad(step)).")
        return check(state, ratio=ratio, patience=patience, min_s=min_s)

    # -- gradients ------------------------------------------------------------------------
    @not_traced(WHOLE_STEP, warn=True)  # [Note: no whole-step graph] in shardfn/_compile.py
    def grad_and_value(self, shards, batch, *rest):
        """`(grads, loss)` (with `has_aux`: `(grads, (loss, aux))`), like
        `torch.func.grad_and_value(step)` but on eager autograd, with each unit's gradient
        reduce-scatter overlapping the backward of the units before it and waited once at
        the end: the fast path that `sf.train_step` takes. Leaves without a gradient get zeros.
        """
        return self._grad_and_value(shards, batch, *rest)

    def _grad_and_value(self, shards, batch, *rest, where: str = "shard: step.grad_and_value"):
        """`grad_and_value`, its errors naming `where` (the entry point the user called)."""
        state = self._state(self._plan_for(shards))
        state.mode = StepMode.DEFERRED
        done = False
        try:
            grads, out = eager_grad_and_value(self, shards, batch, *rest, has_aux=self.config.has_aux)
            done = True
        except RuntimeError as e:  # torch.utils.checkpoint in loss_fn: point to sf.remat
            raise (checkpoint_error(e, where) or e) from e
        finally:
            state.mode = StepMode.EAGER
            state.finish_deferred(complete=done)
        value = (out[0].detach(), out[1]) if self.config.has_aux else out.detach()
        return grads, value

    # -- gradient accumulation ------------------------------------------------------------
    @not_traced(WHOLE_STEP, warn=True)  # [Note: no whole-step graph] in shardfn/_compile.py
    def accumulate(self, shards, micro_batches, *rest, mode: str = "reduce_each"):
        """`(grads, loss)` of one step over several micro-batches, equal to one big batch
        (the order of `torch.func.grad_and_value` and `Shard.grad_and_value`).

        Args:
          shards: this rank's shards.
          micro_batches: a sequence of this rank's micro-batches (equal sizes give exactly
            the big-batch mean; with `batch_weighting="global_mean"` any sizes do: each
            micro-batch weighs by its share of the step's global examples).
          mode: "reduce_each" reduce-scatters every micro-batch's gradient and sums the
            shards (memory: 1/N gradients; communication: one reduce-scatter per micro-batch);
            "reduce_once" keeps each unit's unsharded gradient sum locally and reduce-scatters
            it once, on the last micro-batch (communication: one reduce-scatter per unit per
            step; memory: + one full-model gradient buffer in reduce dtype).

        Returns:
          The mean gradient, shaped like `shards`, and the mean loss over micro-batches
          (with `has_aux`, `(grads, (loss, [aux, ...]))`).
        """
        if mode not in ("reduce_each", "reduce_once"):
            raise SpecError(f"shard.accumulate: mode must be 'reduce_each' or 'reduce_once', got {mode!r}")
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise SpecError("shard.accumulate: micro_batches is empty")
        state = self._state(self._plan_for(shards))
        state.drop_encoded()  # encoded once for all micro-batches ([Note: quantized all-gather] in gather.py)
        state.stats.reset()
        state.encoded.reset()
        weights = micro_batch_weights(micro_batches, self.config.batch_weighting, state.groups.data, state.stats)
        total_loss, total, auxes, done = None, None, [], False
        try:
            for i, (batch, w) in enumerate(zip(micro_batches, weights)):
                hold = mode == "reduce_once" and i < len(micro_batches) - 1
                state.mode = StepMode.ACCUMULATE_HOLD if hold else StepMode.ACCUMULATE
                # global_mean: the micro-batch's loss is weighted before its backward, so that
                # reduce_once's held gradient sums carry the weights too
                fn = self if w is None else functools.partial(_weighted, self, w * len(micro_batches))
                grads, out = torch.func.grad_and_value(fn, has_aux=self.config.has_aux)(shards, batch, *rest)
                loss = out[0] if self.config.has_aux else out
                if self.config.has_aux:
                    auxes.append(out[1])
                total_loss = loss if total_loss is None else total_loss + loss
                total = grads if total is None else _tree.tree_map(torch.add, total, grads)
            done = True
        finally:
            state.mode = StepMode.EAGER
            state.drop_encoded()
            if not done:
                state.drop_held_grads()
        m = len(micro_batches)
        mean_loss = total_loss / m
        grads = _tree.tree_map(lambda g: g / m, total)
        return grads, ((mean_loss, auxes) if self.config.has_aux else mean_loss)

    # -- the step -------------------------------------------------------------------------
    def _first_vmapped_call(self, rank: int) -> bool:
        """True once per rank: [Note: vmap over the batch with per-rank examples] in batch.py."""
        with self._lock:
            first = rank not in self._vmap_checked
            self._vmap_checked.add(rank)
        return first

    def _plan_for(self, shards) -> Plan:
        treedef = _tree.flatten(shards)[1]
        plan = self._plans.get((self._rank(), treedef))
        if plan is None:
            known = f" (known structures: {[t for _, t in self._plans]})" if self._plans else ""
            raise ShardingError(
                f"shard: these shards have a tree structure this step has not laid out{known}.\n"
                f"Fix: create them with step.shard_params(params) on every rank, and pass that tree."
            )
        return plan

    def _existing_state(self, plan: Plan) -> RankState | None:
        """This rank's RankState for `plan` if it has one (a stale entry of a freed plan whose
        id was reused is not)."""
        state = self._states.get((self.mesh.rank, id(plan)))
        return state if state is not None and state.plan is plan else None

    def _state(self, plan: Plan) -> RankState:
        state = self._existing_state(plan)
        if state is None:
            state = self._states[(self.mesh.rank, id(plan))] = RankState(plan, self.mesh, self.config)
        return state

    def _mode(self, plan: Plan) -> StepMode:
        """This rank's step mode for `plan`, without creating its RankState (which, made
        under a transform, would hold that transform's tensors)."""
        state = self._existing_state(plan)
        return state.mode if state is not None else StepMode.EAGER

    def _loss_binding(self, plan: Plan) -> binding:
        """The mesh binding `loss_fn` runs in: manual over the data and tensor-parallel axes
        (the other axes are auto there), its collectives vetted ([Note: FSDP x TP])."""
        manual = self.config.data_axes + plan.tp_axes
        return binding(self.mesh, tp.collective_axes_check(self.config.data_axes, plan.tp_axes), manual)

    def _check_shards(self, plan: Plan, paths, leaves, index: int) -> None:
        for layout, path, leaf in zip(plan.leaves, paths, leaves):
            expected = layout.local_shape(index, plan.k) if layout.sharded else layout.shape
            if not isinstance(leaf, torch.Tensor) or tuple(leaf.shape) != expected:
                got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
                raise ShardingError(
                    f"shard: shards{_tree.keystr(path)} has shape {got}, but this rank's shard of a "
                    f"{layout.shape} leaf over axes {self.config.shard_axes} has shape {expected}.\n"
                    f"Fix: pass the tree returned by step.shard_params (or updates of it of the same shapes)."
                )

    def _prepare_batch(self, batch, device, plan: Plan):
        mp = self.config.mixed_precision
        cast = mp.param_dtype if (mp is not None and mp.cast_inputs) else None
        compute = (mp.param_dtype if mp is not None else None) or next(
            (u.dtype for u in plan.units if u.dtype is not None and u.dtype.is_floating_point), None
        )

        def fix(path, x):
            if isinstance(x, torch.Tensor):
                # sf.estimate: integer batch leaves run for real on meta shards ([Note: what runs for real
                # in a dry run] in shardfn/_dry_run.py)
                if x.device != device and not (device.type == "meta" and ops.in_meta_run()):
                    raise ShardingError(
                        f"shard: batch{_tree.keystr(path)} is on {x.device}, but the shards are on {device}.\n"
                        f"Fix: move the batch to {device} (mesh.device) before calling the step."
                    )
                if cast is not None and x.is_floating_point():
                    return x.to(cast)
                if compute is not None and x.is_floating_point() and x.dtype != compute:
                    raise ShardingError(
                        f"shard: batch{_tree.keystr(path)} has dtype {x.dtype}, but the parameters compute in "
                        f"{compute}.\nFix: cast the batch (x.to({compute})), or let shard cast it with "
                        f"mixed_precision=sf.MixedPrecision(param_dtype={compute})."
                    )
            return x

        paths, leaves, treedef = _tree.flatten_with_paths(batch)
        return _tree.unflatten(treedef, [fix(p, x) for p, x in zip(paths, leaves)])

    @not_traced(WHOLE_STEP, warn=True)  # [Note: no whole-step graph] in shardfn/_compile.py
    def __call__(self, shards, batch, *rest):
        if bound_mesh() is not None:
            raise ShardingError("shard: a shard step cannot run inside another shard / shard_map")
        mesh = self.mesh
        if not mesh.in_rank():
            raise ShardingError(
                "shard: the step runs on a rank, with this rank's shards and local batch; this thread is "
                f"not a rank of the simulated mesh {mesh.shape}.\nFix: mesh.run(lambda: train(...)) — "
                "do the whole training loop inside mesh.run."
            )
        plan = self._plan_for(shards)
        paths, leaves, treedef = _tree.flatten_with_paths(shards)
        if funcgrad.eligible(self, self._mode(plan), leaves, (batch, *rest)):  # [Note: torch.func.grad of a whole step]
            return funcgrad.grad_path(self, shards, (batch, *rest))
        state = self._state(plan)
        self._check_shards(plan, paths, leaves, state.groups.shard_index)
        device = next((x.device for x in leaves), mesh.device)
        batch = self._prepare_batch(batch, device, plan)
        state.batch_size = local_batch_size(batch)  # for the loss mean ([Note: the batch size rides on ...])
        if state.batch_size == UNKNOWN and self.config.batch_weighting == "global_mean" and batch_is_vmapped(batch):
            support.refused_here("vmap", "global_mean")  # [Note: the composition table]
        if batch_is_vmapped(batch) and self._first_vmapped_call(mesh.rank):
            warn_if_examples_differ(batch, mesh.group(self.config.data_axes), self.config.data_axes)
        state.begin_step(leaves)
        view = make_view(treedef, len(leaves), state.leaf)
        try:
            with self._loss_binding(plan):
                out = self.loss_fn(view, batch, *rest)
        except RuntimeError as e:  # torch.utils.checkpoint in loss_fn: point to sf.remat
            raise (checkpoint_error(e, "shard: loss_fn") or e) from e
        finally:
            state.post_forward()
        loss, aux = (out if self.config.has_aux else (out, None))
        if self.config.has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise ShardingError("shard(has_aux=True): loss_fn must return a pair (loss, aux)")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ShardingError(
                f"shard: loss_fn must return a scalar tensor (0-dim), got {what}.\nFix: reduce it, e.g. "
                f"loss.mean(); to return more, use has_aux=True and return (loss, aux)."
            )
        loss = state.loss_mean(loss)
        mp = self.config.mixed_precision
        if mp is not None and mp.output_dtype is not None:
            loss = loss.to(mp.output_dtype)
        return (loss, aux) if self.config.has_aux else loss


def _weighted(step: Shard, factor: float, shards, batch, *rest):
    """`step(shards, batch, *rest)` with its loss times `factor` (aux untouched)."""
    out = step(shards, batch, *rest)
    return (out[0] * factor, out[1]) if step.config.has_aux else out * factor


def shard(
    loss_fn: Callable,
    mesh,
    *,
    data_axes="data",
    shard_axes=None,
    units: Callable[[tuple], Hashable] | None = None,
    reshard_after_forward: bool | str | tuple[str, ...] | int = True,
    prefetch: int = 1,
    mixed_precision: MixedPrecision | None = None,
    has_aux: bool = False,
    replicated: Callable[[tuple], bool] | None = None,
    frozen: Callable[[tuple], bool] | None = None,
    check_finite: bool = False,
    param_specs=None,
    batch_weighting: str = "equal",
) -> Shard:
    """Turn `loss_fn(params, batch, *rest) -> scalar` into a fully sharded data-parallel step.

    Args:
      loss_fn: a pure function of a parameter pytree and this rank's batch.
      mesh: the mesh; the step runs on its ranks (inside `mesh.run` or under torchrun).
      data_axes: axes the batch is split over; the loss and gradients are averaged over them.
      shard_axes: axes the parameters are sharded over (default: `data_axes`); a subset
        of `data_axes` gives hybrid sharding (HSDP): replicated over the others.
      units: `key_path -> unit key` grouping leaves into units gathered together (default:
        each element of the first list/tuple in the tree, plus one root unit).
      reshard_after_forward: release each unit's full parameters after the forward and
        gather them again in the backward (ZeRO-3); False keeps them until their gradient
        is reduced (fewer all-gathers, more memory). Some of the shard axes (a name or a
        tuple; or an int, FSDP2's form, for the last shard axes of that size) keep 1/M of
        each unit after the forward and re-gather it in the backward over those axes only
        (ZeRO++ hpZ: e.g. `'gpu'` on `{'node': 2, 'gpu': 8}` keeps backward all-gathers
        inside a node).
      prefetch: how many units ahead to all-gather asynchronously (order learned from the
        previous call).
      mixed_precision: `MixedPrecision(param_dtype, reduce_dtype, output_dtype)`; its
        `all_gather_dtype` ("int8", a float8 dtype or bf16) sends each unit's shards
        quantized, encoded once per step (docs/howto/compressed-communication.md).
      has_aux: `loss_fn` returns `(loss, aux)`; the step returns the same pair.
      replicated: `key_path -> bool` marking leaves to keep whole on every rank (their
        gradient is all-reduced); 0-dim and non-float leaves always are.
      frozen: `key_path -> bool` marking leaves that are trained by nobody: they are
        sharded and gathered like the others (in units of their own), but never
        reduce-scattered, and their gradient is zero / None.
      check_finite: raise `sf.NonFiniteError` on every rank, naming the unit (or the loss)
        and the ranks, as soon as the loss or a unit's reduced gradient holds a NaN/Inf,
        before any update can be applied (one tiny all-reduce per unit and step).
      param_specs: tensor parallelism inside `loss_fn` (FSDP x TP): how each parameter is
        split over the mesh axes that are not data axes, as a pytree prefix of params with
        an `sf.P(...)` (or None = replicated) per subtree, or a function `key_path -> P`;
        e.g. `P(None, "model")` for a column-parallel `x @ w` weight. `loss_fn` then sees
        this rank's tensor-parallel blocks and may call collectives over those axes; the
        loss must be the same on all of their ranks (checked on the first call).
        Gradients follow shard_map's transpose rule (docs/howto/fsdp-tp.md). A spec may
        also name a data axis that is not a shard axis (expert parallelism: experts split
        over `'expert'` with `data_axes=("data", "expert"), shard_axes="data"`; tokens
        routed by collectives over `'expert'` inside `loss_fn`; docs/howto/experts.md).
      batch_weighting: how the ranks' losses make the step's loss when their local batches
        (the leading dim of the batch's tensor leaves) differ in size. `"equal"` (default):
        they must not; a ShardingError on every rank names each rank's size otherwise
        (checked on the loss all-reduce the step issues anyway: no extra collective).
        `"global_mean"`: each rank's loss weighted by its batch size, the mean over the
        global batch (as one process on the concatenated batch, for a `loss_fn` returning
        its batch's mean). `"mean_of_means"`: the plain mean of the ranks' losses, unchecked.

    Returns:
      A `Shard` step: call it as `step(shards, batch, *rest)`; it has `shard_params`,
      `unshard_params`, `specs` and `stats()`. It composes with `torch.func`: `grad`,
      `vjp`, `jvp`, `vmap(grad(step), in_dims=(None, 0))` (per-example gradients) and
      `vmap(step, in_dims=(0, None))` over stacked shards (an ensemble of models).

    Raises:
      SpecError: invalid options; `loss_fn` an `nn.Module` (wrap it with `sf.functional`).
      ShardingError: (when called) unequal local batches under `batch_weighting="equal"`, and
        the other misuses the step names (shards not from `shard_params`, a non-scalar loss).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 2})
      >>> def loss_fn(params, batch):
      ...     x, y = batch
      ...     return ((x @ params["w"] - y) ** 2).mean()
      >>> step = sf.shard(loss_fn, mesh)
      >>> def train():
      ...     g = torch.Generator().manual_seed(0)
      ...     shards = step.shard_params({"w": torch.ones(4, 1)})
      ...     x = torch.randn(8, 4, generator=g); batch = (x, x.sum(1, keepdim=True))
      ...     grads, loss = torch.func.grad_and_value(step)(shards, batch)
      ...     return tuple(grads["w"].shape)
      >>> mesh.run(train)
      [(2, 1), (2, 1)]
    """
    config = make_config(loss_fn, mesh, data_axes=data_axes, shard_axes=shard_axes, units=units,
                         reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                         mixed_precision=mixed_precision, has_aux=has_aux, replicated=replicated, frozen=frozen,
                         check_finite=check_finite, param_specs=param_specs, batch_weighting=batch_weighting)
    return Shard(loss_fn, mesh, config)
