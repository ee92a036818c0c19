"""Failures are loud, fast and named: desynchronized ranks, non-finite values, interrupts."""

import _thread
import time

import pytest
import torch

import shardfn as sf
from shardfn.testing import RankProcessError, run_on_mesh
from shardfn.testing.models import mlp_loss, mlp_params
from traffic import sent

# A bound on a hang, not a timing benchmark: the fail-fast paths below take ~0.1 s (100x
# margin on a loaded 2-core machine) and the hang they rule out is the mesh timeout,
# twice the bound. The simulated meshes keep that timeout short: stuck gloo work lingers
# until it, holding exit.
MESH_TIMEOUT_S = 12
HANG_BOUND_S = MESH_TIMEOUT_S / 2


def _skip_a_collective(mesh):
    """Rank 1 takes a branch that skips a psum the others issue, then all-reduce again."""
    f = sf.shard_map(lambda x: sf.psum(x, "data"), mesh, sf.P(), sf.P(), check=False)
    if mesh.rank != 1:
        f(torch.ones(2))
    return mesh.all_reduce(torch.ones(3), "data")


def test_desync_is_named_on_the_simulated_mesh():
    mesh = sf.local_mesh({"data": 2}, timeout=MESH_TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(sf.DesyncError, match=r"as collective #1 of that group, rank \d issued all_reduce\[sum\]"
                                             r"\(shape=\((2|3),\).*but rank \d issued all_reduce\[sum\]\(shape=\((2|3),\)"):
        mesh.run(_skip_a_collective, mesh)
    assert time.monotonic() - start < HANG_BOUND_S  # long before the timeout


@pytest.mark.multiprocess
def test_desync_is_named_across_processes():
    def body():
        mesh = sf.init_mesh({"data": 2}, timeout=2 * MESH_TIMEOUT_S, check_collectives=True)
        return _skip_a_collective(mesh)

    from shardfn.testing import run_multiprocess

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=r"DesyncError: collectives out of step over mesh axes \('data',\)"):
        run_multiprocess(body, 2, timeout=30)
    assert time.monotonic() - start < HANG_BOUND_S


@pytest.mark.multiprocess
def test_skipped_collective_times_out_naming_the_op_across_processes():
    def body(mesh):
        if mesh.rank == 0:
            mesh.all_reduce(torch.ones(5), "data")
        return None

    with pytest.raises(RankProcessError, match=r"CollectiveTimeoutError: all_reduce\[sum\]\(shape=\(5,\), "
                                               r"dtype=torch.float32\) over mesh axes \('data',\)"):
        run_on_mesh(body, {"data": 2}, "distributed", timeout=2.0)


def test_nan_in_one_ranks_batch_is_guarded_and_params_unchanged():
    g = torch.Generator().manual_seed(0)
    params = mlp_params(g, [3, 4, 2])
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(mlp_loss, mesh, check_finite=True)
    opt = sf.optim.adamw(0.1)
    train = sf.train_step(step, opt)

    def body():
        shards = step.shard_params(params)
        state = opt.init(shards)
        before = [t.clone() for t in torch.utils._pytree.tree_leaves(shards)]
        x, y = torch.randn(2, 3), torch.randn(2, 2)
        if mesh.rank == 1:
            x[1, 2] = float("nan")
        with pytest.raises(sf.NonFiniteError, match=r"the loss is NaN or infinite on ranks \[1\]"):
            train(shards, state, (x, y))
        after = torch.utils._pytree.tree_leaves(shards)
        return all(torch.equal(a, b) for a, b in zip(before, after))

    assert mesh.run(body) == [True, True]


def test_non_finite_gradient_names_the_unit():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: sum((layer["w"].sqrt() * x).sum() for layer in p["layers"]), mesh,
                    check_finite=True)

    def body():
        shards = step.shard_params({"layers": [{"w": torch.ones(4)}, {"w": torch.tensor([1.0, 0.0, 4.0, 9.0])}]})
        torch.func.grad(step)(shards, torch.ones(4))

    with pytest.raises(sf.NonFiniteError, match=r"the gradient of unit \('layers', 1\) is NaN or infinite on ranks \[0\]"):
        mesh.run(body)


def test_check_finite_off_by_default_costs_nothing():
    mesh = sf.local_mesh({"data": 2})
    step = sf.shard(lambda p, x: (p["w"] * x).sum(), mesh)

    def body():
        shards = step.shard_params({"w": torch.ones(4)})
        with sent() as rec:
            torch.func.grad(step)(shards, torch.ones(4))
        return [(c.op, c.nbytes) for c in rec.records], step.stats()["num_collectives"]

    for records, counted in mesh.run(body):  # what the backend sent: no finiteness flags
        assert sorted(records) == [("all_gather", 16), ("all_reduce", 32), ("reduce_scatter", 16)]  # loss + batch-size check
        assert counted == 3


def test_keyboard_interrupt_stops_every_simulated_rank():
    mesh = sf.local_mesh({"data": 2}, timeout=MESH_TIMEOUT_S)

    def body():
        if mesh.rank == 0:
            _thread.interrupt_main()  # as if the user pressed Ctrl-C in the notebook
            mesh.all_reduce(torch.ones(1), "data")  # rank 1 never joins: would wait MESH_TIMEOUT_S
        return mesh.rank

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        mesh.run(body)
    assert time.monotonic() - start < HANG_BOUND_S
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(()), "data").item()) == [2.0, 2.0]  # usable again
