"""Varying manual axes: the mesh axes each value inside a `shard_map` body varies over.

[Note: varying axes] With `check_vma=True` (the default) every tensor computed inside a
shard_map body carries a type: the set of the body's manual axes over which it may differ
from rank to rank (JAX's `vma`, JEP 17111's "device variance"). Inputs get the axes their
in spec names; an op's result varies over the union of its operands' axes; collectives
set it themselves:

  psum / pmean / pmax / pmin over A   varying -> invariant over A
  all_gather over A                   varying -> invariant over A
  psum_scatter / ppermute /
  all_to_all / ragged_all_to_all      varying over A
  sf.pvary(x, A)                      invariant -> varying over A (no communication)

Tensors made inside the body with no tensor operand (torch.zeros, closed-over parameters,
values built from `axis_index`, which is a Python int) are invariant. The types do two
jobs, both without communication:
  * an output whose out spec omits an axis it varies over is an error at the boundary
    ([Note: the replication check] is then an opt-in debug check);
  * they decide the transposes ([Note: typed transposes]).

[Note: typed transposes] Where an op meets operands of different types, the invariant
ones are lifted with `pvary` first (JAX inserts `pbroadcast` the same way). pvary is the
identity whose transpose is a psum; psum (varying -> invariant) is an all-reduce whose
transpose is pvary, the identity. So a psum costs nothing in the backward, and a
gradient is summed across ranks exactly where an invariant value fed varying work:
Megatron's f/g pair falls out (x @ w_col lifts x: its cotangent is all-reduced; the
psum after w_row: identity). The boundaries need no correction in either direction. A
tensor lifted twice shares one pvary (memo per call), so its cotangent is summed once.
all_gather's result is invariant, and its transpose takes this rank's block; but the
common case, a gathered value feeding varying work (sequence parallelism), would then
cost an all-reduce and a slice. Lifting a tensor straight from an all_gather therefore
re-routes its varying cotangent through psum_scatter instead (`_VaryGathered` in
_collectives.py): the bytes of a reduce-scatter, as JAX's varying all_gather gets.

Mechanism: a TorchFunctionMode, active while a typed body runs (and when remat's
recompute re-enters it), reads the operands' types, lifts where they differ, and tags
results. Types are per call ("scope"): a tag from another call reads as invariant.
Limits: transforms applied *inside* the body (torch.func.vmap / grad there) make
wrappers the mode does not see, so values inside them read as invariant; apply
transforms around the shard_map, or pass check_vma=False.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from ._backend import graph, ops
from ._errors import ShardingError

__all__ = ["Types", "vma", "tag", "untag", "lift", "paused", "enter", "exit", "current"]

_state = threading.local()

_ATTR = "_sf_vma"  # (scope, frozenset of axis names) on a tensor


class Types:
    """A typed scope: the axes tracked and the lifts made in one shard_map call.

    `axes`: the manual axes whose variance is tracked (this shard_map's, plus an enclosing
    typed shard_map's). `scope`: the object tags are valid for (shared with an enclosing
    typed shard_map). `memo`: (id, axes) -> (tensor, lifted) for this call."""

    def __init__(self, mesh, axes, scope=None):
        self.mesh = mesh
        self.axes = frozenset(axes)
        self.scope = self if scope is None else scope
        self.memo: dict = {}


def current() -> Types | None:
    """The innermost typed scope on this thread, or None (untyped: shard, check_vma=False)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def enter(types: Types | None) -> None:
    """Push a scope (None: an untyped binding, which turns the types off inside it)."""
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
        _state.paused = 0
    stack.append(types)
    if types is not None and getattr(_state, "mode", None) is None:
        _state.mode = _Mode()
        _state.mode.__enter__()
        _state.mode_depth = len(stack)


def exit() -> None:  # noqa: A001 - the pair of `enter`
    stack = _state.stack
    types = stack.pop()
    if types is not None:
        types.memo.clear()
    if getattr(_state, "mode", None) is not None and len(stack) < _state.mode_depth:
        _state.mode.__exit__(None, None, None)
        _state.mode = None


@contextlib.contextmanager
def paused():
    """Run shardfn's own code (a collective's internals) without the mode."""
    _state.paused = getattr(_state, "paused", 0) + 1
    try:
        yield
    finally:
        _state.paused -= 1


def vma(t, types: Types | None = None) -> frozenset:
    """The axes `t` varies over in the current scope (empty: invariant, or untyped)."""
    types = current() if types is None else types
    if types is None or not isinstance(t, torch.Tensor):
        return frozenset()
    got = getattr(t, _ATTR, None)
    if got is None or got[0] is not types.scope:
        return frozenset()
    return got[1]  # tags are written within the scope's axes (inputs, unions, collectives)


def tag(t, axes, types: Types | None = None):
    """Give `t` the type `axes` in the current scope; returns `t`."""
    types = current() if types is None else types
    if types is not None and isinstance(t, torch.Tensor):
        setattr(t, _ATTR, (types.scope, frozenset(axes)))
    return t


