"""Every error of the matrix-aware path and the per-group optimizers names the leaf and the fix."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
import shardfn.optim as optim


def test_an_owner_out_of_range_is_a_value_error():
    mesh = sf.local_mesh({"data": 2})
    opt = optim.muon(0.02, mesh=mesh, owners=lambda path, shape, size: size)

    def rank_fn():
        shards = {"w": torch.ones(2, 3)}
        opt.update(shards, opt.init(shards), shards)

    with pytest.raises(ValueError, match=r"owners\(params\['w'\], \(4, 3\), 2\) returned 2; it must be an int in \[0, 2\)"):
        mesh.run(rank_fn)


def test_a_spec_with_more_entries_than_dims_names_the_leaf():
    mesh = sf.local_mesh({"data": 2})
    opt = optim.adafactor(0.01, mesh=mesh, specs={"w": sf.P("data"), "b": sf.P("data", None)})

    def rank_fn():
        shards = {"w": torch.ones(2, 3), "b": torch.ones(2)}
        opt.update(shards, opt.init(shards), shards)

    with pytest.raises(sf.SpecError, match=r"(?s)params\['b'\]: spec P\('data', None\) has 2 entries but the leaf has 1"):
        mesh.run(rank_fn)


def test_blocks_that_are_not_torch_chunk_blocks_are_refused():
    """Rows 1 and 3 add up to 4, but torch.chunk of 4 rows over 2 ranks is 2 and 2."""
    mesh = sf.local_mesh({"data": 2})
    opt = optim.muon(0.02, mesh=mesh, specs=sf.P("data"))

    def rank_fn():
        shards = {"w": torch.ones(1 if mesh.coords["data"] == 0 else 3, 3)}
        opt.update(shards, opt.init(shards), shards)

    with pytest.raises(sf.SpecError, match=r"(?s)params\['w'\]: this rank's block has shape \(\d, 3\) but spec "
                                           r"P\('data', None\) .* gives \(2, 3\) of the global shape \(4, 3\)"):
        mesh.run(rank_fn)


def test_specs_that_are_not_a_prefix_of_the_params_are_a_spec_error():
    mesh = sf.local_mesh({"data": 2})
    opt = optim.muon(0.02, mesh=mesh, specs={"v": sf.P("data")})

    def rank_fn():
        shards = {"w": torch.ones(2, 3)}
        opt.update(shards, opt.init(shards), shards)

    with pytest.raises(sf.SpecError, match=r"(?s)scale_by_muon: `specs` must be a pytree prefix of the params"):
        mesh.run(rank_fn)


def test_specs_without_a_mesh_is_a_value_error():
    with pytest.raises(ValueError, match="`specs` describe a mesh; pass `mesh` too"):
        optim.muon(0.02, specs=sf.P("data"))


def test_masked_and_multi_transform_misuse():
    with pytest.raises(TypeError, match="masked: inner is function, not a GradientTransformation"):
        optim.masked(optim.adamw, {"w": True})
    opt = optim.multi_transform({"a": optim.sgd(0.1)}, lambda path: "a")
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"the state has no group 'a'"):
        opt.update(params, optim.MultiTransformState({}), params)


def test_soap_hyperparameters():
    with pytest.raises(ValueError, match="b1 must be in"):
        optim.soap(0.01, b1=1.0)
    with pytest.raises(ValueError, match="precondition_frequency must be an int >= 1"):
        optim.soap(0.01, precondition_frequency=0)
    with pytest.raises(ValueError, match="shampoo_beta must be in"):
        optim.soap(0.01, shampoo_beta=-0.5)
