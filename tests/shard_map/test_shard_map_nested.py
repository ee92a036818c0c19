"""Partial-manual shard_map (`axis_names`), nesting, and shard_map inside sf.shard's loss_fn:
values, VJP and JVP against the single-device reference (fp64); every misuse by message."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._backend.base import rank_coords
from shardfn.testing._ddp import local_batch

F64 = torch.float64
tree_leaves = torch.utils._pytree.tree_leaves


def _maxdiff(a, b) -> float:
    return max(((u - v).abs().max().item() if u.numel() else 0.0) for u, v in zip(tree_leaves(a), tree_leaves(b)))


# -- a tensor-parallel MLP: shard_map over 'data' around a shard_map over 'model' -------------


def _mlp_reference(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _nested_mlp(mesh):
    def inner(x, w1, w2):  # manual over 'data' and 'model': w1's columns, w2's rows
        return sf.psum(torch.tanh(x @ w1) @ w2, "model")

    tp = sf.shard_map(inner, mesh, in_specs=(sf.P(), sf.P(None, "model"), sf.P("model")), out_specs=sf.P(),
                      axis_names={"model"})

    def outer(x, w1, w2):  # manual over 'data' (this rank's rows); whole over 'model'
        return tp(x, w1, w2)

    return sf.shard_map(outer, mesh, in_specs=(sf.P("data"), sf.P(), sf.P()), out_specs=sf.P("data"),
                        axis_names={"data"})


def _mlp_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(6, 4, generator=g, dtype=F64), torch.randn(4, 6, generator=g, dtype=F64),
            torch.randn(6, 3, generator=g, dtype=F64))


@pytest.mark.parametrize("shape", [{"data": 2, "model": 2}, {"model": 2, "data": 2}, {"data": 1, "model": 4},
                                   {"data": 3, "model": 1}])
def test_nested_shard_maps_equal_one_device(shape):
    mesh = sf.local_mesh(shape)
    f = _nested_mlp(mesh)
    x, w1, w2 = _mlp_inputs()
    ct = torch.randn(6, 3, generator=torch.Generator().manual_seed(5), dtype=F64)
    tangents = _mlp_inputs(seed=7)
    want, pull = torch.func.vjp(_mlp_reference, x, w1, w2)
    want_grads = pull(ct)
    _, want_jvp = torch.func.jvp(_mlp_reference, (x, w1, w2), tangents)

    def body():  # on each rank: this rank's rows of x (manual over 'data' outside f too)
        rows = local_batch((x, ct, tangents[0]), mesh.coords["data"], mesh.shape["data"])
        out, pull = torch.func.vjp(f, rows[0], w1, w2)
        gx, g1, g2 = pull(rows[1])
        _, jv = torch.func.jvp(f, (rows[0], w1, w2), (rows[2], tangents[1], tangents[2]))
        return out, gx, g1, g2, jv

    def full_rows(pieces):
        return torch.cat([pieces[r] for r in range(len(pieces)) if rank_coords(r, mesh.shape)["model"] == 0])

    results = mesh.run(body)
    assert _maxdiff(full_rows([r[0] for r in results]), want) <= 1e-12
    assert _maxdiff(full_rows([r[1] for r in results]), want_grads[0]) <= 1e-12
    assert _maxdiff(full_rows([r[4] for r in results]), want_jvp) <= 1e-12
    # w1, w2 are replicated into the outer shard_map: its boundary sums their gradients over 'data'
    for r in results:
        assert _maxdiff(r[2], want_grads[1]) <= 1e-12 and _maxdiff(r[3], want_grads[2]) <= 1e-12


def test_nested_shard_maps_from_the_main_thread_take_global_values():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    x, w1, w2 = (t.requires_grad_() for t in _mlp_inputs())
    out = _nested_mlp(mesh)(x, w1, w2)
    out.square().sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    _mlp_reference(*ref).square().sum().backward()
    assert _maxdiff(out, _mlp_reference(*ref)) <= 1e-12
    for got, want in zip((x, w1, w2), ref):
        assert _maxdiff(got.grad, want.grad) <= 1e-12


# -- shard (FSDP over 'data') whose loss_fn uses a shard_map over 'model' --------------------


def _tp_loss(mesh):
    def block(h, w1, w2):
        return sf.psum(torch.tanh(h @ w1) @ w2, "model")

    tp = sf.shard_map(block, mesh, in_specs=(sf.P(), sf.P(None, "model"), sf.P("model")), out_specs=sf.P(),
                      axis_names={"model"})

    return _residual_loss(tp)


def _residual_loss(block):
    def loss_fn(params, batch):
        x, y = batch
        h = x
        for layer in params["layers"]:
            h = h + block(h, layer["w1"], layer["w2"])
        return ((h - y) ** 2).mean()

    return loss_fn


_reference_loss = _residual_loss(_mlp_reference)


@pytest.mark.parametrize("how", ["func", "grad_and_value", "backward"])
def test_shard_loss_fn_with_a_shard_map_over_model_equals_one_device(how):
    g = torch.Generator().manual_seed(0)
    params = {"layers": [{"w1": torch.randn(4, 6, generator=g, dtype=F64) / 2,
                          "w2": torch.randn(6, 4, generator=g, dtype=F64) / 2} for _ in range(2)]}
    batch = (torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, 4, generator=g, dtype=F64))
    want_grads, want_loss = torch.func.grad_and_value(_reference_loss)(params, batch)
    mesh = sf.local_mesh({"data": 2, "model": 2})
    step = sf.shard(_tp_loss(mesh), mesh, data_axes="data")

    def body():
        shards = step.shard_params(params)
        mine = local_batch(batch, mesh.coords["data"], 2)  # the same batch on both 'model' ranks
        if how == "func":
            grads, loss = torch.func.grad_and_value(step)(shards, mine)
        elif how == "grad_and_value":
            grads, loss = step.grad_and_value(shards, mine)
        else:
            leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), shards)
            loss = step(leaves, mine)
            loss.backward()
            grads = torch.utils._pytree.tree_map(lambda t: t.grad, leaves)
        return float(loss), step.unshard_params(grads)

    for loss, grads in mesh.run(body):
        assert abs(loss - float(want_loss)) <= 1e-12
        assert _maxdiff(grads, want_grads) <= 1e-12


# -- a property: random meshes, axis splits, specs and shapes ------------------------------


@st.composite
def _nested_cases(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    shape = {n: draw(st.integers(1, 3)) for n in names}
    assume(1 < len(names) or shape[names[0]] > 1)
    assume(math.prod(shape.values()) <= 8)  # rank threads on a 2-core machine
    inner = draw(st.sets(st.sampled_from(names), min_size=1))
    outer = [n for n in names if n not in inner]
    dims = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))

    def spec_over(axes):
        entries = [None] * len(dims)
        for a in axes:
            if draw(st.booleans()):
                d = draw(st.integers(0, len(dims) - 1))
                entries[d] = a if entries[d] is None else (entries[d] if isinstance(entries[d], tuple) else
                                                           (entries[d],)) + (a,)
        return sf.P(*entries)

    return shape, sorted(inner), outer, dims, spec_over(outer), spec_over(sorted(inner))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_nested_cases())
def test_nested_shard_maps_property(case):
    """Outer shard_map over some axes, inner over the rest: for an elementwise map and a
    psum-reduced sum, values, VJP and JVP equal the one-device function of global values."""
    shape, inner_axes, outer_axes, dims, outer_spec, inner_spec = case
    mesh = sf.local_mesh(shape)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*dims, generator=g, dtype=F64), torch.randn((), generator=g, dtype=F64)

    def reference(x, w):
        return torch.tanh(x) * w, x.square().sum() * w

    def total(v, spec):  # the sum over the ranks that split the value (psum over a replica would repeat it)
        return sf.psum(v, tuple(spec.axes)) if spec.axes else v

    def inner(x, w):
        return torch.tanh(x) * w, total(x.square().sum(), inner_spec) * w

    inner_f = sf.shard_map(inner, mesh, in_specs=(inner_spec, sf.P()), out_specs=(inner_spec, sf.P()),
                           axis_names=set(inner_axes))

    def outer(x, w):
        y, s = inner_f(x, w)
        return y, total(s, outer_spec)

    f = sf.shard_map(outer, mesh, in_specs=(outer_spec, sf.P()), out_specs=(outer_spec, sf.P()),
                     axis_names=set(outer_axes) or None) if outer_axes else inner_f
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    y, s = f(xs, ws)  # global mode: scatter, run every rank, gather
    want_y, want_s = reference(x, w)
    assert _maxdiff((y, s), (want_y, want_s)) <= 1e-12
    (y.sum() + 3 * s).backward()
    gx, gw = torch.func.grad(lambda x, w: reference(x, w)[0].sum() + 3 * reference(x, w)[1], argnums=(0, 1))(x, w)
    assert _maxdiff((xs.grad, ws.grad), (gx, gw)) <= 1e-10

    # forward mode on the ranks: the top shard_map takes this rank's blocks over its own axes
    tx, tw = torch.randn(*dims, generator=g, dtype=F64), torch.randn((), generator=g, dtype=F64)
    top = outer_spec if outer_axes else inner_spec

    def jvp_body():
        xb, tb = sf.scatter(x, mesh, top, allow_empty=True), sf.scatter(tx, mesh, top, allow_empty=True)  # torch.chunk's empty blocks too
        _, (tyb, tsb) = torch.func.jvp(f, (xb, w), (tb, tw))
        return sf.gather(tyb, mesh, top), tsb

    _, (want_ty, want_ts) = torch.func.jvp(reference, (x, w), (tx, tw))
    for ty, ts in mesh.run(jvp_body):
        assert _maxdiff((ty, ts), (want_ty, want_ts)) <= 1e-10


# -- misuse ---------------------------------------------------------------------------------


def test_a_collective_over_an_axis_that_is_not_manual_is_refused():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    f = sf.shard_map(lambda x: sf.psum(x, "data"), mesh, in_specs=sf.P(), out_specs=sf.P(), axis_names={"model"})
    with pytest.raises(sf.SpecError) as err:
        mesh.run(lambda: f(torch.ones(2)))
    msg = str(err.value)
    assert "psum(axis='data')" in msg and "not manual here" in msg and "['model']" in msg and "Fix: add" in msg


def test_specs_may_name_only_the_manual_axes():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    f = sf.shard_map(lambda x: x, mesh, in_specs=sf.P("data"), out_specs=sf.P(), axis_names={"model"})
    with pytest.raises(sf.SpecError) as err:
        mesh.run(lambda: f(torch.ones(2)))
    msg = str(err.value)
    assert "in_specs for argument [0]" in msg and "names ['data']" in msg and "axis_names ['model']" in msg


def test_nesting_over_an_axis_that_is_already_manual_is_refused():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    inner = sf.shard_map(lambda x: x, mesh, in_specs=sf.P(), out_specs=sf.P(), axis_names={"data"})
    outer = sf.shard_map(lambda x: inner(x), mesh, in_specs=sf.P("data"), out_specs=sf.P("data"),
                         axis_names={"data"})
    with pytest.raises(sf.SpecError) as err:
        mesh.run(lambda: outer(torch.ones(2)))
    assert "already manual over" in str(err.value) and "axis_names=['model']" in str(err.value)


def test_axis_names_must_be_mesh_axes():
    mesh = sf.local_mesh({"data": 2})
    f = sf.shard_map(lambda x: x, mesh, in_specs=sf.P(), out_specs=sf.P(), axis_names={"model"})
    with pytest.raises(sf.SpecError, match="model"):
        mesh.run(lambda: f(torch.ones(2)))
