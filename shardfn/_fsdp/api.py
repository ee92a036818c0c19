"""What shardfn's other packages may ask of a `shard` step (`sf.hf`, `sf.jit`, `sf.estimate`).

A `Shard` keeps its plans, rank states and checks private; a package outside `_fsdp/`
reaches them through these functions only, never through a `_name` of the step and never
by setting an attribute on it (tests/test_package.py checks both with the ast). Each is
one call into the step, named for what the caller needs.
"""

from __future__ import annotations

from . import tp
from .plan import Plan
from .reduce import raise_nonfinite as _raise_nonfinite
from .runtime import RankState

__all__ = ["plan_of", "lay_out", "check_same_everywhere", "check_shards", "rank_state", "raise_nonfinite",
           "loss_binding", "check_tp_loss"]


def plan_of(step, shards) -> Plan:
    """The plan `shards` follow (laid out by `step.shard_params` on this rank); a
    ShardingError naming the fix for a tree the step has not laid out."""
    return step._plan_for(shards)


def lay_out(step, params, paths, leaves, treedef, *, allow_meta: bool = False):
    """`(plan, blocks)` for a parameter tree (meta leaves allowed with `allow_meta`): the
    plan `step.shard_params` would use, cached on the step like it."""
    return step._lay_out(params, paths, leaves, treedef, allow_meta=allow_meta)


def check_same_everywhere(step, paths, leaves) -> None:
    """One small collective: every rank passed the same structure, shapes and dtypes."""
    step._check_same_everywhere(paths, leaves)


def check_shards(step, plan: Plan, paths, leaves, index: int) -> None:
    """Each leaf has this rank's shard shape under `plan` (`index`: the rank's place in the
    shard group); a ShardingError naming the leaf path otherwise."""
    step._check_shards(plan, paths, leaves, index)


def loss_binding(step, plan: Plan):
    """The mesh binding `loss_fn` runs in under `plan` (a context manager): the named-axis
    collectives inside it resolve their axes and are vetted as in the eager step."""
    return step._loss_binding(plan)


def rank_state(step, plan: Plan) -> RankState:
    """This rank's runtime state for `plan` (made on first use)."""
    return step._state(plan)


def raise_nonfinite(step, what: str, bad) -> None:
    """`check_finite`'s NonFiniteError on every rank, naming `what` and the ranks whose
    flag `bad` ((1,) float32, 1.0: not finite) is set, as the eager step raises it."""
    mesh = step.mesh
    _raise_nonfinite(what, bad, mesh.group(mesh.axis_names))


def check_tp_loss(step, plan: Plan, loss) -> None:
    """With tensor-parallel axes, the ShardingError eager raises at its first call when the
    loss differs across them (one small all-reduce); nothing without them. `sf.jit` checks
    the loss mean its first call returns, before handing back any update."""
    if plan.tp_axes:
        tp.check_same_loss(step.mesh.group(plan.tp_axes), plan.tp_axes, loss)
