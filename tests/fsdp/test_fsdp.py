"""shard(): parity with data parallelism, memory and communication accounting, composition,
nn.Module models, and the errors a user can provoke."""

import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._fsdp.funcgrad import wrapped
from shardfn.testing._ddp import assert_ddp_equivalent, ddp_training, local_batch
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params
from shardfn.testing import run_on_mesh
from traffic import sent, stats_view, totals

D = torch.float64


def _batches(g, n, rows, d_in, d_out, dtype=D):
    return [(torch.randn(rows, d_in, generator=g, dtype=dtype), torch.randn(rows, d_out, generator=g, dtype=dtype))
            for _ in range(n)]


# -- parity with data parallelism ---------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    world=st.integers(1, 4),
    reshard=st.booleans(),
    prefetch=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_mlp_matches_data_parallel(sizes, world, reshard, prefetch, seed):
    # Widths 1..7 on up to 4 ranks: uneven chunks and leaves with fewer rows than ranks.
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, sizes, dtype=D)
    batches = _batches(g, 2, 2 * world, sizes[0], sizes[-1])
    assert_ddp_equivalent(mlp_loss, params, batches, world_sizes=(world,), steps=2,
                          reshard_after_forward=reshard, prefetch=prefetch)


def test_oracle_reports_divergence():
    g = torch.Generator().manual_seed(0)
    params = mlp_params(g, [3, 4, 2], dtype=D)
    batches = _batches(g, 2, 4, 3, 2)

    def rank_dependent(p, batch):  # not data parallel: simulated rank 0 weighs its data twice
        return mlp_loss(p, batch) * (2.0 if threading.current_thread().name == "shardfn-rank-0" else 1.0)

    with pytest.raises(AssertionError, match=r"world size 2, step 0, rank \d: loss"):
        assert_ddp_equivalent(rank_dependent, params, batches, world_sizes=(2,), steps=1)


def _gpt_setup(dtype=D, n_layer=2):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16)
    model = GPT(cfg).to(dtype)
    apply_fn, params = sf.functional(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(2)]
    return model, apply_fn, params, batches


def test_gpt_module_matches_data_parallel():
    model, apply_fn, params, batches = _gpt_setup()
    assert_ddp_equivalent(lambda p, b: apply_fn(p, *b), params, batches, world_sizes=(2, 4), steps=2)


def test_functional_keeps_ties_and_buffers():
    model, apply_fn, params, batches = _gpt_setup()
    assert "lm_head" not in params  # tied to transformer.wte.weight: one leaf, in the root unit
    idx, tgt = batches[0]
    assert torch.equal(apply_fn(params, idx, tgt), model(idx, tgt))
    grads = torch.func.grad(lambda p: apply_fn(p, idx, tgt))(params)
    model(idx, tgt).backward()
    assert torch.allclose(grads["transformer"]["wte"]["weight"], model.transformer.wte.weight.grad, atol=1e-12)


@pytest.mark.multiprocess
def test_shard_matches_pytorch_ddp_multiprocess():
    g = torch.Generator().manual_seed(3)
    params = mlp_params(g, [5, 7, 3], dtype=D)
    batches = _batches(g, 3, 6, 5, 3)

    def body(mesh):
        ddp_losses, ddp_history = ddp_training(mlp_loss, params, batches, lr=0.1)
        step = sf.shard(mlp_loss, mesh)
        shards = step.shard_params(params)
        losses = []
        for batch in batches:
            grads, loss = torch.func.grad_and_value(step)(shards, local_batch(batch, mesh.rank, mesh.size))
            shards = torch.utils._pytree.tree_map(lambda p, gr: p - 0.1 * gr, shards, grads)
            losses.append(float(loss))
        full = step.unshard_params(shards)
        diffs = [(a - b).abs().max().item() for a, b in zip(torch.utils._pytree.tree_leaves(full),
                                                           torch.utils._pytree.tree_leaves(ddp_history[-1]))]
        return losses, ddp_losses, max(diffs)

    for losses, ddp_losses, diff in run_on_mesh(body, {"data": 2}, "distributed"):
        assert losses == pytest.approx(ddp_losses, abs=1e-12)
        assert diff < 1e-12


# -- memory and communication -------------------------------------------------------------


