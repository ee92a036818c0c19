"""Run one per-rank test body on either backend, so a test checks both with one body."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from .._mesh import _normalize_shape, init_mesh, local_mesh
from ._multiprocess import run_multiprocess

__all__ = ["BACKENDS", "run_on_mesh"]

BACKENDS = ("simulated", "distributed")


def run_on_mesh(fn: Callable[[Any], Any], shape, backend: str = "simulated", *,
                axis_names=None, timeout: float = 30.0, env: Mapping[str, str] | None = None) -> list:
    """Build a mesh of `shape` on `backend`, run `fn(mesh)` on every rank; per-rank results.

    Args:
      fn: the per-rank body; it receives the mesh. On "distributed" its result must be
        picklable (tensors are).
      shape: the mesh shape, as for `sf.local_mesh` / `sf.init_mesh` (e.g. `{"x": 2, "y": 2}`).
      backend: "simulated" (`sf.local_mesh(shape).run`) or "distributed" (one forked
        process per rank via `run_multiprocess`, then `sf.init_mesh(shape)` in each).
      timeout: the mesh's collective timeout; the processes get a little more.

    Returns:
      The results of `fn` on every rank, in rank order.

    Example:
      >>> import torch
      >>> from shardfn.testing import run_on_mesh
      >>> run_on_mesh(lambda mesh: mesh.all_reduce(torch.ones(()), "data").item(), {"data": 2})
      [2.0, 2.0]
    """
    if backend == "simulated":
        mesh = local_mesh(shape, axis_names, timeout=timeout)
        return mesh.run(fn, mesh)
    if backend == "distributed":
        nprocs = math.prod(_normalize_shape(shape, axis_names).values())

        def body():
            return fn(init_mesh(shape, axis_names, timeout=timeout))

        return run_multiprocess(body, nprocs, timeout=timeout + 10.0, env=env)
    raise ValueError(f"run_on_mesh: backend must be one of {BACKENDS}, got {backend!r}")
