"""shard policies: mixed precision, hybrid sharding, gradient accumulation, frozen params."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing import run_on_mesh
from shardfn.testing._ddp import local_batch, reference_training
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params
from traffic import sent, stats_view, totals

D = torch.float64
tree_leaves = torch.utils._pytree.tree_leaves
tree_map = torch.utils._pytree.tree_map


def _data(seed, sizes, rows, dtype=D):
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, sizes, dtype=dtype)
    batch = (torch.randn(rows, sizes[0], generator=g, dtype=dtype), torch.randn(rows, sizes[-1], generator=g, dtype=dtype))
    return params, batch


def _max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(tree_leaves(a), tree_leaves(b)))


# -- mixed precision ------------------------------------------------------------------------


def test_mixed_precision_gathers_in_param_dtype_and_returns_master_dtype():
    params, batch = _data(0, [8, 16, 16, 4], 8, dtype=torch.float32)
    results = {}
    for name, mp in [("fp32", None), ("bf16", sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))]:
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(mlp_loss, mesh, mixed_precision=mp)

        def body():
            shards = step.shard_params(params)
            with sent() as rec:
                grads, loss = torch.func.grad_and_value(step)(shards, local_batch(batch, mesh.rank, 2))
            return rec.records, [g.dtype for g in tree_leaves(grads)], step.unshard_params(grads), loss

        results[name] = mesh.run(body)[0]
    (r32, _, g32, l32), (r16, d16, g16, l16) = results["fp32"], results["bf16"]
    s32, s16 = totals(r32), totals(r16)  # what the backend sent
    assert s16["all_gather_bytes"] * 2 == s32["all_gather_bytes"]  # gathers move bf16
    assert s16["reduce_scatter_bytes"] == s32["reduce_scatter_bytes"]  # reductions in fp32
    assert {c.dtype for c in r16 if c.op == "all_gather"} == {torch.bfloat16}
    assert {c.dtype for c in r16 if c.op == "reduce_scatter"} == {torch.float32}
    assert set(d16) == {torch.float32}  # grads arrive in the shards' dtype
    assert _max_diff(g16, g32) < 2e-2 and abs(float(l16) - float(l32)) < 2e-2


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_reduction_really_runs_in_reduce_dtype(reduce_dtype):
    # Per-rank grads 256, 1, 1, 1 are exact in bf16; their bf16 sum rounds to 256, their
    # fp32 sum is 259 (PyTorch issue 190626 was a reduction silently running in bf16).
    mesh = sf.local_mesh({"data": 4})
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    step = sf.shard(lambda p, c: (p["w"] * c).sum(), mesh, mixed_precision=mp)

    def body():
        shards = step.shard_params({"w": torch.zeros(4)})
        c = torch.full((4,), 256.0 if mesh.rank == 0 else 1.0)
        return step.unshard_params(torch.func.grad(step)(shards, c))["w"]

    for full in mesh.run(body):
        assert full.dtype == torch.float32
        if reduce_dtype == torch.float32:
            assert full.tolist() == [64.75] * 4  # (256 + 1 + 1 + 1) / 4, exact
        else:  # the control: a bf16 reduction loses the ones (order-dependent rounding)
            assert all(v in (64.0, 64.5, 65.0) for v in full.tolist())


def test_output_dtype_and_cast_inputs():
    mesh = sf.local_mesh({"data": 2})
    mp = sf.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    seen = {}

    def loss_fn(p, x):
        seen["x"] = x.dtype
        return (x @ p["w"]).sum()

    step = sf.shard(loss_fn, mesh, mixed_precision=mp)

    def body():
        return step(step.shard_params({"w": torch.ones(3, 2)}), torch.ones(2, 3)).dtype

    assert mesh.run(body) == [torch.float32, torch.float32] and seen["x"] == torch.bfloat16


@pytest.mark.multiprocess
def test_bf16_loss_trajectory_matches_fsdp2():
    """Same GPT, data and MixedPrecisionPolicy(bf16, fp32) as FSDP2 on 2 gloo processes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))] * 5  # overfit one batch
    lr = 0.5

    def body(mesh):
        torch.manual_seed(0)
        apply_fn, params = sf.functional(GPT(cfg))
        torch.manual_seed(0)
        model = GPT(cfg)  # the same initial weights, for FSDP2 to wrap
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        step = sf.shard(lambda p, b: apply_fn(p, *b), mesh,
                        mixed_precision=sf.MixedPrecision(torch.bfloat16, torch.float32))
        shards = step.shard_params(params)
        ours, theirs = [], []
        for batch in data:
            idx, tgt = local_batch(batch, mesh.rank, 2)
            opt.zero_grad()
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            theirs.append(float(loss))  # this rank's loss (FSDP2 does not average it)
            grads, mean_loss = torch.func.grad_and_value(step)(shards, (idx, tgt))
            shards = tree_map(lambda p, gr: p - lr * gr, shards, grads)
            ours.append(float(mean_loss))
        theirs = torch.tensor(theirs)
        mesh.all_reduce(theirs, "data", op="mean")
        return ours, theirs.tolist(), step.stats()

    results = run_on_mesh(body, {"data": 2}, "distributed", timeout=60.0)
    ours, theirs, stats = results[0]
    assert ours[-1] < ours[0] - 0.05  # it trains
    # bf16 compute in both; documented tolerance: 2e-2 absolute on a loss of ~4.
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-2


