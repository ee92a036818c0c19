"""clip_by_global_norm / global_norm: equal to torch's clip_grad_norm_, whole and sharded."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
import shardfn.optim as optim
from optim_testutil import NS, assert_close, leaves, make_tree, seed_st, shapes_st, structure


def _torch_clip(grads, max_norm, foreach=None):
    ps = [torch.zeros_like(g, requires_grad=True) for g in leaves(grads)]
    for p, g in zip(ps, leaves(grads)):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=foreach)
    return optree.tree_unflatten(structure(grads), [p.grad for p in ps]), total


# -- unsharded ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    shapes=shapes_st,
    seed=seed_st,
    max_norm=st.sampled_from([1e-3, 0.1, 1.0, 3.0, 1e6]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    foreach=st.sampled_from([None, False, True]),
)
def test_clip_matches_clip_grad_norm(shapes, seed, max_norm, dtype, foreach):
    grads = make_tree(shapes, torch.Generator().manual_seed(seed), dtype)
    ref, total = _torch_clip(grads, max_norm, foreach)
    opt = optim.clip_by_global_norm(max_norm)
    ours, _ = opt.update(grads, opt.init(grads))
    assert_close(ours, ref)
    norm = optim.global_norm(grads)
    assert norm.dtype == dtype
    torch.testing.assert_close(norm, total, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)


def test_clip_scales_only_above_max_norm():
    g = {"a": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    opt = optim.clip_by_global_norm(10.0)
    assert opt.update(g, opt.init(g))[0]["a"].tolist() == [3.0, 4.0]
    opt = optim.clip_by_global_norm(1.0)
    scaled = opt.update(g, opt.init(g))[0]["a"]
    torch.testing.assert_close(scaled, torch.tensor([3.0, 4.0], dtype=torch.float64) / (5.0 + 1e-6))


# -- sharded ------------------------------------------------------------------------------


def _block(t, n, r):
    """Rank r's torch.chunk block of t along dim 0 (trailing ranks may get zero rows)."""
    chunks = torch.chunk(t, n, dim=0)
    return chunks[r] if r < len(chunks) else t[:0]


SHARDED_SHAPES = [(5, 3), (2,), (7,), (1, 4), (3, 2, 2)]


