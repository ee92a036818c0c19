"""Pytree helpers on optree: key paths, prefix matching, path-naming errors.

Every call passes `namespace="shardfn"`, so a node type registered in that namespace
affects shardfn's flattening only, never a user's other libraries. shardfn itself
registers no node types: its trees are dicts, lists, tuples and namedtuples, which
optree handles everywhere, and a `PartitionSpec` is a leaf (see `_spec.py`).
`None` is a leaf in spec trees (it means "replicated") but an empty node in
argument trees, as in JAX.
"""

from __future__ import annotations

from typing import Any, Callable

import optree

from ._errors import SpecError

NAMESPACE = "shardfn"

__all__ = [
    "NAMESPACE",
    "flatten",
    "flatten_with_paths",
    "unflatten",
    "tree_map",
    "keystr",
    "broadcast_prefix",
]


def flatten(tree: Any, *, none_is_leaf: bool = False):
    """`(leaves, treedef)` of a tree, in shardfn's namespace."""
    return optree.tree_flatten(tree, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def flatten_with_paths(tree: Any, *, none_is_leaf: bool = False):
    """`(paths, leaves, treedef)`; each path is a tuple of keys / indices / attribute names."""
    return optree.tree_flatten_with_path(tree, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def unflatten(treedef, leaves):
    """Inverse of `flatten`."""
    return optree.tree_unflatten(treedef, leaves)


def tree_map(fn: Callable, tree: Any, *rest: Any, none_is_leaf: bool = False):
    """`optree.tree_map` in shardfn's namespace."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def keystr(path: tuple) -> str:
    """JAX-style text of a key path: `['layers'][3]['w']` (namedtuple fields show as keys)."""
    return "".join(f"[{key!r}]" for key in path)


def _one_level(node: Any, none_is_leaf: bool):
    """`(children, entries, type)` of one pytree node, or None when it is a leaf."""
    if optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=none_is_leaf, namespace=NAMESPACE)):
        return None
    children, _meta, entries, _ = optree.tree_flatten_one_level(
        node, none_is_leaf=none_is_leaf, namespace=NAMESPACE
    )
    return list(children), list(entries), type(node)


def _describe(node: Any) -> str:
    if isinstance(node, dict):
        return f"a dict with keys {sorted(map(repr, node.keys()))}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of length {len(node)}"
    return f"a {type(node).__name__}"


def find_prefix_mismatch(prefix: Any, tree: Any, is_prefix_leaf: Callable[[Any], bool]):
    """First `(path, message)` where `prefix` is not a tree-prefix of `tree`, else None.

    Only used on the error path, to name the key path of a mismatch.
    """
    stack = [((), prefix, tree)]
    while stack:
        path, p, t = stack.pop()
        if is_prefix_leaf(p):
            continue
        p_level = _one_level(p, none_is_leaf=True)
        t_level = _one_level(t, none_is_leaf=False)
        if p_level is None:
            continue
        if t_level is None:
            return path, f"the spec has {_describe(p)} but the argument is {_describe(t)}"
        p_children, p_entries, p_type = p_level
        t_children, t_entries, t_type = t_level
        if p_type is not t_type and not (isinstance(p, dict) and isinstance(t, dict)):
            return path, f"the spec has {_describe(p)} but the argument has {_describe(t)}"
        if isinstance(p, dict):
            missing = [k for k in t_entries if k not in p_entries]
            extra = [k for k in p_entries if k not in t_entries]
            if missing or extra:
                detail = []
                if missing:
                    detail.append(f"missing key(s) {missing}")
                if extra:
                    detail.append(f"extra key(s) {extra}")
                return path, f"the spec dict has {' and '.join(detail)} compared to the argument"
            t_by_key = dict(zip(t_entries, t_children))
            t_children = [t_by_key[k] for k in p_entries]
        elif len(p_entries) != len(t_entries):
            return path, f"the spec has {_describe(p)} but the argument has {_describe(t)}"
        for entry, pc, tc in reversed(list(zip(p_entries, p_children, t_children))):
            stack.append((path + (entry,), pc, tc))
    return None


def broadcast_prefix(prefix: Any, tree: Any, *, what: str, is_prefix_leaf: Callable[[Any], bool]):
    """Broadcast a spec tree `prefix` to the leaves of `tree`; a path-naming error on mismatch.

    Args:
      prefix: a tree whose leaves (per `is_prefix_leaf`, `None` included) apply to whole
        subtrees of `tree`.
      tree: the argument tree (its `None`s are empty nodes).
      what: how the message names the prefix, e.g. ``"in_specs"``.

    Returns:
      The list of prefix leaves, one per leaf of `tree` in flatten order.

    Raises:
      SpecError: naming the key path where `prefix` is not a prefix of `tree`.
    """
    mismatch = find_prefix_mismatch(prefix, tree, is_prefix_leaf)
    if mismatch is not None:
        path, message = mismatch
        raise SpecError(
            f"{what} is not a pytree prefix of the arguments: at {what}{keystr(path)}, {message}.\n"
            f"Fix: give {what} the same structure as the arguments down to where one spec "
            f"applies to a whole subtree (a single spec, e.g. P(), applies to everything below it)."
        )
    paths, _, _ = flatten_with_paths(tree)
    return [_prefix_leaf(prefix, path, is_prefix_leaf) for path in paths]


def _prefix_leaf(prefix: Any, path: tuple, is_prefix_leaf: Callable[[Any], bool]):
    """The prefix leaf that covers the tree leaf at `path` (matched by key, not position)."""
    node = prefix
    for key in path:
        if node is None or is_prefix_leaf(node) or _one_level(node, none_is_leaf=True) is None:
            break  # a spec, or a leaf that is not one (the caller's validation names it)
        node = node[key]
    return node