# -- hybrid sharding --------------------------------------------------------------------------


def _hsdp_body(params, batches, lr):
    def body(mesh):
        step = sf.shard(mlp_loss, mesh, data_axes=("replica", "shard"), shard_axes="shard")
        shards = step.shard_params(params)
        losses = []
        for batch in batches:
            with sent() as rec:
                grads, loss = torch.func.grad_and_value(step)(shards, local_batch(batch, mesh.rank, 4))
            shards = tree_map(lambda p, g: p - lr * g, shards, grads)
            losses.append(float(loss))
        return losses, step.unshard_params(shards), (rec.records, step.stats()), step.specs

    return body


@pytest.mark.parametrize("backend", ["simulated", pytest.param("distributed", marks=pytest.mark.multiprocess)])
def test_hsdp_2x2_equals_data_parallel_over_4(backend):
    params, _ = _data(1, [6, 5, 3], 1)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 6, generator=g, dtype=D), torch.randn(8, 3, generator=g, dtype=D)) for _ in range(3)]
    ref_losses, ref_history = reference_training(mlp_loss, params, batches, 4, lr=0.1)
    results = run_on_mesh(_hsdp_body(params, batches, 0.1), {"replica": 2, "shard": 2}, backend)
    # Psi in fp64 with 2-way padding: w1 (6x5 -> 3 rows x 5 per rank), b1 (5 -> 3), w2 (5x3 -> 3 rows x 3), b2 (3 -> 2)
    psi = 2 * (3 * 5 + 3 + 3 * 3 + 2) * 8
    for losses, full, (records, stats), specs in results:
        assert losses == pytest.approx(ref_losses, abs=1e-12)
        assert _max_diff(full, ref_history[-1]) < 1e-12
        # What the backend sent: gathers and reduce-scatters within 'shard'; HSDP adds a
        # shard-sized all-reduce over 'replica' per unit; the loss is averaged over both axes.
        by_op = {}
        for c in records:
            by_op.setdefault((c.op, c.axes), []).append(c.nbytes)
        assert set(by_op) == {("all_gather", ("shard",)), ("reduce_scatter", ("shard",)),
                              ("all_reduce", ("replica",)), ("all_reduce", ("replica", "shard"))}
        assert sum(by_op["reduce_scatter", ("shard",)]) == psi
        assert sum(by_op["all_gather", ("shard",)]) == 2 * psi
        assert sorted(by_op["all_reduce", ("replica",)]) == sorted(n // 2 for n in by_op["reduce_scatter", ("shard",)])
        assert by_op["all_reduce", ("replica", "shard")] == [32]  # the loss with the batch-size check (float64 x 4)
        assert stats_view(stats) == totals(records)
        assert specs["layers"][0]["w"] == sf.P("shard")


# -- gradient accumulation --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["reduce_each", "reduce_once"])
def test_accumulation_equals_big_batch(mode):
    params, batch = _data(3, [4, 6, 5, 3], 16)
    ref_grads, ref_loss = torch.func.grad_and_value(lambda p: sum(
        mlp_loss(p, local_batch(batch, r, 2)) for r in range(2)) / 2)(params)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(mlp_loss, mesh)

    def body():
        shards = step.shard_params(params)
        x, y = local_batch(batch, mesh.rank, 2)  # 8 rows: 4 micro-batches of 2
        micro = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)]
        with sent() as rec:
            grads, loss = step.accumulate(shards, micro, mode=mode)
        return float(loss), step.unshard_params(grads), rec.records, step.stats()

    units = 3
    n_rs = 1 if mode == "reduce_once" else 4  # reduce_once: one reduce-scatter per unit per step
    psi = sum(2 * ((l["w"].shape[0] + 1) // 2 * l["w"].shape[1] + (l["b"].shape[0] + 1) // 2) * 8
              for l in params["layers"])
    for loss, full, records, stats in mesh.run(body):
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)
        assert _max_diff(full, ref_grads) < 1e-12
        reduce_scatters = [c.nbytes for c in records if c.op == "reduce_scatter"]
        assert len(reduce_scatters) == n_rs * units
        assert sum(reduce_scatters) == n_rs * psi
        assert stats_view(stats) == totals(records)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(micro=st.integers(1, 4), world=st.integers(1, 3), mode=st.sampled_from(["reduce_each", "reduce_once"]),
       dtype=st.sampled_from([None, torch.bfloat16]), seed=st.integers(0, 999))
