"""Named-axis collectives: one autograd.Function each, its transpose beside it.

Every collective runs on the mesh bound by the enclosing `shard_map` / `shard` (`_binding.py`)
and takes an axis name or tuple of names. Each Function has:
- `forward` on plain tensors (functorch unwraps them for us) calling `_backend.ops`;
- `setup_context` capturing the process group, since a backward often runs after the
  shard_map call has returned;
- `backward` that calls the transpose through another Function's `.apply` — never a raw
  process-group method, because under `torch.func.grad` the cotangents are wrapped;
- `jvp`: the same linear collective on the tangent;
- `vmap`: the batch dim is moved to the front and the collective runs on dims shifted by one.

psum's transpose is psum: see docs/autodiff.md and [Note: the psum transpose rule] in
_shard_map.py for the two boundary halves that make that correct.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _tree, _vma
from ._backend import graph, ops
from ._backend.base import Group
from ._binding import bound_mesh, current_binding
from ._errors import SpecError

__all__ = [
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "ppermute",
    "all_to_all",
    "ragged_all_to_all",
    "pvary",
    "axis_index",
    "axis_size",
]

def _axes(op: str, axis) -> tuple[str, ...]:
    """The axes `axis` names, all manual in the innermost binding (checked)."""
    current = current_binding()
    mesh = bound_mesh(op, axis)
    axes = mesh.axes(axis, where=f"{op}(axis={axis!r})")
    if current.check is not None and op not in ("axis_index", "axis_size", "pvary"):
        current.check(op, axes)
    stray = [a for a in axes if a not in current.manual]
    if stray:
        raise SpecError(
            f"{op}(axis={axis!r}): {stray} are not manual here; this shard_map is manual over "
            f"{list(current.manual)} only (its axis_names), and a collective may name only those.\nFix: "
            f"add {stray} to axis_names, or call {op} in the enclosing code that is manual over them."
        )
    return axes


def _group(op: str, axis) -> Group:
    return bound_mesh(op, axis).group(_axes(op, axis))


def _types(op: str, group: Group) -> _vma.Types | None:
    """The typed scope if the group's axes are tracked there ([Note: varying axes]); None
    if untyped (then the boundary rule applies)."""
    types = _vma.current()
    if types is None:
        return None
    tracked = [a for a in group.axes if a in types.axes]
    if len(tracked) == len(group.axes):
        return types
    if not tracked:
        return None
    raise SpecError(
        f"{op}(axis={group.axes!r}): {tracked} belong to a shard_map with varying-axis types (check_vma=True) "
        f"and {[a for a in group.axes if a not in types.axes]} to enclosing code without them; one "
        f"collective cannot mix the two rules.\nFix: call {op} once per kind of axis, or give the shard_maps "
        f"the same check_vma."
    )


def _typed_apply(types: _vma.Types, fn, x: torch.Tensor, group: Group, *rest, reduces: bool) -> torch.Tensor:
    """`fn.apply(x, group, *rest)` in a typed body: the operand lifted to vary over the
    group's axes, the result tagged — invariant over them if the collective `reduces`
    (psum, pmax, all_gather), varying otherwise ([Note: varying axes])."""
    x = _vma.lift(x, group.axes, types)
    with _vma.paused():
        out = fn.apply(x, group, *rest)
    axes = _vma.vma(x, types)
    return _vma.tag(out, axes - set(group.axes) if reduces else axes, types)


def _vary_apply(op: str, fn, x: torch.Tensor, group: Group, *rest) -> torch.Tensor:
    """`fn.apply(x, group, *rest)` for a collective whose operand and result vary over the
    group's axes (typed or not)."""
    types = _types(op, group)
    if types is None:
        return fn.apply(x, group, *rest)
    return _typed_apply(types, fn, x, group, *rest, reduces=False)


def _front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim is None or bdim == 0 else x.movedim(bdim, 0)


_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int32, torch.int64)


def _operand(x, op: str, group: Group) -> torch.Tensor:
    """SpecError unless `x` is a tensor this group's collectives can move."""
    if not isinstance(x, torch.Tensor):
        raise SpecError(f"{op}: expected a torch.Tensor, got {type(x).__name__} {x!r:.60}")
    device = group.backend.device
    if x.device.type != device.type and not (x.is_meta and ops.in_meta_run()):  # [Note: meta tensors] (sf.estimate)
        raise SpecError(f"{op}: the tensor is on {x.device}, but this mesh communicates tensors on {device.type}; "
                        f"move it with .to(mesh.device)")
    if x.dtype not in _SUPPORTED:
        raise SpecError(
            f"{op}: dtype {x.dtype} is not supported by shardfn's collectives (supported: "
            f"{', '.join(str(d).replace('torch.', '') for d in _SUPPORTED)}); cast it first, e.g. x.float()"
            + (" (for complex values, collect torch.view_as_real(x))" if x.is_complex() else "")
        )
    return x


