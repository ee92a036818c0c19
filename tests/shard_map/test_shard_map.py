"""shard_map: spec prefixes, local and global mode, torch.func transforms, a tensor-parallel
MLP against the single-device model, and a hypothesis sweep against the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from collective_cases import (
    TP_MESHES,
    TP_PARAM_SPECS,
    assert_trees_close,
    assert_triples_close,
    inputs,
    mesh_for,
    mlp_single,
    mlp_tp,
    reference,
    reference_results,
    run_simulated,
    tp_setup,
)
from shardfn.testing import strategies as sfst
from shardfn.testing._reference import C, join_tree, shmap_reference, split_tree

torch.set_num_threads(1)
P = sf.P
F64 = torch.float64
TIGHT = dict(rtol=1e-11, atol=1e-12)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape):
    return torch.randn(shape, generator=gen, dtype=F64)


# -- spec prefixes ------------------------------------------------------------------------


def _tree_prog(params, x, scale):
    """params: {'w': (D, H) P(None, 'y'), 'b': [(H,) P('y'), (H,) P()]}, x: (B, D) P('x')."""
    h = torch.tanh(x @ params["w"] + params["b"][0]) * scale
    full = C.all_gather(h, "y", dim=1)  # (B/x, H)
    s = C.psum((full * params["b"][1]).sum(), ("x", "y")) / C.axis_size("y")
    return {"h": full, "s": s}


TREE_IN = ({"w": P(None, "y"), "b": [P("y"), None]}, P("x"), None)
TREE_OUT = {"h": P("x"), "s": P()}


def _tree_args(seed=0):
    gen = _gen(seed)
    params = {"w": _randn(gen, 3, 4), "b": [_randn(gen, 4), _randn(gen, 4)]}
    return params, _randn(gen, 6, 3), 1.5


def _tree_unsharded(params, x, scale):
    h = torch.tanh(x @ params["w"] + params["b"][0]) * scale
    return {"h": h, "s": (h * params["b"][1]).sum()}


def test_spec_prefixes_global_mode_values_and_backward():
    mesh = mesh_for({"x": 2, "y": 2})
    params, x, scale = _tree_args()
    f = sf.shard_map(_tree_prog, mesh, TREE_IN, TREE_OUT)
    leaves = [params["w"], params["b"][0], params["b"][1], x]
    for t in leaves:
        t.requires_grad_(True)
    out = f(params, x, scale)
    assert_trees_close({k: v.detach() for k, v in out.items()},
                        {k: v.detach() for k, v in _tree_unsharded(params, x, scale).items()})
    (out["h"].pow(2).sum() + 3 * out["s"]).backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    ref = _tree_unsharded(params, x, scale)
    (ref["h"].pow(2).sum() + 3 * ref["s"]).backward()
    for g, t in zip(got, leaves):
        torch.testing.assert_close(g, t.grad, **TIGHT)


def test_spec_prefixes_local_mode_matches_reference():
    mesh = mesh_for({"x": 2, "y": 2})
    args = _tree_args(1)
    want = shmap_reference(_tree_prog, mesh.shape, TREE_IN, TREE_OUT)(*args)
    f = sf.shard_map(_tree_prog, mesh, TREE_IN, TREE_OUT)
    per_rank = mesh.run(lambda: f(*split_tree(args, TREE_IN, mesh.shape)[mesh.rank]))
    assert_trees_close(join_tree(per_rank, TREE_OUT, mesh.shape), want)


def test_single_spec_applies_to_every_argument_and_output():
    mesh = mesh_for({"x": 2})
    gen = _gen(2)
    a, b = _randn(gen, 4, 2), _randn(gen, 4, 2)
    f = sf.shard_map(lambda u, v: (u * v, u + v), mesh, P("x"), P("x"))
    prod, total = f(a, b)
    torch.testing.assert_close(prod, a * b)
    torch.testing.assert_close(total, a + b)


def test_none_spec_means_replicated_and_out_spec_dict_prefix():
    mesh = mesh_for({"x": 2})
    gen = _gen(3)
    x, w = _randn(gen, 4, 3), _randn(gen, 3)
    f = sf.shard_map(lambda x, w: {"y": x * w, "n": C.psum((x * w).sum(), "x")},
                     mesh, (P("x"), None), {"y": P("x"), "n": None})
    out = f(x, w)
    torch.testing.assert_close(out["y"], x * w)
    torch.testing.assert_close(out["n"], (x * w).sum())


def test_list_arguments_and_non_tensor_leaves():
    mesh = mesh_for({"x": 3})
    gen = _gen(4)
    xs = [_randn(gen, 3, 2), _randn(gen, 6)]
    f = sf.shard_map(lambda xs, k, name: (C.psum(xs[0].sum() * k, "x"), xs[1] * k),
                     mesh, ([P("x"), P("x")], None, None), (P(), P("x")))
    total, scaled = f(xs, 2.0, "ignored")
    torch.testing.assert_close(total, xs[0].sum() * 2.0)
    torch.testing.assert_close(scaled, xs[1] * 2.0)


@pytest.mark.parametrize("n,shape", [(5, {"x": 2}), (5, {"x": 4}), (2, {"x": 3}), (7, {"x": 2, "y": 2})])
def test_uneven_blocks_follow_torch_chunk(n, shape):
    mesh = mesh_for(shape)
    spec = P(tuple(shape)) if len(shape) > 1 else P("x")
    axes = tuple(shape)
    x = _randn(_gen(5), n, 2).requires_grad_()
    f = sf.shard_map(lambda b: (b.sin(), C.psum((b * b).sum(0), axes), torch.full((1,), b.shape[0])),
                     mesh, spec, (spec, P(), spec))
    y, sq, rows = f(x)
    k = mesh.size
    assert rows.tolist() == [len(c) for c in torch.chunk(torch.arange(n), k)] + [0] * (k - len(torch.chunk(torch.arange(n), k)))
    torch.testing.assert_close(y, x.sin())
    torch.testing.assert_close(sq, (x * x).sum(0))
    (y.sum() + sq.sum()).backward()
    torch.testing.assert_close(x.grad, x.cos() + 2 * x, **TIGHT)


# -- torch.func over shard_mapped functions (local mode) ---------------------------------


def _mlp_like(x, w):
    """x: (B, D) P('x'); w: (D, K) P(); a replicated scalar out."""
    return C.psum(torch.tanh(x @ w).pow(2).sum(), "x")


def _func_setup(seed=6):
    mesh = mesh_for({"x": 2, "y": 2})
    gen = _gen(seed)
    x, w = _randn(gen, 4, 3), _randn(gen, 3, 2)
    specs = (P("x"), P())
    ref = shmap_reference(_mlp_like, mesh.shape, specs, P())
    real = sf.shard_map(_mlp_like, mesh, specs, P())
    return mesh, x, w, specs, ref, real


def test_func_grad_over_shard_map():
    mesh, x, w, specs, ref, real = _func_setup()
    want = torch.func.grad(ref, argnums=(0, 1))(x, w)
    per_rank = mesh.run(lambda: torch.func.grad(real, argnums=(0, 1))(*split_tree((x, w), specs, mesh.shape)[mesh.rank]))
    assert_trees_close(join_tree(per_rank, specs, mesh.shape), want)


def test_func_vjp_over_shard_map():
    mesh, x, w, specs, ref, real = _func_setup(7)
    ct = torch.tensor(0.7, dtype=F64)
    want = torch.func.vjp(ref, x, w)[1](ct)

    def body():
        out, vjp = torch.func.vjp(real, *split_tree((x, w), specs, mesh.shape)[mesh.rank])
        return vjp(ct)

    assert_trees_close(join_tree(mesh.run(body), specs, mesh.shape), want)


def test_func_jvp_over_shard_map():
    mesh, x, w, specs, ref, real = _func_setup(8)
    gen = _gen(9)
    tx, tw = _randn(gen, *x.shape), _randn(gen, *w.shape)
    want = torch.func.jvp(ref, (x, w), (tx, tw))

    def body():
        b = split_tree((x, w, tx, tw), specs + specs, mesh.shape)[mesh.rank]
        return torch.func.jvp(real, b[:2], b[2:])

    for out, tangent in mesh.run(body):
        torch.testing.assert_close(out, want[0], **TIGHT)
        torch.testing.assert_close(tangent, want[1], **TIGHT)


def test_func_jacrev_over_shard_map():
    """A replicated output: each rank's jacrev is its column block of the global Jacobian."""
    mesh = mesh_for({"x": 2})
    gen = _gen(10)
    x = _randn(gen, 4, 3)

    def prog(b):
        return C.all_gather(torch.tanh(b) * b.sum(), "x", dim=0).sum(1)  # (4,), same on every rank

    want = torch.func.jacrev(shmap_reference(prog, mesh.shape, P("x"), P()))(x)  # (4, 4, 3)
    real = sf.shard_map(prog, mesh, P("x"), P())
    per_rank = mesh.run(lambda: torch.func.jacrev(real)(split_tree(x, P("x"), mesh.shape)[mesh.rank]))
    torch.testing.assert_close(torch.cat(per_rank, 1), want, **TIGHT)


