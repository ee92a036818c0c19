"""The reference evaluator and the hypothesis strategies themselves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._spec import validate_spec
from shardfn.testing import strategies as sfst
from shardfn.testing._reference import (
    C,
    ReferenceCheckError,
    join_blocks,
    shmap_reference,
    split_blocks,
)

P = sf.P


def test_reference_psum_example():
    g = shmap_reference(lambda x: C.psum(x, "data"), {"data": 2}, P("data"), P())
    torch.testing.assert_close(g(torch.tensor([1.0, 2.0])), torch.tensor([3.0]))


def test_reference_orders_tuple_axes_as_given():
    x = torch.arange(4.0)
    shape = {"x": 2, "y": 2}
    xy = shmap_reference(lambda b: C.all_gather(b, ("x", "y")), shape, P(("x", "y")), P())(x)
    yx = shmap_reference(lambda b: C.all_gather(b, ("y", "x")), shape, P(("x", "y")), P())(x)
    assert xy.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert yx.tolist() == [0.0, 2.0, 1.0, 3.0]  # logical index row-major over ('y', 'x')


def test_reference_axis_index_and_size():
    g = shmap_reference(lambda b: b * C.axis_index("y") + C.axis_size(("x", "y")), {"x": 2, "y": 2},
                        P(("x", "y")), P(("x", "y")))
    assert g(torch.ones(4)).tolist() == [4.0, 5.0, 4.0, 5.0]


def test_reference_checks_replication():
    g = shmap_reference(lambda b: b * 2, {"x": 2}, P("x"), P())
    with pytest.raises(ReferenceCheckError, match="omits axes"):
        g(torch.arange(2.0))
    assert shmap_reference(lambda b: b * 2, {"x": 2}, P("x"), P(), check=False)(torch.arange(2.0)).tolist() == [0.0]


def test_reference_detects_ranks_that_disagree():
    def prog(b):
        return C.psum(b, "x") if C.axis_index("x") == 0 else C.pmax(b, "x")

    with pytest.raises(ReferenceCheckError, match="disagree on collective #0"):
        shmap_reference(prog, {"x": 2}, P("x"), P())(torch.arange(2.0))


def test_reference_runs_under_torch_func():
    g = shmap_reference(lambda b: C.psum((b ** 2).sum(), "x"), {"x": 3}, P("x"), P())
    x = torch.arange(6.0)
    torch.testing.assert_close(torch.func.grad(g)(x), 2 * x)
    torch.testing.assert_close(torch.func.jvp(g, (x,), (torch.ones(6),))[1], 2 * x.sum())
    torch.testing.assert_close(torch.func.vmap(g)(torch.stack([x, -x])), torch.stack([(x ** 2).sum()] * 2))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_split_join_round_trip_uneven(data):
    mesh_shape = data.draw(sfst.mesh_shapes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(sfst.partition_specs(ndim, mesh_shape))
    shape = data.draw(sfst.global_shapes(spec, ndim, mesh_shape, even=False))
    validate_spec(spec, shape, mesh_shape, "strategy")
    x = torch.randn(shape)
    blocks = split_blocks(x, spec, mesh_shape)
    torch.testing.assert_close(join_blocks(blocks, spec, mesh_shape), x)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=sfst.collective_cases())
def test_collective_cases_are_valid(case):
    validate_spec(case.in_spec, case.global_shape, case.mesh_shape, "in spec")
    x = torch.randn(case.global_shape, dtype=torch.float64)
    out = shmap_reference(case.program(), case.mesh_shape, case.in_spec, case.out_spec)(x)  # checks replication
    validate_spec(case.out_spec, tuple(out.shape), case.mesh_shape, "out spec")
