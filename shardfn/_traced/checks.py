"""What the traced step supports, checked before anything is traced.

The options of `shard` are the composition table's ([Note: the composition table] in
shardfn/_fsdp/support.py): a refused one raises its SpecError, naming the reason and the
eager fallback (`sf.train_step(step, opt)`, which supports them all). The checks here
are the traced step's own: a plan or a mesh it cannot express.
"""

from __future__ import annotations

from .._errors import SpecError
from .._fsdp import support
from .._fsdp.plan import hpz_rows

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
    if cfg.reshard_axes:
        _check_hpz(step)
    kind = getattr(mesh._backend, "kind", None)
    if kind != "distributed":
        raise SpecError(
            "sf.jit: the traced step needs the distributed backend (sf.init_mesh under torchrun); this mesh is "
            f"{kind!r}. The simulated mesh's rank threads hold gloo groups that torch.distributed does not "
            "register, so the functional collectives cannot name them, and dynamo's code cache is shared by the "
            "threads (docs/fsdp_design.md, 'Traced step').\nFix: run under torchrun (or "
            "sf.testing.run_multiprocess), or train eagerly with sf.train_step(step, opt) on the simulated mesh."
        )


def _check_hpz(step) -> None:
    """[Note: hpZ in the graph]: the re-gather's rows are the inner-axes pattern, and the
    all-gather travels in full precision."""
    cfg, mesh = step.config, step.mesh
    k, m = mesh.axis_size(cfg.shard_axes), mesh.axis_size(cfg.reshard_axes)
    sub = mesh.group(cfg.reshard_axes)
    keep, order = hpz_rows(mesh, cfg.shard_axes, cfg.reshard_axes)
    if sub.perm is not None or keep != list(range(sub.index, k, m)) or \
            order != [(j % m) * (k // m) + j // m for j in range(k)]:
        raise _refuse(f"reshard_after_forward={cfg.reshard_axes} (hpZ) over shard axes {cfg.shard_axes}",
                      "the re-gather's axes must be the inner (last) shard axes, in the mesh's order")
