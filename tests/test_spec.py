"""PartitionSpec semantics, spec validation, and torch.chunk block arithmetic."""

import itertools
import pickle

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._spec import block_index, chunk_bounds, local_shape, validate_spec

P = sf.P


# -- P ------------------------------------------------------------------------------------


def test_p_is_partition_spec_and_a_tuple():
    assert sf.P is sf.PartitionSpec
    spec = P("data", None)
    assert isinstance(spec, tuple) and isinstance(spec, sf.PartitionSpec)
    assert tuple(spec) == ("data", None)
    assert len(spec) == 2 and spec[0] == "data" and spec[1] is None
    assert P() == () and len(P()) == 0


def test_p_normalizes_entries():
    assert tuple(P(["a", "b"], None)) == (("a", "b"), None)  # a list of names becomes a tuple
    assert tuple(P(("a",))) == (("a",),)  # 1-tuples kept as written
    assert tuple(P(())) == ((),)
    assert isinstance(P(["a"])[0], tuple)


@pytest.mark.parametrize("entry", [3, 1.5, ("a", 2), {"a"}, [None]])
def test_p_rejects_bad_entries(entry):
    with pytest.raises(sf.SpecError, match=(
        r"a PartitionSpec entry must be None, an axis name or a tuple of axis names; got "
    )):
        P("data", entry)


def test_p_repr_and_axes():
    assert repr(P("data", None)) == "P('data', None)"
    assert repr(P()) == "P()"
    assert repr(P(("replica", "shard"), "model")) == "P(('replica', 'shard'), 'model')"
    assert str(P(None, "x")) == "P(None, 'x')"
    assert P(("a", "b"), None, "c").axes == ("a", "b", "c")
    assert P().axes == () and P(None, None).axes == ()


def test_p_pickles_and_compares():
    spec = P(("a", "b"), None, "c")
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and type(again) is sf.PartitionSpec
    assert P("x") == P("x") and P("x") != P("y")
    assert hash(P("x", None)) == hash(P("x", None))


def test_p_is_an_optree_leaf():
    tree = {"w": P("x", None), "b": [P(), P(("x", "y"))], "c": None}
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=True, namespace="shardfn")
    assert leaves == [P(), P(("x", "y")), None, P("x", None)]  # dict keys sorted: b, c, w
    assert all(type(leaf) is sf.PartitionSpec for leaf in leaves if leaf is not None)
    assert optree.tree_unflatten(treedef, leaves) == tree


def test_trailing_dims_default_to_none():
    mesh_shape = {"x": 2, "y": 3}
    coords = {"x": 1, "y": 2}
    for spec in (P("x"), P("x", None), P("x", None, None)):
        assert local_shape((6, 9, 4), spec, coords, mesh_shape) == (3, 9, 4)
        validate_spec(spec, (6, 9, 4), mesh_shape, "f")
    assert local_shape((6, 9), P(), coords, mesh_shape) == (6, 9)
    assert local_shape((6, 9), P(None, "y"), coords, mesh_shape) == (6, 3)


# -- validate_spec ------------------------------------------------------------------------

MESH = {"data": 2, "model": 4}


def test_validate_spec_accepts():
    validate_spec(P("data", "model"), (4, 8), MESH, "f")
    validate_spec(P(("data", "model")), (8,), MESH, "f")
    validate_spec(P(None, None), (3, 3), MESH, "f")  # uneven/unsplit sizes are fine
    validate_spec(P("data"), (3,), MESH, "f")  # torch.chunk rules: 2 + 1 rows


