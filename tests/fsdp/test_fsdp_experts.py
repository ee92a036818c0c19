"""Expert parallelism inside sf.shard: param_specs naming a data axis that is not a shard
axis ([Note: expert parallelism] in shardfn/_fsdp/tp.py), against one device in fp64."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from shardfn.testing._ddp import local_batch

E, D = 4, 3  # experts, width


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(D, D, generator=g, dtype=torch.float64),
            "experts": torch.randn(E, D, D, generator=g, dtype=torch.float64) / 2,  # stacked on dim 0
            "scale": torch.randn(E, generator=g, dtype=torch.float64)}


def _global_batch(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    return x, torch.randn(n, D, generator=g, dtype=torch.float64)


def _reference_loss(p, batch):
    """Every token through every expert, weighted: (B, D) -> sum_e scale_e tanh(h W_e)."""
    x, y = batch
    h = x @ p["embed"]
    out = torch.einsum("e,ebd->bd", p["scale"], torch.tanh(torch.einsum("bi,eid->ebd", h, p["experts"])))
    return ((out - y) ** 2).mean()


def _expert_parallel_loss(p, batch):
    """The same on this rank's experts: the tokens of all 'expert' ranks are gathered, each
    rank applies its experts, and psum_scatter returns every rank its tokens' sums."""
    x, y = batch
    h = x @ p["embed"]  # (b, D)
    tokens = sf.all_gather(h, "expert")  # (n_expert * b, D)
    mine = torch.einsum("e,ebd->bd", p["scale"], torch.tanh(torch.einsum("bi,eid->ebd", tokens, p["experts"])))
    out = sf.psum_scatter(mine, "expert")  # (b, D): summed over all experts
    return ((out - y) ** 2).mean()


def _spec(path):
    return sf.P("expert") if path[0] in ("experts", "scale") else None


@pytest.mark.parametrize("shape", [{"data": 2, "expert": 2}, {"data": 1, "expert": 4}, {"expert": 2, "data": 2}])
@pytest.mark.parametrize("how", ["func", "backward"])
def test_expert_weights_split_over_a_data_axis_match_one_device(shape, how):
    params, batch = _params(), _global_batch()
    mesh = sf.local_mesh(shape)
    step = sf.shard(_expert_parallel_loss, mesh, data_axes=("data", "expert"), shard_axes="data",
                    param_specs=_spec)
    n = mesh.size
    want_grads, want_loss = torch.func.grad_and_value(_reference_loss)(params, batch)

    def body():
        shards = step.shard_params(params)
        rank = mesh.group(("data", "expert")).index  # this rank's position among the batch's ranks
        mine = local_batch(batch, rank, n)
        if how == "func":
            grads, loss = torch.func.grad_and_value(step)(shards, mine)
        else:
            leaves = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(), shards)
            loss = step(leaves, mine)
            loss.backward()
            grads = torch.utils._pytree.tree_map(lambda t: t.grad, leaves)
        return float(loss), step.unshard_params(grads), step.specs

    for loss, grads, specs in mesh.run(body):
        assert abs(loss - float(want_loss)) <= 1e-12
        for k in params:
            assert (grads[k] - want_grads[k]).abs().max().item() <= 1e-12, k
        assert specs["experts"] == sf.P(("expert", "data")) and specs["embed"] == sf.P("data")


def test_expert_parallel_training_matches_one_device_over_steps():
    params, batch = _params(), _global_batch()
    mesh = sf.local_mesh({"data": 2, "expert": 2})
    step = sf.shard(_expert_parallel_loss, mesh, data_axes=("data", "expert"), shard_axes="data",
                    param_specs=_spec)
    opt = sf.optim.adamw(1e-2)
    ref, state = params, opt.init(params)
    for _ in range(3):
        grads = torch.func.grad(_reference_loss)(ref, batch)
        updates, state = opt.update(grads, state, ref)
        ref = sf.optim.apply_updates(ref, updates)

    def body():
        shards = step.shard_params(params)
        s = opt.init(shards)
        mine = local_batch(batch, mesh.group(("data", "expert")).index, 4)
        for _ in range(3):
            grads = torch.func.grad(step)(shards, mine)
            updates, s = opt.update(grads, s, shards)
            shards = sf.optim.apply_updates(shards, updates)
        return step.unshard_params(shards)

    for got in mesh.run(body):
        for k in params:
            assert (got[k] - ref[k]).abs().max().item() <= 1e-12, k


def test_a_spec_naming_a_shard_axis_is_still_refused():
    mesh = sf.local_mesh({"data": 2, "expert": 2})
    step = sf.shard(_expert_parallel_loss, mesh, data_axes=("data", "expert"), shard_axes="data",
                    param_specs=lambda path: sf.P("data") if path[0] == "experts" else None)
    with pytest.raises(sf.SpecError) as err:
        mesh.run(lambda: step.shard_params(_params()))
    msg = str(err.value)
    assert "params['experts']" in msg and "names data axes ['data']" in msg and "expert parallelism" in msg
