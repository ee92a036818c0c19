"""Every typed transpose, deterministically: op x check_vma x mesh, gradients against the
global function written out in plain torch.

`tests/shard_map/test_vma.py` draws its programs at random; a psum under check_vma over an axis of
more than one rank came up in about one example in twenty, and a wrong psum transpose
slipped through. Here every collective whose transpose depends on the varying-axis types
([Note: typed transposes] in shardfn/_vma.py) runs under both rules (check_vma True: the
types; False: the boundary rule, [Note: the psum transpose rule]) on meshes of 1, 2 and 4
ranks and on a 2 x 2 mesh where the operand is invariant over the collective's axis (so
the types lift it) or the collective names a tuple of axes. Each program mixes an
invariant weight into varying work before the collective and after it, so pvary (the
lift, whose transpose is the psum) sits on both sides.

The reference is independent of shardfn: the global function evaluated in one thread by
a loop over the ranks, each collective written as a list operation over the group's
blocks (sum, cat, chunk), so `torch.func.vjp` of it is the derivative of the function the
program denotes. Gradients are compared in fp64 at 1e-12, per rank (each rank's `vjp` of
the local program) and from the main thread (global values in, autograd backward).
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

import shardfn as sf

P = sf.P
F64 = torch.float64
TOL = 1e-12

# -- the programs ----------------------------------------------------------------------------
# Every program is pre -> one collective -> post on the rank's blocks: x varies over the axes
# of its spec, w (a (c,) weight, spec P()) is invariant everywhere.


def _pre(x, w):
    return torch.tanh(x) * w  # invariant w meets varying x: the types lift w (pvary)


def _post(y, x, w):
    return y + 0.5 * y * y * w.sum()  # and again after the collective


def _post_vary(y, x, w):
    return y * x.sum() + w.sum()  # a gathered (invariant) value times a varying one: lifted by psum_scatter


# op -> (shardfn collective on the local block, reference on the group's blocks (hs, my position p),
#        which post, whether the result is invariant over the op's axes)
def _ring(k):
    return [(i, (i + 1) % k) for i in range(k)]


OPS = {
    "psum": (lambda h, a, k: sf.psum(h, a), lambda hs, p: sum(hs), _post, True),
    "pmean": (lambda h, a, k: sf.pmean(h, a), lambda hs, p: sum(hs) / len(hs), _post, True),
    "pmax": (lambda h, a, k: sf.pmax(h, a), lambda hs, p: torch.stack(hs).amax(0), _post, True),
    "pmin": (lambda h, a, k: sf.pmin(h, a), lambda hs, p: torch.stack(hs).amin(0), _post, True),
    "all_gather": (lambda h, a, k: sf.all_gather(h, a, dim=0), lambda hs, p: torch.cat(hs, 0), _post, True),
    "all_gather->varying": (lambda h, a, k: sf.all_gather(h, a, dim=0), lambda hs, p: torch.cat(hs, 0),
                            _post_vary, True),
    "psum_scatter": (lambda h, a, k: sf.psum_scatter(h, a, dim=0),
                     lambda hs, p: sum(hs).chunk(len(hs), 0)[p], _post, False),
    "ppermute": (lambda h, a, k: sf.ppermute(h, a, _ring(k)), lambda hs, p: hs[(p - 1) % len(hs)], _post, False),
    "all_to_all": (lambda h, a, k: sf.all_to_all(h, a, 0, 1),
                   lambda hs, p: torch.cat([h.chunk(len(hs), 0)[p] for h in hs], 1), _post, False),
    "pvary": (lambda h, a, k: sf.pvary(h, a), lambda hs, p: hs[p], _post, False),
}

# name -> (mesh shape, x's spec axes on dim 0, the collective's axes)
MESHES = {
    "i1": ({"i": 1}, ("i",), ("i",)),
    "i2": ({"i": 2}, ("i",), ("i",)),
    "i4": ({"i": 4}, ("i",), ("i",)),
    "i2j2-x_over_j": ({"i": 2, "j": 2}, ("j",), ("i",)),  # the operand is invariant over 'i': lifted, summed twice
    "i2j2-over_ji": ({"i": 2, "j": 2}, ("j", "i"), ("j", "i")),  # a tuple of axes, minor-major
}


# -- the reference: one thread, a loop over the ranks ------------------------------------------


class _Layout:
    """Ranks, blocks and groups of a mesh shape, row-major (shardfn's contract)."""

    def __init__(self, shape: dict[str, int]):
        self.shape = dict(shape)
        self.coords = [dict(zip(shape, c)) for c in itertools.product(*(range(n) for n in shape.values()))]

    def index(self, coords, axes) -> int:
        i = 0
        for a in axes:
            i = i * self.shape[a] + coords[a]
        return i

    def count(self, axes) -> int:
        return math.prod(self.shape[a] for a in axes)

    def split(self, x, axes) -> list:
        blocks = x.chunk(self.count(axes), 0) if axes else [x]
        return [blocks[self.index(c, axes)] for c in self.coords]

    def join(self, blocks, axes):
        """The global value of per-rank blocks under a dim-0 spec over `axes` (the block of
        the rank at coordinate 0 of every other axis)."""
        picked = []
        for idx in range(self.count(axes)):
            for r, c in enumerate(self.coords):
                if self.index(c, axes) == idx and all(c[a] == 0 for a in self.shape if a not in axes):
                    picked.append(blocks[r])
                    break
        return torch.cat(picked, 0)

    def group(self, r, axes) -> list[int]:
        """The ranks of r's group over `axes`, row-major over `axes` as given."""
        base = self.coords[r]
        out = []
        for vals in itertools.product(*(range(self.shape[a]) for a in axes)):
            want = {**base, **dict(zip(axes, vals))}
            out.append(self.coords.index(want))
        return out


def _reference(op, shape, x_axes, op_axes, out_axes):
    _, combine, post, _ = OPS[op]
    lay = _Layout(shape)

    def f(x, w):
        xs = lay.split(x, x_axes)
        hs = [_pre(xb, w) for xb in xs]
        ys = []
        for r in range(len(lay.coords)):
            members = lay.group(r, op_axes)
            ys.append(combine([hs[m] for m in members], members.index(r)))
        zs = [post(y, xb, w) for y, xb in zip(ys, xs)]
        return lay.join(zs, out_axes)

    return f


def _out_axes(op, shape, x_axes, op_axes, named):
    """The out spec's axes: exactly what the result varies over, or (`named`) every axis."""
    reduces = OPS[op][3]
    varying = set(x_axes) - set(op_axes) if reduces else set(x_axes) | set(op_axes)
    if OPS[op][2] is _post_vary:
        varying |= set(x_axes)  # times x.sum(): x's axes again
    return tuple(a for a in shape if named or a in varying)


def _cases():
    for op in OPS:
        for mesh_id, (shape, x_axes, op_axes) in MESHES.items():
            minimal = _out_axes(op, shape, x_axes, op_axes, False)
            for named in (False, True):
                if named and minimal == tuple(shape):
                    continue  # the same spec
                for check_vma in (True, False):
                    yield pytest.param(op, mesh_id, named, check_vma,
                                       id=f"{op}-{mesh_id}-{'named' if named else 'minimal'}-vma{check_vma}")


_MESH_CACHE: dict = {}


def _mesh(shape):
    key = tuple(shape.items())
    if key not in _MESH_CACHE:
        _MESH_CACHE[key] = sf.local_mesh(dict(shape))
    return _MESH_CACHE[key]


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("op, mesh_id, named, check_vma", list(_cases()))
def test_typed_transposes_equal_the_global_gradient(op, mesh_id, named, check_vma):
    shape, x_axes, op_axes = MESHES[mesh_id]
    local_op = OPS[op][0]
    post = OPS[op][2]
    k = math.prod(shape[a] for a in op_axes)
    out_axes = _out_axes(op, shape, x_axes, op_axes, named)
    lay = _Layout(shape)
    mesh = _mesh(shape)

    b, c = 2 * k, 3  # x's block: (b, c), rows divisible by k for psum_scatter / all_to_all
    gen = torch.Generator().manual_seed(zlib.crc32(f"{op}-{mesh_id}".encode()))
    x = torch.randn(b * lay.count(x_axes), c, generator=gen, dtype=F64)
    w = torch.randn(c, generator=gen, dtype=F64)
    axis = op_axes[0] if len(op_axes) == 1 else op_axes

    def program(xb, wb):
        return post(local_op(_pre(xb, wb), axis, k), xb, wb)

    reference = _reference(op, shape, x_axes, op_axes, out_axes)
    want, pullback = torch.func.vjp(reference, x, w)
    ct = torch.randn(want.shape, generator=gen, dtype=F64)
    want_gx, want_gw = pullback(ct)
    assert float(want_gw.abs().max()) > 0 and float(want_gx.abs().max()) > 0

    in_specs = (P(x_axes if len(x_axes) > 1 else x_axes[0]), P())
    out_spec = P(out_axes if len(out_axes) > 1 else out_axes[0]) if out_axes else P()
    f = sf.shard_map(program, mesh, in_specs, out_spec, check_vma=check_vma)

    # per rank: torch.func.vjp of the local program on this rank's blocks
    ct_blocks, x_blocks = lay.split(ct, out_axes), lay.split(x, x_axes)

    def on_rank():
        r = mesh.rank
        out, pull = torch.func.vjp(f, x_blocks[r], w)
        gx, gw = pull(ct_blocks[r])
        return out, gx, gw

    results = mesh.run(on_rank)
    assert _maxdiff(lay.join([o for o, _, _ in results], out_axes), want) <= TOL
    # x's gradient: the blocks over x's axes; every copy of a block (ranks that differ only
    # on other axes) must hold it, so compare each rank's with the reference's block
    for r, (_, gx, gw) in enumerate(results):
        assert _maxdiff(gx, lay.split(want_gx, x_axes)[r]) <= TOL, f"rank {r}: x's gradient"
        assert _maxdiff(gw, want_gw) <= TOL, f"rank {r}: the replicated weight's gradient"

    # the main thread: global values in, autograd backward
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = f(xs, ws)
    assert _maxdiff(got, want) <= TOL
    got.backward(ct)
    assert _maxdiff(xs.grad, want_gx) <= TOL
    assert _maxdiff(ws.grad, want_gw) <= TOL


def test_the_grid_covers_every_typed_collective():
    """The collectives whose transposes the types decide, all in the grid, each over an
    axis of more than one rank under both rules."""
    typed = {"psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "all_to_all", "pvary"}
    assert typed <= {op.split("->")[0] for op in OPS}
    covered = {(p.values[0], p.values[3]) for p in _cases()
               if math.prod(MESHES[p.values[1]][0][a] for a in MESHES[p.values[1]][2]) > 1}
    assert {(op, v) for op in OPS for v in (True, False)} <= covered
