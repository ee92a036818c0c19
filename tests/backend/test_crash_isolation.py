"""`make test` survives a native crash: the crashing test fails by name, the rest still run.

The Makefile runs pytest with `$(ISOLATE)` (a pytest-xdist worker process). This runs that
exact option string on a small file whose middle test kills its process with SIGFPE, the
signal a gloo crash once ended a whole `make test` with (no summary, the failure lost).
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CRASHING = textwrap.dedent(
    """
    import os, signal

    def test_before():
        assert 1 + 1 == 2

    def test_native_crash():
        os.kill(os.getpid(), signal.SIGFPE)  # what a division by zero in C++ does

    def test_after():
        assert 2 + 2 == 4
    """
)


def _make_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{name} \?= (.*)$", text, re.M)
    assert match, f"the Makefile defines no {name}"
    return match.group(1)


def test_a_native_crash_fails_one_test_by_name(tmp_path):
    pytest.importorskip("xdist")
    isolate = _make_variable("ISOLATE").replace("$(TEST_WORKERS)", _make_variable("TEST_WORKERS"))
    isolate = isolate.replace("$(HARD_TIMEOUT)", _make_variable("HARD_TIMEOUT"))
    assert "xdist" in isolate and "$(" not in isolate, isolate
    (tmp_path / "test_crashes.py").write_text(CRASHING)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # as from make's cwd
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *isolate.split(), "test_crashes.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "crashed while running 'test_crashes.py::test_native_crash'" in out, out
    assert re.search(r"^1 failed, 2 passed", out, re.M), out
