"""Per-example gradients of a sharded model with different examples on every rank
(`sf.per_example_grads`), and DP-SGD on them (`sf.optim.dp_aggregate`).

The references are one device in float64: `torch.func.vmap(torch.func.grad(loss))` over
the global batch (the ranks' local batches concatenated in rank order), and a DP-SGD step
written out here (Opacus's clip factor, sum, noise of std sigma * C rebuilt from the
documented per-block seeds, divide by B).
"""

import math
import warnings

import optree
import pytest
import torch

import shardfn as sf
from shardfn import optim
from shardfn.testing import run_on_mesh
from collective_cases import mesh_for
from traffic import sent, totals

F64 = torch.float64
SIZES = [5, 7, 6, 3]  # the last layer has 3 rows: on 4 ranks one rank holds none of it
B_LOCAL = 4


def loss_fn(params, example):
    """ONE example's loss: a tanh MLP, its output scaled by a 0-dim leaf (kept whole)."""
    x, y = example
    h = x
    for i, layer in enumerate(params["layers"]):
        h = h @ layer["w"] + layer["b"]
        if i + 1 < len(params["layers"]):
            h = torch.tanh(h)
    return ((params["gain"] * h - y) ** 2).mean()


def problem(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    params = {"layers": [{"w": torch.randn(a, b, generator=g, dtype=F64) / math.sqrt(a),
                          "b": 0.1 * torch.randn(b, generator=g, dtype=F64)} for a, b in zip(SIZES, SIZES[1:])],
              "gain": torch.tensor(1.3, dtype=F64)}
    x = torch.randn(n * B_LOCAL, SIZES[0], generator=g, dtype=F64)  # (B, D_in): the global batch
    y = torch.randn(n * B_LOCAL, SIZES[-1], generator=g, dtype=F64)
    return params, (x, y)


def local(batch, n: int, r: int):
    """Rank r's own examples: rows r * B_LOCAL .. (r + 1) * B_LOCAL - 1 of the global batch."""
    return tuple(t.chunk(n)[r] for t in batch)


def block(full: torch.Tensor, n: int, r: int, dim: int = 0) -> torch.Tensor:
    """Rank r's torch.chunk block of `dim` (empty when r is past the last chunk)."""
    chunks = full.chunk(n, dim=dim)
    return chunks[r] if r < len(chunks) else full.narrow(dim, 0, 0)


def max_diff(a, b) -> float:
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    assert len(la) == len(lb) and all(x.shape == y.shape for x, y in zip(la, lb)), \
        [(tuple(x.shape), tuple(y.shape)) for x, y in zip(la, lb)]
    return max(((x - y).abs().max().item() if x.numel() else 0.0) for x, y in zip(la, lb))


def reference(params, batch):
    """One device: every example's gradient (leaves (B, *shape)), squared norms, losses."""
    grads = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0))(params, batch)
    losses = torch.func.vmap(loss_fn, in_dims=(None, 0))(params, batch)
    sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in optree.tree_leaves(grads))
    return grads, sq, losses


def owners_view(grads, n: int, r: int):
    """What rank r should hold: its dim-0 block of every example's gradient (whole for 0-dim)."""
    return optree.tree_map(lambda g: block(g, n, r, dim=1) if g.dim() > 1 else g, grads)


def psi_padded(params, n: int) -> int:
    """Ψ: bytes of the padded unsharded unit buffers, sum over units of k * S (fp64)."""
    return sum(n * sum(math.ceil(t.shape[0] / n) * math.prod(t.shape[1:]) for t in layer.values()) * 8
               for layer in params["layers"])


def expected_bytes(params, n: int) -> dict:
    """The formula of docs/autodiff.md §12 for this model: one gather of Ψ, an all-to-all of
    B_local * Ψ, the whole 0-dim leaf's B gradients and the B losses gathered, an all-reduce
    of B squared norms plus the batch-size check (two int64s)."""
    b = n * B_LOCAL
    units = len(params["layers"])
    return {"all_gather_bytes": psi_padded(params, n) + b * 8 + b * 8,
            "all_to_all_bytes": B_LOCAL * psi_padded(params, n),
            "all_reduce_bytes": 16 + b * 8,
            "num_collectives": 1 + units + units + 1 + 1 + 1}


def run_per_example(mesh, params, batch, n):
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        with sent() as rec:
            out = sf.per_example_grads(step, shards, local(batch, n, mesh.coords["data"]))
        return out.grads, out.sq_norms, out.losses, out.stats, totals(rec.records)

    return mesh.run(body)


