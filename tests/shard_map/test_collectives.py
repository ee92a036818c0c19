"""Every collective: values, reverse and forward derivatives, vmap, gradcheck, double backward.

Three oracles per case (tests/collective_cases.py): the reference evaluator
(`shmap_reference`, one thread, no process groups), the same global function written by
hand without a mesh, and shardfn itself on a simulated mesh. Meshes 2, 3, 4 and 2x2,
axes named singly and as tuples in both orders.
"""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from collective_cases import (
    assert_triples_close,
    inputs,
    mesh_for,
    parametrized_cases,
    reference_results,
    unsharded,
    unsharded_results,
)
from shardfn.testing._reference import C, join_blocks, shmap_reference, split_blocks

torch.set_num_threads(1)
P = sf.P

CASES = parametrized_cases()


def _rank_values_and_grads(case, mesh, x, ct):
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    x_block = split_blocks(x, case.in_spec, mesh.shape)[mesh.rank].contiguous()
    out, vjp = torch.func.vjp(f, x_block)
    (grad,) = vjp(split_blocks(ct, case.out_spec, mesh.shape)[mesh.rank].contiguous())
    return out, grad


def _rank_tangents(case, mesh, x, tangent):
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    blocks = [split_blocks(t, case.in_spec, mesh.shape)[mesh.rank].contiguous() for t in (x, tangent)]
    return torch.func.jvp(f, (blocks[0],), (blocks[1],))[1]


