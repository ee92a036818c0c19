"""Shared cases and runners for the collective tests on both backends.

A case is a `CollectiveCase` (shardfn.testing.strategies): a tiny shard_map program around
one collective. `rank_body` runs it on one rank in local mode (values, VJP and JVP of
this rank's block) and works unchanged under `mesh.run` and under real processes
(`run_on_mesh(..., backend="distributed")`); `reference` evaluates the same program with
`shmap_reference`; `unsharded` is the same global function written by hand without any
mesh, for the parametrized cases below.
"""

from __future__ import annotations

import functools
import math

import torch

import shardfn as sf
from shardfn.testing._reference import C, join_blocks, shmap_reference, split_blocks
from shardfn.testing.strategies import CollectiveCase, make_case

P = sf.P
DTYPE = torch.float64
TOL = dict(rtol=1e-10, atol=1e-12)
TIGHT = dict(rtol=1e-11, atol=1e-12)


@functools.lru_cache(maxsize=None)
def _mesh(items: tuple) -> sf.Mesh:
    return sf.local_mesh(dict(items))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen, dtype=DTYPE)


def mesh_for(shape) -> sf.Mesh:
    """A simulated mesh of `shape`, built once per session (group creation is a rendezvous)."""
    return _mesh(tuple(dict(shape).items()))


