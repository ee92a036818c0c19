"""Bad input at the public API: every failure must be a shardfn error with a message.

Hypothesis throws malformed specs, mismatched trees, wrong dtypes and devices, empty
tensors, zero-size and huge axes and wrong perms at each entry point. The call must either
raise `sf.ShardingError` (a documented class, with a non-empty message) or succeed with
the right value, checked against a reference that does not use shardfn's machinery
(`split_blocks` / `join_blocks`, `shmap_reference`, or the same function on one device):
never another exception, a wrong answer, a hang (the mesh timeout is short and
pytest-timeout is the backstop), or a dead process.
"""

import math

import optree
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing import C, join_blocks, shmap_reference, split_blocks

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
good_axes = st.sampled_from(["data", "model", ("data", "model"), ("model", "data")])  # so some calls succeed


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                  torch.complex64, torch.uint8]))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    device = draw(st.sampled_from(["cpu", "cpu", "cpu", "meta"]))
    # Distinct small integers (exact in every dtype here), so a wrong block or a missing
    # reduction shows in the value; the values ride along to the meta device as shapes only.
    values = (torch.arange(math.prod(shape)).reshape(shape) % 5 + 1).to(dtype)
    return values.to(device)


specs = st.one_of(
    st.builds(lambda e: sf.P(*e), st.lists(st.sampled_from([None, "data", "model", ("data", "model"), ()]), max_size=4)),
    st.none(), scalars, st.sampled_from([("data",), ["data"], {"a": sf.P()}, [sf.P(), sf.P()], (sf.P("data"),)]),
)
junk = st.one_of(scalars, tensors(), specs, st.lists(tensors(), max_size=3),
                 st.dictionaries(st.sampled_from(["a", "b", "w"]), tensors(), max_size=3))


def _shardfn_error_or_success(mesh, fn, *args):
    """Per-rank results of `mesh.run(fn, *args)`, or None after a shardfn error with a message."""
    try:
        results = mesh.run(fn, *args)
    except sf.ShardingError as err:
        assert str(err).strip(), "a shardfn error must say what is wrong"
        event("shardfn error")
        return None
    event("success: value checked")
    return results


def assert_same(got, want, what="result"):
    """Equal trees; tensors with the same shape, dtype and device and (off meta) equal values."""
    g_leaves, g_def = optree.tree_flatten(got, none_is_leaf=True)
    w_leaves, w_def = optree.tree_flatten(want, none_is_leaf=True)
    assert g_def == w_def, f"{what}: structure {g_def} != {w_def}"
    for a, b in zip(g_leaves, w_leaves):
        if not isinstance(b, torch.Tensor):
            assert a == b, f"{what}: {a!r} != {b!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{what}: {a!r} is not a tensor like {b!r}"
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), (
            f"{what}: {(a.shape, a.dtype, a.device)} != {(b.shape, b.dtype, b.device)}")
        if a.device.type != "meta":
            assert torch.equal(a, b), f"{what}: {a} != {b}"


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
    else:
        if isinstance(shape, dict):
            want = shape
        else:
            sizes = [shape] if isinstance(shape, int) else list(shape)
            axis_names = ["data"] if names is None and len(sizes) == 1 else [names] if isinstance(names, str) else names
            want = dict(zip(axis_names, sizes))
        assert mesh.shape == want and list(mesh.axis_names) == list(want)
        assert mesh.size == math.prod(want.values()) and 1 <= mesh.size <= 16
        assert mesh.run(lambda: mesh.rank) == list(range(mesh.size))


@FUZZ
@given(entries=st.lists(st.one_of(axes, st.tuples(axes, axes)), max_size=4))
def test_fuzz_partition_spec(entries):
    try:
        spec = sf.P(*entries)
    except sf.ShardingError as err:
        assert str(err)
    else:
        assert isinstance(spec, tuple)
        assert spec == tuple(tuple(e) if isinstance(e, (list, tuple)) else e for e in entries)


