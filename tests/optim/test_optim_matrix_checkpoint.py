"""Muon + AdamW state saved at step 5 on 4 ranks and resumed on 2: steps 6-10 bit for bit
the uninterrupted run's (the momentum is sharded like the params, so it reshards N -> M)."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from matrix_cases import blocks, grads_of, tree_of

SHAPES = {"a": (8, 5), "b": (3, 7), "c": (6, 6), "d": (1, 4), "bias": (5,), "s": ()}
SPECS = {k: (sf.P() if len(s) == 0 else sf.P("data")) for k, s in SHAPES.items()}


def _make(mesh):
    return optim.multi_transform({"muon": optim.muon(0.02, mesh=mesh, specs=SPECS), "adamw": optim.adamw(1e-2)},
                                 lambda path, p: "muon" if p.ndim == 2 else "adamw")


def _run(params, grads, n, start, stop, load=None, save=None):
    """Steps start..stop-1 on n simulated ranks; each rank's shards after every step."""
    mesh = sf.local_mesh({"data": n})
    opt = _make(mesh)

    def rank_fn():
        r = mesh.coords["data"]
        shards = blocks(params, n, r)
        state = opt.init(shards)
        specs = {"params": SPECS, "opt": sf.checkpoint.specs_like(state, SPECS, params=shards)}
        if load is not None:
            tree = sf.checkpoint.load(load, {"params": shards, "opt": state}, mesh, specs)
            shards, state = tree["params"], tree["opt"]
        history = []
        for i in range(start, stop):
            u, state = opt.update(blocks(grads[i], n, r), state, shards)
            shards = optim.apply_updates(shards, u)
            history.append(shards)
        if save is not None:
            sf.checkpoint.save(save, {"params": shards, "opt": state}, mesh, specs)
        return history

    return mesh.run(rank_fn)


def _whole(per_rank, step, key):
    if not SHAPES[key]:
        return per_rank[0][step][key]
    return torch.cat([h[step][key] for h in per_rank])


@pytest.mark.slow
@pytest.mark.ci
def test_checkpoint_at_step_5_on_4_ranks_resumes_on_2_bit_for_bit(tmp_path):
    params = tree_of(SHAPES, 0, torch.float32)
    grads = grads_of(SHAPES, 1, torch.float32)
    uninterrupted = _run(params, grads, 4, 0, 10)
    _run(params, grads, 4, 0, 5, save=str(tmp_path / "step_5"))
    resumed = _run(params, grads, 2, 5, 10, load=str(tmp_path / "step_5"))
    for step in range(5):
        for key in SHAPES:
            assert torch.equal(_whole(resumed, step, key), _whole(uninterrupted, 5 + step, key)), (6 + step, key)
    # and the run did move: step 10 is not step 5
    assert not torch.equal(_whole(resumed, 4, "a"), _whole(uninterrupted, 4, "a"))


@pytest.mark.slow
def test_adafactor_state_reshards_from_4_ranks_to_2(tmp_path):
    """R split like the rows, C whole (adafactor_state_specs); its sums run in another order
    on 2 ranks than on 4, so the resumed run equals the uninterrupted one to rounding."""
    shapes = {"a": (8, 5), "b": (3, 7), "e": (2, 3, 4), "bias": (5,), "s": ()}
    specs = {k: (sf.P() if len(s) == 0 else sf.P("data")) for k, s in shapes.items()}
    params = tree_of(shapes, 0, torch.float64)
    grads = grads_of(shapes, 1, torch.float64)

    def run(n, start, stop, load=None, save=None):
        mesh = sf.local_mesh({"data": n})
        opt = optim.adafactor(0.02, weight_decay=0.01, mesh=mesh, specs=specs)

        def rank_fn():
            r = mesh.coords["data"]
            shards = blocks(params, n, r)
            state = opt.init(shards)
            tree_specs = {"params": specs, "opt": optim.adafactor_state_specs(state, specs, shards)}
            if load is not None:
                tree = sf.checkpoint.load(load, {"params": shards, "opt": state}, mesh, tree_specs)
                shards, state = tree["params"], tree["opt"]
            for i in range(start, stop):
                u, state = opt.update(blocks(grads[i], n, r), state, shards)
                shards = optim.apply_updates(shards, u)
            if save is not None:
                sf.checkpoint.save(save, {"params": shards, "opt": state}, mesh, tree_specs)
            return shards, state

        return mesh.run(rank_fn)

    def whole(per_rank, key):
        return per_rank[0][0][key] if not shapes[key] else torch.cat([p[key] for p, _ in per_rank])

    uninterrupted = run(4, 0, 10)
    run(4, 0, 5, save=str(tmp_path / "step_5"))
    resumed = run(2, 5, 10, load=str(tmp_path / "step_5"))
    for key in shapes:
        a, b = whole(resumed, key), whole(uninterrupted, key)
        assert (a - b).abs().max().item() <= 1e-12 * max(b.abs().max().item(), 1.0), key
    # C is whole on every rank: the last rank of each run holds the same column factor
    assert (resumed[1][1].col_var["a"] - uninterrupted[3][1].col_var["a"]).abs().max().item() <= 1e-12