def _global_grads(seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return {
        "layers": [torch.randn(s, generator=gen, dtype=dtype) for s in SHARDED_SHAPES],
        "head": {
            "scale": torch.randn((), generator=gen, dtype=dtype),  # 0-dim: replicated
            "bias": torch.randn(3, generator=gen, dtype=dtype),  # kept whole: replicated
            "temp": [torch.randn((), generator=gen, dtype=dtype)],
        },
    }


def _local(grads, n, r, axis_size_index=None):
    """This rank's view: layer leaves chunked over n ranks, head leaves whole."""
    return {"layers": [_block(t, n, r) for t in grads["layers"]], "head": grads["head"]}


def _specs(axis="data"):
    return {"layers": sf.P(axis), "head": {"scale": None, "bias": sf.P(), "temp": [sf.P()]}}


def _check_against_global(results, ref, n, index_of_rank):
    for rank, local in enumerate(results):
        r = index_of_rank(rank)
        expected = _local(ref, n, r)
        assert_close(local, expected, what=f"rank {rank}")


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sharded_clip_matches_clip_grad_norm_on_the_full_gradient(n, max_norm, dtype):
    grads = _global_grads(n, dtype)
    ref, total = _torch_clip(grads, max_norm)
    mesh = sf.local_mesh({"data": n})
    opt = optim.clip_by_global_norm(max_norm, mesh=mesh, specs=_specs())

    def rank_fn():
        r = mesh.coords["data"]
        local = _local(grads, n, r)
        updates, _ = opt.update(local, opt.init(local))
        return updates, optim.global_norm(local, mesh, specs=_specs())

    results = mesh.run(rank_fn)
    _check_against_global([u for u, _ in results], ref, n, lambda rank: rank)
    for _, norm in results:
        torch.testing.assert_close(norm, total, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_default_counts_0dim_leaves_once(n):
    """Without specs: 0-dim leaves replicated, the rest sharded (sf.shard's layout)."""
    gen = torch.Generator().manual_seed(7)
    grads = {"w": torch.randn(5, 2, generator=gen, dtype=torch.float64), "s": torch.randn((), generator=gen, dtype=torch.float64)}
    _, total = _torch_clip(grads, 1.0)
    mesh = sf.local_mesh({"data": n})

    def rank_fn():
        local = {"w": _block(grads["w"], n, mesh.coords["data"]), "s": grads["s"]}
        return optim.global_norm(local, mesh)

    for norm in mesh.run(rank_fn):
        torch.testing.assert_close(norm, total, rtol=1e-12, atol=0)


def test_sharded_replicated_leaf_needs_its_spec():
    """A whole 1-D leaf on every rank is counted n times unless specs say it is replicated."""
    n = 3
    grads = _global_grads(11)
    _, total = _torch_clip(grads, 1.0)
    mesh = sf.local_mesh({"data": n})

    def rank_fn():
        local = _local(grads, n, mesh.coords["data"])
        return optim.global_norm(local, mesh), optim.global_norm(local, mesh, specs=_specs())

    for without, with_specs in mesh.run(rank_fn):
        torch.testing.assert_close(with_specs, total, rtol=1e-12, atol=0)
        assert without > total * (1 + 1e-6)


@pytest.mark.parametrize("axes", [None, "shard", ("replica", "shard")])
def test_sharded_clip_on_a_2d_mesh_with_partial_replication(axes):
    """HSDP-like: leaves sharded over 'shard', replicated over 'replica'; counted once."""
    grads = _global_grads(13)
    ref, total = _torch_clip(grads, 0.3)
    mesh = sf.local_mesh({"replica": 2, "shard": 2})
    opt = optim.clip_by_global_norm(0.3, mesh=mesh, axes=axes, specs=_specs("shard"))

    def rank_fn():
        local = _local(grads, 2, mesh.coords["shard"])
        updates, _ = opt.update(local, opt.init(local))
        return updates, optim.global_norm(local, mesh, axes=axes, specs=_specs("shard"))

    results = mesh.run(rank_fn)
    _check_against_global([u for u, _ in results], ref, 2, lambda rank: rank % 2)
    for _, norm in results:
        torch.testing.assert_close(norm, total, rtol=1e-12, atol=0)


def test_sharded_inplace_clip():
    n = 2
    grads = _global_grads(17)
    ref, _ = _torch_clip(grads, 0.1)
    mesh = sf.local_mesh({"data": n})
    opt = optim.clip_by_global_norm(0.1, mesh=mesh, specs=_specs(), inplace=True)

    def rank_fn():
        local = optree.tree_map(lambda t: t.clone(), _local(grads, n, mesh.coords["data"]), namespace=NS)
        ptrs = [t.data_ptr() for t in leaves(local)]
        updates, _ = opt.update(local, opt.init(local))
        assert [t.data_ptr() for t in leaves(updates)] == ptrs
        return updates

    _check_against_global(mesh.run(rank_fn), ref, n, lambda rank: rank)


def test_sharded_specs_line_up_by_key_with_an_ordered_dict():
    from collections import OrderedDict

    n = 2
    gen = torch.Generator().manual_seed(19)
    grads = OrderedDict([("w", torch.randn(5, 2, generator=gen, dtype=torch.float64)),
                         ("bias", torch.randn(3, generator=gen, dtype=torch.float64))])
    _, total = _torch_clip(grads, 1.0)
    mesh = sf.local_mesh({"data": n})
    specs = {"bias": sf.P(), "w": sf.P("data")}  # a plain dict: sorted keys, unlike grads

    def rank_fn():
        r = mesh.coords["data"]
        local = OrderedDict([("w", _block(grads["w"], n, r)), ("bias", grads["bias"])])
        return optim.global_norm(local, mesh, specs=specs)

    for norm in mesh.run(rank_fn):
        torch.testing.assert_close(norm, total, rtol=1e-12, atol=0)


# -- errors -------------------------------------------------------------------------------


def test_clip_errors():
    mesh = sf.local_mesh({"data": 2})
    with pytest.raises(ValueError, match=r"clip_by_global_norm: axes \['model'\] are not axes of the mesh; the mesh has axes \['data'\]"):
        optim.clip_by_global_norm(1.0, mesh=mesh, axes="model")
    with pytest.raises(ValueError, match=r"clip_by_global_norm: `axes` and `specs` describe a mesh; pass `mesh` too"):
        optim.clip_by_global_norm(1.0, axes="data")
    opt = optim.clip_by_global_norm(1.0, mesh=mesh, specs={"nope": sf.P("data")})

    def rank_fn():
        g = {"w": torch.ones(2)}
        with pytest.raises(ValueError, match=r"clip_by_global_norm: `specs` must be a pytree prefix of the gradients"):
            opt.update(g, opt.init(g))
        return True

    assert mesh.run(rank_fn) == [True, True]
