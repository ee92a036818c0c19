"""train_step: grad_and_value + update + apply, equal to a torch.optim training loop."""

from __future__ import annotations

import pytest
import torch

import shardfn.optim as optim
from optim_testutil import assert_close, clone_tree, leaves


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "l1": {"w": torch.randn(6, 4, generator=gen, dtype=torch.float64), "b": torch.zeros(6, dtype=torch.float64)},
        "l2": {"w": torch.randn(1, 6, generator=gen, dtype=torch.float64)},
        "gain": torch.ones((), dtype=torch.float64),
    }
    batches = [
        (torch.randn(16, 4, generator=gen, dtype=torch.float64), torch.randn(16, 1, generator=gen, dtype=torch.float64))
        for _ in range(10)
    ]
    return params, batches


def loss_fn(params, batch):
    x, y = batch  # (B, 4), (B, 1)
    h = torch.tanh(x @ params["l1"]["w"].T + params["l1"]["b"])  # (B, 6)
    out = params["gain"] * (h @ params["l2"]["w"].T)  # (B, 1)
    return ((out - y) ** 2).mean()


CASES = {
    "sgd": (lambda inplace: optim.sgd(0.1, 0.9, nesterov=True, weight_decay=1e-3, inplace=inplace),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adamw": (lambda inplace: optim.adamw(0.01, inplace=inplace),
              lambda ps: torch.optim.AdamW(ps, lr=0.01)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("inplace", [False, True])
def test_train_step_matches_a_torch_optim_loop(name, inplace):
    make_ours, make_torch = CASES[name]
    params, batches = _problem()

    ref = {k: v for k, v in clone_tree(params).items()}
    ref_leaves = leaves(ref)
    for t in ref_leaves:
        t.requires_grad_()
    topt = make_torch(ref_leaves)
    ref_losses = []
    for batch in batches:
        topt.zero_grad()
        loss = loss_fn(ref, batch)
        loss.backward()
        topt.step()
        ref_losses.append(loss.item())

    opt = make_ours(inplace)
    train = optim.train_step(loss_fn, opt, inplace=inplace)
    shards = clone_tree(params)
    first = leaves(shards)
    state = opt.init(shards)
    losses = []
    for batch in batches:
        shards, state, loss = train(shards, state, batch)
        losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-12, abs=1e-14)
    assert_close(shards, {k: v for k, v in ref.items()})
    if inplace:
        assert all(a is b for a, b in zip(leaves(shards), first))


def test_train_step_with_aux_and_params_requiring_grad():
    params, batches = _problem(1)
    for t in leaves(params):
        t.requires_grad_()

    def with_aux(p, batch):
        loss = loss_fn(p, batch)
        return loss, {"loss_x2": 2 * loss.detach()}

    opt = optim.adam(1e-2)
    train = optim.train_step(with_aux, opt, has_aux=True)
    state = opt.init(params)
    shards = params
    for batch in batches[:3]:
        shards, state, loss, aux = train(shards, state, batch)
        torch.testing.assert_close(aux["loss_x2"], 2 * loss)
        assert loss.grad_fn is None
    # No autograd history accumulates across steps.
    assert all(t.grad_fn is None for t in leaves(shards))


@pytest.mark.parametrize("n", [2, 3])
def test_train_step_on_sf_shard_matches_single_process(n):
    """train_step(sf.shard(loss_fn, mesh), chain(sharded clipping, adamw)) on n simulated
    ranks, each with its slice of the batch, equals single-process training."""
    import optree

    import shardfn as sf

    params, batches = _problem(2)
    batches = [(x[:12], y[:12]) for x, y in batches[:5]]  # 12 rows: divisible by 2 and 3

    def make(mesh=None, specs=None):
        return optim.chain(optim.clip_by_global_norm(0.5, mesh, specs=specs), optim.adamw(0.05, weight_decay=0.1))

    opt = make()
    train = optim.train_step(loss_fn, opt)
    ref, state = clone_tree(params), opt.init(params)
    ref_losses = []
    for batch in batches:
        ref, state, loss = train(ref, state, batch)
        ref_losses.append(loss.item())

    mesh = sf.local_mesh({"data": n})
    step = sf.shard(loss_fn, mesh)

    def rank_main():
        r = mesh.coords["data"]
        shards = step.shard_params(params)
        sharded_opt = make(mesh, step.specs)
        st = sharded_opt.init(shards)
        assert sum(t.numel() for t in leaves(st[1][0].mu)) == sum(t.numel() for t in leaves(shards))
        sharded_train = optim.train_step(step, sharded_opt)
        losses = []
        for x, y in batches:
            shards, st, loss = sharded_train(shards, st, (x.chunk(n)[r], y.chunk(n)[r]))
            losses.append(loss.item())
        return step.unshard_params(shards), losses

    for full, losses in mesh.run(rank_main):
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        assert_close(optree.tree_map(lambda t: t.detach(), full), ref)
