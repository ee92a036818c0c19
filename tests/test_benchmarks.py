"""Every benchmark runs once at a tiny size, so the scripts keep working. Nothing here
asserts a time: only that they run, write their JSON, and report the numbers that do not
depend on speed (bytes, equal losses). `benchmarks` is a package, importable from the
repository root (pyproject's pytest `pythonpath`), as `python -m benchmarks.x` runs it."""

import json

import pytest


def test_memory_scaling_matches_the_zero3_formula(tmp_path):
    from benchmarks import memory_scaling

    rows = memory_scaling.main(["--tiny", "--out", str(tmp_path / "mem")])
    assert [r["world"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert abs(r["state_over_formula"] - 1) < 0.05  # (4 + 4 + 8) * numel / N, padding aside
        # 2 units, the prefetched one's send buffer (unit / N), and the (smaller) root
        assert r["peak_gathered"] <= (3.5 + 1 / r["world"]) * r["unit_bytes"]
    assert json.loads((tmp_path / "mem.json").read_text())["results"][0]["world"] == 1


@pytest.mark.multiprocess
def test_fsdp_vs_ddp_tiny(tmp_path):
    from benchmarks import fsdp_vs_ddp

    (row,) = fsdp_vs_ddp.main(["--tiny", "--models", "gpt", "--world-sizes", "2", "--out", str(tmp_path / "cmp")])
    assert set(row["median_step_s"]) == {"shardfn", "fsdp2", "ddp"}
    assert row["max_loss_diff_vs_ddp"]["shardfn"] < 1e-4
    assert row["max_loss_diff_vs_ddp"]["fsdp2"] < 1e-4
    sb = row["state_bytes_per_rank"]
    assert sb["shardfn"] <= 1.05 * sb["fsdp2"]  # same ZeRO-3 state as FSDP2's
    assert 0 < row["comm_bytes_per_rank"] <= row["comm_theory_bytes_per_rank"]
    assert (tmp_path / "cmp.json").exists()


@pytest.mark.multiprocess
def test_fsdp_tp_vs_torch_tiny(tmp_path):
    from benchmarks import fsdp_tp_vs_torch

    result = fsdp_tp_vs_torch.main(["--tiny", "--out", str(tmp_path / "tp")])
    assert result["mesh"] == {"data": 2, "model": 2} and set(result["median_step_s"]) == {"shardfn", "torch"}
    assert result["max_loss_diff"] < 1e-5  # the same model, data and AdamW: the same losses
    sb = result["state_bytes_per_rank"]
    assert sb["shardfn"] <= 1.05 * sb["torch"]  # the same 2-D sharded state as FSDP2 + DTensor TP
    assert sb["shardfn"] < 0.5 * result["unsharded_state_bytes"]
    assert json.loads((tmp_path / "tp.json").read_text())["result"]["parameters"] == result["parameters"]


@pytest.mark.multiprocess
def test_simulated_overhead_tiny(tmp_path):
    from benchmarks import simulated_overhead

    sim, dist = simulated_overhead.main(["--tiny", "--out", str(tmp_path / "sim.json")])
    assert sim > 0 and dist > 0
    assert json.loads((tmp_path / "sim.json").read_text())["world"] == 2


def test_optim_update_tiny(tmp_path):
    from benchmarks import optim_update

    optim_update.main(["--tiny", "--out", str(tmp_path / "opt.json")])
    report = json.loads((tmp_path / "opt.json").read_text())
    assert report["config"]["tiny"] is True and report["results"]
