"""Expert parallelism: examples/moe.py's mixture-of-experts layer, experts split over 'expert'.

The layer's tokens travel to their experts' ranks and back by `sf.all_to_all`; with a
capacity of at least the tokens per rank nothing is dropped, so the sharded layer must be
the single-device one (`moe_reference`: every expert on every token, weighted by its
gate) in values, VJP, JVP and `.backward()` gradients of everything: the tokens, the
experts and the router (whose gradient comes only through the gate weights), at float64.

Level 1: the layer alone under `sf.shard_map` over {'expert': R}. Level 2: a small model
of [LayerNorm -> MoE -> residual] blocks inside `sf.shard`, with the experts split over
'expert' by `param_specs` (a data axis: needs expert parallelism in shard) and, as a
fallback that works today, replicated (every rank runs all experts on its tokens).
"""

import importlib.util
import os

import optree
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import shardfn as sf
from collective_cases import mesh_for

_spec = importlib.util.spec_from_file_location(
    "examples_moe", os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "moe.py"))
moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe)

P = sf.P
F64 = torch.float64
TOL = 1e-10


def layer_params(seed, E, d, h):
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(d, E, generator=g, dtype=F64),
            "w1": torch.randn(E, d, h, generator=g, dtype=F64) / d ** 0.5,
            "w2": torch.randn(E, h, d, generator=g, dtype=F64) / h ** 0.5}


def tokens(seed, n, d):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(100 + seed), dtype=F64)


SPECS = {"router": P(), "w1": P("expert"), "w2": P("expert")}


def sharded_layer(mesh, k, capacity):
    """The layer under shard_map: tokens and experts split over 'expert', the router replicated."""
    return sf.shard_map(lambda p, x: moe.moe(p, x, k=k, capacity=capacity, axis="expert")[0], mesh,
                        in_specs=(SPECS, P("expert")), out_specs=P("expert"))


def max_diff(got, want):
    return max((a - b).abs().max().item() for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))


