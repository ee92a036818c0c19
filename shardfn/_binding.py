"""Which mesh the collectives talk to: the thread-local stack of mesh bindings.

`shard_map` and `shard` push a `binding` around the code they run; the named-axis
collectives (`_collectives.py`), `sf.remat`'s recompute (which re-enters the binding of its
forward in the backward), `sf.pipeline` and `sf.nn` read the innermost one. It sits below
all of them, so none has to import another to find its mesh.
"""

from __future__ import annotations

import threading
from typing import Callable

from . import _vma
from ._errors import ShardingError

__all__ = ["binding", "current_binding", "bound_mesh"]

_state = threading.local()


class binding:
    """Bind `mesh` for the collectives called in this thread (used by shard_map / shard).

    `check(op, axes)`, when given, vets the axes of every communicating collective (shard
    refuses axes it would not reduce gradients over). `manual`: the axes the code inside
    is manual over (collectives may name only those); None: every axis of the mesh.
    `types`: the typed scope of a shard_map with check_vma ([Note: varying axes]); None:
    untyped (shard's loss_fn, check_vma=False), where the collectives use the boundary
    rule ([Note: the psum transpose rule])."""

    def __init__(self, mesh, check: Callable[[str, tuple[str, ...]], None] | None = None,
                 manual: tuple[str, ...] | None = None, types: _vma.Types | None = None):
        self.mesh = mesh
        self.check = check
        self.manual = tuple(mesh.axis_names) if manual is None else tuple(a for a in mesh.axis_names if a in manual)
        self.types = types

    def __enter__(self):
        if getattr(_state, "stack", None) is None:
            _state.stack = []
        _state.stack.append(self)
        _vma.enter(self.types)
        return self.mesh

    def __exit__(self, *exc):
        _vma.exit()
        _state.stack.pop()


def current_binding() -> binding | None:
    """The innermost binding on this thread (mesh, axes check, manual axes), to re-enter
    later (remat's recompute runs in the backward, after the shard_map / shard call has
    returned) or to nest in (a shard_map inside another, or inside shard's loss_fn)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def bound_mesh(op: str | None = None, axis=None):
    """The mesh of the innermost shard_map / shard on this thread; error outside one."""
    current = current_binding()
    if current is not None:
        return current.mesh
    if op is None:
        return None
    raise ShardingError(
        f"{op}(axis={axis!r}) was called outside shard_map / shard: named-axis collectives need "
        f"a mesh to resolve the axis name.\nFix: call it inside a function wrapped with "
        f"sf.shard_map(f, mesh, in_specs, out_specs) (or the loss_fn of sf.shard)."
    )
