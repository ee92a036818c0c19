"""sf.testing.assert_trees_allclose / assert_trees_equal: structure first, then values by dtype."""

import pytest
import torch

import shardfn as sf


def test_equal_trees_pass_and_nans_match():
    tree = {"layers": [{"w": torch.tensor([1.0, float("nan")])}], "step": 3}
    sf.testing.assert_trees_equal(tree, {"layers": [{"w": torch.tensor([1.0, float("nan")])}], "step": 3})
    sf.testing.assert_trees_allclose(tree, {"layers": [{"w": torch.tensor([1.0 + 1e-7, float("nan")])}], "step": 3})


def test_a_structure_difference_names_the_key_path():
    a = {"layers": [{"w": torch.ones(2)}, {"w": torch.ones(2)}]}
    b = {"layers": [{"w": torch.ones(2)}, {"v": torch.ones(2)}]}
    with pytest.raises(AssertionError, match=r"^trees have different structures at \['layers'\]\[1\]\['w'\] "
                                             r"\(leaf 1\): the other tree has \['layers'\]\[1\]\['v'\] there"):
        sf.testing.assert_trees_allclose(a, b)


def test_a_value_difference_names_the_leaf_and_the_difference():
    a = {"w": torch.zeros(3, dtype=torch.float64)}
    b = {"w": torch.tensor([0.0, 2e-9, 0.0], dtype=torch.float64)}
    with pytest.raises(AssertionError, match=r"^\['w'\]: values differ beyond rtol=1e-10, atol=1e-12 "
                                             r"\(max \|difference\| 2e-09, dtype torch.float64\)"):
        sf.testing.assert_trees_allclose(a, b)
    sf.testing.assert_trees_allclose(a, b, atol=1e-8)
    with pytest.raises(AssertionError, match=r"^\['w'\]: values differ \(max \|difference\| 2e-09\)"):
        sf.testing.assert_trees_equal(a, b)


def test_dtype_and_shape_differences_are_named():
    with pytest.raises(AssertionError, match=r"^\['w'\]: torch.float32 \(2,\) vs torch.float64 \(2,\)"):
        sf.testing.assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(AssertionError, match=r"^\['n'\]: 1 != 2"):
        sf.testing.assert_trees_allclose({"n": 1}, {"n": 2})
    with pytest.raises(AssertionError, match=r"^\['i'\]: values differ \(torch.int64, compared exactly\)"):
        sf.testing.assert_trees_allclose({"i": torch.tensor([1])}, {"i": torch.tensor([2])})