def test_func_vmap_over_and_inside_shard_map():
    mesh = mesh_for({"x": 2, "y": 2})
    gen = _gen(11)
    xs, w = _randn(gen, 5, 4, 3), _randn(gen, 3, 2)  # a batch of 5 global x's
    real = sf.shard_map(_mlp_like, mesh, (P("x"), P()), P())
    inside = sf.shard_map(lambda xs, w: torch.func.vmap(_mlp_like, in_dims=(0, None))(xs, w),
                          mesh, (P(None, "x"), P()), P())
    want = torch.stack([torch.tanh(x @ w).pow(2).sum() for x in xs])

    def body():
        local = split_tree(xs, P(None, "x"), mesh.shape)[mesh.rank]
        over = torch.func.vmap(real, in_dims=(0, None))(local, w)
        return over, inside(local, w)

    for over, ins in mesh.run(body):
        torch.testing.assert_close(over, want, **TIGHT)
        torch.testing.assert_close(ins, want, **TIGHT)


def _jvp_prog(x):
    return C.psum(torch.sin(x) * x, "x")


def test_jvp_repeated_on_four_ranks_never_loses_tangents():
    """[Note: forward AD on the simulated mesh]: concurrent jvps in rank threads, many times."""
    mesh = mesh_for({"x": 4})
    real = sf.shard_map(_jvp_prog, mesh, P("x"), P())
    ref = shmap_reference(_jvp_prog, mesh.shape, P("x"), P())
    gen = _gen(12)
    for i in range(50):
        x, t = _randn(gen, 8, 2), _randn(gen, 8, 2) + 3.0  # tangents far from zero
        want = torch.func.jvp(ref, (x,), (t,))[1]
        assert want.abs().min() > 0

        def body():
            xb, tb = split_tree((x, t), P("x"), mesh.shape)[mesh.rank]
            return torch.func.jvp(real, (xb,), (tb,))[1]

        for rank, got in enumerate(mesh.run(body)):
            assert got.abs().min() > 0, f"iteration {i}, rank {rank}: a zero tangent"
            torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"iteration {i} rank {rank}: {m}")