@pytest.mark.parametrize("n", [2, 4])
def test_every_example_gradient_as_the_owners_hold_it_equals_one_device(n):
    params, batch = problem(n)
    ref_grads, ref_sq, ref_losses = reference(params, batch)
    results = run_per_example(mesh_for({"data": n}), params, batch, n)
    for r, (grads, sq, losses, stats, wire) in enumerate(results):
        assert optree.tree_leaves(grads)[-1].shape[0] == n * B_LOCAL  # every example, not B_LOCAL
        assert max_diff(grads, owners_view(ref_grads, n, r)) <= 1e-10
        assert (sq - ref_sq).abs().max().item() <= 1e-10
        assert (losses - ref_losses).abs().max().item() <= 1e-12
        # bytes: the docs' formula, and what the backend saw this rank send
        assert stats == expected_bytes(params, n), (stats, expected_bytes(params, n))
        assert wire == {"all_gather_bytes": stats["all_gather_bytes"], "reduce_scatter_bytes": 0,
                        "all_reduce_bytes": stats["all_reduce_bytes"], "num_collectives": stats["num_collectives"],
                        "all_to_all_bytes": stats["all_to_all_bytes"]}
    # rank 3 of 4 holds no row of the last layer: an empty block of every example
    if n == 4:
        assert results[3][0]["layers"][2]["w"].shape == (n * B_LOCAL, 0, SIZES[-1])


def test_two_data_axes_order_the_examples_by_the_shard_group_index():
    """data_axes=('b', 'a') on a {'a': 2, 'b': 2} mesh: the shard group is row-major over
    ('b', 'a'), and example r * B_LOCAL + i is example i of the rank at index r of it."""
    n = 4
    params, batch = problem(n)
    ref_grads, ref_sq, _ = reference(params, batch)
    mesh = mesh_for({"a": 2, "b": 2})
    step = sf.shard(loss_fn, mesh, data_axes=("b", "a"))

    def body():
        r = mesh.group(("b", "a")).index
        assert r == mesh.coords["b"] * 2 + mesh.coords["a"]
        out = sf.per_example_grads(step, step.shard_params(params), local(batch, n, r))
        return r, out.grads, out.sq_norms

    for r, grads, sq in mesh.run(body):
        assert max_diff(grads, owners_view(ref_grads, n, r)) <= 1e-10
        assert (sq - ref_sq).abs().max().item() <= 1e-10


@pytest.mark.slow
def test_a_gpt_through_sf_functional_with_a_tied_head():
    """The examples' GPT (2 layers, tied head, LayerNorm, embeddings) as `sf.functional`
    gives it: every example's gradient on 2 ranks equals one device's vmap(grad)."""
    from shardfn.testing.models import GPT, GPTConfig

    n, b_local = 2, 3
    torch.manual_seed(0)
    apply_fn, params = sf.functional(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)).double())

    def gpt_loss(p, example):  # ONE sequence: tokens (T,), targets (T,)
        x, y = example
        return apply_fn(p, x[None], y[None])

    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 32, (n * b_local, 8), generator=g), torch.randint(0, 32, (n * b_local, 8), generator=g)
    ref = torch.func.vmap(torch.func.grad(gpt_loss), in_dims=(None, 0))(params, (x, y))
    ref_sq = sum(t.reshape(t.shape[0], -1).pow(2).sum(1) for t in optree.tree_leaves(ref))
    mesh = mesh_for({"data": n})
    step = sf.shard(gpt_loss, mesh)

    def body():
        r = mesh.rank
        out = sf.per_example_grads(step, step.shard_params(params), (x.chunk(n)[r], y.chunk(n)[r]))
        return out.grads, out.sq_norms

    for r, (grads, sq) in enumerate(mesh.run(body)):
        assert max_diff(grads, owners_view(ref, n, r)) <= 1e-10
        assert (sq - ref_sq).abs().max().item() <= 1e-10


