"""sf.train_step(step, opt, replicas=...): what it refuses, by message (runs without
torchft: the checks come before the Manager is used; tests/optim/test_replicas_torchft.py
trains across real torchft replicas)."""

import types

import pytest
import torch

import shardfn as sf


def manager(use_async_quorum=False):
    """Only the attribute the checks read: nothing here talks to a Manager."""
    return types.SimpleNamespace(_use_async_quorum=use_async_quorum)


@pytest.fixture(scope="module")
def mesh():
    return sf.local_mesh({"shard": 2})


def test_a_plain_function_is_refused():
    with pytest.raises(sf.SpecError, match=r"(?s)replicas=.*must be an sf.shard step.*got function.*Fix: step = sf.shard"):
        sf.train_step(lambda p, b: p["w"].sum(), sf.optim.sgd(0.1), replicas=manager())


def test_an_asynchronous_quorum_is_refused(mesh):
    step = sf.shard(lambda p, b: (b @ p["w"]).sum(), mesh, data_axes="shard")
    with pytest.raises(sf.SpecError, match=r"(?s)use_async_quorum=True.*stale parameters.*Fix: Manager\(\.\.\., "
                                           r"use_async_quorum=False\)"):
        sf.train_step(step, sf.optim.sgd(0.1), replicas=manager(use_async_quorum=True))


def test_has_aux_and_use_func_are_refused(mesh):
    step = sf.shard(lambda p, b: ((b @ p["w"]).sum(), b), mesh, data_axes="shard", has_aux=True)
    with pytest.raises(sf.SpecError, match=r"has_aux=True is not supported across torchft replicas"):
        sf.train_step(step, sf.optim.sgd(0.1), replicas=manager())
    plain = sf.shard(lambda p, b: (b @ p["w"]).sum(), mesh, data_axes="shard")
    with pytest.raises(sf.SpecError, match=r"(?s)use_func=True.*Fix: drop use_func"):
        sf.train_step(plain, sf.optim.sgd(0.1), replicas=manager(), use_func=True)


def test_state_dict_round_trip_is_per_rank(mesh):
    """The Manager's callbacks: a rank's state at its last step boundary, replaced by a peer's."""
    step = sf.shard(lambda p, b: (b @ p["w"]).sum(), mesh, data_axes="shard")
    train = sf.train_step(step, sf.optim.sgd(0.1), replicas=manager())
    train._current[0] = ({"w": torch.ones(2)}, ())
    sd = train.state_dict(0)
    train.load_state_dict({"shards": {"w": torch.zeros(2)}, "opt_state": ()}, rank=1)
    assert torch.equal(sd["shards"]["w"], torch.ones(2)) and torch.equal(train.state_dict(1)["shards"]["w"],
                                                                         torch.zeros(2))
    assert train._healed == {1: True}
