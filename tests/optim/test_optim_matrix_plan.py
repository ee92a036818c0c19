"""The owner rule's bytes before any run (`update.plan`, no collective) equal a run's
`update.stats()`; sf.estimate counts Muon's and Adafactor's state (sharded like the params)."""

from __future__ import annotations

import math

import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from matrix_cases import blocks, mlp, mlp_loss, tree_of
from optim_testutil import tree_bytes
from shardfn._spec import chunk_bounds

SHAPES = {"a": (8, 5), "b": (3, 7), "c": (6, 6), "d": (1, 4), "e": (9, 2)}


@pytest.mark.parametrize("shape,axis", [({"data": 2}, "data"), ({"data": 4}, "data"), ({"replica": 2, "shard": 2}, "shard")])
@pytest.mark.parametrize("name", ["muon", "soap"])
def test_plan_equals_the_stats_of_a_run(shape, axis, name):
    params = tree_of(SHAPES, 0, torch.float32)
    mesh = sf.local_mesh(shape)
    make = optim.muon if name == "muon" else optim.soap
    opt = make(0.02, mesh=mesh, specs=sf.P(axis))
    n = shape[axis]

    def rank_fn():
        shards = blocks(params, n, mesh.coords[axis])
        state = opt.init(shards)
        opt.update(shards, state, shards)
        return opt.update.stats(), {p[0]: o for p, (_, o) in opt.update.owners(shards).items()}

    meta = {k: torch.empty(s, device="meta") for k, s in SHAPES.items()}
    plan = opt.update.plan(meta, shape)
    results = mesh.run(rank_fn)
    assert [plan[r] for r in range(len(results))] == [stats for stats, _ in results]
    # summed over ranks: 2 * b * sum_i (N_i - n_i(owner_i)), once per replica group
    owners = results[0][1]
    wire = 2 if name == "muon" else 4  # Muon sends bfloat16 both ways; SOAP the params' float32
    per_group = sum(2 * wire * (math.prod(s) - (lambda b: b[1] - b[0])(chunk_bounds(s[0], n, owners[k])) * s[1])
                    for k, s in SHAPES.items())
    assert sum(p["gather_bytes"] + p["scatter_bytes"] for p in plan.values()) == per_group * (len(plan) // n)


def test_estimate_counts_muon_and_adafactor_state_sharded_like_the_params():
    params = mlp(torch.float32)
    label = lambda path, p: "muon" if p.ndim == 2 else "adamw"  # noqa: E731
    recipe = optim.multi_transform({"muon": optim.muon(0.02), "adamw": optim.adamw(1e-2)}, label)
    est = sf.estimate(mlp_loss, params, ((4, 5), (4, 3)), {"data": 2}, optimizer=recipe)
    # Muon: one momentum buffer per matrix; AdamW: two moments per vector; + the int64 counts
    # (muon's, the lr scale's, adam's, and adamw's lr scale's): rank 0 holds the larger chunks
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(mlp_loss, mesh)
    shards = mesh.run(lambda: step.shard_params(params))[0]
    want = tree_bytes(recipe.init(shards))
    assert est.opt_state_bytes == want
    assert est.param_bytes == tree_bytes(shards)
    fact = sf.estimate(mlp_loss, params, ((4, 5), (4, 3)), {"data": 2}, optimizer=optim.adafactor(1e-2))
    assert fact.opt_state_bytes == tree_bytes(optim.adafactor(1e-2).init(shards)) < est.param_bytes