def inputs(case: CollectiveCase, seed: int = 0):
    """Global (x, output cotangent, input tangent) for `case`, float64, deterministic."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.global_shape, generator=gen, dtype=DTYPE)
    out = reference(case)(x)
    ct = torch.randn(out.shape, generator=gen, dtype=DTYPE)
    tangent = torch.randn(case.global_shape, generator=gen, dtype=DTYPE)
    return x, ct, tangent


def rank_body(case: CollectiveCase, mesh, x, ct, tangent):
    """On one rank: (output block, input-cotangent block, output-tangent block)."""
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    rank = mesh.rank
    x_block = split_blocks(x, case.in_spec, mesh.shape)[rank].contiguous()
    t_block = split_blocks(tangent, case.in_spec, mesh.shape)[rank].contiguous()
    out, vjp = torch.func.vjp(f, x_block)
    ct_block = split_blocks(ct, case.out_spec, mesh.shape)[rank].contiguous()
    (grad,) = vjp(ct_block)
    _, tan = torch.func.jvp(f, (x_block,), (t_block,))
    return out.detach(), grad.detach(), tan.detach()


def join_results(case: CollectiveCase, mesh_shape, per_rank):
    """Global (output, input gradient, output tangent) from the per-rank triples."""
    outs, grads, tans = zip(*per_rank)
    return (
        join_blocks(outs, case.out_spec, mesh_shape, rtol=1e-9, atol=1e-12),
        join_blocks(grads, case.in_spec, mesh_shape, rtol=1e-9, atol=1e-12),
        join_blocks(tans, case.out_spec, mesh_shape, rtol=1e-9, atol=1e-12),
    )


def run_simulated(case: CollectiveCase, x, ct, tangent):
    mesh = mesh_for(case.mesh_shape)
    return join_results(case, mesh.shape, mesh.run(rank_body, case, mesh, x, ct, tangent))


def reference(case: CollectiveCase):
    return shmap_reference(case.program(), case.mesh_shape, case.in_spec, case.out_spec)


def reference_results(case: CollectiveCase, x, ct, tangent):
    """(output, input gradient, output tangent) of the reference, by autograd and torch.func."""
    out, vjp = torch.func.vjp(reference(case), x)
    (grad,) = vjp(ct)
    _, tan = torch.func.jvp(reference(case), (x,), (tangent,))
    return out, grad, tan


def unsharded_results(fn, x, ct, tangent):
    """The same triple for a global function `fn` by plain autograd / torch.func."""
    out, vjp = torch.func.vjp(fn, x)
    (grad,) = vjp(ct)
    _, tan = torch.func.jvp(fn, (x,), (tangent,))
    return out, grad, tan


def assert_triples_close(got, want, what=""):
    for name, a, b in zip(("value", "gradient", "tangent"), got, want):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what} {name}: {m}")


# -- trees, and a Megatron-style tensor-parallel MLP ------------------------------------


def assert_trees_close(got, want, **tol):
    import optree

    g_leaves, g_def = optree.tree_flatten(got)
    w_leaves, w_def = optree.tree_flatten(want)
    assert g_def == w_def, f"structures differ: {g_def} vs {w_def}"
    for a, b in zip(g_leaves, w_leaves):
        torch.testing.assert_close(a, b, **(tol or TIGHT))


def mlp_params(seed, d=4, h=8):
    gen = _gen(seed)
    return {
        "w1": _randn(gen, d, h) / 2, "b1": _randn(gen, h) / 4,   # column-parallel
        "w2": _randn(gen, h, d) / 2, "b2": _randn(gen, d) / 4,   # row-parallel, bias after the psum
        "g": 1.0 + _randn(gen, d) / 10,                          # a gain replicated everywhere
    }


def mlp_single(params, x, target):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    y = (h @ params["w2"] + params["b2"]) * params["g"]
    return ((y - target) ** 2).mean()


def mlp_tp(data: bool):
    def loss(params, x, target):
        h = torch.tanh(x @ params["w1"] + params["b1"])  # (B, H / model)
        y = (C.psum(h @ params["w2"], "model") + params["b2"]) * params["g"]  # the one psum
        local = ((y - target) ** 2).mean()
        return C.pmean(local, "data") if data else local

    return loss


TP_PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(), "g": P()}
TP_MESHES = {"model2": {"model": 2}, "data2xmodel2": {"data": 2, "model": 2}}


def tp_setup(mesh_id, seed=20):
    shape = TP_MESHES[mesh_id]
    data = "data" in shape
    params = mlp_params(seed)
    gen = _gen(seed + 1)
    x, target = _randn(gen, 6, 4), _randn(gen, 6, 4)
    batch = P("data") if data else P()
    in_specs = (TP_PARAM_SPECS, batch, batch)
    return mesh_for(shape), mlp_tp(data), params, x, target, in_specs


# -- hand-written parametrized cases with their unsharded meaning --------------------------


def _post(z):
    return z + 0.5 * z * z


def _blocks(x, k):
    """(k, rows/k, ...): the k equal dim-0 blocks of x."""
    return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))


def _unsharded(case: CollectiveCase):
    """The global function of a hand-written case, without a mesh (dim-0 layouts only)."""
    op, kw = case.op, case.kwargs
    k = math.prod(case.mesh_shape[a] for a in case.axes)
    # Tuples of axes in a non-mesh order permute the blocks: logical index = row-major over
    # `axis` as given, while a P(('x','y')) layout is row-major over ('x','y').
    order = _logical_order(case)

    def fn(x):
        h = torch.tanh(x)
        if op in ("psum", "pmean"):
            y = _blocks(h, k).sum(0) / (k if op == "pmean" else 1)
        elif op in ("pmax", "pmin"):
            y = _blocks(h, k).amax(0) if op == "pmax" else _blocks(h, k).amin(0)
        elif op == "all_gather":
            blocks = _blocks(h, k)[order]
            y = blocks.reshape(h.shape) if kw["tiled"] else blocks
        elif op == "psum_scatter":  # in P(axes) out P(axes): global out = sum of the blocks
            y = _blocks(h, k).sum(0)
            # rank at logical index i keeps block i of the sum; the out layout follows mesh order
            if not kw["tiled"]:  # out P(axes) on the unit dim: the k rows stack up there
                return _post(y[_inverse(order)])
            y = _blocks(y, k)[_inverse(order)].reshape(y.shape)
        elif op == "ppermute":
            src_of = {d: s for s, d in kw["perm"]}
            blocks = _blocks(h, k)
            logical = blocks[order]  # logical index -> block
            moved = torch.stack([logical[src_of[i]] if i in src_of else torch.zeros_like(logical[0])
                                 for i in range(k)])
            y = moved[_inverse(order)].reshape(h.shape)
        elif op == "all_to_all" and kw["tiled"]:  # P(axes, None) -> P(None, axes): unchanged up to order
            r, c = h.shape[0] // k, h.shape[1] // k
            y = h.reshape(k, r, k, c)[order][:, :, _inverse(order)].reshape(h.shape)
        elif op == "all_to_all":  # untiled: rank i gets column i of every rank's (rows, k) block
            r = h.shape[0] // k
            y = h.reshape(k, r, k)[order][:, :, _inverse(order)]  # [j, r, p]
            return _post(y.permute(0, 2, 1).reshape(k, k * r).unsqueeze(0))
        else:  # pragma: no cover
            raise ValueError(op)
        return _post(y.unsqueeze(0))

    return fn


def _logical_order(case: CollectiveCase) -> list[int]:
    """For each logical index over `case.axes` (as given), the mesh-order block it holds."""
    axes = case.axes
    mesh_order = [a for a in case.mesh_shape if a in axes]
    sizes = case.mesh_shape
    out = []
    import itertools

    for combo in itertools.product(*(range(sizes[a]) for a in axes)):
        coords = dict(zip(axes, combo))
        idx = 0
        for a in mesh_order:
            idx = idx * sizes[a] + coords[a]
        out.append(idx)
    return out


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for logical, block in enumerate(order):
        inv[block] = logical
    return inv


def _spec_axes(axes):
    """The dim-0 layout over mesh-ordered axes (P('x') or P(('x', 'y')))."""
    return axes[0] if len(axes) == 1 else tuple(axes)


def _case(shape, op, axis, rows=2, cols=3, **kw):
    """A case of `op` over `axis` with dim-0 layouts; local blocks have `rows` (times the
    group size where the op splits that dim) x `cols` elements."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    mesh_order = _spec_axes([a for a in shape if a in axes])
    k = math.prod(shape[a] for a in axes)
    if op in ("psum", "pmean", "pmax", "pmin"):
        return make_case(shape, op, axis, P(mesh_order), P(), (k * rows, cols), **kw)
    if op == "all_gather":
        out = P() if kw.get("tiled", True) else P(None, None)
        return make_case(shape, op, axis, P(mesh_order), out, (k * rows, cols), dim=0, **kw)
    if op == "psum_scatter":
        tiled = kw.get("tiled", True)
        out = P(None, mesh_order) if tiled else P(mesh_order)
        return make_case(shape, op, axis, P(mesh_order), out, (k * k * (rows if tiled else 1), cols), dim=0, **kw)
    if op == "ppermute":
        return make_case(shape, op, axis, P(mesh_order), P(None, mesh_order), (k * rows, cols), **kw)
    if op == "all_to_all" and kw.get("tiled", True):
        return make_case(shape, op, axis, P(mesh_order, None), P(None, None, mesh_order), (rows * k, k * cols),
                         split_dim=1, concat_dim=0, **kw)
    if op == "all_to_all":  # local (rows, k) -> (k, rows)
        return make_case(shape, op, axis, P(mesh_order, None), P(None, None, mesh_order), (rows * k, k),
                         split_dim=1, concat_dim=0, **kw)
    raise ValueError(op)


