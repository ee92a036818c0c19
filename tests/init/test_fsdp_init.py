"""Sharded initialization: `sf.init` descriptions and `step.init_shards(init_fn, seed)`.

The contract: each rank draws only its own shards, the global values do not depend on
the world size (bit for bit, N = 1, 2, 4, with and without tensor parallelism) and equal
`sf.init.materialize`; the shards are `shard_params`' shards of that tree, so training
from them is training from `shard_params(materialize(...))`; no rank ever holds more
than its shards plus one leaf (measured with torch.profiler's memory timeline).
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import shardfn as sf
from allocations import net_and_peak
from collective_cases import mesh_for
from shardfn._init.describe import ROW_BLOCK_NUMEL
from shardfn.testing import run_on_mesh
from shardfn.testing.models import GPT, GPTConfig

P = sf.P
I = sf.init


def description():
    """Every initializer; uneven and empty chunks at N = 4 (7 and 3 rows); leaves spanning
    several row blocks (300 x 512: 128-row blocks, cut by the rank boundaries); a 0-dim,
    an integer, a bfloat16 and a float64 leaf."""
    return {
        "embed": I.normal(0.0, 0.02)((300, 512)),
        "layers": [
            {"w": I.kaiming_uniform(a=math.sqrt(5))((7, 5)), "b": I.uniform(-0.1, 0.1)((7,)),
             "g": I.trunc_normal(0.0, 1.0, -2.0, 2.0)((3, 4, 2)), "scale": I.ones()((5,))}
            for _ in range(3)
        ],
        "xn": I.xavier_normal()((16, 6), torch.float64),
        "xu": I.xavier_uniform(gain=2.0)((6, 16), torch.bfloat16),
        "kn": I.kaiming_normal(mode="fan_out")((9, 3, 2)),
        "temperature": I.constant(0.5)(()),
        "step": I.zeros()((4,), torch.int64),
    }


def _loss(params, x):
    h = x
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"].T * layer["scale"])
    return h.square().mean()


def _one_unit_per_leaf(path):
    return path




# -- N-independence -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_unsharded_init_shards_equal_materialize_at_every_world_size(n):
    desc = description()
    full = I.materialize(desc, seed=1234)
    mesh = mesh_for({"data": n})
    step = sf.shard(_loss, mesh, units=_one_unit_per_leaf)  # units of one dtype each

    def body():
        shards = step.init_shards(desc, seed=1234)
        reference = step.shard_params(full)  # shard_params' layout of the same tree
        sf.testing.assert_trees_equal(shards, reference)
        sf.testing.assert_trees_equal(step.unshard_params(shards), full)
        return tuple(shards["embed"].shape)

    rows = [math.ceil(300 / n)] * n
    rows[-1] = 300 - sum(rows[:-1])
    assert mesh.run(body) == [(r, 512) for r in rows]


@pytest.mark.multiprocess
def test_processes_draw_the_same_tree():
    desc = description()
    full = I.materialize(desc, seed=9)

    def body(mesh):
        step = sf.shard(_loss, mesh, units=_one_unit_per_leaf)
        shards = step.init_shards(desc, seed=9)
        sf.testing.assert_trees_equal(shards, step.shard_params(full))
        return step.unshard_params(shards)

    for unsharded in run_on_mesh(body, {"data": 2}, "distributed"):
        sf.testing.assert_trees_equal(unsharded, full)


def test_a_function_description_runs_on_the_meta_device_and_seeds_matter():
    seen = []

    def init_fn():
        seen.append(torch.empty(1).device.type)
        return description()

    a = I.materialize(init_fn, seed=0)
    sf.testing.assert_trees_equal(a, I.materialize(description(), seed=0))
    assert seen == ["meta"]
    b = I.materialize(description(), seed=1)
    assert not torch.equal(a["embed"], b["embed"])
    # Leaves with the same initializer and shape get different values (the path is in the key).
    assert not torch.equal(a["layers"][0]["w"], a["layers"][1]["w"])


def test_initializers_follow_their_distributions():
    full = I.materialize(description(), seed=0)
    e = full["embed"]
    assert abs(e.mean().item()) < 1e-3 and abs(e.std().item() - 0.02) < 1e-3
    w = full["layers"][0]["w"]
    bound = 1 / math.sqrt(5)  # nn.Linear's default: kaiming_uniform(a=sqrt(5)) = U(±1/sqrt(fan_in))
    assert w.abs().max() <= bound
    assert full["layers"][0]["g"].abs().max() <= 2.0
    assert full["layers"][0]["b"].abs().max() <= 0.1
    assert torch.equal(full["layers"][0]["scale"], torch.ones(5))
    assert full["temperature"].shape == () and full["temperature"].item() == 0.5
    assert full["step"].dtype == torch.int64 and full["step"].tolist() == [0, 0, 0, 0]
    assert full["xu"].dtype == torch.bfloat16 and full["xn"].dtype == torch.float64
    assert full["xu"].float().abs().max() <= 2.0 * math.sqrt(6 / 22) + 1e-2
    big = I.materialize({"k": I.kaiming_normal(mode="fan_out")((64, 512, 3))}, seed=0)["k"]
    assert abs(big.std().item() - math.sqrt(2 / (64 * 3))) < 2e-3


@pytest.mark.parametrize("shape", [{"data": 2, "model": 2}, {"data": 4, "model": 1}, {"data": 1, "model": 4}])
def test_tensor_parallel_blocks_are_drawn_in_place(shape):
    desc = {
        "layers": [{"w1": I.normal(std=0.5)((8, 12)), "b1": I.uniform(-1, 1)((12,)), "w2": I.normal()((12, 8)),
                    "b2": I.zeros()((8,)), "scale": I.trunc_normal(1.0, 0.1)((8,))} for _ in range(2)],
        "head": I.normal()((8, 3)),
    }
    specs = {"layers": [{"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None,
                         "scale": None}] * 2, "head": None}
    full = I.materialize(desc, seed=7)
    mesh = mesh_for(shape)
    step = sf.shard(_loss, mesh, param_specs=specs)

    def body():
        shards = step.init_shards(desc, seed=7)
        specs = step.specs  # the layout init_shards reports is shard_params'
        sf.testing.assert_trees_equal(shards, step.shard_params(full))
        assert step.specs == specs
        sf.testing.assert_trees_equal(step.unshard_params(shards), full)
        return True

    assert all(mesh.run(body))


def test_hsdp_replicas_draw_the_same_shards():
    desc = {"w": I.normal()((10, 4)), "b": I.zeros()((4,))}
    mesh = mesh_for({"replica": 2, "shard": 2})
    step = sf.shard(_loss, mesh, data_axes=("replica", "shard"), shard_axes="shard",
                    replicated=lambda path: path == ("b",))  # kept whole on every rank
    full = I.materialize(desc, seed=3)
    out = mesh.run(lambda: (step.init_shards(desc, seed=3), step.unshard_params(step.init_shards(desc, seed=3))))
    for shards, unsharded in out:
        sf.testing.assert_trees_equal(unsharded, full)
    sf.testing.assert_trees_equal(out[0][0], out[2][0])  # same shard coordinate, other replica
    assert out[0][0]["w"].shape == (5, 4) and out[0][0]["b"].shape == (4,)


# -- nn.Module ----------------------------------------------------------------------------------


GPT_INIT = {nn.Linear: {"weight": I.normal(std=0.02), "bias": I.zeros()}, nn.Embedding: {"weight": I.normal(std=0.02)}}
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, sdpa=True)


def gpt_description():
    return I.from_module(GPT(CFG), GPT_INIT)  # init_shards / materialize build GPT on the meta device


def test_from_module_follows_functional_and_gpts_init():
    with torch.device("meta"):
        model = GPT(CFG)
    desc = I.from_module(model, GPT_INIT)
    _, params = sf.functional(model)
    assert optree.tree_structure(desc) == optree.tree_structure(params)
    for d, p in zip(optree.tree_leaves(desc), optree.tree_leaves(params)):
        assert d.shape == tuple(p.shape) and d.dtype == p.dtype
    full = I.materialize(gpt_description, seed=0)
    block = full["transformer"]["h"][0]
    assert abs(full["transformer"]["wte"]["weight"].std().item() - 0.02) < 2e-3
    assert abs(block["mlp"][0]["weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(block["attn"]["c_attn"]["bias"], torch.zeros(96))
    assert torch.equal(block["ln_1"]["weight"], torch.ones(32)) and torch.equal(block["ln_1"]["bias"], torch.zeros(32))
    assert "lm_head" not in full  # tied to wte: described once, like sf.functional's tree


def test_from_module_uses_torchs_defaults():
    with torch.device("meta"):
        net = nn.ModuleDict({"lin": nn.Linear(16, 8), "conv": nn.Conv2d(3, 4, 3),
                             "emb": nn.Embedding(10, 4, padding_idx=2), "ln": nn.LayerNorm(8), "bn": nn.BatchNorm1d(8)})
    desc = I.from_module(net)
    assert desc["lin"]["weight"].init == I.kaiming_uniform(a=math.sqrt(5))
    assert desc["lin"]["bias"].init == I.uniform(-1 / 4, 1 / 4)  # fan_in 16
    assert desc["conv"]["bias"].init == I.uniform(-1 / math.sqrt(27), 1 / math.sqrt(27))
    full = I.materialize(desc, seed=0)
    assert full["lin"]["weight"].abs().max() <= 1 / 4 and full["lin"]["weight"].abs().max() > 0.2
    assert torch.equal(full["emb"]["weight"][2], torch.zeros(4)) and full["emb"]["weight"][3].abs().sum() > 0
    assert torch.equal(full["bn"]["weight"], torch.ones(8)) and torch.equal(full["ln"]["bias"], torch.zeros(8))
    by_name = I.from_module(net, {"lin.weight": I.zeros(), nn.Linear: {"weight": I.ones()}})
    assert by_name["lin"]["weight"].init == I.zeros() and by_name["lin"]["bias"].init == desc["lin"]["bias"].init
    fn = I.from_module(net, lambda path, module, name: I.constant(3.0) if name == "bias" else None)
    assert fn["ln"]["bias"].init == I.constant(3.0) and fn["ln"]["weight"].init == I.ones()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gpt_init_shards_are_world_size_independent(n):
    full = I.materialize(gpt_description, seed=5)
    mesh = mesh_for({"data": n})
    apply_fn, _ = sf.functional(GPT(CFG))
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    for unsharded in mesh.run(lambda: step.unshard_params(step.init_shards(gpt_description, seed=5))):
        sf.testing.assert_trees_equal(unsharded, full)


def test_training_from_init_shards_equals_training_from_shard_params():
    with torch.device("meta"):
        model = GPT(CFG)
    apply_fn, _ = sf.functional(model)
    mesh = mesh_for({"data": 2})
    step = sf.shard(lambda p, b: apply_fn(p, *b), mesh)
    full = I.materialize(gpt_description, seed=11)

    def train(shards):
        losses = []
        idx = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=torch.Generator().manual_seed(mesh.rank))
        for _ in range(3):  # SGD on one batch per rank
            grads, loss = torch.func.grad_and_value(step)(shards, (idx, idx.roll(-1, 1)))
            shards = optree.tree_map(lambda s, g: s - 1.0 * g, shards, grads)
            losses.append(loss)
        return torch.stack(losses), shards

    def body():
        from_init = train(step.init_shards(gpt_description, seed=11))
        from_params = train(step.shard_params(full))
        assert torch.equal(from_init[0], from_params[0])
        sf.testing.assert_trees_equal(from_init[1], from_params[1])
        return from_init[0]

    losses = mesh.run(body)
    assert torch.equal(losses[0], losses[1]) and losses[0][-1] < losses[0][0]


# -- memory ------------------------------------------------------------------------------------


MEMORY_DESC = {
    "embed": I.normal(std=0.02)((1024, 256)),  # 1 MiB, drawn in 256-row blocks
    "layers": [{"w": I.kaiming_uniform(a=math.sqrt(5))((256, 256)), "b": I.zeros()((256,)),
                "ln": I.ones()((256,))} for _ in range(6)],
    "head": I.trunc_normal(std=0.02)((256, 512)),
}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_no_rank_holds_more_than_its_shards_and_one_leaf(n):
    leaves = optree.tree_leaves(MEMORY_DESC)
    model_bytes = sum(math.prod(p.shape) * 4 for p in leaves)
    largest = max(math.prod(p.shape) * 4 for p in leaves)
    mesh = mesh_for({"data": n})
    step = sf.shard(_loss, mesh)

    def body():
        step.init_shards(MEMORY_DESC, seed=0)  # warm: the plan, the check's buffers
        if mesh.rank != 0:  # one profiler per process: rank 0's thread on the simulated mesh
            return step.init_shards(MEMORY_DESC, seed=0) and None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            shards = step.init_shards(MEMORY_DESC, seed=0)
        held = sum(x.numel() * x.element_size() for x in optree.tree_leaves(shards))
        return (*net_and_peak(prof), held)

    net, peak, held = mesh.run(body)[0]
    bound = model_bytes / n + largest
    print(f"N={n}: net {net} B, peak {peak} B, shards {held} B, bound {bound:.0f} B "
          f"(model {model_bytes} / {n} + largest leaf {largest})")
    assert held == model_bytes // n  # every dim divides by 4: rank 0 holds exactly 1/N
    assert held <= net <= peak <= bound
    # besides the shards: one row block's draw at a time (+ the few bytes of the agreement
    # check). The shards are each unit's buffer, allocated before the first draw ([Note:
    # shards in one buffer]), so the largest draw's temporaries (the fp32 block and the
    # initializer's own scratch: 448 KiB, the same at every N) land on all of them.
    assert peak - held <= 2 * 4 * ROW_BLOCK_NUMEL + 1024


# -- errors ------------------------------------------------------------------------------------


def test_a_leaf_without_an_initializer_is_named():
    desc = {"w": torch.empty(4, 3, device="meta"), "b": I.zeros()((3,)), "c": I.normal(), "d": 3.0}
    with pytest.raises(sf.ShardingError) as info:
        I.materialize(desc, seed=0)
    message = str(info.value)
    assert "params['w'] is a meta tensor of shape (4, 3) without an initializer" in message
    assert "sf.init.Param((4, 3), sf.init.normal(std=0.02), torch.float32)" in message
    assert "params['c'] is an initializer (sf.init.normal(mean=0.0, std=1.0)) without a shape" in message
    assert "params['d'] is a float, not an sf.init.Param" in message
    assert "params['b']" not in message
    with pytest.raises(sf.ShardingError, match=r"got the module Linear itself as the description; fix: pass "
                                               r"sf.init.from_module\(module\)"):
        I.materialize(nn.Linear(2, 2), seed=0)
    assert I.Param([4, 3], I.zeros()) == I.Param((4, 3), I.zeros()) == I.zeros()(torch.Size([4, 3]))


def test_a_random_initializer_on_an_integer_leaf_is_named():
    mesh = mesh_for({"data": 2})
    step = sf.shard(_loss, mesh)
    desc = {"ids": I.normal()((4,), torch.int64)}
    with pytest.raises(sf.ShardingError, match=r"params\['ids'\] \(shape \(4,\), dtype torch.int64\) has the random "
                                               r"initializer .* needs a floating dtype; fix: .*sf.init.zeros\(\)"):
        mesh.run(lambda: step.init_shards(desc, seed=0))


def test_a_shape_that_does_not_fit_param_specs_is_named():
    mesh = mesh_for({"data": 2, "model": 2})
    step = sf.shard(_loss, mesh, param_specs={"w": P(None, None, "model")})
    with pytest.raises(sf.SpecError, match=r"(?s)param_specs\) for params\['w'\]: invalid partition spec "
                                           r"P\(None, None, 'model'\) for shape \(8, 4\).*has 3 entries"):
        mesh.run(lambda: step.init_shards({"w": I.normal()((8, 4))}, seed=0))
    step = sf.shard(_loss, mesh, param_specs={"w": P("model")})
    with pytest.raises(sf.SpecError, match=r"(?s)params\['w'\] \(shape \(6, 4\)\) has dim 0 split 2 ways over "
                                           r"\('model',\).*Fix: make dim 0 a multiple of 4"):
        mesh.run(lambda: step.init_shards({"w": I.normal()((6, 4))}, seed=0))


def test_ranks_with_different_seeds_fail_together():
    mesh = mesh_for({"data": 2})
    step = sf.shard(_loss, mesh)
    with pytest.raises(sf.ShardingError, match=r"(?s)different parameter descriptions \(or seeds\).*"
                                               r"rank \d has seed \d, rank \d has seed \d"):
        mesh.run(lambda: step.init_shards({"w": I.normal()((4, 4))}, seed=mesh.rank))


def test_bad_seed_unknown_module_and_shard_params_on_meta():
    with pytest.raises(sf.ShardingError, match="seed must be an int, got float"):
        I.materialize({"w": I.zeros()((2,))}, seed=0.5)
    with torch.device("meta"):
        net = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2)})
    with pytest.raises(sf.ShardingError, match=r"params\['attn'\]\['in_proj_weight'\] \(attn.in_proj_weight, shape "
                                               r"\(24, 8\)\) belongs to a MultiheadAttention.*overrides="):
        I.from_module(net)
    with pytest.raises(sf.ShardingError, match="fan in/out need a weight of at least 2 dims"):
        I.materialize({"b": I.kaiming_uniform()((4,))}, seed=0)
    mesh = mesh_for({"data": 2})
    step = sf.shard(_loss, mesh)
    with pytest.raises(sf.ShardingError, match=r"is on the meta device .*step.init_shards\(description, seed\)"):
        mesh.run(lambda: step.shard_params({"w": torch.empty(4, 4, device="meta")}))
