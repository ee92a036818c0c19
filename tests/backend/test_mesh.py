"""Mesh: shape, coordinates, per-axis groups and errors, on both backends."""

import itertools
import math
import os

import pytest
import torch

import shardfn as sf
from shardfn.testing import RankProcessError, run_multiprocess

SHAPES = [{"data": 2}, {"data": 4}, {"x": 2, "y": 2}]


def expected_coords(shape: dict) -> list[dict]:
    """Row-major coordinates, last axis fastest (as numpy.unravel_index), one per rank."""
    return [dict(zip(shape, c)) for c in itertools.product(*(range(s) for s in shape.values()))]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.values())))
def test_mesh_layout(on_mesh, shape):
    def body(mesh):
        return {
            "rank": mesh.rank,
            "coords": mesh.coords,
            "shape": mesh.shape,
            "axis_names": mesh.axis_names,
            "size": mesh.size,
            "kind": mesh.kind,
            "in_rank": mesh.in_rank(),
            "axis_sizes": {a: mesh.axis_size(a) for a in mesh.axis_names},
        }

    results = on_mesh(body, shape)
    n = math.prod(shape.values())
    assert len(results) == n
    assert [r["rank"] for r in results] == list(range(n))  # results come back in rank order
    assert [r["coords"] for r in results] == expected_coords(shape)
    for r in results:
        assert r["shape"] == shape and list(r["shape"]) == list(shape)  # mesh order kept
        assert r["axis_names"] == tuple(shape)
        assert r["size"] == n
        assert r["kind"] == on_mesh.backend
        assert r["in_rank"] is True
        assert r["axis_sizes"] == shape


def test_mesh_from_sizes_and_names():
    mesh = sf.local_mesh((2, 3), ("a", "b"))
    assert mesh.shape == {"a": 2, "b": 3}
    assert mesh.size == 6
    assert sf.local_mesh(3).shape == {"data": 3}  # one size: the axis is 'data'
    assert sf.local_mesh((2,)).axis_names == ("data",)
    assert repr(sf.local_mesh({"x": 2, "y": 1})) == "Mesh({'x': 2, 'y': 1}, kind='simulated')"
    assert mesh.axis_size(("b", "a")) == 6
    assert mesh.axes(None) == ("a", "b")
    assert mesh.axes(["b", "a"]) == ("b", "a")


def test_run_passes_args_and_nests():
    mesh = sf.local_mesh({"data": 3})
    out = mesh.run(lambda a, b=0: (mesh.rank, a + b), 10, b=5)
    assert out == [(0, 15), (1, 15), (2, 15)]
    # SPMD code that calls run again is already on its rank: one call, one result.
    assert mesh.run(lambda: mesh.run(lambda: mesh.rank)) == [[0], [1], [2]]
    assert mesh.in_rank() is False


def test_run_on_distributed_mesh_calls_once():
    def body():
        mesh = sf.init_mesh({"data": 2}, timeout=30)
        return mesh.run(lambda x: (mesh.rank, x), "hi")

    assert run_multiprocess(body, 2) == [[(0, "hi")], [(1, "hi")]]


# rank r holds 10**r: the sums show exactly which ranks were reduced together.
AXIS_SUMS_2X2 = {
    "x": [101, 1010, 101, 1010],  # ranks sharing y: {0, 2} and {1, 3}
    "y": [11, 11, 1100, 1100],  # ranks sharing x: {0, 1} and {2, 3}
    ("x", "y"): [1111] * 4,
    ("y", "x"): [1111] * 4,
    None: [1111] * 4,
}


@pytest.mark.parametrize("axes", list(AXIS_SUMS_2X2), ids=str)
def test_all_reduce_per_axis_groups(on_mesh, axes):
    def body(mesh):
        t = torch.tensor([10.0**mesh.rank], dtype=torch.float64)
        out = mesh.all_reduce(t, axes)
        assert out is t  # in place
        return t.item()

    assert on_mesh(body, {"x": 2, "y": 2}) == AXIS_SUMS_2X2[axes]


