"""Fault injection (shardfn.testing.faults): each fault does what it says, at the point it
names, and shardfn answers it: the other ranks fail fast with a message naming the rank,
or (a corrupted shard under check_finite) no update is applied."""

import functools
import time

import pytest
import torch

import shardfn as sf
from shardfn._backend import flight
from shardfn.testing import RankProcessError, faults, run_multiprocess

HANG_BOUND_S = 10.0  # a bound on a hang (fail-fast paths take well under 1 s), not a timing


def in_fresh_process(test):
    """Run the body in a forked child (a failed simulated rank leaves gloo work behind;
    see tests/backend/test_failures.py's [Note: failure tests run in a fresh process])."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        run_multiprocess(test, 1, *args, timeout=60.0, **kwargs)

    return wrapper


PARAMS = {"layers": [{"w": torch.eye(4, dtype=torch.float64) * (i + 1)} for i in range(2)],
          "b": torch.zeros(4, dtype=torch.float64)}


def loss_fn(p, x):
    for layer in p["layers"]:
        x = torch.tanh(x @ layer["w"])
    return (x + p["b"]).square().mean()


def _train(mesh, steps: int, fault_list=(), **shard_kwargs):
    """`steps` SGD steps of the small model; returns the ring entries (step, n in step, seq)."""
    step = sf.shard(loss_fn, mesh, **shard_kwargs)
    shards = step.shard_params(PARAMS)
    x = torch.ones(2, 4, dtype=torch.float64) * (mesh.rank + 1)
    with faults.inject(mesh, *fault_list) as inj:
        for _ in range(steps):
            grads = torch.func.grad(step)(shards, x)
            shards = torch.utils._pytree.tree_map(lambda s, g: s - 0.1 * g, shards, grads)
    return step, shards, inj


def _seq_of(step_number: int, n: int) -> int:
    """The group sequence number of collective `n` of step `step_number` in `_train`
    (from a fault-free run's flight ring on the simulated mesh)."""
    mesh = sf.local_mesh({"data": 2}, timeout=20)

    def body():
        _train(mesh, step_number)
        mine = [e for e in flight.ring(mesh._backend, mesh.rank) if e[flight.STEP] == step_number]
        return mine[n - 1][flight.SEQ]

    return mesh.run(body)[0]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_kill_a_rank_at_a_step_and_collective():
    want = _seq_of(2, 2)

    def body():
        _train(sf.init_mesh({"data": 2}, timeout=20), 3, [faults.kill(1, step=2, collective=2)])

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=r"rank 1 was killed by SIGKILL") as info:
        run_multiprocess(body, 2, timeout=40)
    assert time.monotonic() - start < HANG_BOUND_S  # long before the 20 s collective timeout
    # rank 0 did not hang: it failed at once, in the collective rank 1 never issued, naming rank 1
    survivor = info.value.failures[0]
    assert f"(collective #{want} on that group) failed on rank 0: the connection to rank 1 broke" in survivor, survivor
    assert "RankAbortedError" in survivor


@pytest.mark.multiprocess
@pytest.mark.slow
def test_drop_a_rank_from_the_store_times_out_naming_it():
    want = _seq_of(2, 1)

    def body():
        _train(sf.init_mesh({"data": 2}, timeout=2), 3, [faults.drop_from_store(1, step=2, collective=1)])

    with pytest.raises(RankProcessError, match=r"rank 0 raised shardfn._errors.CollectiveTimeoutError") as info:
        run_multiprocess(body, 2, timeout=30)
    text = info.value.traceback
    assert f"(collective #{want} on that group) waited more than 2 s on rank 0" in text, text
    assert "ranks [1] did not report (still computing, waiting elsewhere, or dead)" in text, text
    assert info.value.failures.keys() == {0}  # rank 1 is alive, blocked, and not blamed for dying


