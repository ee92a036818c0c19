"""A reference evaluator for shard_map programs: one thread, no process groups.

`shmap_reference(f, mesh_shape, in_specs, out_specs)` is JAX's `shmap_reference` idea
for shardfn: it evaluates the program `f` on global tensors as a plain Python loop over
the mesh's ranks, with the collectives replaced by reference implementations that see
every rank's value at once and are written with ordinary differentiable torch ops
(`stack().sum()`, `cat`, `narrow`, `amax`). Because it is just torch ops in one thread,
`torch.autograd`, `torch.func.grad / vjp / jvp / vmap` apply to the reference directly,
and what they return is the derivative of the *global* function the program denotes.

[Note: writing programs for both evaluators] A program calls the collectives through
the namespace `C` of this module (`C.psum(x, "data")`, `C.all_gather(...)`, ...). Inside
`shmap_reference`, `C` runs the reference collectives; anywhere else it forwards to
`shardfn` itself, so the very same `f` runs under `sf.shard_map(f, mesh, ...)`.

[Note: evaluation by replay] Ranks cannot run in lock-step in one thread, so the
reference replays: it runs `f` on rank 0, 1, ..., N-1 until each reaches its first
collective (recording that collective's input and abandoning the run), combines the N
inputs into N outputs, and starts over; on the next pass the first collective returns
its stored output and the second one stops the run, and so on until every rank returns.
A program with k collectives runs k + 1 times per rank, which is nothing for test-sized
programs. The stored outputs are torch expressions of the earlier passes' inputs, so the
final outputs are differentiable functions of the global inputs. `f` must be
deterministic and may not wrap the collectives in its own torch.func transforms (apply
them around the reference instead).

Layout rules follow shardfn's contract: ranks are row-major over the mesh axes, a spec
entry naming a tuple of axes splits a dim over their product (first axis major), blocks
follow `torch.chunk` (trailing blocks shorter or empty), an axis absent from an out spec
means "replicated": the global value is the block of the ranks at coordinate 0 on that
axis (with `check=True` every other copy must agree), and a collective over a tuple of
axes orders ranks row-major over the axes *as given*.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Callable

import optree
import torch

from .._backend.base import coords_rank, rank_coords
from ._blocks import (
    ReferenceCheckError,
    _shape,
    join_blocks,
    join_tree,
    local_blocks,
    split_blocks,
    split_tree,
)

__all__ = [
    "C",
    "shmap_reference",
    "split_blocks",
    "join_blocks",
    "split_tree",
    "join_tree",
    "local_blocks",
    "rank_coords",
    "ReferenceCheckError",
]


def _axes(axis, mesh_shape, op: str) -> tuple[str, ...]:
    if axis is None:  # every axis, as shardfn's collectives read it (Mesh.axes)
        return tuple(mesh_shape)
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    unknown = [a for a in names if a not in mesh_shape]
    if unknown or not names or len(set(names)) != len(names):
        raise ReferenceCheckError(f"reference {op}: bad axis {axis!r} for mesh axes {list(mesh_shape)}")
    return names


def _members(rank: int, axes: tuple[str, ...], mesh_shape) -> list[int]:
    """The ranks of `rank`'s group over `axes`, row-major over `axes` as given."""
    base = rank_coords(rank, mesh_shape)
    out = []
    for varying in itertools.product(*(range(mesh_shape[a]) for a in axes)):
        out.append(coords_rank({**base, **dict(zip(axes, varying))}, mesh_shape))
    return out


def _groups(axes: tuple[str, ...], mesh_shape) -> list[list[int]]:
    seen, groups = set(), []
    for rank in range(math.prod(mesh_shape.values())):
        members = _members(rank, axes, mesh_shape)
        if members[0] not in seen:
            seen.update(members)
            groups.append(members)
    return groups


# -- replay machinery: see [Note: evaluation by replay] --------------------------------

_tls = threading.local()


class _Stop(BaseException):
    """Abandons one rank's pass at the first collective not yet evaluated."""