def untag(t, types: Types) -> None:
    """Drop `t`'s type if it belongs to `types`' scope: the scope has ended, and the tag holds
    the scope and through it the mesh (gloo groups, locks), which would keep the mesh alive
    and make the tensor unpicklable (`torch.save`, a result sent between processes)."""
    got = getattr(t, _ATTR, None) if isinstance(t, torch.Tensor) else None
    if got is not None and got[0] is types.scope:
        delattr(t, _ATTR)


# -- pvary and its transpose, the invariant psum -----------------------------------------


@graph.traceable
class _Pvary(torch.autograd.Function):
    """Identity, invariant -> varying over the group's axes; transpose: psum."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return PsumInvariant.apply(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return t.view_as(t)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _Pvary.apply(x, group), in_dims[0]


@graph.traceable
class PsumInvariant(torch.autograd.Function):
    """All-reduce sum, varying -> invariant; transpose: pvary (the identity)."""

    @staticmethod
    def forward(x, group):
        return ops.all_reduce(group, x, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _Pvary.apply(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return PsumInvariant.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return PsumInvariant.apply(x, group), in_dims[0]


def lift(t: torch.Tensor, axes, types: Types | None = None) -> torch.Tensor:
    """`t` made varying over `axes` too (pvary over those it is invariant over), once per
    tensor and axes in this call ([Note: typed transposes])."""
    types = current() if types is None else types
    have = vma(t, types)
    missing = frozenset(axes) - have
    if not missing or types is None:
        return t
    key = (id(t), missing)
    hit = types.memo.get(key)
    if hit is not None and hit[0] is t:
        return hit[1]
    order = tuple(a for a in types.mesh.axis_names if a in missing)
    with paused():
        gathered = getattr(t, "_sf_gathered", None)
        if gathered is not None and t.requires_grad:
            lifted, rest = gathered.vary(t, order)
        else:
            lifted, rest = t, order
        if rest and (t.is_floating_point() or t.is_complex()):
            lifted = _Pvary.apply(lifted, types.mesh.group(rest))
        elif lifted is t:
            lifted = t.view_as(t)
    tag(lifted, have | missing, types)
    types.memo[key] = (t, lifted)
    return lifted


# -- the mode: types of every op in a typed body ------------------------------------------

_SKIP = {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__,
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__format__,
    torch.Tensor.__repr__, torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.is_contiguous,
    torch.Tensor.storage_offset, torch.Tensor.__index__, torch.Tensor.__int__, torch.Tensor.__float__,
}
_SKIP |= {getattr(torch.Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout", "is_cuda", "grad")
    if hasattr(getattr(torch.Tensor, name, None), "__get__")}


def _tensors(args, kwargs):
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                found.extend(x for x in a if isinstance(x, torch.Tensor))
    return found


def _inplace(func, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imod__", "__imatmul__") or (
        bool(kwargs) and kwargs.get("out") is not None)


def _lift_arg(a, union, types):
    if isinstance(a, torch.Tensor):
        return lift(a, union, types)
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(lift(x, union, types) if isinstance(x, torch.Tensor) else x for x in a)
    return a


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIP or _state.paused:
            return func(*args, **kwargs)
        types = current()
        tensors = _tensors(args, kwargs) if types is not None else None
        if not tensors:
            return func(*args, **kwargs)
        if len(tensors) == 1:  # most ops: the result's type is the operand's
            vmas = None
            union = vma(tensors[0], types)
        else:
            vmas = [vma(t, types) for t in tensors]
            union = frozenset().union(*vmas)
        if vmas is not None and union and any(v != union for v in vmas):
            if _inplace(func, kwargs):
                target = args[0] if args else kwargs.get("out")
                if isinstance(target, torch.Tensor) and vma(target, types) != union and target.requires_grad:
                    raise _inplace_error(func, target, union, vma(target, types))
                args = (args[0],) + tuple(_lift_arg(a, union, types) for a in args[1:])
                kwargs = {k: (v if k == "out" else _lift_arg(v, union, types)) for k, v in kwargs.items()}
            else:
                args = tuple(_lift_arg(a, union, types) for a in args)
                kwargs = {k: _lift_arg(v, union, types) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if union:
            if isinstance(out, torch.Tensor):
                tag(out, union, types)
            elif isinstance(out, (list, tuple)):
                for o in out:
                    if isinstance(o, torch.Tensor):
                        tag(o, union, types)
        return out


def _inplace_error(func, target, union, have) -> ShardingError:
    name = getattr(func, "__name__", str(func))
    extra = sorted(union - have)
    return ShardingError(
        f"shard_map: in-place {name} writes values that vary over mesh axes {extra} into a tensor of shape "
        f"{tuple(target.shape)} that requires grad and is invariant over them (the same on every rank); "
        f"its gradient would miss the sum over {extra}.\nFix: write it out of place (y = x + v), or lift the "
        f"tensor first: x = sf.pvary(x, {tuple(extra)!r})."
    )
