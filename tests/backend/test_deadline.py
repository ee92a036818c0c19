"""`make test` always finishes and leaves no process behind (tests/_deadline.py).

Runs the Makefile's exact `$(ISOLATE)` options (pytest-xdist + the deadline plugin) on a
small planted file, with a short inner limit (pytest-timeout, thread method, as the
project configures it) and a short hard deadline:

- a test stuck in C code holding the GIL with SIGALRM and the dump signal blocked (so
  pytest-timeout's thread can never run): the controller dumps its stacks and kills its
  worker; the test fails by name with the stacks; a fresh worker runs the rest;
- a test that forks two orphaned "rank" processes (double fork + new session) and then
  hangs the same way: the same, and the orphans die with the worker's tree;
- a test that forks two orphans and raises: the reaper kills them at its teardown;
- a test past pytest-timeout's limit (its thread method ends the worker with os._exit) and
  a test that segfaults: each fails by name with why its worker died and its stacks;
- the summary line is printed and, after the run, none of the planted processes is alive.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLANTED = textwrap.dedent(
    """
    import ctypes, os, signal, time

    PIDS = os.environ["PLANTED_PIDS"]

    def _orphans(n, tag):
        # n "rank" processes that outlive their parent: double fork, then a new session
        for _ in range(n):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                if os.fork() == 0:
                    os.setsid()
                    with open(PIDS, "a") as f:
                        f.write(f"{tag} {os.getpid()}\\n")
                    os.write(w, b"x")
                    while True:
                        time.sleep(1)
                os._exit(0)
            os.close(w)
            os.read(r, 1)
            os.close(r)
            os.waitpid(pid, 0)

    def _stuck_in_c():
        # pytest-timeout's signal and the dump signal blocked in this thread; the C call keeps
        # the GIL (PyDLL), so pytest-timeout's timer thread never runs either
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGUSR2})
        libc = ctypes.PyDLL(None)
        while True:
            libc.sleep(1000)

    def test_before():
        assert 1 + 1 == 2

    def test_stuck_in_c_holding_the_gil():
        _stuck_in_c()

    def test_orphans_then_stuck():
        _orphans(2, "stuck")
        _stuck_in_c()

    def test_orphans_then_raises():
        _orphans(2, "raises")
        raise RuntimeError("a rank failed")

    def test_past_the_inner_timeout():
        time.sleep(30)  # pytest-timeout's thread method ends the worker

    def test_segfault():
        ctypes.string_at(0)  # SIGSEGV in C

    def test_after():
        assert 2 + 2 == 4
    """
)


def _make_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{name} \?= (.*)$", text, re.M)
    assert match, f"the Makefile defines no {name}"
    return match.group(1)


def _isolate(hard_timeout: float) -> list[str]:
    isolate = _make_variable("ISOLATE")
    isolate = isolate.replace("$(TEST_WORKERS)", _make_variable("TEST_WORKERS"))
    isolate = isolate.replace("$(HARD_TIMEOUT)", f"{hard_timeout:g}")
    assert "$(" not in isolate, isolate
    return isolate.split()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":
        try:  # a zombie re-parented to this process (it is a subreaper under the plugin)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl: Linux")
def test_stuck_and_orphaning_tests_fail_by_name_and_leave_nothing(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    pids_file = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # as from make's cwd
    env["PLANTED_PIDS"] = str(pids_file)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_isolate(4),
         "-o", "timeout=1", "-o", "timeout_method=thread", "test_planted.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    wall = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # the summary line is printed, with every test accounted for
    assert re.search(r"^5 failed, 2 passed", out, re.M), out
    for name in ("test_stuck_in_c_holding_the_gil", "test_orphans_then_stuck"):
        nodeid = f"test_planted.py::{name}"
        assert re.search(rf"worker 'gw\d+' crashed while running '{re.escape(nodeid)}'", out), out
        assert f"shardfn hard deadline: {nodeid} ran " in out, out
        assert f"FAILED {nodeid} - worker 'gw" in out, out
        # the stacks name the line the test was stuck on
        assert re.search(rf'File ".*test_planted.py", line \d+ in {name}', out), out
    assert "past --hard-timeout=4 s (pytest-timeout's timeout=1 did not end it)" in out, out
    # the forked orphans' own stacks were dumped too (they inherited the handler)
    assert out.count("--- child process ") >= 2, out
    assert "FAILED test_planted.py::test_orphans_then_raises - RuntimeError" in out, out
    # a worker that died by itself says why: pytest-timeout's expiry or the fatal signal, with the stacks
    for name, why in (("test_past_the_inner_timeout", "pytest-timeout: test_planted.py::test_past_the_inner_timeout "
                                                      "ran past timeout=1 s"),
                      ("test_segfault", "Fatal Python error: Segmentation fault")):
        nodeid = f"test_planted.py::{name}"
        assert re.search(rf"worker 'gw\d+' crashed while running '{re.escape(nodeid)}'", out), out
        assert re.search(rf"shardfn: worker gw\d+ died by itself \d+ s into {re.escape(nodeid)}", out), out
        assert why in out, out
        assert re.search(rf'File ".*test_planted.py", line \d+ in {name}', out), out
    assert "test_planted.py::test_orphans_then_raises left 2 process(es) running after its teardown" in out, out
    planted = [line.split() for line in pids_file.read_text().splitlines()]
    assert sorted(tag for tag, _ in planted) == ["raises", "raises", "stuck", "stuck"], planted
    deadline = time.monotonic() + 10
    while any(_alive(int(pid)) for _, pid in planted) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for _, pid in planted if _alive(int(pid))], (planted, out)
    assert wall < 200, wall


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_rank_processes_die_with_their_parent(tmp_path):
    """A runner killed mid-run (pytest-timeout's os._exit, the deadline's SIGKILL) takes its ranks along."""
    pids_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import os, time
        from shardfn.testing import run_multiprocess

        def body():
            with open({str(pids_file)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(600)

        run_multiprocess(body, 2, timeout=600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if pids_file.exists() and len(pids_file.read_text().split()) == 2:
                break
            assert parent.poll() is None, "the runner exited before its ranks started"
            time.sleep(0.1)
        ranks = [int(p) for p in pids_file.read_text().split()]
        assert len(ranks) == 2, ranks
        assert all(_alive(p) for p in ranks)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in ranks if _alive(p)], ranks
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