def test_jvp_many_in_one_run_out_of_lockstep():
    """Ranks call jvp 60 times each inside one run, drifting apart between collectives."""
    mesh = mesh_for({"x": 4})
    real = sf.shard_map(_jvp_prog, mesh, P("x"), P())
    gen = _gen(13)
    xs = [(_randn(gen, 8, 2), _randn(gen, 8, 2) + 3.0) for _ in range(60)]
    ref = shmap_reference(_jvp_prog, mesh.shape, P("x"), P())
    wants = [torch.func.jvp(ref, (x,), (t,))[1] for x, t in xs]

    def body():
        out = []
        for i, (x, t) in enumerate(xs):
            xb, tb = split_tree((x, t), P("x"), mesh.shape)[mesh.rank]
            if (i + mesh.rank) % 3 == 0:
                torch.tanh(torch.randn(64, 64) @ torch.randn(64, 64))  # drift apart
            out.append(torch.func.jvp(real, (xb,), (tb,))[1])
        return out

    for rank, outs in enumerate(mesh.run(body)):
        for i, (got, want) in enumerate(zip(outs, wants)):
            torch.testing.assert_close(got, want, **TIGHT, msg=lambda m: f"jvp #{i} rank {rank}: {m}")


# -- Megatron-style tensor-parallel MLP -------------------------------------------------------


@pytest.mark.parametrize("mesh_id", list(TP_MESHES))
def test_tp_mlp_global_mode_matches_single_device(mesh_id):
    mesh, loss_fn, params, x, target, in_specs = tp_setup(mesh_id)
    want_loss = mlp_single(params, x, target)
    want_grads = torch.func.grad(mlp_single)(params, x, target)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = sf.shard_map(loss_fn, mesh, in_specs, P())(leaves, x, target)
    torch.testing.assert_close(loss, want_loss, **TIGHT)
    loss.backward()
    assert_trees_close({k: v.grad for k, v in leaves.items()}, want_grads)