@pytest.mark.parametrize("op, expected", [("sum", 10.0), ("max", 4.0), ("min", 1.0), ("mean", 2.5)])
def test_all_reduce_ops(on_mesh, op, expected):
    def body(mesh):
        t = torch.full((2, 3), mesh.rank + 1.0)
        return mesh.all_reduce(t, "data", op=op)

    for out in on_mesh(body, {"data": 4}):
        torch.testing.assert_close(out, torch.full((2, 3), expected), rtol=0, atol=0)


def test_all_reduce_size_one_axis_is_identity():
    mesh = sf.local_mesh({"x": 2, "y": 1})
    out = mesh.run(lambda: mesh.all_reduce(torch.tensor([mesh.rank + 1.0]), "y").item())
    assert out == [1.0, 2.0]


# -- errors -------------------------------------------------------------------------------


def test_unknown_axis_names_the_mesh_axes():
    mesh = sf.local_mesh({"x": 2, "y": 2})
    with pytest.raises(sf.SpecError, match=r"'model' is not an axis of this mesh; mesh axes are \['x', 'y'\]"):
        mesh.axes("model")
    with pytest.raises(sf.SpecError, match=r"\('x', 'z'\) is not an axis of this mesh"):
        mesh.axis_size(("x", "z"))
    with pytest.raises(sf.SpecError, match=r"axis tuple \('x', 'x'\) names an axis twice"):
        mesh.axes(("x", "x"))
    with pytest.raises(sf.SpecError, match=r"Mesh.all_reduce: op must be 'sum', 'max', 'min' or 'mean', got 'prod'"):
        mesh.run(lambda: mesh.all_reduce(torch.ones(1), "x", op="prod"))


def test_unknown_axis_inside_run_on_both_backends(on_mesh):
    def body(mesh):
        mesh.all_reduce(torch.ones(1), "model")

    expected = sf.SpecError if on_mesh.backend == "simulated" else RankProcessError
    with pytest.raises(expected, match=r"'model' is not an axis of this mesh; mesh axes are \['data'\]"):
        on_mesh(body, {"data": 2})


def test_integer_axis_is_a_spec_error():
    # Was a bare TypeError from tuple(0) in Mesh.axes.
    mesh = sf.local_mesh({"data": 2})
    with pytest.raises(sf.SpecError, match=r"is not an axis of this mesh"):
        mesh.axes(0)


@pytest.mark.parametrize("args, message", [
    (({"data": 0},), r"axis 'data' has size 0; sizes must be positive integers"),
    (({"data": 2, "model": -1},), r"axis 'model' has size -1; sizes must be positive integers"),
    (({"data": 2.0},), r"axis 'data' has size 2.0; sizes must be positive integers"),
    (((2, 2), ("a", "a")), r"axis names \[.*'a'.*\] appear more than once"),
    (((2, 2), ("a",)), r"mesh shape \(2, 2\) has 2 dims but axis_names \('a',\) has 1"),
    (((2, 2, 2), ("a", "b")), r"mesh shape \(2, 2, 2\) has 3 dims but axis_names \('a', 'b'\) has 2"),
    (((2, 2),), r"a mesh of shape \(2, 2\) needs axis_names"),
    (({},), r"the mesh has no axes"),
    (({"data": 2}, ("data",)), r"either as a dict .* or as sizes plus axis_names, not both"),
    (({"": 2},), r"axis name '' is not a non-empty string"),
])
def test_invalid_mesh_shapes(args, message):
    with pytest.raises(sf.SpecError, match=message):
        sf.local_mesh(*args)


def test_invalid_mesh_shape_lists_every_problem():
    with pytest.raises(sf.SpecError) as info:
        sf.local_mesh((0, 2, 2), ("a", "b", "b"))
    text = str(info.value)
    assert text.count("\n  - ") == 2, text
    assert "axis 'a' has size 0" in text and "'b'" in text and "appear more than once" in text