def test_vmap_of_grad_of_the_step_is_the_mean_over_ranks_of_each_slot():
    """What `vmap(grad(step), in_dims=(None, 0))` means with per-rank examples (the docs say
    so): slot i is the mean over ranks of their i-th examples' gradients, far from rank r's
    own example's gradient. `per_example_grads` is the call for the latter."""
    n = 2
    params, batch = problem(n)
    ref_grads, _, _ = reference(params, batch)
    mesh = mesh_for({"data": n})
    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        return torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(shards, local(batch, n, mesh.rank))

    per_slot_mean = optree.tree_map(lambda g: (g[:B_LOCAL] + g[B_LOCAL:]) / 2, ref_grads)  # (B_LOCAL, *shape)
    with pytest.warns(UserWarning, match=r"different examples on the ranks of the data axes \['data'\].*"
                                         r"\n.*use sf.per_example_grads\(step, shards, batch\)") as caught:
        results = mesh.run(body)
    assert sum("sf.per_example_grads" in str(w.message) for w in caught) == n  # once per rank
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        mesh.run(body)  # the first vmapped call only
    assert not [w for w in again if "sf.per_example_grads" in str(w.message)]
    for r, slots in enumerate(results):
        assert max_diff(slots, owners_view(per_slot_mean, n, r)) <= 1e-12
        own = optree.tree_map(lambda g: g[r * B_LOCAL:(r + 1) * B_LOCAL], ref_grads)
        assert max_diff(slots, owners_view(own, n, r)) > 1e-2


def test_vmap_of_grad_with_the_same_examples_on_every_rank_does_not_warn():
    """The layout of examples/per_example_grads.py: every rank of the data axes vmaps over the
    same examples, so slot i is example i's gradient and nothing is wrong."""
    n = 2
    params, batch = problem(n)
    mesh = mesh_for({"data": n})
    step = sf.shard(loss_fn, mesh)
    ref_grads, _, _ = reference(params, batch)

    def body():
        return torch.func.vmap(torch.func.grad(step), in_dims=(None, 0))(step.shard_params(params), batch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = mesh.run(body)
    assert not [w for w in caught if "sf.per_example_grads" in str(w.message)]
    for r, grads in enumerate(results):
        assert max_diff(grads, owners_view(ref_grads, n, r)) <= 1e-12


# -- DP-SGD -------------------------------------------------------------------------------

CLIP, SIGMA, LR, SEED = 3.0, 0.7, 0.05, 1234  # C between the examples' norms: some clipped, some not


def noise_seed(seed, step, leaf, blk):  # docs' formula, written out again
    return (((seed * 1_000_003 + step) * 1_000_003 + leaf) * 1_000_003 + blk) & ((1 << 63) - 1)


def reference_noise(params, n: int, step: int):
    """The full noise of a step, rebuilt from the per-block draws (leaf j's block i drawn
    from noise_seed(SEED, step, j, i); a whole leaf from block 0)."""
    out = []
    for j, p in enumerate(optree.tree_leaves(params)):
        if p.dim() == 0:
            g = torch.Generator().manual_seed(noise_seed(SEED, step, j, 0))
            out.append(torch.randn((), generator=g, dtype=F64))
            continue
        pieces = []
        for i in range(n):
            g = torch.Generator().manual_seed(noise_seed(SEED, step, j, i))
            pieces.append(torch.randn(block(p, n, i).shape, generator=g, dtype=F64))
        out.append(torch.cat(pieces))
    return optree.tree_unflatten(optree.tree_structure(params), out)


def reference_dp_sgd(params, batches, n: int):
    """Opacus's DP-SGD on one device: clip each example to CLIP (factor min(1, C/(norm+1e-6))),
    sum, add N(0, (SIGMA*C)^2), divide by B; then plain SGD."""
    for t, batch in enumerate(batches):
        grads, sq, _ = reference(params, batch)
        factors = (CLIP / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        noise = reference_noise(params, n, t)
        b = batch[0].shape[0]
        mean = optree.tree_map(lambda g, z: (torch.einsum("b,b...->...", factors, g) + SIGMA * CLIP * z) / b,
                               grads, noise)
        params = optree.tree_map(lambda p, u: p - LR * u, params, mean)
    return params


def dp_sgd_sharded(mesh, params, batches, n: int):
    step = sf.shard(loss_fn, mesh)
    shards = step.shard_params(params)
    opt = optim.chain(optim.dp_aggregate(CLIP, SIGMA, SEED, mesh=mesh, specs=step.specs), optim.sgd(LR))
    state = opt.init(shards)
    r = mesh.coords["data"]
    for batch in batches:
        pe = sf.per_example_grads(step, shards, local(batch, n, r))
        updates, state = opt.update(pe.grads, state, shards)
        shards = optim.apply_updates(shards, updates)
    return step.unshard_params(shards)


@pytest.mark.parametrize("n", [2, 4])
def test_dp_sgd_steps_equal_a_one_device_reference_with_the_same_noise_seed(n):
    params, batch0 = problem(n, seed=0)
    _, batch1 = problem(n, seed=1)
    batches = [batch0, batch1]  # two steps: the noise's step index advances
    expected = reference_dp_sgd(params, batches, n)
    mesh = mesh_for({"data": n})
    for final in mesh.run(dp_sgd_sharded, mesh, params, batches, n):
        assert max_diff(final, expected) <= 1e-10
    # clipping and noise matter here: one DP-SGD step is far from plain SGD on the mean gradient
    norms = reference(params, batch0)[1].sqrt()
    assert (norms > CLIP).any() and (norms < CLIP).any(), "the test would not see a wrong clip factor"
    plain = optree.tree_map(lambda p, g: p - LR * g.mean(0), params, reference(params, batch0)[0])
    assert max_diff(reference_dp_sgd(params, [batch0], n), plain) > 1e-3


def test_dp_aggregate_on_one_device_clips_each_example():
    per_example = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=F64)}  # norms 5 and 0.5
    opt = optim.dp_aggregate(1.0, 0.0, seed=0)
    out, state = opt.update(per_example, opt.init(None))
    expected = (torch.tensor([0.6, 0.8], dtype=F64) * 5 / (5 + 1e-6) + torch.tensor([0.3, 0.4], dtype=F64)) / 2
    assert torch.allclose(out["w"], expected, atol=1e-15, rtol=0) and int(state.count) == 1
    noisy, _ = optim.dp_aggregate(1.0, 2.0, seed=7).update(per_example, state)
    z = torch.randn(2, generator=torch.Generator().manual_seed(noise_seed(7, 1, 0, 0)), dtype=F64)
    assert torch.allclose(noisy["w"], expected + 2.0 * z / 2, atol=1e-15, rtol=0)