class _Replay:
    def __init__(self, mesh_shape: dict[str, int]):
        self.mesh_shape = mesh_shape
        self.size = math.prod(mesh_shape.values())
        self.stages: list[tuple[tuple, list]] = []  # (key, per-rank outputs)
        self.pending: dict[int, tuple[tuple, Any, Callable]] = {}
        self.rank = 0
        self.counter = 0

    def collective(self, key: tuple, payload, combine: Callable[[list], list]):
        i = self.counter
        self.counter += 1
        if i < len(self.stages):
            return self.stages[i][1][self.rank]
        self.pending[self.rank] = (key, payload, combine)
        raise _Stop

    def evaluate(self, f: Callable, per_rank_args: list[tuple], max_stages: int = 10_000) -> list:
        prev = getattr(_tls, "replay", None)
        _tls.replay = self
        try:
            while True:
                self.pending = {}
                results: dict[int, Any] = {}
                for rank in range(self.size):
                    self.rank, self.counter = rank, 0
                    try:
                        results[rank] = f(*per_rank_args[rank])
                    except _Stop:
                        pass
                if len(results) == self.size:
                    return [results[r] for r in range(self.size)]
                stage = len(self.stages)
                if results:
                    raise ReferenceCheckError(
                        f"ranks {sorted(results)} returned while ranks {sorted(self.pending)} called "
                        f"{self.pending[min(self.pending)][0]} as collective #{stage}"
                    )
                keys = {r: p[0] for r, p in self.pending.items()}
                if len(set(keys.values())) != 1:
                    text = "; ".join(f"rank {r}: {k}" for r, k in sorted(keys.items()))
                    raise ReferenceCheckError(f"the ranks disagree on collective #{stage}: {text}")
                combine = self.pending[0][2]
                outs = combine([self.pending[r][1] for r in range(self.size)])
                self.stages.append((keys[0], outs))
                if len(self.stages) > max_stages:
                    raise ReferenceCheckError(f"more than {max_stages} collectives: is the program a loop?")
        finally:
            _tls.replay = prev


def _active() -> _Replay | None:
    return getattr(_tls, "replay", None)


# -- reference collectives ---------------------------------------------------------------


def _same_shapes(op: str, group: list[int], xs: list) -> None:
    shapes = {tuple(xs[m].shape) for m in group}
    if len(shapes) != 1:
        raise ReferenceCheckError(f"reference {op}: ranks {group} pass different shapes "
                             f"{[tuple(xs[m].shape) for m in group]}")


def _by_group(replay: _Replay, axes, op: str, xs: list, per_group: Callable[[list[int], list], list]) -> list:
    """Run `per_group(members, xs)` (-> one output per member) for every group over `axes`."""
    outs: list = [None] * replay.size
    for members in _groups(axes, replay.mesh_shape):
        for m, y in zip(members, per_group(members, xs)):
            outs[m] = y
    return outs


def _norm_dim(d: int, ndim: int, op: str) -> int:
    if not -ndim <= d < ndim:
        raise ReferenceCheckError(f"reference {op}: dim {d} out of range for rank {ndim}")
    return d % ndim


def _ref_psum(x, axis, mean: bool = False):
    op = "pmean" if mean else "psum"
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, op)
    k = math.prod(replay.mesh_shape[a] for a in axes)

    def combine(payloads: list) -> list:
        flat = [optree.tree_flatten(p, namespace="shardfn") for p in payloads]
        treedef = flat[0][1]
        n_leaves = len(flat[0][0])
        outs_by_leaf = []
        for j in range(n_leaves):
            xs = [leaves[j] for leaves, _ in flat]
            if not isinstance(xs[0], torch.Tensor):
                outs_by_leaf.append([x if mean else x * k for x in xs])
                continue

            def per_group(members, xs=xs):
                _same_shapes(op, members, xs)
                total = torch.stack([xs[m] for m in members]).sum(0)
                total = total / k if mean else total
                return [total] * len(members)

            outs_by_leaf.append(_by_group(replay, axes, op, xs, per_group))
        return [optree.tree_unflatten(treedef, [outs_by_leaf[j][r] for j in range(n_leaves)])
                for r in range(replay.size)]

    return replay.collective((op, axes), x, combine)