@pytest.mark.parametrize("mesh_id", list(TP_MESHES))
def test_tp_mlp_local_mode_grads_of_all_weights(mesh_id):
    """Every weight's gradient, on every rank, including b2 and g (replicated over 'data' and
    'model': the input-boundary psum) and w1/w2 (replicated over 'data')."""
    mesh, loss_fn, params, x, target, in_specs = tp_setup(mesh_id, seed=30)
    want_loss, want_grads = mlp_single(params, x, target), torch.func.grad(mlp_single)(params, x, target)
    f = sf.shard_map(loss_fn, mesh, in_specs, P())

    def body():
        p, xb, tb = split_tree((params, x, target), in_specs, mesh.shape)[mesh.rank]
        grads, loss = torch.func.grad_and_value(f)(p, xb, tb)
        eager = {k: v.clone().requires_grad_() for k, v in p.items()}
        f(eager, xb, tb).backward()
        return loss, grads, {k: v.grad for k, v in eager.items()}

    results = mesh.run(body)
    claimed = dict(rtol=0, atol=1e-12)  # docs/autodiff.md: "the single-device gradients, to 1e-12 in float64"
    for loss, _, _ in results:
        torch.testing.assert_close(loss, want_loss, **claimed)
    # join_tree checks that the replicas of each replicated gradient agree
    assert_trees_close(join_tree([g for _, g, _ in results], TP_PARAM_SPECS, mesh.shape), want_grads, **claimed)
    assert_trees_close(join_tree([e for _, _, e in results], TP_PARAM_SPECS, mesh.shape), want_grads, **claimed)


@pytest.mark.parametrize("mesh_id", list(TP_MESHES))
def test_tp_mlp_per_example_grads_vmap_of_grad(mesh_id):
    """vmap(grad(f)) over examples (replicated on every rank) equals a Python loop and the
    single-device per-example gradients."""
    mesh, _, params, x, target, _ = tp_setup(mesh_id, seed=40)
    loss_fn = mlp_tp(data=False)  # one example per call: nothing to average over 'data'
    specs = (TP_PARAM_SPECS, P(), P())
    f = sf.shard_map(lambda p, xi, ti: loss_fn(p, xi[None], ti[None]), mesh, specs, P())
    single = lambda p, xi, ti: mlp_single(p, xi[None], ti[None])  # noqa: E731
    want = torch.func.vmap(torch.func.grad(single), in_dims=(None, 0, 0))(params, x, target)

    def body():
        p = split_tree(params, TP_PARAM_SPECS, mesh.shape)[mesh.rank]
        batched = torch.func.vmap(torch.func.grad(f), in_dims=(None, 0, 0))(p, x, target)
        looped = [torch.func.grad(f)(p, xi, ti) for xi, ti in zip(x, target)]
        return batched, looped

    results = mesh.run(body)
    for batched, looped in results:
        for i, one in enumerate(looped):
            assert_trees_close({k: v[i] for k, v in batched.items()}, one)
    batch_specs = {k: P(None, *s) for k, s in TP_PARAM_SPECS.items()}
    assert_trees_close(join_tree([b for b, _ in results], batch_specs, mesh.shape), want)


# -- hypothesis: shard_map vs the reference over meshes, specs, shapes, collectives ----------


HYP = settings(max_examples=40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@HYP
@given(case=sfst.collective_cases(), seed=st.integers(0, 2**16))
def test_shard_map_matches_reference(case, seed):
    x, ct, tangent = inputs(case, seed)
    mesh = mesh_for(case.mesh_shape)
    # global mode: values and .backward()
    f = sf.shard_map(case.program(), mesh, case.in_spec, case.out_spec)
    xs = x.clone().requires_grad_()
    out = f(xs)
    (out * ct).sum().backward()
    xr = x.clone().requires_grad_()
    ref_out = reference(case)(xr)
    (ref_out * ct).sum().backward()
    torch.testing.assert_close(out.detach(), ref_out.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-10, atol=1e-12)
    # local mode: values, VJP and JVP on every rank
    assert_triples_close(run_simulated(case, x, ct, tangent), reference_results(case, x, ct, tangent), repr(case))


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=sfst.collective_cases(), seed=st.integers(0, 2**16))
def test_shard_map_matches_reference_many(case, seed):
    test_shard_map_matches_reference.hypothesis.inner_test(case=case, seed=seed)
