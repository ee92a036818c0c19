"""What the traced step supports, checked before anything is traced.

Each option the traced step cannot express yet raises a SpecError that names the option
and the eager fallback (`sf.train_step(step, opt)`, which supports them all).
"""

from __future__ import annotations

from .._errors import SpecError

__all__ = ["check_traceable"]

_FALLBACK = "Fix: drop the option, or train eagerly with sf.train_step(step, opt), which supports it."


def _refuse(what: str, why: str) -> SpecError:
    return SpecError(f"sf.jit: {what} is not supported by the traced step: {why}.\n{_FALLBACK}")


def check_traceable(step, plan) -> None:
    """Raise a SpecError for a `shard` option or a plan the traced step does not handle."""
    cfg, mesh = step.config, step.mesh
    if cfg.shard_axes != cfg.data_axes:
        raise _refuse(f"HSDP (shard_axes={cfg.shard_axes} within data_axes={cfg.data_axes})",
                      "the replica all-reduce after the reduce-scatter is not written yet")
    if cfg.reshard_axes:
        raise _refuse(f"hpZ (reshard_after_forward={cfg.reshard_axes})",
                      "the backward re-gather over a sub-group is not written yet")
    if cfg.frozen is not None:
        raise _refuse("frozen=", "frozen units are gathered without a reduce-scatter, not written yet")
    if cfg.check_finite:
        raise _refuse("check_finite=True", "raising from inside a graph needs a host sync")
    if plan.tp_axes:
        raise _refuse(f"param_specs over {plan.tp_axes} (tensor parallelism)",
                      "the tensor-parallel reductions are not written yet")
    if cfg.batch_weighting == "global_mean":
        raise _refuse("batch_weighting='global_mean'", "the weights are read on the host")
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
