"""Adafactor: torch.optim.Adafactor's numbers on one device, and on blocks with the row and
column statistics summed over the mesh (no matrix gathered)."""

from __future__ import annotations

import optree
import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from matrix_cases import blocks, grads_of, mlp, mlp_batches, mlp_loss, rel_err, tree_of
from optim_testutil import NS, clone_tree
from shardfn._backend import ops

SHAPES = {"a": (8, 5), "b": (3, 7), "c": (6,), "d": (1, 4), "e": (2, 3, 4), "s": ()}
SPECS = {k: (sf.P() if len(s) == 0 else sf.P("data")) for k, s in SHAPES.items()}
KWS = [dict(lr=0.01), dict(lr=0.05, weight_decay=0.1, d=1.5, beta2_decay=-0.5, eps=(1e-20, 1e-3), maximize=True)]


def _torch(params, grads, **kw):
    names = list(params)
    ts = [params[k].clone().requires_grad_() for k in names]
    opt = torch.optim.Adafactor(ts, **kw)
    for g in grads:
        for k, t in zip(names, ts):
            t.grad = g[k].clone()
        opt.step()
    return {k: t.detach() for k, t in zip(names, ts)}, opt


def _ours(kw, **extra):
    kw = dict(kw)
    return optim.adafactor(kw.pop("lr"), **kw, **extra)


def _run(opt, params, grads):
    params = clone_tree(params)
    state = opt.init(params)
    for g in grads:
        u, state = opt.update(clone_tree(g), state, params)
        params = optim.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("kw", KWS, ids=["defaults", "options"])
def test_adafactor_equals_torch_adafactor_for_ten_steps(dtype, tol, kw):
    params = tree_of(SHAPES, 0, dtype)
    grads = grads_of(SHAPES, 1, dtype)
    ref, topt = _torch(params, grads, **kw)
    ours, state = _run(_ours(kw), params, grads)
    assert rel_err(ours, ref) <= tol
    tstate = dict(zip(SHAPES, (topt.state[p] for p in topt.param_groups[0]["params"])))
    assert rel_err(state.row_var["a"], tstate["a"]["row_var"]) <= tol
    assert rel_err(state.col_var["e"], tstate["e"]["col_var"]) <= tol
    assert rel_err(state.variance["c"], tstate["c"]["variance"]) <= tol
    assert state.row_var["c"] is None and state.variance["a"] is None


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kw", KWS, ids=["defaults", "options"])
def test_adafactor_on_blocks_equals_torch_and_gathers_no_matrix(n, kw):
    dtype = torch.float32
    params = tree_of(SHAPES, 0, dtype)
    grads = grads_of(SHAPES, 1, dtype)
    ref, _ = _torch(params, grads, **kw)
    mesh = sf.local_mesh({"data": n})
    opt = _ours(kw, mesh=mesh, specs=SPECS)

    def rank_fn():
        r = mesh.coords["data"]
        shards = blocks(params, n, r)
        state = opt.init(shards)
        for g in grads:
            with ops.recording() as rec:
                u, state = opt.update(blocks(g, n, r), state, shards)
            shards = optim.apply_updates(shards, u)
        return shards, state, [(c.op, c.nbytes) for c in rec.records]

    sharded = [k for k, s in SHAPES.items() if s]
    # phase 1: ||p|| per sharded leaf, column sums (n numbers) and the sum of R per 2-D leaf;
    # phase 2: ||u|| per sharded leaf. A 3-D leaf's dims -2, -1 are whole on each rank: no sums.
    phase1 = len(sharded) + sum(s[1] + 1 for s in SHAPES.values() if len(s) == 2)
    phase2 = len(sharded)
    for r, (shards, state, records) in enumerate(mesh.run(rank_fn)):
        assert rel_err(shards, blocks(ref, n, r)) <= 1e-6
        assert records == [("all_reduce", 4 * phase1), ("all_reduce", 4 * phase2)]
        assert state.col_var["a"].shape == (1, 5)  # C is whole: the columns are not split
        assert state.row_var["a"].shape == (blocks(params, n, r)["a"].shape[0], 1)  # R like the rows


