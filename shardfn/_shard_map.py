"""shard_map, scatter and gather: the edges between global values and local blocks.

[Note: the psum transpose rule] We use the rule of JAX's first shard_map (JEP 17111,
"shmap transpose"): psum's transpose is psum, which is correct only together with two
boundary halves, both applied here:
  (1) at the output, the cotangent of an output whose out spec omits a mesh axis is
      divided by that axis' size (every rank holds the whole cotangent of a replicated
      value; the psum inside will add the N copies back up);
  (2) at the input, the cotangent of an input whose in spec omits a mesh axis is psummed
      over that axis (each rank computed only its share of a replicated input's gradient).
Both are identities in the forward and in forward mode. The price is an all-reduce per
replicated *input* in the backward; `shard` (FSDP) never pays it, because it moves
parameters with its own all-gather / reduce-scatter pair and only its scalar loss crosses
a boundary. docs/autodiff.md works through the examples.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _tree, _vma
from ._backend import ops
from ._agree import check_same_everywhere
from ._blocks import check_tensor, checked_spec, gather_blocks, slice_block, check_no_empty_blocks
from ._binding import binding, current_binding
from ._errors import ShardingError, SpecError
from ._global import global_call
from ._spec import PartitionSpec, as_spec, is_spec, validate_spec

__all__ = ["shard_map", "scatter", "gather"]


# -- scatter / gather: differentiable moves between global tensors and local blocks ------


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(x, mesh, spec):
        return slice_block(x, spec, mesh).clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.mesh, ctx.spec = inputs

    @staticmethod
    def backward(ctx, g):  # transpose: gather (the global cotangent is the sum of blocks)
        return _Gather.apply(g, ctx.mesh, ctx.spec), None, None

    @staticmethod
    def jvp(ctx, t, _m, _s):
        return _Scatter.apply(t, ctx.mesh, ctx.spec)

    @staticmethod
    def vmap(info, in_dims, x, mesh, spec):
        x = x if in_dims[0] == 0 else x.movedim(in_dims[0], 0)
        return slice_block(x, spec, mesh, offset=1).clone(), 0


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(x, mesh, spec):
        return gather_blocks(x, spec, mesh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.mesh, ctx.spec = inputs

    @staticmethod
    def backward(ctx, g):  # the cotangent is the same on every rank: take this rank's block
        return _Scatter.apply(g, ctx.mesh, ctx.spec), None, None

    @staticmethod
    def jvp(ctx, t, _m, _s):
        return _Gather.apply(t, ctx.mesh, ctx.spec)

    @staticmethod
    def vmap(info, in_dims, x, mesh, spec):
        x = x if in_dims[0] == 0 else x.movedim(in_dims[0], 0)
        return gather_blocks(x, spec, mesh, offset=1), 0


def scatter(x: torch.Tensor, mesh, spec, *, allow_empty: bool = False) -> torch.Tensor:
    """This rank's block of a global tensor `x` that every rank holds.

    Uneven sizes follow `torch.chunk`: blocks of `ceil(n / k)` rows, the trailing ones
    shorter. A split that would leave some ranks with zero rows while others hold rows
    (6 rows over 4 ranks: 2, 2, 2, 0) is refused unless `allow_empty=True`: a rank with
    an empty batch computes a NaN mean and, under `sf.shard`, an unequal batch.
    Differentiable: the backward is `gather`.

    Args:
      x: the global tensor, the same on every rank.
      mesh: the mesh.
      spec: an `sf.P(...)` (or None: replicated) for `x`'s dims.
      allow_empty: accept blocks of zero rows (torch.chunk's layout as it is; `sf.shard`
        lays out small parameters that way).

    Returns:
      This rank's block (a view of `x`).

    Raises:
      SpecError: an invalid spec for `x` or the mesh; a split with empty blocks (above).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 2})
      >>> mesh.run(lambda: sf.scatter(torch.arange(3.0), mesh, sf.P("data")).tolist())
      [[0.0, 1.0], [2.0]]
    """
    spec = checked_spec(x, mesh, spec, "scatter", communicates=False)
    if not allow_empty:
        check_no_empty_blocks(tuple(x.shape), spec, mesh.shape, "scatter")
    return _Scatter.apply(x, mesh, spec)


def gather(x_local: torch.Tensor, mesh, spec) -> torch.Tensor:
    """The global tensor, on every rank, from each rank's block `x_local`.

    Differentiable: the backward takes this rank's block of a cotangent that is the same
    on every rank (a slice, not a reduction).

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 2})
      >>> mesh.run(lambda: sf.gather(torch.full((2,), float(mesh.rank)), mesh, sf.P("data")).tolist())
      [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]
    """
    return _Gather.apply(x_local, mesh, checked_spec(x_local, mesh, spec, "gather"))


# -- boundary halves of the transpose rule ----------------------------------------------


class _InputBoundary(torch.autograd.Function):
    """Identity; the backward psums over the axes the in spec omits (half 2)."""

    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _PsumToReplicated.apply(g, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return t.view_as(t)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _InputBoundary.apply(x, group), in_dims[0]


class _PsumToReplicated(torch.autograd.Function):
    """The input boundary's psum: it produces a replicated gradient, so (for double
    backward) its transpose passes the — replicated — cotangent through unchanged,
    which is `psum` after the output-boundary division by the axis size."""

    @staticmethod
    def forward(g, group):
        return ops.all_reduce(group, g, "sum")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, c):
        return _InputBoundary.apply(c, ctx.group), None

    @staticmethod
    def jvp(ctx, t, _):
        return _PsumToReplicated.apply(t, ctx.group)

    @staticmethod
    def vmap(info, in_dims, g, group):
        return _PsumToReplicated.apply(g, group), in_dims[0]


class _OutputBoundary(torch.autograd.Function):
    """Identity; the backward divides by the size of the axes the out spec omits (half 1)."""

    @staticmethod
    def forward(x, size):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.size = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _OutputBoundary.apply(g, 1) / ctx.size, None

    @staticmethod
    def jvp(ctx, t, _):
        return t.view_as(t)

    @staticmethod
    def vmap(info, in_dims, x, size):
        return _OutputBoundary.apply(x, size), in_dims[0]


class _CheckReplicated(torch.autograd.Function):
    """Identity on many tensors; the forward verifies they agree across `group`.

    [Note: the replication check] Each tensor is reduced to a fingerprint (its float64
    sum and a position-weighted sum, NaN/Inf mapped to sentinels); one all-reduce(max) of
    [fingerprints, -fingerprints] over the omitted axes gives every rank the max and min,
    which must agree to 1e-6 relative. Cost: one all-reduce of 4 floats per output per
    group of omitted axes, once per call, in the forward only.
    """

    @staticmethod
    def forward(group, where, *xs):
        _verify_replicated(group, where, xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *gs):
        return (None, None) + tuple(gs)

    @staticmethod
    def jvp(ctx, _g, _w, *ts):
        return tuple(t.view_as(t) for t in ts)

    @staticmethod
    def vmap(info, in_dims, group, where, *xs):
        _verify_replicated(group, where, xs)
        return tuple(x.view_as(x) for x in xs), tuple(in_dims[2:])


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1).to(torch.float64)
    flat = torch.nan_to_num(flat, nan=1.234567e300, posinf=2.345678e300, neginf=-3.456789e300)
    weights = (torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 7.0) + 1.0
    return torch.stack([flat.sum(), (flat * weights).sum()])


def replicated_mismatch(group, xs) -> list[bool]:
    """Per tensor, whether it differs across the ranks of `group` (same on all ranks)."""
    prints = torch.stack([_fingerprint(x) for x in xs])  # (n, 2)
    both = ops.all_reduce(group, torch.cat([prints, -prints]).reshape(-1), "max").reshape(2, -1, 2)
    hi, lo = both[0], -both[1]
    return ((hi - lo).abs() > 1e-6 * torch.maximum(hi.abs(), lo.abs()) + 1e-30).any(dim=1).tolist()


def _verify_replicated(group, where: list[str], xs) -> None:
    bad = replicated_mismatch(group, xs)
    if any(bad):
        names = [w for w, b in zip(where, bad) if b]
        raise ShardingError(
            f"shard_map: out_specs promise that {names} are the same on every rank of mesh axes "
            f"{group.axes} (their out spec omits those axes), but the values differ across ranks "
            f"{list(group.ranks)} (seen on rank index {group.index}).\nFix: name the axis in the out "
            f"spec (e.g. P('{group.axes[0]}')) if the output is sharded, or reduce it first "
            f"(sf.psum / sf.pmean); without check=True this debug check does not run."
        )


# -- shard_map -------------------------------------------------------------------------


def _omitted(manual: tuple[str, ...], spec: PartitionSpec) -> tuple[str, ...]:
    """The manual axes a spec does not name: the value is replicated over them."""
    used = set(spec.axes)
    return tuple(a for a in manual if a not in used)


class _Context:
    """Where a shard_map runs: its manual axes, and those it must split itself.

    [Note: partial-manual shard_map] `axis_names` makes a shard_map manual over those axes
    only; over the others the code inside is "auto", as the code around it was. Rank code
    outside any shard_map / shard is manual over every axis (it holds local blocks), so a
    shard_map called there takes blocks as they are. Inside another shard_map or a shard
    step, the values are whole over the axes that are auto there: a nested shard_map over
    such axes slices its inputs by its in_specs (sf.scatter: backward = gather) and gathers
    its outputs by its out_specs (sf.gather: backward = this rank's block), and its body is
    manual over the outer manual axes plus its own. The transpose rule's two boundary halves
    apply over this shard_map's own axes only. JAX's shard_map has the same semantics."""

    def __init__(self, mesh, axis_names, name, check_vma: bool):
        outer = current_binding()
        self.axes = tuple(mesh.axis_names) if axis_names is None else mesh.axes(
            tuple(axis_names), where=f"{name}(axis_names=...)")
        self.types = self.outer_types = None
        if check_vma:  # [Note: varying axes]; nested in a typed shard_map: its scope, its axes too
            self.outer_types = _vma.current() if outer is not None else None
            outer_axes = self.outer_types.axes if self.outer_types is not None else frozenset()
            self.types = _vma.Types(mesh, outer_axes | set(self.axes),
                                    self.outer_types.scope if self.outer_types is not None else None)
        if outer is None:
            self.split, self.manual = (), self.axes
            return
        if outer.mesh is not mesh:
            raise ShardingError(f"{name}: nested inside a shard_map / shard over another mesh; nest shard_maps "
                                f"over one mesh")
        already = [a for a in self.axes if a in outer.manual]
        if already:
            raise SpecError(
                f"{name}: axis_names {list(self.axes)} include {already}, which the enclosing shard_map / shard "
                f"is already manual over (its manual axes: {list(outer.manual)}).\nFix: nest a shard_map over "
                f"the other axes (axis_names={[a for a in mesh.axis_names if a not in outer.manual]}), or call "
                f"the collectives directly."
            )
        self.split = self.axes  # whole over these outside: split them here
        self.manual = tuple(a for a in mesh.axis_names if a in outer.manual or a in self.axes)

    def check_spec(self, spec: PartitionSpec, where: str) -> None:
        stray = [a for a in spec.axes if a not in self.axes]
        if stray:
            raise SpecError(
                f"{where}: the spec {spec!r} names {stray}, which are not in this shard_map's axis_names "
                f"{list(self.axes)}; specs may name only the axes the shard_map is manual over.\nFix: add "
                f"{stray} to axis_names, or drop them from the spec."
            )


def _agree_on_structure(mesh, paths, leaves, treedef, agreed: set, name: str) -> None:
    """Once per argument structure and rank: all ranks passed the same tree, dtypes, ranks."""
    kinds = tuple((x.dtype, x.dim()) if isinstance(x, torch.Tensor) else type(x) for x in leaves)
    key = (mesh.rank, treedef, kinds)
    if key in agreed:
        return
    lines = [f"args{_tree.keystr(p)}: " + (f"{x.dtype} of rank {x.dim()}" if isinstance(x, torch.Tensor)
             else type(x).__name__) for p, x in zip(paths, leaves)]
    check_same_everywhere(mesh.group(mesh.axis_names), lines, f"arguments to {name}",
                          "call the shard_mapped function with the same tree of blocks on every rank.")
    agreed.add(key)


def _local_call(f, mesh, in_specs, out_specs, check, args, name, agreed=None, axis_names=None, check_vma=True):
    ctx = _Context(mesh, axis_names, name, check_vma)
    paths, leaves, treedef = _tree.flatten_with_paths(args)
    if agreed is not None:
        _agree_on_structure(mesh, paths, leaves, treedef, agreed, name)
    specs = _tree.broadcast_prefix(in_specs, args, what="in_specs", is_prefix_leaf=is_spec)
    bound = []
    for path, leaf, spec in zip(paths, leaves, specs):
        where = f"{name}: in_specs for argument {_tree.keystr(path)}"
        spec = as_spec(spec, where)
        ctx.check_spec(spec, where)
        if isinstance(leaf, torch.Tensor):
            check_tensor(leaf, mesh, f"{name}: argument {_tree.keystr(path)}")
            validate_spec(spec, tuple(leaf.shape), mesh.shape, where)
            outer_vma = _vma.vma(leaf, ctx.outer_types) if ctx.outer_types is not None else frozenset()
            if ctx.split and spec.axes:  # whole outside: this rank's block ([Note: partial-manual shard_map])
                leaf = _Scatter.apply(leaf, mesh, spec)
            omitted = _omitted(ctx.axes, spec)
            if ctx.types is not None:  # typed: varies over what its spec names (a view: the caller's stays untagged)
                leaf = _vma.tag(leaf.view_as(leaf), outer_vma | (set(spec.axes) & set(ctx.axes)), ctx.types)
            elif omitted and (leaf.is_floating_point() or leaf.is_complex()):
                leaf = _InputBoundary.apply(leaf, mesh.group(omitted))
        elif spec.axes:
            raise SpecError(
                f"{name}: argument {_tree.keystr(path)} is a {type(leaf).__name__}, not a tensor, but its "
                f"in spec {spec!r} shards it over {spec.axes}.\nFix: give non-tensor arguments P() or None."
            )
        bound.append(leaf)
    with binding(mesh, manual=ctx.manual, types=ctx.types):
        out = f(*_tree.unflatten(treedef, bound))
    return _finish_outputs(mesh, out, out_specs, check, name, ctx)


def _vma_error(name: str, bad: list) -> ShardingError:
    """[Note: varying axes] outputs whose out spec omits axes they vary over."""
    items = "\n".join(f"  - {'output' + path if path else 'the output'}: varies over {axes} (it is computed from values that differ across "
                      f"those ranks), but its out spec {spec!r} omits them, which promises the same value on "
                      f"every rank" for path, spec, axes in bad)
    axes = sorted({a for _, _, ax in bad for a in ax})
    return ShardingError(
        f"{name}: out_specs do not match what the function returns:\n{items}\nFix: reduce it over "
        f"{axes} first (sf.psum / sf.pmean / sf.all_gather), or name the axes in the out spec (e.g. "
        f"P({axes[0]!r})) to return every rank's block; if it is in fact the same on every rank in a way the "
        f"types cannot see, pass check_vma=False (and check=True to verify it at run time)."
    )


def _typed_outputs(paths, leaves, specs, ctx: _Context, name: str) -> list:
    """Typed outputs: none may vary over an axis its out spec omits (an error, no
    communication); one that is invariant over an axis its spec names is lifted there
    (its cotangent varies over it and is summed: pvary's transpose)."""
    types, bad, out = ctx.types, [], list(leaves)
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
        if not isinstance(leaf, torch.Tensor):
            continue
        have = _vma.vma(leaf, types)
        named = set(spec.axes) & set(ctx.axes)
        stray = sorted(have & (set(ctx.axes) - named), key=ctx.axes.index)
        if stray:
            bad.append((_tree.keystr(path), spec, stray))
        elif named - have:
            out[i] = _vma.lift(leaf, named, types)
    if bad:
        raise _vma_error(name, bad)
    return out


def _finish_outputs(mesh, out, out_specs, check, name, ctx: _Context):
    paths, leaves, treedef = _tree.flatten_with_paths(out)
    specs = _tree.broadcast_prefix(out_specs, out, what="out_specs", is_prefix_leaf=is_spec)
    specs = [as_spec(spec, f"{name}: out_specs for output {_tree.keystr(path)}") for path, spec in zip(paths, specs)]
    if ctx.types is not None:
        leaves = _typed_outputs(paths, leaves, specs, ctx, name)
    by_group: dict[tuple[str, ...], list[int]] = {}
    split: dict[int, PartitionSpec] = {}
    for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
        where = f"{name}: out_specs for output {_tree.keystr(path)}"
        ctx.check_spec(spec, where)
        if not isinstance(leaf, torch.Tensor):
            continue
        check_tensor(leaf, mesh, f"{name}: output {_tree.keystr(path)}")
        validate_spec(spec, tuple(leaf.shape), mesh.shape, where)
        omitted = _omitted(ctx.axes, spec)
        if omitted:
            by_group.setdefault(omitted, []).append(i)
        if ctx.split and spec.axes:
            split[i] = spec
    leaves = list(leaves)
    for omitted, idx in by_group.items():
        group = mesh.group(omitted)
        if check and group.size > 1:
            where = [f"output{_tree.keystr(paths[i])}" for i in idx]
            checked = _CheckReplicated.apply(group, where, *[leaves[i] for i in idx])
            for i, y in zip(idx, checked):
                leaves[i] = y
        for i in idx:
            if ctx.types is None and (leaves[i].is_floating_point() or leaves[i].is_complex()):
                leaves[i] = _OutputBoundary.apply(leaves[i], group.size)
    for i, spec in split.items():  # back to whole over the axes that are auto outside
        outer = _vma.vma(leaves[i], ctx.types) if ctx.outer_types is not None else frozenset()
        leaves[i] = _Gather.apply(leaves[i], mesh, spec)
        if ctx.outer_types is not None:
            _vma.tag(leaves[i], outer & ctx.outer_types.axes, ctx.outer_types)
    if ctx.types is not None and ctx.outer_types is None:  # this call's scope ends here
        for leaf in leaves:
            _vma.untag(leaf, ctx.types)
    return _tree.unflatten(treedef, leaves)


def shard_map(f: Callable, mesh, in_specs, out_specs, *, check_vma: bool = True, check: bool = False,
              axis_names=None) -> Callable:
    """Map `f` over local blocks: inside, every tensor is this rank's block.

    Args:
      f: a function of local blocks; it may call the named-axis collectives.
      mesh: the mesh whose axis names the specs and collectives use.
      in_specs: a pytree prefix of the positional arguments: `sf.P(...)` (or None = `P()`)
        per argument subtree. An axis absent from a spec means "replicated over that axis".
      out_specs: likewise for the outputs. An axis absent from an out spec promises the
        output is the same on every rank along it.
      check_vma: track, for every value inside `f`, the manual axes it varies over (JAX's
        check_vma; [Note: varying axes]). An output that varies over an axis its out spec
        omits is then an error, found without communication, and the transposes follow the
        types: a psum costs nothing in the backward, and a cotangent is summed only where
        an invariant value fed varying work ([Note: typed transposes]). False: the
        boundary rule instead ([Note: the psum transpose rule]): correct, but an
        all-reduce per replicated input in the backward, and no static check.
      check: also verify the promise at run time (a debug check: one small all-reduce per
        call, [Note: the replication check]), and, once per argument structure, that every
        rank passed the same tree of blocks. Catches what the types cannot see (values
        built from `axis_index`).
      axis_names: the axes `f` is manual over (default: all). Over the others the code
        inside stays as the code around it: specs and collectives may name only these
        axes. Nested in another shard_map or in `sf.shard`'s `loss_fn` (over axes that are
        auto there), the shard_map splits its inputs and gathers its outputs over them
        itself ([Note: partial-manual shard_map]).

    Returns:
      A function of the same arguments. Called on a rank (inside `mesh.run`, under
      torchrun, or inside another transform) it takes and returns local blocks. Called from
      the main thread with a simulated mesh, it takes global tensors, scatters them, runs all
      ranks and returns global outputs; that mode supports `.backward()`.

    Example:
      >>> import shardfn as sf, torch
      >>> mesh = sf.local_mesh({"data": 2})
      >>> f = sf.shard_map(lambda x: sf.psum((x * x).sum(), "data"), mesh, sf.P("data"), sf.P())
      >>> f(torch.arange(4.0))
      tensor(14.)
    """
    name = f"shard_map({getattr(f, '__name__', 'f')})"
    agreed: set = set()  # (rank, structure) pairs already checked across ranks

    def mapped(*args):
        if mesh.kind == "simulated" and not mesh.in_rank():
            return global_call(lambda *a: _local_call(f, mesh, in_specs, out_specs, check, a, name,
                                                      axis_names=axis_names, check_vma=check_vma),
                               mesh, in_specs, out_specs, args, name)
        return _local_call(f, mesh, in_specs, out_specs, check, args, name, agreed if check else None, axis_names,
                           check_vma)

    mapped.__wrapped__ = f
    return mapped