@pytest.mark.parametrize("spec, shape, message", [
    (P("expert"), (4,), r"in_specs\['w'\]: invalid partition spec P\('expert'\) for shape \(4,\):\n"
     r"  - dim 0 names axis 'expert', which is not a mesh axis; the mesh has axes \['data', 'model'\]"
     r" \(sizes \{'data': 2, 'model': 4\}\)"),
    (P("data", "data"), (4, 4), r"axis 'data' is used twice \(dims 0 and 1\); an axis may shard one dim only"),
    (P(("model", "data"), "data"), (8, 4), r"axis 'data' is used twice \(dims 0 and 1\)"),
    (P(None, "data", None), (4, 4), r"the spec P\(None, 'data', None\) has 3 entries but the tensor has "
     r"rank 2 \(shape \(4, 4\)\); fix: drop the extra entries, e.g. P\(None, 'data'\)"),
    (P("data"), (), r"has 1 entries but the tensor has rank 0"),
])
def test_validate_spec_errors(spec, shape, message):
    with pytest.raises(sf.SpecError, match=message):
        validate_spec(spec, shape, MESH, "in_specs['w']")


def test_validate_spec_lists_every_problem():
    with pytest.raises(sf.SpecError) as info:
        validate_spec(P("expert", "data", "data"), (4, 4), MESH, "f")
    text = str(info.value)
    assert text.count("\n  - ") == 3, text
    assert "has 3 entries" in text and "'expert'" in text and "used twice" in text


@pytest.mark.parametrize("spec, fix", [(("data", None), r"sf\.P\('data', None\)"), ("data", r"sf\.P\('data',\)")])
def test_validate_spec_wants_a_partition_spec(spec, fix):
    with pytest.raises(sf.SpecError, match=r"out_specs: expected a PartitionSpec \(sf.P\(...\)\) or None, got "
                       r"(tuple|str) .*\nFix: wrap the entries, e.g. " + fix):
        validate_spec(spec, (4, 4), MESH, "out_specs")


# -- blocks follow torch.chunk -----------------------------------------------------------


def chunk_sizes(n: int, k: int) -> list[int]:
    """Rows of each of k blocks per torch.chunk, padded with empty blocks to k."""
    sizes = [c.shape[0] for c in torch.arange(n).chunk(k)]
    return sizes + [0] * (k - len(sizes))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 64), k=st.integers(1, 12))
def test_chunk_bounds_match_torch_chunk(n, k):
    x = torch.arange(n)
    chunks = list(x.chunk(k))
    stop_before = 0
    for i, size in enumerate(chunk_sizes(n, k)):
        start, stop = chunk_bounds(n, k, i)
        assert start == stop_before and stop - start == size and 0 <= start <= stop <= n
        if i < len(chunks):
            assert torch.equal(x[start:stop], chunks[i])
        stop_before = stop
    assert stop_before == n


@pytest.mark.parametrize("n, k, sizes", [(5, 4, [2, 2, 1, 0]), (7, 3, [3, 3, 1]), (1, 3, [1, 0, 0]),
                                         (0, 2, [0, 0]), (6, 4, [2, 2, 2, 0]), (8, 4, [2, 2, 2, 2])])
def test_uneven_and_empty_blocks(n, k, sizes):
    assert [chunk_bounds(n, k, i)[1] - chunk_bounds(n, k, i)[0] for i in range(k)] == sizes
    assert chunk_sizes(n, k) == sizes


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(0, 20), cols=st.integers(0, 20))
def test_local_shape_on_a_2d_mesh_matches_nested_chunk(rows, cols):
    mesh_shape = {"x": 2, "y": 3}
    for x, y in itertools.product(range(2), range(3)):
        coords = {"x": x, "y": y}
        # P(('x', 'y')): dim 0 in 6 blocks, x major.
        assert local_shape((rows, cols), P(("x", "y")), coords, mesh_shape) == (chunk_sizes(rows, 6)[x * 3 + y], cols)
        assert block_index(("x", "y"), coords, mesh_shape) == (x * 3 + y, 6)
        assert block_index(("y", "x"), coords, mesh_shape) == (y * 2 + x, 6)
        # P('y', 'x'): dim 0 in 3 blocks by y, dim 1 in 2 blocks by x.
        assert local_shape((rows, cols), P("y", "x"), coords, mesh_shape) == (
            chunk_sizes(rows, 3)[y], chunk_sizes(cols, 2)[x]
        )