def _layers_only_params(L, d, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {"layers": [{"w": torch.randn(d, d, generator=g, dtype=dtype) / d, "b": torch.zeros(d, dtype=dtype)}
                       for _ in range(L)]}


def _layers_loss(p, x):
    for layer in p["layers"]:
        x = torch.tanh(x @ layer["w"] + layer["b"])
    return x.square().mean()


def _unit_bytes(d, k, itemsize=4):
    c = math.ceil(d / k)
    return k * (c * d + c) * itemsize  # w (d rows of d) + b (d rows of 1), each padded to k*c rows


@pytest.mark.parametrize("mode", ["backward", "func"])
@pytest.mark.parametrize("world", [2, 3])
def test_zero3_traffic_and_memory(mode, world):
    # What the backend sent (ops.recording), not stats()' bookkeeping: ZeRO-3 all-gathers
    # 2 Psi and reduce-scatters Psi per step; Psi all-gathered with reshard_after_forward=False.
    L, d = 4, 10  # 10 rows over 3 ranks: padded chunks
    params = _layers_only_params(L, d)
    unit = _unit_bytes(d, world)
    psi = L * unit
    # With reshard_after_forward, at most: one unit in use, and the next one's all-gather in
    # flight — its packed send buffer (unit / world) and its (k, S) output (a unit: these
    # units hold two leaves, so the output is copied out into the unit's buffer).
    for reshard, expected_ag, peak_bound in [(True, 2 * psi, 2 * unit + unit // world), (False, psi, psi)]:
        mesh = sf.local_mesh({"data": world})
        step = sf.shard(_layers_loss, mesh, reshard_after_forward=reshard, prefetch=1)

        def body():
            shards = step.shard_params(params)
            x = torch.randn(3, d, generator=torch.Generator().manual_seed(mesh.rank))
            for _ in range(2):  # the second call prefetches in the order learned on the first
                with sent() as rec:
                    if mode == "func":
                        torch.func.grad(step)(shards, x)
                    else:
                        leaves = torch.utils._pytree.tree_leaves(shards)
                        for t in leaves:
                            t.requires_grad_(True)
                            t.grad = None
                        step(shards, x).backward()
            return rec.records, step.stats()

        for records, stats in mesh.run(body):
            wire = totals(records)
            assert [c.nbytes for c in records if c.op == "all_gather"] == [unit] * (expected_ag // unit)
            assert [c.nbytes for c in records if c.op == "reduce_scatter"] == [unit] * L
            assert [(c.op, c.nbytes) for c in records if c.op not in ("all_gather", "reduce_scatter")] == [
                ("all_reduce", 32)]  # the loss and the batch-size check: [loss, n, n*n, unknown] in float64
            assert wire["all_gather_bytes"] == expected_ag and wire["reduce_scatter_bytes"] == psi
            assert stats_view(stats) == wire
            if reshard:
                assert unit < stats["peak_gathered_bytes"] <= peak_bound
            else:  # every unit, plus the last one's all-gather output until its copy-out
                assert stats["peak_gathered_bytes"] == psi + unit


def test_root_unit_stays_gathered_and_is_gathered_once():
    g = torch.Generator().manual_seed(0)
    params = {"embed": torch.randn(6, 4, generator=g), **_layers_only_params(3, 4), "head": torch.randn(4, 2, generator=g)}

    def loss_fn(p, x):
        h = x @ p["embed"][:4]
        return _layers_loss({"layers": p["layers"]}, h) + (h @ p["head"]).mean()

    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        for _ in range(2):
            with sent() as rec:
                torch.func.grad(step)(shards, torch.randn(2, 4))
        return rec.records, step.stats()

    root = 2 * (3 * 4 + 2 * 2) * 4  # embed: 3 rows x 4, head: 2 rows x 2 per rank, 2 ranks, fp32
    unit = _unit_bytes(4, 2)
    records, stats = mesh.run(body)[0]
    assert sorted(c.nbytes for c in records if c.op == "all_gather") == sorted([root] + [unit] * 6)
    assert sorted(c.nbytes for c in records if c.op == "reduce_scatter") == sorted([root] + [unit] * 3)
    assert stats_view(stats) == totals(records)
    assert stats["peak_gathered_bytes"] <= root + 2 * unit + unit // 2  # + the prefetched unit's send buffer


# -- composition --------------------------------------------------------------------------


def test_vmap_grad_per_example_and_jvp():
    g = torch.Generator().manual_seed(0)
    params = mlp_params(g, [4, 6, 3], dtype=D)
    X, Y = torch.randn(8, 4, generator=g, dtype=D), torch.randn(8, 3, generator=g, dtype=D)
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, b: mlp_loss(p, (b[0][None], b[1][None])), mesh)

    def body():
        shards = step.shard_params(params)
        x, y = local_batch((X, Y), mesh.rank, 2)
        per_example = torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(shards, (x, y))
        loop = [torch.func.grad(step)(shards, (x[i], y[i])) for i in range(4)]
        err = max((per_example["layers"][j][k][i] - loop[i]["layers"][j][k]).abs().max().item()
                  for i in range(4) for j in range(2) for k in "wb")
        tangent = torch.utils._pytree.tree_map(torch.ones_like, shards)
        _, jvp_out = torch.func.jvp(lambda s: step(s, (x[0], y[0])), (shards,), (tangent,))
        eps = 1e-6
        shift = lambda s, e: torch.utils._pytree.tree_map(lambda t: t + e, s)  # noqa: E731
        fd = (step(shift(shards, eps), (x[0], y[0])) - step(shift(shards, -eps), (x[0], y[0]))) / (2 * eps)
        return err, float(jvp_out), float(fd)

    for err, jvp_out, fd in mesh.run(body):
        assert err < 1e-14
        assert jvp_out == pytest.approx(fd, rel=1e-6)


def test_has_aux_and_collectives_inside_loss():
    mesh = sf.local_mesh({"data": 2})

    def loss_fn(p, x):
        loss = (x @ p["w"]).square().mean()
        return loss, {"rank": sf.axis_index("data"), "local": loss.detach()}

    step = sf.shard(loss_fn, mesh, has_aux=True)

    def body():
        shards = step.shard_params({"w": torch.ones(3, 1)})
        loss, aux = step(shards, torch.full((2, 3), float(mesh.rank + 1)))
        return float(loss), aux["rank"], float(aux["local"])

    (l0, r0, a0), (l1, r1, a1) = mesh.run(body)
    assert (r0, r1) == (0, 1) and l0 == l1 == pytest.approx((a0 + a1) / 2)


def test_specs_and_unshard_roundtrip():
    mesh = sf.local_mesh({"data": 3})
    params = {"w": torch.arange(20.0).reshape(5, 4), "s": torch.tensor(2.0), "n": torch.arange(3)}
    step = sf.shard(lambda p, x: (x @ p["w"].T).sum() * p["s"], mesh)

    def body():
        shards = step.shard_params(params)
        full = step.unshard_params(shards)
        return [tuple(v.shape) for v in shards.values()], all(torch.equal(full[k], params[k]) for k in params)

    results = mesh.run(body)
    assert step.specs == {"w": sf.P("data"), "s": sf.P(), "n": sf.P()}
    assert [r[0][0] for r in results] == [(2, 4), (2, 4), (1, 4)]
    assert all(r[1] for r in results)


# -- errors -------------------------------------------------------------------------------


def _run_expect(mesh, body, match):
    with pytest.raises(sf.ShardingError, match=match):
        mesh.run(body)


def test_error_non_tensor_leaf():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x.sum(), mesh)
    _run_expect(mesh, lambda: step.shard_params({"w": torch.ones(2), "lr": 0.1}),
                r"params\['lr'\] is a float, not a tensor")


def test_error_batch_device_and_dtype():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: (x @ p["w"]).sum(), mesh)

    def wrong_device():
        step(step.shard_params({"w": torch.ones(2, 2)}), {"x": torch.ones(2, 2, device="meta")})

    def wrong_dtype():
        step(step.shard_params({"w": torch.ones(2, 2)}), torch.ones(2, 2, dtype=torch.float64))

    _run_expect(mesh, wrong_device, r"batch\['x'\] is on meta, but the shards are on cpu")
    _run_expect(mesh, wrong_dtype, r"batch has dtype torch.float64, but the parameters compute in torch.float32")


def test_error_non_scalar_loss():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x @ p["w"], mesh)
    _run_expect(mesh, lambda: step(step.shard_params({"w": torch.ones(2, 2)}), torch.ones(2, 2)),
                r"loss_fn must return a scalar tensor \(0-dim\), got a tensor of shape \(2, 2\)")


