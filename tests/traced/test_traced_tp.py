"""sf.jit with tensor parallelism (`shard(..., param_specs=...)`): loss_fn's named-axis
collectives in the graph ([Note: collectives in a graph] in shardfn/_backend/graph.py).

The plain cell (the MLP, Megatron's column / row split, a psum per block) is the composition
matrix's (tests/fsdp/test_composition.py, `jit` on processes). Here: the same blocks with the
row-parallel sum written as psum_scatter + all_gather, with sf.remat per block, with
inductor; each against eager `sf.train_step` (bit for bit with aot_eager, rounding with
inductor), its `stats()` bytes against eager's; a loss that differs across the
tensor-parallel axis fails as in eager; a collective with no graph form names itself.
"""

import pytest
import torch

import composition_cases as cases
import shardfn as sf
from shardfn.testing import run_multiprocess

TIMEOUT = 300
SPECS = cases.SETUPS["tp"].shard_kwargs


def _block(p, x, how: str):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    y = h @ p["w2"]  # this rank's partial sum of the row-parallel matmul
    if how == "psum":
        y = sf.psum(y, "model")
    elif how == "scatter_gather":  # the same sum as a reduce-scatter and an all-gather (sequence-parallel's pair)
        y = sf.all_gather(sf.psum_scatter(y, "model", dim=1), "model", dim=1)
    elif how == "differs":  # a loss that is not the same on the 'model' ranks
        y = sf.psum(y, "model") * (1.0 + sf.axis_index("model"))
    elif how == "ppermute":
        y = sf.psum(y, "model") + 0 * sf.ppermute(y, "model", [(0, 1), (1, 0)])
    return x + y + p["b2"]


def _loss(how: str, remat: bool):
    def block(p, x):
        return _block(p, x, how)

    return cases.loss_of(sf.remat(block) if remat else block)


def _traced_vs_eager(shape: dict, how: str, remat: bool, backend: str):
    mesh = sf.init_mesh(shape, timeout=120)
    step = sf.shard(_loss(how, remat), mesh, **SPECS)
    parts, _ = cases.global_batch(cases.SETUPS["tp"], shape["data"])
    try:
        return cases.traced_against_eager(step, parts[mesh.coords["data"]], backend=backend)
    except (sf.ShardingError, sf.SpecError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _check_equal(outs, exact: bool):
    for out in outs:
        assert "error" not in out, out["error"]
        if exact:
            assert out["losses"] == out["eager_losses"] and out["equal"], out
        else:  # inductor's fused kernels round differently (fp64 here)
            assert max(abs(a - b) for a, b in zip(out["losses"], out["eager_losses"])) <= 1e-12, out
            assert out["gap"] <= 1e-12, out
        # reduce-scatter and all-reduce bytes equal (loss_fn's own collectives are not the step's traffic,
        # in eager and traced alike); the traced step skips the last unit's re-gather
        assert out["bytes"][1:] == out["eager_bytes"][1:], out
        assert out["bytes"][0] <= out["eager_bytes"][0], out


@pytest.mark.slow
@pytest.mark.ci
@pytest.mark.multiprocess
def test_scatter_gather_and_remat_blocks_equal_eager_bit_for_bit():
    """psum_scatter + all_gather in loss_fn, each block under sf.remat (whose recompute in the
    backward re-runs the collectives): [Note: remat across a collective's backward]."""
    outs = run_multiprocess(_traced_vs_eager, 2, {"data": 1, "model": 2}, "scatter_gather", True, "aot_eager",
                            timeout=TIMEOUT)
    _check_equal(outs, exact=True)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how,remat", [("psum", True), ("scatter_gather", False)])
def test_fsdp_x_tp_on_four_processes_equals_eager(how, remat):
    outs = run_multiprocess(_traced_vs_eager, 4, {"data": 2, "model": 2}, how, remat, "aot_eager", timeout=TIMEOUT)
    _check_equal(outs, exact=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_inductor_with_remat_on_four_processes_is_within_rounding_of_eager():
    outs = run_multiprocess(_traced_vs_eager, 4, {"data": 2, "model": 2}, "psum", True, "inductor", timeout=TIMEOUT)
    _check_equal(outs, exact=False)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_loss_that_differs_across_the_tensor_parallel_axis_fails_as_in_eager():
    for out in run_multiprocess(_traced_vs_eager, 2, {"data": 1, "model": 2}, "differs", False, "aot_eager",
                                timeout=TIMEOUT):
        assert out["error"].startswith("ShardingError: shard: the loss differs across mesh axes ('model',)"), out
        assert "Fix: give every rank of ('model',) the same batch" in out["error"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_collective_without_a_graph_form_is_named_in_the_error():
    for out in run_multiprocess(_traced_vs_eager, 2, {"data": 1, "model": 2}, "ppermute", False, "aot_eager",
                                timeout=TIMEOUT):
        assert out["error"] == (
            "SpecError: sf.jit: shardfn's ppermute has no graph form (graph forms: all_gather, all_reduce, "
            "all_to_all, reduce_scatter).\nFix: express it with those collectives, or train eagerly with "
            "sf.train_step(step, opt)."), out