def _int(value, op: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{op}: {what} must be an int, got {value!r:.60}")
    return value


def _flag(value, op: str, what: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{op}: {what} must be True or False, got {value!r:.60}")
    return value


def _dim(d: int, ndim: int, op: str, what: str = "dim") -> int:
    d = _int(d, op, what)
    if not -ndim <= d < ndim:
        raise SpecError(f"{op}: {what}={d} is out of range for a tensor of rank {ndim}")
    return d % ndim


# -- psum / pmean ----------------------------------------------------------------------


@graph.traceable
class _Psum(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return ops.all_reduce(group, x, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):  # transpose of psum is psum (simple rule; see module note)
        return _Psum.apply(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return _Psum.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _Psum.apply(x, group), in_dims[0]


def psum(x, axis):
    """Sum `x` over a mesh axis (or tuple of axes); every rank gets the total.

    Accepts a tensor, a pytree of tensors, or a Python number (`psum(1, 'data')` is the
    axis size, as in JAX).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 2})
      >>> f = sf.shard_map(lambda x: sf.psum(x, "data"), mesh, sf.P("data"), sf.P())
      >>> f(torch.tensor([1.0, 2.0]))
      tensor([3.])
    """
    group = _group("psum", axis)
    return _tree.tree_map(lambda leaf: _psum_leaf(leaf, group, "psum"), x)


def pmean(x, axis):
    """Mean of `x` over a mesh axis (or tuple of axes)."""
    group = _group("pmean", axis)
    return _tree.tree_map(lambda leaf: _psum_leaf(leaf, group, "pmean") / group.size, x)


def _psum_leaf(leaf, group: Group, op: str):
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        return leaf * group.size  # psum(1, 'data') is the axis size, as in JAX
    x = _operand(leaf, op, group)
    types = _types(op, group)
    if types is None:
        return _Psum.apply(x, group)
    # an invariant operand is lifted, so summed N times, as in JAX
    return _typed_apply(types, _vma.PsumInvariant, x, group, reduces=True)


# -- pmax / pmin -----------------------------------------------------------------------


@graph.traceable
class _Pextremum(torch.autograd.Function):
    """max / min over the group; the cotangent goes to the ranks holding the extremum,
    split evenly among ties (like `torch.amax`)."""

    @staticmethod
    def forward(x, group, op, typed):
        return ops.all_reduce(group, x, op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.group, ctx.op, ctx.typed = inputs
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)  # forward mode reads them too

    @staticmethod
    def _route(ctx, g):
        # typed, the output's cotangent is invariant (whole on every rank): no sum; untyped,
        # each rank holds 1/N of it after the output boundary ([Note: the psum transpose rule])
        x, out = ctx.saved_tensors
        hit = (x == out).to(g.dtype)
        total = g if ctx.typed else _Psum.apply(g, ctx.group)
        return total * hit / _Psum.apply(hit, ctx.group)

    @staticmethod
    def backward(ctx, g):
        return _Pextremum._route(ctx, g), None, None, None

    @staticmethod
    def jvp(ctx, t, _g, _o, _t):
        x, out = ctx.saved_tensors
        hit = (x == out).to(t.dtype)
        return _Psum.apply(t * hit, ctx.group) / _Psum.apply(hit, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group, op, typed):
        return _Pextremum.apply(x, group, op, typed), in_dims[0]


def _extremum(x, axis, op: str, name: str) -> torch.Tensor:
    group = _group(name, axis)
    x = _operand(x, name, group)
    types = _types(name, group)
    if types is None:
        return _Pextremum.apply(x, group, op, False)
    return _typed_apply(types, _Pextremum, x, group, op, True, reduces=True)


def pmax(x: torch.Tensor, axis) -> torch.Tensor:
    """Elementwise max over a mesh axis; gradient flows to the ranks holding the max."""
    return _extremum(x, axis, "max", "pmax")


def pmin(x: torch.Tensor, axis) -> torch.Tensor:
    """Elementwise min over a mesh axis; gradient flows to the ranks holding the min."""
    return _extremum(x, axis, "min", "pmin")


# -- all_gather <-> psum_scatter -------------------------------------------------------


@graph.traceable
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim):
        return ops.all_gather(group, x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: psum_scatter
        return _PsumScatter.apply(g, ctx.group, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, t, _g, _d):
        return _AllGather.apply(t, ctx.group, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        return _AllGather.apply(_front(x, in_dims[0]), group, dim + 1), 0


@graph.traceable
class _PsumScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim):
        return ops.reduce_scatter(group, x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: all_gather
        return _AllGather.apply(g, ctx.group, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, t, _g, _d):
        return _PsumScatter.apply(t, ctx.group, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        return _PsumScatter.apply(_front(x, in_dims[0]), group, dim + 1), 0


@graph.traceable
class _AllGatherInvariant(torch.autograd.Function):
    """all_gather typed varying -> invariant ([Note: varying axes]); the cotangent is then
    the same on every rank, and the transpose takes this rank's block."""

    @staticmethod
    def forward(x, group, dim):
        return ops.all_gather(group, x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: this rank's block (no communication)
        return _TakeBlock.apply(g, ctx.group, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, t, _g, _d):
        return _AllGatherInvariant.apply(t, ctx.group, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        return _AllGatherInvariant.apply(_front(x, in_dims[0]), group, dim + 1), 0


@graph.traceable
class _TakeBlock(torch.autograd.Function):
    """This rank's block of `dim` of an invariant value; transpose: the invariant all_gather."""

    @staticmethod
    def forward(x, group, dim):
        n = x.shape[dim] // group.size
        return x.narrow(dim, group.index * n, n).clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, g):
        return _AllGatherInvariant.apply(g, ctx.group, ctx.dim), None, None

    @staticmethod
    def jvp(ctx, t, _g, _d):
        return _TakeBlock.apply(t, ctx.group, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        return _TakeBlock.apply(_front(x, in_dims[0]), group, dim + 1), 0


@graph.traceable
class _VaryGathered(torch.autograd.Function):
    """`gathered` = all_gather(`src`) lifted to varying: the value as it is, the cotangent
    reduce-scattered back to `src` (not all-reduced, then sliced) ([Note: typed transposes])."""

    @staticmethod
    def forward(src, gathered, group, dim):
        return gathered.view_as(gathered)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, g):
        return _PsumScatter.apply(g, ctx.group, ctx.dim), None, None, None

    @staticmethod
    def jvp(ctx, t_src, t_gathered, _g, _d):
        if t_gathered is not None:
            return t_gathered.view_as(t_gathered)
        return _AllGather.apply(t_src, ctx.group, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, src, gathered, group, dim):
        def front(x, d):
            return x.unsqueeze(0).expand((info.batch_size,) + tuple(x.shape)) if d is None else _front(x, d)

        return _VaryGathered.apply(front(src, in_dims[0]), front(gathered, in_dims[1]), group, dim + 1), 0


class _Gathered:
    """Where an invariant all_gather result came from, for lifting it (`_vma.lift`)."""

    __slots__ = ("src", "group", "dim")

    def __init__(self, src, group, dim):
        self.src, self.group, self.dim = src, group, dim

    def vary(self, gathered, axes: tuple) -> tuple[torch.Tensor, tuple]:
        """(`gathered` varying over the group's axes, the axes of `axes` still to lift)."""
        if not set(self.group.axes) <= set(axes):
            return gathered, axes
        return (_VaryGathered.apply(self.src, gathered, self.group, self.dim),
                tuple(a for a in axes if a not in self.group.axes))


def all_gather(x: torch.Tensor, axis, dim: int = 0, tiled: bool = True) -> torch.Tensor:
    """Gather every rank's `x` along `dim` (tiled) or along a new dim `dim` (untiled).

    All ranks must pass the same shape. Ranks are ordered row-major over `axis` as given.
    The result is the same on every rank of `axis` (invariant over it: it may be returned
    under an out spec that omits the axis). Transpose: this rank's block of the cotangent;
    where the result feeds values that vary over `axis`, `psum_scatter` ([Note: typed
    transposes]; untyped, always `psum_scatter`).
    """
    group = _group("all_gather", axis)
    x = _operand(x, "all_gather", group)
    if not _flag(tiled, "all_gather", "tiled"):
        dim = _dim(dim, x.dim() + 1, "all_gather")
        x = x.unsqueeze(dim)
    elif x.dim() == 0:
        raise SpecError("all_gather(tiled=True) needs a tensor of rank >= 1; use tiled=False for scalars")
    else:
        dim = _dim(dim, x.dim(), "all_gather")
    types = _types("all_gather", group)
    if types is None:
        return _AllGather.apply(x, group, dim)
    x = _vma.lift(x, group.axes, types)
    out = _typed_apply(types, _AllGatherInvariant, x, group, dim, reduces=True)
    out._sf_gathered = _Gathered(x, group, dim)
    return out


def psum_scatter(x: torch.Tensor, axis, dim: int = 0, tiled: bool = True) -> torch.Tensor:
    """Sum over `axis`, then keep this rank's block of `dim` (JAX's psum_scatter).

    Tiled: `x.shape[dim]` must divide by the axis size and the block has
    `x.shape[dim] / size` rows. Untiled: `x.shape[dim]` must equal the size and the dim
    is removed. Transpose: `all_gather`.
    """
    group = _group("psum_scatter", axis)
    x = _operand(x, "psum_scatter", group)
    _flag(tiled, "psum_scatter", "tiled")
    if x.dim() == 0:
        raise SpecError("psum_scatter needs a tensor of rank >= 1")
    d = _dim(dim, x.dim(), "psum_scatter")
    n = x.shape[d]
    if (not tiled and n != group.size) or (tiled and n % group.size):
        need = f"equal to the axis size {group.size}" if not tiled else f"divisible by the axis size {group.size}"
        raise SpecError(
            f"psum_scatter(axis={axis!r}, dim={dim}, tiled={tiled}): x has shape {tuple(x.shape)}; "
            f"dim {d} has size {n}, which must be {need}.\nFix: pad dim {d} to a multiple of {group.size}, "
            f"or scatter another dim."
        )
    out = _vary_apply("psum_scatter", _PsumScatter, x, group, d)
    return out if tiled else out.squeeze(d)


# -- ppermute --------------------------------------------------------------------------


@graph.traceable
class _Ppermute(torch.autograd.Function):
    @staticmethod
    def forward(x, group, perm):
        return ops.ppermute(group, x, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.perm = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: the inverse permutation
        return _Ppermute.apply(g, ctx.group, tuple((d, s) for s, d in ctx.perm)), None, None

    @staticmethod
    def jvp(ctx, t, _g, _p):
        return _Ppermute.apply(t, ctx.group, ctx.perm)

    @staticmethod
    def vmap(info, in_dims, x, group, perm):
        return _Ppermute.apply(x, group, perm), in_dims[0]


def ppermute(x: torch.Tensor, axis, perm: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Send `x` from axis index `src` to `dst` for each `(src, dst)` pair of `perm`.

    A rank that no pair sends to receives zeros. Transpose: the inverse permutation.
    """
    group = _group("ppermute", axis)
    x = _operand(x, "ppermute", group)
    try:
        pairs = tuple((_int(s, "ppermute", "perm entries"), _int(d, "ppermute", "perm entries")) for s, d in perm)
    except (TypeError, ValueError):
        raise SpecError(f"ppermute(axis={axis!r}): perm must be a list of (source, destination) index pairs, "
                        f"got {perm!r:.80}; e.g. [(0, 1), (1, 0)]") from None
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    bad = [p for p in pairs if not (0 <= p[0] < group.size and 0 <= p[1] < group.size)]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise SpecError(
            f"ppermute(axis={axis!r}, perm={list(perm)!r}): perm must be a permutation (a partial one is "
            f"fine) of the axis indices 0..{group.size - 1}: each index at most once as a source and once "
            f"as a destination" + (f"; out of range: {bad}" if bad else "") + ".\nFix: e.g. a ring shift "
            f"[(i, (i + 1) % {group.size}) for i in range({group.size})]."
        )
    return _vary_apply("ppermute", _Ppermute, x, group, pairs)


# -- all_to_all ------------------------------------------------------------------------


@graph.traceable
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, group, split_dim, concat_dim):
        return ops.all_to_all(group, x, split_dim, concat_dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.split_dim, ctx.concat_dim = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: all_to_all with the dims swapped
        return _AllToAll.apply(g, ctx.group, ctx.concat_dim, ctx.split_dim), None, None, None

    @staticmethod
    def jvp(ctx, t, _g, _s, _c):
        return _AllToAll.apply(t, ctx.group, ctx.split_dim, ctx.concat_dim)

    @staticmethod
    def vmap(info, in_dims, x, group, split_dim, concat_dim):
        return _AllToAll.apply(_front(x, in_dims[0]), group, split_dim + 1, concat_dim + 1), 0


def all_to_all(x: torch.Tensor, axis, split_dim: int, concat_dim: int, tiled: bool = True) -> torch.Tensor:
    """Split `split_dim` into one block per rank, send block i to rank i, concatenate the
    received blocks along `concat_dim` (tiled), or, untiled, remove `split_dim` (whose
    size must equal the axis size) and stack the received pieces on a new `concat_dim`.
    Transpose: all_to_all with the dims swapped.
    """
    group = _group("all_to_all", axis)
    x = _operand(x, "all_to_all", group)
    _flag(tiled, "all_to_all", "tiled")
    if x.dim() == 0:
        raise SpecError("all_to_all needs a tensor of rank >= 1")
    s = _dim(split_dim, x.dim(), "all_to_all", "split_dim")
    n = x.shape[s]
    if (not tiled and n != group.size) or (tiled and n % group.size):
        need = f"equal to the axis size {group.size}" if not tiled else f"divisible by the axis size {group.size}"
        raise SpecError(
            f"all_to_all(axis={axis!r}, split_dim={split_dim}, tiled={tiled}): x has shape "
            f"{tuple(x.shape)}; split dim {s} has size {n}, which must be {need}."
        )
    if not tiled:
        c = _dim(concat_dim, x.dim(), "all_to_all", "concat_dim")
        moved = x.movedim(s, 0)  # (k, *rest): piece j goes to rank j
        return _vary_apply("all_to_all", _AllToAll, moved, group, 0, 0).movedim(0, c)
    return _vary_apply("all_to_all", _AllToAll, x, group, s, _dim(concat_dim, x.dim(), "all_to_all", "concat_dim"))


# -- ragged_all_to_all -----------------------------------------------------------------
#
# [Note: ragged offsets] JAX's signature, JAX's meaning: on rank i, chunk j is
# operand[input_offsets[j] : input_offsets[j] + send_sizes[j]] and lands in peer j's
# `output` at rows output_offsets[j] : output_offsets[j] + send_sizes[j] — offsets in the
# RECEIVER's buffer, supplied by the sender. The receiver needs them, so the public
# function exchanges (output_offsets, send_sizes) with one all_to_all of k x 2 int64s and
# hands `_RaggedAllToAll` a purely local plan: where each outgoing chunk starts in
# `operand`, and where each incoming chunk goes in `output`. In that form the transpose
# needs no exchange at all: it is the same op with the roles swapped (send from the
# output cotangent at the receive offsets, receive into the operand at input_offsets).
# Operand chunks may overlap (the same rows sent to several peers), so the transpose adds
# what it receives (`accumulate=True`); incoming chunks of the forward may not overlap
# (checked), so its receive side may overwrite.


class _RaggedPlan:
    """Local rows of one ragged all-to-all (plain object: functorch rebuilds containers).

    send_offsets/send_sizes index the operand by destination axis index; recv_offsets/
    recv_sizes index the output by source axis index; `accumulate` adds received rows
    instead of overwriting them."""

    __slots__ = ("send_offsets", "send_sizes", "recv_offsets", "recv_sizes", "accumulate")

    def __init__(self, send_offsets, send_sizes, recv_offsets, recv_sizes, accumulate=False):
        self.send_offsets, self.send_sizes = tuple(send_offsets), tuple(send_sizes)
        self.recv_offsets, self.recv_sizes = tuple(recv_offsets), tuple(recv_sizes)
        self.accumulate = accumulate

    def transposed(self) -> "_RaggedPlan":
        return _RaggedPlan(self.recv_offsets, self.recv_sizes, self.send_offsets, self.send_sizes, True)

    @staticmethod
    def rows(offsets, sizes, device) -> torch.Tensor:
        """The row indices of the chunks, concatenated: offsets[j] .. offsets[j] + sizes[j] - 1."""
        n = torch.tensor(sizes, dtype=torch.int64, device=device)
        shift = torch.tensor(offsets, dtype=torch.int64, device=device) - (torch.cumsum(n, 0) - n)
        return torch.arange(int(sum(sizes)), dtype=torch.int64, device=device) + torch.repeat_interleave(shift, n)


@graph.traceable
class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(operand, output, group, plan):
        packed = operand.index_select(0, plan.rows(plan.send_offsets, plan.send_sizes, operand.device))
        received = ops.ragged_all_to_all(group, packed, plan.send_sizes, plan.recv_sizes)
        result = output.clone(memory_format=torch.contiguous_format)
        rows = plan.rows(plan.recv_offsets, plan.recv_sizes, result.device)
        return result.index_add_(0, rows, received) if plan.accumulate else result.index_copy_(0, rows, received)

    @staticmethod
    def setup_context(ctx, inputs, output):
        operand, out, ctx.group, ctx.plan = inputs
        ctx.operand_meta = (tuple(operand.shape), operand.dtype, operand.device)
        ctx.output_meta = (tuple(out.shape), out.dtype, out.device)

    @staticmethod
    def backward(ctx, g):  # transpose: the same op, roles swapped, received rows added up
        plan = ctx.plan
        g_operand = g_output = None
        if ctx.needs_input_grad[0]:
            shape, dtype, device = ctx.operand_meta
            zeros = torch.zeros(shape, dtype=g.dtype, device=device)
            g_operand = _RaggedAllToAll.apply(g, zeros, ctx.group, plan.transposed())
        if ctx.needs_input_grad[1]:
            g_output = g
            if not plan.accumulate:  # overwritten rows of the buffer get no gradient
                keep = torch.ones(g.shape[0], dtype=g.dtype, device=g.device)
                keep[plan.rows(plan.recv_offsets, plan.recv_sizes, g.device)] = 0
                g_output = g * keep.reshape((-1,) + (1,) * (g.dim() - 1))
        return g_operand, g_output, None, None

    @staticmethod
    def jvp(ctx, t_operand, t_output, _g, _p):
        if t_operand is None:
            shape, _, device = ctx.operand_meta
            t_operand = torch.zeros(shape, dtype=t_output.dtype, device=device)
        if t_output is None:
            shape, _, device = ctx.output_meta
            t_output = torch.zeros(shape, dtype=t_operand.dtype, device=device)
        return _RaggedAllToAll.apply(t_operand, t_output, ctx.group, ctx.plan)

    @staticmethod
    def vmap(info, in_dims, operand, output, group, plan):
        # rows stay dim 0, the batch goes to dim 1: the same rows move, each carrying B items
        def batched(x, d):
            if d is None:
                return x.unsqueeze(1).expand((x.shape[0], info.batch_size) + tuple(x.shape[1:]))
            return x.movedim(d, 1)

        return _RaggedAllToAll.apply(batched(operand, in_dims[0]), batched(output, in_dims[1]), group, plan), 1


_RAGGED_ARGS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def _ragged_ints(value, what: str, k: int, where: str) -> tuple[int, ...]:
    """A length-k tuple of Python ints from a 1-D integer tensor or a list of ints."""
    if isinstance(value, torch.Tensor):
        if torch._C._functorch.is_batchedtensor(value):
            raise SpecError(
                f"{where}: {what} is batched by vmap; per-example ragged layouts are not supported.\nFix: vmap "
                f"over the data only (sizes and offsets shared by the batch, e.g. in_dims=None for them), or "
                f"loop over the examples.")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise SpecError(f"{where}: {what} must hold integers, got dtype {value.dtype}.\nFix: "
                            f"{what}.to(torch.int64).")
        if value.dim() != 1 or value.shape[0] != k:
            raise SpecError(f"{where}: {what} must be 1-D with one entry per rank of the axis (length {k}), "
                            f"got shape {tuple(value.shape)}.")
        try:
            return tuple(int(v) for v in value.detach().cpu().tolist())
        except RuntimeError as err:  # a wrapper without storage that is_batchedtensor did not spot
            raise SpecError(f"{where}: cannot read the values of {what} ({err}); pass a plain tensor "
                            f"or a list of ints.") from None
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise SpecError(f"{where}: {what} must hold Python ints, got {list(value)!r:.80}.")
        if len(value) != k:
            raise SpecError(f"{where}: {what} must have one entry per rank of the axis (length {k}), got "
                            f"length {len(value)}: {list(value)!r:.80}.")
        return tuple(value)
    raise SpecError(f"{where}: {what} must be a 1-D integer tensor or a list of {k} ints, got "
                    f"{type(value).__name__} {value!r:.60}.")


def _ragged_problems(operand, output, ints, incoming, me) -> list[str]:
    """Everything wrong with this rank's arguments (empty when fine); `incoming[j]` is peer
    j's (output_offsets[me], send_sizes[me])."""
    in_off, send, out_off, recv = (ints[a] for a in _RAGGED_ARGS)
    n_in, n_out = operand.shape[0], output.shape[0]
    bad = [f"{a} has negative entries: {list(ints[a])}" for a in _RAGGED_ARGS if min(ints[a]) < 0]
    bad += [f"input_offsets[{j}] + send_sizes[{j}] = {in_off[j]} + {send[j]} = {in_off[j] + send[j]} exceeds "
            f"operand's {n_in} rows (operand shape {tuple(operand.shape)})"
            for j in range(len(send)) if in_off[j] + send[j] > n_in]
    if incoming is None:
        return bad
    for j, (o, n) in enumerate(incoming):
        if n != recv[j]:
            bad.append(f"recv_sizes[{j}] = {recv[j]}, but axis index {j} sends {n} rows here (its "
                       f"send_sizes[{me}] = {n}): every rank's recv_sizes[j] must equal rank j's send_sizes[me]")
        elif o + n > n_out:
            bad.append(f"axis index {j} writes rows {o}:{o + n} here (its output_offsets[{me}] = {o}, "
                       f"send_sizes[{me}] = {n}), beyond output's {n_out} rows (output shape {tuple(output.shape)})")
    spans = sorted((o, o + n, j) for j, (o, n) in enumerate(incoming) if n > 0)
    bad += [f"the chunks from axis indices {a[2]} (rows {a[0]}:{a[1]}) and {b[2]} (rows {b[0]}:{b[1]}) overlap "
            f"in output" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return bad


def ragged_all_to_all(operand: torch.Tensor, output: torch.Tensor, input_offsets, send_sizes, output_offsets,
                      recv_sizes, axis, *, check: bool = False) -> torch.Tensor:
    """All-to-all with a variable number of rows per peer (`jax.lax.ragged_all_to_all`).

    On the rank at axis index i, for every peer j (axis index, row-major over `axis` as
    given): rows `operand[input_offsets[j] : input_offsets[j] + send_sizes[j]]` are written
    into **peer j's** `output` at rows `output_offsets[j] : output_offsets[j] + send_sizes[j]`.
    As in JAX, `output_offsets` are offsets in the *receiver's* buffer, chosen by the sender
    (see [Note: ragged offsets]); `recv_sizes[j]` is how many rows this rank receives from
    peer j and must equal peer j's `send_sizes[i]`. Rows of `output` nobody writes keep their
    values; the result is a new tensor (`output` is not modified). Rows are dim 0; operand
    and output share dtype and trailing dims.

    Cost: one all_to_all of `axis_size x 2` int64s (each receiver learns where its incoming
    chunks go, and their sizes, which are checked against `recv_sizes`), then one uneven
    all-to-all of the rows. The backward and jvp add no offset exchange.

    Args:
      operand: rows to send, `(n_in, *rest)`.
      output: the buffer received rows are written into, `(n_out, *rest)`.
      input_offsets: where chunk j starts in `operand`.
      send_sizes: rows of chunk j.
      output_offsets: where chunk j starts in peer j's `output`.
      recv_sizes: rows received from each peer. Each of these four is a 1-D integer
        tensor or a list of ints, one entry per rank of `axis`, shared by a vmapped batch
        (not batched itself).
      axis: a mesh axis name or tuple of names.
      check: also agree, with one all-reduce, that every rank's arguments are valid, so
        that every rank raises together (without it, only the rank that finds a problem
        raises; its peers stop through the simulated mesh's abort, or time out on processes).

    Returns:
      `output` with the received chunks written in, `(n_out, *rest)`.

    Raises:
      SpecError: wrong types, dtypes or lengths; negative entries; a chunk past the end of
        `operand` or of the receiver's `output`; `recv_sizes` that disagree with the
        senders' `send_sizes`; incoming chunks that overlap.

    Autodiff: linear in (operand, output). The operand's cotangent is the same op run back
    (each received chunk's cotangent returns to its sender's rows, summed where rows were
    sent twice; rows never sent get zero); the buffer's cotangent is the output's with the
    written rows zeroed. jvp: the same op on the tangents. vmap: a batch dim on operand
    and/or output (rows move with their whole batch).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"ep": 2})
      >>> def route(x):  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 and 1
      ...     i = sf.axis_index("ep")
      ...     send = [[1, 2], [1, 1]][i]
      ...     recv = [[1, 1], [2, 1]][i]
      ...     out_off = [[0, 0], [1, 2]][i]  # in the receiver's buffer
      ...     return sf.ragged_all_to_all(x, torch.zeros(3), [0, 1], send, out_off, recv, "ep")
      >>> f = sf.shard_map(route, mesh, sf.P("ep"), sf.P("ep"))
      >>> f(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
      tensor([1., 4., 0., 2., 3., 5.])
    """
    group = _group("ragged_all_to_all", axis)
    k = group.size
    where = f"ragged_all_to_all(axis={axis!r}, axis size {k})"
    operand = _operand(operand, "ragged_all_to_all (operand)", group)
    output = _operand(output, "ragged_all_to_all (output)", group)
    _flag(check, "ragged_all_to_all", "check")
    if operand.dim() == 0 or output.dim() == 0:
        raise SpecError(f"{where}: operand and output need rank >= 1 (rows are dim 0), got shapes "
                        f"{tuple(operand.shape)} and {tuple(output.shape)}; e.g. x.reshape(-1, 1).")
    if operand.dtype != output.dtype or operand.shape[1:] != output.shape[1:]:
        raise SpecError(f"{where}: operand and output must share dtype and trailing dims (rows are dim 0), got "
                        f"operand {tuple(operand.shape)} {operand.dtype} and output {tuple(output.shape)} "
                        f"{output.dtype}.")
    values = dict(zip(_RAGGED_ARGS, (input_offsets, send_sizes, output_offsets, recv_sizes)))
    ints = {a: _ragged_ints(v, a, k, where) for a, v in values.items()}
    me = group.index
    problems = _ragged_problems(operand, output, ints, None, me)
    if problems and not check:
        raise _ragged_error(where, me, problems)
    mine = torch.tensor(list(zip(ints["output_offsets"], ints["send_sizes"])), dtype=torch.int64)
    incoming = [tuple(r) for r in ops.all_to_all(group, mine.to(group.backend.device), 0, 0).cpu().tolist()]
    problems = problems or _ragged_problems(operand, output, ints, incoming, me)
    if check and k > 1:
        flag = ops.all_reduce(group, torch.tensor([int(bool(problems))], device=group.backend.device), "max")
        if int(flag) and not problems:
            raise SpecError(f"{where}: another rank of the axis found invalid arguments (check=True stops "
                            f"every rank here); its error names them.")
    if problems:
        raise _ragged_error(where, me, problems)
    plan = _RaggedPlan(ints["input_offsets"], ints["send_sizes"], [o for o, _ in incoming], ints["recv_sizes"])
    types = _types("ragged_all_to_all", group)
    if types is None:
        return _RaggedAllToAll.apply(operand, output, group, plan)
    axes = _vma.vma(operand, types) | _vma.vma(output, types) | set(group.axes)
    operand, output = _vma.lift(operand, axes, types), _vma.lift(output, axes, types)
    with _vma.paused():
        out = _RaggedAllToAll.apply(operand, output, group, plan)
    return _vma.tag(out, axes, types)


def _ragged_error(where: str, me: int, problems: list[str]) -> SpecError:
    items = "\n".join(f"  - {p}" for p in problems)
    return SpecError(
        f"{where} on axis index {me}:\n{items}\nFix: chunk j of operand is rows input_offsets[j] : "
        f"input_offsets[j] + send_sizes[j]; it lands in peer j's output at rows output_offsets[j] : "
        f"output_offsets[j] + send_sizes[j] (offsets in the receiver's buffer, as in JAX); recv_sizes[j] is "
        f"what peer j sends here.")


# -- pvary -----------------------------------------------------------------------------


def pvary(x, axis):
    """Mark `x` as varying over `axis` (JAX's `lax.pvary`): no communication, the value is
    unchanged; its transpose sums the cotangent over `axis`.

    Inside a shard_map with `check_vma=True`, shardfn inserts it wherever an invariant value
    meets a varying one ([Note: typed transposes]); call it yourself where a value varies
    in a way the types cannot see (one built from `axis_index`, or random per rank), or
    before an in-place write of varying values into an invariant tensor. Accepts a pytree.
    Without types (check_vma=False, `sf.shard`'s loss_fn) it returns `x` unchanged.

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"i": 2})
      >>> def f(w):  # w is replicated (P()); make it per rank, then return the blocks
      ...     return sf.pvary(w, "i") * (sf.axis_index("i") + 1)
      >>> sf.shard_map(f, mesh, sf.P(), sf.P("i"))(torch.ones(2))
      tensor([1., 1., 2., 2.])
    """
    group = _group("pvary", axis)
    axes = group.axes
    types = _types("pvary", group)
    if types is None:
        return x
    def one(leaf):
        lifted = _vma.lift(_operand(leaf, "pvary", group), axes, types)
        # a copy, unlike the implicit lifts: the caller may write into it in place
        return lifted if lifted is leaf else _vma.tag(lifted.clone(), _vma.vma(lifted, types), types)

    return _tree.tree_map(one, x)


# -- indices ---------------------------------------------------------------------------


def axis_index(axis):
    """This rank's index along `axis` (row-major over a tuple of axes).

    Inside a shard_map with varying-axis types (check_vma=True, the default) it is, as in
    JAX, a value that varies over `axis`: a 0-d int64 tensor typed so ([Note: varying
    axes]), usable in arithmetic and as an index (`xs[i]`, `x[i * n:]`); `int(i)` gives a
    plain int, which the types no longer follow. Elsewhere (`sf.shard`'s loss_fn,
    check_vma=False, rank code) it is a Python int.
    """
    group = _group("axis_index", axis)
    types = _types("axis_index", group)
    if types is None:
        return group.index
    return _vma.tag(torch.tensor(group.index), group.axes, types)


def axis_size(axis) -> int:
    """The number of ranks along `axis` (product over a tuple)."""
    return bound_mesh("axis_size", axis).axis_size(_axes("axis_size", axis))