def test_accumulation_and_precision_policies_property(micro, world, mode, dtype, seed):
    params, batch = _data(seed, [3, 5, 2], 2 * micro * world, dtype=torch.float32)
    ref_grads = torch.func.grad(lambda p: sum(mlp_loss(p, local_batch(batch, r, world)) for r in range(world)) / world)(params)
    mesh = sf.local_mesh({"data": world})
    mp = sf.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
    step = sf.shard(mlp_loss, mesh, mixed_precision=mp)

    def body():
        shards = step.shard_params(params)
        x, y = local_batch(batch, mesh.rank, world)
        micro_batches = [(x[i:i + 2], y[i:i + 2]) for i in range(0, 2 * micro, 2)]
        grads, _ = step.accumulate(shards, micro_batches, mode=mode)
        return step.unshard_params(grads)

    tol = 1e-5 if dtype is None else 5e-2
    for full in mesh.run(body):
        assert _max_diff(full, ref_grads) < tol


# -- frozen params ----------------------------------------------------------------------------


@pytest.mark.parametrize("reshard, prefetch", [(True, 0), (True, 1), (False, 1)])
def test_frozen_params_get_no_gradient_and_no_reduce_scatter(reshard, prefetch):
    params, batch = _data(4, [4, 6, 5, 3], 8)
    ref = torch.func.grad(lambda p: sum(mlp_loss(p, local_batch(batch, r, 2)) for r in range(2)) / 2)(params)
    mesh = sf.local_mesh({"data": 2})
    frozen_layer = 1
    step = sf.shard(mlp_loss, mesh, frozen=lambda path: path[:2] == ("layers", frozen_layer),
                    reshard_after_forward=reshard, prefetch=prefetch)

    def body():
        shards = step.shard_params(params)
        grads = step.unshard_params(torch.func.grad(step)(shards, local_batch(batch, mesh.rank, 2)))
        for t in tree_leaves(shards):
            t.requires_grad_(True)
        with sent() as rec:
            step(shards, local_batch(batch, mesh.rank, 2)).backward()
        return grads, [t.grad is None for t in tree_leaves(shards)], (rec.records, step.stats())

    for grads, no_grad, (records, stats) in mesh.run(body):
        for i, (layer, ref_layer) in enumerate(zip(grads["layers"], ref["layers"])):
            for k in ("w", "b"):
                if i == frozen_layer:
                    assert torch.count_nonzero(layer[k]) == 0
                else:
                    assert torch.allclose(layer[k], ref_layer[k], atol=1e-12)
        assert no_grad == [False, False, True, True, False, False]
        frozen_bytes = 2 * (3 * 5 + 3) * 8
        trainable = 2 * (2 * 6 + 3) * 8 + 2 * (3 * 3 + 2) * 8
        wire = totals(records)  # what the backend sent
        assert sorted(c.nbytes for c in records if c.op == "reduce_scatter") == sorted(
            [2 * (2 * 6 + 3) * 8, 2 * (3 * 3 + 2) * 8])  # the two trainable units; none for the frozen one
        assert wire["all_gather_bytes"] == (2 if reshard else 1) * (trainable + frozen_bytes)
        assert wire["reduce_scatter_bytes"] == trainable
        assert stats_view(stats) == wire


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([{"data": 1}, {"data": 2}, {"data": 3}, {"replica": 2, "shard": 2},
                              {"replica": 2, "shard": 1}, {"replica": 1, "shard": 3}]),
       micro=st.integers(1, 3), mode=st.sampled_from(["reduce_each", "reduce_once"]),
       dtype=st.sampled_from([None, torch.bfloat16]), seed=st.integers(0, 999))
def test_policies_over_mesh_shapes_property(shape, micro, mode, dtype, seed):
    """1-D FSDP and 2-D HSDP meshes x accumulation modes x precision policies == DP."""
    world = 1
    for size in shape.values():
        world *= size
    params, batch = _data(seed, [3, 5, 2], 2 * micro * world, dtype=torch.float32)
    ref = torch.func.grad(lambda p: sum(mlp_loss(p, local_batch(batch, r, world)) for r in range(world)) / world)(params)
    mesh = sf.local_mesh(shape)
    axes = dict(data_axes=("replica", "shard"), shard_axes="shard") if "shard" in shape else {}
    mp = sf.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
    step = sf.shard(mlp_loss, mesh, mixed_precision=mp, **axes)

    def body():
        shards = step.shard_params(params)
        x, y = local_batch(batch, mesh.rank, world)
        grads, _ = step.accumulate(shards, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 2 * micro, 2)], mode=mode)
        return step.unshard_params(grads)

    tol = 1e-5 if dtype is None else 5e-2
    for full in mesh.run(body):
        assert _max_diff(full, ref) < tol
