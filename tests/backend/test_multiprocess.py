"""run_multiprocess: the harness the distributed-backend tests stand on."""

import gc
import os
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing import RankProcessError, run_multiprocess, run_on_mesh
from shardfn.testing import _multiprocess

pytestmark = pytest.mark.multiprocess


def test_results_in_rank_order_with_args_env_and_closures():
    offset = 100  # captured by the closure: fork needs no pickling of fn

    def body(a, b=0):
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "env": {v: os.environ[v] for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME",
                                                "OMP_NUM_THREADS", "MASTER_ADDR", "EXTRA")},
            "threads": torch.get_num_threads(),
            "value": offset + a + b,
            "backend": dist.get_backend(),
        }

    results = run_multiprocess(body, 3, 1, b=2, env={"EXTRA": "yes"})
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["world"] == 3 and r["value"] == 103 and r["threads"] == 1 and r["backend"] == "gloo"
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
                            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                            "MASTER_ADDR": "127.0.0.1", "EXTRA": "yes"}
    assert "EXTRA" not in os.environ  # the parent's environment is untouched
    assert run_multiprocess(lambda: torch.arange(3) * (dist.get_rank() + 1), 2)[1].tolist() == [0, 2, 4]


def test_lambda_and_single_process():
    assert run_multiprocess(lambda: dist.get_world_size(), 1) == [1]


def test_unpicklable_result_is_reported():
    with pytest.raises(RankProcessError, match=r"rank [01] raised .*(Pickl|pickle)") as info:
        run_multiprocess(lambda: (lambda: None), 2)
    assert info.value.rank in (0, 1)


def test_exit_codes_are_reported():
    with pytest.raises(RankProcessError, match=r"rank 1 exited with code 3 without reporting a result"):
        run_multiprocess(lambda: os._exit(3) if dist.get_rank() == 1 else 0, 2)
    with pytest.raises(RankProcessError, match=r"rank 0 raised SystemExit: 4"):
        run_multiprocess(lambda: sys.exit(4), 1)


def test_timeout_names_the_ranks_still_running(monkeypatch):
    monkeypatch.setattr(_multiprocess, "_MARGIN_S", 0.5)

    def body():
        if dist.get_rank() == 1:
            threading.Event().wait()  # hangs until killed: no sleep, no duration to tune
        return "done"

    start = time.monotonic()
    with pytest.raises(RankProcessError, match=(
        r"2 processes did not finish within 1 s \(\+0.5 s margin\); ranks still running: \[1\]; "
        r"ranks that returned: \[0\]"
    )) as info:
        run_multiprocess(body, 2, timeout=1.0)
    assert time.monotonic() - start < 10.0  # 1.5 s expected; a bound on a hang, 6x margin under load
    assert info.value.rank is None and info.value.failures == {1: "rank 1 was still running"}


def test_fork_while_holding_gloo_groups():
    """[Note: fork, not spawn]: inherited gloo groups must not be collected in the child."""
    mesh = sf.local_mesh({"data": 2})
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(1), "data").item()) == [2.0, 2.0]
    cycle = [sf.local_mesh({"data": 2})]
    cycle.append(cycle)  # only the cyclic collector can free it
    del cycle

    def body():
        gc.collect()  # would reach the inherited groups without gc.freeze() in the parent
        return dist.get_rank()

    for _ in range(3):
        assert run_multiprocess(body, 2, timeout=20) == [0, 1]
    gc.collect()
    assert mesh.run(lambda: mesh.all_reduce(torch.ones(1), "data").item()) == [2.0, 2.0]


def test_run_on_mesh_rejects_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \('simulated', 'distributed'\), got 'mpi'"):
        run_on_mesh(lambda mesh: None, {"data": 2}, "mpi")


@pytest.mark.slow
def test_many_groups_in_a_row():
    """Start-up stays cheap and clean over many process groups (flakiness canary)."""
    for i in range(20):
        out = run_on_mesh(lambda mesh: mesh.all_reduce(torch.tensor([1.0]), "data").item(), {"data": 2},
                          "distributed", timeout=20)
        assert out == [2.0, 2.0], i