def test_adafactor_with_hsdp_and_a_tensor_parallel_split_of_the_last_dim():
    """Specs that split dim -1 too (P('shard', 'model')): the row means are summed over
    'model' first; the result is still the whole leaf's."""
    dtype = torch.float64
    shapes = {"w": (6, 5), "v": (4, 3)}
    params = tree_of(shapes, 3, dtype)
    grads = grads_of(shapes, 4, dtype)
    ref, _ = _torch(params, grads, lr=0.02)
    mesh = sf.local_mesh({"replica": 2, "shard": 2, "model": 2})
    specs = sf.P("shard", "model")
    opt = optim.adafactor(0.02, mesh=mesh, specs=specs)
    from shardfn._spec import local_block

    def rank_fn():
        cut = lambda tree: {k: local_block(v, specs, mesh.coords, mesh.shape).clone() for k, v in tree.items()}  # noqa: E731
        shards = cut(params)
        state = opt.init(shards)
        for g in grads:
            u, state = opt.update(cut(g), state, shards)
            shards = optim.apply_updates(shards, u)
        return shards, cut(ref)

    for shards, want in mesh.run(rank_fn):
        assert rel_err(shards, want) <= 1e-12


FROZEN = ("layers", 1, "w")


@pytest.mark.slow
@pytest.mark.ci
def test_adafactor_under_sf_shard_with_accumulation_and_a_frozen_leaf_equals_torch():
    n = 4
    params = mlp()
    batches = mlp_batches(n)
    paths, ps, treedef = optree.tree_flatten_with_path(params, namespace=NS)
    ts = [p.clone().requires_grad_() for p in ps]
    topt = torch.optim.Adafactor([t for path, t in zip(paths, ts) if path != FROZEN], lr=0.02, weight_decay=0.01)
    for batch in batches:
        grads = torch.autograd.grad(mlp_loss(optree.tree_unflatten(treedef, ts), batch), ts)
        for t, g in zip(ts, grads):
            t.grad = g
        topt.step()
    ref = optree.tree_unflatten(treedef, [t.detach() for t in ts])
    mesh = sf.local_mesh({"data": n})
    step = sf.shard(mlp_loss, mesh, frozen=lambda path: path == FROZEN)

    def rank_fn():
        shards = step.shard_params(clone_tree(params))
        opt = optim.multi_transform({"fact": optim.adafactor(0.02, weight_decay=0.01, mesh=mesh, specs=step.specs),
                                     "frozen": optim.set_to_zero()},
                                    lambda path: "frozen" if path == FROZEN else "fact")
        state = opt.init(shards)
        r = mesh.coords["data"]
        for x, y in batches:
            local = (x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])
            grads, _ = step.accumulate(shards, [(local[0][:2], local[1][:2]), (local[0][2:], local[1][2:])])
            u, state = opt.update(grads, state, shards)
            shards = optim.apply_updates(shards, u)
        return step.unshard_params(shards)

    for full in mesh.run(rank_fn):
        assert torch.equal(full["layers"][1]["w"], params["layers"][1]["w"])
        assert rel_err(full, ref) <= 1e-10


def test_adafactor_inside_multi_transform_sees_its_leaves_only():
    params = tree_of(SHAPES, 0, torch.float64)
    grads = grads_of(SHAPES, 1, torch.float64, steps=3)
    label = lambda path, p: "fact" if p.ndim >= 2 else "sgd"  # noqa: E731
    opt = optim.multi_transform({"fact": optim.adafactor(0.01), "sgd": optim.sgd(0.1)}, label)
    ours, _ = _run(opt, params, grads)
    ref, _ = _torch({k: v for k, v in params.items() if v.ndim >= 2},
                    [{k: v for k, v in g.items() if v.ndim >= 2} for g in grads], lr=0.01)
    assert rel_err({k: ours[k] for k in ref}, ref) <= 1e-12


def test_bad_hyperparameters_are_value_errors():
    with pytest.raises(ValueError, match="beta2_decay"):
        optim.adafactor(0.01, beta2_decay=0.5)
    with pytest.raises(ValueError, match="clipping threshold d"):
        optim.adafactor(0.01, d=0.5)
