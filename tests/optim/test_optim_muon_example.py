"""examples/muon_gpt.py and benchmarks/muon_vs_adamw.py run (tiny settings) and report what they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_muon_gpt_example_tiny(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "muon_gpt.py"), "--tiny", "--steps", "6",
                           "--quiet", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Muon + AdamW" in proc.stdout and "AdamW" in proc.stdout
    with open(tmp_path / "muon_gpt_losses.json") as f:
        out = json.load(f)
    assert out["ranks"] == 4 and set(out["losses"]) == {"adamw", "muon"}
    losses = out["losses"]
    assert len(losses["muon"]) == 6 and losses["muon"][0] == losses["adamw"][0]  # same init, same first batch
    assert losses["muon"][-1] < losses["muon"][0] and losses["adamw"][-1] < losses["adamw"][0]


@pytest.mark.slow
def test_muon_vs_adamw_benchmark_tiny(tmp_path):
    from benchmarks import muon_vs_adamw

    report = muon_vs_adamw.main(["--tiny", "--simulated", "--reps", "2", "--out", str(tmp_path / "mva")])
    assert set(report["median_ms"]) == {"adamw", "muon"}
    # the 1-layer GPT's 4 hidden matrices (12,288 elements), one per rank: bfloat16 both ways,
    # each owner's own quarter stays home
    assert sum(g + s for _, g, s, _ in report["owner_bytes"]) == 2 * 2 * 12288 * 3 // 4
    assert [owned for *_, owned in report["owner_bytes"]] == [1, 1, 1, 1]