# -- errors ---------------------------------------------------------------------------------


def test_ranks_with_different_numbers_of_examples_are_refused_on_every_rank():
    n = 2
    params, batch = problem(n)
    mesh = mesh_for({"data": n})
    step = sf.shard(loss_fn, mesh)

    def body():
        x, y = local(batch, n, mesh.rank)
        if mesh.rank == 1:
            x, y = x[:3], y[:3]
        try:
            sf.per_example_grads(step, step.shard_params(params), (x, y))
        except sf.ShardingError as err:
            return str(err)

    for message in mesh.run(body):
        assert message is not None and "different numbers of examples" in message and "from 3 to 4" in message
        assert "Fix: give every rank the same number of examples" in message


def test_hsdp_and_mixed_precision_steps_are_refused_by_name():
    mesh = mesh_for({"replica": 2, "shard": 2})
    params, batch = problem(4)
    step = sf.shard(loss_fn, mesh, data_axes=("replica", "shard"), shard_axes="shard",
                    mixed_precision=sf.MixedPrecision(param_dtype=torch.float32))

    def body():
        try:
            sf.per_example_grads(step, step.shard_params(params), local(batch, 4, mesh.rank))
        except sf.ShardingError as err:
            return str(err)

    for message in mesh.run(body):
        assert "HSDP: data axes ['replica'] are not shard axes" in message
        assert "mixed_precision=" in message and "Fix: build a plain FSDP step" in message


def test_a_batch_without_one_leading_size_is_a_spec_error():
    mesh = mesh_for({"data": 2})
    params, _ = problem(2)
    step = sf.shard(loss_fn, mesh)

    def body():
        try:
            sf.per_example_grads(step, step.shard_params(params), (torch.zeros(4, 5, dtype=F64),
                                                                    torch.zeros(3, 3, dtype=F64)))
        except sf.SpecError as err:
            return str(err)

    for message in mesh.run(body):
        assert "must share one leading size" in message and "[0]" in message and "[1]" in message


# -- real processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.ci
def test_per_example_grads_and_dp_sgd_in_two_processes():
    n = 2
    params, batch = problem(n)
    ref_grads, ref_sq, _ = reference(params, batch)
    expected = reference_dp_sgd(params, [batch], n)

    def body(mesh):
        step = sf.shard(loss_fn, mesh)
        out = sf.per_example_grads(step, step.shard_params(params), local(batch, n, mesh.coords["data"]))
        final = dp_sgd_sharded(mesh, params, [batch], n)
        return out.grads, out.sq_norms, out.stats, final

    for r, (grads, sq, stats, final) in enumerate(run_on_mesh(body, {"data": n}, backend="distributed")):
        assert max_diff(grads, owners_view(ref_grads, n, r)) <= 1e-10
        assert (sq - ref_sq).abs().max().item() <= 1e-10
        assert stats == expected_bytes(params, n)
        assert max_diff(final, expected) <= 1e-10
