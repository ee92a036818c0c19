"""The flight recorder ([Note: flight recorder] in shardfn/_backend/flight.py).

Each rank rings its last collectives; a timeout, a desync or SIGUSR1 dumps them, and
`python -m shardfn.flight DIR` names the first differing sequence number and the rank
that is behind. Planted faults on real gloo processes: a desync (rank 1 skips an
all-gather, so as the same number it issues the next op) and a hang (rank 1 skips the
last all-gather, so rank 0 waits alone and times out).
"""

import subprocess
import sys

import pytest
import torch

import shardfn as sf
import shardfn.flight
from shardfn._backend import flight, ops
from shardfn.testing import RankProcessError, run_multiprocess


def _loop(mesh, skip_step: int | None, skip_rank: int, steps: int = 3):
    """`steps` steps of all_gather(4), all_gather(2), all_reduce(3); `skip_rank` skips the
    all_gather(2) of step `skip_step`."""
    group = mesh.group("data")
    for step in range(1, steps + 1):
        with flight.step(step):
            ops.all_gather(group, torch.ones(4))
            if not (step == skip_step and mesh.rank == skip_rank):
                ops.all_gather(group, torch.ones(2))
            ops.all_reduce(group, torch.ones(3))


def _cli(path) -> str:
    out = subprocess.run([sys.executable, "-m", "shardfn.flight", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_planted_desync_names_the_behind_rank_and_the_number(tmp_path):
    def body():
        sf.flight.set_dump_dir(tmp_path)
        mesh = sf.init_mesh({"data": 2}, timeout=20, check_collectives=True)
        _loop(mesh, skip_step=3, skip_rank=1)

    with pytest.raises(RankProcessError, match="DesyncError"):
        run_multiprocess(body, 2, timeout=40)
    findings = sf.flight.analyze(str(tmp_path))
    assert len(findings) == 1, findings
    f = findings[0]
    # steps 1-2: #1-#6; step 3: #7 all_gather(4), then #8 differs
    assert (f.axes, f.ranks, f.seq, f.kind, f.behind) == (("data",), (0, 1), 8, "desync", [1])
    assert f.issued[0]["what"] == "all_gather(shape=(2,), dtype=torch.float32)"
    assert f.issued[1]["what"] == "all_reduce[sum](shape=(3,), dtype=torch.float32)"
    assert f.issued[0]["step"] == f.issued[1]["step"] == 3
    assert f.issued[0]["nbytes"] == 8 and f.issued[1]["nbytes"] == 12
    text = sf.flight.report(str(tmp_path))  # what `python -m shardfn.flight` prints (run in the dropped-rank test)
    assert "group over ('data',) of ranks [0, 1]: desync at collective #8" in text, text
    assert "rank 1 is behind: rank 1 skipped all_gather(shape=(2,), dtype=torch.float32)" in text, text
    assert len(text.splitlines()) <= 25  # one screen


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.ci
def test_planted_hang_names_the_behind_rank_and_the_number(tmp_path):
    """Rank 1 skips step 3's all_gather(2) and stops issuing; rank 0 times out on it (2 s),
    dumps, and asks rank 1 (SIGUSR1) to dump too."""

    def body():
        sf.flight.set_dump_dir(tmp_path)
        mesh = sf.init_mesh({"data": 2}, timeout=2)
        group = mesh.group("data")
        for step in range(1, 4):
            with flight.step(step):
                ops.all_gather(group, torch.ones(4))
                if not (step == 3 and mesh.rank == 1):
                    ops.all_gather(group, torch.ones(2))

    with pytest.raises(RankProcessError, match=r"rank 0 raised .*CollectiveTimeoutError: all_gather\(shape=\(2,\)"):
        run_multiprocess(body, 2, timeout=30)
    docs = sf.flight.load(str(tmp_path))
    assert {r: d["reason"] for r, d in docs.items()} == {0: "timeout", 1: "SIGUSR1"}
    (f,) = sf.flight.analyze(docs)
    assert (f.seq, f.kind, f.behind, f.last) == (6, "hang", [1], {0: 6, 1: 5})
    assert f.issued[0]["t_end"] is None and f.issued[1] is None  # rank 0's #6 never finished
    text = sf.flight.report(str(tmp_path))  # `python -m shardfn.flight` itself: the dropped-rank test
    assert "group over ('data',) of ranks [0, 1]: hang at collective #6" in text, text
    assert "rank 0: all_gather(shape=(2,), dtype=torch.float32) 8 B  [step 3]" in text, text
    assert "NOT FINISHED" in text and "rank 1: nothing (its last collective on this group is #5)" in text, text
    assert "=> rank 1 is behind: rank 1 issued 5 collectives on this group, the others issued #6" in text, text


def test_a_shard_step_labels_its_collectives_with_step_and_unit():
    """The ring of a simulated rank after two FSDP steps: every collective has its step, the
    gathers and reduce-scatters their unit, and every one finished."""
    mesh = sf.local_mesh({"data": 2}, timeout=20)
    params = {"layers": [{"w": torch.randn(4, 4)} for _ in range(2)], "b": torch.zeros(4)}

    def loss_fn(p, x):
        for layer in p["layers"]:
            x = torch.tanh(x @ layer["w"])
        return (x + p["b"]).square().mean()

    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        before = len(flight.ring(mesh._backend, mesh.rank))
        for _ in range(2):
            torch.func.grad(step)(shards, torch.ones(2, 4))
        entries = list(flight.ring(mesh._backend, mesh.rank))[before:]
        return [(e[flight.OP], e[flight.STEP], e[flight.UNIT], e[flight.T_END] is not None) for e in entries]

    rings = mesh.run(body)
    assert rings[0] == rings[1]
    got = rings[0]
    steps = [s for _, s, _, _ in got]
    assert steps[0] >= 1 and set(steps) == {steps[0], steps[0] + 1}
    assert all(done for *_, done in got)
    units = {(op, u) for op, _, u, _ in got}
    assert {("all_gather", "unit ('layers', 0)"), ("reduce_scatter", "unit ('layers', 1)"),
            ("all_gather", "root unit"), ("all_reduce", None)} <= units, units


def test_recording_costs_a_few_python_calls_per_collective():
    """Counted, not timed: the Python calls the recorder adds per collective (sys.setprofile
    on the rank thread), against all the Python calls of an FSDP step."""
    mesh = sf.local_mesh({"data": 2}, timeout=20)
    params = {"layers": [{"w": torch.randn(8, 8)} for _ in range(4)]}

    def loss_fn(p, x):
        for layer in p["layers"]:
            x = torch.tanh(x @ layer["w"])
        return x.square().mean()

    step = sf.shard(loss_fn, mesh)

    def body():
        shards = step.shard_params(params)
        torch.func.grad(step)(shards, torch.ones(2, 8))  # warm: the prefetch order is learned
        counts = {"all": 0, "flight": 0}

        def profile(frame, event, arg):
            if event == "call":
                counts["all"] += 1
                if frame.f_code.co_filename == flight.__file__:
                    counts["flight"] += 1

        with ops.recording() as rec:
            sys.setprofile(profile)
            try:
                torch.func.grad(step)(shards, torch.ones(2, 8))
            finally:
                sys.setprofile(None)
        return counts, len(rec.records)

    (counts, n), _ = mesh.run(body)
    assert n >= 9  # 4 + 4 gathers (+ the root's), 4 reduce-scatters, the loss all-reduce
    # record + ring + done per collective, and the step/unit labels (flight.unit's enter/exit)
    assert counts["flight"] <= 6 * n, (counts, n)
    assert counts["flight"] < 0.03 * counts["all"], counts


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_dropped_rank_in_an_fsdp_step_is_explained(tmp_path):
    """A real `shard` step; rank 1 leaves at the 2nd collective of step 2
    (`faults.drop_from_store`: alive, silent). Rank 0 times out and both dump: the tool
    names rank 1, the collective number, the step and the unit rank 0 was gathering."""
    from shardfn.testing import faults

    def body():
        sf.flight.set_dump_dir(tmp_path)
        mesh = sf.init_mesh({"data": 2}, timeout=2)
        params = {"layers": [{"w": torch.eye(4) * (i + 1)} for i in range(2)]}
        step = sf.shard(lambda p, x: sum(torch.tanh(x @ l["w"]).sum() for l in p["layers"]), mesh)
        shards = step.shard_params(params)
        with faults.inject(mesh, faults.drop_from_store(1, step=2, collective=2)):
            for _ in range(3):
                torch.func.grad(step)(shards, torch.ones(2, 4))

    with pytest.raises(RankProcessError, match="CollectiveTimeoutError"):
        run_multiprocess(body, 2, timeout=30)
    docs = sf.flight.load(str(tmp_path))
    # a dropped rank's pid left the store with it: it cannot be asked to dump
    assert {r: d["reason"] for r, d in docs.items()} == {0: "timeout"}
    (f,) = sf.flight.analyze(docs)
    assert (f.kind, f.behind, f.last[1]) == ("hang", [1], None)
    mine = [e for e in docs[0]["entries"] if e["step"] == 2]
    assert f.seq == mine[1]["seq"] and f.issued[0] == mine[1]  # rank 0 waits in step 2's 2nd collective
    assert mine[1]["t_end"] is None and mine[1]["unit"] is not None
    text = _cli(tmp_path)
    assert f"hang at collective #{f.seq}" in text, text
    assert f"[step 2 unit {mine[1]['unit']}]" in text and "NOT FINISHED" in text, text
    assert "  rank 1: no dump" in text and "=> rank 1 is behind: rank 1 left no dump" in text, text


@pytest.mark.slow
def test_a_timeout_on_the_simulated_mesh_dumps_every_rank(tmp_path):
    """The simulated mesh's ranks live in one process: the rank that times out dumps them all."""
    run_multiprocess(_simulated_timeout, 1, str(tmp_path), timeout=60)
    (f,) = sf.flight.analyze(str(tmp_path))
    assert sorted(sf.flight.load(str(tmp_path))) == [0, 1, 2]
    assert (f.kind, f.behind, f.seq, f.ranks) == ("hang", [2], 6, (0, 1, 2))
    assert f.issued[0]["what"] == f.issued[1]["what"] == "all_gather(shape=(2,), dtype=torch.float32)"


def _simulated_timeout(path: str) -> None:
    sf.flight.set_dump_dir(path)
    mesh = sf.local_mesh({"data": 3}, timeout=1)

    def body():  # rank 2 skips the last all_gather(2): the others wait for it alone
        group = mesh.group("data")
        for step in range(1, 4):
            with flight.step(step):
                ops.all_gather(group, torch.ones(4))
                if not (step == 3 and mesh.rank == 2):
                    ops.all_gather(group, torch.ones(2))

    try:
        mesh.run(body)
    except sf.CollectiveTimeoutError:
        return
    raise AssertionError("no timeout")