def test_error_access_after_forward():
    mesh = sf.local_mesh({"data": 2})
    kept = {}

    def loss_fn(p, x):
        kept["view"] = p
        return (x @ p["layers"][0]["w"]).sum()

    step = sf.shard(loss_fn, mesh)

    def body():
        step(step.shard_params({"layers": [{"w": torch.ones(2, 2)}]}), torch.ones(2, 2))
        return kept["view"]["layers"][0]["w"]

    _run_expect(mesh, body, r"params\['layers'\]\[0\]\['w'\] was read outside the forward.*reshard_after_forward")


def test_error_structure_differs_across_ranks():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x.sum(), mesh)

    def body():
        rows = 4 if mesh.rank == 0 else 5
        return step.shard_params({"a": torch.ones(3), "b": torch.ones(rows, 2)})

    _run_expect(mesh, body, r"different parameter trees to shard_params\. First difference, at entry #1: "
                            r"rank \d has params\['b'\]: \((4|5), 2\)")


def test_error_outside_rank_and_wrong_shards():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: x.sum(), mesh)
    with pytest.raises(sf.ShardingError, match="not a rank of the simulated mesh"):
        step({"w": torch.ones(2)}, torch.ones(1))
    _run_expect(mesh, lambda: step({"w": torch.ones(2)}, torch.ones(1)), "has not laid out")


