"""Optimizer state is sharded like the params (ZeRO): bytes held, and equal training to unsharded."""

from __future__ import annotations

import optree
import pytest
import torch

import shardfn as sf
import shardfn.optim as optim
from optim_testutil import NS, assert_close, clone_tree, grad_sequence, leaves, tree_bytes

SHAPES = {"emb": (11, 8), "layers": [(8, 8), (8,), (5, 3)], "out": (3, 8)}


def _full_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    tree = optree.tree_map(lambda s: torch.randn(s, generator=gen, dtype=dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    tree["scale"] = torch.randn((), generator=gen, dtype=dtype)  # 0-dim: replicated
    return tree


def _shard(tree, n, r):
    """Rank r's shards: dim-0 torch.chunk blocks (maybe empty), 0-dim leaves whole."""

    def block(t):
        if t.dim() == 0:
            return t
        chunks = torch.chunk(t, n, dim=0)
        return chunks[r] if r < len(chunks) else t[:0]

    return optree.tree_map(block, tree, namespace=NS)


def _specs(tree):
    return optree.tree_map(lambda t: sf.P() if t.dim() == 0 else sf.P("data"), tree, namespace=NS)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_adam_state_on_shards_is_twice_the_shard_bytes(n):
    full = _full_params()
    full_state = optim.adam(1e-3).init(full)[1]
    full_state_bytes = tree_bytes((full_state.mu, full_state.nu))
    assert full_state_bytes == 2 * tree_bytes(full)
    sharded_total = 0
    for r in range(n):
        shards = _shard(full, n, r)
        state = optim.adam(1e-3).init(shards)[1]
        assert isinstance(state, optim.ScaleByAdamState)
        mu_nu_bytes = tree_bytes(state.mu) + tree_bytes(state.nu)
        assert mu_nu_bytes == 2 * tree_bytes(shards)
        assert tree_bytes(state) == 2 * tree_bytes(shards) + 8  # + the int64 step count
        for m, p in zip(leaves(state.mu), leaves(shards)):
            assert m.shape == p.shape and m.dtype == p.dtype
        sharded_total += tree_bytes(state.mu) + tree_bytes(state.nu) - 2 * full["scale"].element_size()
    # Over all ranks the sharded leaves' state adds up to one replica's: 1/n per rank.
    replicated = 2 * full["scale"].element_size()
    assert sharded_total == full_state_bytes - replicated


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("inplace", [False, True])
def test_sharded_training_equals_unsharded(n, inplace):
    """chain(clip_by_global_norm over the mesh, adamw) on every rank's shards for 20 steps
    gives the chunks of the same optimizer run on the whole tree."""
    full = _full_params(1, torch.float64)
    grads = grad_sequence(full, 2)

    def make(mesh=None, specs=None):
        return optim.chain(
            optim.clip_by_global_norm(2.0, mesh=mesh, specs=specs, inplace=inplace),
            optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 0.05, 4, 20), weight_decay=0.1, inplace=inplace),
        )

    ref = clone_tree(full)
    opt = make()
    state = opt.init(ref)
    for g in grads:
        updates, state = opt.update(clone_tree(g), state, ref)
        ref = optim.apply_updates(ref, updates)

    mesh = sf.local_mesh({"data": n})
    specs = _specs(full)
    sharded_opt = make(mesh, specs)

    def rank_fn():
        r = mesh.coords["data"]
        shards = clone_tree(_shard(full, n, r))
        st = sharded_opt.init(shards)
        for g in grads:
            updates, st = sharded_opt.update(clone_tree(_shard(g, n, r)), st, shards)
            shards = optim.apply_updates(shards, updates, inplace=inplace)
        return shards, st

    for r, (shards, st) in enumerate(mesh.run(rank_fn)):
        assert_close(shards, _shard(ref, n, r), what=f"rank {r} params")
        assert_close(st[1][0].mu, _shard(state[1][0].mu, n, r), what=f"rank {r} mu")
