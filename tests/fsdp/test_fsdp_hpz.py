"""reshard_after_forward=<shard axes> (ZeRO++ hpZ; FSDP2's int form).

After the forward each rank keeps 1/M of every unit; the backward re-gathers it over the
named sub-axes only. The results must be bit-identical to plain ZeRO-3 (the same values
are gathered, only by another route), the backward all-gathers must run over the
sub-axes, and the kept rows are the extra memory.
"""

import optree
import pytest
import torch

import shardfn as sf
from shardfn._backend import ops
from shardfn.testing import run_on_mesh
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import mlp_loss, mlp_params
from collective_cases import mesh_for as mesh_of  # one simulated mesh per shape, per session

F64 = torch.float64
ROWS = 24  # divisible by every world size used (4, 6, 8): no empty per-rank batch
CASES = [
    ({"node": 2, "gpu": 2}, ("node", "gpu"), "gpu", ("gpu",)),
    ({"node": 2, "gpu": 2}, ("node", "gpu"), 2, ("gpu",)),  # FSDP2's int form: the last shard axis
    ({"node": 2, "gpu": 3}, ("node", "gpu"), "node", ("node",)),  # uneven chunks, the outer axis
    ({"gpu": 2, "node": 2}, ("node", "gpu"), ("gpu",), ("gpu",)),  # shard axes in another order than the mesh's
    ({"replica": 2, "node": 2, "gpu": 2}, ("node", "gpu"), "gpu", ("gpu",)),  # HSDP + hpZ
]


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, [5, 7, 6, 3], dtype=F64)
    batch = (torch.randn(ROWS, 5, generator=g, dtype=F64), torch.randn(ROWS, 3, generator=g, dtype=F64))
    return params, batch


def one_step(mesh, shard_axes, reshard, params, batch, mode):
    data = tuple(mesh.axis_names)
    step = sf.shard(mlp_loss, mesh, data_axes=data, shard_axes=shard_axes, reshard_after_forward=reshard)

    def body():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        with ops.recording() as rec:
            if mode == "fast":
                grads, loss = step.grad_and_value(shards, local)
            else:
                grads, loss = torch.func.grad_and_value(step)(shards, local)
        gathers = [(c.axes, c.nbytes) for c in rec.records if c.op == "all_gather"]
        return float(loss), step.unshard_params(grads), step.stats(), gathers

    return mesh.run(body)


@pytest.mark.parametrize("shape,shard_axes,reshard,sub", CASES, ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("mode", ["fast", "func"])
def test_hpz_is_bit_identical_to_zero3_and_regathers_over_the_sub_axes(shape, shard_axes, reshard, sub, mode):
    params, batch = setup()
    mesh = mesh_of(shape)
    zero3 = one_step(mesh, shard_axes, True, params, batch, mode)
    hpz = one_step(mesh, shard_axes, reshard, params, batch, mode)
    for (l0, g0, s0, ag0), (l1, g1, s1, ag1) in zip(zero3, hpz):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(g0), optree.tree_leaves(g1)))
        # 3 units (the layers; no root): forward over all shard axes, then the backward
        # re-gathers over the sub-axes only.
        assert [axes for axes, _ in ag0] == [shard_axes] * 6
        assert [axes for axes, _ in ag1] == [shard_axes] * 3 + [sub] * 3
        # As sent: the backward re-gathers the same unsharded units (logical bytes), in reverse.
        forward = [n for _, n in ag1[:3]]
        assert [n for _, n in ag1[3:]] == forward[::-1] and [n for _, n in ag0] == [n for _, n in ag1]
        assert s1["all_gather_bytes"] == s0["all_gather_bytes"] == sum(n for _, n in ag1)
        assert s1["peak_gathered_bytes"] > s0["peak_gathered_bytes"]  # + the kept 1/M rows


def test_hpz_keeps_one_mth_of_each_unit_between_forward_and_backward():
    params, batch = setup()
    mesh = mesh_of({"node": 2, "gpu": 2})
    axes = ("node", "gpu")
    step = sf.shard(mlp_loss, mesh, data_axes=axes, shard_axes=axes, reshard_after_forward="gpu")

    def body():
        step(step.shard_params(params), local_batch(batch, mesh.rank, 4))  # forward only
        state = next(s for (r, _), s in step._states.items() if r == mesh.rank)
        return [None if u.kept is None else tuple(u.kept.shape) for u in state.units], \
            [u.plan.shard_numel for u in state.units], [u.state.name for u in state.units]

    for kept, numel, states in mesh.run(body):
        # each of the 3 layer units keeps 2 of the 4 rows of its gathered (4, S) buffer
        assert kept == [(2, n) for n in numel]
        assert states == ["SHARDED_POST_FORWARD"] * 3


def test_hpz_training_with_adamw_is_bit_identical():
    params, _ = setup()
    mesh = mesh_of({"node": 2, "gpu": 2})
    axes = ("node", "gpu")
    batches = [setup(seed)[1] for seed in range(1, 4)]

    def train(reshard):
        step = sf.shard(mlp_loss, mesh, data_axes=axes, shard_axes=axes, reshard_after_forward=reshard)
        opt = sf.optim.adamw(1e-2)
        update = sf.train_step(step, opt)

        def body():
            shards = step.shard_params(params)
            state = opt.init(shards)
            for batch in batches:
                shards, state, _ = update(shards, state, local_batch(batch, mesh.rank, 4))
            return step.unshard_params(shards)

        return mesh.run(body)

    for a, b in zip(train(True), train("gpu")):
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


@pytest.mark.parametrize("value,message", [
    (3, r"(?s)reshard_after_forward=3: an int means 're-gather in the backward within groups of 3 ranks'.*"
        r"give groups of \[2\] ranks\.\nFix: name the axes, e.g. reshard_after_forward='gpu'"),
    ("data", r"names \['data'\], which are not shard axes \('node', 'gpu'\)"),
    ("model", r"'model'"),
    (1.5, r"must be True, False, shard axis names or an int, got 1.5"),
])
def test_hpz_errors(value, message):
    mesh = sf.local_mesh({"data": 1, "node": 2, "gpu": 2})
    with pytest.raises(sf.SpecError, match=message):
        sf.shard(mlp_loss, mesh, data_axes=("data", "node", "gpu"), shard_axes=("node", "gpu"),
                 reshard_after_forward=value)


def test_hpz_over_every_shard_axis_or_the_full_size_is_plain_zero3():
    mesh = mesh_of({"node": 2, "gpu": 2})
    axes = ("node", "gpu")
    for value in (("gpu", "node"), 4):
        step = sf.shard(mlp_loss, mesh, data_axes=axes, shard_axes=axes, reshard_after_forward=value)
        assert step.config.reshard_after_forward is True and step.config.reshard_axes is None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hpz_on_processes_is_bit_identical_to_zero3():
    params, batch = setup()
    axes = ("node", "gpu")

    def body(mesh):
        out = []
        for reshard in (True, "gpu"):
            step = sf.shard(mlp_loss, mesh, data_axes=axes, shard_axes=axes, reshard_after_forward=reshard)
            grads, loss = step.grad_and_value(step.shard_params(params), local_batch(batch, mesh.rank, 4))
            out.append((float(loss), step.unshard_params(grads)))
        return out

    for (l0, g0), (l1, g1) in run_on_mesh(body, {"node": 2, "gpu": 2}, "distributed"):
        assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(g0), optree.tree_leaves(g1)))