def test_delay_a_rank_makes_its_peer_wait():
    mesh = sf.local_mesh({"data": 2}, timeout=20)

    def body():
        _, _, inj = _train(mesh, 3, [faults.delay(1, 0.4, step=2, collective=3)])
        mine = [e for e in flight.ring(mesh._backend, mesh.rank) if e[flight.STEP] == 2]
        third = mine[2]
        gap = mine[3][flight.T_ISSUE] - third[flight.T_ISSUE]
        return inj.fired, gap, third[flight.T_END] - third[flight.T_WAIT]

    (fired0, _, waited0), (fired1, gap1, _) = mesh.run(body)
    assert fired0 == [] and fired1 == [("delay", 1, 2, 3)]
    assert gap1 >= 0.4  # rank 1 slept before handing its 3rd collective of step 2 over (numbered, not started)
    assert waited0 >= 0.2  # and rank 0 waited for it in that collective (0.4 s, less rank 1's lag)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_raise_in_a_units_backward_names_the_rank_fast():
    def body():
        _train(sf.init_mesh({"data": 2}, timeout=20), 3, [faults.raise_in_backward("unit ('layers', 1)", rank=1, step=2)])

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=r"rank 1 raised shardfn.testing.faults.InjectedFault: injected fault: "
                                               r"rank 1 raised in the backward of unit \('layers', 1\) \(step 2\)"):
        run_multiprocess(body, 2, timeout=40)
    assert time.monotonic() - start < HANG_BOUND_S


@pytest.mark.slow
@in_fresh_process
def test_raise_in_a_units_backward_on_the_simulated_mesh():
    """The error is rank 2's, named; the peers, though, are inside their deferred
    reduce-scatters, and gloo's `_reduce_scatter_base` work ignores `wait(timeout)` (found
    by this test: `work.wait(50 ms)` blocks until gloo's own timeout), so they leave only at
    the mesh timeout + 2 s, not within a poll slice ([Note: polled waits] in base.py)."""
    mesh = sf.local_mesh({"data": 4}, timeout=3)
    start = time.monotonic()
    with pytest.raises(faults.InjectedFault, match=r"rank 2 raised in the backward of unit \('layers', 1\) "
                                                   r"\(step 2\)") as info:
        mesh.run(lambda: _train(mesh, 3, [faults.raise_in_backward("unit ('layers', 1)", rank=2, step=2)]))
    assert time.monotonic() - start < 3 + 2 + HANG_BOUND_S
    assert "(raised on rank 2 of the simulated mesh, coords {'data': 2})" in info.value.__notes__


def test_corrupt_shard_changes_one_element_and_check_finite_stops_the_update():
    mesh = sf.local_mesh({"data": 2}, timeout=20)
    step = sf.shard(loss_fn, mesh, check_finite=True)
    x = torch.ones(2, 4, dtype=torch.float64)

    def body():
        shards = step.shard_params(PARAMS)
        if mesh.rank == 1:
            shards = faults.corrupt_shard(shards, "['layers'][0]['w']", index=5, value=7.0)
        full = step.unshard_params(shards)["layers"][0]["w"]
        if mesh.rank == 1:
            shards = faults.corrupt_shard(shards, "['layers'][0]['w']", index=5)  # NaN
        with pytest.raises(sf.NonFiniteError) as info:
            torch.func.grad(step)(shards, x)
        return full, str(info.value)

    (full, err0), (_, err1) = mesh.run(body)
    want = PARAMS["layers"][0]["w"].clone()
    want.view(-1)[8 + 5] = 7.0  # rank 1's shard is rows 2-3: flat element 5 of it is row 3, column 1
    assert torch.equal(full, want)
    for err in (err0, err1):
        assert "shard(check_finite=True): the loss is NaN or infinite on ranks [0, 1]" in err, err
        assert "no parameter update was applied" in err
    with pytest.raises(sf.SpecError, match=r"corrupt_shard: no leaf at \['w'\]; the leaves are"):
        faults.corrupt_shard(PARAMS, "['w']")


def test_kill_needs_a_process_per_rank():
    mesh = sf.local_mesh({"data": 2}, timeout=20)
    with pytest.raises(sf.SpecError, match=r"faults.kill: needs a process per rank"):
        faults.inject(mesh, faults.kill(1, step=1))
