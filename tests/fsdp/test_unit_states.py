"""A unit's two states and its named transitions ([Note: a unit's two states] in
shardfn/_fsdp/unit.py): the sequence one unit goes through over a step, per option, and
the internal error a transition out of order raises.

The sequences are recorded on rank 0 of a simulated mesh through `UnitRuntime.observer`,
which sees every unit after each transition, on the second step (the first has no forward
prefetch: the access order is learned on it).
"""

import pytest
import torch

import shardfn as sf
from shardfn import _tree
from shardfn._fsdp import api
from shardfn._fsdp.unit import UnitRuntime, UnitStateError
from shardfn.testing._ddp import local_batch
from shardfn.testing.models import mlp_loss, mlp_params
from collective_cases import mesh_for  # one simulated mesh per shape, per session

F64 = torch.float64
ROWS = 8


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = mlp_params(g, [5, 7, 6, 3], dtype=F64)  # three layer units, no root
    batch = (torch.randn(ROWS, 5, generator=g, dtype=F64), torch.randn(ROWS, 3, generator=g, dtype=F64))
    return params, batch


def record_second_step(monkeypatch, mesh, run_step, **options):
    """Per unit (by index), the (transition, training state, parameters state) after each
    of its transitions on rank 0 during the second of two steps run by `run_step(step,
    shards, batch)`."""
    params, batch = setup()
    step = sf.shard(mlp_loss, mesh, data_axes=tuple(mesh.axis_names), **options)
    seen = {}  # rank -> [(unit, transition, training, state)]

    def observe(unit, transition):
        log = seen.get(mesh.rank)
        if log is not None:
            log.append((unit, transition, unit.training.name, unit.state.name))

    monkeypatch.setattr(UnitRuntime, "observer", observe)

    def body():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        run_step(step, shards, local)
        seen[mesh.rank] = []
        run_step(step, shards, local)
        log, seen[mesh.rank] = seen[mesh.rank], None
        units = api.rank_state(step, api.plan_of(step, shards)).units
        return [[entry[1:] for entry in log if entry[0] is unit] for unit in units], units

    return mesh.run(body)[0]


def fast(step, shards, batch):
    step.grad_and_value(shards, batch)


def func(step, shards, batch):
    torch.func.grad(step)(shards, batch)


# The middle unit of three (first unit: no forward prefetch of it; last: no backward one).
PREFETCH_RESHARD = [
    ("begin_step", "IDLE", "SHARDED"),
    ("prefetch_forward", "IDLE", "GATHERING"),  # when unit 0 is entered
    ("pre_forward", "FORWARD", "GATHERED"),
    ("post_forward", "FORWARD", "SHARDED"),  # when unit 2 is entered
    ("post_forward", "FORWARD", "SHARDED"),  # the end of the forward: every unit, freed or not
    ("prefetch_backward", "FORWARD", "GATHERING"),  # when unit 2 is brought back
    ("pre_backward", "PRE_BACKWARD", "GATHERED"),
    ("post_backward", "POST_BACKWARD", "SHARDED"),
]


@pytest.mark.parametrize("run_step", [fast, func])
def test_a_unit_with_prefetch_and_reshard_goes_through_every_state(monkeypatch, run_step):
    sequences, _ = record_second_step(monkeypatch, mesh_for({"data": 2}), run_step)
    assert sequences[1] == PREFETCH_RESHARD
    first, last = sequences[0], sequences[2]
    assert [t for t, *_ in first] == ["begin_step", "pre_forward", "post_forward", "post_forward",
                                      "prefetch_backward", "pre_backward", "post_backward"]
    assert [t for t, *_ in last] == ["begin_step", "prefetch_forward", "pre_forward", "post_forward",
                                     "pre_backward", "post_backward"]


def test_without_prefetch_nothing_is_gathering_between_transitions(monkeypatch):
    sequences, _ = record_second_step(monkeypatch, mesh_for({"data": 2}), fast, prefetch=0)
    assert sequences[1] == [
        ("begin_step", "IDLE", "SHARDED"),
        ("pre_forward", "FORWARD", "GATHERED"),
        ("post_forward", "FORWARD", "SHARDED"),
        ("post_forward", "FORWARD", "SHARDED"),
        ("pre_backward", "PRE_BACKWARD", "GATHERED"),
        ("post_backward", "POST_BACKWARD", "SHARDED"),
    ]


def test_without_reshard_a_unit_stays_gathered_from_its_forward_to_its_backward(monkeypatch):
    sequences, _ = record_second_step(monkeypatch, mesh_for({"data": 2}), fast, reshard_after_forward=False)
    assert sequences[0] == [
        ("begin_step", "IDLE", "SHARDED"),
        ("pre_forward", "FORWARD", "GATHERED"),
        ("post_backward", "POST_BACKWARD", "SHARDED"),
    ]
    assert sequences[1] == [
        ("begin_step", "IDLE", "SHARDED"),
        ("prefetch_forward", "IDLE", "GATHERING"),
        ("pre_forward", "FORWARD", "GATHERED"),
        ("post_backward", "POST_BACKWARD", "SHARDED"),
    ]


def test_hpz_keeps_rows_from_the_forward_to_the_backward(monkeypatch):
    mesh = mesh_for({"node": 2, "gpu": 2})
    sequences, _ = record_second_step(monkeypatch, mesh, fast, reshard_after_forward="gpu")
    assert sequences[1] == [
        ("begin_step", "IDLE", "SHARDED"),
        ("prefetch_forward", "IDLE", "GATHERING"),
        ("pre_forward", "FORWARD", "GATHERED_KEPT"),  # k / M rows cut from the forward's all-gather
        ("post_forward", "FORWARD", "SHARDED_POST_FORWARD"),
        ("post_forward", "FORWARD", "SHARDED_POST_FORWARD"),
        ("prefetch_backward", "FORWARD", "GATHERING_KEPT"),  # over 'gpu' only
        ("pre_backward", "PRE_BACKWARD", "GATHERED_KEPT"),
        ("post_backward", "POST_BACKWARD", "SHARDED"),  # the kept rows dropped too
    ]


