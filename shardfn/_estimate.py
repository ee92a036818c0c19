"""`sf.estimate`: will it fit? A dry run of a `shard` step on meta tensors.

The step runs for real, schedule, autograd and all, on a simulated mesh of the target
size, but parameters and activations are meta tensors (a shape and a dtype, no data) and
every collective returns at once ([Note: meta tensors] in `_backend/ops.py`); integer and
bool batch leaves, and what is computed from them alone (masks, positions), keep their
values, so code that branches on them takes the real step's path ([Note: what runs for
real in a dry run] in `_dry_run.py`). What a rank would hold is then counted, not guessed:

- parameter shards, gradient shards and optimizer state: the bytes of the trees the step
  and `optimizer.init` return;
- gathered parameters and collective bytes: the step's own `stats()`;
- everything else the step allocates (activations, their gradients, unsharded gradients
  before their reduce-scatter): a `TorchDispatchMode` in each rank thread sees every op's
  outputs, counts the storages that are new, and forgets each when it dies
  (`weakref.finalize` on the untyped storage: a storage's Python object lives as long as
  its memory does, meta ones too). The units' unsharded buffers are freed by resizing
  their storage ([Note: why storage is freed, not the tensor] in `_fsdp/unit.py`),
  which no op reports, so they are counted from the schedule's state instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import optree
import torch

from ._backend import ops
from ._dry_run import MetaFunctions, Tracker, real_batch_leaf
from ._errors import SpecError
from ._fsdp import api, support
from ._mesh import Mesh, _normalize_shape, local_mesh

__all__ = ["estimate", "Estimate"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What one rank holds and moves in one `shard` step (bytes; each the largest over ranks).

    `total` is what the rank needs at the step's peak: the parameter shards and optimizer
    state, which live across steps, plus `peak_step_bytes`, the most bytes the forward and
    backward allocate at once (gathered parameters, activations, gradients as they arrive).
    It is at most the sum of the parts, since gathered parameters and activations need not
    peak at the same moment.
    """

    mesh_shape: dict[str, int]
    param_bytes: int  # this rank's parameter shards
    grad_bytes: int  # this rank's gradient shards
    opt_state_bytes: int  # `optimizer.init(shards)`, sharded like the params
    peak_gathered_bytes: int  # step.stats()["peak_gathered_bytes"]
    peak_activation_bytes: int  # the most bytes the step allocates besides gathered parameters
    peak_step_bytes: int  # the most bytes the step allocates at once, gathered parameters and gloo's copies included
    scratch_bytes: int  # the largest all-gather / reduce-scatter buffer (gloo on CPU copies an all-gather in flight)
    all_gather_bytes: int
    reduce_scatter_bytes: int
    all_reduce_bytes: int
    num_collectives: int
    # the most bytes of encoded all-gather send buffers alive at once (MixedPrecision(all_gather_dtype=...);
    # [Note: quantized all-gather] in _fsdp/gather.py), part of peak_gathered_bytes
    encoded_send_bytes: int = 0

    @property
    def total(self) -> int:
        """Bytes per rank at the step's peak: shards + optimizer state + the step's peak."""
        return self.param_bytes + self.opt_state_bytes + self.peak_step_bytes

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameter shards", self.param_bytes),
            ("gradient shards", self.grad_bytes),
            ("optimizer state", self.opt_state_bytes),
            ("peak gathered parameters", self.peak_gathered_bytes),
            ("peak activations", self.peak_activation_bytes),
            ("peak of the step (gathered + activations + gradients)", self.peak_step_bytes),
            ("total (shards + optimizer state + peak of the step)", self.total),
            ("largest collective buffer (gloo copies it)", self.scratch_bytes),
            ("all-gather per step", self.all_gather_bytes),
            ("reduce-scatter per step", self.reduce_scatter_bytes),
            ("all-reduce per step", self.all_reduce_bytes),
        ] + ([("encoded all-gather send buffers (in peak gathered)", self.encoded_send_bytes)]
             if self.encoded_send_bytes else [])

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = [f"sf.estimate on mesh {self.mesh_shape}, per rank:"]
        for i, (name, value) in enumerate(rows):
            if i == 8:
                lines.append(f"  {'collectives (logical bytes)':<{width}}  {self.num_collectives:>8} ops")
            lines.append(f"  {name:<{width}}  {format_bytes(value):>12}")
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """`1536` -> `'1.50 KiB'` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # unreachable


# -- inputs -> meta trees ------------------------------------------------------------------


def _is_shape(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)


def _is_leaf(x) -> bool:
    if isinstance(x, (torch.Tensor, torch.Size)):
        return True
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype) and _is_shape(x[0]):
        return True  # (shape, dtype)
    return isinstance(x, tuple) and len(x) > 0 and _is_shape(x)


def _meta_tree(tree, dtype: torch.dtype, what: str, batch: bool = False):
    """Tensors, `torch.Size` / tuples of ints (in `dtype`) or `(shape, dtype)` -> meta tensors
    (a `batch`'s integer and bool leaves real: [Note: what runs for real in a dry run])."""

    def leaf(path, x):
        return real_batch_leaf(meta_leaf(path, x)) if batch else meta_leaf(path, x)

    def meta_leaf(path, x):
        if isinstance(x, torch.Tensor):
            return x if batch else torch.empty_like(x, device="meta")
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.dtype) and _is_shape(x[0]):
            return torch.empty(tuple(x[0]), dtype=x[1], device="meta")
        if _is_shape(x):
            return torch.empty(tuple(x), dtype=dtype, device="meta")
        keys = "".join(f"[{k!r}]" for k in path)
        raise SpecError(
            f"sf.estimate: {what}{keys} is a {type(x).__name__} ({x!r}); each leaf must be a tensor (real or "
            f"meta), a shape (torch.Size or a tuple of ints, in dtype {dtype}) or a pair (shape, dtype).\n"
            f"Fix: e.g. torch.Size([8, 128]) or ((8, 128), torch.long)."
        )

    return optree.tree_map_with_path(leaf, tree, is_leaf=_is_leaf, none_is_leaf=False)


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


