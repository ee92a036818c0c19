"""vmap over stacked shards: an ensemble of models, each sharded like the params.

Every case compares the vmapped step with a Python loop over the members (the same step
on each member's own shards), which is the definition of the batched computation.
"""

import optree
import pytest
import torch

import shardfn as sf
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import GPT, GPTConfig, mlp_loss, mlp_params
from collective_cases import mesh_for as mesh_of  # one simulated mesh per shape, per session

F64 = torch.float64
B = 3  # ensemble members


def stack(trees):
    return optree.tree_map(lambda *xs: torch.stack(xs), *trees)


def max_diff(a, b) -> float:
    pairs = list(zip(optree.tree_leaves(a), optree.tree_leaves(b)))
    assert len(pairs) == len(optree.tree_leaves(b))
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in pairs)


def members_and_batch(seed: int, sizes=(5, 7, 3), rows=8, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    members = [mlp_params(g, list(sizes), dtype=dtype) for _ in range(B)]
    batch = (torch.randn(rows, sizes[0], generator=g, dtype=dtype), torch.randn(rows, sizes[-1], generator=g, dtype=dtype))
    return members, batch


def compare_compositions(step, mesh, members, local, atol=1e-13):
    """On every rank: vmap(step), vmap(grad(step)), grad(sum of vmap(step)) and
    .backward() through vmap(step), each against the loop over members."""

    def body():
        shards = [step.shard_params(p) for p in members]
        stacked = stack(shards)
        batch = local(mesh)
        vstep = torch.func.vmap(step, in_dims=(0, None))
        losses = vstep(stacked, batch)
        loop_losses = torch.stack([step(s, batch) for s in shards])
        loop_grads = stack([torch.func.grad(step)(s, batch) for s in shards])
        per_member = torch.func.vmap(torch.func.grad(step), in_dims=(0, None))(stacked, batch)
        summed = torch.func.grad(lambda s: vstep(s, batch).sum())(stacked)
        eager = optree.tree_map(lambda t: t.detach().clone().requires_grad_(True), stacked)
        vstep(eager, batch).sum().backward()
        eager = optree.tree_map(lambda t: torch.zeros_like(t) if t.grad is None else t.grad, eager)  # frozen: None
        return [(losses - loop_losses).abs().max().item(), max_diff(per_member, loop_grads),
                max_diff(summed, loop_grads), max_diff(eager, loop_grads)]

    for diffs in mesh.run(body):
        assert max(diffs) <= atol, diffs


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reshard", [True, False])
def test_ensemble_equals_a_loop_over_members(world, reshard):
    members, batch = members_and_batch(0, sizes=(5, 7, 4, 3))  # dim 0 of 5/7/4 over 3 ranks: uneven
    mesh = mesh_of({"data": world})  # the batch's 8 rows over 3 ranks: 3, 3, 2, weighted by size
    step = sf.shard(mlp_loss, mesh, reshard_after_forward=reshard, batch_weighting="global_mean")
    compare_compositions(step, mesh, members, lambda m: local_batch(batch, m.rank, world))


def test_ensemble_hsdp_and_frozen_leaves():
    members, batch = members_and_batch(1)
    mesh = mesh_of({"replica": 2, "shard": 2})
    step = sf.shard(mlp_loss, mesh, data_axes=("replica", "shard"), shard_axes="shard",
                    frozen=lambda path: path[-1] == "b")
    compare_compositions(step, mesh, members, lambda m: local_batch(batch, m.rank, 4))


def test_ensemble_with_tensor_parallel_specs():
    """FSDP x TP: the leaves replicated over 'model' get their all-reduce per member."""
    g = torch.Generator().manual_seed(2)
    members = [{"w1": torch.randn(6, 8, generator=g, dtype=F64), "w2": torch.randn(8, 6, generator=g, dtype=F64),
                "s": torch.randn(6, generator=g, dtype=F64)} for _ in range(B)]
    x = torch.randn(8, 6, generator=g, dtype=F64)

    def loss_fn(p, x):
        return (sf.psum(torch.tanh((x * p["s"]) @ p["w1"]) @ p["w2"], "model") ** 2).mean()

    mesh = mesh_of({"data": 2, "model": 2})
    step = sf.shard(loss_fn, mesh, param_specs={"w1": sf.P(None, "model"), "w2": sf.P("model"), "s": None})
    compare_compositions(step, mesh, members, lambda m: x.chunk(2)[m.coords["data"]])


def test_ensemble_bf16_compute_matches_the_loop_to_bf16_rounding():
    members, batch = members_and_batch(3, dtype=torch.float32)
    mesh = mesh_of({"data": 2})
    step = sf.shard(mlp_loss, mesh, mixed_precision=sf.MixedPrecision(torch.bfloat16, torch.float32))
    compare_compositions(step, mesh, members, lambda m: local_batch(batch, m.rank, 2), atol=2e-2)


def test_ensemble_of_gpts_through_sf_functional():
    cfg = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=8)
    members = []
    for seed in range(B):
        torch.manual_seed(seed)
        apply_fn, params = sf.functional(GPT(cfg).to(F64))
        members.append(params)
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(0, 17, (4, 8), generator=g)
    mesh = mesh_of({"data": 2})
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    compare_compositions(step, mesh, members, lambda m: (idx.chunk(2)[m.rank], idx.chunk(2)[m.rank]), atol=1e-6)  # the loss is fp32


def test_training_an_ensemble_with_sf_optim_equals_training_each_member():
    members, batch = members_and_batch(4)
    mesh = mesh_of({"data": 2})
    step = sf.shard(mlp_loss, mesh)
    opt = sf.optim.adamw(1e-2)
    grad_fn = torch.func.vmap(torch.func.grad(step), in_dims=(0, None))

    def body():
        local = local_batch(batch, mesh.rank, 2)
        shards = [step.shard_params(p) for p in members]
        stacked, state = stack(shards), opt.init(stack(shards))
        for _ in range(3):
            updates, state = opt.update(grad_fn(stacked, local), state, stacked)
            stacked = sf.optim.apply_updates(stacked, updates)
        singles = []
        for s in shards:
            st = opt.init(s)
            for _ in range(3):
                updates, st = opt.update(torch.func.grad(step)(s, local), st, s)
                s = sf.optim.apply_updates(s, updates)
            singles.append(s)
        return max_diff(stacked, stack(singles))

    assert max(mesh.run(body)) < 1e-12


def test_error_nested_vmap_over_stacked_shards():
    members, batch = members_and_batch(5)
    mesh = mesh_of({"data": 2})
    step = sf.shard(mlp_loss, mesh)

    def body():
        twice = stack([stack([step.shard_params(p) for p in members])] * 2)  # (2, B, ...)
        inner = torch.func.vmap(step, in_dims=(0, None))
        return torch.func.vmap(inner, in_dims=(0, None))(twice, local_batch(batch, mesh.rank, 2))

    with pytest.raises(sf.ShardingError, match="nests once"):
        mesh.run(body)