def test_a_frozen_unit_is_released_by_the_unit_before_it_and_stays_pre_backward(monkeypatch):
    sequences, units = record_second_step(monkeypatch, mesh_for({"data": 2}), fast,
                                          frozen=lambda path: path[:2] == ("layers", 1))
    assert units[1].plan.frozen and not units[0].plan.frozen
    assert sequences[1] == [
        ("begin_step", "IDLE", "SHARDED"),
        ("prefetch_forward", "IDLE", "GATHERING"),
        ("pre_forward", "FORWARD", "GATHERED"),
        ("post_forward", "FORWARD", "SHARDED"),
        ("post_forward", "FORWARD", "SHARDED"),
        ("prefetch_backward", "FORWARD", "GATHERING"),
        ("pre_backward", "PRE_BACKWARD", "GATHERED"),  # brought with unit 0, which it feeds
        ("release_frozen", "PRE_BACKWARD", "SHARDED"),  # after unit 0's backward: no node of its own
    ]


def test_reverse_over_reverse_gathers_every_unit_again_for_the_second_backward(monkeypatch):
    def hvp(step, shards, batch):  # grad(<grad(step), v>), v = ones
        def dot(s):
            return sum(g.sum() for g in _tree.flatten(torch.func.grad(step)(s, batch))[0])

        torch.func.grad(dot)(shards)

    sequences, _ = record_second_step(monkeypatch, mesh_for({"data": 2}), hvp)
    for sequence in sequences:
        transitions = [t for t, *_ in sequence]
        first = transitions.index("post_backward")
        assert transitions[first + 1:] == ["pre_second_backward", "post_second_backward"]
        assert sequence[-2][1:] == ("POST_BACKWARD", "GATHERED")
        assert sequence[-1][1:] == ("POST_BACKWARD", "SHARDED")


# -- transitions out of order -------------------------------------------------------------


def one_step_state(mesh, after_backward=True, then=None):
    """Rank 0's RankState after one step (forward only, or forward and backward), and what
    `then(state)` returns on rank 0 (run on every rank: its transitions may all-gather)."""
    params, batch = setup()
    step = sf.shard(mlp_loss, mesh)

    def body():
        shards = step.shard_params(params)
        local = local_batch(batch, mesh.rank, mesh.size)
        if after_backward:
            step.grad_and_value(shards, local)
        else:
            step(shards, local)
        state = api.rank_state(step, api.plan_of(step, shards))
        return state, then(state) if then is not None else None

    return mesh.run(body)[0]


def test_a_schedule_that_frees_after_the_backward_is_a_named_internal_error():
    state, _ = one_step_state(mesh_for({"data": 2}))
    with pytest.raises(UnitStateError, match=r"shard internal error: unit \('layers', 0\) cannot post_forward: "
                                             r"it is POST_BACKWARD with its parameters SHARDED, and post_forward "
                                             r"needs training state FORWARD\. This is a bug in shard's schedule"):
        state.post_forward()  # the rank's transition, run again after the backward


def test_entering_a_unit_twice_in_one_forward_is_a_named_internal_error():
    state, _ = one_step_state(mesh_for({"data": 2}), after_backward=False)
    unit = state.units[2]  # the step's post_forward freed it
    assert (unit.training.name, unit.state.name) == ("FORWARD", "SHARDED")
    with pytest.raises(UnitStateError, match=r"unit \('layers', 2\) cannot pre_forward: it is FORWARD with its "
                                             r"parameters SHARDED, and pre_forward needs training state IDLE\."):
        unit.pre_forward([])


def test_a_parameters_precondition_names_the_states_it_needs():
    def regather_then_reenter(state):
        unit = state.units[0]
        unit.pre_backward()  # gathered again for its backward (an all-gather: on every rank)
        with pytest.raises(UnitStateError) as error:
            unit.reenter_forward()
        unit.post_backward()
        return str(error.value), (unit.training.name, unit.state.name, unit.full_held)

    _, (message, after) = one_step_state(mesh_for({"data": 2}), after_backward=False, then=regather_then_reenter)
    assert message.startswith(
        "shard internal error: unit ('layers', 0) cannot reenter_forward: it is PRE_BACKWARD with its parameters "
        "GATHERED, and reenter_forward needs training state FORWARD and parameters SHARDED or SHARDED_POST_FORWARD "
        "or GATHERING or GATHERING_KEPT.")
    assert after == ("POST_BACKWARD", "SHARDED", False)


def test_post_backward_of_a_unit_the_step_never_entered_is_refused_unless_its_shards_were_stacked():
    state, _ = one_step_state(mesh_for({"data": 2}), after_backward=False)
    unit = state.units[1]
    unit.begin_step(unit.step.shards)
    with pytest.raises(UnitStateError, match=r"cannot post_backward: it is IDLE with its parameters SHARDED, and "
                                             r"post_backward needs training state FORWARD or PRE_BACKWARD \(or IDLE "
                                             r"with stacked shards\)\."):
        unit.post_backward()
    unit.step.stacked = True  # vmap over an ensemble outside grad: its gather's backward comes here
    unit.post_backward()
    assert unit.training.name == "POST_BACKWARD"
