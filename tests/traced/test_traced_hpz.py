"""sf.jit with hpZ (`reshard_after_forward=<inner shard axes>`): the backward re-gathers
over the sub-group ([Note: hpZ in the graph] in shardfn/_traced/schedule.py).

The values are the composition matrix's cell (bit for bit with eager `sf.train_step`,
tests/fsdp/test_composition.py). Here: which group each all-gather of the compiled graph
uses, and the refusals for the layouts the traced step does not write.
"""

import pytest
import torch

import composition_cases as cases
import shardfn as sf
import shardfn._traced.step as traced_step
from shardfn.testing import run_multiprocess

TIMEOUT = 240
_C = torch.ops._c10d_functional


def _gathers(reshard_axes: str):
    graphs = []
    schedule = traced_step.schedule_units

    def spy(graph, *args, **kwargs):
        schedule(graph, *args, **kwargs)
        # a gather over a 2-rank gloo group runs as a two-rank exchange (an all-to-all), the
        # eager runtime's form ([Note: gloo's two-rank collectives])
        graphs.append([(n.args[2] if n.target is _C.all_gather_into_tensor.default else n.args[3],
                        bool(n.meta.get("autograd_backward"))) for n in graph.nodes
                       if n.target in (_C.all_gather_into_tensor.default, _C.all_to_all_single.default)])

    traced_step.schedule_units = spy
    mesh = sf.init_mesh({"a": 2, "b": 2}, timeout=60)
    step = sf.shard(cases.make_loss(), mesh, data_axes=("a", "b"), reshard_after_forward=reshard_axes)
    parts, _ = cases.global_batch(cases.SETUPS["hpz"], 4)
    opt = sf.optim.sgd(0.1)
    shards = step.shard_params(cases.mlp_params())
    train = sf.jit(step, opt, backend="aot_eager")
    try:
        train(shards, opt.init(shards), parts[mesh.coords["a"] * 2 + mesh.coords["b"]])
    except sf.SpecError as e:
        return str(e)
    names = {"shard": mesh.group(("a", "b")).pg.group_name, "sub": mesh.group((reshard_axes,)).pg.group_name}
    return {"gathers": [(next(k for k, v in names.items() if v == name), back) for name, back in graphs[-1]],
            "backward_gathers": train.record.backward_gathers, "exchanged": train.record.exchanged_gathers}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jit_hpz_regathers_over_the_sub_group_in_the_backward():
    for out in run_multiprocess(_gathers, 4, "b", timeout=TIMEOUT):
        forward = [g for g, back in out["gathers"] if not back]
        backward = [g for g, back in out["gathers"] if back]
        assert forward == ["shard"] * (cases.BLOCKS + 1)  # every unit, over the whole shard group
        # each block but the last gathered ([Note: the last unit]) again, over the 2-rank sub-group
        assert backward == ["sub"] * (cases.BLOCKS - 1) == ["sub"] * out["backward_gathers"]
        assert out["exchanged"] == len(backward)  # the sub-group has 2 gloo ranks: exchanges


@pytest.mark.slow
@pytest.mark.multiprocess
def test_jit_hpz_over_outer_axes_is_refused_with_the_reason():
    for message in run_multiprocess(_gathers, 4, "a", timeout=TIMEOUT):
        assert isinstance(message, str) and "the re-gather's axes must be the inner (last) shard axes" in message
        assert "sf.train_step(step, opt)" in message


def _hpz_with_wire_vs_eager(wire: str):
    setup = cases.combine((wire, "hpz"))
    mesh = sf.init_mesh(dict(setup.mesh_shape), timeout=60)
    step = sf.shard(cases.make_loss(), mesh, **setup.shard_kwargs)
    index, size = cases.data_rank(mesh, setup)
    return cases.traced_against_eager(step, cases.global_batch(setup, size)[0][index])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("wire", ["wire_int8", "wire_fp8", "wire_cast"])
def test_jit_hpz_with_a_wire_format_equals_eager_bit_for_bit(wire):
    """The kept rows of a quantized (or cast) all-gather are its wire rows: the backward
    re-gathers them over the sub-group and decodes them again, as eager does."""
    for out in run_multiprocess(_hpz_with_wire_vs_eager, 4, wire, timeout=TIMEOUT):
        assert out["losses"] == out["eager_losses"] and out["equal"], out
        assert out["backward_gathers"] == cases.BLOCKS - 1
        assert out["bytes"][1:] == out["eager_bytes"][1:]
        assert out["bytes"][0] < out["eager_bytes"][0]  # the last unit is not re-gathered ([Note: the last unit])