def level1(R, E, k, n, d=5, h=6, extra_capacity=0, seed=0):
    """Per rank, VJP and JVP of the sharded layer on its blocks; joined into global values and
    compared with the single-device layer. Returns the max differences."""
    mesh = mesh_for({"expert": R})
    params, x = layer_params(seed, E, d, h), tokens(seed, n, d)
    g = torch.Generator().manual_seed(200 + seed)
    ct = torch.randn(n, d, generator=g, dtype=F64)
    tan_p = optree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=F64), params)
    tan_x = torch.randn(n, d, generator=g, dtype=F64)
    f = sharded_layer(mesh, k, capacity=n // R + extra_capacity)

    def body():
        local = lambda tree: optree.tree_map(lambda t, s: sf.scatter(t, mesh, s), tree, SPECS)  # noqa: E731
        rows = lambda t: sf.scatter(t, mesh, P("expert"))  # noqa: E731
        out, vjp = torch.func.vjp(f, local(params), rows(x))
        gp, gx = vjp(rows(ct))
        _, tan = torch.func.jvp(f, (local(params), rows(x)), (local(tan_p), rows(tan_x)))
        full = lambda tree: optree.tree_map(lambda t, s: sf.gather(t, mesh, s), tree, SPECS)  # noqa: E731
        return out, full(gp), gx, tan

    per_rank = mesh.run(body)
    out = torch.cat([r[0] for r in per_rank])
    gx = torch.cat([r[2] for r in per_rank])
    tan = torch.cat([r[3] for r in per_rank])
    ref = lambda p, x: moe.moe_reference(p, x, k=k)  # noqa: E731
    want_out, ref_vjp = torch.func.vjp(ref, params, x)
    want_gp, want_gx = ref_vjp(ct)
    _, want_tan = torch.func.jvp(ref, (params, x), (tan_p, tan_x))
    router_grads = [r[1]["router"] for r in per_rank]  # psummed over 'expert' by shard_map's rule (2)
    assert all(torch.equal(router_grads[0], r) for r in router_grads)
    assert want_gp["router"].abs().max() > 1e-9  # the router does get a gradient, through the gates (small when k = E)
    return {"out": max_diff(out, want_out), "grad params": max_diff(per_rank[0][1], want_gp),
            "grad x": max_diff(gx, want_gx), "jvp": max_diff(tan, want_tan)}


# -- level 1: the layer under shard_map --------------------------------------------------


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
def test_layer_matches_single_device(R, E, k):
    diffs = level1(R, E, k, n=4 * R)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("R,E,k", [(2, 4, 2), (4, 8, 1)])
def test_layer_backward_matches_single_device(R, E, k):
    """`.backward()` through the shard_map'ed layer called from the main thread on global
    tensors (it scatters, runs the ranks and gathers)."""
    n, d, h = 4 * R, 5, 6
    params, x = layer_params(1, E, d, h), tokens(1, n, d)
    ct = torch.randn(n, d, generator=torch.Generator().manual_seed(7), dtype=F64)
    leaves = optree.tree_map(lambda t: t.clone().requires_grad_(True), (params, x))
    (sharded_layer(mesh_for({"expert": R}), k, capacity=n // R)(*leaves) * ct).sum().backward()
    ref = optree.tree_map(lambda t: t.clone().requires_grad_(True), (params, x))
    (moe.moe_reference(*ref, k=k) * ct).sum().backward()
    got, want = optree.tree_map(lambda t: t.grad, leaves), optree.tree_map(lambda t: t.grad, ref)
    assert max_diff(got, want) <= TOL


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(R=st.sampled_from([2, 4]), E=st.sampled_from([2, 4, 8]), k=st.sampled_from([1, 2]),
       per_rank=st.integers(1, 5), d=st.integers(1, 4), h=st.integers(1, 4), extra=st.integers(0, 3),
       seed=st.integers(0, 2 ** 16))
def test_layer_matches_single_device_property(R, E, k, per_rank, d, h, extra, seed):
    assume(E % R == 0 and k <= E)
    diffs = level1(R, E, k, n=per_rank * R, d=d, h=h, extra_capacity=extra, seed=seed)
    assert max(diffs.values()) <= TOL, diffs


@pytest.mark.parametrize("k", [1, 2])
def test_dropping_is_per_rank_capacity(k):
    """Below capacity, each rank drops its own overflowing choices: the sharded layer equals the
    local (no-communication) layer run on each rank's tokens with the same capacity, and a
    dropped choice contributes nothing."""
    R, E, n, d, h, capacity = 2, 4, 16, 5, 6, 2
    mesh = mesh_for({"expert": R})
    params, x = layer_params(3, E, d, h), tokens(3, n, d)
    got = sharded_layer(mesh, k, capacity)(params, x)
    want = torch.cat([moe.moe(params, chunk, k=k, capacity=capacity)[0] for chunk in x.chunk(R)])
    assert (got - want).abs().max() <= TOL
    dispatch, _ = moe.dispatch_combine(*moe.route(params["router"], x[: n // R], k)[1:], E, capacity)
    assert dispatch.sum() < k * n // R  # this case does drop
    assert dispatch.sum((0, 2)).max() <= capacity and dispatch.sum((1, 2)).max() <= k


# -- level 2: the model inside sf.shard --------------------------------------------------

CFG = moe.Config(experts=4, k=2, d_in=3, d=6, h=5, d_out=2, layers=2, clusters=3, batch=16)


def level2_grads(mesh_shape, *, expert_parallel, mode="func"):
    """On every rank of a {'data': D, 'expert': R} mesh: the global gradient and loss of one
    sf.shard step on this rank's chunk of the global batch."""
    mesh = mesh_for(mesh_shape)
    axes = ("data", "expert")
    world = mesh.size
    capacity = CFG.batch // world  # tokens per rank: nothing dropped
    if expert_parallel:
        step = sf.shard(lambda p, b: moe.local_loss(p, b, k=CFG.k, capacity=capacity, axis="expert",
                                                    batch_axes=axes)[0],
                        mesh, data_axes=axes, shard_axes="data",
                        param_specs=lambda path: P("expert") if moe.is_expert_weight(path) else None)
    else:
        step = sf.shard(lambda p, b: moe.local_loss(p, b, k=CFG.k, capacity=capacity, axis=None,
                                                    batch_axes=axes)[0],
                        mesh, data_axes=axes)
    params = moe.init_params(CFG, torch.Generator().manual_seed(5))
    x, y, _ = moe.global_batch(CFG, moe.make_task(CFG), 0)

    def body():
        index = mesh.coords["data"] * mesh.shape["expert"] + mesh.coords["expert"]
        batch = x.chunk(world)[index], y.chunk(world)[index]
        shards = step.shard_params(params)
        if mode == "func":
            grads, loss = torch.func.grad_and_value(step)(shards, batch)
        else:
            shards = optree.tree_map(lambda t: t.requires_grad_(True), shards)
            loss = step(shards, batch)
            loss.backward()
            grads = optree.tree_map(lambda t: t.grad, shards)
        return float(loss.detach()), step.unshard_params(grads)

    want_grads, want_loss = torch.func.grad_and_value(moe.reference_loss)(params, (x, y), CFG.k)
    return mesh.run(body), want_grads, float(want_loss)


MESHES = [{"data": 2, "expert": 2}, {"data": 1, "expert": 4}, {"data": 4, "expert": 1}]
mesh_id = lambda s: "x".join(f"{a}{n}" for a, n in s.items())  # noqa: E731


@pytest.mark.parametrize("shape", MESHES, ids=mesh_id)
@pytest.mark.parametrize("mode", ["func", "backward"])
def test_model_in_shard_replicated_experts_matches_single_device(shape, mode):
    """Fallback without param_specs: the experts are FSDP-sharded like any weight, gathered
    whole on every rank, and each rank runs all of them on its own tokens (no all_to_all)."""
    per_rank, want, want_loss = level2_grads(shape, expert_parallel=False, mode=mode)
    for loss, grads in per_rank:
        assert abs(loss - want_loss) <= TOL
        assert max_diff(grads, want) <= TOL


@pytest.mark.parametrize("shape", MESHES[:2], ids=mesh_id)
@pytest.mark.parametrize("mode", ["func", "backward"])
def test_model_in_shard_expert_parallel_matches_single_device(shape, mode):
    """The intended API: param_specs splits the expert weights over 'expert' (also a data axis:
    the batch is split over it too), shard FSDP-shards every block over 'data'; inside
    loss_fn the layer calls sf.all_to_all over 'expert' on the local blocks. The gradients
    must be the single-device ones, and equal to the replicated fallback's."""
    per_rank, want, want_loss = level2_grads(shape, expert_parallel=True, mode=mode)
    fallback, _, _ = level2_grads(shape, expert_parallel=False, mode=mode)
    for (loss, grads), (_, replicated) in zip(per_rank, fallback):
        assert abs(loss - want_loss) <= TOL
        assert max_diff(grads, want) <= TOL
        assert max_diff(grads, replicated) <= TOL


@pytest.mark.parametrize("shape", MESHES[:2], ids=mesh_id)
def test_model_under_shard_map_on_the_2d_mesh_matches_single_device(shape):
    """What the expert-parallel sf.shard step computes, spelled out with shard_map on the same
    {'data': D, 'expert': R} mesh (no FSDP): the batch split over both axes, the experts over
    'expert', the rest replicated, the loss the global mean. Gradients = single device; so
    the model code above is right and only shard's param_specs over a data axis is missing."""
    mesh = mesh_for(shape)
    axes = ("data", "expert")
    params = moe.init_params(CFG, torch.Generator().manual_seed(5))
    x, y, _ = moe.global_batch(CFG, moe.make_task(CFG), 0)
    specs = moe.expert_specs(params)

    def loss_fn(p, batch):
        loss, _ = moe.local_loss(p, batch, k=CFG.k, capacity=CFG.batch // mesh.size, axis="expert", batch_axes=axes)
        return sf.psum(loss, axes) / mesh.size

    f = sf.shard_map(loss_fn, mesh, in_specs=(specs, P(axes)), out_specs=P())

    def body():
        batch = sf.scatter(x, mesh, P(axes)), sf.scatter(y, mesh, P(axes))
        local = optree.tree_map(lambda t, s: sf.scatter(t, mesh, s), params, specs)
        grads, loss = torch.func.grad_and_value(f)(local, batch)
        return float(loss), optree.tree_map(lambda t, s: sf.gather(t, mesh, s), grads, specs)

    want_grads, want_loss = torch.func.grad_and_value(moe.reference_loss)(params, (x, y), CFG.k)
    for loss, grads in mesh.run(body):
        assert abs(loss - float(want_loss)) <= TOL
        assert max_diff(grads, want_grads) <= TOL
