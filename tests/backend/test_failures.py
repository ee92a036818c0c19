"""A failing rank must fail the whole program fast and say who and where, never hang.

[Note: failure tests run in a fresh process] After a simulated rank fails, the peers'
unfinished gloo work stays in retired process groups, and Python's exit then blocks
until gloo's own timeout (the mesh timeout + 30 s); a collective mismatched in shape can
even abort the process. So the simulated-backend cases here run their body in a forked
child (`in_fresh_process`), which leaves with `os._exit`; an assertion that fails in
the child comes back as a RankProcessError carrying its traceback.
"""

import functools
import os
import signal
import threading
import time

import pytest
import torch

import shardfn as sf
from shardfn._backend import ops
from shardfn.testing import RankProcessError, run_multiprocess, run_on_mesh

# A bound on a hang, not a timing benchmark: fail-fast paths take well under 1 s even on a
# loaded 2-core machine (10x+ margin), and each bound sits at most 1/3 of the hang it
# rules out (mesh timeouts of 30 s) or 10x above the timeout the test waits for (1-2 s).
HANG_BOUND_S = 10.0


def in_fresh_process(test):
    """Run the test body in a forked child process; see [Note: failure tests run in a fresh process]."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        run_multiprocess(test, 1, *args, timeout=60.0, **kwargs)

    return wrapper


class CustomError(Exception):
    pass


# -- simulated backend ----------------------------------------------------------------------


@in_fresh_process
def test_rank_error_is_reraised_fast_and_the_mesh_recovers():
    mesh = sf.local_mesh({"data": 4}, timeout=30)  # a timeout far above the bound: only fail-fast passes
    entered = threading.Semaphore(0)  # one release per peer that has issued its all-reduce

    def body():
        if mesh.rank == 2:  # fail only once the others have issued their collective (event order, no sleep)
            for _ in range(mesh.size - 1):
                assert entered.acquire(timeout=HANG_BOUND_S), "a peer never issued its all-reduce"
            raise CustomError("rank 2 failed on purpose")
        with ops.recording(lambda op, axes, nbytes: entered.release()):
            return mesh.all_reduce(torch.ones(3), "data")

    for _ in range(2):  # fail, recover, fail again
        start = time.monotonic()
        with pytest.raises(CustomError, match="rank 2 failed on purpose") as info:
            mesh.run(body)
        assert time.monotonic() - start < HANG_BOUND_S
        assert type(info.value) is CustomError  # the original exception, not a wrapper
        assert "(raised on rank 2 of the simulated mesh, coords {'data': 2})" in info.value.__notes__
        sums = mesh.run(lambda: mesh.all_reduce(torch.tensor([mesh.rank + 1.0]), "data").item())
        assert sums == [10.0] * 4


@in_fresh_process
def test_rank_error_on_a_2d_mesh_stops_every_group():
    mesh = sf.local_mesh({"x": 2, "y": 2}, timeout=30)

    def body():
        mesh.all_reduce(torch.ones(1), "x")  # every rank completes one collective first
        if mesh.coords == {"x": 1, "y": 1}:
            raise KeyError("missing on rank 3")
        mesh.all_reduce(torch.ones(1), "y")
        return mesh.all_reduce(torch.ones(1), ("y", "x")).item()

    start = time.monotonic()
    with pytest.raises(KeyError, match="missing on rank 3"):
        mesh.run(body)
    assert time.monotonic() - start < HANG_BOUND_S
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(1), ("x", "y")).item()) == [4.0] * 4


@in_fresh_process
def test_skipped_collective_times_out_naming_the_late_rank():
    mesh = sf.local_mesh({"data": 4}, timeout=1)

    def body():
        if mesh.rank == 1:
            return None  # skips the collective
        return mesh.all_reduce(torch.ones(3), "data")

    start = time.monotonic()
    with pytest.raises(sf.CollectiveTimeoutError) as info:
        mesh.run(body)
    assert time.monotonic() - start < HANG_BOUND_S
    text = str(info.value)
    assert "all_reduce[sum](shape=(3,), dtype=torch.float32) over mesh axes ('data',) " \
           "(collective #1 on that group) waited more than 1 s" in text, text
    assert "Ranks that did not arrive: [1] (rank 1 is at: no collective yet)" in text, text
    assert "Fix: every rank of the group must issue the same collectives in the same order" in text
    assert isinstance(info.value, TimeoutError)
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(1), "data").item()) == [4.0] * 4


@in_fresh_process
def test_skipped_collective_on_one_axis_names_that_axis():
    mesh = sf.local_mesh({"x": 2, "y": 2}, timeout=1)

    def body():
        mesh.all_reduce(torch.ones(2), ("x", "y"))
        if mesh.rank == 3:
            return None
        return mesh.all_reduce(torch.ones(2), "y")

    with pytest.raises(sf.CollectiveTimeoutError) as info:
        mesh.run(body)
    text = str(info.value)
    # Only the group {2, 3} over 'y' waits: rank 2 reports that rank 3 never came.
    assert "over mesh axes ('y',) (collective #1 on that group) waited more than 1 s on rank 2" in text, text
    assert "Ranks that did not arrive: [3] (rank 3 is at: all_reduce[sum](shape=(2,), dtype=torch.float32) " \
           "(collective #1 over ('x', 'y')))" in text, text


@in_fresh_process
def test_mismatched_collectives_are_a_desync_error():
    mesh = sf.local_mesh({"data": 2}, timeout=30)

    def body():
        from shardfn._backend import ops

        group = mesh.group("data")
        if mesh.rank == 0:
            return ops.all_reduce(group, torch.ones(4))
        return ops.all_gather(group, torch.ones(2))

    start = time.monotonic()
    with pytest.raises(sf.DesyncError, match=(
        r"collectives out of step over mesh axes \('data',\): as collective #1 of that group, rank \d issued"
    )) as info:
        mesh.run(body)
    assert time.monotonic() - start < HANG_BOUND_S
    text = str(info.value)  # either rank may be the one that notices
    assert "rank 0 issued all_reduce[sum](shape=(4,), dtype=torch.float32)" in text, text
    assert "rank 1 issued all_gather(shape=(2,), dtype=torch.float32)" in text, text
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(1), "data").item()) == [2.0, 2.0]


@in_fresh_process
def test_shape_mismatch_is_a_desync_error_not_a_crash():
    # Without the check, gloo aborts the whole process (EnforceNotMet: "Received data size
    # doesn't match expected size" -> std::terminate).
    mesh = sf.local_mesh({"data": 2}, timeout=30)
    with pytest.raises(sf.DesyncError) as info:
        mesh.run(lambda: mesh.all_reduce(torch.ones(4 + mesh.rank), "data"))
    text = str(info.value)
    assert "all_reduce[sum](shape=(4,)" in text and "all_reduce[sum](shape=(5,)" in text, text


# -- distributed backend (real processes) ---------------------------------------------------


@pytest.mark.multiprocess
def test_child_error_names_the_rank_and_message():
    def body():
        mesh = sf.init_mesh({"data": 2}, timeout=30)
        if mesh.rank == 1:
            raise ValueError("bad value on rank 1")
        mesh.all_reduce(torch.ones(1), "data")  # rank 0 waits here until it is killed

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=r"rank 1 raised ValueError: bad value on rank 1") as info:
        run_multiprocess(body, 2)
    assert time.monotonic() - start < HANG_BOUND_S
    err = info.value
    assert (err.rank, err.exc_type, err.exc_message, err.signal) == (1, "ValueError", "bad value on rank 1", None)
    assert "Traceback of rank 1:" in str(err) and "in body" in err.traceback
    assert 'raise ValueError("bad value on rank 1")' in err.traceback
    assert isinstance(err, sf.ShardingError)


@pytest.mark.multiprocess
def test_killed_child_names_the_rank_and_the_signal():
    def body():
        mesh = sf.init_mesh({"data": 2}, timeout=30)
        mesh.all_reduce(torch.ones(1), "data")
        if mesh.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        mesh.all_reduce(torch.ones(1), "data")

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=r"rank 1 was killed by SIGKILL \(exit code -9\)") as info:
        run_multiprocess(body, 2)
    assert time.monotonic() - start < HANG_BOUND_S
    assert info.value.rank == 1 and info.value.signal == "SIGKILL" and info.value.traceback is None


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_skipped_collective_times_out_on_processes():
    def body(mesh):
        if mesh.rank == 1:
            return None
        return mesh.all_reduce(torch.ones(3), "data")

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=(
        r"rank 0 raised shardfn._errors.CollectiveTimeoutError: all_reduce\[sum\]\(shape=\(3,\), "
        r"dtype=torch.float32\) over mesh axes \('data',\) \(collective #1 on that group\) waited more than 2 s"
    )) as info:
        run_on_mesh(body, {"data": 2}, "distributed", timeout=2)
    assert time.monotonic() - start < 2 * HANG_BOUND_S
    assert "ranks [1] did not report" in info.value.traceback
