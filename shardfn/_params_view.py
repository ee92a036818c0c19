"""The params-view protocol: a read-only view of a parameter tree whose leaves are
fetched on first access, and the `together` scope that groups such reads.

`sf.shard` hands its `loss_fn` a view (`make_view`) instead of the full parameters:
indexing down to a leaf asks the resolver for it, which all-gathers that leaf's unit on
first use (`shardfn/_fsdp/runtime.py`, which also reads `current_scope`). Mapping and
sequence access work (`params["layers"][3]["w"]`, `len`, iteration, `.items()`), so a
unit's sub-dict can go straight into `torch.func.functional_call`.

The code that consumes a view without knowing who made it imports this module, never
`_fsdp/`: `sf.functional` reads a block's leaves inside `together`; `sf.remat` and
`sf.pipeline` `materialize` a view into plain containers. Nothing here gathers anything.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from . import _tree

__all__ = ["ParamsView", "make_view", "materialize", "together", "current_scope"]

_scopes = threading.local()


class together:
    """Leaves read inside this block are read together: their units do not free each other
    when entered, and are gathered together again in the backward. `held=True`: the leaves
    are used through the whole forward (a module's root parameters), so their units stay
    gathered until their backward ([Note: units used again later in the forward] in
    _fsdp/runtime.py)."""

    def __init__(self, held: bool = False):
        self.held = held

    def __enter__(self):
        self.previous = getattr(_scopes, "current", None)
        _scopes.current = self
        return self

    def __exit__(self, *exc):
        _scopes.current = self.previous


def current_scope():
    """The innermost `together` block of this thread, or None."""
    return getattr(_scopes, "current", None)


class _Leaf:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class ParamsView:
    """Base of the view containers; `resolve(index)` returns the full leaf."""

    __slots__ = ("_node", "_resolve")

    def __init__(self, node, resolve: Callable[[int], Any]):
        self._node = node
        self._resolve = resolve

    def _wrap(self, child):
        if isinstance(child, _Leaf):
            return self._resolve(child.index)
        if isinstance(child, Mapping):
            return ViewDict(child, self._resolve)
        if isinstance(child, (list, tuple)):
            return ViewList(child, self._resolve)
        return child

    def find(self, path: tuple):
        """The full leaf at `path` below this view (resolved), or None when there is no leaf
        there; no view is made for the levels in between."""
        node = self._node
        for key in path:
            if isinstance(node, Mapping):
                if key not in node:
                    return None
            elif isinstance(node, (list, tuple)):
                if not (isinstance(key, int) and -len(node) <= key < len(node)):
                    return None
            else:
                return None
            node = node[key]
        return self._resolve(node.index) if isinstance(node, _Leaf) else None

    def __setitem__(self, key, value):
        raise TypeError(
            "the params seen by a shard loss_fn are a read-only view of the gathered parameters; "
            "build a new dict instead of assigning into it"
        )


class ViewDict(ParamsView, Mapping):
    __slots__ = ()

    def __getitem__(self, key):
        return self._wrap(self._node[key])

    def __iter__(self):
        return iter(self._node)

    def __len__(self):
        return len(self._node)

    def __repr__(self):
        return f"ParamsView({{{', '.join(repr(k) for k in self._node)}}})"


class ViewList(ParamsView, Sequence):
    __slots__ = ()

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._wrap(c) for c in self._node[index]]
        return self._wrap(self._node[index])

    def __len__(self):
        return len(self._node)

    def __repr__(self):
        return f"ParamsView(<sequence of {len(self._node)}>)"


def make_view(treedef, num_leaves: int, resolve: Callable[[int], Any]):
    """The view of a tree of `num_leaves` leaves with structure `treedef`."""
    skeleton = _tree.unflatten(treedef, [_Leaf(i) for i in range(num_leaves)])
    return ParamsView(None, resolve)._wrap(skeleton)


def materialize(tree):
    """`tree` with every ParamsView in it replaced by plain dicts / lists of the full leaves
    (gathering their units now); other values unchanged."""
    if isinstance(tree, ParamsView):
        return _tree.tree_map(lambda leaf: tree._resolve(leaf.index), tree._node)
    if isinstance(tree, (list, tuple)) and any(isinstance(x, ParamsView) for x in tree):
        items = [materialize(x) for x in tree]
        return type(tree)(items) if type(tree) in (list, tuple) else type(tree)(*items)
    if isinstance(tree, dict) and any(isinstance(x, ParamsView) for x in tree.values()):
        return {k: materialize(v) for k, v in tree.items()}
    return tree

