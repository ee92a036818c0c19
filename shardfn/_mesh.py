"""Mesh: named axes over a set of ranks, on a simulated or a distributed backend."""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch

from ._backend import DistributedBackend, Group, SimulatedBackend
from ._backend import ops
from ._backend.base import rank_coords
from ._errors import SpecError, bullet_list

__all__ = ["Mesh", "init_mesh", "local_mesh", "MAX_SIMULATED_RANKS"]

MAX_SIMULATED_RANKS = 16  # each group of n ranks holds n*(n-1) loopback sockets in this one process


_EXAMPLE = "e.g. sf.local_mesh({'data': 4}) or sf.local_mesh((2, 2), ('data', 'model'))"


def _normalize_shape(shape, axis_names) -> dict[str, int]:
    """`{axis: size}` from a dict, or from sizes plus names; SpecError for anything else."""
    if isinstance(shape, Mapping):
        if axis_names is not None:
            raise SpecError("give the mesh shape either as a dict {'data': 4} or as sizes plus axis_names, not both")
        pairs = list(shape.items())
    else:
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)):
            raise SpecError(f"a mesh shape must be a dict {{axis: size}} or a tuple of sizes, got {shape!r}; {_EXAMPLE}")
        shape = tuple(shape)
        if axis_names is None:
            if len(shape) == 1:
                axis_names = ("data",)
            elif len(shape) > 1:
                raise SpecError(
                    f"a mesh of shape {shape} needs axis_names, one per dim, e.g. "
                    f"axis_names={tuple(f'axis{i}' for i in range(len(shape)))}; or pass a dict "
                    f"like {{'data': {shape[0]!r}, 'model': {shape[1]!r}}}"
                )
            else:
                axis_names = ()
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        if not isinstance(axis_names, (tuple, list)):
            raise SpecError(f"axis_names must be a tuple of strings, got {axis_names!r}; {_EXAMPLE}")
        if len(axis_names) != len(shape):
            raise SpecError(f"mesh shape {shape} has {len(shape)} dims but axis_names {tuple(axis_names)} has {len(axis_names)}")
        pairs = list(zip(axis_names, shape))
    problems = []
    names = [n for n, _ in pairs]
    for name, size in pairs:
        if not isinstance(name, str) or not name:
            problems.append(f"axis name {name!r} is not a non-empty string")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            problems.append(f"axis {name!r} has size {size!r}; sizes must be positive integers")
    dupes = sorted({repr(n) for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"axis names {dupes} appear more than once")
    if not pairs:
        problems.append("the mesh has no axes; give at least one, e.g. {'data': 2}")
    if problems:
        raise SpecError(f"invalid mesh shape {pairs}:\n{bullet_list(problems)}")
    return dict(pairs)


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise SpecError(f"timeout must be a positive number of seconds, got {timeout!r}; e.g. timeout=60")
    return float(timeout)


class Mesh:
    """Named axes laid over ranks (row-major), with the process groups behind each axis.

    Use `sf.local_mesh` (ranks as threads of this process) or `sf.init_mesh` (one process
    per rank under torchrun); both give the same answers to the same program.

    Example:
      >>> import shardfn as sf
      >>> mesh = sf.local_mesh({"data": 2, "model": 2})
      >>> mesh.size, mesh.axis_names
      (4, ('data', 'model'))
      >>> mesh.run(lambda: mesh.coords)
      [{'data': 0, 'model': 0}, {'data': 0, 'model': 1}, {'data': 1, 'model': 0}, {'data': 1, 'model': 1}]
    """

    def __init__(self, backend):
        self._backend = backend

    # -- shape ------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(self._backend.mesh_shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self._backend.mesh_shape)

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._backend.size

    @property
    def kind(self) -> str:
        """`'simulated'` or `'distributed'`."""
        return self._backend.kind

    @property
    def device(self) -> torch.device:
        """The device tensors of this rank live on (CPU for gloo, this rank's GPU for NCCL)."""
        return self._backend.device

    @property
    def timeout(self) -> float:
        """Seconds a collective may wait for its peers before it raises."""
        return self._backend.timeout

    # -- this rank --------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's index (inside `mesh.run` on a simulated mesh)."""
        return self._backend.rank()

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every axis."""
        return rank_coords(self._backend.rank(), self._backend.mesh_shape)

    def in_rank(self) -> bool:
        """Whether the caller is one of the mesh's ranks (always true when distributed)."""
        return self._backend.in_rank()

    # -- running ----------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on every rank; the per-rank results in rank order.

        Simulated: one thread per rank; if any rank raises, the others stop at their next
        collective and the first error is re-raised here with its rank noted. Distributed
        (or called from inside a rank): calls `fn` once and returns `[result]`.
        """
        return self._backend.run(fn, args, kwargs)

    # -- axes and groups --------------------------------------------------------------
    def axes(self, axis, *, where: str = "axis") -> tuple[str, ...]:
        """Normalize an axis name or tuple of names (None = all axes), checking each exists."""
        if axis is None:
            return self.axis_names
        if isinstance(axis, str):
            names = (axis,)
        elif isinstance(axis, (tuple, list)):
            names = tuple(axis)
        else:
            names = (axis,)
        unknown = [a for a in names if not isinstance(a, str) or a not in self._backend.mesh_shape]
        if unknown or not names:
            raise SpecError(
                f"{where}: {axis!r} is not an axis of this mesh; mesh axes are {list(self.axis_names)} "
                f"(shape {self.shape}).\nFix: use one of those names or a tuple of them."
            )
        if len(set(names)) != len(names):
            raise SpecError(f"{where}: axis tuple {names!r} names an axis twice")
        return names

    def group(self, axis) -> Group:
        """This rank's process group over `axis` (a name or tuple; logical order as given)."""
        return self._backend.group(self.axes(axis))

    def axis_size(self, axis) -> int:
        return math.prod(self._backend.mesh_shape[a] for a in self.axes(axis))

    def all_reduce(self, tensor: torch.Tensor, axes=None, op: str = "sum") -> torch.Tensor:
        """In-place, non-differentiable all-reduce of `tensor` over `axes` (None: all axes).

        For bookkeeping outside a traced function (norms, metrics). `op` is "sum", "max",
        "min" or "mean". Must be called on every rank of the group.
        """
        if op not in ("sum", "max", "min", "mean"):
            raise SpecError(f"Mesh.all_reduce: op must be 'sum', 'max', 'min' or 'mean', got {op!r}")
        group = self.group(axes)
        out = ops.all_reduce(group, tensor, "sum" if op == "mean" else op)
        if op == "mean":
            out = out / group.size
        with torch.no_grad():
            tensor.copy_(out)
        return tensor

    def __repr__(self) -> str:
        return f"Mesh({self.shape}, kind={self.kind!r})"


def local_mesh(shape, axis_names: Sequence[str] | None = None, *, timeout: float = 60.0) -> Mesh:
    """A simulated mesh: every rank is a thread of this process, over real gloo groups.

    Args:
      shape: `{"data": 4}`, or sizes with `axis_names`.
      axis_names: names of the axes when `shape` is a tuple.
      timeout: seconds a collective waits for its peers before raising
        `CollectiveTimeoutError` (naming the op, the axes and the late ranks).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 4})
      >>> mesh.run(lambda: mesh.all_reduce(torch.ones(()), "data").item())
      [4.0, 4.0, 4.0, 4.0]
    """
    shape = _normalize_shape(shape, axis_names)
    size = math.prod(shape.values())
    if size > MAX_SIMULATED_RANKS:
        raise SpecError(
            f"local_mesh({shape}) would start {size} rank threads in this process; the simulated mesh "
            f"allows at most {MAX_SIMULATED_RANKS}.\nFix: simulate a smaller mesh, or run real processes "
            f"with torchrun and sf.init_mesh."
        )
    return Mesh(SimulatedBackend(shape, _check_timeout(timeout)))


def init_mesh(
    shape,
    axis_names: Sequence[str] | None = None,
    *,
    backend: str | None = None,
    device=None,
    timeout: float = 300.0,
    check_collectives: bool = False,
) -> Mesh:
    """A mesh over the processes of a `torchrun` job (one rank per process).

    Initializes the default process group from the launcher's environment if needed
    (NCCL when CUDA is available, else gloo; `backend=` overrides), then creates one
    process group per subset of axes.

    Args:
      shape: `{"data": 4}` or sizes with `axis_names`; sizes must multiply to the world size.
      backend: "gloo" or "nccl" (default: from the device).
      device: the device of this rank's tensors (default: `cuda:LOCAL_RANK` with NCCL, else CPU).
      timeout: seconds a collective may wait for its peers.
      check_collectives: before every collective, check that all ranks of its group issue
        the same op, shape and dtype, raising `DesyncError` instead of hanging (one small
        extra all-reduce per collective; also on with SHARDFN_CHECK_COLLECTIVES=1). The
        simulated mesh always checks, for free.

    Example (run with `torchrun --standalone --nproc-per-node 2 script.py`)::

      mesh = sf.init_mesh({"data": 2})
    """
    shape = _normalize_shape(shape, axis_names)
    return Mesh(DistributedBackend(shape, _check_timeout(timeout), backend, device, check_collectives))
