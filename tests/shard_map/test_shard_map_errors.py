"""Every shard_map / collective error a user can provoke, one test each, matching its message."""

from __future__ import annotations

import pytest
import torch

import shardfn as sf
from collective_cases import mesh_for

torch.set_num_threads(1)
P = sf.P


@pytest.fixture
def mesh():
    return mesh_for({"data": 2, "model": 2})


def test_collective_outside_shard_map_names_op_and_axis():
    with pytest.raises(sf.ShardingError, match=r"psum\(axis='data'\) was called outside shard_map"):
        sf.psum(torch.ones(2), "data")
    with pytest.raises(sf.ShardingError, match=r"all_gather\(axis=\('data', 'model'\)\) was called outside"):
        sf.all_gather(torch.ones(2), ("data", "model"))


def test_collective_outside_shard_map_inside_a_rank(mesh):
    """Inside mesh.run but outside shard_map is still outside: the axis needs a binding."""
    with pytest.raises(sf.ShardingError, match=r"ppermute\(axis='model'\) was called outside shard_map"):
        mesh.run(lambda: sf.ppermute(torch.ones(1), "model", [(0, 1), (1, 0)]))


def test_unknown_axis_names_it_and_lists_mesh_axes(mesh):
    f = sf.shard_map(lambda x: sf.psum(x, "modle"), mesh, P("data"), P())
    with pytest.raises(sf.SpecError, match=r"psum\(axis='modle'\): 'modle' is not an axis of this mesh; "
                                           r"mesh axes are \['data', 'model'\]"):
        f(torch.ones(2))


def test_unknown_axis_in_spec(mesh):
    f = sf.shard_map(lambda x: x, mesh, P("dta"), P("dta"))
    with pytest.raises(sf.SpecError, match=r"names axis 'dta', which is not a mesh axis; the mesh has axes "
                                           r"\['data', 'model'\]"):
        f(torch.ones(2))


def test_mismatched_in_specs_tree_shows_key_path(mesh):
    f = sf.shard_map(lambda t: t["a"], mesh, ({"a": P(), "b": {"d": P()}},), P())
    with pytest.raises(sf.SpecError, match=r"at in_specs\[0\]\['b'\], the spec dict has missing key\(s\) \['c'\] "
                                           r"and extra key\(s\) \['d'\]"):
        f({"a": torch.ones(2), "b": {"c": torch.ones(2)}})


def test_mismatched_out_specs_tree_shows_key_path(mesh):
    f = sf.shard_map(lambda x: {"y": [x, x]}, mesh, P(), {"y": [P(), P(), P()]})
    with pytest.raises(sf.SpecError, match=r"at out_specs\['y'\], the spec has a list of length 3 but the "
                                           r"argument has a list of length 2"):
        f(torch.ones(2))


def test_varying_output_under_a_replicated_spec_is_a_static_error(mesh):
    f = sf.shard_map(lambda x: x * 2, mesh, P("data"), P())
    with pytest.raises(sf.ShardingError, match=r"(?s)out_specs do not match what the function returns:\n  - the "
                                               r"output: varies over \['data'\].*out spec P\(\) omits them.*Fix: "
                                               r"reduce it over \['data'\] first \(sf.psum / sf.pmean / "
                                               r"sf.all_gather\), or name the axes in the out spec \(e.g. "
                                               r"P\('data'\)\).*check_vma=False"):
        f(torch.arange(4.0))


def test_varying_output_error_names_every_bad_output_path(mesh):
    f = sf.shard_map(lambda x, y: {"ok": sf.psum(x, "data"), "bad": x, "worse": [y + x]}, mesh,
                     (P("data"), P("model")), {"ok": P(), "bad": P(), "worse": [P("data")]})
    with pytest.raises(sf.ShardingError, match=r"(?s)  - output\['bad'\]: varies over \['data'\].*"
                                               r"  - output\['worse'\]\[0\]: varies over \['model'\].*"
                                               r"out spec P\('data'\) omits them"):
        f(torch.arange(4.0), torch.arange(4.0))


