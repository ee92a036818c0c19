"""Bad input at the public API: every failure must be a shardfn error with a message.

Hypothesis throws malformed specs, mismatched trees, wrong dtypes and devices, empty
tensors, zero-size and huge axes and wrong perms at each entry point. The call must either
succeed or raise `sf.ShardingError` (a documented class, with a non-empty message): never
another exception, a hang (the mesh timeout is short and pytest-timeout is the backstop),
or a dead process.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardfn as sf

EXAMPLES = 500
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

MESH_1D = sf.local_mesh({"data": 2}, timeout=5)
MESH_2D = sf.local_mesh({"data": 2, "model": 2}, timeout=5)
AXES = ["data", "model", "x", "", "data ", 0, 1, -1, None, ("data",), ("data", "data"), ("model", "data"), (),
        ["data"], ("data", 3), b"data", 1.5]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**9), st.floats(allow_nan=True),
                    st.text(max_size=5), st.binary(max_size=3))
axes = st.one_of(st.sampled_from(AXES), scalars)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                  torch.complex64, torch.uint8]))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    device = draw(st.sampled_from(["cpu", "cpu", "cpu", "meta"]))
    return torch.zeros(shape, dtype=dtype, device=device)


specs = st.one_of(
    st.builds(lambda e: sf.P(*e), st.lists(st.sampled_from([None, "data", "model", ("data", "model"), ()]), max_size=4)),
    st.none(), scalars, st.sampled_from([("data",), ["data"], {"a": sf.P()}, [sf.P(), sf.P()], (sf.P("data"),)]),
)
junk = st.one_of(scalars, tensors(), specs, st.lists(tensors(), max_size=3),
                 st.dictionaries(st.sampled_from(["a", "b", "w"]), tensors(), max_size=3))


def _shardfn_error_or_success(mesh, fn, *args):
    try:
        mesh.run(fn, *args)
    except sf.ShardingError as err:
        assert str(err).strip(), "a shardfn error must say what is wrong"


@FUZZ
@given(shape=st.one_of(st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), st.one_of(st.integers(-2, 10**7), scalars), max_size=3),
                       st.lists(st.integers(-2, 10**7), max_size=3), scalars),
       names=st.one_of(st.none(), st.lists(st.one_of(st.text(max_size=3), scalars), max_size=3)),
       timeout=st.one_of(st.just(5.0), scalars))
def test_fuzz_local_mesh(shape, names, timeout):
    try:
        mesh = sf.local_mesh(shape, names, timeout=timeout)
    except sf.ShardingError as err:
        assert str(err)
        return
    assert 1 <= mesh.size <= 16


@FUZZ
@given(entries=st.lists(st.one_of(axes, st.tuples(axes, axes)), max_size=4))
def test_fuzz_partition_spec(entries):
    try:
        spec = sf.P(*entries)
    except sf.ShardingError as err:
        assert str(err)
        return
    assert isinstance(spec, tuple)


@FUZZ
@given(x=junk, spec=specs, use_2d=st.booleans(), op=st.sampled_from(["scatter", "gather"]))
def test_fuzz_scatter_gather(x, spec, use_2d, op):
    mesh = MESH_2D if use_2d else MESH_1D
    fn = sf.scatter if op == "scatter" else sf.gather
    _shardfn_error_or_success(mesh, lambda: fn(x, mesh, spec))


COLLECTIVES = {
    "psum": lambda x, a, k: sf.psum(x, a),
    "pmean": lambda x, a, k: sf.pmean(x, a),
    "pmax": lambda x, a, k: sf.pmax(x, a),
    "pmin": lambda x, a, k: sf.pmin(x, a),
    "all_gather": lambda x, a, k: sf.all_gather(x, a, dim=k["dim"], tiled=k["tiled"]),
    "psum_scatter": lambda x, a, k: sf.psum_scatter(x, a, dim=k["dim"], tiled=k["tiled"]),
    "ppermute": lambda x, a, k: sf.ppermute(x, a, k["perm"]),
    "all_to_all": lambda x, a, k: sf.all_to_all(x, a, k["dim"], k["dim2"], tiled=k["tiled"]),
    "axis_index": lambda x, a, k: sf.axis_index(a),
    "axis_size": lambda x, a, k: sf.axis_size(a),
}


@FUZZ
@given(name=st.sampled_from(sorted(COLLECTIVES)), x=junk, axis=axes,
       dim=st.one_of(st.integers(-4, 4), scalars), dim2=st.integers(-4, 4), tiled=st.one_of(st.booleans(), scalars),
       perm=st.one_of(st.lists(st.tuples(st.integers(-1, 4), st.integers(-1, 4)), max_size=4), scalars,
                      st.lists(scalars, max_size=3)),
       inside=st.booleans())
def test_fuzz_collectives(name, x, axis, dim, dim2, tiled, perm, inside):
    kwargs = {"dim": dim, "dim2": dim2, "tiled": tiled, "perm": perm}
    call = COLLECTIVES[name]
    if not inside:  # outside shard_map: always a clear error
        with pytest.raises(sf.ShardingError, match="outside shard_map"):
            call(x, axis, kwargs)
        return
    mapped = sf.shard_map(lambda: call(x, axis, kwargs), MESH_2D, (), sf.P(), check=False)
    _shardfn_error_or_success(MESH_2D, mapped)


@FUZZ
@given(args=st.lists(junk, max_size=3), in_specs=st.one_of(specs, st.lists(specs, max_size=3), st.tuples(specs, specs)),
       out_specs=st.one_of(specs, st.lists(specs, max_size=2)), body=st.sampled_from(["first", "psum", "tuple", "junk"]))
def test_fuzz_shard_map(args, in_specs, out_specs, body):
    fns = {
        "first": lambda *a: a[0] if a else torch.zeros(()),
        "psum": lambda *a: sf.psum(torch.ones(()), "data"),
        "tuple": lambda *a: tuple(a),
        "junk": lambda *a: "not a tensor",
    }
    try:
        mapped = sf.shard_map(fns[body], MESH_2D, in_specs, out_specs)
    except sf.ShardingError:
        return
    _shardfn_error_or_success(MESH_2D, mapped, *args)


@FUZZ
@given(params=st.one_of(junk, st.dictionaries(st.sampled_from(["w", "b"]), junk, max_size=2),
                        st.lists(st.dictionaries(st.sampled_from(["w"]), tensors(), max_size=1), max_size=2)),
       batch=junk,
       kwargs=st.fixed_dictionaries({}, optional={
           "data_axes": axes, "shard_axes": axes, "prefetch": st.one_of(st.integers(-2, 3), scalars),
           "reshard_after_forward": st.one_of(st.booleans(), scalars), "units": st.one_of(st.none(), scalars),
           "mixed_precision": st.one_of(st.none(), scalars, st.just(sf.MixedPrecision(torch.bfloat16))),
       }))
def test_fuzz_shard(params, batch, kwargs):
    def leaves(p):  # the params view: tensors, mappings and sequences of them
        if isinstance(p, torch.Tensor):
            return [p]
        items = p.values() if hasattr(p, "keys") else p if isinstance(p, (list, tuple)) or hasattr(p, "__len__") else []
        return [t for item in items for t in leaves(item)]

    def loss_fn(p, b):  # a correct user function: every failure must come from shardfn
        return sum((t.float().sum() for t in leaves(p)), torch.zeros(()))

    try:
        step = sf.shard(loss_fn, MESH_1D, **kwargs)
    except sf.ShardingError:
        return

    def body():
        shards = step.shard_params(params)
        return step(shards, batch)

    _shardfn_error_or_success(MESH_1D, body)


@FUZZ
@given(params=st.one_of(st.dictionaries(st.sampled_from(["w", "b"]), tensors(), max_size=2),
                        st.lists(st.dictionaries(st.sampled_from(["w"]), tensors(), max_size=1), max_size=2), junk),
       param_specs=st.one_of(specs, st.dictionaries(st.sampled_from(["w", "b", "x"]), specs, max_size=2),
                             st.lists(specs, max_size=2), st.just(lambda path: sf.P(None, "model"))),
       data_axes=st.sampled_from(["data", "model", ("data", "model"), "x"]),
       body=st.sampled_from(["sum", "psum_model", "psum_data"]))
def test_fuzz_shard_param_specs(params, param_specs, data_axes, body):
    """FSDP x TP entry points: param_specs of any shape against any params on a 2-D mesh."""
    def loss_fn(p, b):
        total = sum((t.float().sum() for t in optree_leaves(p)), torch.zeros(()))
        return {"sum": total, "psum_model": sf.psum(total, "model"), "psum_data": sf.psum(total, "data")}[body]

    try:
        step = sf.shard(loss_fn, MESH_2D, data_axes=data_axes, param_specs=param_specs)
    except sf.ShardingError:
        return

    def run():
        return step(step.shard_params(params), torch.zeros(2))

    _shardfn_error_or_success(MESH_2D, run)


def optree_leaves(p):
    if isinstance(p, torch.Tensor):
        return [p]
    items = p.values() if hasattr(p, "keys") else p if isinstance(p, (list, tuple)) else []
    return [t for item in items for t in optree_leaves(item)]