@FUZZ
@given(x=st.one_of(tensors(), junk), spec=specs, use_2d=st.booleans(), op=st.sampled_from(["scatter", "gather"]))
def test_fuzz_scatter_gather(x, spec, use_2d, op):
    mesh = MESH_2D if use_2d else MESH_1D
    fn = sf.scatter if op == "scatter" else sf.gather
    results = _shardfn_error_or_success(mesh, lambda: fn(x, mesh, spec))
    if results is None:
        return
    spec = sf.P() if spec is None else spec
    if op == "scatter":  # each rank's block of the global x
        want = split_blocks(x, spec, mesh.shape)
    else:  # every rank passed x as its block: the global value they make up, on every rank
        want = [join_blocks([x] * mesh.size, spec, mesh.shape, check=False)] * mesh.size
    for rank, (got, block) in enumerate(zip(results, want)):
        assert_same(got, block, f"{op} on rank {rank}")


# Through `C`: shardfn's collectives, or the reference ones inside `shmap_reference`.
COLLECTIVES = {
    "psum": lambda x, a, k: C.psum(x, a),
    "pmean": lambda x, a, k: C.pmean(x, a),
    "pmax": lambda x, a, k: C.pmax(x, a),
    "pmin": lambda x, a, k: C.pmin(x, a),
    "all_gather": lambda x, a, k: C.all_gather(x, a, dim=k["dim"], tiled=k["tiled"]),
    "psum_scatter": lambda x, a, k: C.psum_scatter(x, a, dim=k["dim"], tiled=k["tiled"]),
    "ppermute": lambda x, a, k: C.ppermute(x, a, k["perm"]),
    "all_to_all": lambda x, a, k: C.all_to_all(x, a, k["dim"], k["dim2"], tiled=k["tiled"]),
    "axis_index": lambda x, a, k: C.axis_index(a),
    "axis_size": lambda x, a, k: C.axis_size(a),
}