def ring(k):
    return tuple((i, (i + 1) % k) for i in range(k))


MESHES = {"2": {"x": 2}, "3": {"x": 3}, "4": {"x": 4}, "2x2": {"x": 2, "y": 2}}
AXES = {"2": ["x"], "3": ["x"], "4": ["x"], "2x2": ["x", "y", ("x", "y"), ("y", "x")]}


def parametrized_cases(ops=("psum", "pmean", "pmax", "pmin", "all_gather", "all_gather_untiled",
                            "psum_scatter", "psum_scatter_untiled", "ppermute", "all_to_all",
                            "all_to_all_untiled"),
                       meshes=tuple(MESHES), axes=None, rows=2, cols=3):
    """(id, case) for every op x mesh x axis choice (`axes`: keep only these axis choices)."""
    out = []
    for mesh_id in meshes:
        shape = MESHES[mesh_id]
        for axis in AXES[mesh_id]:
            names = (axis,) if isinstance(axis, str) else axis
            k = math.prod(shape[a] for a in names)
            if axes is not None and axis not in axes:
                continue
            for op in ops:
                kw = {}
                base = op
                if op.startswith(("all_gather", "psum_scatter", "all_to_all")):
                    kw["tiled"] = True
                if op.endswith("_untiled"):
                    base, kw["tiled"] = op[: -len("_untiled")], False
                if base == "ppermute":
                    kw["perm"] = ring(k)
                case = _case(shape, base, axis, rows=rows, cols=cols, **kw)
                name = f"{op}-{mesh_id}-{'+'.join(names)}"
                out.append((name, case))
    return out


def unsharded(case: CollectiveCase):
    return _unsharded(case)
