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


FIVE = {"shardfn-foreach", "shardfn-fused", "fsdp2-foreach", "fsdp2-fused", "ddp"}


def _check_row(row, methods=FIVE):
    assert set(row["step_s"]) == methods and all(t > 0 for t in row["step_s"].values())
    for m in methods:  # the same model, data and AdamW from the same init: the same losses
        assert row["max_loss_diff_vs_ddp"][m] < 1e-4, (m, row["losses"])
    sb = row["state_bytes_per_rank"]
    for m in ("shardfn-foreach", "shardfn-fused"):
        assert sb[m] <= 1.05 * sb["fsdp2-fused"]  # the same ZeRO-3 state as FSDP2's
    assert sb["fsdp2-fused"] <= 1.05 * sb["ddp"] / row["world"] + 4096
    assert 0 < row["comm_bytes_per_rank"] <= row["comm_theory_bytes_per_rank"]
    for m in methods:
        cpu = row["cpu_per_step"][m]
        assert cpu["main_cpu_s"] >= 0 and cpu["wall_s"] > 0


@pytest.mark.multiprocess
def test_fsdp_vs_ddp_tiny(tmp_path):
    """Every method at N = 2 on the tiny GPT, one profiled step each; the report renders."""
    from benchmarks import _common, fsdp_vs_ddp, report

    out = fsdp_vs_ddp.main(["--tiny", "--models", "gpt", "--world-sizes", "2", "--profile",
                            "--trace-dir", str(tmp_path / "traces"), "--out", str(tmp_path / "fsdp_vs_ddp")])
    saved = json.loads((tmp_path / "fsdp_vs_ddp.json").read_text())
    assert saved["results"] == json.loads(json.dumps(out["results"]))
    env = saved["env"]
    assert env["command"].startswith("python -m benchmarks.fsdp_vs_ddp --tiny") and env["cpu_count"] >= 1
    assert {"date", "machine", "torch", "loadavg_start", "loadavg_end"} <= set(env)
    (row,) = saved["results"]
    _check_row(row)
    for m, prof in row["profile"].items():  # the five shares add up to the step's wall time
        shares = _common.shares(prof)
        assert sum(shares.values()) == pytest.approx(prof["wall_ms"], rel=1e-6), m
        assert shares["compute"] > 0 and prof["ops_self_ms"]
    assert {f"gpt-N2-{m}.json" for m in FIVE} == {p.name for p in (tmp_path / "traces").iterdir()}
    made = report.sections(str(tmp_path))
    assert {"step-time", "ratios", "targets", "scaling", "profile", "memory", "communication"} <= set(made)
    assert len(report.target_rows(saved)) == 3  # three targets on the GPT at N = 2 (the run has no N = 4)
    assert made["targets"].count("| GPT") == 3
    loaded = report.load_table(saved, [saved])  # a run beside itself as its "loaded" twin
    assert loaded.count("| GPT 2L d32 (tiny) | 2 |") == 2 and "| 0 |" in loaded


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_vs_ddp_jaxloop_tiny(tmp_path):
    """The JAX-style loop beside sf.train_step, FSDP2 and DDP in one run: the loop's losses
    are train_step's with the same fused AdamW, bit for bit, and its ratios are reported."""
    from benchmarks import fsdp_vs_ddp, report

    methods = ["shardfn-jaxloop", "shardfn-fused", "fsdp2-fused", "ddp"]
    out = fsdp_vs_ddp.main(["--tiny", "--models", "gpt", "--world-sizes", "2", "--methods", *methods,
                            "--out", str(tmp_path / "fsdp_vs_ddp")])
    (row,) = out["results"]
    assert set(row["step_s"]) == set(methods) and all(t > 0 for t in row["step_s"].values())
    assert row["losses"]["shardfn-jaxloop"] == row["losses"]["shardfn-fused"]
    assert row["max_loss_diff_vs_ddp"]["shardfn-jaxloop"] < 1e-4
    assert row["state_bytes_per_rank"]["shardfn-jaxloop"] == row["state_bytes_per_rank"]["shardfn-fused"]
    rs = fsdp_vs_ddp.ratios(row)
    assert rs["jaxloop: loop / train_step (fused)"] > 0 and rs["jaxloop: loop / fsdp2 (fused)"] > 0
    assert "shardfn JAX-style loop" in report.sections(str(tmp_path))["step-time"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_vs_ddp_tiny_all_models_scaling_load_threads(tmp_path):
    """Three tiny models at N = 1 and 2 (the scaling table), with a busy-loop process on the
    cores and each method's thread census."""
    from benchmarks import fsdp_vs_ddp, report

    out = fsdp_vs_ddp.main(["--tiny", "--world-sizes", "1", "2", "--load", "1", "--threads",
                            "--out", str(tmp_path / "fsdp_vs_ddp")])
    assert out["config"]["load_processes"] == 1
    assert [(r["model"], r["world"]) for r in out["results"]] == [
        (m, n) for m in ("gpt", "gpt-8L", "mlp") for n in (1, 2)]
    for row in out["results"]:
        if row["world"] == 2:
            _check_row(row)
    census = out["thread_census"]["methods"]
    assert set(census) == FIVE and all(c["count_after"] >= c["count_before"] >= 1 for c in census.values())
    scaling = report.scaling_table(out)
    assert len(scaling.splitlines()) == 2 + 3 * 3  # head, rule, 3 methods x 3 models


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_vs_ddp_compiled_tiny(tmp_path):
    """--compile: FSDP2 and shardfn with compiled blocks run and agree with DDP."""
    pytest.importorskip("torch._inductor")
    from benchmarks import fsdp_vs_ddp

    out = fsdp_vs_ddp.main(["--tiny", "--models", "gpt", "--world-sizes", "2", "--compile",
                            "--methods", "shardfn-compiled", "shardfn-compiled-step", "fsdp2-compiled", "ddp",
                            "--out", str(tmp_path / "cmp")])
    (row,) = out["results"]
    assert not row["unsupported"]
    assert row["max_loss_diff_vs_ddp"]["fsdp2-compiled"] < 1e-4
    assert row["max_loss_diff_vs_ddp"]["shardfn-compiled"] < 1e-4
    assert row["max_loss_diff_vs_ddp"]["shardfn-compiled-step"] < 1e-4


@pytest.mark.multiprocess
def test_gloo_wait_tiny(tmp_path):
    from benchmarks import gloo_wait, report

    out = gloo_wait.main(["--tiny", "--out", str(tmp_path / "gloo_wait")])
    (row,) = out["results"]
    assert set(row["per_iteration"]) == {"plain", "polled"} and row["polled_over_plain"] > 0
    assert "| 0 | polled |" in report.gloo_wait_table(out)


@pytest.mark.multiprocess
def test_pipeline_benchmark_tiny(tmp_path):
    """Every schedule and FSDP at p = 2 on a tiny model: times, ratios, bubbles; the table renders."""
    from benchmarks import pipeline, report

    out = pipeline.main(["--tiny", "--out", str(tmp_path / "pipeline")])
    saved = json.loads((tmp_path / "pipeline.json").read_text())
    assert saved["env"]["command"].startswith("python -m benchmarks.pipeline --tiny")
    (row,) = saved["results"]
    assert set(row["step_s"]) == set(pipeline.METHODS) and row["ratio_vs_fsdp"]["fsdp"] == 1.0
    assert row["bubble_slots"]["zb-h1"] == [pytest.approx(1 / 13)] * 2  # (p-1)/(3M+p-1), M = 4
    assert all(0 <= b < 1 for bs in row["bubble_measured"].values() for b in bs)
    assert "| zb-h1 | 2 | 4 |" in report.sections(str(tmp_path))["pipeline"]
    assert out["results"][0]["step_s"] == row["step_s"]


def test_benchmarks_page_matches_results():
    """docs/benchmarks.md's tables are what benchmarks/report.py makes of the committed JSON."""
    from benchmarks import report

    made, page = report.sections(), report.page_sections()
    assert set(made) <= set(page), f"docs/benchmarks.md has no markers for {sorted(set(made) - set(page))}"
    stale = sorted(n for n in made if page[n] != made[n])
    assert not stale, f"docs/benchmarks.md is stale in {stale}: run python -m benchmarks.report --write"


def test_profile_categories():
    from benchmarks._common import categorize, shares

    assert [categorize(n) for n in ("aten::mm", "aten::copy_", "c10d::_allgather_base_", "aten::view",
                                    "FSDP::all_gather (h.0)", "aten::_fused_adamw_", "fsdp::all_gather_copy_in")] == [
        "compute", "copies", "collective_calls", "framework_ops", "annotations", "compute", "copies"]
    prof = {"wall_ms": 100.0, "main_cpu_ms": 60.0, "main_blocked_ms": 20.0,
            "ops_self_ms": {"aten::mm": 40.0, "aten::copy_": 10.0, "aten::view": 5.0, "GatherUnit": 25.0}}
    s = shares(prof)  # running 80 ms of which 60 on a CPU: 3/4 of each running share, 20 ms in the run queue
    assert s == pytest.approx({"compute": 30.0, "copies": 7.5, "python_other": 22.5, "collective_wait": 20.0,
                               "runqueue": 20.0})


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


@pytest.mark.multiprocess
def test_context_parallel_tiny(tmp_path):
    """Ring, Ulysses, all-gather-KV and single-rank attention at N = 2 and 4 on processes:
    outputs equal SDPA's, the ring's ppermute waits are counted (per step: N - 1 K/V
    blocks in the forward; N - 1 K/V blocks and N dK/dV accumulators in the backward), and
    the JSON is written."""
    from benchmarks import context_parallel

    out = context_parallel.main(["--tiny", "--out", str(tmp_path / "cp")])
    assert [row["world"] for row in out["results"]] == [2, 4]
    for row in out["results"]:
        n = row["world"]
        assert set(row["step_s"]) == {"single", "allgather", "ring", "ulysses"}
        assert all(d <= 1e-5 for d in row["max_abs_diff_vs_sdpa"].values()), row["max_abs_diff_vs_sdpa"]
        assert row["ppermute_waits_per_step"]["ring"] == (n - 1) + (n - 1) + n
        assert row["ppermute_wait_s"]["ring"] >= 0 and set(row["ratios"]) == {
            "allgather/single", "ring/single", "ulysses/single", "ring/allgather", "ulysses/allgather"}
    saved = json.loads((tmp_path / "cp.json").read_text())
    assert saved["benchmark"] == "context_parallel" and saved["env"]["command"].startswith(
        "python -m benchmarks.context_parallel --tiny") and "loadavg_end" in saved["env"]
    from benchmarks import report

    section = report.context_parallel_section(saved)
    assert "python -m benchmarks.context_parallel --tiny" in section
    assert section.count("| 2 | 64 |") == 4 and section.count("| 4 | 64 |") == 4


def test_quantized_convergence_tiny(tmp_path):
    """The convergence script at 3 steps of the example's TINY GPT: every run is written,
    and the compressed reduce-scatter bytes are the fraction the wire format promises."""
    from benchmarks import quantized_convergence

    results = quantized_convergence.main(["--tiny", "--steps", "3", "--reduce-only", "--out", str(tmp_path / "qc"),
                                          "--img", str(tmp_path / "qc.png")])
    assert list(results) == ["fp32", "int8 reduce-scatter", "int8 reduce-scatter, block 256", "fp8_e4m3 reduce-scatter",
                             "bf16 reduce-scatter"]
    assert results["fp32"]["rel_diff_to_fp32"] == 0
    assert results["int8 reduce-scatter"]["reduce_scatter_ratio"] == pytest.approx(0.25, abs=0.01)
    assert results["int8 reduce-scatter, block 256"]["reduce_scatter_ratio"] == pytest.approx(0.25 + 1 / 256, abs=0.01)
    assert results["bf16 reduce-scatter"]["reduce_scatter_ratio"] == pytest.approx(0.5, abs=0.01)
    assert all(len(r["losses"]) == 3 for r in results.values())
    saved = json.loads((tmp_path / "qc.json").read_text())
    assert saved["results"]["int8 reduce-scatter"]["final_loss"] == results["int8 reduce-scatter"]["final_loss"]


@pytest.mark.slow
def test_diloco_vs_hsdp_tiny(tmp_path):
    """The DiLoCo / LocalSGD / HSDP comparison at 8 steps of the example's TINY GPT: the bytes
    across replicas per step are 1/4 of HSDP's (sync_every=4), and the runs are written."""
    from benchmarks import diloco_vs_hsdp

    results = diloco_vs_hsdp.main(["--tiny", "--steps", "8", "--out", str(tmp_path / "dvh"),
                                   "--img", str(tmp_path / "dvh.png")])
    assert list(results) == ["hsdp", "diloco H=4", "local_sgd H=4"]
    hsdp = results["hsdp"]["replica_bytes_per_step"]
    assert hsdp > 0
    assert results["diloco H=4"]["replica_bytes_per_step"] * 4 == hsdp
    assert results["local_sgd H=4"]["replica_bytes_per_step"] * 4 == hsdp
    assert all(len(r["losses"]) == 8 for r in results.values())
    saved = json.loads((tmp_path / "dvh.json").read_text())
    assert saved["results"]["diloco H=4"]["final_loss"] == results["diloco H=4"]["final_loss"]
