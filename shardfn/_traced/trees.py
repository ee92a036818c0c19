"""Trees in the traced step: flat across the graph's boundary, plain containers inside.

[Note: trees in the graph]
Dynamo traces optree through polyfills, which fail on some dicts ("SourcelessBuilder does
not know how to wrap optree.registry.DictMetaData", seen on sf.functional's GPT tree). So
trees cross the graph's boundary as flat leaf lists (flattened and rebuilt outside), the
params tree is rebuilt inside from a skeleton of plain containers (`fill`), and the
optimizer runs on a *list* of leaves, whose state has the same leaves in the same order as
the state of the user's tree (optree flattens a dict in key order, a list in order); it is
rebuilt inside with the list structure and flattened back.
"""

from __future__ import annotations

import torch

from .. import _tree
from .._errors import SpecError

__all__ = ["skeleton", "fill", "leaves_of", "list_state"]


def skeleton(treedef):
    """The params tree with each leaf replaced by its index (the same containers)."""
    return _tree.unflatten(treedef, list(range(treedef.num_leaves)))


def fill(tree, leaves: list):
    """[Note: trees in the graph] `tree` (a skeleton) with leaf i replaced by `leaves[i]`."""
    if tree is None:
        return None
    if isinstance(tree, int):
        return leaves[tree]
    if isinstance(tree, dict):
        return {key: fill(value, leaves) for key, value in tree.items()}
    if isinstance(tree, list):
        return [fill(value, leaves) for value in tree]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(fill(value, leaves) for value in tree))
    if isinstance(tree, tuple):
        return tuple(fill(value, leaves) for value in tree)
    raise SpecError(f"sf.jit: params hold a {type(tree).__name__} node; the traced step rebuilds dicts, lists "
                    f"and tuples.\nFix: use those containers, or train eagerly with sf.train_step(step, opt).")


def leaves_of(tree, out: list) -> list:
    """optree's leaf order (dicts by sorted key, None an empty node) by plain recursion."""
    if tree is None:
        return out
    if isinstance(tree, dict):
        for key in sorted(tree):
            leaves_of(tree[key], out)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            leaves_of(value, out)
    else:
        out.append(tree)
    return out


def list_state(opt, plan):
    """The tree structure of `opt`'s state over a *list* of the shard leaves: [Note: trees
    in the graph]."""
    like = [torch.empty(layout.shape if not layout.sharded else (0,) + layout.shape[1:], dtype=layout.dtype,
                        device="meta") for layout in plan.leaves]
    return _tree.flatten(opt.init(like))[1]