@pytest.mark.multiprocess
def test_init_mesh_world_size_mismatch():
    with pytest.raises(RankProcessError, match=(
        r"the mesh shape \{'data': 3\} has 3 devices but the world has 2 processes"
    )) as info:
        run_multiprocess(lambda: sf.init_mesh({"data": 3}, timeout=10), 2)
    assert info.value.exc_type == "shardfn._errors.SpecError"
    assert "Fix: pick a shape whose sizes multiply to 2" in info.value.traceback


def test_init_mesh_without_launcher(monkeypatch):
    assert not torch.distributed.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(sf.ShardingError, match=(
        r"init_mesh found no process group and the launcher variables "
        r"\['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\] are not set(.|\n)*"
        r"torchrun --standalone --nproc-per-node 4"
    )):
        sf.init_mesh({"data": 4})
    assert "RANK" not in os.environ


def test_rank_outside_run_is_an_error():
    mesh = sf.local_mesh({"data": 2})
    message = r"this simulated mesh has 2 ranks, and the calling thread is none of them"
    with pytest.raises(sf.ShardingError, match=message):
        mesh.rank
    with pytest.raises(sf.ShardingError, match=message):
        mesh.coords
    with pytest.raises(sf.ShardingError, match=r"Fix: put the per-rank code in a function and call mesh.run\(fn\)"):
        mesh.all_reduce(torch.ones(1), "data")


# -- lifetime ---------------------------------------------------------------------------------


def _collected(make) -> bool:
    """Whether the simulated backend `make()` used is gone once its return value is dropped
    (each backend holds one gloo group, and its threads, per rank and axis subset)."""
    import gc
    import weakref

    ref = weakref.ref(make())
    gc.collect()
    return ref() is None


def test_a_mesh_is_freed_after_shard_steps_remat_and_a_global_shard_map():
    # Autograd nodes whose ctx holds the step's state or the mesh, kept by a tensor that the
    # same state holds, form cycles through the C++ graph that Python's collector cannot see;
    # the test suite's worker once reached 3000+ gloo threads this way.
    torch.manual_seed(0)
    params = {"embed": torch.randn(4, 4), "layers": [{"w": torch.randn(4, 4)} for _ in range(3)],
              "head": torch.randn(4, 2)}

    def loss_fn(p, x):  # the root unit (embed, head) is read again after the layers, as a GPT's head is
        x = x @ p["embed"]
        for layer in p["layers"]:
            x = torch.tanh(x @ layer["w"])
        return (x @ p["head"]).square().mean()

    def shard_steps():
        mesh = sf.local_mesh({"data": 2})
        step = sf.shard(loss_fn, mesh)

        def body():
            shards = step.shard_params(params)
            step(shards, torch.randn(2, 4))
            step.grad_and_value(shards, torch.randn(2, 4))
            torch.func.grad(step)(shards, torch.randn(2, 4))  # last: what the step keeps past its end

        mesh.run(body)
        return mesh._backend

    def global_shard_map():
        mesh = sf.local_mesh({"data": 2})
        f = sf.shard_map(lambda x, w: (torch.tanh(x) * w, sf.psum(x.sum(), "data") * w), mesh,
                         in_specs=(sf.P("data"), sf.P()), out_specs=(sf.P("data"), sf.P()))
        x, w = torch.randn(4, requires_grad=True), torch.randn((), requires_grad=True)
        y, s = f(x, w)
        (y.sum() + s).backward()
        return mesh._backend

    def remat_in_shard():
        mesh = sf.local_mesh({"data": 2})
        layer = sf.remat(lambda p, x: torch.tanh(x @ p["w"]))
        step = sf.shard(lambda p, x: sum(layer(lp, x) for lp in p["layers"]).square().mean(), mesh)
        mesh.run(lambda: step.grad_and_value(step.shard_params({"layers": params["layers"]}), torch.randn(2, 4)))
        return mesh._backend

    assert _collected(shard_steps)
    assert _collected(global_shard_map)
    assert _collected(remat_in_shard)
