"""scripts/device_check.py, the prepared accelerator check, in its CPU dry run: every check
must pass here, so that a session lent a GPU runs a script that works (the check of
varying-axes types once made its collectives check fail unnoticed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # ~22 s; make test-all (and before any device session)
def test_device_check_dry_run_passes_every_check(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_check.py"), "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    passes = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PASS ")]
    assert {"nccl-1rank", "collectives", "compressed", "compressed-2rank", "compiled", "traced"} <= set(passes), out[-4000:]
    assert "FAIL" not in proc.stdout
    assert (tmp_path / "device_check.json").exists()