def test_runtime_replication_check_is_opt_in(mesh):
    # the types cannot see a value built from a Python int; check=True finds it at run time
    def f(x):
        return x * float(sf.axis_index("data"))

    g = sf.shard_map(f, mesh, P(), P(), check=True)
    with pytest.raises(sf.ShardingError, match=r"(?s)out_specs promise that \['output'\] are the same on every "
                                               r"rank of mesh axes \('data', 'model'\).*without check=True"):
        g(torch.arange(4.0))
    # without it: rank 0's block, no error and no collective
    torch.testing.assert_close(sf.shard_map(f, mesh, P(), P())(torch.arange(4.0)), torch.zeros(4))


def test_varying_output_passes_with_check_vma_false(mesh):
    f = sf.shard_map(lambda x: x * 2, mesh, P("data"), P(), check_vma=False)
    torch.testing.assert_close(f(torch.arange(4.0)), torch.tensor([0.0, 2.0]))  # rank 0's block


def test_ppermute_with_a_non_permutation(mesh):
    f = sf.shard_map(lambda x: sf.ppermute(x, "data", [(0, 1), (1, 1)]), mesh, P("data"), P("data"))
    with pytest.raises(sf.SpecError, match=r"ppermute\(axis='data', perm=\[\(0, 1\), \(1, 1\)\]\): perm must be "
                                           r"a permutation"):
        f(torch.arange(4.0))


def test_ppermute_out_of_range(mesh):
    f = sf.shard_map(lambda x: sf.ppermute(x, "data", [(0, 2)]), mesh, P("data"), P("data"))
    with pytest.raises(sf.SpecError, match=r"out of range: \[\(0, 2\)\]"):
        f(torch.arange(4.0))


def test_psum_scatter_with_indivisible_dim(mesh):
    f = sf.shard_map(lambda x: sf.psum_scatter(x, "data"), mesh, P(), P("data"))
    with pytest.raises(sf.SpecError, match=r"psum_scatter\(axis='data', dim=0, tiled=True\): x has shape \(3,\); "
                                           r"dim 0 has size 3, which must be divisible by the axis size 2"):
        f(torch.arange(3.0))


def test_all_to_all_with_indivisible_split_dim(mesh):
    f = sf.shard_map(lambda x: sf.all_to_all(x, "model", 0, 0), mesh, P(), P("model"))
    with pytest.raises(sf.SpecError, match=r"split dim 0 has size 3, which must be divisible by the axis size 2"):
        f(torch.arange(3.0))


def test_spec_longer_than_tensor_rank(mesh):
    f = sf.shard_map(lambda x: x, mesh, P("data", None), P())
    with pytest.raises(sf.SpecError, match=r"(?s)in_specs for argument \[0\]: invalid partition spec "
                                           r"P\('data', None\) for shape \(4,\).*has 2 entries but the tensor "
                                           r"has rank 1"):
        f(torch.arange(4.0))


def test_non_tensor_argument_with_a_sharding_spec(mesh):
    f = sf.shard_map(lambda x, k: x * k, mesh, (P("data"), P("data")), P("data"))
    with pytest.raises(sf.SpecError, match=r"argument \[1\] is a int, not a tensor, but its in spec P\('data'\) "
                                           r"shards it over \('data',\)"):
        f(torch.arange(4.0), 3)


def test_error_in_global_mode_names_the_rank(mesh):
    f = sf.shard_map(lambda x: sf.psum(x, "modle"), mesh, P("data"), P())
    with pytest.raises(sf.SpecError) as info:
        f(torch.ones(2))
    assert "raised on rank" in str(info.value) + "".join(getattr(info.value, "__notes__", []))


def test_global_mode_rejects_vmap_with_a_clear_error(mesh):
    f = sf.shard_map(lambda x: sf.psum(x.sum(), "data"), mesh, P("data"), P())
    with pytest.raises(sf.ShardingError, match=r"global mode\) supports values and .backward\(\), not torch.func"):
        torch.func.vmap(f)(torch.ones(3, 4))


def test_global_mode_rejects_jvp_with_a_clear_error(mesh):
    f = sf.shard_map(lambda x: sf.psum(x.sum(), "data"), mesh, P("data"), P())
    with pytest.raises(sf.ShardingError, match=r"not torch.func transforms"):
        torch.func.jvp(f, (torch.ones(4),), (torch.ones(4),))