@FUZZ
@given(name=st.sampled_from(sorted(COLLECTIVES)), x=st.one_of(tensors(), junk), axis=st.one_of(good_axes, axes),
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
    else:
        def program():  # a different value on every rank (a tensor x scaled by 1 + the rank)
            index = C.axis_index(("data", "model"))
            mine = x * (1 + index) if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x
            return call(mine, axis, kwargs)

        results = _shardfn_error_or_success(MESH_2D, sf.shard_map(program, MESH_2D, (), sf.P(), check=False))
        if results is not None:
            _check_collective(name, x, axis, kwargs, results)


def _as_tensor(leaf):
    return torch.tensor(leaf, dtype=torch.float64) if isinstance(leaf, float) else torch.as_tensor(leaf)


def _check_collective(name, x, axis, kwargs, results):
    """Each rank's value == the reference's (`shmap_reference`), leaf by leaf: shardfn's
    collectives map over a pytree of tensors and Python numbers."""
    call = COLLECTIVES[name]

    def program():  # as above, one leaf at a time, every leaf stacked over the ranks
        index = C.axis_index(("data", "model"))
        mine = x * (1 + index) if isinstance(x, torch.Tensor) and x.dtype != torch.bool else x
        if isinstance(mine, torch.Tensor) or name in ("axis_index", "axis_size"):
            out = call(mine, axis, kwargs)
        else:
            out = optree.tree_map(lambda leaf: call(_as_tensor(leaf), axis, kwargs), mine)
        return optree.tree_map(lambda t: _as_tensor(t).unsqueeze(0), out)

    stacked = shmap_reference(program, MESH_2D.shape, (), sf.P(("data", "model")), check=False)()
    want_leaves, want_def = optree.tree_flatten(stacked)
    for rank, got in enumerate(results):
        got_leaves, got_def = optree.tree_flatten(got)
        assert got_def == want_def, f"{name} on rank {rank}: structure {got_def} != {want_def}"
        for a, b in zip(got_leaves, want_leaves):
            assert_same(a, b[rank] if isinstance(a, torch.Tensor) else b[rank].item(), f"{name} on rank {rank}")


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
    results = _shardfn_error_or_success(MESH_2D, mapped, *args)
    if results is None:
        return
    # Called from the rank threads, every rank's blocks are `args`: the body on one device.
    want = {"first": args[0] if args else torch.zeros(()), "psum": torch.tensor(2.0), "tuple": tuple(args),
            "junk": "not a tensor"}
    for rank, got in enumerate(results):
        assert_same(got, want[body], f"shard_map body {body!r} on rank {rank}")


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
    def loss_fn(p, b):  # a correct user function: every failure must come from shardfn
        return sum((t.float().sum() for t in param_leaves(p)), torch.zeros(()))

    try:
        step = sf.shard(loss_fn, MESH_1D, **kwargs)
    except sf.ShardingError:
        return

    def body():
        shards = step.shard_params(params)
        return step(shards, batch)

    results = _shardfn_error_or_success(MESH_1D, body)
    if results is None:
        return
    # One device: loss_fn on the whole params (cast to param_dtype), the same batch on both ranks.
    mp = kwargs.get("mixed_precision")
    cast = (lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t) if mp and mp.param_dtype else (lambda t: t)
    want = loss_fn(optree.tree_map(cast, params), batch)
    for rank, loss in enumerate(results):
        assert_same(loss.detach(), want.to(loss.dtype), f"shard loss on rank {rank}")


@FUZZ
@given(params=st.one_of(st.dictionaries(st.sampled_from(["w", "b"]), tensors(), max_size=2),
                        st.lists(st.dictionaries(st.sampled_from(["w"]), tensors(), max_size=1), max_size=2), junk),
       param_specs=st.one_of(specs, st.dictionaries(st.sampled_from(["w", "b", "x"]), specs, max_size=2),
                             st.lists(specs, max_size=2), st.just(lambda path: sf.P(None, "model"))),
       data_axes=st.sampled_from(["data", "model", ("data", "model"), "x"]),
       body=st.sampled_from(["sum", "psum_model", "psum_data"]),
       tp=st.booleans())
def test_fuzz_shard_param_specs(params, param_specs, data_axes, body, tp):
    """FSDP x TP entry points: param_specs of any shape against any params on a 2-D mesh
    (with `tp`, dict params get a well-formed Megatron-like case: specs naming 'model',
    data over 'data', the loss psummed over 'model')."""
    if tp and isinstance(params, dict) and params and all(isinstance(t, torch.Tensor) for t in params.values()):
        param_specs = {k: sf.P(None, "model") if t.dim() == 2 else sf.P("model") if t.dim() == 1 else None
                       for k, t in params.items()}
        data_axes, body = "data", "psum_model"
    def loss_fn(p, b):
        total = sum((t.float().sum() for t in param_leaves(p)), torch.zeros(()))
        return {"sum": total, "psum_model": C.psum(total, "model"), "psum_data": C.psum(total, "data")}[body]

    try:
        step = sf.shard(loss_fn, MESH_2D, data_axes=data_axes, param_specs=param_specs)
    except sf.ShardingError:
        return

    def run():
        return step(step.shard_params(params), torch.zeros(2))

    results = _shardfn_error_or_success(MESH_2D, run)
    if results is None:
        return
    # shard = shard_map over the whole mesh of loss_fn on the tensor-parallel blocks, the
    # loss averaged over data_axes; the reference evaluates that program without shardfn.
    if callable(param_specs):
        specs = optree.tree_map_with_path(lambda path, _: param_specs(path), params)
    else:
        specs = param_specs
    want = shmap_reference(lambda p: C.pmean(loss_fn(p, None), data_axes), MESH_2D.shape, (specs,), sf.P())(params)
    for rank, loss in enumerate(results):
        assert_same(loss.detach(), want, f"shard loss on rank {rank}")


def param_leaves(p):
    """The tensors of a params tree or of shard's read-only view of it, whose containers
    are mappings and sequences but not dicts and lists (so no isinstance(p, list))."""
    if isinstance(p, torch.Tensor):
        return [p]
    if isinstance(p, (str, bytes)):
        return []
    items = p.values() if hasattr(p, "keys") else p if hasattr(p, "__len__") else []
    return [t for item in items for t in param_leaves(item)]