def _ref_extremum(x, axis, op: str):
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, op)

    def combine(xs):
        def per_group(members, xs=xs):
            _same_shapes(op, members, xs)
            stacked = torch.stack([xs[m] for m in members])
            y = stacked.amax(0) if op == "pmax" else stacked.amin(0)
            return [y] * len(members)

        return _by_group(replay, axes, op, xs, per_group)

    return replay.collective((op, axes), x, combine)


def _ref_all_gather(x, axis, dim=0, tiled=True):
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, "all_gather")
    d = _norm_dim(dim, x.dim() + (0 if tiled else 1), "all_gather")

    def combine(xs):
        def per_group(members, xs=xs):
            _same_shapes("all_gather", members, xs)
            parts = [xs[m] for m in members]
            y = torch.cat(parts, d) if tiled else torch.stack(parts, d)
            return [y] * len(members)

        return _by_group(replay, axes, "all_gather", xs, per_group)

    return replay.collective(("all_gather", axes, d, tiled), x, combine)


def _ref_psum_scatter(x, axis, dim=0, tiled=True):
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, "psum_scatter")
    d = _norm_dim(dim, x.dim(), "psum_scatter")

    def combine(xs):
        def per_group(members, xs=xs):
            _same_shapes("psum_scatter", members, xs)
            k = len(members)
            total = torch.stack([xs[m] for m in members]).sum(0)
            n = total.shape[d]
            if tiled:
                if n % k:
                    raise ReferenceCheckError(f"reference psum_scatter: dim {d} of size {n} does not divide by {k}")
                return [total.narrow(d, i * (n // k), n // k) for i in range(k)]
            if n != k:
                raise ReferenceCheckError(f"reference psum_scatter(tiled=False): dim {d} of size {n} != {k}")
            return [total.select(d, i) for i in range(k)]

        return _by_group(replay, axes, "psum_scatter", xs, per_group)

    return replay.collective(("psum_scatter", axes, d, tiled), x, combine)


def _ref_ppermute(x, axis, perm):
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, "ppermute")
    pairs = tuple((int(s), int(t)) for s, t in perm)
    k = math.prod(replay.mesh_shape[a] for a in axes)
    srcs, dsts = [s for s, _ in pairs], [t for _, t in pairs]
    if (len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts)
            or not all(0 <= i < k for i in srcs + dsts)):
        raise ReferenceCheckError(f"reference ppermute: {pairs} is not a permutation of 0..{k - 1}")
    src_of = {t: s for s, t in pairs}

    def combine(xs):
        def per_group(members, xs=xs):
            _same_shapes("ppermute", members, xs)
            return [xs[members[src_of[i]]] if i in src_of else torch.zeros_like(xs[m])
                    for i, m in enumerate(members)]

        return _by_group(replay, axes, "ppermute", xs, per_group)

    return replay.collective(("ppermute", axes, pairs), x, combine)


def _ref_all_to_all(x, axis, split_dim, concat_dim, tiled=True):
    replay = _active()
    axes = _axes(axis, replay.mesh_shape, "all_to_all")
    s = _norm_dim(split_dim, x.dim(), "all_to_all")
    c = _norm_dim(concat_dim, x.dim(), "all_to_all")

    def combine(xs):
        def per_group(members, xs=xs):
            _same_shapes("all_to_all", members, xs)
            k = len(members)
            n = xs[members[0]].shape[s]
            if tiled:
                if n % k:
                    raise ReferenceCheckError(f"reference all_to_all: split dim {s} of size {n} does not divide by {k}")
                b = n // k
                return [torch.cat([xs[m].narrow(s, i * b, b) for m in members], c) for i in range(k)]
            if n != k:
                raise ReferenceCheckError(f"reference all_to_all(tiled=False): split dim {s} of size {n} != {k}")
            return [torch.stack([xs[m].select(s, i) for m in members], c) for i in range(k)]

        return _by_group(replay, axes, "all_to_all", xs, per_group)

    return replay.collective(("all_to_all", axes, s, c, tiled), x, combine)


class _Collectives:
    """The collectives a test program calls; see [Note: writing programs for both evaluators].

    Inside `shmap_reference` they are the reference implementations; elsewhere they are
    shardfn's own (`shardfn.psum`, ...), so one program runs under both.
    """

    @staticmethod
    def psum(x, axis):
        return _ref_psum(x, axis) if _active() else _sf().psum(x, axis)

    @staticmethod
    def pmean(x, axis):
        return _ref_psum(x, axis, mean=True) if _active() else _sf().pmean(x, axis)

    @staticmethod
    def pmax(x, axis):
        return _ref_extremum(x, axis, "pmax") if _active() else _sf().pmax(x, axis)

    @staticmethod
    def pmin(x, axis):
        return _ref_extremum(x, axis, "pmin") if _active() else _sf().pmin(x, axis)

    @staticmethod
    def all_gather(x, axis, dim=0, tiled=True):
        return _ref_all_gather(x, axis, dim, tiled) if _active() else _sf().all_gather(x, axis, dim, tiled)

    @staticmethod
    def psum_scatter(x, axis, dim=0, tiled=True):
        if _active():
            return _ref_psum_scatter(x, axis, dim, tiled)
        return _sf().psum_scatter(x, axis, dim, tiled)

    @staticmethod
    def ppermute(x, axis, perm):
        return _ref_ppermute(x, axis, perm) if _active() else _sf().ppermute(x, axis, perm)

    @staticmethod
    def all_to_all(x, axis, split_dim, concat_dim, tiled=True):
        if _active():
            return _ref_all_to_all(x, axis, split_dim, concat_dim, tiled)
        return _sf().all_to_all(x, axis, split_dim, concat_dim, tiled)

    @staticmethod
    def axis_index(axis) -> int:
        replay = _active()
        if replay is None:
            return _sf().axis_index(axis)
        axes = _axes(axis, replay.mesh_shape, "axis_index")
        return _members(replay.rank, axes, replay.mesh_shape).index(replay.rank)

    @staticmethod
    def axis_size(axis) -> int:
        replay = _active()
        if replay is None:
            return _sf().axis_size(axis)
        return math.prod(replay.mesh_shape[a] for a in _axes(axis, replay.mesh_shape, "axis_size"))


def _sf():
    import shardfn

    return shardfn


C = _Collectives()


# -- the reference shard_map ---------------------------------------------------------------


def shmap_reference(f: Callable, mesh_shape, in_specs, out_specs, *, check: bool = True,
                    rtol: float = 1e-6, atol: float = 1e-6) -> Callable:
    """The global function that `sf.shard_map(f, mesh, in_specs, out_specs)` denotes.

    Args:
      f: a program of local blocks calling the collectives through `C`.
      mesh_shape: `{"data": 2, "model": 2}` (or a Mesh; only its shape is used).
      in_specs, out_specs: as for `sf.shard_map` (pytree prefixes; None means `P()`).
      check: verify that outputs are replicated along the axes their out spec omits.

    Returns:
      A function of global tensors returning global tensors, differentiable with
      `torch.autograd` and every `torch.func` transform.

    Example:
      >>> import torch, shardfn as sf
      >>> from shardfn.testing._reference import C, shmap_reference
      >>> g = shmap_reference(lambda x: C.psum(x, "data"), {"data": 2}, sf.P("data"), sf.P())
      >>> g(torch.tensor([1.0, 2.0]))
      tensor([3.])
    """
    shape = _shape(mesh_shape)

    def reference(*args):
        per_rank = split_tree(args, in_specs, shape)
        outs = _Replay(shape).evaluate(f, per_rank)
        return join_tree(outs, out_specs, shape, check=check, rtol=rtol, atol=atol)

    reference.__wrapped__ = f
    return reference