# -- the dry run ---------------------------------------------------------------------------


class _MetaMesh(Mesh):
    """A simulated mesh whose ranks keep their tensors on the meta device. Its process
    groups are real (the step's one small structure check runs on them, on CPU)."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


@functools.lru_cache(maxsize=8)
def _meta_mesh(items: tuple) -> _MetaMesh:
    return _MetaMesh(local_mesh(dict(items))._backend)


def estimate(loss_fn: Callable, params_or_shapes, batch_shapes, mesh_shape, *, optimizer=None,
             dtype: torch.dtype = torch.float32, batch_dtype: torch.dtype | None = None, rest: tuple = (),
             use_func: bool = False, **shard_options) -> Estimate:
    """Per-rank memory and traffic of `sf.shard(loss_fn, mesh, **shard_options)`, from a dry run.

    The step (forward and backward, as `sf.train_step` runs them, after one forward that
    teaches the schedule its prefetch order) runs on meta tensors on a simulated mesh
    of `mesh_shape`: ranks are threads, no tensor has data and no collective moves any, so
    a model far larger than this machine can be planned here. Gathered parameters and
    collective bytes are exact (they come from the step's own `stats()`); activations are
    the storages the ops create, alive at once, so they follow the program as written:
    compare `estimate(loss_fn)` with `estimate(remat(loss_fn))` to see what recomputation
    saves. Not counted: the process group's own buffers (gloo on CPU copies a collective
    through a buffer of its own: `scratch_bytes` bounds it), the CUDA context, allocator
    rounding and fragmentation, and the optimizer update's temporaries.

    Args:
      loss_fn: `loss_fn(params, batch, *rest) -> scalar`, as for `sf.shard`.
      params_or_shapes: the full (unsharded) parameter tree: real tensors, meta tensors, or
        shapes (`torch.Size` / tuples of ints, in `dtype`) or `(shape, dtype)` pairs.
      batch_shapes: one rank's local batch, in the same forms (shapes in `batch_dtype`,
        default `dtype`; e.g. `((8, 128), torch.long)` for token ids). Integer and bool
        leaves keep values: real tensors as given, shapes filled with ones (token id 1, an
        attention mask without padding); give a real tensor when the values steer the
        program (a padded mask). Floating-point leaves are meta.
      mesh_shape: the target mesh, e.g. `{"data": 8}` or `8` (at most 16 ranks).
      optimizer: an `sf.optim` transformation; its `init` runs on the meta shards.
      dtype: the dtype of parameter leaves given as bare shapes.
      batch_dtype: the dtype of batch leaves given as bare shapes (default: `dtype`).
      rest: extra positional arguments of `loss_fn` (after the batch).
      use_func: differentiate with `torch.func.grad_and_value(step)` instead of
        `step.grad_and_value` (the path `sf.train_step` takes by default). On a step alone
        that runs `step.grad_and_value` below the transform (the same peak); with
        `has_aux=True` the step runs at the transform's level, where `torch.func` keeps
        the backward's intermediates until it ends (it builds the graph of the backward
        too), so its peak is higher (docs/fsdp_design.md, "`torch.func.grad(step)`").
      **shard_options: passed to `sf.shard` (`reshard_after_forward`, `prefetch`,
        `mixed_precision`, `units`, `shard_axes`, ...).

    Returns:
      An `Estimate`: `param_bytes`, `grad_bytes`, `opt_state_bytes`, `peak_gathered_bytes`,
      `peak_activation_bytes`, `peak_step_bytes`, `scratch_bytes`, `all_gather_bytes`,
      `reduce_scatter_bytes`, `all_reduce_bytes`, `num_collectives`, `encoded_send_bytes`
      (with `MixedPrecision(all_gather_dtype=...)`: the encoded send buffers alive at once,
      counted in `peak_gathered_bytes`; the all-gather bytes are the encoded ones) and `total`, each the
      largest over the ranks (they differ only where a dim does not divide evenly);
      `print(est)` shows a table.

    Raises:
      SpecError: a leaf is no tensor, shape or (shape, dtype) pair; `param_specs` was
        given; or the step needs a value the dry run does not have (`.item()` of an
        activation, `nonzero` of a parameter, ...): the error names the op.

    Example:
      >>> import shardfn as sf, torch
      >>> def loss_fn(params, x):
      ...     for layer in params["layers"]:
      ...         x = torch.tanh(x @ layer["w"])
      ...     return x.square().mean()
      >>> params = {"layers": [{"w": torch.Size([1024, 1024])} for _ in range(4)]}  # 16 MiB
      >>> est = sf.estimate(loss_fn, params, torch.Size([32, 1024]), {"data": 4},
      ...                   optimizer=sf.optim.adamw(1e-3))
      >>> est.param_bytes, est.opt_state_bytes  # 1/4 of the weights, and Adam's two moments
      (4194304, 8388616)
      >>> est.peak_gathered_bytes  # one layer computing, the next prefetched
      8388608
    """
    from ._fsdp import shard

    shape = _normalize_shape({"data": mesh_shape} if isinstance(mesh_shape, int) else mesh_shape, None)
    params = _meta_tree(params_or_shapes, dtype, "params_or_shapes")
    batch = _meta_tree(batch_shapes, batch_dtype or dtype, "batch_shapes", batch=True)
    mesh = _meta_mesh(tuple(shape.items()))
    step = shard(loss_fn, mesh, **shard_options)
    support.check("estimate", step)  # [Note: the composition table]
    grad_and_value = torch.func.grad_and_value(step, has_aux=step.config.has_aux) if use_func else step.grad_and_value

    def body():
        tracker = Tracker()
        with ops.meta_run():
            shards = step.shard_params(params)
            opt_state = optimizer.init(shards) if optimizer is not None else None
            with MetaFunctions(), tracker:
                step(shards, batch, *rest)  # learn the access order, as a training loop's first step does
                state = api.rank_state(step, api.plan_of(step, shards))
                scratch = [0]

                def note(op: str, axes, nbytes: int) -> None:
                    if op in ("all_gather", "reduce_scatter", "all_to_all"):  # all_to_all: qgZ's reduction
                        scratch[0] = max(scratch[0], nbytes)

                tracker.watch(state)
                try:
                    with ops.recording(note):
                        grads, _ = grad_and_value(shards, batch, *rest)
                    tracker.sample()
                finally:
                    tracker.unwatch(state)
            stats = step.stats()
        return dict(
            param_bytes=_nbytes(shards), grad_bytes=_nbytes(grads), opt_state_bytes=_nbytes(opt_state),
            peak_gathered_bytes=stats["peak_gathered_bytes"], peak_activation_bytes=tracker.peak_rest,
            peak_step_bytes=tracker.peak_step, scratch_bytes=scratch[0], all_gather_bytes=stats["all_gather_bytes"],
            reduce_scatter_bytes=stats["reduce_scatter_bytes"], all_reduce_bytes=stats["all_reduce_bytes"],
            num_collectives=stats["num_collectives"], encoded_send_bytes=state.encoded.peak,
        )

    per_rank = mesh.run(body)
    fields = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    return Estimate(mesh_shape=dict(shape), **fields)