@pytest.mark.parametrize("name,case", CASES, ids=[n for n, _ in CASES])
def test_values_and_gradients(name, case):
    x, ct, tangent = inputs(case)
    want = reference_results(case, x, ct, tangent)
    by_hand = unsharded_results(unsharded(case), x, ct, tangent)
    assert_triples_close(want, by_hand, f"{name}: reference vs unsharded")
    mesh = mesh_for(case.mesh_shape)
    outs, grads = zip(*mesh.run(_rank_values_and_grads, case, mesh, x, ct))
    got_out = join_blocks(outs, case.out_spec, mesh.shape, rtol=1e-9)
    got_grad = join_blocks(grads, case.in_spec, mesh.shape, rtol=1e-9)  # replicas must agree
    torch.testing.assert_close(got_out, want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,case", CASES, ids=[n for n, _ in CASES])
def test_forward_mode(name, case):
    x, ct, tangent = inputs(case)
    _, _, want = reference_results(case, x, ct, tangent)
    _, _, by_hand = unsharded_results(unsharded(case), x, ct, tangent)
    torch.testing.assert_close(want, by_hand, rtol=1e-10, atol=1e-12)
    mesh = mesh_for(case.mesh_shape)
    got = join_blocks(mesh.run(_rank_tangents, case, mesh, x, tangent), case.out_spec, mesh.shape)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_extremum_forward_mode_minimal(op):
    """Regression: _Pextremum.jvp once read ctx.saved_tensors, empty in forward mode."""
    mesh = mesh_for({"x": 2})
    f = sf.shard_map(lambda x: getattr(C, op)(x, "x"), mesh, P("x"), P())

    def body():
        x = torch.tensor([float(mesh.rank), 5.0])
        return torch.func.jvp(f, (x,), (torch.tensor([10.0 + mesh.rank, 1.0 + mesh.rank]),))[1]

    # max: column 0 from rank 1 (tangent 11), column 1 a tie (mean of 1 and 2)
    # min: column 0 from rank 0 (tangent 10), column 1 the same tie
    want = torch.tensor([11.0, 1.5]) if op == "pmax" else torch.tensor([10.0, 1.5])
    for got in mesh.run(body):
        torch.testing.assert_close(got, want)


# -- pmax / pmin: the gradient goes to the ranks holding the extremum, ties split evenly ----


@pytest.mark.parametrize("shape,axis,spec", [
    ({"x": 4}, "x", P("x")),
    ({"x": 2, "y": 2}, ("x", "y"), P(("x", "y"))),
    ({"x": 2, "y": 2}, ("y", "x"), P(("x", "y"))),
], ids=["4", "2x2-x+y", "2x2-y+x"])
@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_extremum_gradient_routing_splits_ties(shape, axis, spec, op):
    # two columns: column 0 has a two-way tie for the max, column 1 a three-way tie for the min
    x = torch.tensor([[1.0, 5.0], [3.0, 2.0], [3.0, 2.0], [2.0, 2.0]], dtype=torch.float64)
    mesh = mesh_for(shape)
    f = sf.shard_map(lambda b: getattr(C, op)(b, axis), mesh, spec, P())
    xs = x.clone().requires_grad_()
    ct = torch.tensor([[10.0, 100.0]], dtype=torch.float64)
    y = f(xs)
    (y * ct).sum().backward()
    want_y = x.amax(0, keepdim=True) if op == "pmax" else x.amin(0, keepdim=True)
    torch.testing.assert_close(y.detach(), want_y)
    xr = x.clone().requires_grad_()
    (shmap_reference(lambda b: getattr(C, op)(b, axis), shape, spec, P())(xr) * ct).sum().backward()
    if op == "pmax":
        want = torch.tensor([[0.0, 100.0], [5.0, 0.0], [5.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    else:
        want = torch.tensor([[10.0, 0.0], [0.0, 100 / 3], [0.0, 100 / 3], [0.0, 100 / 3]], dtype=torch.float64)
    torch.testing.assert_close(xs.grad, want)
    torch.testing.assert_close(xr.grad, want)


# -- gradcheck / gradgradcheck on the simulated mesh, every rank in lock-step --------------
#
# The checked function is global -> global on every rank: X -> gather(f(scatter(X))). All
# ranks hold the same X and perturb the same element at the same time, so the numerical
# Jacobian is the global one, and every rank issues the same collectives in the same
# order. (A function of the local block would not do: all ranks perturb together, so the
# numerical derivative would sum over ranks while the analytical one does not.)


def _global_fn(case, mesh):
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    return lambda X: sf.gather(f(sf.scatter(X, mesh, case.in_spec)), mesh, case.out_spec)


def _gradcheck_body(case, mesh, x, forward_ad, second_order):
    g = _global_fn(case, mesh)
    X = x.clone().requires_grad_()
    ok = torch.autograd.gradcheck(g, (X,), check_forward_ad=forward_ad, check_batched_grad=False)
    if second_order:
        # gradgradcheck restricted to the primal: the derivative of X -> J(X)^T gO. (The
        # part with respect to gO is not a global question: see docs/autodiff.md.)
        gO = torch.linspace(-1.0, 1.0, g(X).numel(), dtype=X.dtype).reshape(g(X).shape)
        vjp = lambda X: torch.autograd.grad(g(X), X, gO, create_graph=True)[0]  # noqa: E731
        ok = ok and torch.autograd.gradcheck(vjp, (X,), check_batched_grad=False)
    return ok


# The unmarked set shards the input over both axes; the slow set adds inputs replicated
# over an axis (2x2, axis 'y'), where second order goes through the input half's psum.
GRADCHECK = parametrized_cases(meshes=("2x2",), axes=(("y", "x"),), rows=1, cols=2)
GRADCHECK_SLOW = parametrized_cases(meshes=("3",), rows=1, cols=2) + parametrized_cases(
    meshes=("2x2",), axes=("y",), rows=1, cols=2)


def _gradcheck_params(cases, slow):
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(n, c, id=n, marks=marks) for n, c in cases]


@pytest.mark.parametrize("name,case", _gradcheck_params(GRADCHECK, False) + _gradcheck_params(GRADCHECK_SLOW, True))
def test_gradcheck_on_simulated_mesh(name, case):
    x, _, _ = inputs(case)
    mesh = mesh_for(case.mesh_shape)
    assert all(mesh.run(_gradcheck_body, case, mesh, x, True, True))


# -- vmap rules: vmap over a batch dim at several positions equals a Python loop ------------


VMAP_CASES = parametrized_cases(meshes=("2x2",), axes=(("y", "x"), "x"), rows=1, cols=2)
VMAP_SLOW = parametrized_cases(meshes=("3",), rows=1, cols=2)


def _vmap_over_body(case, mesh, xs, pos):
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    block = torch.stack([split_blocks(x, case.in_spec, mesh.shape)[mesh.rank] for x in xs.unbind(pos)], pos)
    batched = torch.func.vmap(f, in_dims=pos)(block)
    looped = torch.stack([f(b) for b in block.unbind(pos)])
    return batched, looped


def _shift(spec, pos, ndim):
    entries = list(spec) + [None] * (ndim - len(spec))
    entries.insert(pos % (ndim + 1), None)
    return P(*entries)


def _vmap_inside_body(case, mesh, xs, pos):
    ndim = len(case.global_shape)
    in_spec = _shift(case.in_spec, pos, ndim)
    out_spec = P(None, *case.out_spec)
    prog = case.program()
    inside = sf.shard_map(lambda b: torch.func.vmap(prog, in_dims=pos)(b), mesh, in_spec, out_spec)
    plain = sf.shard_map(prog, mesh, case.in_spec, case.out_spec)
    block = split_blocks(xs, in_spec, mesh.shape)[mesh.rank]
    batched = inside(block)
    looped = torch.stack([plain(b) for b in block.unbind(pos)])
    return batched, looped


def _vmap_params(cases, slow):
    marks = [pytest.mark.slow] if slow else []
    return [pytest.param(n, c, id=n, marks=marks) for n, c in cases]


@pytest.mark.parametrize("pos", [0, 1, -1])
@pytest.mark.parametrize("name,case", _vmap_params(VMAP_CASES, False) + _vmap_params(VMAP_SLOW, True))
def test_vmap_over_shard_map_equals_loop(name, case, pos):
    gen = torch.Generator().manual_seed(3)
    shape = list(case.global_shape)
    shape.insert(pos % (len(shape) + 1), 3)
    xs = torch.randn(shape, generator=gen, dtype=torch.float64)
    mesh = mesh_for(case.mesh_shape)
    for batched, looped in mesh.run(_vmap_over_body, case, mesh, xs, pos):
        torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pos", [0, -1])
@pytest.mark.parametrize("name,case", _vmap_params(VMAP_CASES, False) + _vmap_params(VMAP_SLOW, True))
def test_vmap_inside_shard_map_equals_loop(name, case, pos):
    gen = torch.Generator().manual_seed(4)
    shape = list(case.global_shape)
    shape.insert(pos % (len(shape) + 1), 3)
    xs = torch.randn(shape, generator=gen, dtype=torch.float64)
    mesh = mesh_for(case.mesh_shape)
    for batched, looped in mesh.run(_vmap_inside_body, case, mesh, xs, pos):
        torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,case", [pytest.param(n, c, id=n) for n, c in VMAP_CASES[:10]])
def test_jacrev_uses_vmap_of_backward(name, case):
    """jacrev = vmap over the VJP: every transpose's vmap rule, against the reference."""
    x, _, _ = inputs(case)
    mesh = mesh_for(case.mesh_shape)
    G = lambda X: shmap_reference(case.program(), case.mesh_shape, case.in_spec, case.out_spec)(X)  # noqa: E731
    want = torch.func.jacrev(G)(x)

    def body():
        return torch.func.jacrev(_global_fn(case, mesh))(x)

    for got in mesh.run(body):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# -- double backward ---------------------------------------------------------------------


def _double(C_prog, mesh_shape, in_spec, out_spec, x, v, mesh=None):
    """grad of (grad f . v): by the reference, or (mesh given) in local mode on each rank."""
    if mesh is None:
        f = shmap_reference(C_prog, mesh_shape, in_spec, out_spec)
        return torch.func.grad(lambda X: (torch.func.grad(f)(X) * v).sum())(x)

    f = sf.shard_map(C_prog, mesh, in_spec, out_spec)

    def body():
        xb = split_blocks(x, in_spec, mesh.shape)[mesh.rank].contiguous()
        vb = split_blocks(v, in_spec, mesh.shape)[mesh.rank].contiguous()
        by_func = torch.func.grad(lambda b: (torch.func.grad(f)(b) * vb).sum())(xb)
        leaf = xb.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
        (by_eager,) = torch.autograd.grad((g * vb).sum(), leaf)
        return by_func, by_eager

    by_func, by_eager = zip(*mesh.run(body))
    return join_blocks(by_func, in_spec, mesh.shape), join_blocks(by_eager, in_spec, mesh.shape)


def _psum_cubes(b):
    return C.psum((b ** 3).sum() + (b.sin() * b).sum(), ("y", "x"))


def _gather_cubes(b):
    full = C.all_gather(b, ("y", "x"), dim=0)  # same on every rank: invariant over both axes
    return (full ** 3).sum() + (full.cos() * full[:1]).sum()


@pytest.mark.parametrize("prog", [_psum_cubes, _gather_cubes], ids=["psum", "all_gather"])
def test_double_backward_through_collective(prog):
    shape = {"x": 2, "y": 2}
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    v = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    spec = P(("y", "x")) if prog is _gather_cubes else P(("x", "y"))
    want = _double(prog, shape, spec, P(), x, v)
    # unsharded: the same global function
    if prog is _psum_cubes:
        glob = lambda X: (X ** 3).sum() + (X.sin() * X).sum()  # noqa: E731
    else:
        glob = lambda X: (X ** 3).sum() + (X.cos() * X[:1]).sum()  # noqa: E731
    by_hand = torch.func.grad(lambda X: (torch.func.grad(glob)(X) * v).sum())(x)
    torch.testing.assert_close(want, by_hand, rtol=1e-10, atol=1e-12)
    by_func, by_eager = _double(prog, shape, spec, P(), x, v, mesh=mesh_for(shape))
    torch.testing.assert_close(by_func, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(by_eager, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [{"x": 2}, {"x": 2, "y": 2}], ids=["2", "2x2"])
def test_double_backward_replicated_input(shape):
    """Regression: reverse-over-reverse w.r.t. an input replicated over an axis was that
    axis' size times too large (the input half's psum was transposed again as a psum)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 2, generator=gen, dtype=torch.float64)  # replicated: in spec P()
    v = torch.randn(4, 2, generator=gen, dtype=torch.float64)
    axes = tuple(shape)

    def prog(b):
        return C.psum((b ** 3).sum() * (C.axis_index(axes) + 1.0), axes)

    n = sum(range(1, len(shape) * 2 + 1)) if len(shape) == 2 else 3  # sum of (index + 1)
    want = _double(prog, shape, P(), P(), x, v)
    torch.testing.assert_close(want, torch.func.grad(
        lambda X: (torch.func.grad(lambda Y: n * (Y ** 3).sum())(X) * v).sum())(x))
    by_func, by_eager = _double(prog, shape, P(), P(), x, v, mesh=mesh_for(shape))
    torch.testing.assert_close(by_func, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(by_eager, want, rtol=1e-10, atol=1e-12)


def test_forward_over_reverse_replicated_input():
    """jvp of grad (a Hessian-vector product by forward-over-reverse) is right even for an
    input replicated over the mesh: forward mode through the input half's psum is a psum."""
    shape = {"x": 2, "y": 2}
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3, generator=gen, dtype=torch.float64)  # replicated: P()
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)  # P(('x', 'y'))
    v = torch.randn(3, generator=gen, dtype=torch.float64)

    def prog(w, xb):
        return C.psum(((xb * w) ** 3).sum(), ("x", "y"))

    hvp = torch.func.jvp(torch.func.grad(lambda w: ((x * w) ** 3).sum()), (w,), (v,))[1]
    mesh = mesh_for(shape)
    f = sf.shard_map(prog, mesh, (P(), P(("x", "y"))), P())

    def body():
        xb = split_blocks(x, P(("x", "y")), mesh.shape)[mesh.rank]
        return torch.func.jvp(torch.func.grad(lambda ww: f(ww, xb)), (w,), (v,))[1]

    for got in mesh.run(body):
        torch.testing.assert_close(got, hvp, rtol=1e-11, atol=1e-12)
