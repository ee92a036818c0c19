"""What the traced step supports, checked before anything is traced.

The options of `shard` are the composition table's ([Note: the composition table] in
shardfn/_fsdp/support.py): a refused one raises its SpecError, naming the reason and the
eager fallback (`sf.train_step(step, opt)`, which supports them all). The checks here
are the traced step's own: a plan or a mesh it cannot express.
"""

from __future__ import annotations

from .._errors import SpecError
from .._fsdp import support

__all__ = ["check_traceable"]

_FALLBACK = "Fix: train eagerly with sf.train_step(step, opt), which supports it."


def _refuse(what: str, why: str) -> SpecError:
    return SpecError(f"sf.jit: {what} is not supported by the traced step: {why}.\n{_FALLBACK}")


def check_traceable(step, plan) -> None:
    """Raise a SpecError for a `shard` option or a plan the traced step does not handle."""
    support.check("jit", step, plan)
    cfg, mesh = step.config, step.mesh
    group = mesh.group(cfg.shard_axes)
    if group.perm is not None:
        raise _refuse(f"shard axes {cfg.shard_axes} named in another order than the mesh",
                      "the functional all-gather orders ranks by the process group")
    for unit in plan.units:
        for layout in unit.replicated:
            if layout.replica_axes or layout.reduce_axes:
                raise _refuse(f"the replicated leaf {layout.path}", "its extra reduction axes are not written yet")
    kind = getattr(mesh._backend, "kind", None)
    if kind != "distributed":
        raise SpecError(
            "sf.jit: the traced step needs the distributed backend (sf.init_mesh under torchrun); this mesh is "
            f"{kind!r}. The simulated mesh's rank threads hold gloo groups that torch.distributed does not "
            "register, so the functional collectives cannot name them, and dynamo's code cache is shared by the "
            "threads (docs/fsdp_design.md, 'Traced step').\nFix: run under torchrun (or "
            "sf.testing.run_multiprocess), or train eagerly with sf.train_step(step, opt) on the simulated mesh."
        )