def test_error_shard_axes_not_subset():
    mesh = sf.local_mesh({"data": 2, "model": 2})
    with pytest.raises(sf.SpecError, match=r"must be a subset of data_axes \('data',\)"):
        sf.shard(lambda p, x: x.sum(), mesh, shard_axes="model")


HSDP = {"data_axes": ("replica", "shard"), "shard_axes": "shard"}


@pytest.mark.parametrize("kwargs", [{}, {"frozen": lambda path: path[:2] == ("layers", 1)}, {"has_aux": True},
                                    {"reshard_after_forward": False, "prefetch": 0}, HSDP])
def test_grad_and_value_fast_path_equals_torch_func(kwargs):
    """step.grad_and_value (eager autograd, reduce-scatters waited at the end, then HSDP's
    replica all-reduce in place) == torch.func."""
    g = torch.Generator().manual_seed(5)
    params = mlp_params(g, [4, 6, 5, 3], dtype=D)
    batch = (torch.randn(8, 4, generator=g, dtype=D), torch.randn(8, 3, generator=g, dtype=D))
    loss_fn = (lambda p, b: (mlp_loss(p, b), {"n": torch.ones(())})) if kwargs.get("has_aux") else mlp_loss
    mesh = sf.local_mesh({"replica": 2, "shard": 2} if kwargs is HSDP else {"data": 2})
    step = sf.shard(loss_fn, mesh, **kwargs)

    def body():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        fast, fast_value = step.grad_and_value(shards, local)
        with wrapped():  # torch.func at the grad level, not its fast path ([Note: torch.func.grad of a whole step])
            ref, ref_value = torch.func.grad_and_value(step, has_aux=kwargs.get("has_aux", False))(shards, local)
        diff = max((a - b).abs().max().item() for a, b in zip(torch.utils._pytree.tree_leaves(fast),
                                                             torch.utils._pytree.tree_leaves(ref)))
        loss = (lambda v: float(v[0]) if isinstance(v, tuple) else float(v))
        return diff, torch.utils._pytree.tree_structure(fast) == torch.utils._pytree.tree_structure(ref), \
            loss(fast_value) == loss(ref_value)

    assert mesh.run(body) == [(0.0, True, True)] * mesh.size


@pytest.mark.multiprocess
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 6), min_size=2, max_size=3), world=st.sampled_from([2, 3]),
       seed=st.integers(0, 999))
def test_shard_adamw_equals_ddp_torch_adamw(sizes, world, seed):
    """shard + sf.optim.adamw on N processes == DistributedDataParallel + torch.optim.AdamW:
    losses every step and parameters after 10 steps (float64)."""
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, sizes, dtype=D)
    batches = _batches(g, 10, 2 * world, sizes[0], sizes[-1])

    def body(mesh):
        ddp_losses, ddp_history = ddp_training(
            mlp_loss, params, batches, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1))
        step = sf.shard(mlp_loss, mesh)
        opt = sf.optim.adamw(0.05, weight_decay=0.1)
        train = sf.train_step(step, opt)
        shards = step.shard_params(params)
        state = opt.init(shards)
        losses = []
        for batch in batches:
            shards, state, loss = train(shards, state, local_batch(batch, mesh.rank, mesh.size))
            losses.append(float(loss))
        full = step.unshard_params(shards)
        diff = max((a - b).abs().max().item() for a, b in zip(torch.utils._pytree.tree_leaves(full),
                                                              torch.utils._pytree.tree_leaves(ddp_history[-1])))
        return losses, ddp_losses, diff

    for losses, ddp_losses, diff in run_on_mesh(body, {"data": world}, "distributed", timeout=60):
        assert losses == pytest.approx(ddp_losses, abs=1e-10)
        assert diff < 1e-10
