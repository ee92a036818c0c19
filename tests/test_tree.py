"""broadcast_prefix: spec trees as pytree prefixes of argument trees, path-naming errors."""

import collections

import pytest
import torch

import shardfn as sf
from shardfn._tree import broadcast_prefix, flatten, flatten_with_paths, keystr

P = sf.P


def is_spec(x) -> bool:
    return isinstance(x, sf.PartitionSpec)


def bp(prefix, tree, what="in_specs"):
    return broadcast_prefix(prefix, tree, what=what, is_prefix_leaf=is_spec)


def leaf(n: int = 1) -> torch.Tensor:
    return torch.zeros(n)


# -- matching prefixes ----------------------------------------------------------------------


def test_single_spec_applies_to_everything():
    tree = {"a": leaf(), "b": [leaf(), (leaf(), leaf())]}
    assert bp(P("x"), tree) == [P("x")] * 4
    assert bp(None, tree) == [None] * 4  # None = replicated, a leaf of spec trees


def test_full_tree_of_specs():
    tree = {"w": leaf(), "b": [leaf(), leaf()]}
    assert bp({"w": P("x"), "b": [P(), P(None, "y")]}, tree) == [P(), P(None, "y"), P("x")]  # b before w


def test_prefix_stops_at_subtrees():
    tree = {"layers": [{"w": leaf(), "b": leaf()}, {"w": leaf(), "b": leaf()}], "emb": leaf()}
    specs = bp({"layers": [P("x"), {"w": P("y"), "b": None}], "emb": P()}, tree)
    # flatten order: emb, layers[0].b, layers[0].w, layers[1].b, layers[1].w
    assert specs == [P(), P("x"), P("x"), None, P("y")]


def test_result_follows_the_argument_flatten_order():
    tree = {"b": leaf(), "a": [leaf(), leaf()], "c": leaf()}
    prefix = {"c": P("c"), "a": P("a"), "b": P("b")}
    paths, _, _ = flatten_with_paths(tree)
    specs = bp(prefix, tree)
    assert len(specs) == len(paths) == 4
    for path, spec in zip(paths, specs):
        assert spec == P(path[0]), (keystr(path), spec)


def test_none_in_arguments_is_an_empty_node():
    tree = {"a": None, "b": leaf(), "c": [None, leaf()]}
    assert len(flatten(tree)[0]) == 2
    assert bp({"a": P("x"), "b": P("y"), "c": [P("x"), None]}, tree) == [P("y"), None]
    assert bp({"a": None, "b": P(), "c": P("x")}, tree) == [P(), P("x")]


def test_tuple_and_namedtuple_arguments():
    Pair = collections.namedtuple("Pair", ["first", "second"])
    assert bp((P("x"), P()), (leaf(), leaf())) == [P("x"), P()]
    assert bp(Pair(P("x"), None), Pair(leaf(), [leaf(), leaf()])) == [P("x"), None, None]


def test_spec_leaf_is_not_mistaken_for_a_tuple_node():
    # P is a tuple subclass, yet it is one spec, not a node with entries.
    assert bp(P("x", None), (leaf(), leaf())) == [P("x", None)] * 2
    assert bp((P("x", None), P()), (leaf(), leaf())) == [P("x", None), P()]


def test_dict_prefix_for_an_ordered_dict_argument():
    # An OrderedDict (e.g. module.state_dict()) flattens in insertion order, a dict sorted:
    # the specs must follow the argument's keys, not the prefix's order.
    tree = collections.OrderedDict(b=[leaf(), leaf()], a=leaf())  # flattens as b, b, a
    assert bp({"a": P("x"), "b": P()}, tree) == [P(), P(), P("x")]


# -- mismatches name the key path ---------------------------------------------------------

FIX = r"\nFix: give in_specs the same structure as the arguments"


@pytest.mark.parametrize("prefix, tree, message", [
    ({"a": P()}, {"a": leaf(), "b": leaf()},
     r"at in_specs, the spec dict has missing key\(s\) \['b'\] compared to the argument"),
    ({"a": P(), "b": P(), "c": P()}, {"a": leaf(), "b": leaf()},
     r"at in_specs, the spec dict has extra key\(s\) \['c'\] compared to the argument"),
    ({"p": {"x": P(), "z": P()}}, {"p": {"x": leaf(), "y": leaf()}},
     r"at in_specs\['p'\], the spec dict has missing key\(s\) \['y'\] and extra key\(s\) \['z'\]"),
    ({"b": [P(), P()]}, {"b": [leaf(), leaf(), leaf()]},
     r"at in_specs\['b'\], the spec has a list of length 2 but the argument has a list of length 3"),
    ({"b": {"w": P()}}, {"b": leaf()},
     r"at in_specs\['b'\], the spec has a dict with keys \[\"'w'\"\] but the argument is a Tensor"),
    ([{"w": P()}, {"w": [P(), P()]}], [{"w": leaf()}, {"w": leaf()}],
     r"at in_specs\[1\]\['w'\], the spec has a list of length 2 but the argument is a Tensor"),
    ([P(), P()], (leaf(), leaf()),
     r"at in_specs, the spec has a list of length 2 but the argument has a tuple of length 2"),
    ({"a": P()}, [leaf()],
     r"at in_specs, the spec has a dict with keys \[\"'a'\"\] but the argument has a list of length 1"),
])
def test_mismatch_names_the_key_path(prefix, tree, message):
    with pytest.raises(sf.SpecError, match=r"in_specs is not a pytree prefix of the arguments: " + message + ".*" + FIX):
        bp(prefix, tree)


def test_mismatch_uses_the_callers_name_and_is_a_value_error():
    with pytest.raises(ValueError, match=r"out_specs is not a pytree prefix .* at out_specs\['b'\]"):
        bp({"b": [P()]}, {"b": [leaf(), leaf()]}, what="out_specs")


def test_keystr():
    assert keystr(("layers", 3, "w")) == "['layers'][3]['w']"
    assert keystr(()) == ""
